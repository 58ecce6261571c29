"""How the ranks end when a signal (SIGTERM, Ctrl-C) comes before every rank agreed that all are mounted: together,
each through MPI_Finalize, with the signal's status; MPI_Abort only where they cannot agree in time.

No rank may leave MPI unfinalised while another still runs: MPICH's hydra proxy SIGKILLs a node's other ranks as
soon as one rank's PMI connection closes without PMI finalize, and reports any rank it reaps as killed: `BAD
TERMINATION`, exit 9, in about 1 run in 8 on a loaded machine, where the ranks left one by one. MPI_Abort on a
duplicated communicator (what the ranks once called) is no help: MPICH sends each rank an exit and leaves unfinalised,
so the ranks that had not exited yet met the same SIGKILL. MPI_Finalize waits for every rank, so the ranks first agree
that all of them are ending: a barrier on a communicator of their own, where it meets none of the job's collectives,
whatever each rank was in the middle of.

A signal may reach one rank only (`kill -TERM` of one process, not the launcher): that rank tells rank 0, rank 0
tells every rank, and each rank's relay thread sends the same signal to its own process, which then ends as if the
launcher had sent it. The relay is a thread that calls MPI, so only where the library gives MPI_THREAD_MULTIPLE; at
MPI_THREAD_SERIALIZED (--mpi-thread-only) the others are not told, and the signalled rank aborts the job after
ENDING_GRACE.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import say_line
from .polling import Backoff

NOTICE = 1  # the tag of a notice (the signal's number) on the relay's communicator
# Seconds between the relay thread's tests: a relayed signal's delay, and an idle rank's cost (one MPI_Test).
RELAY_POLL = 0.02
# Seconds an ending rank waits for every other one to end too: the launcher's signal reaches them all at once, and a
# relayed one within a few RELAY_POLLs; one slower than this (stuck in a system call) has the job aborted.
ENDING_GRACE = 10.0


class EarlyEnd:
    """This rank's part in ending the job early: the relay thread ("signal relay", which owns the receive of a
    notice and nothing else) until `close`, and the end itself (`end`)."""

    def __init__(self, mpi: Any, relay: bool) -> None:
        """Collective: every rank makes its own at the same point of its start. `relay`: MPI_THREAD_MULTIPLE."""
        self._mpi = mpi
        self._comm = mpi.COMM_WORLD.Dup()
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        self._stop = threading.Event()
        self._told = threading.Event()  # a notice came: some rank is ending early
        self._signalled = False  # a SIGTERM or SIGINT interrupted the main thread: it is ending this rank
        for number in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(number)
            if callable(previous):
                signal.signal(number, functools.partial(self._first_only, previous))
        self._thread = threading.Thread(target=self._relay, name="signal relay", daemon=True) \
            if relay and self._size > 1 else None
        if self._thread is not None:
            self._thread.start()

    def _first_only(self, previous: Callable[[int, Any], Any], signum: int, frame: Any) -> None:
        """The first signal interrupts the main thread as `previous` did; later ones (the launcher's and a relayed
        one both come) are dropped, so that none cuts short the unwinding the first began: a transport half stopped
        still called MPI once MPI was finalised (exit 1)."""
        if self._signalled:
            return
        self._signalled = True
        previous(signum, frame)

    def _relay(self) -> None:
        mpi = self._mpi
        notice = np.zeros(1, dtype=np.int32)
        request = self._comm.Irecv([notice, mpi.INT32_T], source=mpi.ANY_SOURCE, tag=NOTICE)
        while not self._stop.wait(RELAY_POLL):
            if request.Test():
                self._told.set()
                if not self._signalled:  # else ending already
                    os.kill(os.getpid(), int(notice[0]))  # the main thread ends this rank as for its own signal
                return
        request.Cancel()
        request.Wait()

    @property
    def relaying(self) -> bool:
        """Whether a relay thread tells this rank of the others' early ends (`told`)."""
        return self._thread is not None

    def told(self) -> bool:
        """Whether another rank told this one that it is ending early (the relay then signalled this process)."""
        return self._told.is_set()

    def close(self) -> None:
        """Every rank agreed that all are mounted (or is ending otherwise): from here on a signal is the lifecycle's,
        and MPI may be finalised. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def end(self, signum: int, line: str) -> None:
        """End this rank for `signum`, with every other rank, once it said `line`: returns once all agreed and MPI
        is finalised (the caller exits with 128 + `signum`); else aborts the job with that status after
        ENDING_GRACE."""
        for number in (signal.SIGTERM, signal.SIGINT):  # bounded below: a second signal (relayed) must not cut it
            signal.signal(number, signal.SIG_IGN)
        say_line(line)
        self.close()
        mpi = self._mpi
        told = list(range(1, self._size)) if self._rank == 0 else [0]
        notice = np.array([signum], dtype=np.int32)
        for peer in told:  # never waited on: a peer may be ending already, and MPI_Finalize leaves them be
            self._comm.Isend([notice, mpi.INT32_T], dest=peer, tag=NOTICE)
        everyone = self._comm.Ibarrier()
        deadline = time.monotonic() + ENDING_GRACE
        backoff = Backoff()
        while not everyone.Test():
            if time.monotonic() > deadline:
                say_line(f"fanstore serve: rank {self._rank}: not every rank ended within {ENDING_GRACE:g} s of the "
                         f"signal; aborting the job")
                mpi.COMM_WORLD.Abort(128 + signum)  # the launcher's own abort: it exits with this status
            backoff.sleep()
        mpi.Finalize()
