"""Read archives (tar, tar.gz/.bz2/.xz/.zst, zip) as streams of members, one pass front to back, never extracting.

This is the one place that knows archive formats. It answers two things: the members of an archive in stream order
(raw names and metadata, each with a `key`, its place in the stream), and the bytes of the member the stream is at.
A compressed tar cannot seek, so everything reads forward; a reader asked for a member behind it starts again.

Damage (a truncated or corrupt archive) ends a pass where it is found: `MemberStream.damage` says where, and the
members before it were whole.
"""

from __future__ import annotations

import bz2
import calendar
import gzip
import io
import lzma
import os
import stat
import struct
import tarfile
import zipfile
import zlib
from collections import deque
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

from .errors import UsageError, quoted

# Bits of a member's key above this hold the archive's number among several SRC archives; below, its place.
ARCHIVE_KEY_SHIFT = 48

_TAR_COMPRESSIONS = {"tar": None, "tar.gz": gzip.GzipFile, "tar.bz2": bz2.BZ2File, "tar.xz": lzma.LZMAFile}
FORMATS = ("tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip")
# Errors a decompressor or a damaged archive raises while read: all mean "damaged here".
_DAMAGE_ERRORS: tuple[type[BaseException], ...] = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error,
                                                    lzma.LZMAError, OSError, ValueError)
try:
    import zstandard
except ImportError:  # pragma: no cover - zstandard is a dependency; without it .tar.zst is refused by name
    zstandard = None  # type: ignore[assignment]
else:
    _DAMAGE_ERRORS += (zstandard.ZstdError,)


class Member(NamedTuple):
    """A member as the archive states it, before fanstore's naming rules (walk_archive.py applies them)."""

    key: int  # its place in the archive's stream: ascending, unique (the tar data offset; a zip's header offset)
    name: str
    mode: int  # full st_mode: type and permission bits
    size: int
    mtime_ns: int
    link_target: str = ""  # a symlink's target
    refusal: str = ""  # why a member that says it is a file is not packed (a hard link, a sparse file)


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a pass over an archive stopped because the archive is truncated or corrupt."""

    archive: Path
    offset: int  # in the archive's (uncompressed) stream
    reason: str

    def __str__(self) -> str:
        return f"{self.archive}: damaged at byte {self.offset:,}: {self.reason}"


def archive_format(path: Path) -> str | None:
    """The archive format of `path` from its first bytes (its name decides only for an old tar without magic);
    None when it is none fanstore reads."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "tar.zst"
    if head.startswith(b"BZh"):
        return "tar.bz2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "tar.xz"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head[257:262] == b"ustar" or (path.name.endswith(".tar") and len(head) in (0, 512)):
        return "tar"
    return None


class MemberStream:
    """One pass over one archive: iterate it for its members in stream order; `open_member()` gives the bytes of
    the member last yielded (valid until the next one). After damage the iteration ends and `damage` says where:
    a member whose data reaches past `damage.offset` is not whole."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.format = fmt
        self.damage: Damage | None = None
        self._file: BinaryIO = open(path, "rb")
        self._tar: tarfile.TarFile | None = None
        self._zip: zipfile.ZipFile | None = None
        self._current: tarfile.TarInfo | zipfile.ZipInfo | None = None
        self._counted: _CountingReader | None = None

    def __enter__(self) -> "MemberStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for closable in (self._tar, self._zip, self._counted, self._file):
            if closable is not None:
                try:
                    closable.close()
                except _DAMAGE_ERRORS:
                    pass
        self._tar = self._zip = self._counted = None

    def __iter__(self) -> Iterator[Member]:
        if self.format == "zip":
            return self._zip_members()
        return self._tar_members()

    def open_member(self) -> BinaryIO:
        """The data of the member last yielded, read forward."""
        if self._tar is not None and isinstance(self._current, tarfile.TarInfo):
            reader = self._tar.extractfile(self._current)
            if reader is None:
                raise ValueError(f"{self._current.name} has no data")
            return reader
        if self._zip is not None and isinstance(self._current, zipfile.ZipInfo):
            return self._zip.open(self._current)  # type: ignore[return-value]
        raise ValueError("no current member")

    @property
    def position(self) -> int:
        """How far into the (uncompressed) stream this pass has read: where damage found now would be (an
        uncompressed tar, which is read by seeking past the data, ends where its file ends)."""
        counted = self._counted
        if counted is None:
            return 0
        return counted.size if counted.size is not None else counted.delivered

    # --- tar ---------------------------------------------------------------------------------------------------

    def _tar_members(self) -> Iterator[Member]:
        try:
            self._counted = _CountingReader(_decompressed(self._file, self.format))
            # An uncompressed tar is listed by seeking from header to header, not by reading every byte.
            self._tar = tarfile.open(fileobj=self._counted, mode="r:" if self.format == "tar" else "r|")
        except _DAMAGE_ERRORS as exc:
            self.damage = Damage(self.path, self.position, _reason(exc))
            return
        tar = self._tar
        while True:
            try:
                info = tar.next()
            except _DAMAGE_ERRORS as exc:
                at = min(self.position, tar.offset) if tar.offset > 0 else self.position
                self.damage = Damage(self.path, at, _reason(exc))
                break
            # tarfile keeps every member it met (for hard links): a pass over millions must not.
            tar.members.clear()
            if info is None:
                self.damage = self._end_damage(tar.offset)
                break
            self._current = info
            yield _tar_member(info)
        self._current = None

    def _end_damage(self, end_offset: int) -> Damage | None:
        """tarfile ends quietly at a short or invalid header: the stream must hold an all-zero end block there."""
        counted = self._counted
        if counted is None:
            return None
        block = counted.recent(end_offset, tarfile.BLOCKSIZE)
        if len(block) < tarfile.BLOCKSIZE:
            return Damage(self.path, min(self.position, end_offset), "the archive ends early (truncated)")
        if block.count(0) != len(block):
            return Damage(self.path, end_offset, "a member header is corrupt")
        return None

    # --- zip ---------------------------------------------------------------------------------------------------

    def _zip_members(self) -> Iterator[Member]:
        try:
            self._zip = zipfile.ZipFile(self._file)
        except _DAMAGE_ERRORS as exc:
            self.damage = Damage(self.path, 0, f"not a readable zip ({_reason(exc)}; its central directory is "
                                               "missing or damaged, as when the file is truncated)")
            return
        infos = sorted(self._zip.infolist(), key=_header_offset)
        for info in infos:
            self._current = info
            target = ""
            mode = _zip_mode(info)
            if stat.S_ISLNK(mode):
                try:
                    with self._zip.open(info) as link:
                        target = link.read(4096).decode("utf-8", "surrogateescape")
                except _DAMAGE_ERRORS as exc:
                    self.damage = Damage(self.path, info.header_offset, _reason(exc))
                    return
            yield Member(info.header_offset, info.filename, mode, info.file_size if stat.S_ISREG(mode) else 0,
                         _zip_mtime_ns(info), target)
        self._current = None


def _header_offset(info: zipfile.ZipInfo) -> int:
    return info.header_offset


def _decompressed(raw: BinaryIO, fmt: str) -> BinaryIO:
    """The tar stream inside a (possibly compressed) archive file."""
    if fmt == "tar":
        return raw
    if fmt == "tar.zst":
        if zstandard is None:
            raise UsageError("reading .tar.zst needs the zstandard package")
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
    opener = _TAR_COMPRESSIONS.get(fmt)
    if opener is None:
        raise UsageError(f"unknown archive format {fmt}")
    return opener(fileobj=raw) if opener is gzip.GzipFile else opener(raw)  # type: ignore[call-arg]


class _CountingReader(io.RawIOBase):
    """Counts the bytes of the tar stream handed to tarfile and keeps the last few blocks, so that the end of a
    pass can be told from damage (tarfile treats a corrupt header as the end). Over an uncompressed tar (a plain
    file) it seeks, and `size` is the file's."""

    _KEEP = 64 << 10

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self.delivered = 0
        self._recent: deque[tuple[int, bytes]] = deque()
        self._recent_bytes = 0
        self.size: int | None = os.fstat(inner.fileno()).st_size if isinstance(inner, io.BufferedReader) else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.size is not None

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self.size is None:
            raise io.UnsupportedOperation("seek")
        self.delivered = self._inner.seek(offset, whence)
        return self.delivered

    def tell(self) -> int:
        return self.delivered

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        if data and self.size is not None:
            self.delivered += len(data)
        elif data:
            self._recent.append((self.delivered, data))
            self._recent_bytes += len(data)
            self.delivered += len(data)
            while self._recent_bytes - len(self._recent[0][1]) >= self._KEEP:
                self._recent_bytes -= len(self._recent.popleft()[1])
        return data

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def recent(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the stream, as far as they were read and are still kept."""
        if self.size is not None:
            return os.pread(self._inner.fileno(), length, offset)
        pieces = []
        for start, data in self._recent:
            end = start + len(data)
            if end <= offset or start >= offset + length:
                continue
            pieces.append(data[max(0, offset - start) : offset + length - start])
        return b"".join(pieces)

    def close(self) -> None:
        if self._inner is not None and hasattr(self._inner, "close"):
            self._inner.close()
        super().close()


_TAR_SPECIAL = {tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK, tarfile.FIFOTYPE: stat.S_IFIFO}


def _tar_member(info: tarfile.TarInfo) -> Member:
    """A tar member as a Member (the naming rules decide what is packed)."""
    perms = info.mode & 0o7777
    mtime_ns = _tar_mtime_ns(info)
    if info.issparse():  # its data in the archive is not its bytes, which reading in place needs
        return Member(info.offset_data, info.name, stat.S_IFREG | perms, 0, mtime_ns,
                      refusal="is a sparse file in the archive; sparse members are not packed (make the archive "
                              "without --sparse)")
    if info.isreg():
        return Member(info.offset_data, info.name, stat.S_IFREG | perms, info.size, mtime_ns)
    if info.isdir():
        return Member(info.offset_data, info.name, stat.S_IFDIR | perms, 0, mtime_ns)
    if info.issym():
        return Member(info.offset_data, info.name, stat.S_IFLNK | 0o777, 0, mtime_ns, info.linkname)
    if info.islnk():
        return Member(info.offset_data, info.name, stat.S_IFREG | perms, 0, mtime_ns, info.linkname,
                      refusal=f"is a hard link to {quoted(info.linkname)} in the archive; hard links in archives "
                              "are not packed (make the archive with tar --hard-dereference to pack their contents)")
    return Member(info.offset_data, info.name, _TAR_SPECIAL.get(info.type, 0) | perms, 0, mtime_ns)


def _tar_mtime_ns(info: tarfile.TarInfo) -> int:
    """The mtime in ns; a pax header's decimal mtime exactly (a float would round the nanoseconds)."""
    pax = info.pax_headers.get("mtime")
    if pax is not None:
        try:
            return int(Decimal(pax) * 1_000_000_000)
        except InvalidOperation:
            pass
    return int(info.mtime) * 1_000_000_000 if float(info.mtime).is_integer() else round(info.mtime * 1e9)


def _zip_mode(info: zipfile.ZipInfo) -> int:
    """st_mode from a zip entry: its Unix mode when a Unix tool made it, else 0644 files and 0755 directories."""
    unix = info.external_attr >> 16
    if info.create_system == 3 and stat.S_IFMT(unix):
        return unix
    return (stat.S_IFDIR | 0o755) if info.is_dir() else (stat.S_IFREG | 0o644)


def _zip_mtime_ns(info: zipfile.ZipInfo) -> int:
    """A zip entry's mtime: its extended-timestamp field's (UTC seconds) when present, else its DOS time read as
    UTC, so the same zip gives the same dataset in every time zone."""
    extra = info.extra
    while len(extra) >= 4:
        tag, length = struct.unpack("<HH", extra[:4])
        body = extra[4 : 4 + length]
        if tag == 0x5455 and len(body) >= 5 and body[0] & 1:
            return struct.unpack("<i", body[1:5])[0] * 1_000_000_000
        extra = extra[4 + length :]
    return calendar.timegm(info.date_time + (0, 0, 0)) * 1_000_000_000


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.rstrip(".")


def open_tar_stream(path: Path, fmt: str) -> BinaryIO:
    """The tar stream of a tar archive of format `fmt` (uncompressed: the file itself, which seeks); closing it
    closes the file."""
    if fmt == "tar":
        return open(path, "rb")
    if fmt == "tar.zst":
        if zstandard is None:
            raise UsageError("reading .tar.zst needs the zstandard package")
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
    openers = {"tar.gz": gzip.open, "tar.bz2": bz2.open, "tar.xz": lzma.open}
    return openers[fmt](path, "rb")  # type: ignore[return-value]


def open_stream(path: Path, fmt: str) -> MemberStream:
    """A pass over the archive at `path`; a file that cannot be opened is a one-line UsageError naming it."""
    try:
        return MemberStream(path, fmt)
    except OSError as exc:
        raise UsageError(f"SRC {quoted(path)} cannot be read: {exc.strerror}") from None


def archive_identity(path: Path) -> tuple[int, int, int, int]:
    """Who the archive file is (size, mtime, ctime, inode): a resumed pack must read the same one."""
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino
