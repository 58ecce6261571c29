"""Remote blobs fetched ahead for the node's readers (fanstore.torch workers), in the order of the node's plan,
within one bound.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..chunk_source import BlobRead
from ..errors import ChunkError

log = logging.getLogger("fanstore.serve")

AHEAD_BYTES = 256 << 20  # remote blobs fetched ahead and not read yet, at most
# Of those, bytes asked of peers and not come yet: a request queued behind many others could miss its deadline.
AHEAD_IN_FLIGHT = 16 << 20
AHEAD_ROWS = 64  # plan rows started at once; the source asks each peer for its blobs among them together
# What holding a blob costs besides its bytes (its entry, the bytes object): counted in the bounds, so that
# AHEAD_BYTES bounds memory for blobs of a few hundred bytes too.
BLOB_OVERHEAD = 512


class BlobsAhead:
    """Remote blobs of the current plan, fetched in plan order and held until read once. One thread starts the
    fetches (ChunkSource.start_reads: each peer's blobs several to a request), and they are handed over as they
    arrive: no thread waits for a peer."""

    def __init__(self, start_reads: Callable[[Sequence[BlobRead]], list[bool]],
                 locate: Callable[[int], tuple[int, int, int]], capacity: int = AHEAD_BYTES,
                 in_flight: int = AHEAD_IN_FLIGHT) -> None:
        self._start_reads = start_reads
        self._locate = locate  # blob row -> (chunk, offset, stored length)
        self._capacity = capacity
        self._in_flight = in_flight
        self._held: dict[int, bytes | memoryview] = {}  # blob row -> the blob, come and not read
        self._held_bytes = 0
        self._reserved = 0  # bytes asked for and not come yet
        self._asked: dict[int, int] = {}  # fetch number -> its cost, while it is asked and not come
        self._fetch_number = 0
        self._plan = np.empty(0, dtype=np.int32)  # blob rows, in the order the readers need them
        self._holder: Hashable = None  # the connection the plan came on: it goes when that connection closes
        self._next = 0
        self._generation = 0
        self._changed = threading.Condition()
        self._closed = False
        self.asked = self.hits = self.fetched = self.failed_batches = 0
        self._thread = threading.Thread(target=self._work, name="fanstore-node-ahead", daemon=True)
        self._thread.start()

    def replace_plan(self, holder: Hashable, rows: np.ndarray) -> None:
        """The plan is now `rows` (blob rows; empty: none), which came on connection `holder`; what came for the
        previous one and was not read is given back."""
        with self._changed:
            self._plan, self._holder = rows, holder
            self._next = 0
            self._generation += 1
            self._held.clear()
            self._held_bytes = 0
            self._changed.notify_all()

    def drop_plan_of(self, holder: Hashable) -> None:
        """Give back the plan if it came on connection `holder`, which has closed."""
        with self._changed:
            if self._holder == holder:
                self._plan, self._holder, self._next = np.empty(0, dtype=np.int32), None, 0
                self._generation += 1
                self._held.clear()
                self._held_bytes = 0
                self._changed.notify_all()

    def take(self, row: int) -> bytes | memoryview | None:
        """Blob `row` if it was fetched ahead (it is then forgotten: each is read once an epoch), else None."""
        with self._changed:
            self.asked += 1
            blob = self._held.pop(row, None)
            if blob is not None:
                self._held_bytes -= len(blob) + BLOB_OVERHEAD
                self.hits += 1
                self._changed.notify_all()
            return blob

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._next >= len(self._plan) or self._full()):
                    self._changed.wait()
                if self._closed:
                    return
                reads: list[BlobRead] = []
                numbers: list[int] = []
                while self._next < len(self._plan) and len(reads) < AHEAD_ROWS and (not reads or not self._full()):
                    row = int(self._plan[self._next])
                    chunk, offset, length = self._locate(row)
                    self._next += 1
                    self._fetch_number += 1
                    self._asked[self._fetch_number] = length + BLOB_OVERHEAD
                    numbers.append(self._fetch_number)
                    self._reserved += length + BLOB_OVERHEAD  # so that what is asked stays within the bounds
                    reads.append(BlobRead(chunk, offset, length, functools.partial(
                        self._arrived, self._generation, self._fetch_number, row)))
            try:
                started = self._start_reads(reads)
            except Exception:  # noqa: BLE001 - a bug in a source must not end fetching ahead for the whole job
                self._batch_failed(numbers)
                continue
            for read, read_started in zip(reads, started):
                if not read_started:  # stored on this node after all: its reader reads it from here
                    read.done(None, None)

    def _batch_failed(self, numbers: list[int]) -> None:
        """Forget a batch the source failed to start (a late answer to any of it is dropped): its readers fetch
        those blobs themselves, and the next batch is tried."""
        self.failed_batches += 1
        if self.failed_batches == 1:
            log.exception("fetching ahead for this node's readers failed; they fetch those %d blobs themselves",
                          len(numbers))
        with self._changed:
            for number in numbers:
                self._release(number)
            self._changed.notify_all()

    def _release(self, number: int) -> bool:
        """Ends fetch `number`'s reservation, once: False if it had ended already."""
        cost = self._asked.pop(number, None)
        if cost is None:
            return False
        self._reserved -= cost
        return True

    def _full(self) -> bool:
        return self._held_bytes + self._reserved >= self._capacity or self._reserved >= self._in_flight

    def _arrived(self, generation: int, number: int, row: int, blob: bytes | memoryview | None,
                 _error: ChunkError | None) -> None:
        """A fetch's outcome, from the MPI thread. A blob that did not come is left to its reader, which meets the
        error itself when it asks, and reports it."""
        with self._changed:
            if self._release(number) and blob is not None and generation == self._generation and not self._closed:
                self._held[row] = blob
                self._held_bytes += len(blob) + BLOB_OVERHEAD
                self.fetched += 1
            self._changed.notify_all()

    def stats(self) -> dict[str, Any]:
        """The node's readers' counters, and the plan's (by the connection it came on). Bytes held count
        BLOB_OVERHEAD a blob besides its own."""
        with self._changed:
            return {"asked": self.asked, "fetched_ahead": self.fetched, "ahead_hits": self.hits,
                    "ahead_failed_batches": self.failed_batches, "ahead_held_bytes": self._held_bytes,
                    "plans": {str(self._holder): {"rows": len(self._plan)}} if len(self._plan) else {}}

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
