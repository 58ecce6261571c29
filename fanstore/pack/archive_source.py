"""Read archives (tar, tar.gz/.bz2/.xz/.zst, zip) as streams of members, one pass front to back, never extracting.

This is the one place that knows archive formats. It answers two things: the members of an archive in stream order
(raw names and metadata, each with a `key`: where its data lies, which archive_feed.py reads without parsing again).
A compressed tar cannot seek, so everything reads forward; a reader asked for a member behind it starts again.

Damage (a truncated or corrupt archive) ends a pass where it is found: `MemberStream.damage` says where, and the
members before it were whole.
"""

from __future__ import annotations

import bz2
import calendar
import gzip
import lzma
import os
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

from ..core.units import plural
from ..errors import UsageError, quoted
from .zip_recovery import open_zip
from .tar_headers import Header, HeaderDamage, TarHeaders

# Bits of a member's key above this hold the archive's number among several SRC archives; below, its place.
ARCHIVE_KEY_SHIFT = 48
_END_READ = 1 << 20  # what is left of a compressed tar past its last member is read in pieces of this
# Why a compressed tar that fails to decode is packed none of: a corrupt block decodes to garbage before anything
# tells (measured: deflate bytes flipped garbled the member before the header that showed it; a zstd block holds
# 128 KiB of members), and its stream's check, the one thing that would tell which bytes are whole, never ran.
_UNCHECKED = "its check at its end cannot be made, so which members the damage garbled cannot be told"

FORMATS = ("tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip")
# Errors a decompressor or a damaged archive raises while read: all mean "damaged here".
_DAMAGE_ERRORS: tuple[type[BaseException], ...] = (zipfile.BadZipFile, EOFError, zlib.error,
                                                    lzma.LZMAError, OSError, ValueError)
try:
    import zstandard
except ImportError:  # pragma: no cover - zstandard is a dependency; without it .tar.zst is refused by name
    zstandard = None  # type: ignore[assignment]
else:
    _DAMAGE_ERRORS += (zstandard.ZstdError,)
# A .tar.gz is decompressed twice, to list it and to read it, by one process: ISA-L's gunzip (isal) runs 2.8x as
# fast as zlib's here (500 against 175 MB/s of output a core), the same bytes. zlib where isal is missing.
try:
    from isal import igzip, isal_zlib
except ImportError:  # pragma: no cover - isal is a dependency
    _GzipFile: type[gzip.GzipFile] = gzip.GzipFile
else:
    _GzipFile = igzip.IGzipFile
    _DAMAGE_ERRORS += (isal_zlib.error,)
_TAR_COMPRESSIONS = {"tar": None, "tar.gz": _GzipFile, "tar.bz2": bz2.BZ2File, "tar.xz": lzma.LZMAFile}


class Member(NamedTuple):
    """A member as the archive states it, before fanstore's naming rules (walk_archive.py applies them)."""

    key: int  # its place in the archive's stream: ascending, unique (the tar data offset; a zip's header offset)
    name: str
    mode: int  # full st_mode: type and permission bits
    size: int
    mtime_ns: int
    link_target: str = ""  # a symlink's target; a hard link's: the name of the member whose data it shares
    refusal: str = ""  # why a member that says it is a file is not packed (a sparse file)
    hard_link: bool = False  # a tar hard link: no data of its own, its target's


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
    try:  # without waiting: a fifo put in its place would block an open until a writer came
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = f.read(512)
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
    """One pass over one archive: iterate it for its members in stream order. After damage the iteration ends
    and `damage` says where: a member whose data reaches past `damage.offset` is not whole."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.format = fmt
        self.damage: Damage | None = None
        self._file: BinaryIO = open(path, "rb")
        self._stream: BinaryIO | None = None
        self._zip: zipfile.ZipFile | None = None

    def __enter__(self) -> MemberStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for closable in (self._zip, self._stream, self._file):
            if closable is not None:
                try:
                    closable.close()
                except _DAMAGE_ERRORS:
                    pass
        self._zip = self._stream = None

    def __iter__(self) -> Iterator[Member]:
        if self.format == "zip":
            return self._zip_members()
        return self._tar_members()

    # --- tar ---------------------------------------------------------------------------------------------------

    def _tar_members(self) -> Iterator[Member]:
        headers = None
        try:
            self._stream = _decompressed(self._file, self.format)
            # An uncompressed tar is listed by seeking from header to header, not by reading every byte.
            size = os.fstat(self._file.fileno()).st_size if self.format == "tar" else None
            headers = TarHeaders(self._stream, size)
            for header in headers:
                yield _tar_member(header)
        except HeaderDamage as damage:
            self.damage = Damage(self.path, damage.offset, str(damage))
            if self.format != "tar" and not damage.truncated:
                self._check_the_end()  # a tar damaged before it was compressed passes; a stream damaged since fails
            return
        except _DAMAGE_ERRORS as exc:
            position = headers.position if headers is not None else 0
            if self.format == "tar" or isinstance(exc, EOFError):  # bytes as they lie, or decoded up to a cut
                self.damage = Damage(self.path, position, _reason(exc))
            else:
                self.damage = Damage(self.path, 0, f"{_reason(exc)} at byte {position:,} of the {self.format} "
                                                   f"stream: {_UNCHECKED}")
            return
        if self.format != "tar":
            self._check_the_end()

    def _check_the_end(self) -> None:
        """Read a compressed tar to its end, where its decompressor checks it whole (gzip's CRC, xz's and zstd's
        checks): bytes damaged inside a block stored as is decode without an error, so without this a corrupt
        photo would be packed as it came out. A check that fails cannot say which member it was: none is packed."""
        try:
            while self._stream.read(_END_READ):  # type: ignore[union-attr]
                pass
        except _DAMAGE_ERRORS as exc:
            self.damage = Damage(self.path, 0, f"{_reason(exc)}: the {self.format} stream's check at its end fails, "
                                               "so which member is damaged cannot be told")

    # --- zip ---------------------------------------------------------------------------------------------------

    def _zip_members(self) -> Iterator[Member]:
        try:
            self._zip, recovered = open_zip(self._file)
        except _DAMAGE_ERRORS as exc:
            self.damage = Damage(self.path, 0, f"not a readable zip ({_reason(exc)}; its central directory is "
                                               "missing or damaged, and no whole member is found before it)")
            return
        if recovered is not None:  # its members as their local headers give them: the damage is said after them
            self.damage = Damage(self.path, recovered.damage_offset, f"no readable central directory: "
                                 f"{recovered.reason}; {plural(recovered.members, 'member')} before it read from their local "
                                 "headers, with default modes")
        infos = sorted(self._zip.infolist(), key=_header_offset)
        for info in infos:
            target = ""
            name = zip_member_name(info)
            mode = _zip_mode(info, name)
            refusal = _zip_refusal(info)
            if refusal:
                yield Member(info.header_offset, name, stat.S_IFREG | 0o644, 0, _zip_mtime_ns(info), refusal=refusal)
                continue
            if stat.S_ISLNK(mode):
                try:
                    with self._zip.open(info) as link:
                        target = link.read(4096).decode("utf-8", "surrogateescape")
                except _DAMAGE_ERRORS as exc:
                    self.damage = Damage(self.path, info.header_offset, _reason(exc))
                    return
            yield Member(info.header_offset, name, mode, info.file_size if stat.S_ISREG(mode) else 0,
                         _zip_mtime_ns(info), target)


def zip_member_name(info: zipfile.ZipInfo) -> str:
    """A zip member's name as unzip gives it on Linux. Without the UTF-8 flag zipfile reads a name as CP437, as the
    zip spec says, but Linux's zip and many other tools store UTF-8 there unflagged: `caf\u00e9.txt` was packed as
    `caf\u251c\u2310.txt`. Bytes that are UTF-8 are read so; others stay CP437. The name is taken whole, as
    stored (zipfile's `filename` ends at a NUL: `a\0b` became `a`; a NUL is refused by name later).

    A name made on MS-DOS/Windows (`create_system` 0) that holds no '/' has each '\\' read as '/', as Info-ZIP
    unzip reads it ("appears to use backslashes as path separators"): some Windows tools store `dir\\sub\\a.jpg`,
    which was packed as one file of that name at the top. No name from those systems holds a '\\' of its own. A
    name from any other system (a Unix name may hold '\\'), or one that separates with '/' already, is kept."""
    name = info.orig_filename
    if not info.flag_bits & 0x800:
        try:
            name = name.encode("cp437").decode("utf-8")
        except UnicodeDecodeError:
            pass
    if info.create_system == 0 and "/" not in name:
        name = name.replace("\\", "/")
    return name


_ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
                zipfile.ZIP_LZMA: "lzma"}  # what zipfile reads


def _zip_refusal(info: zipfile.ZipInfo) -> str:
    """Why a zip member cannot be read without more than the zip (a password, another decompressor), or ""."""
    if info.flag_bits & 0x1:
        return "is encrypted in the zip; encrypted members are not packed (no password is asked for)"
    if info.compress_type not in _ZIP_METHODS:
        return (f"is compressed with zip method {info.compress_type}, which cannot be read here (only "
                f"{', '.join(_ZIP_METHODS.values())})")
    return ""


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
    return opener(fileobj=raw) if opener is _GzipFile else opener(raw)  # type: ignore[call-arg]


def _tar_member(header: Header) -> Member:
    """A tar member as a Member (the naming rules decide what is packed)."""
    perms = header.mode & 0o7777
    kind = header.kind
    if header.sparse:  # its data in the archive is not its bytes, which reading in place needs
        return Member(header.offset_data, header.name, stat.S_IFREG | perms, 0, header.mtime_ns,
                      refusal="is a sparse file in the archive; sparse members are not packed (make the archive "
                              "without --sparse)")
    if header.typeflag == b"1":
        return Member(header.offset_data, header.name, stat.S_IFREG | perms, 0, header.mtime_ns, header.linkname,
                      hard_link=True)
    if kind == stat.S_IFREG:
        return Member(header.offset_data, header.name, kind | perms, header.size, header.mtime_ns)
    if kind == stat.S_IFLNK:
        return Member(header.offset_data, header.name, kind | 0o777, 0, header.mtime_ns, header.linkname)
    return Member(header.offset_data, header.name, kind | perms, 0, header.mtime_ns)


def _zip_mode(info: zipfile.ZipInfo, name: str) -> int:
    """st_mode from a zip entry: its Unix mode when a Unix tool made it, else 0644 files and 0755 directories, a
    directory being a `name` (zip_member_name's: 'dir\\' from Windows is 'dir/') that ends in '/', as unzip has it."""
    unix = info.external_attr >> 16
    if info.create_system == 3 and stat.S_IFMT(unix):
        return unix
    return (stat.S_IFDIR | 0o755) if name.endswith("/") else (stat.S_IFREG | 0o644)


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
    if fmt == "tar.gz":
        return _GzipFile(path, "rb")
    openers = {"tar.bz2": bz2.open, "tar.xz": lzma.open}
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
