"""Hand the compress workers the bytes of archive members, batch by batch, reading the archives front to back.

A worker compressing a directory reads each file itself; a compressed tar can only be read in order, by one
reader. So the packing process reads: each batch's raw bytes go into a buffer the workers share (compress.py),
and the workers compress from there. At most the batches in flight are held, whatever the archive's size.

The listing (walk_archive.py) gave each member its key, where its data lies in the archive's tar stream (a zip:
its header's offset), so reading needs no second parse of the headers: a tar stream is skipped forward to the
data, an uncompressed tar seeks, a zip opens the member where it lies. Hard links share their target's key, and
come right after it in plan order: a compressed stream keeps such a member's bytes until its last reader has them
(up to KEPT_BYTES in all), where reading it again would start the stream over.
"""

from __future__ import annotations

import bisect
import zipfile
from pathlib import Path
from typing import BinaryIO, Sequence

from compressors.kinds import HEAD_BYTES

from .archive_source import _DAMAGE_ERRORS, ARCHIVE_KEY_SHIFT, _reason, open_tar_stream
from .zip_recovery import open_zip
from ..errors import PackError

_KEY_MASK = (1 << ARCHIVE_KEY_SHIFT) - 1
_SKIP_BYTES = 1 << 20
KEPT_BYTES = 64 << 20  # shared members' bytes a compressed stream keeps for their next readers, at most


class ArchiveFeed:
    """Reads planned files (members, by their keys) in plan order. Plan order is stream order within a group, so
    a pass goes forward; a member behind it (the next group's first) starts a new pass."""

    def __init__(self, archives: Sequence[tuple[Path, str]], paths: Sequence[str], keys: Sequence[int],
                 sizes: Sequence[int], linked: dict[int, int] | None = None) -> None:
        self._paths = paths
        self._keys = keys
        self._sizes = sizes
        self._members = MemberReads(archives, linked)

    @property
    def head(self) -> bytes:
        """The first HEAD_BYTES of the member read last (a blocks batch's sniff)."""
        return self._members.head

    def read_range(self, number: int, offset: int, into: memoryview) -> str:
        """Bytes [offset, offset + len(into)) of plan file `number`; "" when done, or why the member cannot be
        read (a damaged zip member: it is skipped). Damage in a tar stream, which the listing found whole, stops
        the pack."""
        key = int(self._keys[number])
        try:
            self._members.read(key, int(self._sizes[number]), offset, into)
        except (*_DAMAGE_ERRORS, KeyError) as exc:
            archive, fmt = self._members.archives[key >> ARCHIVE_KEY_SHIFT]
            if fmt == "zip":  # a zip's members stand apart: the others still read
                return f"damaged in {archive.name} (the member at byte {key & _KEY_MASK:,}: {_reason(exc)}); skipped"
            raise PackError(f"{archive}: {self._paths[number]} cannot be read ({_reason(exc)}): the archive changed "
                            "since it was listed, or cannot be read; finished chunks are kept: run the same command "
                            "again to resume") from None
        return ""

    def close(self) -> None:
        self._members.close()


class MemberReads:
    """Bytes of members by key. A tar's stream is read forward, one archive at a time (a read behind it starts
    the stream again); an uncompressed tar seeks; a zip member is opened where it lies, and read on while the
    reads follow each other."""

    def __init__(self, archives: Sequence[tuple[Path, str]], linked: dict[int, int] | None = None) -> None:
        self.archives = archives
        self._reads_left = dict(linked or {})  # a key hard links share -> whole reads of it still to come
        self._kept: dict[int, bytes] = {}  # such a member's bytes, from a compressed stream
        self._kept_bytes = 0
        self._stream: BinaryIO | None = None
        self._stream_archive = -1
        self._position = 0  # of the tar stream
        # an open zip: its file, the zip over it (a view of it where the central directory had to be remade), its
        # members by header offset
        self._zips: dict[int, tuple[BinaryIO, zipfile.ZipFile, list[zipfile.ZipInfo]]] = {}
        self._zip_member: BinaryIO | None = None
        self._zip_at = (-1, 0)  # (key, offset) the open zip member is at
        self._head_key = -1
        self.head = b""  # the first HEAD_BYTES of the member read last

    def read(self, key: int, size: int, offset: int, into: memoryview) -> None:
        """Bytes [offset, offset + len(into)) of the member `key` of `size` bytes; the archive's errors pass
        through (a zip member that is not where the listing found it: KeyError)."""
        archive, place = key >> ARCHIVE_KEY_SHIFT, key & _KEY_MASK
        if key != self._head_key:
            head = memoryview(bytearray(min(HEAD_BYTES, size)))
            if offset == 0 and len(into) >= len(head):
                self._read(archive, place, key, 0, into, len(into) == size)
                head[:] = into[: len(head)]
                self.head, self._head_key = bytes(head), key
                return
            self._read(archive, place, key, 0, head, len(head) == size)
            self.head, self._head_key = bytes(head), key
        self._read(archive, place, key, offset, into, offset == 0 and len(into) == size)

    def close(self) -> None:
        self._close_stream()
        self._close_zip_member()
        for file, zip_file, _ in self._zips.values():
            zip_file.close()
            file.close()
        self._zips.clear()

    def _read(self, archive: int, place: int, key: int, offset: int, into: memoryview, whole: bool) -> None:
        path, fmt = self.archives[archive]
        if fmt == "zip":
            self._read_zip(archive, path, place, key, offset, into)
            return
        if whole and fmt != "tar" and key in self._reads_left:
            self._read_shared(archive, place, key, into)
            return
        self._read_stream(archive, place, key, offset, into)

    def _read_shared(self, archive: int, place: int, key: int, into: memoryview) -> None:
        """A member hard links share, read whole from a compressed stream: from the bytes kept since its last read,
        or from the stream and kept for the next, while KEPT_BYTES allows."""
        kept = self._kept.get(key)
        if kept is not None and len(kept) == len(into):
            into[:] = kept
        else:
            self._read_stream(archive, place, key, 0, into)
            if self._kept_bytes + len(into) <= KEPT_BYTES:
                self._kept[key] = bytes(into)
                self._kept_bytes += len(into)
        self._reads_left[key] -= 1
        if self._reads_left[key] <= 0:
            del self._reads_left[key]
            self._kept_bytes -= len(self._kept.pop(key, b""))

    def _read_stream(self, archive: int, place: int, key: int, offset: int, into: memoryview) -> None:
        path, fmt = self.archives[archive]
        if archive != self._stream_archive or self._stream is None:
            self._close_stream()
            self._stream, self._stream_archive, self._position = open_tar_stream(path, fmt), archive, 0
        target = place + offset
        stream = self._stream
        if fmt == "tar":
            stream.seek(target)
        else:
            if target < self._position:
                self._close_stream()
                self._read_stream(archive, place, key, offset, into)
                return
            _skip(stream, target - self._position)
        _fill(stream, into)
        self._position = target + len(into)

    def _read_zip(self, archive: int, path: Path, place: int, key: int, offset: int, into: memoryview) -> None:
        if self._zip_member is None or self._zip_at != (key, offset):
            self._close_zip_member()
            if archive not in self._zips:
                file = open(path, "rb")
                try:
                    zip_file, _ = open_zip(file)
                except BaseException:
                    file.close()
                    raise
                self._zips[archive] = file, zip_file, sorted(zip_file.infolist(), key=_header_offset)
            _, zip_file, infos = self._zips[archive]
            at = bisect.bisect_left(infos, place, key=_header_offset)
            if at == len(infos) or infos[at].header_offset != place:
                raise KeyError(f"no member at byte {place}")
            self._zip_member = zip_file.open(infos[at])  # type: ignore[assignment]
            self._zip_member.seek(offset)  # type: ignore[union-attr]
        _fill(self._zip_member, into)  # type: ignore[arg-type]
        self._zip_at = (key, offset + len(into))

    def _close_stream(self) -> None:
        if self._stream is not None:
            try:
                self._stream.close()
            except _DAMAGE_ERRORS:
                pass
        self._stream, self._stream_archive, self._position = None, -1, 0

    def _close_zip_member(self) -> None:
        if self._zip_member is not None:
            try:
                self._zip_member.close()
            except _DAMAGE_ERRORS:
                pass
        self._zip_member, self._zip_at = None, (-1, 0)


def _skip(stream: BinaryIO, length: int) -> None:
    while length > 0:
        skipped = len(stream.read(min(length, _SKIP_BYTES)))
        if not skipped:
            raise EOFError(f"the stream ends {length} bytes early")
        length -= skipped


def _fill(reader: BinaryIO, into: memoryview) -> None:
    done = 0
    while done < len(into):
        got = reader.readinto(into[done:])  # type: ignore[attr-defined]
        if not got:
            raise EOFError(f"the member ends {len(into) - done} bytes early")
        done += got


def _header_offset(info: zipfile.ZipInfo) -> int:
    return info.header_offset
