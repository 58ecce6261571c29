"""Where every fanstore process starts: `python -m fanstore` and the console scripts (`fanstore`, `fanstore-pack`).

The command line imports numpy, the codecs and the commands, a quarter of a second and more on a busy node; a
Ctrl-C then would be a KeyboardInterrupt out of an import, a traceback. Here, where nothing is imported yet but the
errors (see `fanstore/__init__.py`), that import and the parsing of the command line are guarded: an interrupt
during them ends as every other does, in one line and status 130."""

from __future__ import annotations

import os
import signal
import sys
from typing import Sequence

from .errors import EXIT_INTERRUPTED, say_line


def _usable_streams() -> None:
    """Streams every command can write to. The null device where the caller closed stdin, stdout or stderr (`2>&-`):
    Python then has no sys.stderr, and a pack failed on its progress bar's first write, with no word and its dataset
    unfinished; and the next file opened took the closed number, where a child or a library that writes to stderr
    would write into it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    # A name stdout's encoding cannot write (a Latin-1 or ASCII locale) is escaped, as stderr escapes it, where a
    # strict stdout ended `fanstore verify` in a UnicodeEncodeError at the first BAD line naming one.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def _started(prog: str, entry: str, argv: Sequence[str] | None) -> int:
    """Run the command line's `entry`; an interrupt it does not answer itself (in its imports, or while it parses
    the command line) ends in one line."""
    _usable_streams()
    try:
        # SIGINT waits while the command line imports, and builds its parser, which imports what the options need
        # (numpy with the pack's): broken off, a C extension's import (numpy's, datetime's) fails as an
        # ImportError, not an interrupt. Let through after, it is a KeyboardInterrupt here.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            from . import cli

            parser = cli.PARSERS[entry]()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return int(getattr(cli, entry)(argv, parser))
    except KeyboardInterrupt:
        say_line(f"{prog}: interrupted")
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """`fanstore`."""
    return _started("fanstore", "main", argv)


def pack_main(argv: Sequence[str] | None = None) -> int:
    """`fanstore-pack`."""
    return _started("fanstore-pack", "pack_main", argv)


if __name__ == "__main__":
    sys.exit(main())
