"""Remote blobs fetched ahead for the node's readers, the mount and fanstore.torch workers alike: one epoch plan per
reader that announces one (the mount's `--prefetch-list` or the directory it reads in order; each training
process's EpochSampler), all within one bound. A read of a blob still on its way waits for that fetch, never
starts another.

Several training processes may share a node (one per GPU, each with its own DataLoader and sampler share): each
announces its own order, and each order is fetched ahead. Plans take turns by need: the next blob started is
always for the plan with the fewest bytes started and not yet read. When the bound is full and a plan holds less
than its share (the bound over the number of plans) while another holds more, the other gives back its furthest
blobs down to its share and fetches them again later: a process that announced first, or that reads slowly or
not at all, cannot keep the others from fetching ahead.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, Hashable, Sequence

import numpy as np

from ..core.chunk_source import BlobRead, ReadDone
from ..errors import ChunkError, ChunkUnavailable
from ..core.format import FLAG_BLOCKED, NO_CHUNK
from ..core.index import Index
from ..core.thread_names import name_os_thread
from .node_protocol import PLAN_ROW, BlobLookup

log = logging.getLogger("fanstore.serve")

AHEAD_BYTES = 256 << 20  # remote blobs fetched ahead and not read yet, at most, for all plans together
# What holding a blob costs besides its bytes (its entry, its want, the bytes object): counted in the bounds, so
# that AHEAD_BYTES bounds memory for blobs of a few hundred bytes too.
BLOB_OVERHEAD = 512
# Of those, bytes asked of peers and not come yet: a request queued behind many others could miss its deadline.
AHEAD_IN_FLIGHT = 16 << 20
AHEAD_ROWS = 64  # plan rows started at once; the source asks each peer for its blobs among them together
MAX_PLANS = 64  # training processes with a plan at once on a node (one per GPU is a handful)
# A read that comes before its blob was started cancels that start when it lies this close ahead in a plan: a
# reader that runs ahead of the fetches must not leave blobs fetched after it passed them, held until the next plan.
CANCEL_WINDOW = 1024
PASSED = -1  # a plan row whose blob was read, failed, or was read before it was started: never started again


class PlanRefused(Exception):
    """A plan the holder does not take (the node has as many plans as it keeps)."""


class _Plan:
    """One process's epoch: blob rows in its order of need, and its wants (rows started and not read yet)."""

    __slots__ = ("fetched", "hits", "holder", "limit", "live", "next", "outstanding", "owner", "rows", "started")

    def __init__(self, owner: Hashable, holder: Hashable, rows: np.ndarray, limit: int | None = None) -> None:
        self.owner = owner  # the announcing process (a new plan of it replaces this one)
        self.holder = holder  # the connection it came on (its plan goes when that connection closes)
        self.rows = rows  # blob rows; PASSED where there is nothing (more) to start
        self.next = 0  # the first row not started yet
        self.limit = len(rows) if limit is None else limit  # rows from here on wait for the reader (allow)
        self.outstanding = 0  # what its wants cost (blobs held for it, or asked and not come)
        self.live: dict[int, int] = {}  # place in `rows` -> blob row, of each want, in the order started
        self.started = self.fetched = self.hits = 0

    def left(self) -> bool:
        return self.next < len(self.rows) and self.next < self.limit


class _Wanted:
    """A blob started for one or more plans and not yet read by all of them, or read before it came."""

    __slots__ = ("blob", "cost", "deliveries", "fetch", "hit_plans", "wants")

    def __init__(self, length: int, fetch: int) -> None:
        self.cost = length + BLOB_OVERHEAD
        # (plan, place in its rows) of each want, in the order started: a plan that lists the blob twice wants it
        # twice, and the first want is the one a read ends.
        self.wants: list[tuple[_Plan, int]] = []
        self.blob: bytes | memoryview | None = None  # None while asked and not come
        self.deliveries: list[ReadDone] = []  # reads that came while it was on its way, waiting for it
        self.hit_plans: list[_Plan | None] = []  # per delivery, the plan whose want it ended: a hit if the blob comes
        self.fetch = fetch  # the fetch it waits for: an answer to an earlier fetch of the same blob is not it

    def want(self, plan: _Plan, place: int, row: int) -> None:
        self.wants.append((plan, place))
        plan.live[place] = row
        plan.outstanding += self.cost

    def unneeded(self) -> bool:
        """Nobody wants it or waits for it any more: it can go."""
        return not self.wants and not self.deliveries

    def unwant(self, number: int) -> tuple[_Plan, int]:
        """End want `number` of this blob (0: the first); its plan and place."""
        plan, place = self.wants.pop(number)
        del plan.live[place]
        plan.outstanding -= self.cost
        return plan, place


class BlobsAhead:
    """Remote blobs of the node's plans, fetched in each plan's order and held until read once (a blob two plans
    list is fetched once and held until both read it).

    One thread (fanstore-node-ahead) starts the fetches (ChunkSource.start_reads: each peer's blobs several to a
    request), and they are handed over as they arrive from the source's thread: no thread waits for a peer.

    Locking: `_lock` guards every field below and the plans' and wants' fields; the endpoint's threads (take,
    replace_plan, drop_plans_of, stats) and the source's thread (_arrived) hold it briefly and call nothing outside
    while they do. The fetching thread is the only one that waits on `_room` (for a plan it may start a row of);
    it is woken (notify: one thread) only while it waits, and by a read or an arrival only when that lets it start
    a fetch, so a read that frees bytes the fetcher is not waiting for wakes no one.
    """

    def __init__(self, start_reads: Callable[[Sequence[BlobRead]], list[bool]],
                 locate: Callable[[int], tuple[int, int, int]], capacity: int = AHEAD_BYTES,
                 in_flight: int = AHEAD_IN_FLIGHT, max_plans: int = MAX_PLANS) -> None:
        self._start_reads = start_reads
        self._locate = locate  # blob row -> (chunk, offset, stored length)
        self._capacity = capacity
        self._in_flight = in_flight
        self._max_plans = max_plans
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._plans: dict[Hashable, _Plan] = {}  # owner -> its plan
        self._wanted: dict[int, _Wanted] = {}  # blob row -> the blob started for plans and not read by all
        self._held_bytes = 0  # what blobs come and not read cost (their bytes, BLOB_OVERHEAD each)
        self._reserved = 0  # what blobs asked for and not come yet cost
        self._asked: dict[int, int] = {}  # fetch number -> its cost, while it is asked and not come
        self._fetch_number = 0
        self._fetcher_waits = False
        self._closed = False
        self.asked = self.hits = self.fetched = self.failed_batches = self.cancelled = self.given_back = 0
        self.joined = 0  # reads that found their blob on its way and got it when it came (counted in hits too)
        self.joined_failed = 0  # reads that found their blob on its way, whose fetch failed: not hits
        self.wakeups = 0  # times a read, an arrival or a plan woke the fetching thread
        self._thread = threading.Thread(target=self._work, name="fanstore-node-ahead", daemon=True)
        self._thread.start()

    # --- the endpoint's side -------------------------------------------------------------------------------------

    def replace_plan(self, owner: Hashable, holder: Hashable, rows: np.ndarray, limit: int | None = None) -> None:
        """`owner`'s plan is now `rows` (blob rows in its order of need; empty: none), which came on connection
        `holder`; what was started for its previous plan and not read is given back. With `limit`, only rows before
        it are started, until `allow` moves it on (a reader that reports how far it got). PlanRefused when the node
        keeps plans of MAX_PLANS other processes already."""
        with self._lock:
            old = self._plans.pop(owner, None)
            if old is not None:
                self._forget(old)
            if len(rows):
                if len(self._plans) >= self._max_plans:
                    raise PlanRefused(f"this node keeps plans of {self._max_plans} processes at most, and has as many")
                self._plans[owner] = _Plan(owner, holder, rows.copy(), limit)  # its own: rows read are marked
            self._wake_fetcher(always=True)  # the shares changed: the fetcher may have room to make

    def allow(self, owner: Hashable, limit: int) -> None:
        """Rows of `owner`'s plan before `limit` may be started now."""
        with self._lock:
            plan = self._plans.get(owner)
            if plan is not None and limit > plan.limit:
                plan.limit = limit
                self._wake_fetcher()

    def drop_plans_of(self, holder: Hashable) -> None:
        """Give back the plans that came on connection `holder`, which has closed."""
        with self._lock:
            gone = [plan for plan in self._plans.values() if plan.holder == holder]
            for plan in gone:
                del self._plans[plan.owner]
                self._forget(plan)
            if gone:
                self._wake_fetcher(always=True)

    def claim(self, row: int, deliver: ReadDone) -> bool:
        """A read of blob `row`: True when it was fetched ahead or is on its way, and `deliver(blob, None)` is called
        once it is here (at once, on this thread, if it is; else from the source's thread), or `deliver(None,
        error)` if that fetch fails. False when it was not started: its reader fetches it. Either way the read is
        one of the blob's wants, and a read that comes before its blob was started cancels that start."""
        with self._lock:
            claimed, blob = self._claim(row, deliver)
            self._wake_fetcher()
        if blob is not None:
            deliver(blob, None)
        return claimed

    def claim_many(self, rows: Sequence[int],
                   deliver: Callable[[int, bytes | memoryview | None, ChunkError | None], None]) -> list[bool]:
        """`claim` of several blobs (a READS' rows) under one hold of the lock; `deliver(number, blob, error)` for
        the number-th of them. A row < 0 is not claimed."""
        claimed = [False] * len(rows)
        here: list[tuple[int, bytes | memoryview]] = []
        with self._lock:
            for number, row in enumerate(rows):
                if row >= 0:
                    claimed[number], blob = self._claim(row, functools.partial(deliver, number))
                    if blob is not None:
                        here.append((number, blob))
            self._wake_fetcher()
        for number, blob in here:
            deliver(number, blob, None)
        return claimed

    def _claim(self, row: int, deliver: ReadDone) -> tuple[bool, bytes | memoryview | None]:
        """Under the lock: whether `row` was started, and its blob if it has come (else `deliver` waits for it)."""
        self.asked += 1
        entry = self._wanted.get(row)
        if entry is None:
            self._cancel_start(row)
            return False, None
        plan: _Plan | None = None
        if entry.wants:
            plan, place = entry.unwant(0)
            plan.rows[place] = PASSED
        blob = entry.blob
        if blob is None:  # a hit (and a join) once it comes: a fetch that fails is no hit
            entry.deliveries.append(deliver)
            entry.hit_plans.append(plan)
        else:
            self.hits += 1
            if plan is not None:
                plan.hits += 1
            self._release(row, entry)
        return True, blob

    def take(self, row: int) -> bytes | memoryview | None:
        """Blob `row` if it was fetched ahead (waiting for it while it is on its way), else None: its reader fetches
        it. For a reader on a thread of its own (the node endpoint's connections)."""
        arrived = threading.Event()
        outcome: list[bytes | memoryview | None] = [None]

        def deliver(blob: bytes | memoryview | None, _error: ChunkError | None) -> None:
            outcome[0] = blob
            arrived.set()

        if not self.claim(row, deliver):
            return None
        arrived.wait()  # the fetch has a deadline (RemoteBlobs), and close() answers whatever still waits
        return outcome[0]

    def holds(self, row: int) -> bool:
        """Whether blob `row` has come and waits for a read (a take that finds it not come yet counts as its read)."""
        with self._lock:
            entry = self._wanted.get(row)
            return entry is not None and entry.blob is not None

    def stats(self) -> dict[str, object]:
        """The node's readers' counters, and each plan's, by the process that announced it. Bytes held and asked
        count BLOB_OVERHEAD a blob besides its own."""
        with self._lock:
            return {"asked": self.asked, "fetched_ahead": self.fetched, "ahead_hits": self.hits,
                    "ahead_failed_batches": self.failed_batches, "ahead_cancelled": self.cancelled,
                    "ahead_given_back": self.given_back, "ahead_joined": self.joined,
                    "ahead_joined_failed": self.joined_failed,
                    "ahead_held_bytes": self._held_bytes,
                    "ahead_asked_bytes": self._reserved,
                    "plans": {str(plan.owner): {"rows": len(plan.rows), "started": plan.started,
                                                "fetched": plan.fetched, "hits": plan.hits,
                                                "outstanding_bytes": plan.outstanding}
                              for plan in self._plans.values()}}

    def close(self) -> None:
        """Stop fetching ahead; reads still waiting for a blob on its way are answered that it will not come."""
        with self._lock:
            self._closed = True
            self._room.notify()
            waiting = [deliver for entry in self._wanted.values() for deliver in entry.deliveries]
            for entry in self._wanted.values():
                self.joined_failed += len(entry.deliveries)
                entry.deliveries, entry.hit_plans = [], []
        self._thread.join()
        closing = ChunkUnavailable("the node's holder of blobs fetched ahead has closed")
        for deliver in waiting:
            deliver(None, closing)

    # --- the fetching thread -------------------------------------------------------------------------------------

    def _work(self) -> None:
        name_os_thread()
        while True:
            with self._lock:
                while not self._closed:
                    self._share_room()
                    if self._next_plan() is not None:
                        break
                    self._fetcher_waits = True
                    self._room.wait()
                if self._closed:
                    return
                reads, fetches = self._next_reads()
            if not reads:
                continue  # every row taken was wanted already, or passed
            try:
                started = self._start_reads(reads)
            except Exception:  # noqa: BLE001 - a bug in a source must not end fetching ahead for the whole node
                self._batch_failed(fetches)
                continue
            for read, read_started in zip(reads, started):
                if not read_started:  # stored on this node after all: its reader reads it from here
                    read.done(None, None)

    def _next_reads(self) -> tuple[list[BlobRead], list[tuple[int, int]]]:
        """Up to AHEAD_ROWS plan rows to start now, taken one at a time for the plan that needs one most; with
        each read, its (fetch number, blob row)."""
        reads: list[BlobRead] = []
        fetches: list[tuple[int, int]] = []
        while len(reads) < AHEAD_ROWS:
            plan = self._next_plan()
            if plan is None:
                break
            place = plan.next
            row = int(plan.rows[place])
            plan.next += 1
            if row == PASSED:
                continue
            entry = self._wanted.get(row)
            if entry is None:
                chunk, offset, length = self._locate(row)
                self._fetch_number += 1
                entry = self._wanted[row] = _Wanted(length, self._fetch_number)
                self._asked[self._fetch_number] = entry.cost
                self._reserved += entry.cost  # so that what is asked stays within the bounds
                fetches.append((self._fetch_number, row))
                reads.append(BlobRead(chunk, offset, length,
                                      functools.partial(self._arrived, self._fetch_number, row)))
                plan.started += 1
            entry.want(plan, place, row)
        return reads, fetches

    def _arrived(self, fetch: int, row: int, blob: bytes | memoryview | None, error: ChunkError | None) -> None:
        """A fetch's outcome, from the source's thread, handed to the reads that wait for it. A blob that did not
        come is left to its readers, which meet the error themselves when they fetch it, and report it."""
        deliveries: list[ReadDone] = []
        with self._lock:
            cost = self._asked.pop(fetch, None)
            if cost is None:  # its batch failed to start, and was given back already
                return
            self._reserved -= cost
            entry = self._wanted.get(row)
            if entry is not None and entry.fetch == fetch and entry.blob is None:
                deliveries, entry.deliveries = entry.deliveries, []
                hit_plans, entry.hit_plans = entry.hit_plans, []
                if blob is None or self._closed:
                    self.joined_failed += len(deliveries)
                    self._drop(row, entry)
                else:
                    self._joined_hits(hit_plans)
                    self.fetched += 1
                    for plan in {plan for plan, _ in entry.wants}:
                        plan.fetched += 1
                    if entry.wants:
                        entry.blob = blob
                        self._held_bytes += entry.cost
                    else:  # only reads waited for it: they have it now
                        del self._wanted[row]
            self._wake_fetcher()
        if blob is None and error is None:
            error = ChunkUnavailable(f"blob {row} fetched ahead did not come")
        for deliver in deliveries:
            if blob is not None:
                deliver(blob, None)
            else:
                deliver(None, error)

    def _batch_failed(self, fetches: list[tuple[int, int]]) -> None:
        """Give back a batch the source failed to start (a late answer to any of it is dropped): its readers fetch
        those blobs themselves, and the next batch is tried."""
        waiting: list[ReadDone] = []
        with self._lock:
            self.failed_batches += 1
            first = self.failed_batches == 1
            for number, row in fetches:
                self._reserved -= self._asked.pop(number, 0)
                entry = self._wanted.get(row)
                if entry is not None and entry.fetch == number:
                    waiting += entry.deliveries  # reads that came while the batch was being started
                    self.joined_failed += len(entry.deliveries)
                    entry.deliveries, entry.hit_plans = [], []
                    self._drop(row, entry)
            self._wake_fetcher()
        failed = ChunkUnavailable("fetching ahead failed to start")
        for deliver in waiting:
            deliver(None, failed)
        if first:
            log.exception("fetching ahead for this node's readers failed; they fetch those %d blobs themselves",
                          len(fetches))

    # --- under the lock ------------------------------------------------------------------------------------------

    def _next_plan(self) -> _Plan | None:
        """The plan with rows left that has the fewest bytes wanted; None when no fetch may start now (the bounds
        are reached, or no plan has rows left)."""
        if self._held_bytes + self._reserved >= self._capacity or self._reserved >= self._in_flight:
            return None
        best: _Plan | None = None
        for plan in self._plans.values():
            if plan.left() and (best is None or plan.outstanding < best.outstanding):
                best = plan
        return best

    def _share_room(self) -> None:
        """When the bound is full and a plan with rows left holds less than half its share, the plans holding more
        than their share give back their furthest wants down to it (started again when their turn comes). Half:
        a plan just over its share never gives back a blob only to fetch it again at once."""
        if self._held_bytes + self._reserved < self._capacity or len(self._plans) < 2:
            return
        share = self._capacity // len(self._plans)
        if not any(plan.left() and plan.outstanding < share // 2 for plan in self._plans.values()):
            return
        for plan in self._plans.values():
            while plan.outstanding > share and plan.live:
                furthest = next(reversed(plan.live))
                row = plan.live[furthest]
                entry = self._wanted[row]
                entry.unwant(entry.wants.index((plan, furthest)))
                plan.next = furthest  # started again when its turn comes
                self.given_back += 1
                self._release(row, entry)

    def _joined_hits(self, plans: list[_Plan | None]) -> None:
        """Reads that waited for a blob on its way, which came: hits now."""
        self.hits += len(plans)
        self.joined += len(plans)
        for plan in plans:
            if plan is not None:
                plan.hits += 1

    def _release(self, row: int, entry: _Wanted) -> None:
        """Let the blob go if nobody wants it or waits for it (one on its way is dropped when it comes)."""
        if entry.unneeded():
            del self._wanted[row]
            if entry.blob is not None:
                self._held_bytes -= entry.cost

    def _drop(self, row: int, entry: _Wanted) -> None:
        """A blob that will not come: its wants end, and their rows are not started again."""
        del self._wanted[row]
        while entry.wants:
            plan, place = entry.unwant(0)
            plan.rows[place] = PASSED

    def _forget(self, plan: _Plan) -> None:
        """Take `plan`'s wants out; blobs no other plan wants are given back (one on its way is dropped when it
        comes)."""
        for row in set(plan.live.values()):
            entry = self._wanted[row]
            entry.wants = [(other, place) for other, place in entry.wants if other is not plan]
            self._release(row, entry)
        plan.live.clear()
        plan.outstanding = 0

    def _cancel_start(self, row: int) -> None:
        """A read of `row` that no want was waiting for: the first plan that lists it within CANCEL_WINDOW of its
        next row does not start it (the read was that want)."""
        for plan in self._plans.values():
            window = plan.rows[plan.next : plan.next + CANCEL_WINDOW]
            places = np.flatnonzero(window == row)
            if len(places):
                plan.rows[plan.next + int(places[0])] = PASSED
                self.cancelled += 1
                return

    def _wake_fetcher(self, always: bool = False) -> None:
        """Wake the fetching thread if it waits, and (unless `always`) only if it could start a fetch now."""
        if self._fetcher_waits and (always or self._closed or self._next_plan() is not None):
            self._fetcher_waits = False
            self.wakeups += 1
            self._room.notify()


MOUNT_PLAN = "mount"  # the owner (and holder) of the mount's plan: one mount a rank, one plan
# How far ahead of the mount's reader its plan is fetched, in files from other nodes: enough to keep requests to
# every peer in flight, not so many that a reader who stops (or a rank reading other files first) has the node
# fetch its whole epoch. The reader's progress is told every REACHED_STEP of them.
MOUNT_WINDOW = 256
REACHED_STEP = 32


class EntriesAhead:
    """The holder as the mount sees it (prefetch.FetchedAhead): files by entry number. Which of its files the holder
    fetches, and each one's blob row, are worked out once, at mount."""

    def __init__(self, holder: BlobsAhead, lookup: BlobLookup, index: Index, remote: np.ndarray) -> None:
        """`remote`: per entry, whether the file's blob comes from another node (ChunkSource.may_block)."""
        entries = index.entries
        whole = (remote & (entries["chunk"] != NO_CHUNK) & ((entries["flags"] & FLAG_BLOCKED) == 0)
                 & ((entries["mode"] & 0o170000) == 0o100000))
        files = np.flatnonzero(whole)
        wanted = np.empty(len(files), dtype=PLAN_ROW)
        wanted["chunk"], wanted["offset"] = entries["chunk"][files], entries["offset"][files]
        wanted["length"] = entries["stored_len"][files]
        # Per entry, its blob's row (-1: none fetched ahead), in the narrowest type: 4 bytes an entry below 2^31
        # blobs, which matters at 10^7 files; a read looks one up.
        self._rows = np.full(len(entries), -1, dtype=lookup.row_dtype)
        self._rows[files] = lookup.plan_rows(wanted, 0) if len(files) else []
        self.covers: np.ndarray = self._rows >= 0  # per entry: fetched by the holder when a plan names it
        self._holder = holder
        # Of the entries followed: each one's place in that order (-1: not in it), and how many of the places
        # before each are files the holder fetches (the plan's rows), so a read's place gives the plan's limit.
        self._place = np.full(len(entries), -1, dtype=np.int32 if len(entries) < 2**31 else np.int64)
        self._followed = np.empty(0, dtype=np.int64)
        self._rows_before = np.zeros(1, dtype=np.int64)
        self._allowed = 0

    def follow(self, entries: np.ndarray, start_now: bool = False) -> None:
        """The mount's plan is now `entries`, fetched up to MOUNT_WINDOW files ahead of the reader (`reached`): from
        the first read on, or (`start_now`) at once, the reader having just read the entry before them."""
        entries = np.asarray(entries, dtype=np.int64)
        rows = self._rows[entries]
        covered = rows >= 0
        self._place[self._followed] = -1
        self._followed = entries
        self._place[entries[::-1]] = np.arange(len(entries) - 1, -1, -1)  # an entry listed twice: its first place
        self._rows_before = np.concatenate(([0], np.cumsum(covered)))
        self._allowed = MOUNT_WINDOW if start_now else 0
        self._holder.replace_plan(MOUNT_PLAN, MOUNT_PLAN, rows[covered], limit=self._allowed)

    def reached(self, entry: int) -> None:
        """The mount's reader is at `entry`: its plan may be fetched up to MOUNT_WINDOW files further."""
        place = int(self._place[entry])
        if place < 0:
            return
        limit = int(self._rows_before[place + 1]) + MOUNT_WINDOW
        if limit >= self._allowed + REACHED_STEP:
            self._allowed = limit
            self._holder.allow(MOUNT_PLAN, limit)

    def claim(self, entry: int, deliver: ReadDone) -> bool:
        row = int(self._rows[entry])
        return row >= 0 and self._holder.claim(row, deliver)

    def stats(self) -> dict[str, object]:
        plan = self._holder.stats()["plans"].get(MOUNT_PLAN)  # type: ignore[union-attr]
        return plan if plan is not None else {"rows": 0, "started": 0, "fetched": 0, "hits": 0,
                                              "outstanding_bytes": 0}
