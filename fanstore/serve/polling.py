"""Waiting on MPI without spinning a core.

With the MPI libraries these daemons run on, a blocking call (Recv, Wait, Probe, Barrier) polls in a loop for as
long as it waits, which takes a core from the training job. Every wait here is a Testsome (or an Improbe) between
sleeps that start short, to keep latency low while messages flow, and back off when nothing happens.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

SHORTEST_SLEEP = 20e-6  # seconds: about a message's latency between ranks on one node
LONGEST_SLEEP = 2e-3  # idle: 1-5% of a core was measured at 1-5 ms
BUSY_LONGEST_SLEEP = 200e-6  # while a request of ours is in flight, its reply is awaited this closely at least
GROWTH = 1.5


class Backoff:
    """A sleep that grows by GROWTH after each idle round, back to the shortest after a round that did work.

    Sleeps on an Event, so another thread can cut one short (`wake`) when it hands over work."""

    def __init__(self, shortest: float = SHORTEST_SLEEP, longest: float = LONGEST_SLEEP) -> None:
        self.shortest = shortest
        self.longest = longest
        self._delay = shortest
        self._wakeup = threading.Event()

    def progressed(self) -> None:
        self._delay = self.shortest

    def sleep(self, longest: float | None = None) -> None:
        limit = self.longest if longest is None else min(longest, self.longest)
        delay = min(self._delay, limit)
        if self._wakeup.wait(delay):
            self._wakeup.clear()
            self._delay = self.shortest
            return
        self._delay = min(self._delay * GROWTH, self.longest)

    def wake(self) -> None:
        self._wakeup.set()


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


def first_failed_rank(comm: Any, failing: bool) -> int | None:
    """Every rank says whether it can go on (an Iallgather, polled); the lowest rank that cannot, or None. Used
    before a step no rank may start alone, so that one rank's problem stops every rank, not just itself."""
    import numpy as np
    from mpi4py import MPI

    mine = np.array([1 if failing else 0], dtype=np.int8)
    everyone = np.zeros(comm.Get_size(), dtype=np.int8)
    wait_all([comm.Iallgather([mine, MPI.INT8_T], [everyone, MPI.INT8_T])])
    failed = np.flatnonzero(everyone)
    return int(failed[0]) if len(failed) else None
