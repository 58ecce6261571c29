"""A zip whose central directory is gone (a download cut short, a write interrupted) still holds its members, each
behind a local header. They are found by walking those headers from the start, as `zip -FF` does, and the zip is
then read through a view that ends after the last whole member and carries a central directory made from them: the
standard zipfile module reads it as any other zip, so listing and reading need nothing else.

What only a central directory holds is lost: the members' Unix modes, so they come back as files and directories
of the default modes (a symlink as a file that holds its target's name), and the system that made them: the remade
directory says MS-DOS, so a name with '\\' and no '/' reads with '\\' as its separator (zip_member_name). A member
whose sizes only the central directory states (a stored member written by a streaming zip) ends the walk, as damage
does.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from typing import BinaryIO, NamedTuple

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature .. extra length: a local file header (APPNOTE 4.3.7)
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # a central directory header, as zipfile reads it
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_LOCAL_MAGIC, _CENTRAL_MAGIC = b"PK\x03\x04", b"PK\x01\x02"
_END_MAGICS = (b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x05")
_DESCRIPTOR_MAGIC = b"PK\x07\x08"
_DESCRIPTOR_FLAG = 0x08
_DEFLATED = 8
_ZIP64_EXTRA = 0x0001
_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
# A value of the remade central directory at or above these goes into zip64 fields (tests lower them).
ZIP64_VALUE, ZIP64_COUNT = _MAX32, _MAX16
_READ_BYTES = 1 << 20


class _Found(NamedTuple):
    """A whole member found behind its local header."""

    offset: int  # of its local header
    flags: int
    method: int
    time: int
    date: int
    crc: int
    compressed: int
    size: int
    name: bytes
    extra: bytes  # its local extra fields, less zip64's (the central directory gets its own)
    end: int  # just past its data (and its data descriptor)


class Recovered(NamedTuple):
    """A zip read from its local headers: the view zipfile opens, and where and why the walk stopped."""

    view: BinaryIO
    members: int
    damage_offset: int
    reason: str


def open_zip(file: BinaryIO) -> tuple[zipfile.ZipFile, Recovered | None]:
    """The zip in `file`; where its central directory cannot be read, the members its local headers give (with
    what stopped the walk). zipfile.BadZipFile where not even one member is whole."""
    try:
        return zipfile.ZipFile(file), None
    except zipfile.BadZipFile:
        recovered = recover(file)
        if recovered is None:
            raise
        return zipfile.ZipFile(recovered.view), recovered


def recover(file: BinaryIO) -> Recovered | None:
    """The members of `file` found from its local headers, None if there is none."""
    size = file.seek(0, os.SEEK_END)
    found, stop, reason = _walk(file, size)
    if not found:
        return None
    cut = found[-1].end
    return Recovered(_Joined(file, cut, _central_directory(found, cut)), len(found), stop, reason)


def _walk(file: BinaryIO, size: int) -> tuple[list[_Found], int, str]:
    found: list[_Found] = []
    at = 0
    while True:
        file.seek(at)
        head = file.read(_LOCAL.size)
        if head[:4] == _CENTRAL_MAGIC or head[:4] in _END_MAGICS:
            return found, at, "its central directory is damaged"
        if len(head) < 4 and at == size:
            return found, at, "the file ends where its central directory should begin"
        if head[:4] != _LOCAL_MAGIC or len(head) < _LOCAL.size:
            return found, at, "no member header there"
        member, why = _member_at(file, at, size, head)
        if member is None:
            return found, at, why
        found.append(member)
        at = member.end


def _member_at(file: BinaryIO, at: int, size: int, head: bytes) -> tuple[_Found | None, str]:
    _, _, flags, method, time, date, crc, compressed, length, name_length, extra_length = _LOCAL.unpack(head)
    name, extra = file.read(name_length), file.read(extra_length)
    if len(name) < name_length or len(extra) < extra_length:
        return None, "the member's header is cut short"
    wide = _MAX32 in (compressed, length)
    if wide:
        values = _zip64_sizes(extra)
        if values is None:
            return None, "the member's zip64 sizes are missing"
        length, compressed = values
    data = at + _LOCAL.size + name_length + extra_length
    if flags & _DESCRIPTOR_FLAG:
        if method != _DEFLATED:
            return None, "the member's size is only in the central directory (written by a streaming zip)"
        ended = _inflated_end(file, data)
        if ended is None:
            return None, "the member's data is cut short or damaged"
        end, length = ended
        compressed = end - data
        descriptor = _descriptor(file, end, compressed, wide)
        if descriptor is None:
            return None, "the member's data descriptor is missing or damaged"
        crc, end = descriptor
    else:
        end = data + compressed
        if end > size:
            return None, "the member's data is cut short"
    return _Found(at, flags, method, time, date, crc, compressed, length, name, _without_zip64(extra), end), ""


def _zip64_sizes(extra: bytes) -> tuple[int, int] | None:
    """(size, compressed size) from a local header's zip64 extra field."""
    for tag, body in _extra_fields(extra):
        if tag == _ZIP64_EXTRA and len(body) >= 16:
            length, compressed = struct.unpack("<QQ", body[:16])
            return length, compressed
    return None


def _extra_fields(extra: bytes) -> list[tuple[int, bytes]]:
    fields, at = [], 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[at : at + 4])
        fields.append((tag, extra[at + 4 : at + 4 + length]))
        at += 4 + length
    return fields


def _without_zip64(extra: bytes) -> bytes:
    return b"".join(struct.pack("<HH", tag, len(body)) + body for tag, body in _extra_fields(extra)
                    if tag != _ZIP64_EXTRA)


def _inflated_end(file: BinaryIO, data: int) -> tuple[int, int] | None:
    """Where a deflated member's data ends, and its size: the data inflated to its end (its descriptor says
    where only after it)."""
    inflate = zlib.decompressobj(-zlib.MAX_WBITS)
    file.seek(data)
    read = length = 0
    while not inflate.eof:
        block = file.read(_READ_BYTES)
        if not block:
            return None
        try:
            length += len(inflate.decompress(block))
        except zlib.error:
            return None
        read += len(block)
    return data + read - len(inflate.unused_data), length


def _descriptor(file: BinaryIO, at: int, compressed: int, wide: bool) -> tuple[int, int] | None:
    """(crc, end) of the data descriptor at `at`, which may start with its signature and holds 4- or 8-byte sizes."""
    file.seek(at)
    body = file.read(28)
    start = 4 if body[:4] == _DESCRIPTOR_MAGIC else 0
    for width in ((8,) if wide else (4, 8)):
        fields = body[start : start + 4 + 2 * width]
        if len(fields) < 4 + 2 * width:
            continue
        crc, size_bytes = struct.unpack("<L", fields[:4])[0], fields[4 : 4 + width]
        if int.from_bytes(size_bytes, "little") == compressed:
            return crc, at + start + 4 + 2 * width
    return None


def _central_directory(found: list[_Found], at: int) -> bytes:
    """A central directory for `found`, starting at byte `at`, and its end records (zip64 where needed)."""
    records = []
    for member in found:
        sizes = (member.size, member.compressed, member.offset)
        wide = [value for value in sizes if value >= ZIP64_VALUE]  # in this order, as APPNOTE 4.5.3 lists them
        extra = struct.pack(f"<HH{len(wide)}Q", _ZIP64_EXTRA, 8 * len(wide), *wide) if wide else b""
        extra += member.extra
        size, compressed, offset = (_MAX32 if value >= ZIP64_VALUE else value for value in sizes)
        version = 45 if wide else 20
        records.append(_CENTRAL.pack(
            _CENTRAL_MAGIC, version, 0, version, 0, member.flags, member.method, member.time, member.date,
            member.crc, compressed, size, len(member.name), len(extra), 0, 0, 0,
            0x10 if member.name.endswith(b"/") else 0, offset) + member.name + extra)
    directory = b"".join(records)
    count, length = len(found), len(directory)
    tail = b""
    wide_end = count >= ZIP64_COUNT or length >= ZIP64_VALUE or at >= ZIP64_VALUE
    if wide_end:
        tail = _END64.pack(b"PK\x06\x06", _END64.size - 12, 45, 45, 0, 0, count, count, length, at)
        tail += _LOCATOR64.pack(b"PK\x06\x07", 0, at + length, 1)
    tail += _END.pack(b"PK\x05\x06", 0, 0, _MAX16 if wide_end else count, _MAX16 if wide_end else count,
                      _MAX32 if wide_end else length, _MAX32 if wide_end else at, 0)
    return directory + tail


class _Joined(io.RawIOBase):
    """The first `cut` bytes of a file, then `tail` (bytes): what zipfile opens in place of a damaged zip."""

    def __init__(self, file: BinaryIO, cut: int, tail: bytes) -> None:
        super().__init__()
        self._file, self._cut, self._tail = file, cut, tail
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._cut + len(self._tail)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view):
            if self._position < self._cut:
                self._file.seek(self._position)
                got = self._file.readinto(view[done : done + self._cut - self._position])  # type: ignore[attr-defined]
            else:
                start = self._position - self._cut
                piece = self._tail[start : start + len(view) - done]
                view[done : done + len(piece)] = piece
                got = len(piece)
            if not got:
                break
            self._position += got
            done += got
        return done
