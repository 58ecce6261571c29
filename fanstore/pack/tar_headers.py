"""Read the member headers of a tar stream: the one loop a listing of millions of members runs.

tarfile parses every field of every header into a TarInfo (about 60 us a member, most of an archive pack's time on
small files); a listing needs six fields. This reads them from the 512-byte headers of the formats tar writes
(v7, ustar, GNU with its long names, pax with its extended and global headers) the way tarfile does, and the
stream's damage the way archive_source reports it: a header whose checksum fails, or a stream that ends early.
"""

from __future__ import annotations

import stat
from decimal import Decimal, InvalidOperation
from typing import BinaryIO, Iterator, NamedTuple

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_SKIP_BYTES = 1 << 20
_REGULAR = (b"0", b"\0", b"7")  # a file, an old-style file, a contiguous file
_SPECIAL = {b"3": stat.S_IFCHR, b"4": stat.S_IFBLK, b"6": stat.S_IFIFO}
_KNOWN = _REGULAR + tuple(_SPECIAL) + (b"1", b"2", b"5", b"L", b"K", b"S", b"x", b"g", b"X")


class Header(NamedTuple):
    """What a listing keeps of a member header."""

    offset_data: int  # where its data starts in the tar stream
    name: str
    typeflag: bytes
    mode: int  # permission bits as stored
    size: int
    mtime_ns: int
    linkname: str
    sparse: bool

    @property
    def kind(self) -> int:
        """The st_mode type bits (0 for a type fanstore does not pack)."""
        if self.typeflag in _REGULAR or self.typeflag == b"S":
            return stat.S_IFREG
        return {b"5": stat.S_IFDIR, b"2": stat.S_IFLNK, b"1": stat.S_IFREG}.get(self.typeflag,
                                                                             _SPECIAL.get(self.typeflag, 0))


TRUNCATED = "the archive ends early (truncated)"


class HeaderDamage(Exception):
    """The stream is damaged at `offset`: cut short there (`truncated`), or holding what is no header."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.truncated = reason == TRUNCATED


class TarHeaders:
    """Iterate the headers of a tar stream, front to back; a stream that can seek (an uncompressed tar, whose
    `size` is known) is skipped by seeking. Damage raises HeaderDamage after the headers before it."""

    def __init__(self, stream: BinaryIO, size: int | None = None) -> None:
        self._stream = stream
        self._size = size
        self.position = 0

    def __iter__(self) -> Iterator[Header]:
        long_name: str | None = None
        long_link: str | None = None
        pax: dict[str, str] = {}
        global_pax: dict[str, str] = {}
        while True:
            offset = self.position
            block = self._read(BLOCK)
            if len(block) < BLOCK:
                raise HeaderDamage(offset, TRUNCATED)
            if block == _ZERO_BLOCK:
                return
            if not _checksum_holds(block, _number(block[148:156], offset)):
                raise HeaderDamage(offset, "a member header is corrupt")
            typeflag = block[156:157]
            size = _number(block[124:136], offset)
            if typeflag in (b"L", b"K", b"x", b"g", b"X"):
                data = self._read(size)
                if len(data) < size:
                    raise HeaderDamage(self.position, TRUNCATED)
                self._skip(-size % BLOCK)
                if typeflag == b"L":
                    long_name = _text(data.split(b"\0", 1)[0])
                elif typeflag == b"K":
                    long_link = _text(data.split(b"\0", 1)[0])
                else:
                    (global_pax if typeflag == b"g" else pax).update(_pax_records(data, offset))
                continue
            fields = {**global_pax, **pax}
            name = long_name if long_name is not None else _name(block, typeflag)
            name = fields.get("path", name)
            if typeflag == b"\0" and name.endswith("/"):
                typeflag = b"5"
            if typeflag == b"5":
                name = name.rstrip("/")
            if "size" in fields:
                size = _pax_int(fields["size"], offset)
            mtime_ns = _mtime_ns(fields.get("mtime"), _number(block[136:148], offset), offset)
            linkname = fields.get("linkpath", long_link if long_link is not None else _text(_nul_cut(block[157:257])))
            sparse = typeflag == b"S" or any(key.startswith("GNU.sparse.") for key in fields)
            header = Header(offset + BLOCK, name, typeflag, _number(block[100:108], offset), size, mtime_ns,
                            linkname, sparse)
            long_name = long_link = None
            pax = {}
            yield header
            if typeflag in _REGULAR or typeflag == b"S" or typeflag not in _KNOWN:  # as tarfile skips data
                self._skip(-(-size // BLOCK) * BLOCK)

    def _read(self, length: int) -> bytes:
        data = self._stream.read(length)
        self.position += len(data)
        return data

    def _skip(self, length: int) -> None:
        if length <= 0:
            return
        if self._size is not None:
            target = self.position + length
            if target > self._size:
                raise HeaderDamage(self._size, TRUNCATED)
            self._stream.seek(target)
            self.position = target
            return
        while length > 0:
            skipped = len(self._read(min(length, _SKIP_BYTES)))
            if not skipped:
                raise HeaderDamage(self.position, TRUNCATED)
            length -= skipped


def _checksum_holds(block: bytes, stored: int) -> bool:
    """The header's checksum as tar computes it, with the checksum field as spaces: unsigned, or (old tars)
    signed."""
    unsigned = sum(block[:148]) + 256 + sum(block[156:])
    if stored == unsigned:
        return True
    high = sum(1 for byte in block[:148] if byte > 127) + sum(1 for byte in block[156:] if byte > 127)
    return stored == unsigned - 256 * high


def _number(field: bytes, offset: int) -> int:
    """A numeric field: octal text, or base-256 (GNU, for values octal cannot hold)."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0xFF else value
    text = _nul_cut(field).strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise HeaderDamage(offset, "a member header is corrupt") from None


def _nul_cut(field: bytes) -> bytes:
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _name(block: bytes, typeflag: bytes) -> str:
    """The name field, behind the ustar prefix when there is one (not for GNU's own types, as tarfile reads it)."""
    name = _text(_nul_cut(block[0:100]))
    prefix = _text(_nul_cut(block[345:500]))
    if prefix and typeflag not in (b"L", b"K", b"S"):
        return f"{prefix}/{name}"
    return name


def _pax_records(data: bytes, offset: int) -> dict[str, str]:
    """The records of a pax extended header: 'LENGTH KEY=VALUE\\n' each."""
    records: dict[str, str] = {}
    position = 0
    while position < len(data) and data[position:position + 1] not in (b"\0", b""):
        space = data.find(b" ", position)
        try:
            length = int(data[position:space])
        except ValueError:
            raise HeaderDamage(offset, "a pax header is corrupt") from None
        if space < 0 or length <= 0 or position + length > len(data):
            raise HeaderDamage(offset, "a pax header is corrupt")
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = _text(value)
        position += length
    return records


def _pax_int(value: str, offset: int) -> int:
    try:
        return int(value)
    except ValueError:
        raise HeaderDamage(offset, "a pax header is corrupt") from None


def _mtime_ns(pax_mtime: str | None, seconds: int, offset: int) -> int:
    """The mtime in ns; a pax header's decimal mtime exactly (a float would round the nanoseconds)."""
    if pax_mtime is None:
        return seconds * 1_000_000_000
    try:
        return int(Decimal(pax_mtime) * 1_000_000_000)
    except InvalidOperation:
        raise HeaderDamage(offset, "a pax header is corrupt") from None
