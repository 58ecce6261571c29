"""Compress files one by one, in worker processes, handing results back in input order.

Order is what makes a pack deterministic: whatever the worker count, blobs reach the chunk writer in the same
sequence, so chunk boundaries and offsets come out the same.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import xxhash

from selector.kinds import HEAD_BYTES, file_kind

from .codec_plan import NONE_ROW, CodecPlan
from .walk import Problem
_BATCH_FILES = 256
_BATCH_BYTES = 8 << 20
_BATCHES_PER_WORKER = 4


@dataclass(frozen=True, slots=True)
class FileTask:
    number: int  # position in the pack plan
    path: str
    size: int  # as the walk saw it
    group: int


@dataclass(frozen=True, slots=True)
class Skipped:
    """A planned file that could not be packed (it changed, vanished or cannot be read)."""

    number: int
    problem: Problem


@dataclass(frozen=True, slots=True)
class Blob:
    number: int
    stored: bytes
    codec: int
    checksum: int
    raw_size: int


class BlobCompressor:
    """Reads a file, checks it is still the size the walk saw, compresses it, checksums the stored bytes."""

    def __init__(self, root: Path, plan: CodecPlan) -> None:
        self.root = root
        self.plan = plan

    def compress(self, task: FileTask) -> Blob | Skipped:
        try:
            with open(os.path.join(self.root, task.path), "rb") as src:
                raw = src.read()
        except FileNotFoundError:
            return Skipped(task.number, Problem(task.path, "vanished during the pack"))
        except IsADirectoryError:
            return Skipped(task.number, Problem(task.path, "became a directory during the pack"))
        except OSError as exc:
            return Skipped(task.number, Problem(task.path, f"cannot read: {exc.strerror}"))
        if len(raw) != task.size:
            reason = f"changed size during the pack ({task.size} bytes at walk, {len(raw)} now)"
            return Skipped(task.number, Problem(task.path, reason))
        kind = file_kind(task.path, raw[:HEAD_BYTES]) if self.plan.depends_on_kind(task.group) else ""
        codec = self.plan.row_for(task.group, kind)
        stored = self.plan.codecs[codec].encode(raw) if codec != NONE_ROW else raw
        if len(stored) >= len(raw):
            stored, codec = raw, NONE_ROW
        return Blob(task.number, stored, codec, xxhash.xxh3_64_intdigest(stored), len(raw))

    def compress_batch(self, batch: list[FileTask]) -> list[Blob | Skipped]:
        return [self.compress(task) for task in batch]


# A worker process compresses with the BlobCompressor its initializer built; this lives only in workers.
_worker_compressor: BlobCompressor | None = None


def _init_worker(root: Path, plan: CodecPlan) -> None:
    global _worker_compressor
    _worker_compressor = BlobCompressor(root, plan)


def _compress_batch_in_worker(batch: list[FileTask]) -> list[Blob | Skipped]:
    assert _worker_compressor is not None, "worker used before its initializer ran"
    return _worker_compressor.compress_batch(batch)


def _batches(tasks: Iterable[FileTask]) -> Iterator[list[FileTask]]:
    batch: list[FileTask] = []
    batch_bytes = 0
    for task in tasks:
        batch.append(task)
        batch_bytes += task.size
        if len(batch) >= _BATCH_FILES or batch_bytes >= _BATCH_BYTES:
            yield batch
            batch, batch_bytes = [], 0
    if batch:
        yield batch


def compress_in_order(
    root: Path, plan: CodecPlan, tasks: Iterable[FileTask], workers: int
) -> Iterator[Blob | Skipped]:
    """Results in task order; at most a few batches per worker are in flight, so memory stays bounded."""
    if workers <= 1:
        compressor = BlobCompressor(root, plan)
        for task in tasks:
            yield compressor.compress(task)
        return
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(root, plan)) as pool:
        pending = _batches(tasks)
        inflight: deque[Future[list[Blob | Skipped]]] = deque()
        try:
            for batch in pending:
                inflight.append(pool.submit(_compress_batch_in_worker, batch))
                if len(inflight) >= workers * _BATCHES_PER_WORKER:
                    break
            while inflight:
                results = inflight.popleft().result()
                next_batch = next(pending, None)
                if next_batch is not None:
                    inflight.append(pool.submit(_compress_batch_in_worker, next_batch))
                yield from results
        finally:
            for future in inflight:
                future.cancel()
