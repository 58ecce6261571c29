"""What a dataset opens in each process that reads (the main process, every DataLoader worker), and the decoding
ahead that follows the epoch plan.

A torch Dataset is pickled to its workers (spawn, forkserver) or copied into them (fork); open files and threads
must not travel either way. So a dataset holds only how to open its source, and each process opens its own on its
first read (`ProcessReading.of`), again after a fork.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..api import Dataset, open_dataset
from ..cache import DecodedCache
from ..daemon_tuning import keep_freed_memory
from .plan import EpochPlan

PREFETCH_BATCHES = 2  # batches of its own a worker decodes ahead
PREFETCH_BYTES = 64 << 20  # decoded bytes a worker holds ahead at most
PREFETCH_THREADS = 2


def _in_a_dataloader_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


def open_source(source: str | None) -> Dataset:
    """A packed dataset directory, or (None) the dataset of the `fanstore serve` node this process runs on."""
    if source is not None:
        return open_dataset(source)
    from ..serve.node_client import open_served_dataset  # only under serve: mpi4py is never needed here

    return open_served_dataset()


@dataclass
class PrefetchCounters:
    """How the reads of this process went: `ahead` files decoded before they were asked for, of which `used` were
    then read; `waited` reads found their file still decoding; `missed` were decoded when asked."""

    ahead: int = 0
    used: int = 0
    waited: int = 0
    missed: int = 0


class ProcessReading:
    """One process's open dataset, its items' entries, and its decoding ahead."""

    def __init__(self, source: str | None, paths: Sequence[str] | None, plan: Callable[[], EpochPlan | None],
                 prefetch_bytes: int, prefetch_threads: int) -> None:
        self.pid = os.getpid()
        if _in_a_dataloader_worker():
            # A worker decodes all day: glibc would map each decoded file afresh (files of 128 KiB and more) and
            # fault it in page by page. The mount's daemon keeps freed buffers for reuse; so does a worker.
            keep_freed_memory()
        self.dataset = open_source(source)
        index = self.dataset.index
        if paths is None:
            self.entries = np.fromiter(index.iter_files(), dtype=np.int64)
            self.entries = self.entries[np.argsort([index.path_of(int(e)) for e in self.entries], kind="stable")]
        else:
            self.entries = np.array([self.dataset.resolve(path) for path in paths], dtype=np.int64)
        self._plan = plan  # the holder's plan, looked up each batch: an EpochSampler may come after the first read
        self._plan_serial = -1
        self._position = np.empty(0, dtype=np.int64)  # item -> its place in this epoch's order, -1 if absent
        self._order = np.empty(0, dtype=np.int64)
        self._cache = DecodedCache(prefetch_bytes, self.dataset.reader.read)
        self._threads = prefetch_threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first plan
        self._ahead: dict[int, int] = {}  # entries queued or decoded ahead, not read yet -> their size
        self._ahead_bytes = 0
        self._lock = threading.Lock()
        self.counters = PrefetchCounters()

    @staticmethod
    def of(holder: Any, make: Any) -> "ProcessReading":
        """The holder's reading for this process, opened now if it has none or inherited one across a fork."""
        reading = holder.__dict__.get("_process_reading")
        if reading is None or reading.pid != os.getpid():
            reading = make()
            holder.__dict__["_process_reading"] = reading
        return reading

    def paths(self) -> list[str]:
        return [self.dataset.index.path_of(int(entry)) for entry in self.entries]

    def read_items(self, items: Sequence[int]) -> list[bytes]:
        """The bytes of each item, after queueing the decoding of what this worker reads next."""
        self._look_ahead(items)
        return [self._read(int(self.entries[item])) for item in items]

    def _read(self, entry: int) -> bytes:
        with self._lock:
            size = self._ahead.pop(entry, None)
            self._ahead_bytes -= size or 0
        if size is None:
            self.counters.missed += 1
            return self.dataset.reader.read(entry)
        if self._cache.peek(entry) is None:
            self.counters.waited += 1
        self.counters.used += 1
        data = self._cache.get(entry)
        self._cache.discard(entry)  # read once an epoch: holding it only takes room from the next ones
        return data

    def _look_ahead(self, items: Sequence[int]) -> None:
        """Decode this worker's next batches of the epoch order. Workers take batches in turn (DataLoader sends
        batch k to worker k mod num_workers), so this worker's next batch starts num_workers batches on."""
        plan = self._plan()
        if plan is None or self._cache.capacity <= 0 or not len(items):
            return
        serial, order = plan.current()
        if serial != self._plan_serial:
            self._plan_serial, self._order = serial, order
            valid = (order >= 0) & (order < len(self.entries))
            self._position = np.full(len(self.entries), -1, dtype=np.int64)
            self._position[order[valid][::-1]] = np.flatnonzero(valid)[::-1]  # an item listed twice: its first place
        first = int(items[0])
        position = int(self._position[first]) if 0 <= first < len(self._position) else -1
        if position < 0:
            return
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        stride = len(items) * (info.num_workers if info is not None else 1)
        sizes = self.dataset.index.entries["size"]
        for batch in range(1, PREFETCH_BATCHES + 1):
            start = position + batch * stride
            for item in self._order[start : start + len(items)]:
                entry = int(self.entries[int(item)])
                with self._lock:
                    if entry in self._ahead:
                        continue
                    if self._ahead_bytes + int(sizes[entry]) > self._cache.capacity:
                        return
                    self._ahead[entry] = int(sizes[entry])
                    self._ahead_bytes += int(sizes[entry])
                self.counters.ahead += 1
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max(1, self._threads), thread_name_prefix="fanstore-prefetch")
                self._pool.submit(self._decode_ahead, entry)

    def _decode_ahead(self, entry: int) -> None:
        try:
            self._cache.get(entry)
        except Exception:  # noqa: BLE001 - the reader meets the same error when it reads the file, and reports it
            with self._lock:
                self._ahead_bytes -= self._ahead.pop(entry, 0)

    def announce(self, order: np.ndarray) -> None:
        """Hand the epoch's order to the node's serve process (a served dataset only)."""
        announce = getattr(self.dataset.reader.source, "announce", None)
        if announce is not None:
            valid = order[(order >= 0) & (order < len(self.entries))]
            announce(self.dataset.index, self.entries[valid])

    def stats(self) -> dict[str, Any]:
        return {**asdict(self.counters), "cache": asdict(self._cache.stats())}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.dataset.close()
