"""Checks every entry, chunk and block of an index, once per node (index_trust), against everything the read path
will trust without looking again; index_file.py has checked the header, TOC and section layout first.

After these checks a lookup, a listing, a symlink or a blob location taken from the index cannot reach outside the
dataset, index past an array, size a buffer beyond the file, or present the kernel with a name it must not see
('..', '/', NUL). Every failure is one FormatError naming the index file and the field at fault. The checks are
array operations over the whole index, so a million-entry index still opens in a fraction of a second.
"""

from __future__ import annotations

import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError
from .format import (
    CHUNK_HEADER_LEN,
    DERIVED_DTYPE,
    ENTRY_DTYPE,
    FLAG_BLOCKED,
    KNOWN_FLAGS,
    MAX_EXPANSION,
    MAX_FILE_SIZE,
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    NO_CHUNK,
)

_S_IFMT = 0o170000
_KIND_NAMES = {stat.S_IFIFO: "a fifo", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket"}
_SLASH, _DOT = ord("/"), ord(".")
# Entries a round-by-round comparison of paths takes at a time (the arrays of a round: 50 B an entry).
_ROUND_SLICE = 1 << 18
MAX_EQUAL_HASHES = 8  # entries sharing one path hash, at most (see _check_hash_table)


class Refuse:
    """Builds the one-line refusal: the index file, the field, what is wrong."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, field: str, problem: str) -> FormatError:
        return FormatError(f"{self.path}: {field}: {problem}; the index is damaged or was not written by fanstore")


class _Columns:
    """Each entry field as an array: a view of the records' field (no copy), but the small fields read most
    (parent, path_len, mode's kind), made contiguous. Transposing every field made the check hold 84 B an entry
    beside the index's own 64: at the end of a pack, beside the index's bytes, the largest thing it held."""

    def __init__(self, entries: np.ndarray) -> None:
        for name in ENTRY_DTYPE.names:
            setattr(self, name, entries[name])
        self.parent = np.ascontiguousarray(entries["parent"])
        self.path_len = np.ascontiguousarray(entries["path_len"])
        self.count = len(entries)
        self.kind = self.mode & np.uint32(_S_IFMT)


_full_checks = 0  # check_arrays calls in this process: a reader that found its index stamped makes none
_full_checks_lock = threading.Lock()


def full_checks_run() -> int:
    """How many times this process started the pass over every entry (check_arrays): what tests and benchmarks read
    to see whether an open skipped it (index_trust)."""
    return _full_checks


def check_arrays(path: Path, toc: dict[str, Any], sections: dict[str, np.ndarray]) -> None:
    """Every entry, chunk and block field the read path trusts; see the module docstring."""
    global _full_checks
    with _full_checks_lock:
        _full_checks += 1
    refuse = Refuse(path)
    entries, chunks = sections["entries"], sections["chunks"]
    if not 1 <= len(entries) < NO_CHUNK:
        raise refuse("entries", f"holds {len(entries)} rows; it needs the root and at most {NO_CHUNK - 1}")
    if len(chunks) >= NO_CHUNK:
        raise refuse("chunks", f"holds {len(chunks)} rows, more than a chunk id can name")
    columns = _Columns(entries)
    paths = np.asarray(sections["paths"])
    _check_types_and_tree(refuse, columns)
    _check_paths(refuse, columns, paths)
    _check_hash_table(refuse, sections["path_hash"], sections["hash_order"], columns.count)
    _check_chunks(refuse, chunks, len(toc["groups"]))
    none_rows = np.array([row["spec"] == "none" for row in toc["codecs"]])
    blocked = (columns.flags & np.uint8(FLAG_BLOCKED)) != 0
    _check_files(refuse, columns, blocked, chunks, none_rows)
    if "blocks" in sections:
        _check_blocks(refuse, columns, blocked, sections["blocks"], int(toc["block_size"]), chunks, none_rows)
    elif blocked.any():
        raise refuse(_field(int(np.argmax(blocked)), "flags"), "marks a blocked file but the index has no blocks "
                                                               "section")
    _check_directories_and_links(refuse, columns, paths)
    if "first_child" in sections:
        _check_first_child(refuse, columns, sections["first_child"].view(DERIVED_DTYPE))
    if "file_order" in sections:
        _check_file_order(refuse, columns, paths, sections["file_order"].view(DERIVED_DTYPE))


def _check_first_child(refuse: Refuse, columns: _Columns, first_child: np.ndarray) -> None:
    """Each directory's children are the entries its first_child row says (the tree's parents, read another way)."""
    expected = np.searchsorted(columns.parent[1:], np.arange(columns.count + 1)) + 1
    wrong = first_child != expected
    if wrong.any():
        raise refuse(f"first_child[{int(np.argmax(wrong))}]", "does not match the entries' parents")


def _check_file_order(refuse: Refuse, columns: _Columns, paths: np.ndarray, order: np.ndarray) -> None:
    """file_order lists every regular file once, in increasing path byte order (as Python sorts the paths). The
    paths are compared eight bytes a round, as siblings' names are."""
    is_file = columns.kind == stat.S_IFREG
    listed = np.zeros(columns.count, dtype=bool)
    in_range = order < columns.count
    listed[order[in_range]] = True
    if not in_range.all() or len(order) != int(is_file.sum()) or not np.array_equal(listed, is_file):
        raise refuse("file_order", "does not list every regular file of the entries exactly once")
    del is_file, listed, in_range
    if len(order) < 2:
        return
    starts, lengths = columns.path_off.astype(np.int64), columns.path_len.astype(np.int64)
    padded = np.concatenate((np.asarray(paths), np.zeros(8, dtype=np.uint8)))
    big = _windows(padded, ">")
    first_bytes = ~_FIRST_BYTES[::-1]
    first_bytes[0] = 0
    for first in range(1, len(order), _ROUND_SLICE):  # order[pair - 1] must come before order[pair]
        _check_order_rounds(refuse, big, first_bytes, starts, lengths, order,
                            np.arange(first, min(first + _ROUND_SLICE, len(order))))


def _check_order_rounds(refuse: Refuse, big: np.ndarray, first_bytes: np.ndarray, starts: np.ndarray,
                        lengths: np.ndarray, order: np.ndarray, pairs: np.ndarray) -> None:
    """The paths of order[pair - 1] and order[pair], for each of `pairs`, are in order: compared eight bytes a
    round."""
    offset = 0
    while len(pairs):
        earlier, later = order[pairs - 1], order[pairs]
        left_before = np.clip(lengths[earlier] - offset, 0, 8)
        left_after = np.clip(lengths[later] - offset, 0, 8)
        before = big[np.minimum(starts[earlier] + offset, len(big) - 1)] & first_bytes[left_before]
        after = big[np.minimum(starts[later] + offset, len(big) - 1)] & first_bytes[left_after]
        tied = before == after
        # Tied here with only the earlier path going on: the later one is its prefix, so it sorts first.
        wrong = (before > after) | (tied & (lengths[earlier] - offset > 8) & (lengths[later] - offset <= 8))
        if wrong.any():
            raise refuse(f"file_order[{int(pairs[np.argmax(wrong)])}]", "is not in path order")
        pairs = pairs[tied & (lengths[earlier] - offset > 8)]
        offset += 8


def _check_types_and_tree(refuse: Refuse, columns: _Columns) -> None:
    kind = columns.kind
    allowed = (kind == stat.S_IFREG) | (kind == stat.S_IFDIR) | (kind == stat.S_IFLNK)
    if not allowed.all():
        bad = int(np.argmin(allowed))
        name = _KIND_NAMES.get(int(kind[bad]), f"file type {int(kind[bad]):#o}")
        raise refuse(_field(bad, "mode"), f"is {name}; only regular files, directories and symlinks can be served")
    unknown_flags = (columns.flags & np.uint8(0xFF & ~KNOWN_FLAGS)) != 0
    if unknown_flags.any():
        bad = int(np.argmax(unknown_flags))
        raise refuse(_field(bad, "flags"), f"has unknown bits {int(columns.flags[bad]):#x}")
    if kind[0] != stat.S_IFDIR or columns.parent[0] != 0 or columns.path_len[0] != 0:
        raise refuse("entries[0]", "is not the root directory (an empty path, its own parent)")
    parents = columns.parent[1:]
    # Breadth-first order: a parent comes before its children, and parents never decrease.
    wrong = parents >= np.arange(1, columns.count, dtype=np.uint32)
    wrong |= kind[np.where(wrong, 0, parents)] != stat.S_IFDIR  # indexed only once known to be in range
    wrong[1:] |= parents[1:] < parents[:-1]
    if wrong.any():
        bad = int(np.argmax(wrong)) + 1
        raise refuse(_field(bad, "parent"), f"is {int(columns.parent[bad])}, which is not a directory listed "
                                            "before it in breadth-first order")


def _check_paths(refuse: Refuse, columns: _Columns, paths: np.ndarray) -> None:
    """Paths are back to back in entry order, UTF-8 without NUL, each its parent's path, '/', and a valid name,
    siblings in strictly increasing name order (so no two entries share a path)."""
    lengths = columns.path_len.astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if not np.array_equal(columns.path_off, starts):
        bad = int(np.argmax(columns.path_off != starts.astype(np.uint64)))
        raise refuse(_field(bad, "path_off"), f"is {int(columns.path_off[bad])}; paths lie back to back in entry "
                                              f"order, so it must be {int(starts[bad])}")
    total = int(ends[-1])
    if total > len(paths):
        raise refuse("paths", f"holds {len(paths)} bytes, the entries' paths need {total}")
    blob = paths[:total]
    zero = np.flatnonzero(blob == 0)
    if len(zero):
        raise refuse(_field(_entry_at(starts, int(zero[0])), "path"), "contains a NUL byte")
    try:
        str(memoryview(blob), "utf-8")  # decoded in place, not from a copy
    except UnicodeDecodeError as exc:
        raise refuse(_field(_entry_at(starts, exc.start), "path"), "is not valid UTF-8") from None
    padded = np.concatenate((blob, np.zeros(8, dtype=np.uint8)))  # any string's next 8 bytes can be read
    cut = (padded[starts] & 0xC0) == 0x80  # a path starting inside another's multi-byte character
    cut[0] = False
    if cut.any():
        raise refuse(_field(int(np.argmax(cut)), "path"), "starts inside a UTF-8 character")
    if (lengths > MAX_PATH_BYTES).any():
        bad = int(np.argmax(lengths > MAX_PATH_BYTES))
        raise refuse(_field(bad, "path_len"), f"is {int(lengths[bad])}, over {MAX_PATH_BYTES} bytes")
    # Each entry's name is what follows the last '/' of its path; what precedes it must be the parent's path.
    slashes = np.flatnonzero(blob == _SLASH)
    before_end = np.searchsorted(slashes, ends) - 1  # the last slash before each path's end, if any
    last_slash = np.where(before_end >= 0, slashes[np.maximum(before_end, 0)] if len(slashes) else -1, -1)
    has_slash = last_slash >= starts
    name_starts = np.where(has_slash, last_slash + 1, starts)
    name_lens = ends - name_starts
    is_dot, next_is_dot = padded[name_starts] == _DOT, padded[name_starts + 1] == _DOT
    bad_name = (name_lens < 1) | (name_lens > MAX_NAME_BYTES) | ((name_lens == 1) & is_dot)
    bad_name |= (name_lens == 2) & is_dot & next_is_dot
    bad_name[0] = False  # the root has no name
    if bad_name.any():
        raise refuse(_field(int(np.argmax(bad_name)), "path"), "has an empty, '.', '..' or over-long name")
    parents = columns.parent
    dir_lens = np.where(has_slash, name_starts - 1 - starts, 0)
    wrong_dir = (has_slash != (parents != 0)) | (dir_lens != lengths[parents])
    wrong_dir[0] = False
    if wrong_dir.any():
        raise refuse(_field(int(np.argmax(wrong_dir)), "path"), "does not lie in its parent directory's path")
    # What the rounds below do not read goes first: they are the check's peak of memory, beside the index.
    del ends, slashes, before_end, last_slash, has_slash, is_dot, next_is_dot, bad_name, dir_lens, wrong_dir, cut
    _check_prefixes(refuse, padded, starts, parents, lengths)
    _check_sibling_order(refuse, padded, name_starts, name_lens, parents)


def _windows(padded: np.ndarray, byte_order: str) -> np.ndarray:
    """Every 8-byte window of a byte array as one integer (a view, no copy): strings at any offsets then compare
    eight bytes at a time with array operations. `padded` ends in 8 spare bytes."""
    return np.ndarray((len(padded) - 7,), dtype=np.dtype(byte_order + "u8"), buffer=padded, strides=(1,))


# _FIRST_BYTES[n]: the mask of a little-endian window's first n bytes (n = 0..8).
_FIRST_BYTES = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=np.uint64)


def _check_prefixes(refuse: Refuse, padded: np.ndarray, starts: np.ndarray, parents: np.ndarray,
                    lengths: np.ndarray) -> None:
    """Each entry's path begins with its parent's path (the lengths agree already). Compared eight bytes a round,
    each round over the entries whose parent's path is longer still; a slice of entries at a time, so that the
    rounds' arrays are not held for every entry at once."""
    little = _windows(padded, "<")
    for first in range(0, len(parents), _ROUND_SLICE):
        active = np.flatnonzero(lengths[parents[first : first + _ROUND_SLICE]] > 0) + first
        child_starts, parent_starts, parent_lengths = starts[active], starts[parents[active]], lengths[parents[active]]
        offset = 0
        while len(active):
            remaining = parent_lengths - offset
            differ = (little[child_starts + offset] ^ little[parent_starts + offset]) & _FIRST_BYTES[
                np.minimum(remaining, 8)]
            if differ.any():
                raise refuse(_field(int(active[np.argmax(differ != 0)]), "path"), "does not lie in its parent "
                                                                                  "directory's path")
            longer = remaining > 8
            active, child_starts, parent_starts, parent_lengths = (
                active[longer], child_starts[longer], parent_starts[longer], parent_lengths[longer])
            offset += 8


def _check_sibling_order(refuse: Refuse, padded: np.ndarray, name_starts: np.ndarray, name_lens: np.ndarray,
                         parents: np.ndarray) -> None:
    """Siblings are sorted by name bytes, strictly: no two entries share a path, and listings come out in order.
    Names hold no NUL, so zero-padded big-endian 8-byte words order as the names' bytes do. A slice of entries at a
    time, as the prefixes."""
    big = _windows(padded, ">")
    # Keeping a big-endian window's first n bytes is dropping its last 8 - n.
    first_bytes = ~_FIRST_BYTES[::-1]
    first_bytes[0] = 0
    for first in range(2, len(parents), _ROUND_SLICE):
        stop = min(first + _ROUND_SLICE, len(parents))
        # entries whose previous entry is a sibling
        later = np.flatnonzero(parents[first:stop] == parents[first - 1 : stop - 1]) + first
        _check_sibling_rounds(refuse, big, first_bytes, name_starts, name_lens, later)


def _check_sibling_rounds(refuse: Refuse, big: np.ndarray, first_bytes: np.ndarray, name_starts: np.ndarray,
                          name_lens: np.ndarray, later: np.ndarray) -> None:
    """Each of `later` is named after its previous entry, a sibling: compared eight bytes a round."""
    offset = 0
    while len(later):
        earlier = later - 1
        left_before = np.clip(name_lens[earlier] - offset, 0, 8)
        left_after = np.clip(name_lens[later] - offset, 0, 8)
        before = big[np.minimum(name_starts[earlier] + offset, len(big) - 1)] & first_bytes[left_before]
        after = big[np.minimum(name_starts[later] + offset, len(big) - 1)] & first_bytes[left_after]
        if (before > after).any():
            raise refuse(_field(int(later[np.argmax(before > after)]), "path"), "is before its previous sibling in "
                                                                                "name order")
        tied = before == after
        # The same name: both end in this window, tied. (A name ending at a window's last byte, followed by a longer
        # sibling that starts with it, is not a duplicate: the next window tells them apart.)
        ended = tied & (name_lens[earlier] == name_lens[later]) & (name_lens[earlier] - offset <= 8)
        if ended.any():
            raise refuse(_field(int(later[np.argmax(ended)]), "path"), "has the same name as its previous sibling")
        later = later[tied]
        offset += 8


def _check_hash_table(refuse: Refuse, path_hash: np.ndarray, hash_order: np.ndarray, count: int) -> None:
    if len(path_hash) != count or len(hash_order) != count:
        raise refuse("path_hash", f"has {len(path_hash)} rows and hash_order {len(hash_order)}; both need {count}")
    if count > 1 and (path_hash[1:] < path_hash[:-1]).any():
        raise refuse("path_hash", "is not sorted")
    if count > MAX_EQUAL_HASHES:
        # A lookup compares the path of each entry that shares its hash: a long run of one value (a crafted table)
        # made one path's every lookup a scan of the run. Three paths sharing an xxh3-64 hash is all but impossible.
        ties = np.flatnonzero(path_hash[1:] == path_hash[:-1])  # row i ties with row i + 1; none in a real pack
        if len(ties) >= MAX_EQUAL_HASHES:
            starts = np.flatnonzero(np.diff(ties, prepend=-2) != 1)  # where each run of ties begins, in `ties`
            runs = np.diff(starts, append=len(ties)) + 1  # rows in each run
            if runs.max() > MAX_EQUAL_HASHES:
                longest = int(np.argmax(runs))
                raise refuse("path_hash", f"holds {int(runs[longest])} equal values in a row from row "
                                          f"{int(ties[starts[longest]])} (at most {MAX_EQUAL_HASHES})")
    if (hash_order >= count).any():
        raise refuse("hash_order", f"names an entry past the last ({count - 1})")
    seen = np.zeros(count, dtype=bool)
    seen[hash_order] = True
    if not seen.all():
        raise refuse("hash_order", "is not a permutation of the entries")


def _check_chunks(refuse: Refuse, chunks: np.ndarray, group_count: int) -> None:
    small = chunks["size"] < CHUNK_HEADER_LEN
    if small.any():
        raise refuse(f"chunks[{int(np.argmax(small))}].size", f"is smaller than a chunk header ({CHUNK_HEADER_LEN})")
    bad_group = chunks["group"] >= group_count
    if bad_group.any():
        raise refuse(f"chunks[{int(np.argmax(bad_group))}].group", f"names no group (there are {group_count})")


def _check_blobs(refuse: Refuse, where: str, numbers: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
                 stored_len: np.ndarray, codec: np.ndarray, raw_sizes: np.ndarray, chunks: np.ndarray,
                 none_rows: np.ndarray) -> None:
    """Blobs (chunk, offset, stored_len, codec columns; `numbers` name their rows in messages) lie inside their
    chunk, and their raw size is one their codec can produce from that many stored bytes."""
    problems = [
        (chunk >= len(chunks), "chunk", f"names no chunk (there are {len(chunks)})"),
        (codec >= len(none_rows), "codec", f"names no codec (there are {len(none_rows)})"),
        (stored_len == 0, "stored_len", "is 0 for a blob"),
    ]
    for wrong, field, problem in problems:
        if wrong.any():
            raise refuse(f"{where}[{int(numbers[np.argmax(wrong)])}].{field}", problem)
    sizes = chunks["size"][chunk]
    stored = stored_len.astype(np.uint64)
    outside = (offset < CHUNK_HEADER_LEN) | (offset > sizes) | (stored > sizes - np.minimum(offset, sizes))
    if outside.any():
        bad = int(np.argmax(outside))
        raise refuse(f"{where}[{int(numbers[bad])}].offset", f"{int(offset[bad])} + {int(stored[bad])} bytes lies "
                                                             f"outside chunk {int(chunk[bad])}")
    raw = raw_sizes.astype(np.uint64)
    wrong_size = np.where(none_rows[codec], raw != stored, raw // np.uint64(MAX_EXPANSION) > stored)
    if wrong_size.any():
        bad = int(np.argmax(wrong_size))
        raise refuse(f"{where}[{int(numbers[bad])}].stored_len",
                     f"{int(stored[bad])} stored bytes cannot hold {int(raw[bad])} raw bytes with its codec")


def _check_files(refuse: Refuse, columns: _Columns, blocked: np.ndarray, chunks: np.ndarray,
                 none_rows: np.ndarray) -> None:
    is_file = columns.kind == stat.S_IFREG
    large = is_file & (columns.size > MAX_FILE_SIZE)
    if large.any():
        raise refuse(_field(int(np.argmax(large)), "size"), f"is over {MAX_FILE_SIZE} bytes")
    if (blocked & ~is_file).any():
        raise refuse(_field(int(np.argmax(blocked & ~is_file)), "flags"), "marks a non-file as blocked")
    whole = is_file & ~blocked
    empty = whole & (columns.size == 0)
    wrong_empty = empty & ((columns.chunk != NO_CHUNK) | (columns.stored_len != 0))
    if wrong_empty.any():
        raise refuse(_field(int(np.argmax(wrong_empty)), "chunk"), "an empty file has no blob")
    with_blob = whole & ~empty
    numbers = np.flatnonzero(with_blob)
    _check_blobs(refuse, "entries", numbers, columns.chunk[with_blob], columns.offset[with_blob],
                 columns.stored_len[with_blob], columns.codec[with_blob], columns.size[with_blob], chunks, none_rows)


def _check_blocks(refuse: Refuse, columns: _Columns, blocked: np.ndarray, blocks: np.ndarray, block_size: int,
                  chunks: np.ndarray, none_rows: np.ndarray) -> None:
    """Blocked files own consecutive rows of `blocks`, in entry order, one per `block_size` raw bytes."""
    files = np.flatnonzero(blocked)
    sizes = columns.size[files].astype(np.int64)
    if (sizes == 0).any():
        raise refuse(_field(int(files[np.argmax(sizes == 0)]), "size"), "is 0 for a blocked file")
    counts = (sizes + block_size - 1) // block_size
    firsts = np.cumsum(counts) - counts
    if not np.array_equal(columns.offset[files], firsts):
        bad = int(np.argmax(columns.offset[files] != firsts.astype(np.uint64)))
        raise refuse(_field(int(files[bad]), "offset"), f"is block row {int(columns.offset[files[bad]])}; blocks "
                                                        f"follow in entry order, so it must be {int(firsts[bad])}")
    if int(counts.sum()) != len(blocks):
        raise refuse("blocks", f"holds {len(blocks)} rows, the blocked files need {int(counts.sum())}")
    if not len(blocks):
        return
    if np.ascontiguousarray(blocks["reserved"]).view(np.uint8).any():
        raise refuse("blocks", "reserved bytes are not zero")
    no_codec = columns.codec[files] >= len(none_rows)
    if no_codec.any():
        raise refuse(_field(int(files[np.argmax(no_codec)]), "codec"), "names no codec")
    # Every block holds block_size raw bytes but the last of its file, which holds the rest.
    raw = np.full(len(blocks), block_size, dtype=np.int64)
    raw[firsts + counts - 1] = sizes - (counts - 1) * block_size
    _check_blobs(refuse, "blocks", np.arange(len(blocks)), blocks["chunk"], blocks["offset"], blocks["stored_len"],
                 blocks["codec"], raw, chunks, none_rows)
    stored_sums = np.add.reduceat(blocks["stored_len"].astype(np.uint64), firsts)
    wrong = ((columns.chunk[files] != blocks["chunk"][firsts]) | (columns.stored_len[files] != stored_sums)
             | (columns.checksum[files] != 0))
    if wrong.any():
        raise refuse(_field(int(files[np.argmax(wrong)]), "chunk"), "chunk, stored_len and checksum of a blocked "
                                                                    "file must be its first block's chunk, its "
                                                                    "blocks' total and 0")


def _check_directories_and_links(refuse: Refuse, columns: _Columns, paths: np.ndarray) -> None:
    """Directories have no contents; symlink targets lie in the path blob and stay inside the dataset."""
    wrong_dir = (columns.kind == stat.S_IFDIR) & ((columns.size != 0) | (columns.chunk != NO_CHUNK)
                                                 | (columns.flags != 0))
    if wrong_dir.any():
        raise refuse(_field(int(np.argmax(wrong_dir)), "size"), "a directory has no size, chunk or flags")
    links = np.flatnonzero(columns.kind == stat.S_IFLNK)
    if not len(links):
        return
    total = int(columns.path_len.sum(dtype=np.int64))
    offsets, lengths = columns.offset[links], columns.stored_len[links]
    wrong = ((columns.chunk[links] != NO_CHUNK) | (lengths == 0) | (lengths > MAX_PATH_BYTES)
             | (columns.size[links] != lengths) | (offsets < total) | (offsets > len(paths))
             | (lengths > len(paths) - np.minimum(offsets, len(paths))))
    if wrong.any():
        raise refuse(_field(int(links[np.argmax(wrong)]), "offset"), "a symlink target must lie in the path blob "
                                                                     f"after the paths, 1 to {MAX_PATH_BYTES} "
                                                                     "bytes, and be its size")
    blob = paths.tobytes()
    depths = _depths(columns, paths)
    for entry, offset, length in zip(links.tolist(), offsets.tolist(), lengths.tolist()):
        problem = link_target_problem(blob[offset: offset + length], int(depths[entry]) - 1)
        if problem:
            raise refuse(_field(entry, "symlink target"), problem)


def link_target_problem(target: bytes, link_dir_depth: int) -> str | None:
    """Why a symlink target could lead out of the dataset, or None when it cannot: relative, normalized, any '..'
    leading and no more of them than the link's directory is deep (then the rest only descends, and each link met
    on the way obeys the same rule). The packer stores every link in this form."""
    if b"\0" in target:
        return "contains a NUL byte"
    try:
        target.decode("utf-8")
    except UnicodeDecodeError:
        return "is not valid UTF-8"
    if target == b".":
        return None
    if target.startswith(b"/"):
        return "is absolute"
    parts = target.split(b"/")
    ups = 0
    while ups < len(parts) and parts[ups] == b"..":
        ups += 1
    if any(part in (b"", b".", b"..") for part in parts[ups:]):
        return "is not normalized (empty, '.' or inner '..' components)"
    if ups > link_dir_depth:
        return f"climbs {ups} levels from a directory {link_dir_depth} deep: it leaves the dataset"
    return None


def _depths(columns: _Columns, paths: np.ndarray) -> np.ndarray:
    """Each entry's depth: 0 for the root, 1 + its number of '/' otherwise."""
    starts = columns.path_off.astype(np.int64)
    ends = starts + columns.path_len
    slashes = np.flatnonzero(paths[: int(ends[-1])] == _SLASH)
    depth = np.searchsorted(slashes, ends) - np.searchsorted(slashes, starts) + 1
    depth[0] = 0
    return depth


def _entry_at(starts: np.ndarray, byte: int) -> int:
    """The entry whose path holds byte `byte` of the path blob."""
    return int(np.searchsorted(starts, byte, side="right")) - 1


def _field(entry: int, field: str) -> str:
    return f"entries[{entry}].{field}"


