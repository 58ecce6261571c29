"""Compress files one by one, in worker processes, handing results back in input order.

Order is what makes a pack deterministic: whatever the worker count, blobs reach the chunk writer in the same
sequence, so chunk boundaries and offsets come out the same.

Compressed bytes come back through shared memory, not the result pipe: a worker writes a batch's blobs into a
slot of one shared buffer and returns only their places. Pickling them through a pipe cost the packing process
four copies of every byte, and that serial work, not compression, was what two workers waited on.
"""

from __future__ import annotations

import mmap
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
_BATCH_BYTES = 8 << 20  # raw bytes of a batch, and the size of a shared slot (a blob is never larger than its file)
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
    stored: bytes | memoryview  # a view into a shared slot when it came from a worker; valid until the next blob
    codec: int
    checksum: int
    raw_size: int


# A blob a worker left in its batch's slot, as a plain tuple (it crosses the process boundary 100,000s of times,
# and a tuple pickles several times faster than a dataclass): number, offset in the slot, stored length, codec
# row, checksum, raw size.
_SlotBlob = tuple[int, int, int, int, int, int]
_TaskFields = tuple[int, str, int, int]  # a FileTask's fields, sent to workers as a tuple for the same reason


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

    def compress_batch_into(self, batch: list[FileTask], slot: memoryview) -> list[_SlotBlob | Skipped]:
        """Compress a batch whose raw bytes fit the slot, leaving the blobs in it one after another."""
        results: list[_SlotBlob | Skipped] = []
        used = 0
        for task in batch:
            result = self.compress(task)
            if isinstance(result, Skipped):
                results.append(result)
                continue
            length = len(result.stored)
            if used + length > len(slot):  # the file grew after the walk; compress() skips that, but be sure
                results.append(Skipped(task.number, Problem(task.path, "changed size during the pack")))
                continue
            slot[used : used + length] = result.stored
            results.append((task.number, used, length, result.codec, result.checksum, result.raw_size))
            used += length
        return results


class _SharedSlots:
    """One shared memory buffer cut into equal slots, one per batch in flight. It is a memfd that workers open
    through /proc, so nothing is left behind in /dev/shm however the pack ends."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._fd = os.memfd_create("fanstore-pack-slots", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, count * slot_bytes)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._map = mmap.mmap(self._fd, count * slot_bytes)
        self.view = memoryview(self._map)
        self.free = list(range(count))

    def slot(self, number: int) -> memoryview:
        return self.view[number * self.slot_bytes : (number + 1) * self.slot_bytes]

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a blob view is still referenced (an exception's traceback); it goes when that does
        os.close(self._fd)


# A worker process compresses with the BlobCompressor its initializer built; these live only in workers.
_worker_compressor: BlobCompressor | None = None
_worker_slots: memoryview | None = None


def _init_worker(root: Path, plan: CodecPlan, slots_path: str | None) -> None:
    global _worker_compressor, _worker_slots
    _worker_compressor = BlobCompressor(root, plan)
    if slots_path is not None:
        try:
            with open(slots_path, "r+b") as slots_file:
                _worker_slots = memoryview(mmap.mmap(slots_file.fileno(), 0))
        except OSError:
            _worker_slots = None  # blobs go back through the pipe; _blobs_in_slot takes either


def _compress_batch_in_worker(
    fields: list[_TaskFields], slot: int | None, slot_bytes: int
) -> list[Blob | Skipped] | list[_SlotBlob | Skipped]:
    assert _worker_compressor is not None, "worker used before its initializer ran"
    batch = [FileTask(*task) for task in fields]
    if slot is None or _worker_slots is None:
        return _worker_compressor.compress_batch(batch)
    return _worker_compressor.compress_batch_into(batch, _worker_slots[slot * slot_bytes : (slot + 1) * slot_bytes])


def _batches(tasks: Iterable[FileTask]) -> Iterator[list[FileTask]]:
    """Batches of at most _BATCH_FILES files and _BATCH_BYTES raw bytes; a larger file is a batch of its own."""
    batch: list[FileTask] = []
    batch_bytes = 0
    for task in tasks:
        if batch and (len(batch) >= _BATCH_FILES or batch_bytes + task.size > _BATCH_BYTES):
            yield batch
            batch, batch_bytes = [], 0
        batch.append(task)
        batch_bytes += task.size
    if batch:
        yield batch


def _open_slots(count: int) -> _SharedSlots | None:
    """Shared slots where the platform has memfd (Linux); elsewhere blobs come back through the pipe."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        return _SharedSlots(count, _BATCH_BYTES)
    except OSError:
        return None


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
    inflight_limit = workers * _BATCHES_PER_WORKER
    slots = _open_slots(inflight_limit)
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                 initargs=(root, plan, slots.path if slots else None)) as pool:
            pending = _batches(tasks)
            inflight: deque[tuple[Future[list], int | None]] = deque()

            def submit(batch: list[FileTask]) -> None:
                fits = slots is not None and slots.free and sum(task.size for task in batch) <= _BATCH_BYTES
                slot = slots.free.pop() if fits else None
                slot_bytes = slots.slot_bytes if slots is not None else 0
                fields = [(task.number, task.path, task.size, task.group) for task in batch]
                inflight.append((pool.submit(_compress_batch_in_worker, fields, slot, slot_bytes), slot))

            try:
                for batch in pending:
                    submit(batch)
                    if len(inflight) >= inflight_limit:
                        break
                while inflight:
                    future, slot = inflight.popleft()
                    results = future.result()
                    if slot is None:
                        yield from results
                    else:
                        yield from _blobs_in_slot(results, slots.slot(slot))  # type: ignore[union-attr]
                        slots.free.append(slot)  # type: ignore[union-attr]
                    next_batch = next(pending, None)
                    if next_batch is not None:
                        submit(next_batch)
            finally:
                for future, _ in inflight:
                    future.cancel()
    finally:
        if slots is not None:
            slots.close()


def _blobs_in_slot(results: list[_SlotBlob | Blob | Skipped], slot: memoryview) -> Iterator[Blob | Skipped]:
    for result in results:
        if type(result) is not tuple:  # a skip, or a blob from a worker that could not map the slots
            yield result
            continue
        number, offset, length, codec, checksum, raw_size = result
        stored = slot[offset : offset + length]
        yield Blob(number, stored, codec, checksum, raw_size)
        stored.release()  # the consumer has written it; the slot is about to be reused
