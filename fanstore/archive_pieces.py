"""Pieces of archive members by path, for what reads SRC out of order: the codec selector's sample (--codec auto)
and dictionary training. The packer itself reads in order (archive_feed.py).

An uncompressed tar reads a member where it lies and a zip opens it where it lies; a compressed tar cannot seek,
so it is read forward, a member behind the pass starting a new one. The members it reads whole (up to
WHOLE_UP_TO each, CACHE_BYTES in all) are kept: the sampler reads a file's head first and its pieces later.
"""

from __future__ import annotations

import bisect
import os
import zipfile
from collections import OrderedDict
from pathlib import Path

from .archive_feed import MemberMissing, MemberReads
from .archive_source import _DAMAGE_ERRORS, ARCHIVE_KEY_SHIFT
from .walk import SourceEntry, SourceTree

_KEY_MASK = (1 << ARCHIVE_KEY_SHIFT) - 1
WHOLE_UP_TO = 4 << 20
CACHE_BYTES = 256 << 20


class ArchivePieces:
    """`read(path, offset, size)`, the reader selector.sample and codec_plan take in place of a directory."""

    def __init__(self, tree: SourceTree) -> None:
        self._entries = tree.entries  # sorted by path (walk_archive)
        self._archives = tree.archives
        self._reads = MemberReads(tree.archives)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached = 0
        self._files: dict[int, int] = {}  # archive number -> open descriptor (uncompressed tars)
        self._zips: dict[int, tuple[zipfile.ZipFile, list[zipfile.ZipInfo]]] = {}

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
        number, place = key >> ARCHIVE_KEY_SHIFT, key & _KEY_MASK
        archive, fmt = self._archives[number]
        try:
            if fmt == "tar":
                return os.pread(self._descriptor(number, archive), end - offset, place + offset)
            if fmt == "zip":
                with self._zip_member(number, archive, place) as member:
                    member.seek(offset)
                    return member.read(end - offset)
            return self._streamed(key, entry.size, offset, end)
        except (*_DAMAGE_ERRORS, MemberMissing, KeyError):
            return b""

    def close(self) -> None:
        self._reads.close()
        for descriptor in self._files.values():
            os.close(descriptor)
        for zip_file, _ in self._zips.values():
            zip_file.close()
        self._files.clear()
        self._zips.clear()
        self._cache.clear()

    def _file(self, path: str) -> SourceEntry | None:
        encoded = path.encode("utf-8")
        at = bisect.bisect_left(self._entries, encoded, key=_path_bytes)
        if at < len(self._entries) and self._entries[at].path == path and self._entries[at].is_file:
            return self._entries[at]
        return None

    def _streamed(self, key: int, size: int, offset: int, end: int) -> bytes:
        whole = self._cache.get(key)
        if whole is None and size <= WHOLE_UP_TO:
            buffer = bytearray(size)
            self._reads.read(key, 0, memoryview(buffer))
            whole = self._keep(key, bytes(buffer))
        if whole is not None:
            self._cache.move_to_end(key)
            return whole[offset:end]
        piece = bytearray(end - offset)
        self._reads.read(key, offset, memoryview(piece))
        return bytes(piece)

    def _keep(self, key: int, data: bytes) -> bytes:
        self._cache[key] = data
        self._cached += len(data)
        while self._cached > CACHE_BYTES and len(self._cache) > 1:
            self._cached -= len(self._cache.popitem(last=False)[1])
        return data

    def _descriptor(self, number: int, archive: Path) -> int:
        if number not in self._files:
            self._files[number] = os.open(archive, os.O_RDONLY | os.O_CLOEXEC)
        return self._files[number]

    def _zip_member(self, number: int, archive: Path, place: int) -> zipfile.ZipExtFile:
        if number not in self._zips:
            zip_file = zipfile.ZipFile(archive)
            self._zips[number] = zip_file, sorted(zip_file.infolist(), key=_header_offset)
        zip_file, infos = self._zips[number]
        at = bisect.bisect_left(infos, place, key=_header_offset)
        if at == len(infos) or infos[at].header_offset != place:
            raise KeyError(place)
        return zip_file.open(infos[at])


def _path_bytes(entry: SourceEntry) -> bytes:
    return entry.path.encode("utf-8")


def _header_offset(info: zipfile.ZipInfo) -> int:
    return info.header_offset
