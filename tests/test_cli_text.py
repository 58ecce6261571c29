"""What the CLI's help and messages say is what the code does: each claim that was once wrong is checked here
against the behaviour it describes, through the real CLI."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error, make_tree, run_cli
from fanstore import open_dataset
from fanstore.mount.fuse_ops import INLINE_DECODE_BYTES
from fanstore.core.info import SKIPPED_SHOWN

CHUNK_SIZE = 4096


def _help(*command: str) -> str:
    """A command's --help, its lines joined (argparse wraps them at the terminal's width)."""
    return " ".join(run_cli(*command, "--help", check=True).stdout.split())


def test_chunk_size_bounds_chunks_of_stored_blobs_not_files(tmp_path: Path) -> None:
    """--chunk-size speaks of blobs: a chunk holding several is at most SIZE, a blob larger than SIZE is alone in
    its chunk, and a file larger than SIZE stored in blocks is spread over chunks (it does not get one)."""
    assert "next stored blob (a file stored whole, or one block) would take it past SIZE" in _help("pack")
    assert "a blob larger than SIZE gets a chunk of its own" in _help("pack")
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    src.mkdir()
    for number in range(12):
        (src / f"row_{number:02d}.txt").write_text(" ".join(map(str, rng.integers(0, 99, 300))))
    (src / "whole.bin").write_bytes(rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    (src / "blocks.bin").write_bytes(rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(src), str(dest), "--codec", "zstd:3", "--chunk-size", str(CHUNK_SIZE),
            "--block-size", "4KiB", "--blocks-above", "12KiB", "--workers", "1", "--quiet", check=True)
    with open_dataset(dest) as ds:
        chunks = ds.index.chunks
        assert (chunks["size"][chunks["files"] > 1] <= CHUNK_SIZE).all() and (chunks["files"] > 1).any()
        whole = ds.index.lookup("whole.bin")
        assert int(ds.index.entries["stored_len"][whole]) > CHUNK_SIZE
        assert chunks["files"][int(ds.index.entries["chunk"][whole])] == 1
        blocked = ds.index.block_rows(ds.index.lookup("blocks.bin"))
        assert len(set(ds.index.blocks["chunk"][blocked.start : blocked.stop].tolist())) > 1


def test_prefetch_help_names_the_size_below_which_nothing_is_prefetched() -> None:
    """Prefetch skips blobs stored in fewer than --prefetch-min-size bytes (the mount's default, fuse_ops'
    INLINE_DECODE_BYTES; test_mount checks the behaviour); both commands' --prefetch help says so."""
    assert INLINE_DECODE_BYTES == 256 << 10
    mount_help = _help("mount")
    assert "decode ahead those of the next N files (in --prefetch-list order, else directory order) stored in at " \
           "least --prefetch-min-size bytes" in mount_help
    assert "--prefetch-min-size SIZE prefetch only files stored in at least SIZE bytes (default 256KiB" in mount_help
    assert "the next N files that are stored on another node or in at least 256KiB" in _help("serve")


def _make_fifos(src: Path, count: int) -> list[str]:
    (src / "pipes").mkdir(parents=True)
    for number in range(count):
        os.mkfifo(src / "pipes" / f"fifo_{number:03d}")
    (src / "data.txt").write_text("kept\n")
    return [f"pipes/fifo_{number:03d}" for number in range(count)]


def test_every_skipped_path_is_listed_or_counted_with_how_to_list_them(tmp_path: Path) -> None:
    """The pack warns of 20 and `fanstore info` lists 50; each says how many more and names the command that lists
    every one, and that command does."""
    count = SKIPPED_SHOWN + 10
    fifos = _make_fifos(tmp_path / "src", count)
    dest = tmp_path / "ds"
    packed = run_cli("fanstore-pack", str(tmp_path / "src"), str(dest), "--quiet", check=True)
    command = f"`fanstore info {dest} --all-skipped`"
    warnings = [line for line in packed.stderr.splitlines() if line.startswith("warning:")]
    assert warnings[-1] == f"warning: ... and {count - 20} more skipped ({command} lists them all)"
    assert len(warnings) == 21 and f"{count} skipped" in packed.stdout

    def listed(output: str) -> list[str]:
        return [line.split(":")[0].strip() for line in output.splitlines() if line.startswith("  pipes/")]

    info = run_cli("info", str(dest), check=True).stdout
    assert f"skipped      {count} paths:" in info
    assert listed(info) == fifos[:SKIPPED_SHOWN]
    assert f"  ... and {count - SKIPPED_SHOWN} more: {command} lists them all" in info.splitlines()
    every = run_cli("info", str(dest), "--all-skipped", check=True).stdout
    assert listed(every) == fifos and "more:" not in every


COMMANDS = ("pack", "select", "verify", "info", "plan", "mount", "umount", "demo", "serve")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser the CLI builds, by the command line that shows its --help."""
    from fanstore.cli import _build_parser

    main_parser = _build_parser()
    subparsers = next(action for action in main_parser._actions if isinstance(action, argparse._SubParsersAction))
    return {"fanstore": main_parser, **{f"fanstore {name}": parser for name, parser in subparsers.choices.items()}}


def test_every_command_is_described_and_every_argument_explained() -> None:
    parsers = _parsers()
    assert set(parsers) == {"fanstore", *(f"fanstore {name}" for name in COMMANDS)}
    for prog, parser in parsers.items():
        assert parser.description and len(parser.description.split()) >= 12, prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), prog
            elif action.help != argparse.SUPPRESS:
                assert action.help and len(action.help.split()) >= 3, (prog, action.option_strings or action.dest)


@pytest.mark.parametrize("command", [("fanstore-pack",), (), *((name,) for name in COMMANDS)],
                         ids=lambda command: " ".join(command) or "fanstore")
def test_every_help_has_a_description_its_exit_statuses_and_an_example(command: tuple[str, ...]) -> None:
    shown = run_cli(*command, "--help", check=True).stdout
    prog = "fanstore-pack" if command == ("fanstore-pack",) else " ".join(("fanstore", *command))
    description = shown.split("\n\n")[1]
    assert not description.startswith(("positional", "options")) and len(description.split()) >= 12, shown
    statuses = shown.split("\nexit status:\n")[1].split("\n\n")[0]
    codes = [line.split()[0] for line in statuses.splitlines() if line.startswith("  ") and line[2] != " "]
    assert codes[:3] == ["0", "1", "2"], statuses  # then the command's own, if any
    example = shown.split("\nexample:\n")[1].strip().splitlines()
    launcher = "srun --ntasks-per-node=1 " if command == ("serve",) else ""
    assert len(example) == 1 and example[0].startswith(launcher + prog + " "), example


def test_exit_statuses_in_help_are_the_codes_the_cli_returns() -> None:
    """The statuses a help names beyond 0, 1 and 2 are the CLI's own constants."""
    from fanstore.errors import EXIT_DOES_NOT_FIT, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE

    assert (EXIT_FAILURE, EXIT_USAGE, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED) == (1, 2, 3, 130)
    for command in ("plan", "select", "pack"):
        assert f"{EXIT_DOES_NOT_FIT} --fit" in _help(command) or f"{EXIT_DOES_NOT_FIT} the fullest" in _help(command)
    assert run_cli("plan", "--nodes", "2").returncode == EXIT_USAGE  # argparse: DEST missing


@pytest.mark.parametrize("command", ["mount", "info", "serve", "pack"])
def test_an_unknown_option_is_said_with_the_commands_own_usage(command: str) -> None:
    """Status 2's "a usage message says how": `fanstore mount --bogus a b` printed `usage: fanstore [-h]
    [--version] COMMAND ...`, which names none of mount's options."""
    required = ["--local-dir", "d"] if command == "serve" else []
    proc = run_cli(command, "--bogus", "a", "b", *required)
    assert proc.returncode == 2, proc.stderr
    usage = "mpiexec -n N fanstore serve" if command == "serve" else f"fanstore {command} [-h]"
    assert proc.stderr.startswith(f"usage: {usage}"), proc.stderr
    assert f"\nfanstore {command}: error: unrecognized arguments: --bogus" in proc.stderr, proc.stderr


def _pyproject_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as pyproject:
        return tomllib.load(pyproject)["project"]["version"]


def test_version() -> None:
    version = _pyproject_version()
    assert run_cli("--version", check=True).stdout == f"fanstore {version}\n"
    assert run_cli("fanstore-pack", "--version", check=True).stdout == f"fanstore-pack {version}\n"


def test_the_version_falls_back_on_pyproject_outside_an_installation(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from fanstore.cli import package_version

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert package_version() == _pyproject_version()


def test_one_codec_grammar_in_help_readme_and_errors(tmp_path: Path) -> None:
    """The grammar is written once (compressors.registry): --help shows it whole, README.md verbatim, and the error
    for a bad spec the line of the codec it names, or every form: each is in --help, word for word."""
    from compressors.registry import SPEC_FORMS, codec_grammar

    grammar = codec_grammar()
    assert grammar in (REPO / "README.md").read_text()
    for command in (("fanstore-pack",), ("pack",)):
        shown = run_cli(*command, "--help", check=True).stdout
        assert "\n".join(f"  {line}" for line in grammar.splitlines()) in shown
    help_words = " ".join(_help("fanstore-pack").split())
    for spec, codec in (("zstd:99", "zstd"), ("lz4:hc:x", "lz4"), ("blosc:lz4", "blosc"), ("gzip:9", None)):
        failed = run_cli("fanstore-pack", str(tmp_path), str(tmp_path / "ds"), "--codec", spec)
        assert_one_line_error(failed, "--codec: ", repr(spec))
        error = " ".join(failed.stderr.split())
        named = [SPEC_FORMS[codec]] if codec else list(SPEC_FORMS.values())
        for form, meaning in named:
            assert form in error and form in help_words, (form, error)
            if codec:
                assert f"expected {form}: {meaning}" in error and " ".join(meaning.split()) in help_words
        assert not (tmp_path / "ds").exists()


def _option_tables() -> list[tuple[str, object]]:
    """Each command and the options class (or, where the command gives other defaults, the options object) whose
    fields it takes as options."""
    from fanstore.mount.options import MountOptions
    from fanstore.pack.options import PackOptions
    from fanstore.serve.options import SERVE_MOUNT, PeerOptions, ServeOptions

    return [("fanstore mount", MountOptions), ("fanstore serve", PeerOptions), ("fanstore serve", ServeOptions),
            ("fanstore serve", SERVE_MOUNT), ("fanstore pack", PackOptions), ("fanstore select", PackOptions)]


def test_every_option_field_is_in_help_with_its_default() -> None:
    """An options dataclass is where each option is written: every field with a command line is some command's
    option, with the dataclass's default as the parser's (or, for a value read on its own, the one it stands for)
    and that default said in its help, in the words --help shows."""
    from fanstore.core.options import cli_fields, default_of

    parsers, shown, seen = _parsers(), {}, set()
    for prog, defaults in _option_tables():
        cls = defaults if isinstance(defaults, type) else type(defaults)
        if prog not in shown:
            shown[prog] = _help(*prog.split()[1:])
        actions = {action.dest: action for action in parsers[prog]._actions}
        for field, option in cli_fields(cls):
            action = actions.get(field.name)
            if action is None or option.flag not in action.option_strings:
                continue
            seen.add((cls.__name__, field.name))
            default = default_of(defaults, field.name)
            assert action.help and action.help != argparse.SUPPRESS, (prog, option.flag)
            metavar = action.metavar or ("" if action.nargs == 0 else action.dest.upper())  # as argparse shows it
            entry = " ".join(f"{option.flag} {metavar} {action.help.replace('%%', '%')}".split())
            assert entry in shown[prog], (prog, entry)
            if option.parse is None and not isinstance(default, tuple):
                assert action.default == default, (prog, option.flag, action.default, default)
            if option.show is not None and default is not None and not isinstance(default, (bool, tuple)):
                assert f"default {option.show(default)}" in entry or f"default: {option.show(default)}" in entry \
                    or f"{option.show(default)} (default" in entry, (prog, entry)
    every = {(cls.__name__, field.name) for _, defaults in _option_tables()
             for cls in [defaults if isinstance(defaults, type) else type(defaults)] for field, _ in cli_fields(cls)}
    assert every - seen == set(), "fields with a command line that no command takes"


def test_console_scripts_start_where_an_interrupt_is_answered() -> None:
    """pyproject's scripts run the guarded entry points, which import nothing heavy before their guard."""
    with open(REPO / "pyproject.toml", "rb") as pyproject:
        scripts = tomllib.load(pyproject)["project"]["scripts"]
    assert scripts == {"fanstore": "fanstore.__main__:main", "fanstore-pack": "fanstore.__main__:pack_main"}
    code = "import sys, fanstore.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', " \
           "'fanstore')))"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO).stdout
    assert shown.strip() == "['fanstore', 'fanstore.__main__', 'fanstore.errors']", shown


def _tolerated(traceback: str) -> bool:
    """A traceback fanstore cannot answer: Python's own start (its site module), or the few milliseconds in which
    the package and its entry module import what the entry points' guard needs (the errors, signal)."""
    if "Fatal Python error: init_import_site" in traceback:
        return True
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', traceback)
    ours = [(Path(name).relative_to(REPO).as_posix(), where) for name, where in frames
            if Path(name).is_relative_to(REPO)]
    before_the_guard = ("fanstore/__init__.py", "fanstore/errors.py", "fanstore/__main__.py")
    return all(name in before_the_guard and where == "<module>" for name, where in ours)


@pytest.mark.parametrize("way", ["python -m fanstore pack", "fanstore-pack"])
def test_ctrl_c_while_the_command_line_starts_is_one_line(tmp_path: Path, way: str) -> None:
    """A Ctrl-C in the first quarter second (Python importing numpy, the codecs, the commands) was a traceback out
    of an import. Now, whenever it comes, the command ends as every interrupted one does: one line and 130 (or
    done, had it finished first)."""
    src = tmp_path / "src"
    make_tree(src)
    if way == "fanstore-pack":  # as the console script runs it
        command = [sys.executable, "-c", "import sys; from fanstore.__main__ import pack_main; sys.exit(pack_main())"]
    else:
        command = [sys.executable, "-m", "fanstore", "pack"]
    command += [str(src), str(tmp_path / "ds"), "--quiet", "--force"]
    answered = 0
    for delay in [0.02 * step for step in range(18)]:
        # SIGINT as a terminal gives it: pytest run from a script in the background inherits it ignored.
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if "Traceback" in err or "Fatal Python error" in err:
            assert _tolerated(err), f"SIGINT after {delay:.2f} s:\n{err}"
            continue
        assert proc.returncode in (0, 130, -signal.SIGINT), (delay, proc.returncode, err)
        if proc.returncode == 130:
            answered += 1
            assert err.count("\n") == 1 and "interrupted" in err, err
    assert answered, "no SIGINT came while the command ran: the test proved nothing"


_HELD_WHILE_BUILT = """
import signal, sys
from fanstore import cli
for entry, build in list(cli.PARSERS.items()):
    def held(build=build):
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()), "SIGINT let through"
        print("built while SIGINT waits")
        return build()
    cli.PARSERS[entry] = held
from fanstore.__main__ import main, pack_main
print(main(["info", "/nonexistent/ds"]), pack_main(["/nonexistent/src", "/nonexistent/ds"]))
"""


def test_the_parser_is_built_while_an_interrupt_waits() -> None:
    """Building the parser imports numpy (the pack's options): a Ctrl-C then, let through, broke numpy's import into
    an ImportError traceback (test_ctrl_c_while_the_command_line_starts_is_one_line, 1 run in 3 after the start-up
    moved by a few milliseconds). It is built while SIGINT waits, as the command line's import is."""
    built = subprocess.run([sys.executable, "-c", _HELD_WHILE_BUILT], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert built.returncode == 0 and "Traceback" not in built.stderr, built.stderr
    assert built.stdout == "built while SIGINT waits\n" * 2 + "1 1\n", built.stdout  # each ran: no DEST, no SRC
