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

import contextlib
import ctypes
import errno
import mmap
import multiprocessing
import os
import pickle
import signal
import stat
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Protocol, Sequence

import xxhash

from compressors.kinds import HEAD_BYTES, file_kind

from .codec_plan import NONE_ROW, CodecPlan
from .walk import Problem

_BATCH_FILES = 256
_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
_BATCH_BYTES = 8 << 20  # raw bytes of a batch, and the size of a slot (a blob is never larger than its raw bytes)
_BATCHES_PER_WORKER = 4


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


@dataclass(frozen=True, slots=True)
class Skipped:
    """A planned file that could not be packed (it changed, vanished or cannot be read)."""

    number: int
    problem: Problem


# A compressed file or block, as a plain tuple (it crosses the process boundary 100,000s of times, and a tuple
# pickles several times faster than a dataclass): plan number, block number (WHOLE_FILE for a file stored whole),
# offset of its blob in the batch's `blobs`, stored length, codec row, checksum of the stored bytes, raw size.
SlotBlob = tuple[int, int, int, int, int, int, int]
WHOLE_FILE = -1


class Batch(NamedTuple):
    """Plan files [first, end) stored whole, or blocks [first_block, end_block) of plan file `first` (then
    end == first + 1 and end_block > 0)."""

    first: int
    end: int
    first_block: int
    end_block: int
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class CompressedBatch:
    """One batch's results in plan order. `blobs` holds every blob back to back; it is valid only until the
    consumer asks for the next batch (its memory is reused)."""

    results: list[SlotBlob | Skipped]
    blobs: memoryview


@dataclass(frozen=True, slots=True)
class Supplied:
    """A batch's raw bytes read by the packing process (from archives: archive_feed.py), back to back in plan
    order: whole files, or the batch's blocks. `head` is a blocks batch's file's first bytes (its kind's sniff);
    `failed` the files that could not be read, and why."""

    raw: memoryview
    head: bytes = b""
    failed: dict[int, str] = field(default_factory=dict)


class _Changed(Exception):
    """The file is not the one the walk saw, or changed while read: it is skipped for this reason."""


class BlobCompressor:
    """Reads a file (or some of its blocks), checks it is still the file the walk saw, compresses and checksums."""

    def __init__(self, root: Path, plan: CodecPlan, files: PlanFiles) -> None:
        self.root = root
        self.plan = plan
        self.files = files
        self._sniffed_groups = frozenset(g for g in plan.by_group if plan.depends_on_kind(g))

    def compress_into(self, batch: Batch, into: memoryview, supplied: Supplied | None = None
                      ) -> list[SlotBlob | Skipped]:
        """Compress a batch, leaving its blobs in `into` back to back; its raw bytes are read from SRC, or are
        `supplied`."""
        if batch.end_block:
            if supplied is not None:
                return self._supplied_blocks_into(batch, supplied, into)
            return self._blocks_into(batch.first, batch.first_block, batch.end_block, into)
        return self._files_into(batch.first, batch.end, into, supplied)

    def _files_into(self, first: int, end: int, into: memoryview, supplied: Supplied | None = None
                    ) -> list[SlotBlob | Skipped]:
        results: list[SlotBlob | Skipped] = []
        used = 0
        supplied_at = 0
        raw: bytes | bytearray | memoryview
        for number in range(first, end):
            size = self.files.sizes[number]
            if size == 0:
                continue  # empty files have no blob; the packer records them itself
            if supplied is not None:
                raw = supplied.raw[supplied_at : supplied_at + size]
                supplied_at += size
                if number in supplied.failed:
                    results.append(Skipped(number, Problem(self.files.paths[number], supplied.failed[number])))
                    continue
            else:
                try:
                    with self._open(number) as fd:
                        raw = _read_exactly(fd, size, 0)
                        self._check_unchanged_after(fd, number)
                except _Changed as changed:
                    results.append(Skipped(number, Problem(self.files.paths[number], str(changed))))
                    continue
            codec = self.plan.row_for(self.files.groups[number], self._kind(number, raw))
            stored, codec = self._encode(raw, codec)
            length = len(stored)
            into[used : used + length] = stored
            results.append((number, WHOLE_FILE, used, length, codec, xxhash.xxh3_64_intdigest(stored), size))
            used += length
        return results

    def _blocks_into(self, number: int, first_block: int, end_block: int, into: memoryview
                     ) -> list[SlotBlob | Skipped]:
        """Blocks of one large file, read one at a time: packing a file of any size needs memory for a few blocks."""
        size, block_size = self.files.sizes[number], self.files.layout.block_size
        results: list[SlotBlob | Skipped] = []
        used = 0
        try:
            with self._open(number) as fd:
                codec = self.plan.row_for(self.files.groups[number], self._kind(number, fd=fd))
                for block in range(first_block, end_block):
                    offset = block * block_size
                    raw = _read_exactly(fd, min(block_size, size - offset), offset)
                    stored, block_codec = self._encode(raw, codec)
                    length = len(stored)
                    into[used : used + length] = stored
                    results.append((number, block, used, length, block_codec, xxhash.xxh3_64_intdigest(stored),
                                    len(raw)))
                    used += length
                self._check_unchanged_after(fd, number)
        except _Changed as changed:
            return [Skipped(number, Problem(self.files.paths[number], str(changed)))]
        return results

    def _supplied_blocks_into(self, batch: Batch, supplied: Supplied, into: memoryview) -> list[SlotBlob | Skipped]:
        """_blocks_into for blocks whose bytes were read for this process."""
        number, block_size = batch.first, self.files.layout.block_size
        if number in supplied.failed:
            return [Skipped(number, Problem(self.files.paths[number], supplied.failed[number]))]
        codec = self.plan.row_for(self.files.groups[number], self._kind(number, supplied.head))
        results: list[SlotBlob | Skipped] = []
        used = 0
        for block in range(batch.first_block, batch.end_block):
            start = (block - batch.first_block) * block_size
            raw = supplied.raw[start : min(start + block_size, batch.raw_bytes)]
            stored, block_codec = self._encode(raw, codec)
            length = len(stored)
            into[used : used + length] = stored
            results.append((number, block, used, length, block_codec, xxhash.xxh3_64_intdigest(stored), len(raw)))
            used += length
        return results

    def _encode(self, raw: bytes | bytearray | memoryview, codec: int) -> tuple[bytes | bytearray | memoryview, int]:
        """Stored bytes and codec row; raw bytes under `none` when compressing would not make them smaller."""
        stored = self.plan.codecs[codec].encode(raw) if codec != NONE_ROW else raw
        return (raw, NONE_ROW) if len(stored) >= len(raw) else (stored, codec)

    def _kind(self, number: int, raw: bytes | bytearray | memoryview | None = None, fd: int | None = None) -> str:
        if self.files.groups[number] not in self._sniffed_groups:
            return ""
        head = raw[:HEAD_BYTES] if raw is not None else os.pread(fd, HEAD_BYTES, 0)  # type: ignore[arg-type]
        return file_kind(self.files.paths[number], bytes(head))

    @contextlib.contextmanager
    def _open(self, number: int) -> Iterator[int]:
        """The file, opened without following a symlink or blocking on a fifo, and only if it is still the file
        the walk saw: a regular file with the same inode, size, mtime and ctime."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(self.root, self.files.paths[number]), flags)
        except FileNotFoundError:
            raise _Changed("vanished during the pack") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Changed("became a symlink during the pack") from None
            raise _Changed(f"cannot read: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            files = self.files
            if not stat.S_ISREG(info.st_mode):
                raise _Changed("is no longer a regular file")
            if info.st_ino != files.inos[number]:
                raise _Changed("was replaced by another file during the pack")
            if info.st_size != files.sizes[number]:
                raise _Changed(f"changed size during the pack ({files.sizes[number]} bytes at walk, "
                               f"{info.st_size} now)")
            if info.st_mtime_ns != files.mtimes[number] or info.st_ctime_ns != files.ctimes[number]:
                raise _Changed("changed during the pack (modified since the walk)")
            yield fd
        except OSError as exc:
            raise _Changed(f"cannot read: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _check_unchanged_after(self, fd: int, number: int) -> None:
        """A write while the file was read changes its size, mtime or ctime: the bytes read may be a mix."""
        info = os.fstat(fd)
        if (info.st_size, info.st_mtime_ns, info.st_ctime_ns) != (
                self.files.sizes[number], self.files.mtimes[number], self.files.ctimes[number]):
            raise _Changed("changed while it was being read")


def _read_exactly(fd: int, length: int, offset: int) -> bytearray:
    """`length` bytes at `offset`; a file that ends sooner changed under us."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise _Changed(f"changed size during the pack (ended {length - done} bytes early)")
        done += got
    return buffer


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
        size = files.sizes[number]
        if size:
            failure = feed.read_range(number, 0, into[used : used + size])
            if failure:
                failed[number] = failure
            used += size
    return b"", failed


def batch_ranges(files: PlanFiles, start: int, start_block: int = 0) -> Iterator[Batch]:
    """Batches from plan position (start, start_block) on: runs of whole files, each of at most _BATCH_FILES
    non-empty files and _BATCH_BYTES raw bytes, and runs of at most _BATCH_BYTES of a large file's blocks. A
    whole file larger than a batch is a batch of its own, with a buffer sized for it."""
    sizes, layout = files.sizes, files.layout
    if start_block:
        yield from _block_batches(start, start_block, sizes[start], layout)
        start += 1
    first, count, batch_bytes = start, 0, 0
    for number in range(start, len(sizes)):
        size = sizes[number]
        if size == 0:
            continue
        if layout.blocks_of(size):
            if count:
                yield Batch(first, number, 0, 0, batch_bytes)
            yield from _block_batches(number, 0, size, layout)
            first, count, batch_bytes = number + 1, 0, 0
            continue
        if count and (count >= _BATCH_FILES or batch_bytes + size > _BATCH_BYTES):
            yield Batch(first, number, 0, 0, batch_bytes)
            first, count, batch_bytes = number, 0, 0
        count += 1
        batch_bytes += size
    if count:
        yield Batch(first, len(sizes), 0, 0, batch_bytes)


def _block_batches(number: int, first_block: int, size: int, layout: BlockLayout) -> Iterator[Batch]:
    per_batch = max(1, _BATCH_BYTES // layout.block_size)
    total = layout.blocks_of(size)
    for block in range(first_block, total, per_batch):
        end = min(total, block + per_batch)
        yield Batch(number, number + 1, block, end, min(size, end * layout.block_size) - block * layout.block_size)


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
        self.executor = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork" if forked else "forkserver"),
            initializer=_die_with_parent, initargs=(os.getpid() if forked else None,))
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
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
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
        compressor = BlobCompressor(root, plan, files)
        slot = memoryview(bytearray(_BATCH_BYTES))
        raw_slot = memoryview(bytearray(_BATCH_BYTES)) if feed is not None else None
        for batch in batch_ranges(files, start, start_block):
            blobs = slot if batch.raw_bytes <= _BATCH_BYTES else memoryview(bytearray(batch.raw_bytes))
            supplied = None
            if feed is not None and raw_slot is not None:
                raw = raw_slot if batch.raw_bytes <= _BATCH_BYTES else memoryview(bytearray(batch.raw_bytes))
                head, failed = read_batch(feed, files, batch, raw)
                supplied = Supplied(raw[: batch.raw_bytes], head, failed)
            yield CompressedBatch(compressor.compress_into(batch, blobs, supplied), blobs)
        return
    inflight_limit = pool.workers * _BATCHES_PER_WORKER
    job = _JobFile((root, plan, files))
    slots = _SharedSlots(inflight_limit, _BATCH_BYTES)
    raw_slots = _SharedSlots(inflight_limit, _BATCH_BYTES) if feed is not None else None
    inflight: deque[tuple[Future[tuple[list, bytes | None]], int | None, int | None]] = deque()

    def submit(batch: Batch) -> None:
        slot = slots.free.pop() if batch.raw_bytes <= _BATCH_BYTES else None
        raw_slot, raw = None, None
        if feed is not None and raw_slots is not None:
            if batch.raw_bytes <= _BATCH_BYTES:
                raw_slot = raw_slots.free.pop()
                head, failed = read_batch(feed, files, batch, raw_slots.slot(raw_slot))
                raw = (raw_slot, None, head, failed)
            else:
                own = memoryview(bytearray(batch.raw_bytes))
                head, failed = read_batch(feed, files, batch, own)
                raw = (None, bytes(own), head, failed)
        inflight.append((pool.executor.submit(_compress_in_worker, job.token, job.path, slots.path, batch, slot,
                                              slots.slot_bytes, raw_slots.path if raw_slots else None, raw),
                         slot, raw_slot))

    try:
        batches = batch_ranges(files, start, start_block)
        for batch in batches:
            submit(batch)
            if len(inflight) >= inflight_limit:
                break
        while inflight:
            future, slot, raw_slot = inflight.popleft()
            results, own = future.result()
            if raw_slot is not None and raw_slots is not None:
                raw_slots.free.append(raw_slot)
            if slot is None:
                yield CompressedBatch(results, memoryview(own or b""))
            else:
                with slots.slot(slot) as blobs:
                    yield CompressedBatch(results, blobs)
                slots.free.append(slot)
            following = next(batches, None)
            if following is not None:
                submit(following)
    finally:
        for future, _, _ in inflight:
            future.cancel()
        for future, _, _ in inflight:  # a worker may still be writing into a slot
            if not future.cancelled():
                future.exception()
        slots.close()
        if raw_slots is not None:
            raw_slots.close()
        job.close()
