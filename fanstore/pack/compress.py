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

import itertools
import mmap
import multiprocessing
import os
import pickle
import signal
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..core.libc import prctl
from .batches import BATCH_BYTES, Batch, PlanFiles, RawFeed, batch_ranges, read_batch
from .blob_compressor import BlobCompressor, SlotBlob, Skipped, Supplied
from .codec_plan import CodecPlan

_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
_BATCHES_PER_WORKER = 4


@dataclass(frozen=True, slots=True)
class CompressedBatch:
    """One batch's results in plan order. `blobs` holds every blob back to back; it is valid only until the
    consumer asks for the next batch (its memory is reused)."""

    results: list[SlotBlob | Skipped]
    blobs: memoryview


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
        forked = threading.active_count() == 1 and os.name == "posix"
        before = set(multiprocessing.active_children())
        try:
            self.executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork" if forked else "forkserver"),
                initializer=_die_with_parent, initargs=(os.getpid() if forked else None,))
            for _ in range(workers):
                self.executor.submit(_warm_up)  # starts every process now
        except BaseException:
            # A Ctrl-C while the workers start: those started wait for work that never comes, and the exit waited
            # for them for good (multiprocessing joins its children). They are ended here, each once forked.
            for worker in set(multiprocessing.active_children()) - before:
                worker.kill()
                worker.join()
            raise

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
_worker_raw_slots: memoryview | None = None


def _warm_up() -> None:
    return None


def _die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel kill this worker when its parent dies (Linux), so a packer killed with SIGKILL leaves no
    worker behind; a forked worker whose packer died before this ran exits now. A worker of the forkserver dies
    with the forkserver, which exits when the packer goes.

    Ctrl-C reaches the whole process group: the packer decides what to do (it shuts the pool down), so workers
    ignore SIGINT; and SIGTERM, which the executor sends to workers of a broken pool, ends a worker quietly
    rather than through the handler a forked worker inherits from the packer's CLI."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not prctl(_PR_SET_PDEATHSIG, signal.SIGKILL):
        return  # no prctl (not Linux): workers still end when the pool is shut down
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _load_job(token: str, job_path: str, slots_path: str, raw_slots_path: str | None) -> BlobCompressor:
    global _worker_token, _worker_compressor, _worker_slots, _worker_raw_slots
    if token != _worker_token or _worker_compressor is None:
        with open(job_path, "rb") as job_file:
            root, plan, files = pickle.load(job_file)
        with open(slots_path, "r+b") as slots_file:
            _worker_slots = memoryview(mmap.mmap(slots_file.fileno(), 0))
        _worker_raw_slots = None
        if raw_slots_path is not None:
            with open(raw_slots_path, "rb") as raw_file:
                _worker_raw_slots = memoryview(mmap.mmap(raw_file.fileno(), 0, prot=mmap.PROT_READ))
        _worker_compressor, _worker_token = BlobCompressor(root, plan, files), token
    return _worker_compressor


# What the packing process read for a batch (from archives): the raw slot holding its bytes (None: `data` holds
# them, a whole file larger than a slot), the sniff head and the files that failed.
RawBatch = tuple[int | None, bytes | None, bytes, dict[int, str]]


def _compress_in_worker(token: str, job_path: str, slots_path: str, batch: Batch, slot: int | None,
                        slot_bytes: int, raw_slots_path: str | None = None, raw: RawBatch | None = None
                        ) -> tuple[list[SlotBlob | Skipped], bytes | None]:
    """A batch into shared slot `slot`; with no slot (a whole file larger than one), its blobs come back as bytes.
    With `raw`, the batch's bytes are in a raw slot (or in `raw` itself), read by the packing process."""
    compressor = _load_job(token, job_path, slots_path, raw_slots_path)
    supplied = None
    if raw is not None:
        raw_slot, data, head, failed = raw
        if raw_slot is not None:
            if _worker_raw_slots is None:
                raise RuntimeError("worker has no raw slots")
            view = _worker_raw_slots[raw_slot * slot_bytes : raw_slot * slot_bytes + batch.raw_bytes]
        else:
            view = memoryview(data or b"")
        supplied = Supplied(view, head, failed)
    if slot is not None:
        if _worker_slots is None:
            raise RuntimeError("worker has no shared slots")
        into = _worker_slots[slot * slot_bytes : (slot + 1) * slot_bytes]
        return compressor.compress_into(batch, into, supplied), None
    own = memoryview(bytearray(batch.raw_bytes))
    results = compressor.compress_into(batch, own, supplied)
    used = max((r[2] + r[3] for r in results if type(r) is tuple), default=0)
    return results, bytes(own[:used])


def compress_in_order(root: Path, plan: CodecPlan, files: PlanFiles, start: int, start_block: int,
                      pool: WorkerPool | None, feed: RawFeed | None = None) -> Iterator[CompressedBatch]:
    """Batches from plan position (start, start_block) on, in order; at most a few per worker are in flight, so
    memory stays bounded. With no pool the packing process compresses them itself, the same way. With a `feed`
    (archives), this process reads each batch's bytes into a shared raw slot for the worker."""
    if pool is None:
        return _compress_here(root, plan, files, start, start_block, feed)
    return _compress_in_workers(root, plan, files, start, start_block, pool, feed)


def _compress_here(root: Path, plan: CodecPlan, files: PlanFiles, start: int, start_block: int,
                   feed: RawFeed | None) -> Iterator[CompressedBatch]:
    """compress_in_order without workers: one buffer for the blobs (and one for the raw bytes, from archives)."""
    compressor = BlobCompressor(root, plan, files)
    slot = memoryview(bytearray(BATCH_BYTES))
    raw_slot = memoryview(bytearray(BATCH_BYTES)) if feed is not None else None
    for batch in batch_ranges(files, start, start_block):
        blobs = slot if batch.raw_bytes <= BATCH_BYTES else memoryview(bytearray(batch.raw_bytes))
        supplied = None
        if feed is not None and raw_slot is not None:
            raw = raw_slot if batch.raw_bytes <= BATCH_BYTES else memoryview(bytearray(batch.raw_bytes))
            head, failed = read_batch(feed, files, batch, raw)
            supplied = Supplied(raw[: batch.raw_bytes], head, failed)
        yield CompressedBatch(compressor.compress_into(batch, blobs, supplied), blobs)


def _compress_in_workers(root: Path, plan: CodecPlan, files: PlanFiles, start: int, start_block: int,
                         pool: WorkerPool, feed: RawFeed | None) -> Iterator[CompressedBatch]:
    """compress_in_order with workers: the pool is kept busy with up to its limit of batches in flight, and each
    result is handed on in order, its slot freed once the consumer asks for the next."""
    flight = _InFlight(root, plan, files, pool, feed)
    try:
        batches = batch_ranges(files, start, start_block)
        for batch in itertools.islice(batches, flight.limit):
            flight.submit(batch)
        while flight.batches:
            future, slot, raw_slot = flight.batches.popleft()
            results, own = future.result()
            flight.free_raw_slot(raw_slot)
            if slot is None:
                yield CompressedBatch(results, memoryview(own or b""))
            else:
                with flight.slots.slot(slot) as blobs:
                    yield CompressedBatch(results, blobs)
                flight.slots.free.append(slot)
            following = next(batches, None)
            if following is not None:
                flight.submit(following)
    finally:
        flight.close()


class _InFlight:
    """The batches in the workers' hands, oldest first, each with the shared slot its blobs go to (None: a whole
    file larger than a slot, whose blobs come back as bytes) and the raw slot its bytes were read into (archives)."""

    def __init__(self, root: Path, plan: CodecPlan, files: PlanFiles, pool: WorkerPool, feed: RawFeed | None
                 ) -> None:
        self.limit = pool.workers * _BATCHES_PER_WORKER
        self.files, self.pool, self.feed = files, pool, feed
        self.job = _JobFile((root, plan, files))
        self.slots = _SharedSlots(self.limit, BATCH_BYTES)
        self.raw_slots = _SharedSlots(self.limit, BATCH_BYTES) if feed is not None else None
        self.batches: deque[tuple[Future[tuple[list, bytes | None]], int | None, int | None]] = deque()

    def submit(self, batch: Batch) -> None:
        """Hand `batch` to the pool, with a free slot (from archives, its raw bytes read into a raw slot first)."""
        slot = self.slots.free.pop() if batch.raw_bytes <= BATCH_BYTES else None
        raw_slot, raw = None, None
        if self.feed is not None and self.raw_slots is not None:
            if batch.raw_bytes <= BATCH_BYTES:
                raw_slot = self.raw_slots.free.pop()
                head, failed = read_batch(self.feed, self.files, batch, self.raw_slots.slot(raw_slot))
                raw = (raw_slot, None, head, failed)
            else:
                own = memoryview(bytearray(batch.raw_bytes))
                head, failed = read_batch(self.feed, self.files, batch, own)
                raw = (None, bytes(own), head, failed)
        job, slots, raw_slots = self.job, self.slots, self.raw_slots
        self.batches.append((self.pool.executor.submit(_compress_in_worker, job.token, job.path, slots.path, batch,
                                                       slot, slots.slot_bytes,
                                                       raw_slots.path if raw_slots else None, raw),
                             slot, raw_slot))

    def free_raw_slot(self, raw_slot: int | None) -> None:
        if raw_slot is not None and self.raw_slots is not None:
            self.raw_slots.free.append(raw_slot)

    def close(self) -> None:
        """Cancel what has not started, wait for what has (a worker may still be writing into a slot), let go of
        the shared memory."""
        for future, _, _ in self.batches:
            future.cancel()
        for future, _, _ in self.batches:
            if not future.cancelled():
                future.exception()
        self.slots.close()
        if self.raw_slots is not None:
            self.raw_slots.close()
        self.job.close()
