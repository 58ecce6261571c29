"""The on-disk contract of format v1.2 (docs/FORMAT.md says the same in prose): names, magics, versions, layouts,
and the bounds a reader holds every index field to.

Everything that reads or writes dataset bytes takes its constants from here, so a change to the format is a
change to this file and to docs/FORMAT.md, and the golden fixture test tells whether old datasets still read.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from ..errors import FormatError

FORMAT_MAJOR = 1
# 1.1 added large files stored in blocks (FLAG_BLOCKED, the `blocks` section); 1.2 stores what a reader derived at
# open (the `first_child` and `file_order` sections), so that it maps the index and reads it in place.
FORMAT_MINOR = 2

INDEX_NAME = "fanstore.index"
# Asked of any path of a mount, it answers with the identity of the index file the mount serves (device, inode,
# size, mtime: index.file_identity), as JSON: a pack whose SRC is a mount of the dataset in its DEST would
# remove what it reads. Not listed by listxattr, so copying tools do not carry it along.
INDEX_XATTR = "user.fanstore.index"
CHUNK_DIR = "chunks"
CHUNK_SUFFIX = ".fsc"

INDEX_MAGIC = b"FANSTIDX"
# magic, major, minor, header_len, toc_len, body_len, body_xxh3_64, reserved
INDEX_HEADER = struct.Struct("<8sHHIQQQ24x")
INDEX_HEADER_LEN = INDEX_HEADER.size  # 64

CHUNK_MAGIC = b"FANSTCHK"
# magic, major, minor, chunk_id, group
CHUNK_HEADER = struct.Struct("<8sHHII12x")
CHUNK_HEADER_LEN = CHUNK_HEADER.size  # 32

SECTION_ALIGN = 8

# Marks an entry that has no blob: directories, symlinks, empty files.
NO_CHUNK = 0xFFFFFFFF

# One row per directory, file and symlink, in breadth-first order (entry 0 is the root), so that the
# children of every directory are contiguous and `parent` never decreases.
ENTRY_DTYPE = np.dtype(
    [
        ("path_off", "<u8"),  # full relative path in the `paths` blob (UTF-8, '/'-separated, root is "")
        ("size", "<u8"),  # raw size of a file; target length of a symlink; 0 for a directory
        ("mtime_ns", "<i8"),
        ("offset", "<u8"),  # blob offset in its chunk file; for a symlink, its target's offset in `paths`
        ("stored_len", "<u8"),  # blob length; for a symlink, its target's length
        ("checksum", "<u8"),  # xxh3_64 of the stored blob
        ("parent", "<u4"),
        ("mode", "<u4"),  # st_mode, file type bits included
        ("chunk", "<u4"),  # NO_CHUNK when the entry has no blob
        ("path_len", "<u2"),
        ("codec", "<u1"),  # row in the codec table
        ("flags", "<u1"),  # FLAG_BLOCKED, or 0
    ]
)
if ENTRY_DTYPE.itemsize != 64:
    raise ImportError("ENTRY_DTYPE must be 64 bytes")

# Entry flag (1.1): the file is stored as blocks. Its `offset` is then its first row in the `blocks` section, its
# `chunk` the chunk of its first block, `stored_len` the sum of its blocks' and `checksum` 0.
FLAG_BLOCKED = 0x01
KNOWN_FLAGS = FLAG_BLOCKED

# One row per block of a blocked file (1.1): the blocks of a file are consecutive rows, files in entry order.
# Every block holds `block_size` raw bytes (the TOC's), the last one of a file the rest.
BLOCK_DTYPE = np.dtype(
    [
        ("offset", "<u8"),  # blob offset in its chunk file
        ("checksum", "<u8"),  # xxh3_64 of the stored blob
        ("chunk", "<u4"),
        ("stored_len", "<u4"),
        ("codec", "<u1"),  # row in the codec table: a block that would not shrink is stored as it is (`none`)
        ("reserved", "V7"),  # zero
    ]
)
if BLOCK_DTYPE.itemsize != 32:
    raise ImportError("BLOCK_DTYPE must be 32 bytes")



def fields_view(rows: np.ndarray, *names: str) -> np.ndarray:
    """`rows` (entries or blocks) seen through the named fields only, in the order named: a view, made once at open,
    whose row's `.item()` is the tuple of those fields. Read by name, so a reordered dtype cannot silently swap
    fields, and cheaper than unpacking the whole row by position (fewer objects made: bench/bench_records.py)."""
    if len(names) < 2:
        raise ValueError("fields_view takes two field names or more (one field: index the column instead)")
    missing = [name for name in names if name not in rows.dtype.names]
    if missing:
        raise ValueError(f"no field {', '.join(missing)} in {rows.dtype}")
    return rows[list(names)]


CHUNK_DTYPE = np.dtype([("size", "<u8"), ("group", "<u4"), ("files", "<u4")])
HASH_DTYPE = np.dtype("<u8")
ORDER_DTYPE = np.dtype("<u4")

# Sections every v1 index holds, with the dtype each must have; dictionaries are extra byte sections.
REQUIRED_SECTIONS = {
    "entries": ENTRY_DTYPE,
    "paths": np.dtype("u1"),
    "path_hash": HASH_DTYPE,
    "hash_order": ORDER_DTYPE,
    "chunks": CHUNK_DTYPE,
}
# Sections a minor version added, with their dtypes: present only when the dataset uses what they describe.
# `first_child` and `file_order` (1.2) are byte sections holding little-endian u32 entry numbers (DERIVED_DTYPE):
# as bytes, every earlier 1.x reader skips them (the 1.0 reader refuses an unknown typed section).
OPTIONAL_SECTIONS = {
    "blocks": BLOCK_DTYPE,
    "first_child": np.dtype("u1"),
    "file_order": np.dtype("u1"),
}
DERIVED_DTYPE = np.dtype("<u4")
# Byte sections holding zstd dictionaries, named by the codec table's `dictionary` (dict.N, or dict.N.KIND).
DICTIONARY_PREFIX = "dict."
BYTES_DTYPE = np.dtype("u1")

# A layout tag (a section's `dtype` in the TOC): numpy's type string, or `name:type` fields joined by ','. A type is
# a byte order, a kind whose size counts bytes, and that size; records have no padding (docs/FORMAT.md, Sections).
_LAYOUT_TYPE = re.compile(r"[<>|=][biufcSV]([1-9][0-9]{0,8})\Z")
_LAYOUT_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Bounds no honest index exceeds: a crafted one that does is refused at open, before a field can size a
# buffer or index an array.
MAX_FILE_SIZE = 1 << 48  # 256 TiB
MAX_PATH_BYTES = 4096  # PATH_MAX; each name at most NAME_MAX
MAX_NAME_BYTES = 255
# No codec expands stored bytes more than this (zstd's best is an RLE block: 4 bytes for 128 KiB, 32768x).
MAX_EXPANSION = 1 << 16
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 30  # a block's stored length is a u32


def known_section_dtype(name: str) -> np.dtype | None:
    """The layout this reader expects of a section, or None for a section it does not know: one a later minor
    version added, which it skips unless the index marks it required."""
    known = REQUIRED_SECTIONS.get(name) or OPTIONAL_SECTIONS.get(name)
    if known is not None:
        return known
    return BYTES_DTYPE if name.startswith(DICTIONARY_PREFIX) else None


def layout_tag(dtype: np.dtype) -> str:
    """The stable text form of a dtype stored beside each section, so a layout change is caught on open."""
    if dtype.names:
        return ",".join(f"{name}:{dtype.fields[name][0].str}" for name in dtype.names)
    return dtype.str


def layout_itemsize(tag: str) -> int | None:
    """Bytes per element of a layout tag, or None if the tag is not one: all a reader needs to know of a section
    it skips, to check that the section lies inside the index and overlaps no other."""
    whole = _LAYOUT_TYPE.match(tag)
    if whole:
        return int(whole.group(1))
    total = 0
    for field in tag.split(","):
        name, colon, field_type = field.partition(":")
        typed = _LAYOUT_TYPE.match(field_type)
        if not colon or not _LAYOUT_FIELD_NAME.match(name) or not typed:
            return None
        total += int(typed.group(1))
    return total


def chunk_file_name(chunk_id: int) -> str:
    """Relative path of a chunk inside a dataset directory."""
    return f"{CHUNK_DIR}/{chunk_id:08d}{CHUNK_SUFFIX}"


def check_version(major: int, minor: int, what: Path | str) -> None:
    """Refuse a major version this code does not know; newer minors only add, so they read fine."""
    if major != FORMAT_MAJOR:
        raise FormatError(
            f"{what}: fanstore format version {major}.{minor} is not supported "
            f"(this fanstore reads version {FORMAT_MAJOR}.x)"
        )


def pack_chunk_header(chunk_id: int, group: int) -> bytes:
    return CHUNK_HEADER.pack(CHUNK_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, chunk_id, group)


def check_chunk_header(header: bytes, chunk_id: int, what: Path | str) -> None:
    """A chunk file must say it is one, in a version we read, with the id the index expects."""
    if len(header) < CHUNK_HEADER_LEN:
        raise FormatError(f"{what}: chunk {chunk_id} is truncated (no header)")
    magic, major, minor, found_id, _group = CHUNK_HEADER.unpack(header[:CHUNK_HEADER_LEN])
    if magic != CHUNK_MAGIC:
        raise FormatError(f"{what}: chunk {chunk_id} is not a fanstore chunk file (bad magic)")
    check_version(major, minor, what)
    if found_id != chunk_id:
        raise FormatError(f"{what}: holds chunk {found_id}, the index expects chunk {chunk_id}")
