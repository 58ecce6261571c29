"""The index file as a reader finds it: opened without trusting it, mapped, and its header, table of contents and
section layout checked before Index reads an array of it.

These checks run in every process that opens the index, on every open: they cost one read of pages the node shares.
The pass over every entry (index_check.check_arrays) runs once per node instead (index_trust), so it lives apart.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from . import index_trust
from ..errors import DatasetNotFound, FormatError, quoted
from .format import (
    DERIVED_DTYPE,
    DICTIONARY_PREFIX,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    INDEX_HEADER,
    INDEX_HEADER_LEN,
    INDEX_MAGIC,
    INDEX_NAME,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    REQUIRED_SECTIONS,
    SECTION_ALIGN,
    check_version,
    known_section_dtype,
    layout_itemsize,
    layout_tag,
)
from .index_check import Refuse, check_arrays


def read_index_file(dataset_dir: str | os.PathLike[str]) -> bytes:
    """The bytes of a dataset directory's index file, not yet checked (Index.from_bytes checks them). Opened without
    blocking, and refused unless a regular file: an index that is a fifo must not hang the reader."""
    fd, path = _open_index_file(dataset_dir)
    try:
        info = os.fstat(fd)
        _check_header_before_reading(fd, path, info.st_size)
        return _read_whole(fd, path, info.st_size)
    except FormatError:
        raise  # an OSError too, naming what is wrong already
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the index: {exc.strerror}") from None
    finally:
        os.close(fd)


def map_index_file(dataset_dir: str | os.PathLike[str]) -> tuple[mmap.mmap | bytes, os.stat_result]:
    """A read-only map of a dataset directory's index file (bytes if it cannot be mapped: empty, or a file system
    without mmap), not yet checked, and the file's identity as it was mapped.

    A map is read where it lies: a page past the end of a file that shrank after it was mapped raises SIGBUS. fanstore
    never shrinks an index in place (a pack writes a new file and renames it over the old, whose pages stay mapped);
    a file shorter than its header says is refused before anything past its end is read."""
    fd, path = _open_index_file(dataset_dir)
    try:
        info = os.fstat(fd)
        _check_header_before_reading(fd, path, info.st_size)
        try:
            if info.st_size >= INDEX_HEADER_LEN:
                return mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ), info
        except (OSError, ValueError):
            pass  # read it instead
        return _read_whole(fd, path, info.st_size), info
    except FormatError:
        raise  # an OSError too, naming what is wrong already
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the index: {exc.strerror}") from None
    finally:
        os.close(fd)


def _check_header_before_reading(fd: int, path: Path, file_size: int) -> None:
    """The header read alone and checked against the file's size, before the file is mapped or read: a file that
    is not the index its header describes (64 GiB of zeros, a tail past the body) is refused without reading it,
    where a reader that cannot map it (`ulimit -v`) would read all of it into memory."""
    if file_size >= INDEX_HEADER_LEN:
        check_header(path, os.pread(fd, INDEX_HEADER_LEN, 0), file_size)


def _read_whole(fd: int, path: Path, file_size: int) -> bytes:
    """The index file's bytes, read where it cannot be mapped; one line naming it where memory does not hold them."""
    try:
        with os.fdopen(fd, "rb", closefd=False) as index_file:
            return index_file.read()
    except MemoryError:
        raise FormatError(f"{path}: cannot read the index: not enough memory for its {file_size} bytes (it could "
                          "not be mapped either: is the address space limited, `ulimit -v`?)") from None


def _open_index_file(dataset_dir: str | os.PathLike[str]) -> tuple[int, Path]:
    """An open descriptor of a dataset directory's index file, checked to be a regular file."""
    directory = Path(dataset_dir)
    path = directory / INDEX_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if directory.is_dir():
            raise DatasetNotFound(
                f"{directory}: no {INDEX_NAME} here: not a fanstore dataset, or its pack did not finish"
            ) from None
        raise DatasetNotFound(f"{directory}: no such dataset directory") from None
    except NotADirectoryError:
        raise DatasetNotFound(f"{directory}: is a file; a dataset is a directory holding {INDEX_NAME}") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the index: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise FormatError(f"{path}: cannot read the index: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FormatError(f"{path}: is not a regular file, expected an index file")
    return fd, path


def header_body_hash(data: bytes | mmap.mmap) -> int | None:
    """The body checksum the header records, or None if there is no whole header (parse_index says why)."""
    if len(data) < INDEX_HEADER_LEN:
        return None
    return int(INDEX_HEADER.unpack_from(data)[6])


def parse_index(path: Path, data: bytes | mmap.mmap,
                full_check: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The table of contents and the sections of the index bytes `data` (the file at `path`, which errors name), as
    views into `data`, once every check of this module passed; and the pass over every entry unless `full_check`
    is False (this node made it already: index_trust)."""
    major, minor, header_len, toc_len, body_len, body_hash = check_header(path, data, len(data))
    body = memoryview(data)[header_len:]
    if xxhash.xxh3_64_intdigest(body) != body_hash:
        raise FormatError(f"{path}: index checksum mismatch: the index file is corrupt")
    if toc_len > body_len:
        raise FormatError(f"{path}: table of contents length {toc_len} runs past the index")
    try:
        toc = json.loads(bytes(body[:toc_len]))
    except (ValueError, RecursionError):
        raise FormatError(f"{path}: index table of contents is not valid JSON") from None
    check_toc(path, toc, f"{major}.{minor}")
    # Sections a later minor version added are bounded by their layout tags, then skipped (or refused if required).
    known, itemsizes = section_layouts(path, toc["sections"], f"{major}.{minor}")
    check_section_layout(path, toc["sections"], itemsizes, header_len + toc_len, len(data))
    missing = sorted(set(REQUIRED_SECTIONS) - set(toc["sections"]))
    if missing:
        raise FormatError(f"{path}: index lacks section(s) {', '.join(missing)}")
    sections = {name: np.frombuffer(data, dtype=dtype, count=toc["sections"][name]["count"],
                                    offset=toc["sections"][name]["offset"])
                for name, dtype in known.items()}
    check_derived_sections(path, toc, sections)  # their sizes, always: a reader indexes them as they are
    if full_check:
        check_arrays(path, toc, sections)
    return toc, sections


def check_header(path: Path, data: bytes | mmap.mmap, file_size: int) -> tuple[int, int, int, int, int, int]:
    """The header at the start of `data` (major, minor, header length, TOC length, body length, body checksum),
    checked against the index file's size `file_size`: magic, major version, where the body starts and ends."""
    if len(data) < INDEX_HEADER_LEN:
        raise FormatError(f"{path}: index is truncated ({len(data)} bytes)")
    magic, major, minor, header_len, toc_len, body_len, body_hash = INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC:
        raise FormatError(f"{path}: not a fanstore index (bad magic)")
    check_version(major, minor, path)
    if header_len < INDEX_HEADER_LEN or header_len % SECTION_ALIGN or header_len > file_size:
        raise FormatError(f"{path}: header length {header_len} is not a multiple of {SECTION_ALIGN} from "
                          f"{INDEX_HEADER_LEN} to the file's size")
    if file_size - header_len != body_len:
        state = "truncated" if file_size - header_len < body_len else "longer than its header says"
        raise FormatError(f"{path}: index is {state} (body {file_size - header_len} of {body_len} bytes)")
    return major, minor, header_len, toc_len, body_len, body_hash


def check_toc(path: Path, toc: Any, version: str) -> None:
    """The table of contents has every key the reader uses, each of the type it uses."""
    refuse = Refuse(path)
    if not isinstance(toc, dict):
        raise refuse("table of contents", "is not a JSON object")
    if toc.get("format") != "fanstore-index":
        raise refuse("table of contents", f"format is {quoted(toc.get('format'))}, expected 'fanstore-index'")
    if toc.get("version") != version:
        raise refuse("table of contents", f"version {quoted(toc.get('version'))} differs from the header's "
                                          f"{quoted(version)}")
    groups = toc.get("groups")
    if not isinstance(groups, list) or not groups:
        raise refuse("groups", "must be a non-empty list")
    for number, group in enumerate(groups):
        if not (isinstance(group, dict) and isinstance(group.get("name"), str)
                and isinstance(group.get("replicated"), bool) and isinstance(group.get("patterns", []), list)
                and all(isinstance(p, str) for p in group.get("patterns", []))):
            raise refuse(f"groups[{number}]", "needs a name, a replicated flag and a list of patterns")
    codecs = toc.get("codecs")
    if not isinstance(codecs, list) or not 1 <= len(codecs) <= 256:
        raise refuse("codecs", "must be a list of 1 to 256 rows (a file's codec field is one byte)")
    sections = toc.get("sections")
    if not isinstance(sections, dict):
        raise refuse("sections", "must be an object")
    for number, row in enumerate(codecs):
        if not (isinstance(row, dict) and _is_int(row.get("id")) and isinstance(row.get("spec"), str)):
            raise refuse(f"codecs[{number}]", "needs an integer id and a spec string")
        dictionary = row.get("dictionary")
        if dictionary is not None and (not isinstance(dictionary, str) or not dictionary.startswith(DICTIONARY_PREFIX)
                                       or dictionary not in sections):
            raise refuse(f"codecs[{number}].dictionary", f"{quoted(dictionary)} names no dictionary section")
    if codecs[0].get("spec") != "none":
        raise refuse("codecs[0]", f"is {quoted(codecs[0].get('spec'))}; row 0 is always 'none'")
    for name, where in sections.items():
        if not (isinstance(where, dict) and _is_int(where.get("offset")) and _is_int(where.get("count"))
                and isinstance(where.get("dtype"), str) and where["offset"] >= 0 and where["count"] >= 0
                and isinstance(where.get("required", False), bool)):
            raise refuse(f"sections[{quoted(name)}]", "needs a non-negative offset and count, a dtype and, if marked "
                                                "required, true or false")
    if not isinstance(toc.get("meta", {}), dict):
        raise refuse("meta", "must be an object")
    if "blocks" in sections:
        block_size = toc.get("block_size")
        if not _is_int(block_size) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise refuse("block_size", f"{quoted(block_size)} is not a block size from {MIN_BLOCK_SIZE} to "
                                       f"{MAX_BLOCK_SIZE} bytes")


def section_layouts(path: Path, sections: dict[str, Any], version: str) -> tuple[dict[str, np.dtype],
                                                                                  dict[str, int]]:
    """The dtype of each section this reader knows, checked against the layout the index records, and the element
    size of every section. A section it does not know (a later minor version's) is skipped, unless marked required:
    reading on without it would misread the dataset (docs/FORMAT.md, Versioning)."""
    known: dict[str, np.dtype] = {}
    itemsizes: dict[str, int] = {}
    for name, where in sections.items():
        dtype = known_section_dtype(name)
        if dtype is not None:
            if where["dtype"] != layout_tag(dtype):
                raise FormatError(f"{path}: section {quoted(name)} has layout {quoted(where['dtype'])}, expected "
                                  f"{layout_tag(dtype)}")
            known[name], itemsizes[name] = dtype, dtype.itemsize
            continue
        if where.get("required", False):
            raise FormatError(f"{path}: section {quoted(name)} is required to read this version {version} index "
                              f"and this fanstore (format {FORMAT_MAJOR}.{FORMAT_MINOR}) does not know it: read the "
                              "dataset with a newer fanstore")
        itemsize = layout_itemsize(where["dtype"])
        if itemsize is None:
            raise Refuse(path)(f"sections[{quoted(name)}].dtype", f"{quoted(where['dtype'])} is not a layout tag")
        itemsizes[name] = itemsize
    return known, itemsizes


def check_section_layout(path: Path, sections: dict[str, Any], itemsizes: dict[str, int], body_start: int,
                         file_size: int) -> None:
    """Sections lie after the table of contents, inside the file, and do not overlap one another."""
    refuse = Refuse(path)
    spans = []
    for name, where in sections.items():
        end = where["offset"] + where["count"] * itemsizes[name]
        if where["offset"] < body_start or end > file_size:
            raise refuse(f"sections[{quoted(name)}]", f"bytes {where['offset']}..{end} lie outside the index's "
                                                      f"sections ({body_start}..{file_size})")
        spans.append((where["offset"], end, name))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        if start < end:
            raise refuse(f"sections[{quoted(following)}]", f"overlaps section {quoted(name)}")


def check_derived_sections(path: Path, toc: dict[str, Any], sections: dict[str, np.ndarray]) -> None:
    """The 1.2 sections a reader indexes by entry number hold whole u32s, as many as it will index: checked in every
    process (their sizes only; their values are checked with the rest, once per node)."""
    refuse = Refuse(path)
    entries = len(sections["entries"])
    width = DERIVED_DTYPE.itemsize
    if "first_child" in sections and len(sections["first_child"]) != width * (entries + 1):
        raise refuse("first_child", f"holds {len(sections['first_child'])} bytes; {entries} entries need "
                                    f"{width * (entries + 1)}")
    if "file_order" in sections:
        size = len(sections["file_order"])
        if size % width or size > width * entries:
            raise refuse("file_order", f"holds {size} bytes, not a whole number of u32 entry numbers up to one per "
                                       f"entry ({entries})")


def mark_copy_checked(copy_dir: Path, index_bytes: bytes | mmap.mmap) -> None:
    """`index_bytes` passed the full check in this process (Index.from_bytes) and were just written, byte for byte,
    to `copy_dir`: the node's other processes then map that copy without checking every entry again (the serve
    process's copy in its local directory, which every reader of the node opens)."""
    body_hash = header_body_hash(index_bytes)
    try:
        info = os.stat(Path(copy_dir) / INDEX_NAME)
    except OSError:
        return
    if body_hash is not None and info.st_size == len(index_bytes):
        index_trust.mark_checked(info, body_hash)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
