"""The index: every path's metadata and blob location, held as a few numpy arrays and one blob of paths.

A million-file dataset must open in about a second and cost little RAM per file, so nothing here builds a
Python object per file: lookups hash the path and binary-search a sorted hash array written at pack time.
Index reads the arrays that index_file.py mapped and checked; IndexLayout builds them at pack time.
"""

from __future__ import annotations

import json
import operator
import os
import stat
from array import array
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import xxhash

from . import index_trust
from .durable import write_atomically
from ..errors import FormatError, PathNotFound, quoted
from .format import (
    BLOCK_DTYPE,
    CHUNK_DTYPE,
    DERIVED_DTYPE,
    DICTIONARY_PREFIX,
    FLAG_BLOCKED,
    ENTRY_DTYPE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HASH_DTYPE,
    INDEX_HEADER,
    INDEX_HEADER_LEN,
    INDEX_MAGIC,
    INDEX_NAME,
    NO_CHUNK,
    ORDER_DTYPE,
    SECTION_ALIGN,
    layout_tag,
)
from .index_file import header_body_hash, map_index_file, parse_index

_hash_path = xxhash.xxh3_64_intdigest
_LOOKUP_SLICE = 1 << 16  # paths looked up at once when the packer places blobs


def normalize_path(path: str | os.PathLike[str]) -> str:
    """The index spells paths relative, '/'-separated, with no leading, trailing or doubled slashes. A bytes path is
    decoded as the file system's names are (os.fsdecode)."""
    text = os.fsdecode(path)
    return "/".join(part for part in text.split("/") if part and part != ".")


class EntryRecord(NamedTuple):
    """One directory, file or symlink as the packer hands it to the index writer (a named tuple: a pack makes
    one per file, and a tuple is made and taken apart several times faster than a frozen dataclass)."""

    path: str
    mode: int
    mtime_ns: int
    size: int = 0
    chunk: int = NO_CHUNK
    offset: int = 0
    stored_len: int = 0
    codec: int = 0
    checksum: int = 0
    link_target: str = ""


def file_identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """Which file a stat describes (device, inode, size, mtime): the same identity, the same bytes, as a pack writes
    a new index file and renames it over the old."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class Index:
    """A loaded index: read-only arrays plus the table of contents (groups, codecs, chunks, pack metadata)."""

    def __init__(self, path: Path, toc: dict[str, Any], sections: dict[str, np.ndarray],
                 mapped: os.stat_result | None = None) -> None:
        # The sections may be views into a read-only map of the index file, which they keep open.
        self.path = path
        # Which file was read (device, inode, size, mtime), where known: another process that finds the same
        # identity reads the very same bytes, so entry numbers from here mean the same there.
        self.file_identity = None if mapped is None else file_identity(mapped)
        self.toc = toc
        self.entries: np.ndarray = sections["entries"]
        # A view into the loaded file, not a copy: the path blob is a third of the index's memory.
        self.paths: memoryview = memoryview(sections["paths"])
        self.path_hash: np.ndarray = sections["path_hash"]
        self.hash_order: np.ndarray = sections["hash_order"]
        self.chunks: np.ndarray = sections["chunks"]
        self.groups: list[dict[str, Any]] = toc["groups"]
        self.codecs: list[dict[str, Any]] = toc["codecs"]
        self.dictionaries: dict[str, bytes] = {
            name: sections[name].tobytes() for name in toc["sections"] if name.startswith(DICTIONARY_PREFIX)
        }
        self.meta: dict[str, Any] = toc.get("meta", {})
        # Files stored in blocks (format 1.1): their blocks' locations, `block_size` raw bytes each but the last.
        self.blocks: np.ndarray = sections.get("blocks", np.zeros(0, dtype=BLOCK_DTYPE))
        self.block_size: int = int(toc.get("block_size", 0)) if "blocks" in sections else 0
        # Column views (no copies) for the lookup path, which reads two fields of a few entries per call.
        self._path_off = self.entries["path_off"]
        self._flags = self.entries["flags"]
        self._path_len = self.entries["path_len"]
        # Children of entry i are first_child[i]..first_child[i+1]; regular files in path order. Stored by 1.2
        # packs (read in place, shared by the node's processes); derived here from an older index.
        self._link_counts: dict[int, int] | None = None  # per directory, its st_nlink (link_count)
        self._first_child: np.ndarray = (sections["first_child"].view(DERIVED_DTYPE) if "first_child" in sections
                                         else derive_first_child(self.entries["parent"]))
        self._file_order: np.ndarray | None = (sections["file_order"].view(DERIVED_DTYPE)
                                               if "file_order" in sections else None)

    @classmethod
    def load(cls, dataset_dir: str | os.PathLike[str]) -> "Index":
        """Map and check an index; every inconsistency is one FormatError naming the file and the field.

        The arrays are read in place from a read-only map of the file, so every process of a node shares one copy
        (the page cache). The pass over every entry runs once per node (index_trust); each process still checks
        the header, the TOC, the sections' layout and the body's checksum."""
        path = Path(dataset_dir) / INDEX_NAME
        data, info = map_index_file(dataset_dir)
        try:
            body_hash = header_body_hash(data)
            checked = body_hash is not None and index_trust.is_checked(info, body_hash)
            toc, sections = parse_index(path, data, full_check=not checked)
            if not checked and body_hash is not None:
                index_trust.mark_checked(info, body_hash)
            return cls(path, toc, sections, info)
        except MemoryError:
            raise _no_memory_for(path, len(data)) from None

    @classmethod
    def from_bytes(cls, path: Path, data: bytes) -> "Index":
        """The index in `data`, the bytes of the index file at `path` (which errors name), checked as `load` checks
        it: for a caller that needs the bytes too (to checksum or copy them), so it reads the file once."""
        try:
            toc, sections = parse_index(path, data)
            return cls(path, toc, sections)
        except MemoryError:
            raise _no_memory_for(path, len(data)) from None

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def file_count(self) -> int:
        if self._file_order is not None:
            return len(self._file_order)
        return int(np.count_nonzero((self.entries["mode"] & 0o170000) == stat.S_IFREG))

    def files_in_path_order(self) -> np.ndarray:
        """Entry numbers of every regular file, sorted by path (as Python sorts the path strings): a 1.2 index's
        stored `file_order`, read in place (no copy); an older index's sorted here, once per call."""
        if self._file_order is not None:
            return self._file_order
        files = np.fromiter(self.iter_files(), dtype=np.int64)
        return files[np.argsort([self.path_bytes(int(entry)) for entry in files], kind="stable")]

    def lookup(self, path: str | os.PathLike[str]) -> int:
        """Entry number of a path; PathNotFound if the dataset has no such path."""
        entry = self.lookup_key(normalize_path(path).encode("utf-8", "surrogateescape"))
        if entry is None:
            raise PathNotFound(f"{quoted(path)}: no such file or directory in the dataset")
        return entry

    def lookup_key(self, key: bytes) -> int | None:
        """Entry number of a path already spelled as the index spells it (UTF-8, normalized), or None: the
        FUSE lookup builds such keys from names the kernel hands it, so it skips normalizing and decoding."""
        # As a numpy scalar: searchsorted given a Python int of 2**63 or more converts it the slow way (5 us).
        digest = np.uint64(_hash_path(key))
        hashes = self.path_hash
        pos = int(hashes.searchsorted(digest))
        while pos < len(hashes) and hashes[pos] == digest:
            entry = int(self.hash_order[pos])
            off = int(self._path_off[entry])
            if self.paths[off : off + int(self._path_len[entry])] == key:  # compared in place, no copy
                return entry
            pos += 1
        return None

    def lookup_keys(self, keys: Sequence[bytes]) -> np.ndarray:
        """Entry numbers of many keys (spelled as for lookup_key), -1 where there is none: one vectorized search
        instead of one per key, for a Dataset opening a million paths in every DataLoader worker."""
        found = np.full(len(keys), -1, dtype=np.int64)
        hashes = self.path_hash
        if not len(keys) or not len(hashes):
            return found
        digests = np.fromiter((_hash_path(key) for key in keys), dtype=np.uint64, count=len(keys))
        positions = np.minimum(hashes.searchsorted(digests), len(hashes) - 1)
        first = self.hash_order[positions].astype(np.int64)
        hit = hashes[positions] == digests
        offsets, lengths = self._path_off[first].tolist(), self._path_len[first].tolist()
        paths = self.paths
        for number in np.flatnonzero(hit).tolist():
            off = offsets[number]
            if paths[off : off + lengths[number]] == keys[number]:
                found[number] = first[number]
            else:  # another path with the same hash comes first (never seen; the single lookup walks them)
                entry = self.lookup_key(keys[number])
                found[number] = -1 if entry is None else entry
        return found

    def unfindable(self) -> np.ndarray:
        """Entries a lookup of their own path misses: `path_hash` holds another hash than their path's (a damaged or
        crafted index; listings show them, lookups say they are not there). A hash of every path: `fanstore verify`
        asks, not open, which must stay fast at 10^7 paths."""
        order = self.hash_order.astype(np.int64)
        offsets, lengths, paths = self._path_off[order].tolist(), self._path_len[order].tolist(), self.paths
        digests = np.fromiter((_hash_path(paths[off : off + length]) for off, length in zip(offsets, lengths)),
                              dtype=np.uint64, count=len(order))
        return np.sort(order[digests != self.path_hash])

    def path_bytes(self, entry: int) -> bytes:
        off = int(self._path_off[entry])
        return self.paths[off : off + int(self._path_len[entry])].tobytes()

    def path_of(self, entry: int) -> str:
        return self.path_bytes(entry).decode("utf-8")

    def link_count(self, entry: int) -> int:
        """st_nlink as a file system gives it: 2 and one a subdirectory for a directory, 1 otherwise. Counted once,
        for every directory (few beside the files), at the first call."""
        counts = self._link_counts
        if counts is None:
            kinds = self.entries["mode"] & 0o170000
            directories = np.flatnonzero(kinds == stat.S_IFDIR)
            below = directories[directories != 0]  # the root is its own parent, not its own subdirectory
            subdirectories = np.bincount(self.entries["parent"][below].astype(np.int64), minlength=len(self.entries))
            counts = self._link_counts = dict(zip(directories.tolist(), (2 + subdirectories[directories]).tolist()))
        return counts.get(entry, 1)

    def children(self, entry: int) -> range:
        """Entry numbers of a directory's children, in name order (empty for files and symlinks)."""
        return range(int(self._first_child[entry]), int(self._first_child[entry + 1]))

    def block_count(self, entry: int) -> int:
        """How many blocks a file is stored in (format 1.1); 0 for a file stored whole."""
        if not self._flags[entry] & FLAG_BLOCKED:
            return 0
        return -(-int(self.entries["size"][entry]) // self.block_size)

    def block_rows(self, entry: int) -> range:
        """The rows of `blocks` that hold a file's blocks, in block order (empty for a file stored whole)."""
        first = int(self.entries["offset"][entry]) if self._flags[entry] & FLAG_BLOCKED else 0
        return range(first, first + self.block_count(entry))

    def link_target(self, entry: int) -> str:
        rec = self.entries[entry]
        off = int(rec["offset"])
        return str(self.paths[off : off + int(rec["stored_len"])], "utf-8")

    def iter_files(self) -> Iterator[int]:
        """Entry numbers of regular files, in chunk and offset order: the order that reads chunks sequentially."""
        is_file = (self.entries["mode"] & 0o170000) == stat.S_IFREG
        files = np.flatnonzero(is_file)
        order = np.lexsort((self.entries["offset"][files], self.entries["chunk"][files]))
        return (int(i) for i in files[order])


def _no_memory_for(path: Path, size: int) -> FormatError:
    """Opening an index ran out of memory: its table of contents (free-form JSON, which Python holds at many times
    its size) or the checks' arrays. One line naming it, where a MemoryError traceback came from json or numpy."""
    return FormatError(f"{path}: not enough memory to open the index ({size} bytes; its table of contents and the "
                       "checks of its entries take more): is the address space limited (`ulimit -v`)?")


def derive_first_child(parents: np.ndarray) -> np.ndarray:
    """first_child of a tree in breadth-first order: children of entry i are entries first_child[i] to
    first_child[i+1] (parents never decrease, so each directory's children are contiguous)."""
    return (np.searchsorted(parents[1:], np.arange(len(parents) + 1)) + 1).astype(DERIVED_DTYPE)


def _bfs_order(records: list[Any]) -> tuple[list[Any], np.ndarray]:
    """Breadth-first order with children sorted by name: each directory's children end up contiguous. And each
    entry's parent, the entry number of the directory it was found under."""
    by_parent: dict[str, list[Any]] = {}
    root = None
    for rec in records:
        if rec.path == "":
            root = rec
            continue
        parent, _, _ = rec.path.rpartition("/")
        by_parent.setdefault(parent, []).append(rec)
    if root is None:
        raise ValueError("index records must include the root directory (path '')")
    ordered = [root]
    parents = array("I", [0])
    head = 0
    while head < len(ordered):
        current = ordered[head]
        head += 1
        if stat.S_ISDIR(current.mode):
            kids = by_parent.pop(current.path, [])
            kids.sort(key=lambda r: r.path.encode("utf-8", "surrogateescape"))
            ordered.extend(kids)
            parents.extend(repeat(head - 1, len(kids)))
    if by_parent:
        orphan = next(iter(by_parent.values()))[0].path
        raise ValueError(f"index record {orphan!r} has no parent directory record")
    return ordered, np.frombuffer(parents, dtype=np.uint32).copy()


class _TreeEntry(Protocol):
    """What IndexLayout reads of an entry of a walk (walk.SourceEntry)."""

    path: str
    mode: int
    mtime_ns: int
    size: int
    link_target: str


class IndexLayout:
    """Everything an index holds that follows from the tree alone: entry order, paths, parents, modes, mtimes,
    sizes, symlink targets, the path-hash lookup. A pack builds it while files are still being compressed (it
    is most of the work of writing an index), then places the blobs and serialises."""

    def __init__(self, records: Iterable[EntryRecord | _TreeEntry]) -> None:
        """`records`: EntryRecords, whose blobs are placed already, or entries of a walk (path, mode, mtime_ns, size
        and link_target, nothing placed: the packer's, taken as they are rather than copied into a record each)."""
        ordered, parents = _bfs_order(list(records))
        count = len(ordered)
        encoded_paths = [rec.path.encode("utf-8") for rec in ordered]
        path_lens = np.fromiter(map(len, encoded_paths), dtype=np.uint64, count=count)
        paths = bytearray(b"".join(encoded_paths))
        entries = np.zeros(count, dtype=ENTRY_DTYPE)
        entries["path_off"] = np.concatenate(([0], np.cumsum(path_lens)[:-1])).astype(np.uint64)
        entries["path_len"] = path_lens
        entries["parent"] = parents
        del parents
        placed = isinstance(ordered[0], EntryRecord)
        for field in ("mode", "mtime_ns", "size") + (("chunk", "offset", "stored_len", "codec", "checksum")
                                                     if placed else ()):
            column = map(operator.attrgetter(field), ordered)
            entries[field] = np.fromiter(column, dtype=ENTRY_DTYPE[field], count=count)
        if not placed:
            entries["chunk"] = NO_CHUNK  # as EntryRecord's defaults: no blob yet
        # Symlink targets follow the paths in the same blob; offset and stored_len locate them.
        for i, rec in enumerate(ordered):
            if stat.S_ISLNK(rec.mode):
                target = rec.link_target.encode("utf-8")
                entries[i]["offset"] = len(paths)
                entries[i]["stored_len"] = len(target)
                entries[i]["size"] = len(target)
                entries[i]["chunk"] = NO_CHUNK
                paths += target
        files = [i for i, rec in enumerate(ordered) if stat.S_ISREG(rec.mode)]
        files.sort(key=encoded_paths.__getitem__)  # UTF-8 byte order is code point order: as Python sorts paths
        self._file_order = np.array(files, dtype=DERIVED_DTYPE)
        hashes = np.fromiter(map(_hash_path, encoded_paths), dtype=HASH_DTYPE, count=count)
        self._order = np.lexsort((np.arange(count), hashes)).astype(ORDER_DTYPE)
        self._path_hash = hashes[self._order]
        self._paths = np.frombuffer(bytes(paths), dtype="u1")
        self.entries = entries

    @classmethod
    def from_arrays(cls, entries: np.ndarray, paths: np.ndarray, path_hash: np.ndarray, order: np.ndarray,
                    file_order: np.ndarray) -> IndexLayout:
        """A layout its caller built in arrays (pack/tree_layout.py, from a walk's columns): the same fields as
        `IndexLayout(records)` sets."""
        layout = cls.__new__(cls)
        layout.entries, layout._paths, layout._path_hash = entries, paths, path_hash
        layout._order, layout._file_order = order, file_order
        return layout

    def entry_of(self, path: str) -> int:
        return int(self._entry_numbers([path])[0])

    def _entry_numbers(self, paths: Sequence[str]) -> np.ndarray:
        """The entry number of each path, which must be in the layout: found as a reader finds it, by its hash in
        the sorted hashes and then its bytes, not in a dict of every path (70 bytes a file, held to the end of a
        pack); a slice of keys at a time, so that the encoded keys of every path are not held at once."""
        found = np.empty(len(paths), dtype=np.int64)
        hashes, order, blob = self._path_hash, self._order, memoryview(self._paths)
        path_off, path_len = self.entries["path_off"], self.entries["path_len"]
        for start in range(0, len(paths), _LOOKUP_SLICE):
            keys = [path.encode("utf-8") for path in paths[start : start + _LOOKUP_SLICE]]
            digests = np.fromiter(map(_hash_path, keys), dtype=HASH_DTYPE, count=len(keys))
            positions = np.searchsorted(hashes, digests)
            for number, (key, digest, position) in enumerate(zip(keys, digests.tolist(), positions.tolist())):
                while position < len(hashes) and int(hashes[position]) == digest:
                    entry = int(order[position])
                    off = int(path_off[entry])
                    if blob[off : off + int(path_len[entry])] == key:
                        break
                    position += 1  # another path of the same hash
                else:
                    raise KeyError(key.decode("utf-8"))
                found[start + number] = entry
        return found

    def place_blobs(self, paths: Sequence[str],
                    **columns: Iterable[int] | np.ndarray | Callable[[], np.ndarray]) -> None:
        """Set where each file's blob lies: `columns` maps entry fields (chunk, offset, stored_len, codec,
        checksum) to their values for `paths`, in the same order, or to a function that makes them, called when
        the field's turn comes (one column made at a time). Every path must be a file of the layout."""
        at = self._entry_numbers(paths)
        for field, values in columns.items():
            values = values() if callable(values) else values
            self.entries[field][at] = (values.astype(ENTRY_DTYPE[field]) if isinstance(values, np.ndarray) else
                                       np.fromiter(values, dtype=ENTRY_DTYPE[field], count=len(paths)))

    def to_bytes(self, chunks: np.ndarray, groups: list[dict[str, Any]], codecs: list[dict[str, Any]],
                 dictionaries: dict[str, bytes], meta: dict[str, Any], blocks: np.ndarray | None = None,
                 block_size: int = 0) -> bytearray:
        """The index file's bytes; the same inputs always give the same bytes (no clocks, no host names).
        `blocks`, the blocks section, is written only when some file is stored in blocks of `block_size`.
        A layout is serialised once: it lets go of its arrays then, so that a pack does not hold them beside the
        file's bytes while it writes and checks those."""
        arrays: dict[str, np.ndarray] = {
            "entries": self.entries,
            "paths": self._paths,
            "path_hash": self._path_hash,
            "hash_order": self._order,
            "chunks": np.asarray(chunks, dtype=CHUNK_DTYPE),
        }
        extra: dict[str, Any] = {}
        if blocks is not None:
            arrays["blocks"] = np.asarray(blocks, dtype=BLOCK_DTYPE)
            extra["block_size"] = block_size
        # 1.2: what a reader would otherwise derive at open, in every process (u32 entry numbers, as bytes).
        arrays["first_child"] = derive_first_child(self.entries["parent"]).view(np.uint8)
        arrays["file_order"] = self._file_order.view(np.uint8)
        for name in sorted(dictionaries):
            arrays[name] = np.frombuffer(dictionaries[name], dtype="u1")
        del self.entries, self._paths, self._path_hash, self._order, self._file_order
        return _serialise(arrays, groups, codecs, meta, extra)


def build_index_bytes(
    records: Iterable[EntryRecord],
    chunks: np.ndarray,
    groups: list[dict[str, Any]],
    codecs: list[dict[str, Any]],
    dictionaries: dict[str, bytes],
    meta: dict[str, Any],
) -> bytes:
    """Serialise an index of records that already say where their blobs are."""
    return IndexLayout(records).to_bytes(chunks, groups, codecs, dictionaries, meta)


def _serialise(
    arrays: dict[str, np.ndarray], groups: list[dict[str, Any]], codecs: list[dict[str, Any]], meta: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> bytearray:
    """The index file's bytes, in one buffer (not copied into a `bytes`: at 10^7 files the index is a gigabyte)."""

    def encode_toc(offsets: dict[str, int]) -> bytes:
        toc = {
            "format": "fanstore-index",
            "version": f"{FORMAT_MAJOR}.{FORMAT_MINOR}",
            "groups": groups,
            "codecs": codecs,
            "sections": {
                name: {"offset": offsets.get(name, 0), "count": len(arr), "dtype": layout_tag(arr.dtype)}
                for name, arr in arrays.items()
            },
            "meta": meta,
            **(extra or {}),
        }
        return json.dumps(toc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    # Offsets change the TOC's length, which moves the offsets: lay out with fixed-width numbers by iterating
    # until the layout is stable (two rounds in practice).
    offsets: dict[str, int] = {}
    for _ in range(8):
        toc_bytes = encode_toc(offsets)
        cursor = _align(INDEX_HEADER_LEN + len(toc_bytes))
        new_offsets = {}
        for name, arr in arrays.items():
            new_offsets[name] = cursor
            cursor = _align(cursor + arr.nbytes)
        if new_offsets == offsets:
            break
        offsets = new_offsets
    # One buffer of the file's final size, each array copied into it once: a body grown piece by piece, then copied
    # behind the header, held the index three times over at its peak (300 B a member, a pack's largest holder).
    index = bytearray(cursor)
    flat = np.frombuffer(index, dtype=np.uint8)
    flat[INDEX_HEADER_LEN : INDEX_HEADER_LEN + len(toc_bytes)] = np.frombuffer(toc_bytes, dtype=np.uint8)
    for name, arr in arrays.items():
        flat[offsets[name] : offsets[name] + arr.nbytes] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    del flat  # a buffer with an export cannot be resized, and the caller's is its own
    body = memoryview(index)[INDEX_HEADER_LEN:]
    INDEX_HEADER.pack_into(index, 0, INDEX_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, INDEX_HEADER_LEN, len(toc_bytes),
                           len(body), xxhash.xxh3_64_intdigest(body))
    body.release()
    return index


def _align(n: int) -> int:
    return (n + SECTION_ALIGN - 1) // SECTION_ALIGN * SECTION_ALIGN


def write_index_atomically(dataset_dir: Path, index_bytes: bytes) -> None:
    """The index is the dataset's commit record: a directory without it is not a dataset."""
    write_atomically(dataset_dir / INDEX_NAME, index_bytes)


def write_packed_index(dataset_dir: Path, index_bytes: bytes) -> None:
    """Write the index a pack built in this process, and stamp it for this node (index_trust) if these very bytes
    pass the full check a reader runs: the first open after a pack then skips the pass over every entry.

    Built is not checked: a pack can write an index the check refuses (a tar member with a 300-byte name), so the
    check runs here, on the bytes written, in a thread while they are written and synced; the cost moves from the
    first open on this node to the pack, mostly hidden behind the write. The stamp names the file as it stands
    after the rename (fstat of the open file), and is left only if nothing wrote to it in between (the same size,
    no new mtime); a file replaced, rewritten or touched later has another identity and is checked again."""
    path = dataset_dir / INDEX_NAME
    body_hash = header_body_hash(index_bytes)
    with ThreadPoolExecutor(1, thread_name_prefix="fanstore-index-check") as checker:
        passed = checker.submit(_passes_full_check, path, index_bytes)
        written, renamed = write_atomically(path, index_bytes)
        checked = passed.result()
    if (checked and body_hash is not None and renamed.st_size == written.st_size == len(index_bytes)
            and renamed.st_mtime_ns == written.st_mtime_ns and renamed.st_ino == written.st_ino):
        index_trust.mark_checked(renamed, body_hash)


def _passes_full_check(path: Path, index_bytes: bytes) -> bool:
    """Whether `index_bytes` pass every check Index.load makes of an index file it finds unstamped."""
    try:
        parse_index(path, index_bytes, full_check=True)
    except FormatError:
        return False
    return True
