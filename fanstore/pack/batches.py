"""The files of a pack in plan order, as the workers see them, cut into batches: a batch is what one worker
compresses at a time and what the packing process hands on, in order, to the chunk builder.

A batch is just a range of plan positions (runs of whole files, or runs of one large file's blocks), so that what
crosses to a worker per batch is a few integers; its raw bytes are read by the worker, or, from archives, by the
packing process (read_batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Protocol, Sequence

import numpy as np

_BATCH_FILES = 256
BATCH_BYTES = 8 << 20  # raw bytes of a batch, and the size of a slot (a blob is never larger than its raw bytes)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Which files are stored as blocks, and how large a block is (output-defining options of a pack)."""

    blocks_above: int  # a file larger than this is stored in blocks
    block_size: int

    def blocks_of(self, size: int) -> int:
        """How many blocks a file of `size` bytes is stored in; 0 when it is stored whole."""
        return -(-size // self.block_size) if size > self.blocks_above else 0


@dataclass(frozen=True, slots=True)
class PlanFiles:
    """The files of a pack in plan order, as workers need them: sent to each worker once. Sizes, inodes and
    times are the walk's: a worker packs a file only if it is still that file, unchanged."""

    paths: Sequence[str]
    sizes: Sequence[int]
    groups: Sequence[int]
    inos: Sequence[int]
    mtimes: Sequence[int]
    ctimes: Sequence[int]
    layout: BlockLayout


class Batch(NamedTuple):
    """Plan files [first, end) stored whole, or blocks [first_block, end_block) of plan file `first` (then
    end == first + 1 and end_block > 0)."""

    first: int
    end: int
    first_block: int
    end_block: int
    raw_bytes: int


class RawFeed(Protocol):
    """Where the packing process reads plan files' bytes from when workers cannot (archive_feed.ArchiveFeed)."""

    head: bytes

    def read_range(self, number: int, offset: int, into: memoryview) -> str: ...


def read_batch(feed: RawFeed, files: PlanFiles, batch: Batch, into: memoryview) -> tuple[bytes, dict[int, str]]:
    """A batch's raw bytes into `into`, back to back; returns the sniff head of a blocks batch's file and the
    files that could not be read, with why."""
    if batch.end_block:
        failure = feed.read_range(batch.first, batch.first_block * files.layout.block_size, into[: batch.raw_bytes])
        return feed.head, ({batch.first: failure} if failure else {})
    failed: dict[int, str] = {}
    used = 0
    for number in range(batch.first, batch.end):
        size = int(files.sizes[number])
        if size:
            failure = feed.read_range(number, 0, into[used : used + size])
            if failure:
                failed[number] = failure
            used += size
    return b"", failed


def batch_ranges(files: PlanFiles, start: int, start_block: int = 0) -> Iterator[Batch]:
    """Batches from plan position (start, start_block) on: runs of whole files, each of at most _BATCH_FILES
    non-empty files and BATCH_BYTES raw bytes, and runs of at most BATCH_BYTES of a large file's blocks. A
    whole file larger than a batch is a batch of its own, with a buffer sized for it."""
    sizes, layout = files.sizes, files.layout
    if start_block:
        yield from _block_batches(start, start_block, int(sizes[start]), layout)
        start += 1
    first, count, batch_bytes = start, 0, 0
    for number, size in enumerate(_ints(sizes, start), start):
        if size == 0:
            continue
        if layout.blocks_of(size):
            if count:
                yield Batch(first, number, 0, 0, batch_bytes)
            yield from _block_batches(number, 0, size, layout)
            first, count, batch_bytes = number + 1, 0, 0
            continue
        if count and (count >= _BATCH_FILES or batch_bytes + size > BATCH_BYTES):
            yield Batch(first, number, 0, 0, batch_bytes)
            first, count, batch_bytes = number, 0, 0
        count += 1
        batch_bytes += size
    if count:
        yield Batch(first, len(sizes), 0, 0, batch_bytes)


def _block_batches(number: int, first_block: int, size: int, layout: BlockLayout) -> Iterator[Batch]:
    per_batch = max(1, BATCH_BYTES // layout.block_size)
    total = layout.blocks_of(size)
    for block in range(first_block, total, per_batch):
        end = min(total, block + per_batch)
        yield Batch(number, number + 1, block, end, min(size, end * layout.block_size) - block * layout.block_size)


def _ints(values: Sequence[int], start: int) -> Iterator[int]:
    """values[start:] as Python ints, a slice at a time (numpy's elements are slower to loop over)."""
    for first in range(start, len(values), 1 << 16):
        yield from np.asarray(values[first : first + (1 << 16)], dtype=np.int64).tolist()
