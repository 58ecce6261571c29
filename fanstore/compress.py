"""Compress files one by one, in worker processes, handing results back in plan order, a batch at a time.

Order is what makes a pack deterministic: whatever the worker count, blobs reach the chunk writer in the same
sequence, so chunk boundaries and offsets come out the same.

The packing process is the one serial part, so it does as little per file as it can. Workers get the plan's
paths once, at start, and a batch is just a range of plan positions. Compressed bytes come back through shared
memory, not the result pipe: a worker writes a batch's blobs one after another into a slot of one shared
buffer and returns only their places, and the chunk writer copies a whole run of them at once. Pickling blobs
through a pipe cost the packing process four copies of every byte, and per-file objects cost it more than
compressing a small file; that serial work, not compression, was what two workers waited on.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import xxhash

from .codec_plan import NONE_ROW, CodecPlan
from .kinds import HEAD_BYTES, file_kind
from .walk import Problem

_BATCH_FILES = 256
_BATCH_BYTES = 8 << 20  # raw bytes of a batch, and the size of a slot (a blob is never larger than its file)
_BATCHES_PER_WORKER = 4


@dataclass(frozen=True, slots=True)
class PlanFiles:
    """The files of a pack in plan order, as workers need them: sent to each worker once."""

    paths: Sequence[str]
    sizes: Sequence[int]  # as the walk saw them
    groups: Sequence[int]


@dataclass(frozen=True, slots=True)
class Skipped:
    """A planned file that could not be packed (it changed, vanished or cannot be read)."""

    number: int
    problem: Problem


# A compressed file, as a plain tuple (it crosses the process boundary 100,000s of times, and a tuple pickles
# several times faster than a dataclass): plan number, offset of its blob in the batch's `blobs`, stored length,
# codec row, checksum of the stored bytes, raw size.
SlotBlob = tuple[int, int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class CompressedBatch:
    """One batch's results in plan order. `blobs` holds every blob back to back; it is valid only until the
    consumer asks for the next batch (its memory is reused)."""

    results: list[SlotBlob | Skipped]
    blobs: memoryview


class BlobCompressor:
    """Reads a file, checks it is still the size the walk saw, compresses it, checksums the stored bytes."""

    def __init__(self, root: Path, plan: CodecPlan, files: PlanFiles) -> None:
        self.root = root
        self.plan = plan
        self.files = files
        self._sniffed_groups = frozenset(g for g in plan.by_group if plan.depends_on_kind(g))

    def compress(self, number: int) -> tuple[bytes, int, int] | Skipped:
        """(stored bytes, codec row, raw size) of plan file `number`, or why it was skipped."""
        path = self.files.paths[number]
        try:
            with open(os.path.join(self.root, path), "rb") as src:
                raw = src.read()
        except FileNotFoundError:
            return Skipped(number, Problem(path, "vanished during the pack"))
        except IsADirectoryError:
            return Skipped(number, Problem(path, "became a directory during the pack"))
        except OSError as exc:
            return Skipped(number, Problem(path, f"cannot read: {exc.strerror}"))
        if len(raw) != self.files.sizes[number]:
            reason = f"changed size during the pack ({self.files.sizes[number]} bytes at walk, {len(raw)} now)"
            return Skipped(number, Problem(path, reason))
        group = self.files.groups[number]
        kind = file_kind(path, raw[:HEAD_BYTES]) if group in self._sniffed_groups else ""
        codec = self.plan.row_for(group, kind)
        stored = self.plan.codecs[codec].encode(raw) if codec != NONE_ROW else raw
        if len(stored) >= len(raw):
            stored, codec = raw, NONE_ROW
        return stored, codec, len(raw)

    def compress_batch_into(self, first: int, end: int, slot: memoryview) -> list[SlotBlob | Skipped]:
        """Compress the non-empty files of plan range [first, end), leaving their blobs in `slot` back to back."""
        results: list[SlotBlob | Skipped] = []
        used = 0
        sizes = self.files.sizes
        for number in range(first, end):
            if sizes[number] == 0:
                continue  # empty files have no blob; the packer records them itself
            done = self.compress(number)
            if isinstance(done, Skipped):
                results.append(done)
                continue
            stored, codec, raw_size = done
            length = len(stored)
            if used + length > len(slot):  # cannot happen (compress() skips a file that grew), but be sure
                results.append(Skipped(number, Problem(self.files.paths[number], "changed size during the pack")))
                continue
            slot[used : used + length] = stored
            results.append((number, used, length, codec, xxhash.xxh3_64_intdigest(stored), raw_size))
            used += length
        return results


def batch_ranges(sizes: Sequence[int], start: int) -> Iterator[tuple[int, int, int]]:
    """Plan ranges [first, end) from `start` on, with their raw bytes: each of at most _BATCH_FILES non-empty files
    and _BATCH_BYTES raw bytes; a file larger than that is a batch of its own, with a buffer sized for it."""
    first, count, batch_bytes = start, 0, 0
    for number in range(start, len(sizes)):
        size = sizes[number]
        if size == 0:
            continue
        if count and (count >= _BATCH_FILES or batch_bytes + size > _BATCH_BYTES):
            yield first, number, batch_bytes
            first, count, batch_bytes = number, 0, 0
        count += 1
        batch_bytes += size
    if first < len(sizes):
        yield first, len(sizes), batch_bytes


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


class WorkerPool:
    """Compression worker processes, started before the walk (which they share) so that their start-up overlaps
    it instead of adding to the serial part of a pack.

    They are forked when this process runs no other thread: forking is then safe, and a forked worker is ready in
    milliseconds with the codecs already imported. A fresh interpreter from the forkserver, the fallback, takes
    about 0.4 s of CPU to import them, which on two cores is taken from the walk.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        start_method = "fork" if threading.active_count() == 1 and os.name == "posix" else "forkserver"
        self.executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(start_method))
        for _ in range(workers):
            self.executor.submit(_warm_up)  # starts every process now

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


class _JobFile:
    """What every batch of one pack needs (root, codec plan, plan files), pickled once into a memfd that workers
    read through /proc the first time they see its token."""

    def __init__(self, job: tuple[Path, CodecPlan, PlanFiles]) -> None:
        self.token = os.urandom(8).hex()
        self._fd = os.memfd_create("fanstore-pack-job", os.MFD_CLOEXEC)
        os.write(self._fd, pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"

    def close(self) -> None:
        os.close(self._fd)


# The job a worker process is compressing for, loaded on its first batch; these live only in workers.
_worker_token: str | None = None
_worker_compressor: BlobCompressor | None = None
_worker_slots: memoryview | None = None


def _warm_up() -> None:
    return None


def _load_job(token: str, job_path: str, slots_path: str) -> BlobCompressor:
    global _worker_token, _worker_compressor, _worker_slots
    if token != _worker_token or _worker_compressor is None:
        with open(job_path, "rb") as job_file:
            root, plan, files = pickle.load(job_file)
        with open(slots_path, "r+b") as slots_file:
            _worker_slots = memoryview(mmap.mmap(slots_file.fileno(), 0))
        _worker_compressor, _worker_token = BlobCompressor(root, plan, files), token
    return _worker_compressor


def _compress_in_worker(token: str, job_path: str, slots_path: str, first: int, end: int, slot: int | None,
                        slot_bytes: int) -> tuple[list[SlotBlob | Skipped], bytes | None]:
    """A batch into shared slot `slot`; with no slot (a file larger than one), its blobs come back as bytes."""
    compressor = _load_job(token, job_path, slots_path)
    if slot is not None:
        assert _worker_slots is not None
        into = _worker_slots[slot * slot_bytes : (slot + 1) * slot_bytes]
        return compressor.compress_batch_into(first, end, into), None
    own = memoryview(bytearray(sum(compressor.files.sizes[first:end])))
    results = compressor.compress_batch_into(first, end, own)
    used = max((r[1] + r[2] for r in results if type(r) is tuple), default=0)
    return results, bytes(own[:used])


def compress_in_order(
    root: Path, plan: CodecPlan, files: PlanFiles, start: int, pool: WorkerPool | None
) -> Iterator[CompressedBatch]:
    """Batches of plan files from `start` on, in order; at most a few per worker are in flight, so memory stays
    bounded. With no pool the packing process compresses them itself, the same way."""
    if pool is None:
        compressor = BlobCompressor(root, plan, files)
        slot = memoryview(bytearray(_BATCH_BYTES))
        for first, end, raw_bytes in batch_ranges(files.sizes, start):
            blobs = slot if raw_bytes <= _BATCH_BYTES else memoryview(bytearray(raw_bytes))
            yield CompressedBatch(compressor.compress_batch_into(first, end, blobs), blobs)
        return
    inflight_limit = pool.workers * _BATCHES_PER_WORKER
    job = _JobFile((root, plan, files))
    slots = _SharedSlots(inflight_limit, _BATCH_BYTES)
    inflight: deque[tuple[Future[tuple[list, bytes | None]], int | None]] = deque()

    def submit(first: int, end: int, raw_bytes: int) -> None:
        slot = slots.free.pop() if raw_bytes <= _BATCH_BYTES else None
        inflight.append((pool.executor.submit(_compress_in_worker, job.token, job.path, slots.path, first, end,
                                              slot, slots.slot_bytes), slot))

    try:
        ranges = batch_ranges(files.sizes, start)
        for batch in ranges:
            submit(*batch)
            if len(inflight) >= inflight_limit:
                break
        while inflight:
            future, slot = inflight.popleft()
            results, own = future.result()
            if slot is None:
                yield CompressedBatch(results, memoryview(own or b""))
            else:
                with slots.slot(slot) as blobs:
                    yield CompressedBatch(results, blobs)
                slots.free.append(slot)
            next_range = next(ranges, None)
            if next_range is not None:
                submit(*next_range)
    finally:
        for future, _ in inflight:
            future.cancel()
        for future, _ in inflight:  # a worker may still be writing into a slot
            if not future.cancelled():
                future.exception()
        slots.close()
        job.close()
