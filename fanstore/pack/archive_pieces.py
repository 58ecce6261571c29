"""Pieces of archive members by path, for what reads SRC out of order: the codec selector's sample (--codec auto)
and dictionary training. The packer itself reads in order (archive_feed.py).

An uncompressed tar seeks and a zip opens a member where it lies (archive_feed.MemberReads); a compressed tar
cannot seek, so it is read forward, a member behind the pass starting a new one. The members it reads whole (up
to WHOLE_UP_TO each, CACHE_BYTES in all) are kept: the sampler reads a file's head first and its pieces later.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

from .archive_feed import MemberReads
from .archive_source import _DAMAGE_ERRORS, ARCHIVE_KEY_SHIFT
from .walk import SourceEntry, SourceTree

WHOLE_UP_TO = 4 << 20
CACHE_BYTES = 256 << 20


@contextlib.contextmanager
def pieces_of(src: Path, tree: SourceTree) -> Iterator[Path | ArchivePieces]:
    """What reads SRC out of order: the directory itself, or a reader of the archives, closed after."""
    if not tree.archives:
        yield src
        return
    pieces = ArchivePieces(tree)
    try:
        yield pieces
    finally:
        pieces.close()


class ArchivePieces:
    """`read(path, offset, size)`, the reader selector.sample and codec_plan take in place of a directory."""

    def __init__(self, tree: SourceTree) -> None:
        self._entries = tree.entries  # sorted by path (walk_archive)
        self._archives = tree.archives
        self._reads = MemberReads(tree.archives)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached = 0

    def read(self, path: str, offset: int, size: int) -> bytes:
        """`size` bytes of the member at `path` from `offset` (fewer at its end); b"" when it is no file or cannot
        be read (the pack reports it)."""
        entry = self._file(path)
        if entry is None:
            return b""
        end = min(entry.size, offset + size)
        if end <= offset:
            return b""
        key = entry.ino
        try:
            if self._archives[key >> ARCHIVE_KEY_SHIFT][1] in ("tar", "zip"):
                return self._piece(key, entry.size, offset, end)
            return self._streamed(key, entry.size, offset, end)
        except (*_DAMAGE_ERRORS, KeyError):
            return b""

    def close(self) -> None:
        self._reads.close()
        self._cache.clear()

    def _file(self, path: str) -> SourceEntry | None:
        encoded = path.encode("utf-8")
        paths = self._entries.paths
        at = bisect.bisect_left(paths.as_bytes, encoded)
        if at < len(paths) and paths.encoded(at) == encoded and self._entries[at].is_file:
            return self._entries[at]
        return None

    def _streamed(self, key: int, size: int, offset: int, end: int) -> bytes:
        whole = self._cache.get(key)
        if whole is None and size <= WHOLE_UP_TO:
            whole = self._keep(key, self._piece(key, size, 0, size))
        if whole is not None:
            self._cache.move_to_end(key)
            return whole[offset:end]
        return self._piece(key, size, offset, end)

    def _piece(self, key: int, size: int, offset: int, end: int) -> bytes:
        piece = bytearray(end - offset)
        self._reads.read(key, size, offset, memoryview(piece))
        return bytes(piece)

    def _keep(self, key: int, data: bytes) -> bytes:
        self._cache[key] = data
        self._cached += len(data)
        while self._cached > CACHE_BYTES and len(self._cache) > 1:
            self._cached -= len(self._cache.popitem(last=False)[1])
        return data
