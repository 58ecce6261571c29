"""Project errors: each names the file, path or option at fault, so the CLI can print it in one line.

Errors that refine a builtin also subclass it (a missing path is a FileNotFoundError, a corrupt blob an
OSError), so callers that already handle the builtin keep working. Each carries the errno a file system
answers for it (`fuse_errno`), so the mount translates any of them without a table of its own.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import TextIO

# The command line's exit statuses besides 0 (and 128 + a signal's number, for serve's ranks).
EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's, for a command line it cannot parse
EXIT_DOES_NOT_FIT = 3  # `fanstore plan` and --fit: distinct from an error, so a batch script can try more nodes
EXIT_INTERRUPTED = 130


# The errors a caller may catch, importable from `fanstore` too (the helpers below are fanstore's own).
__all__ = [
    "ChunkCorrupt",
    "ChunkError",
    "ChunkUnavailable",
    "DatasetNotFound",
    "DoesNotFit",
    "FanstoreError",
    "FormatError",
    "IsADirectory",
    "NotADirectory",
    "NotASymlink",
    "PackError",
    "PathNotFound",
    "SymlinkLoop",
    "UsageError",
]


class FanstoreError(Exception):
    """Base of every error fanstore raises on purpose; the CLI prints its message and exits non-zero."""

    fuse_errno = errno.EIO

    def __str__(self) -> str:
        # OSError subclasses would print "[Errno 5] ..." when built with an errno; ours print the message only.
        return str(self.args[0]) if self.args else self.__class__.__name__


class UsageError(FanstoreError, ValueError):
    """A command-line option or API argument has a value fanstore cannot use."""

    fuse_errno = errno.EINVAL


class SeekRefused(UsageError, OSError):
    """A seek an open dataset file refuses (before its start, an unknown whence): an OSError (EINVAL) as a real
    file's seek raises, and a ValueError as io.BytesIO's, so code written for either keeps working on it (zipfile
    tells a short file from a zip by catching OSError from a seek before the start)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.EINVAL


class DoesNotFit(UsageError):
    """--fit cannot be met: the dataset (or one node's share) would not fit in the capacity given. The CLI exits
    with its own status for it, as `fanstore plan` does, so a batch script can try more nodes."""


class FormatError(FanstoreError, OSError):
    """A dataset file is not in a format this version can read (bad magic, unknown version, a field out of range)."""


class DatasetNotFound(FanstoreError, FileNotFoundError):
    """The directory given as a dataset holds no complete fanstore index."""

    fuse_errno = errno.ENOENT


class PathNotFound(FanstoreError, FileNotFoundError):
    """A path asked of a dataset is not in it."""

    fuse_errno = errno.ENOENT


class IsADirectory(FanstoreError, IsADirectoryError):
    """File contents were asked of a directory."""

    fuse_errno = errno.EISDIR


class NotADirectory(FanstoreError, NotADirectoryError):
    """A listing was asked of something that is not a directory."""

    fuse_errno = errno.ENOTDIR


class NotASymlink(FanstoreError, OSError):
    """A link target was asked of something that is not a symbolic link."""

    fuse_errno = errno.EINVAL


class SymlinkLoop(FanstoreError, OSError):
    """Following symbolic links went round more than the kernel's limit of hops."""

    fuse_errno = errno.ELOOP


class ChunkError(FanstoreError, OSError):
    """A file's stored bytes could not be had or were wrong; only the files of the named chunk are affected."""

    def __init__(self, message: str, path: str = "", chunk_id: int = -1) -> None:
        super().__init__(message)
        self.path = path
        self.chunk_id = chunk_id


class ChunkCorrupt(ChunkError):
    """The stored bytes are wrong: a checksum mismatch, a blob that does not decode, a chunk file whose header or
    size is not what the index says. Reading again will not help; packing again will."""


class ChunkUnavailable(ChunkError):
    """The stored bytes cannot be had now: a chunk file missing or unreadable (EIO, permissions, too many open
    files), a closed dataset, a peer that does not answer. The bytes may well be fine; a later read may work."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, which the command line turns into an interrupt as Ctrl-C's: `fanstore serve` exits 128 + SIGTERM for
    it, as a job's ranks report a signal, where the other commands say "interrupted" (130) for either."""


class PackError(FanstoreError):
    """The pack cannot go on (disk full, DEST unusable, SRC changed); what is done stays resumable."""


def fuse_errno_of(exc: BaseException) -> int:
    """The errno a file system request should fail with for `exc`: the error's own for fanstore errors and OS
    errors, ENOMEM for MemoryError, EIO for anything else (a bug, a crafted field that slipped through)."""
    if isinstance(exc, FanstoreError):
        return exc.fuse_errno
    if isinstance(exc, MemoryError):
        return errno.ENOMEM
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


QUOTE_LIMIT = 200  # characters of user text an error message shows


def quoted(text: object) -> str:
    """User text as an error message shows it (an option's value, a path, a line of a file, a field of a crafted
    index): quoted as repr quotes it, and past QUOTE_LIMIT characters cut, with an ellipsis and its full length. A
    50 MB line echoed whole was 50 MB of output from every rank; cut, it is one readable line."""
    if isinstance(text, os.PathLike):
        text = os.fspath(text)
    if not isinstance(text, (str, bytes)):  # a field of a crafted index: a list, a number, None
        shown = repr(text)
        return shown if len(shown) <= QUOTE_LIMIT else f"{shown[:QUOTE_LIMIT]}... ({len(shown):,} characters)"
    if len(text) <= QUOTE_LIMIT:
        return repr(text)
    head = repr(text[:QUOTE_LIMIT])  # the head alone: the whole may be huge, and escapes stay whole
    unit = "bytes" if isinstance(text, bytes) else "characters"
    return f"{head[:-1]}...{head[-1]} ({len(text):,} {unit})"


PATH_SHOWN_WHOLE = 1024  # characters of a path a message shows whole: deep real trees stay named in full
PATH_ENDS_SHOWN = 60  # characters of each end of a longer path that a message shows


def shown_path(path: str) -> str:
    """A path from SRC or the dataset as a message shows it: as it is where it reads so unambiguously (every
    character prints, no space at either end), else quoted as `quoted` quotes it. A name may hold a newline, a
    terminal's escape or a trailing space: shown bare, it split a one-line error in two, recoloured the terminal,
    or hid. Plain paths stay bare, so `BAD train/a.png: ...` reads as before.

    Past PATH_SHOWN_WHOLE characters a path is cut to its first and last PATH_ENDS_SHOWN, each shown by the same
    rule, with its length in bytes: an archive member's path of 4,100 bytes (refused past PATH_MAX) made a
    4,100-character warning line; its ends say where it was and which file."""
    if len(path) > PATH_SHOWN_WHOLE:
        head, tail = path[:PATH_ENDS_SHOWN], path[-PATH_ENDS_SHOWN:]
        try:
            length = len(path.encode("utf-8", "surrogateescape"))  # a name's undecodable bytes count one each
        except UnicodeEncodeError:
            length = len(path.encode("utf-8", "surrogatepass"))
        if path.isprintable() and path.strip() == path:
            return f"{head}...{tail} ({length:,} bytes)"
        return f"{head!r}...{tail!r} ({length:,} bytes)"
    if path.isprintable() and path.strip() == path:
        return path
    return quoted(path)


def shell_word(path: str | os.PathLike[str]) -> str:
    """A path as a command a message suggests must write it to run as pasted: quoted for the shell where it holds a
    space or a quote (`fanstore umount my mnt` unmounted nothing), and a relative one that starts with '-' led by
    './' (`fanstore umount -mnt` was an unknown option)."""
    text = os.fspath(path)
    if text.startswith("-"):
        text = "./" + text
    import shlex  # here, not above: __main__ imports this module first, before anything else loads

    return shlex.quote(text)


def one_line(text: str) -> str:
    """`text` made one line: each character that does not print (a newline, a tab, a terminal's escape) written as
    repr writes it. A message names paths as given, and one whose name held a newline split an error in two, of
    which a background mount's daemon, handing its error up as one line, kept only the first."""
    if text.isprintable():
        return text
    return "".join(character if character.isprintable() else repr(character)[1:-1] for character in text)


def say_line(text: str, stream: TextIO | None = None) -> None:
    """Print one line (to stderr unless told) in a single write. print() writes the text and its newline separately,
    and under mpiexec the lines of several ranks writing at once then run together on one line."""
    stream = stream or sys.stderr
    stream.write(one_line(text) + "\n")
    stream.flush()
