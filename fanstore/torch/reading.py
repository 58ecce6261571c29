"""What a dataset opens in each process that reads (the main process, every DataLoader worker), and the decoding
ahead that follows the epoch plan.

A torch Dataset is pickled to its workers (spawn, forkserver) or copied into them (fork); open files and threads
must not travel either way. So a dataset holds only how to open its source, and each process opens its own on its
first read (`ProcessReading.of`), again after a fork.
"""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..core.api import Dataset, open_dataset
from ..core.chunk_source import LocalChunkSource
from ..core.format import INDEX_NAME
from ..core.allocator import keep_freed_memory
from ..core.index import Index, file_identity
from ..errors import FanstoreError, IsADirectory, UsageError, quoted
from ..core.thread_names import name_os_thread
from .plan import EpochPlan

PREFETCH_BATCHES = 2  # batches of its own a worker decodes ahead
OUT_OF_TURN = 8  # a worker stops decoding ahead once more than one in OUT_OF_TURN of its batches came out of turn
PREFETCH_BYTES = 64 << 20  # decoded bytes a worker holds ahead at most
PREFETCH_THREADS = 2
_CANDIDATES = 16  # batches starting with a batch's first item that are compared with it, at most, to find it


def _dataloader_workers() -> int:
    """How many workers share this process's DataLoader (0: this is not one of them)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return 0 if info is None else info.num_workers


def open_source(source: str | None) -> Dataset:
    """A packed dataset directory, or (None) the dataset of the `fanstore serve` node this process runs on."""
    if source is not None:
        return open_dataset(source)
    from ..serve.node_client import open_served_dataset  # only under serve: mpi4py is never needed here

    return open_served_dataset()


@dataclass
class PrefetchCounters:
    """How the reads of this process went: `ahead` files queued for decoding before they were asked for, of which
    `used` were then read; `waited` of those were still decoding (or not started) when asked; `missed` files were
    not known ahead and were decoded when asked; `out_of_turn` batches came to this worker that were not its
    turn's (DataLoader(in_order=False) hands a batch to whichever worker is free)."""

    ahead: int = 0
    used: int = 0
    waited: int = 0
    missed: int = 0
    out_of_turn: int = 0


@dataclass
class _BatchAhead:
    """One of this worker's next batches, decoded in one task: a task and a hand-over per batch, not per file,
    cost little beside the decoding itself."""

    entries: list[int]
    size: int  # decoded bytes it holds once done
    done: Future[dict[int, bytes]]


def _decode_batch(read_many: Callable[[list[int]], list[Any]], entries: list[int]) -> dict[int, bytes]:
    """A batch's files, read together (under serve, one round trip for its remote blobs). One that failed is left
    out: the reader reads it again, meets the error and reports it."""
    try:
        results = read_many(entries)
    except Exception:  # noqa: BLE001 - as for one file: the reader meets it again
        return {}
    return {entry: result for entry, result in zip(entries, results) if not isinstance(result, Exception)}


def _take_over(inherited: "ProcessReading | None", source: str | None) -> Dataset | None:
    """The parent's open dataset, carried into this forked process: its index (shared memory, copy-on-write) and its
    open chunk files. A DataLoader forks its workers afresh every epoch (persistent_workers off, the default); each
    opening the index and every chunk file again would cost W x (chunks + 1) opens an epoch on the shared file
    system, and a private copy of the index each. None where nothing can be taken (spawned workers, under serve,
    another source): the process opens its own."""
    if inherited is None or source is None or inherited.source != source:
        return None
    if inherited.dataset.index.file_identity is None or _index_file(source) != inherited.dataset.index.file_identity:
        return None  # packed again since the parent opened it (one stat, not an open): read what is there now
    return inherited.dataset.for_forked_child()


def _index_file(source: str | None) -> tuple[int, int, int, int] | None:
    """Which index file a dataset directory holds (device, inode, size, mtime), or None (none, or under serve)."""
    if source is None:
        return None
    try:
        info = os.stat(os.path.join(source, INDEX_NAME))
    except OSError:
        return None
    return file_identity(info)


def _same_index(one: Index, other: Index) -> bool:
    """Whether two loaded indexes hold the same entries and paths, byte for byte (a memory compare: milliseconds
    for a million files, where looking their paths up again takes seconds)."""
    try:
        return (np.array_equal(one.entries.view(np.uint8), other.entries.view(np.uint8))
                and np.array_equal(np.frombuffer(one.paths, np.uint8), np.frombuffer(other.paths, np.uint8)))
    except ValueError:  # not viewable as bytes: take nothing
        return False


def first_places(order: np.ndarray, items: int, step: int = 1 << 16) -> np.ndarray:
    """Each item's first place in `order` (-1 where it is absent), in the narrowest signed type that holds every
    place. Built a slice of the order at a time: a worker keeps the memory it frees (keep_freed_memory), so a
    temporary as long as the order would stay in every worker for good."""
    places = np.full(items, -1, dtype=np.int32 if len(order) < 2**31 else np.int64)
    for start in range((len(order) - 1) // step * step, -1, -step):  # later slices first: earlier places win
        part = order[start : start + step]
        valid = (part >= 0) & (part < items)
        places[part[valid][::-1]] = (np.flatnonzero(valid) + start)[::-1]  # an item listed twice: its first place
    return places


def batch_keys(order: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The order's non-empty batches, each as (its first item << 32 | its number), sorted: the batches an item
    starts, in batch order, are one searchsorted away. So a batch is found by its start even where its first item
    was drawn before (a sampler with replacement), where that item's first place lay in another batch. 8 bytes a
    batch, one sort (10^7 batches of one item: 0.4 s, where a stable argsort of their first items took 1.2 s)."""
    starts, ends = bounds[:-1], bounds[1:]
    # An item number out of int32's range (no item of a dataset) is clipped: the batches it starts hold no valid item.
    keys = np.clip(order[starts], -(2**31), 2**31 - 1).astype(np.int64) << 32
    keys |= np.arange(len(starts), dtype=np.int64)
    keys = keys[ends > starts]
    keys.sort()
    return keys


@dataclass(frozen=True)
class ShippedItems:
    """A dataset's items as a spawned worker gets them: their entry numbers in the index file the training process
    looked them up in, and that file's identity. 4 bytes an item travel, where a list of paths cost each worker the
    paths as str objects and a lookup of every one again (at 10^7 files, gigabytes and seconds a worker)."""

    entries: np.ndarray
    index_file: tuple[int, int, int, int]

    @classmethod
    def of(cls, reading: "ProcessReading") -> "ShippedItems | None":
        """The items of an open reading, or None where its index file's identity is unknown."""
        identity = reading.dataset.index.file_identity
        if identity is None:
            return None
        entries = reading.entries
        narrow = np.int32 if len(reading.dataset.index) < 2**31 else np.int64
        return cls(entries.astype(narrow, copy=False), identity)

    def entries_in(self, index: Index) -> np.ndarray:
        """The entries, in `index` if it was read from the same file; else one error naming the file."""
        if index.file_identity != self.index_file:
            raise UsageError(f"{index.path}: not the index file the training process looked this dataset's items up "
                             f"in (packed again since?); the items' paths are not known here: start the DataLoader "
                             f"again")
        return self.entries


_opening = threading.RLock()  # around opening a reading; made anew in a forked child, where a parent's thread held it


def _new_opening_lock() -> None:
    global _opening
    _opening = threading.RLock()


os.register_at_fork(after_in_child=_new_opening_lock)


def _files_of(dataset: Dataset, paths: Sequence[str], source: str | None) -> np.ndarray:
    """Each path's entry, checked once as the dataset opens (in the training process, when the loader asks its
    length): a path that is missing or names a directory is said with its place in `paths`, not met by a worker at
    that item's first read, an epoch in."""
    errors: dict[int, FanstoreError] = {}
    entries = dataset.resolve_many(paths, errors)
    modes = dataset.index.entries["mode"][np.maximum(entries, 0)]
    bad = np.flatnonzero((entries < 0) | ((modes & 0o170000) == stat.S_IFDIR))
    if not len(bad):
        return entries
    first = int(bad[0])
    error = errors.get(first) or IsADirectory(f"{quoted(paths[first])} is a directory, not a file")
    where = quoted(source) if source is not None else "the node's served dataset"
    more = f"; {len(bad) - 1:,} more of the {len(paths):,} paths are not files either" if len(bad) > 1 else ""
    raise type(error)(f"{where}: paths[{first}]: {error}{more}")


class ProcessReading:
    """One process's open dataset, its items' entries, and its decoding ahead."""

    def __init__(self, source: str | None, paths: Sequence[str] | None, plan: Callable[[], EpochPlan | None],
                 prefetch_bytes: int, prefetch_threads: int, inherited: "ProcessReading | None" = None,
                 shipped: "ShippedItems | None" = None) -> None:
        self.pid = os.getpid()
        self.source = source
        workers = _dataloader_workers()
        self._workers = max(1, workers)  # processes that take the loader's batches in turn
        in_a_worker = workers > 0
        if in_a_worker:
            # A worker decodes all day: glibc would map each decoded file afresh (files of 128 KiB and more) and
            # fault it in page by page. The mount's daemon keeps freed buffers for reuse; so does a worker.
            keep_freed_memory()
        taken = _take_over(inherited, source)
        self.dataset = taken if taken is not None else open_source(source)
        index = self.dataset.index
        if taken is not None:  # the parent's index itself: its items are this process's
            self.entries = inherited.entries  # type: ignore[union-attr]
        elif inherited is not None and _same_index(inherited.dataset.index, index):
            # A forked worker: the parent's items are this index's too (the same bytes), so it need not look up a
            # million paths again. Only the array is taken; the parent's open files stay the parent's.
            self.entries = inherited.entries
        elif shipped is not None:
            self.entries = shipped.entries_in(index)
        elif paths is None:
            self.entries = index.files_in_path_order()  # a 1.2 index's own array, read in place: nothing to sort
        else:
            self.entries = _files_of(self.dataset, paths, source)
        if source is not None and not in_a_worker and isinstance(self.dataset.reader.source, LocalChunkSource):
            self.dataset.reader.source.open_ahead()  # for the workers this process forks (see _take_over)
        self._sizes = index.entries["size"]
        self._plan = plan  # the holder's plan, looked up each batch: an EpochSampler may come after the first read
        self._plan_serial = -1
        self._position = np.empty(0, dtype=np.int32)  # item -> its place in this epoch's order, -1 if absent
        self._order = np.empty(0, dtype=np.int64)
        self._expected = -1  # where this process's next batch should start in the order (-1: not known)
        # Where the sampler yields batches: their bounds as published, the batches by first item, the batch this
        # process read last and the one it should read next (numbers in this publication; -1: none, not known).
        self._bounds = np.empty(0, dtype=np.int64)
        self._batch_keys = np.empty(0, dtype=np.int64)  # see batch_keys
        self._batch = self._expected_batch = -1
        # This publication's batches that came to this worker in its turn and out of it (_out_of_turn).
        self._turns = [0, 0]
        self._capacity = prefetch_bytes
        self._threads = prefetch_threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first plan
        self._ahead: dict[int, _BatchAhead] = {}  # place in the order of a batch's first item -> its decoding
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self.counters = PrefetchCounters()

    @staticmethod
    def of(holder: Any, make: Callable[["ProcessReading | None"], "ProcessReading"]) -> "ProcessReading":
        """The holder's reading for this process, opened now if it has none or inherited one across a fork (which
        `make` is given, to take what it can of it). Opened once however many threads ask at first: each opened its
        own, the index and up to every chunk file again, and all but one were dropped."""
        reading = holder.__dict__.get("_process_reading")
        if reading is None or reading.pid != os.getpid():
            with _opening:
                reading = holder.__dict__.get("_process_reading")
                if reading is None or reading.pid != os.getpid():
                    reading = make(reading)
                    holder.__dict__["_process_reading"] = reading
        return reading

    def paths(self) -> list[str]:
        return [self.dataset.index.path_of(int(entry)) for entry in self.entries]

    def read_items(self, items: Sequence[int]) -> list[bytes]:
        """The bytes of each item: from its batch's decoding ahead if there is one. This worker's next batches are
        queued first, so they decode while this one is finished."""
        entries = [int(self.entries[item]) for item in items]
        with self._lock:  # bookkeeping only: decoding and waiting happen outside
            position = self._position_of(items)
            batch = self._ahead.pop(position, None) if position >= 0 else None
            if batch is not None:
                self._ahead_bytes -= batch.size
            if position >= 0:
                self._look_ahead(position, len(items))
        decoded: dict[int, bytes] = {}
        queued: set[int] = set()
        if batch is not None:
            queued = set(batch.entries)
            if batch.done.cancel():  # not started yet: decoded here, now
                self.counters.waited += len(queued)
            else:
                if not batch.done.done():
                    self.counters.waited += len(queued)
                decoded = batch.done.result()
        used = sum(entry in queued for entry in entries)
        self.counters.used += used
        self.counters.missed += len(entries) - used
        missing = [entry for entry in entries if entry not in decoded]
        if missing:  # read together: under serve, one round trip for the batch's remote blobs
            for entry, result in zip(missing, self.dataset.reader.read_many(missing)):
                if isinstance(result, Exception):
                    raise result
                decoded[entry] = result
        return [decoded[entry] for entry in entries]

    def _position_of(self, items: Sequence[int]) -> int:
        """The place in the epoch's order where this batch lies (-1: no plan, or not in it), the plan of a new epoch
        taken up first. Where the sampler yields batches, the start of the batch it is (_batch_start). Else where
        this process's next batch was expected, or else at its first item's first place; either only if the order
        holds the whole batch there. An item drawn twice (a sampler with replacement) was taken at its first place,
        and batches long past were decoded ahead, and held, in place of the next ones."""
        plan = self._plan()
        if plan is None or self._capacity <= 0 or not len(items):
            return -1
        publication = plan.current()
        if publication.serial != self._plan_serial:
            self._take_up(*publication)
        if len(self._bounds):
            expected = self._expected_batch
            position = self._batch_start(items)
            self._count_turn(expected, self._batch if position >= 0 else -1)
            return position
        first = int(items[0])
        for position in (self._expected, int(self._position[first]) if 0 <= first < len(self._position) else -1):
            if position >= 0 and np.array_equal(self._order[position : position + len(items)], items):
                self._count_turn(self._expected, position)
                return position
        return -1

    def _count_turn(self, expected: int, found: int) -> None:
        """Tally whether the batch asked (`found`, a batch number or a place in the order) is the one expected in
        this worker's turn; the first of a publication is neither."""
        if expected < 0 or found < 0:
            return
        out = found != expected
        self._turns[out] += 1
        self.counters.out_of_turn += out

    def _out_of_turn(self) -> bool:
        """Batches come to this worker out of turn (DataLoader(in_order=False) hands each to a free worker): each
        time, those it decoded ahead for its turn go to another worker (on 12,000 files, 38,000 decoded ahead for
        24,000 read). Past two in this epoch, and more than one in OUT_OF_TURN of its batches, it decodes each batch
        as it comes."""
        held, out = self._turns
        return out >= 2 and out * OUT_OF_TURN > held + out

    def _take_up(self, serial: int, order: np.ndarray, bounds: np.ndarray) -> None:
        """A new publication: what was decoded for the last one dropped, and this one's index built, once: each
        item's first place, or where the sampler yields batches, the batches by first item."""
        self._drop_ahead()
        self._plan_serial, self._order, self._bounds = serial, order, bounds
        self._position = np.empty(0, dtype=np.int32)  # the last epoch's, freed before the next is built
        self._batch_keys = np.empty(0, dtype=np.int64)
        if len(bounds):
            self._batch_keys = batch_keys(order, bounds)
        else:
            self._position = first_places(order, len(self.entries))
        self._expected = self._batch = self._expected_batch = -1
        self._turns = [0, 0]

    def _batch_start(self, items: Sequence[int]) -> int:
        """Where the sampler yields batches: the start of the batch that is `items` (-1: none is), the one this
        process was expected to read next, or else the first one after its last that `items[0]` starts and that
        holds `items`. Sets `_batch` to its number."""
        batch = self._expected_batch
        if 0 <= batch < len(self._bounds) - 1 and self._holds(batch, items):
            self._batch = batch
            return int(self._bounds[batch])
        first = int(items[0])
        if not -(2**31) <= first < 2**31:
            return -1
        keys = self._batch_keys
        low = int(np.searchsorted(keys, (first << 32) | (self._batch + 1)))  # after its last: a worker reads on
        high = min(int(np.searchsorted(keys, (first + 1) << 32)), low + _CANDIDATES)
        for batch in (keys[low:high] & 0xFFFFFFFF).tolist():
            if self._holds(batch, items):
                self._batch = batch
                return int(self._bounds[batch])
        return -1

    def _holds(self, batch: int, items: Sequence[int]) -> bool:
        """Whether the published batch number `batch` is `items`, item for item."""
        start, end = int(self._bounds[batch]), int(self._bounds[batch + 1])
        return end - start == len(items) and np.array_equal(self._order[start:end], items)

    def _next_batches(self, position: int, batch_len: int) -> list[tuple[int, int]]:
        """(start, end) in the order of this worker's next PREFETCH_BATCHES batches. Workers take batches in turn
        (DataLoader sends batch k to worker k mod num_workers), so this worker's next batch is num_workers batches
        on: the batch num_workers further where the bounds are published, else num_workers times this one's length
        further (a plain sampler and batch_size: every batch but the last has that length)."""
        if len(self._bounds):
            self._expected_batch = self._batch + self._workers
            batches = range(self._expected_batch, len(self._bounds) - 1, self._workers)[:PREFETCH_BATCHES]
            return [(int(self._bounds[batch]), int(self._bounds[batch + 1])) for batch in batches]
        stride = batch_len * self._workers
        self._expected = position + stride
        starts = range(position + stride, len(self._order), stride)[:PREFETCH_BATCHES]
        return [(start, start + batch_len) for start in starts]

    def _look_ahead(self, position: int, batch_len: int) -> None:
        """Queue the decoding of this worker's next batches of the epoch order."""
        for start in [start for start in self._ahead if start < position]:  # passed by: never read now
            self._forget(self._ahead.pop(start))
        batches = self._next_batches(position, batch_len)
        if self._out_of_turn():
            self._drop_ahead()
            return
        for start, end in batches:
            if start in self._ahead or end <= start:
                continue
            entries = [int(self.entries[int(item)]) for item in self._order[start:end]]
            size = int(self._sizes[entries].sum())
            if self._ahead_bytes + size > self._capacity:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, self._threads), thread_name_prefix="fanstore-prefetch",
                                                initializer=name_os_thread)
            self._ahead[start] = _BatchAhead(entries, size,
                                             self._pool.submit(_decode_batch, self.dataset.reader.read_many,
                                                               entries))
            self._ahead_bytes += size
            self.counters.ahead += len(entries)

    def _forget(self, batch: _BatchAhead) -> None:
        batch.done.cancel()
        self._ahead_bytes -= batch.size

    def _drop_ahead(self) -> None:
        for batch in self._ahead.values():
            self._forget(batch)
        self._ahead.clear()

    def announce(self, order: np.ndarray) -> None:
        """Hand the epoch's order to the node's serve process (a served dataset only)."""
        announce = getattr(self.dataset.reader.source, "announce", None)
        if announce is not None:
            valid = order[(order >= 0) & (order < len(self.entries))]
            announce(self.dataset.index, self.entries[valid])

    def stats(self) -> dict[str, Any]:
        return {**asdict(self.counters), "held_bytes": self._ahead_bytes}

    def close(self) -> None:
        with self._lock:
            self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.dataset.close()
