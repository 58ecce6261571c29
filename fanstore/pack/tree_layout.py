"""The index's layout of a walk's entries, computed on their columns (entry_columns.py): the same arrays as
core.index.IndexLayout builds from one record object per entry, without making one (at 10^6 entries those objects
and their sort keys were the largest thing a pack held while it compressed)."""

from __future__ import annotations

import stat

import numpy as np
import xxhash

from ..core.format import DERIVED_DTYPE, ENTRY_DTYPE, HASH_DTYPE, NO_CHUNK, ORDER_DTYPE
from ..core.index import IndexLayout
from .entry_columns import SLICE, EntryColumns


def layout_of_tree(entries: EntryColumns) -> IndexLayout:
    """The layout of `entries`, in path order with the root ("") first: entries in breadth-first order, children
    by name; paths, then symlink targets, in one blob; the path-hash lookup and the files in path order."""
    parent = _parents(entries)
    ordered, position = _breadth_first(parent)
    count = len(entries)
    layout = np.zeros(count, dtype=ENTRY_DTYPE)
    layout["path_len"] = entries.paths.lengths_of(ordered)
    layout["path_off"] = np.cumsum(layout["path_len"]) - layout["path_len"]
    layout["parent"] = position[parent[ordered]]
    del parent
    for field in ("mode", "mtime_ns", "size"):
        layout[field] = getattr(entries, field)[ordered]
    layout["chunk"] = NO_CHUNK
    targets = bytearray()
    paths_bytes = int(entries.paths.ends[-1])
    # Symlink targets follow the paths in the same blob, in entry order; offset and stored_len locate them.
    for at, target in sorted((int(position[number]), target) for number, target in entries.link_targets.items()):
        encoded = target.encode("utf-8")
        row = layout[at]  # a view of the entry's record
        row["offset"], row["stored_len"], row["size"] = paths_bytes + len(targets), len(encoded), len(encoded)
        targets += encoded
    blob = np.empty(paths_bytes + len(targets), dtype=np.uint8)
    entries.paths.gather_into(ordered, blob)
    blob[paths_bytes:] = np.frombuffer(targets, dtype=np.uint8)
    del targets
    file_order = position[np.flatnonzero(entries.is_file())].astype(DERIVED_DTYPE)  # entries are in path order
    del position
    hashes = np.empty(count, dtype=HASH_DTYPE)
    for start in range(0, count, SLICE):
        piece = entries.paths.encoded_slice(start, min(start + SLICE, count))
        hashes[start : start + len(piece)] = np.fromiter(map(xxhash.xxh3_64_intdigest, piece), dtype=HASH_DTYPE,
                                                         count=len(piece))
    hashes = hashes[ordered]
    del ordered
    order = np.argsort(hashes, kind="stable").astype(ORDER_DTYPE)  # by hash, then by entry
    hashes.sort()  # hashes[order], in place: the layout's peak is not one more column of them
    return IndexLayout.from_arrays(layout, blob, hashes, order, file_order)


def _parents(entries: EntryColumns) -> np.ndarray:
    """Each entry's parent directory's entry number (the root's: 0); ValueError for an entry with none."""
    if not len(entries) or entries.paths.encoded(0) != b"":
        raise ValueError("index records must include the root directory (path '')")
    is_dir = (entries.mode & 0o170000) == stat.S_IFDIR
    directories = {entries.paths.encoded(int(n)): int(n) for n in np.flatnonzero(is_dir)}
    parent = np.zeros(len(entries), dtype=np.int32)  # an index holds fewer than 2^32 entries
    for start in range(1, len(entries), SLICE):
        piece = entries.paths.encoded_slice(start, min(start + SLICE, len(entries)))
        try:
            parent[start : start + len(piece)] = [directories[path.rpartition(b"/")[0]] for path in piece]
        except KeyError:
            orphan = next(path for path in piece if path.rpartition(b"/")[0] not in directories)
            raise ValueError(f"index record {orphan.decode('utf-8')!r} has no parent directory record") from None
    return parent


def _breadth_first(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entry numbers in breadth-first order, each directory's children together in name order (entries are in
    path order, so a stable sort by the parent's place keeps siblings in it); and each entry's place in that order."""
    depth = np.zeros(len(parent), dtype=np.int32)
    while True:
        deeper = depth[parent]
        deeper += 1
        deeper[0] = 0
        if np.array_equal(deeper, depth):
            break
        depth = deeper
    del deeper
    position = np.zeros(len(parent), dtype=np.int32)
    levels = [np.zeros(1, dtype=np.int32)]
    placed = 1
    for level in range(1, int(depth.max(initial=0)) + 1):
        members = np.flatnonzero(depth == level).astype(np.int32)
        members = members[np.argsort(position[parent[members]], kind="stable")]
        position[members] = np.arange(placed, placed + len(members), dtype=np.int32)
        placed += len(members)
        levels.append(members)
    return np.concatenate(levels), position
