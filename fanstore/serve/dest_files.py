"""DEST's chunk files as staging reads them: each opened once by a rank, however many spans it reads from it.

On Lustre or GPFS every open and every close is a round trip to the metadata server, the very load fanstore exists
to take off the shared file system: a rank reading a 256 MiB chunk in 8 MiB spans (blob_spans.SPAN_BYTES) would
otherwise open and close it 32 times.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Callable, Iterable

from ..core.format import chunk_file_name

MAX_OPEN = 8  # staging reads each chunk's spans in a row, two chunks at a time at most: a bound, with room to spare


def open_for_reading(path: Path) -> int:
    """A descriptor of a chunk file of DEST, which must be a regular file: opened without blocking, so that one
    replaced by a fifo does not hold the rank in open() for good (a device would give its bytes as the chunk's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


class DestChunkFiles:
    """Descriptors of DEST's chunk files, one per chunk: opened at the chunk's first read, closed once every span
    expected of it has been dealt with (read, or taken from elsewhere), or by close(). At most `max_open` are open at
    once, the least recently read closed first. A file that could not be opened is not tried again: its error is
    raised for each later span of it."""

    def __init__(self, dest: Path, max_open: int = MAX_OPEN,
                 open_file: Callable[[Path], int] = open_for_reading) -> None:
        self.dest = dest
        self._max_open = max(1, max_open)
        self._open_file = open_file
        self._left: Counter[int] = Counter()  # spans still expected, by chunk
        self._open: OrderedDict[int, int] = OrderedDict()
        self._failed: dict[int, OSError] = {}

    def path(self, chunk: int) -> Path:
        return self.dest / chunk_file_name(chunk)

    def expect(self, chunks: Iterable[int]) -> None:
        """The chunk of each span that may be read from here (a chunk once a span), so that each chunk's file is
        closed after its last span."""
        self._left.update(chunks)

    def read(self, chunk: int, start: int, length: int) -> bytes:
        """A span's bytes as DEST holds them (fewer where the file ends first); OSError when they cannot be read.
        The span counts as dealt with either way."""
        try:
            return os.pread(self._descriptor(chunk), length, start)
        finally:
            self.done(chunk)

    def done(self, chunk: int) -> None:
        """A span of `chunk` needs nothing more from DEST; the chunk's file is closed after its last."""
        self._left[chunk] -= 1
        if self._left[chunk] <= 0:
            del self._left[chunk]
            self._close(chunk)

    def close(self) -> None:
        """Close every file still open (staging ended, or failed)."""
        while self._open:
            os.close(self._open.popitem()[1])

    def __enter__(self) -> DestChunkFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _descriptor(self, chunk: int) -> int:
        fd = self._open.get(chunk)
        if fd is not None:
            self._open.move_to_end(chunk)
            return fd
        failed = self._failed.get(chunk)
        if failed is not None:
            raise OSError(failed.errno, failed.strerror, failed.filename)
        while len(self._open) >= self._max_open:
            os.close(self._open.popitem(last=False)[1])
        try:
            fd = self._open_file(self.path(chunk))
        except OSError as exc:
            self._failed[chunk] = exc
            raise
        self._open[chunk] = fd
        return fd

    def _close(self, chunk: int) -> None:
        fd = self._open.pop(chunk, None)
        if fd is not None:
            os.close(fd)
