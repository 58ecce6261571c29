"""core/options.py: a dataclass field that is also a command-line option, on a small options class of its own."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from fanstore import UsageError
from fanstore.core.options import add_option, cli_fields, flag_of, from_args, given, option
from fanstore.core.units import parse_size, size_option


@dataclass(frozen=True)
class Toy:
    size: int = option(4096, flag="--size", metavar="SIZE", parse=parse_size, show=size_option,
                       help="how big (default {default})")
    count: int = option(2, flag="--count", metavar="N", type=int, help="how many (default {default})")
    keep: bool = option(True, flag="--no-keep", help="drop instead of keeping")
    loud: bool = option(False, flag="--loud", help="say more than usual")
    globs: tuple[str, ...] = option((), flag="--glob", metavar="GLOB", help="repeatable pattern to match")
    python_only: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise UsageError(f"--count: must be 0 or more, got {self.count}")


def _parser(defaults: object = Toy) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy")
    for field, _ in cli_fields(Toy):
        add_option(parser, defaults, field.name)
    return parser


def test_nothing_given_is_the_dataclass_default() -> None:
    assert from_args(Toy, _parser().parse_args([])) == Toy()
    assert [field.name for field, _ in cli_fields(Toy)] == ["size", "count", "keep", "loud", "globs"]


def test_each_kind_of_option_reads_back_into_its_field() -> None:
    args = _parser().parse_args(["--size", "1MiB", "--count", "5", "--no-keep", "--loud", "--glob", "a", "--glob", "b"])
    assert from_args(Toy, args) == Toy(size=1 << 20, count=5, keep=False, loud=True, globs=("a", "b"))
    assert from_args(Toy, args, count=7).count == 7  # fixed by the caller: not read from args


def test_an_options_object_gives_the_defaults_its_help_shows() -> None:
    """A command with other defaults (serve's mount) passes an object: its values are the parser's defaults."""
    parser = _parser(Toy(size=8192, count=3))
    assert "(default 8KiB)" in parser.format_help() and "(default 3)" in parser.format_help()
    assert from_args(Toy(size=8192, count=3), parser.parse_args([])) == Toy(size=8192, count=3)


def test_a_bad_value_is_named_by_its_flag_whoever_gives_it() -> None:
    with pytest.raises(UsageError, match="^--size: cannot read"):
        from_args(Toy, _parser().parse_args(["--size", "lots"]))
    with pytest.raises(UsageError, match="^--count: must be 0 or more, got -1"):
        from_args(Toy, _parser().parse_args(["--count", "-1"]))
    with pytest.raises(UsageError, match="^--count: must be 0 or more, got -1"):
        Toy(count=-1)
    assert flag_of(Toy, "count") == "--count"
    with pytest.raises(KeyError):
        flag_of(Toy, "python_only")


def test_given_means_other_than_the_default_as_help_writes_it() -> None:
    parser = _parser()
    assert not given(Toy, parser.parse_args([]), "size")
    assert not given(Toy, parser.parse_args(["--size", "4KiB"]), "size")  # the default, as --help shows it
    assert given(Toy, parser.parse_args(["--size", "8KiB"]), "size")
    assert not given(Toy, parser.parse_args(["--count", "2"]), "count")
    assert given(Toy, parser.parse_args(["--count", "3"]), "count")
