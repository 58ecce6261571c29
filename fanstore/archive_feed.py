"""Hand the compress workers the bytes of archive members, batch by batch, reading the archives front to back.

A worker compressing a directory reads each file itself; a compressed tar can only be read in order, by one
reader. So the packing process reads: each batch's raw bytes go into a buffer the workers share (compress.py),
and the workers compress from there. At most the batches in flight are held, whatever the archive's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from compressors.kinds import HEAD_BYTES

from .archive_source import _DAMAGE_ERRORS, ARCHIVE_KEY_SHIFT, Member, MemberStream, _reason, open_stream
from .errors import PackError

_KEY_MASK = (1 << ARCHIVE_KEY_SHIFT) - 1
_SKIP_BYTES = 1 << 20


class ArchiveFeed:
    """Reads planned files (members, by their keys) in plan order. Plan order is stream order within a group, so
    a pass goes forward; a member behind it (the next group's first) starts a new pass."""

    def __init__(self, archives: Sequence[tuple[Path, str]], paths: Sequence[str], keys: Sequence[int]) -> None:
        self._paths = paths
        self._keys = keys
        self._members = MemberReads(archives)

    @property
    def head(self) -> bytes:
        """The first HEAD_BYTES of the member read last (a blocks batch's sniff)."""
        return self._members.head

    def read_range(self, number: int, offset: int, into: memoryview) -> str:
        """Bytes [offset, offset + len(into)) of plan file `number`; "" when done, or why the member cannot be
        read (a damaged zip member: it is skipped). Damage in a tar stream, which the listing found whole, stops
        the pack."""
        key = self._keys[number]
        try:
            self._members.read(key, offset, into)
        except _DAMAGE_ERRORS as exc:
            archive, fmt = self._members.archives[key >> ARCHIVE_KEY_SHIFT]
            if fmt == "zip":  # a zip's members stand apart: the others still read
                return f"damaged in {archive.name} (the member at byte {key & _KEY_MASK:,}: {_reason(exc)}); skipped"
            raise PackError(f"{archive}: {self._paths[number]} cannot be read ({_reason(exc)}): the archive changed "
                            "since it was listed, or cannot be read; finished chunks are kept: run the same command "
                            "again to resume") from None
        except MemberMissing as exc:
            raise PackError(f"{exc.archive}: {self._paths[number]} is no longer where the archive was listed; it "
                            "changed since: pass --force to pack it afresh") from None
        return ""

    def close(self) -> None:
        self._members.close()


class MemberMissing(Exception):
    """No member has the key asked for: the archive is not the one listed."""

    def __init__(self, archive: Path) -> None:
        super().__init__(str(archive))
        self.archive = archive


class MemberReads:
    """Bytes of members by key, read forward through one pass at a time: within the member open, and from one
    member to a later one; a member behind the pass starts a new one."""

    def __init__(self, archives: Sequence[tuple[Path, str]]) -> None:
        self.archives = archives
        self._stream: MemberStream | None = None
        self._members: Iterator[Member] | None = None
        self._archive = -1  # number of the archive the pass is over
        self._at = -1  # key (within that archive) of the member the pass is at
        self._key = -1  # key of the open member
        self._reader: BinaryIO | None = None
        self._read = 0  # bytes of the open member read so far
        self.head = b""  # the open member's first HEAD_BYTES

    def read(self, key: int, offset: int, into: memoryview) -> None:
        """Bytes [offset, offset + len(into)) of the member `key`; the archive's errors pass through."""
        try:
            if key != self._key or offset < self._read:
                self._open(key)
            self._skip(offset - self._read)
            self._fill(into)
        except BaseException:
            self._close_member()
            raise

    def close(self) -> None:
        self._close_member()
        if self._stream is not None:
            self._stream.close()
        self._stream = self._members = None

    def _open(self, key: int) -> None:
        self._close_member()
        archive, place = key >> ARCHIVE_KEY_SHIFT, key & _KEY_MASK
        if archive != self._archive or place <= self._at or self._members is None:
            self.close()
            path, fmt = self.archives[archive]
            self._stream = open_stream(path, fmt)
            self._members = iter(self._stream)
            self._archive, self._at = archive, -1
        for member in self._members:
            self._at = member.key
            if member.key >= place:
                break
        if self._at != place or self._stream is None:
            self._archive = -1
            raise MemberMissing(self.archives[archive][0])
        self._reader = self._stream.open_member()
        self._key, self._read, self.head = key, 0, b""

    def _skip(self, length: int) -> None:
        scratch = memoryview(bytearray(min(length, _SKIP_BYTES)))
        while length > 0:
            part = scratch[: min(length, len(scratch))]
            self._fill(part)
            length -= len(part)

    def _fill(self, into: memoryview) -> None:
        reader = self._reader
        if reader is None:
            raise ValueError("no member open")
        done = 0
        while done < len(into):
            got = reader.readinto(into[done:])  # type: ignore[attr-defined]
            if not got:
                raise EOFError(f"the member ends {len(into) - done} bytes early")
            done += got
        if self._read < HEAD_BYTES:
            self.head += bytes(into[: HEAD_BYTES - self._read])
        self._read += done

    def _close_member(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except _DAMAGE_ERRORS:
                pass
        self._reader, self._key, self._read = None, -1, 0
