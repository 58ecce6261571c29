"""Waiting on MPI without spinning a core.

With the MPI libraries these daemons run on, a blocking call (Recv, Wait, Probe, Barrier) polls in a loop for as
long as it waits, which takes a core from the training job. Every wait here is a Testsome (or an Improbe) between
sleeps that start short, to keep latency low while messages flow, and back off when nothing happens.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from ..core.libc import prctl

SHORTEST_SLEEP = 20e-6  # seconds: about a message's latency between ranks on one node
LONGEST_SLEEP = 2e-3  # idle: 1-5% of a core was measured at 1-5 ms
GROWTH = 1.5
# Peers read in bursts (an epoch): a request comes every few hundred microseconds while one lasts. For LINGER
# seconds after the last work the sleep stays at most LINGER_LONGEST_SLEEP, so the next request of a burst is not
# met by a 2 ms sleep (measured: 0.4 ms of a 1 ms remote read was the owner's sleep); an idle rank still backs off.
LINGER = 0.2
LINGER_LONGEST_SLEEP = 100e-6
# For SPIN seconds after work the loop does not sleep but yields the CPU (sched_yield) between polls. On these VMs a
# timed sleep of any length costs 30-50 us of CPU to wake from, more than the 1.4 us a Testsome costs, and a reply
# is often a few tens of microseconds away: a 128 KiB request-reply between two ranks took 263 us and 127 us of CPU
# with sleeps alone, 105 us and 53 us with a 50 us spin (both ranks on one CPU; 185 against 40 us on two CPUs).
# Yielding, not spinning, lets a peer or reader on the same CPU run first; an idle rank never spins.
SPIN = 50e-6
# With a doorbell (doorbell.py) a request or reply rings the rank awake, so it needs no linger and its first sleep
# after work can be long: a timed wake is then only for MPI's own progress (the rest of a large message) and for
# deadlines. Measured with 3 ranks reading 128 KiB files from each other on 2 CPUs (rank and reader on one, peers on
# the other): a remote read's round trip 458 -> 246 us, a peer's CPU per file served 0.31-0.37 -> 0.13-0.14 ms.
RUNG_SHORTEST_SLEEP = 500e-6  # a bell's wait rounds any sleep below 1 ms up to it (Doorbell.wait)
# An idle rung rank needs no timed wake to answer (a request rings it), only to complete a collective now and then
# and to meet a peer whose ring was lost, so it backs off further: idle CPU per rank 0.8-1.2% of a core, against
# 1.8-2.8% when it backed off to LONGEST_SLEEP (bench_serve, 3 ranks).
RUNG_LONGEST_SLEEP = 10e-3
_PR_SET_TIMERSLACK = 29


class Bell(Protocol):
    """What wakes a sleeping poller besides its timer (doorbell.Doorbell)."""

    def wait(self, seconds: float) -> bool:
        """Sleep until rung or `seconds` pass; True if rung."""

    def ring_self(self) -> None:
        """Ring it from another thread of this process."""


class Backoff:
    """A sleep that grows by GROWTH after each idle round, back to the shortest after a round that did work, and
    that stays short for `linger` seconds after the last work; for `spin` seconds after work it only yields.

    Another thread can cut a sleep short (`wake`) when it hands over work; with a doorbell (`rung_by`), so can a
    peer that sent this rank a message."""

    def __init__(self, shortest: float = SHORTEST_SLEEP, longest: float = LONGEST_SLEEP, linger: float = LINGER,
                 linger_longest: float = LINGER_LONGEST_SLEEP, spin: float = SPIN,
                 bell: Bell | None = None) -> None:
        self.bell = bell
        self.shortest = shortest
        self.longest = longest
        self.linger = linger
        self.linger_longest = linger_longest
        self.spin = spin
        self._delay = shortest
        self._last_work = time.monotonic()
        # Held while no wake-up is pending; `wake` releases it. A bare lock, not an Event: an idle turn of a
        # polling loop is mostly this wait, and Event.wait costs several times as much Python per call.
        self._wakeup = threading.Lock()
        self._wakeup.acquire()
        # With a bell: a ring to self is on its way and not yet taken, so another `wake` need not send one (a
        # syscall, where work is handed over once a file).
        self._ring_pending = False

    @classmethod
    def rung_by(cls, bell: Bell | None) -> "Backoff":
        """The sleep of a thread that a doorbell wakes: no linger, a long first sleep; the usual one without."""
        if bell is None:
            return cls()
        return cls(shortest=RUNG_SHORTEST_SLEEP, longest=RUNG_LONGEST_SLEEP, linger=0.0, bell=bell)

    def progressed(self) -> None:
        self._delay = self.shortest
        self._last_work = time.monotonic()

    def next_delay(self, longest: float | None = None, now: float | None = None) -> float:
        """How long the next idle sleep lasts (unless woken): capped by `longest`, and by `linger_longest` while
        the last work is less than `linger` seconds old."""
        limit = self.longest if longest is None else min(longest, self.longest)
        if self._delay > self.linger_longest:
            now = time.monotonic() if now is None else now
            if now - self._last_work < self.linger:
                limit = min(limit, self.linger_longest)
        return min(self._delay, limit)

    def sleep(self, longest: float | None = None) -> None:
        if time.monotonic() - self._last_work < self.spin:
            if self._woken(0.0):
                self.progressed()
            else:
                os.sched_yield()
            return
        if self._woken(self.next_delay(longest)):
            self.progressed()
            return
        self._delay = min(self._delay * GROWTH, self.longest)

    def _woken(self, seconds: float) -> bool:
        if self.bell is not None:
            rung = self.bell.wait(seconds)
            # Cleared after the wait took the rings, before the caller looks for work: work handed over before this
            # line is found by that look; after it, its `wake` rings again.
            self._ring_pending = False
            return rung
        if seconds <= 0:
            return self._wakeup.acquire(blocking=False)
        return self._wakeup.acquire(timeout=seconds)

    def wake(self) -> None:
        """Cut the sleep short; the caller hands its work over first (the sleeper looks for it after waking)."""
        if self.bell is not None:
            if not self._ring_pending:
                self._ring_pending = True
                self.bell.ring_self()
            return
        try:
            self._wakeup.release()
        except RuntimeError:  # released already: a wake-up is pending
            pass


def precise_sleeps() -> bool:
    """Let the calling thread's short sleeps last what they ask: Linux adds a 'timer slack' of 50 us to every
    timed wait of a thread, which more than triples a 20 us poll. Only the polling thread calls this; False where
    the call is missing."""
    return prctl(_PR_SET_TIMERSLACK, 1000)


def wait_all(requests: Sequence[Any], on_idle: Callable[[], None] | None = None, deadline: float | None = None,
             what: str = "MPI requests") -> None:
    """Complete every request (mpi4py Requests), polling with Testsome and a backing-off sleep.

    `on_idle` runs between polls (a progress bar, or serving something else). Past `deadline` (monotonic seconds)
    the requests still pending are cancelled and TimeoutError names `what`."""
    from mpi4py import MPI

    pending = [request for request in requests if request != MPI.REQUEST_NULL]
    backoff = Backoff()
    while pending:
        done = MPI.Request.Testsome(pending)
        if done:
            finished = set(done)
            pending = [request for position, request in enumerate(pending) if position not in finished]
            backoff.progressed()
            continue
        if deadline is not None and time.monotonic() > deadline:
            for request in pending:
                request.Cancel()
            raise TimeoutError(f"{what}: not complete in time")
        if on_idle is not None:
            on_idle()
        backoff.sleep()


def first_failed_rank(comm: Any, failing: bool, on_idle: Callable[[], None] | None = None) -> int | None:
    """Every rank says whether it can go on (an Iallgather, polled; `on_idle` between polls); the lowest rank that
    cannot, or None. Used before a step no rank may start alone, so that one rank's problem stops every rank, not
    just itself."""
    import numpy as np
    from mpi4py import MPI

    mine = np.array([1 if failing else 0], dtype=np.int8)
    everyone = np.zeros(comm.Get_size(), dtype=np.int8)
    wait_all([comm.Iallgather([mine, MPI.INT8_T], [everyone, MPI.INT8_T])], on_idle=on_idle)
    failed = np.flatnonzero(everyone)
    return int(failed[0]) if len(failed) else None
