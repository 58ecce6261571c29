"""Writes that survive a crash and say what failed: a file appears under its name only whole and synced, and an
OS error while writing names the file (a failed write or fsync, ENOSPC say, does not say which file it was)."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import Iterable, Iterator

PARTIAL_SUFFIX = ".partial"


def write_atomically(path: Path, data: bytes | bytearray | memoryview | mmap.mmap | Iterable[bytes]) \
        -> tuple[os.stat_result, os.stat_result]:
    """`data` (bytes, or pieces written one after another, so that the whole is never held at once) in `path`,
    written under a temporary name, synced, renamed, and the rename synced: a reader (or a resumed pack) sees the
    whole file or none. Returns the written file's identity before and after the rename,
    taken from the open file, not by name (the rename may change its ctime; a write between them, its size or
    mtime). A write that fails (a full disk) removes what it wrote; one killed leaves it under partial_of(path)."""
    partial = partial_of(path)
    with naming_the_file(partial):
        # What stands at the temporary name (left by a write that was killed, or put there) is replaced, never
        # written through: a link there to another file (DEST's index, say) had that file truncated and rewritten.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            with open(descriptor, "wb") as out:
                if isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)):
                    out.write(data)
                else:
                    for piece in data:
                        out.write(piece)
                out.flush()
                os.fsync(out.fileno())
                written = os.fstat(out.fileno())
                os.replace(partial, path)
                renamed = os.fstat(out.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        fsync_dir(path.parent)
    return written, renamed


def partial_of(path: Path) -> Path:
    """The name write_atomically writes `path` under until it is whole."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


@contextlib.contextmanager
def naming_the_file(path: Path) -> Iterator[None]:
    """An OSError raised inside names `path` if it named no file itself."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
