"""The index file's bytes, the last thing a pack makes: the walk's entries, laid out while the workers compress,
with each packed file's blob placed from the journal's chunk records, and the chunks and blocks tables."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ..core.format import BLOCK_DTYPE, CHUNK_DTYPE, FLAG_BLOCKED, NO_CHUNK
from ..core.index import IndexLayout
from ..errors import PackError
from .batches import BlockLayout
from .codec_plan import CodecPlan
from .groups import GroupPlan
from .journal import BlockRow, ChunkRecord, FileRows
from .entry_columns import EntryColumns, EntryColumnsBuilder, sorted_by_path
from .tree_layout import layout_of_tree


def index_layout(entries: EntryColumns, leave_out: frozenset[str] = frozenset()) -> IndexLayout:
    """The index's layout from the walk's entries alone: every entry but the files in `leave_out`."""
    if not leave_out:
        return layout_of_tree(entries)
    paths = entries.paths
    return layout_of_tree(entries.take(np.array([n for n in range(len(paths)) if paths[n] not in leave_out],
                                                dtype=np.int64)))


class PlacedIndex(NamedTuple):
    """The index laid out with every packed file's blob placed, and its chunks and blocks sections: all its bytes
    are made of, so that the walk and the chunk records can go before they are made, written and checked."""

    layout: IndexLayout
    chunks: np.ndarray
    blocks: np.ndarray | None

    def to_bytes(self, plan: CodecPlan, groups: GroupPlan, block_layout: BlockLayout, meta: dict[str, Any]
                 ) -> bytearray:
        """The index file's bytes; `meta` is the pack's record (with --codec auto, the selection's too)."""
        return self.layout.to_bytes(self.chunks, groups.table(), plan.rows, plan.dictionaries, meta,
                                    blocks=self.blocks, block_size=block_layout.block_size)


def packed_layout(layout: Future[IndexLayout], records: list[ChunkRecord], files: EntryColumns,
                  others: EntryColumns) -> IndexLayout:
    """The layout of what was packed: `layout`, the walk's, built while the files were compressed; built again
    without the files that turned out not to be packable during the pack (they vanished or changed), which is rare,
    from the walk's `files` (all of them, in plan order) and its `others` (directories and symlinks): the walk itself
    is gone by then."""
    if sum(len(record.files) for record in records) == len(files):  # a file is recorded once
        return layout.result()
    packed_paths = frozenset(path for record in records for path in record.files.paths)
    walk = EntryColumnsBuilder()
    walk.extend(others)
    walk.extend(files)
    return index_layout(sorted_by_path(walk.build()), frozenset(files.paths) - packed_paths)


def blocked_plan_numbers(files: EntryColumns, block_layout: BlockLayout) -> dict[str, int]:
    """The plan number of each file that may be stored in blocks, by path: what placing their blocks needs of the
    plan, taken before the plan goes."""
    return {files.paths[n]: n for n in np.flatnonzero(files.size > block_layout.blocks_above).tolist()}


def placed_index(packed: IndexLayout, records: list[ChunkRecord], number_of: dict[str, int],
                 block_layout: BlockLayout) -> PlacedIndex:
    """The index with each packed file's blob placed from the chunk records, into `packed` (packed_layout's);
    `number_of`: blocked_plan_numbers'."""
    blocked_files = [(record.files.paths[n], size) for record in records for n, size in _blocked_rows(record.files)]
    blocks, first_block_rows = _blocks_table(packed, records, blocked_files, number_of, block_layout)
    for record in records:  # a record at a time, a column at a time: not every file's columns at once
        rows = record.files
        packed.place_blobs(rows.paths, chunk=partial(rows.column, "chunk"),
                           offset=partial(_offsets, rows, first_block_rows),
                           stored_len=partial(rows.column, "stored_len"), codec=partial(rows.column, "codec"),
                           checksum=partial(rows.column, "checksum"), flags=partial(rows.column, "flags"))
    return PlacedIndex(packed, _chunks_table(records), blocks)


def _offsets(rows: FileRows, first_block_rows: dict[str, int]) -> np.ndarray:
    """The rows' blob offsets; a file stored in blocks: its first row in the blocks section."""
    offsets = rows.column("offset")
    for number, _ in _blocked_rows(rows):
        offsets[number] = first_block_rows[rows.paths[number]]
    return offsets


def _blocked_rows(rows: FileRows) -> list[tuple[int, int]]:
    """The rows of files stored in blocks, and their sizes."""
    blocked = np.flatnonzero(rows.column("flags") & FLAG_BLOCKED)
    return list(zip(blocked.tolist(), rows.column("size")[blocked].tolist()))


def _chunks_table(records: list[ChunkRecord]) -> np.ndarray:
    """The `chunks` section: each chunk's size, group, and how many blobs it holds (whole files, and blocks)."""
    chunk_rows = [r for r in records if r.chunk_id != NO_CHUNK]
    chunks = np.zeros(len(chunk_rows), dtype=CHUNK_DTYPE)
    for r in chunk_rows:
        stored_whole = (r.files.column("flags") & FLAG_BLOCKED) == 0
        whole = int(np.count_nonzero((r.files.column("chunk") == r.chunk_id) & stored_whole))
        chunks[r.chunk_id] = (r.size, r.group, whole + len(r.blocks))
    return chunks


def _blocks_table(packed_layout: IndexLayout, records: list[ChunkRecord], blocked_files: list[tuple[str, int]],
                  number_of: dict[str, int], block_layout: BlockLayout) -> tuple[np.ndarray | None, dict[str, int]]:
    """The `blocks` section (None when no file is stored in blocks): the blocks of each file stored in blocks
    (`blocked_files`, their paths and sizes), files in entry order; and each such file's first row in it, by path."""
    blocked_rows = sorted((_BlockedRow(path, size) for path, size in blocked_files),
                          key=lambda row: packed_layout.entry_of(row.path))
    if not blocked_rows:
        return None, {}
    placed: dict[int, list[tuple[int, BlockRow]]] = {}
    for record in records:
        for block_row in record.blocks:
            placed.setdefault(block_row.file, []).append((record.chunk_id, block_row))
    table = np.zeros(sum(block_layout.blocks_of(row.size) for row in blocked_rows), dtype=BLOCK_DTYPE)
    first_rows: dict[str, int] = {}
    cursor = 0
    for row in blocked_rows:
        file_blocks = sorted(placed[number_of[row.path]], key=lambda chunk_and_block: chunk_and_block[1].block)
        if [block.block for _, block in file_blocks] != list(range(block_layout.blocks_of(row.size))):
            raise PackError(f"{row.path}: its blocks in the journal are not the file's blocks 0..n-1; pass --force "
                            "to pack afresh")
        first_rows[row.path] = cursor
        for chunk, block in file_blocks:
            table[cursor] = (block.offset, block.checksum, chunk, block.stored_len, block.codec, b"")
            cursor += 1
    return table, first_rows


class _BlockedRow(NamedTuple):
    """A file stored in blocks, as _blocks_table lays out its blocks."""

    path: str
    size: int
