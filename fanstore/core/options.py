"""An option written once: its default is the options dataclass field's, its flag, metavar and help are the field's
metadata (`option`), and the class's __post_init__ checks its value, naming the flag, whoever built it. cli.py adds
the argument from the field (`add_option`), commands.py builds the options from what was parsed (`from_args`).

This module imports argparse and dataclasses only, so the light options modules (mount/options.py,
serve/options.py, pack/options.py) that use it keep the command line's parse free of FUSE, MPI and the packer.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

_KEY = "fanstore.option"


@dataclass(frozen=True, slots=True)
class Option:
    """A field's command line: `flag` (a bool field that is True unless the flag is given takes a flag such as
    --no-keep-cache), `help` ("{default}" in it is replaced by `show(default)`), `metavar`, and how a value given is
    read: `type` (argparse's, for int and float) or `parse(text, flag)` (sizes, rates: their errors name the flag,
    and are the command's one-line errors, not usage errors). `show` None: the help names no default (not giving
    the option is a state of its own, as no --fit is no capacity)."""

    flag: str
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    parse: Callable[[str, str], Any] | None = None
    show: Callable[[Any], str] | None = str
    required: bool = False


def option(default: Any = dataclasses.MISSING, *, flag: str, help: str, metavar: str | None = None,
           type: Callable[[str], Any] | None = None, parse: Callable[[str, str], Any] | None = None,
           show: Callable[[Any], str] | None = str, required: bool = False) -> Any:
    """A dataclass field that is also a command-line option (see Option)."""
    return dataclasses.field(default=default, metadata={_KEY: Option(flag, help, metavar, type, parse, show,
                                                                      required)})


def option_of(field: dataclasses.Field) -> Option | None:
    """The field's command line, or None if it has none (a setting for Python callers only)."""
    return field.metadata.get(_KEY)


def cli_fields(cls: type) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of options class `cls` that are command-line options, in their order."""
    return [(field, found) for field in dataclasses.fields(cls) if (found := option_of(field)) is not None]


def flag_of(cls: type, name: str) -> str:
    """The flag of field `name` of options class `cls`: how its errors name it."""
    return _option(cls, name).flag


def default_of(defaults: Any, name: str) -> Any:
    """The default of field `name`: `defaults`'s value when it is an options object (serve's mount options), else
    the class's field default (None when the field has none: it is required)."""
    if not isinstance(defaults, type):
        return getattr(defaults, name)
    default = _field(defaults, name).default
    return None if default is dataclasses.MISSING else default


def help_of(defaults: Any, name: str, help: str | None = None) -> str:
    """The help of field `name`, or `help` (a command's own wording of it), its {default} filled in (escaped for
    argparse, which %-formats help)."""
    found = _option(_class(defaults), name)
    text = found.help if help is None else help
    if "{default}" in text and found.show is not None:
        text = text.replace("{default}", found.show(default_of(defaults, name)).replace("%", "%%"))
    return text


def add_option(parser: argparse.ArgumentParser, defaults: Any, name: str, help: str | None = None,
               more: str = "") -> None:
    """Add field `name` of the options class (or object) `defaults` to `parser`: flag, metavar and help from its
    metadata, its default from `defaults`: a bool field is a flag that turns it over, a tuple field a repeatable
    option. A value read by `parse` stays text (None when not given) until from_args reads it. `more` ends the
    help with what only this command says."""
    found = _option(_class(defaults), name)
    default = default_of(defaults, name)
    keywords: dict[str, Any] = {"dest": name, "help": help_of(defaults, name, help) + more}
    if isinstance(default, bool):
        keywords["action"] = "store_false" if default else "store_true"
    elif isinstance(default, tuple):  # repeatable: each use adds one
        keywords.update(action="append", metavar=found.metavar, default=None)
    else:
        keywords.update(metavar=found.metavar, default=None if found.parse else default)
        if found.type is not None:
            keywords["type"] = found.type
        if found.required:
            keywords["required"] = True
    parser.add_argument(found.flag, **keywords)


def from_args(defaults: Any, args: argparse.Namespace, **fixed: Any) -> Any:
    """The options object for what the command line gave: each option added by add_option taken from `args` (read
    by its `parse`, in field order, when given), the rest from `defaults`, and `fixed` (the arguments, the options
    objects within); checked by the class."""
    cls = _class(defaults)
    values = {field.name: value_of(defaults, args, field.name) for field, _ in cli_fields(cls)
              if field.name not in fixed and hasattr(args, field.name)}
    if not isinstance(defaults, type):
        return dataclasses.replace(defaults, **values, **fixed)
    return cls(**values, **fixed)


def value_of(defaults: Any, args: argparse.Namespace, name: str) -> Any:
    """The value of field `name` as the command line gave it (read by its `parse`), else its default."""
    found, value = _option(_class(defaults), name), getattr(args, name)
    if value is None and (found.parse is not None or isinstance(default_of(defaults, name), tuple)):
        return default_of(defaults, name)
    if isinstance(value, list):
        return tuple(value)
    return found.parse(value, found.flag) if found.parse is not None else value


def given(defaults: Any, args: argparse.Namespace, name: str) -> bool:
    """Whether the command line gave field `name` a value other than its default (as text, a value written as the
    help shows the default counts as the default)."""
    found, value, default = _option(_class(defaults), name), getattr(args, name), default_of(defaults, name)
    if found.parse is None:
        return value != default
    return value is not None and (found.show is None or value != found.show(default))


def _class(defaults: Any) -> type:
    return defaults if isinstance(defaults, type) else type(defaults)


def _option(cls: type, name: str) -> Option:
    found = option_of(_field(cls, name))
    if found is None:
        raise KeyError(f"{cls.__name__}.{name} is no command-line option")
    return found


def _field(cls: type, name: str) -> dataclasses.Field:
    for field in dataclasses.fields(cls):
        if field.name == name:
            return field
    raise KeyError(f"{cls.__name__} has no field {name!r}")
