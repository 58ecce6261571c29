"""Peer requests made by the mount's event loop itself, where the MPI library lets any thread call it
(MPI_THREAD_MULTIPLE) and the ranks have doorbells.

Through the MPI thread (transport.py), a file from a peer costs the reading rank two hand-offs between threads: the
loop wakes the MPI thread to send the request, and the MPI thread, woken by the peer's ring, wakes the loop with the
blob. Each is a wake-up and a pass of the GIL between two busy threads. Measured with `mpiexec -n 2`, 64 KiB blobs
asked one at a time from a trio loop: 210-234 us a round trip and 185 us of the asking rank's CPU that way; 80-90 us
and 50 us with the loop asking itself (both ranks on one CPU: 268 against 96-101 us).

So the loop posts the reply's Irecv and the request's Isend, rings the peer, and goes on with its other work; the
peer rings the loop's reply bell (doorbell.py) when it answers, and a task of the loop (the pump) then completes
what came with Testsome. A fetch ahead of the reader is not waited for, so its reply rings nobody: the mount's reads
collect it (`collect`), and the pump's timer when no read comes, which spares the loop a wake per file.

The rules are the MPI thread's: a deadline per request (past it every request of the loop's to that peer is
cancelled, the MPI thread skips the peer as for its own, and the reads fall back to DEST); at most `max_in_flight`
requests to one peer (past it, requests go the MPI thread's way); replies that come after a request was given up are
dropped by the MPI thread, which also completes the cancelled requests.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import trio

from ..chunk_source import BlobRead, ReadDone
from ..errors import ChunkUnavailable
from .doorbell import Doorbell
from .peer_messages import MAX_BLOBS, QUIET_REPLY, RING_REPLY_BELL, TAG_REQUEST, hand_out_reply, reply_room, \
    request_message
from .transport import PeerTransport

log = logging.getLogger("fanstore.serve")

# The pump's longest wait while a request is out: a ring can be lost (UDP), and a large message may need more
# progress than the first poll after its ring gives it. The loop's timers have a resolution of 1 ms.
WAIT_WHILE_OUT = 1e-3
# That timer is one cancel scope whose deadline moves, not a scope per wait: entering and closing a scope, and above
# all cancelling one (trio formats the task's repr for the reason, then throws Cancelled into the pump), cost more
# of the loop's time than the rest of a request. While replies keep coming the deadline is pushed back once it is
# nearer than half of WAIT_WHILE_OUT, so it never fires and is moved at most every half of it.

# After a ring or a reply, while requests are still out, the pump polls again at once for this long (yielding to
# the loop's other tasks between polls), as the MPI thread does after work: the next reply, or the rest of a large
# one, is often microseconds away.
SPIN = 50e-6
_FAILED = "asking peers from the mount's loop failed"


@dataclass(eq=False, slots=True)
class _LoopFetch:
    peer: int
    reads: Sequence[BlobRead]  # the blobs asked, which the reply carries one after the other
    tag: int
    buffer: bytearray
    receive: Any
    send: Any
    deadline: float


class LoopRequests:
    """Requests to peers from one trio event loop (the mount's), answered on this rank's reply bell."""

    def __init__(self, transport: PeerTransport, bell: Doorbell) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._transport = transport
        self._comm = transport.comm
        self._bell = bell
        self._options = transport.options
        self._first_tag, self._last_tag = transport.loop_tags
        self._next_tag = self._first_tag
        self._pending: list[_LoopFetch] = []  # in the order they were sent, which is the order of their deadlines
        self._receives: list[Any] = []  # each pending one's receive, for Testsome
        self._sends: list[Any] = []  # requests sent and not yet complete
        self._statuses: list[Any] = [MPI.Status()]
        self._in_flight = [0] * transport.size
        self.counters = transport.loop_counters
        self._token: Any = None  # the trio run the pump serves
        self._timer: trio.CancelScope | None = None  # the pump's timer: no deadline once idle (see _arm)
        self._failed = False  # the pump met a bug: from then on the MPI thread asks

    def start(self, peer: int, chunk: int, offset: int, length: int, done: ReadDone, ahead: bool = False) -> bool:
        """Ask `peer` for a blob; `done` is called on this loop by the request's deadline. False when this cannot
        be asked from here (not on a trio loop, the peer skipped or at its cap): the caller asks the MPI thread.

        `ahead`: a fetch ahead of the reader, which nobody waits for yet. Its reply rings nobody: the mount's
        reads take it with `collect`, and the pump's timer when no read comes. Measured with 3 ranks, 128 KiB
        files, --prefetch-list, a CPU per rank: 0.300-0.308 ms a remote file against 0.324-0.330 with a ring
        and a wake of the loop for every reply (local files: 0.249-0.256)."""
        return self.start_many(peer, (BlobRead(chunk, offset, length, done),), ahead)

    def start_many(self, peer: int, reads: Sequence[BlobRead], ahead: bool = False) -> bool:
        """start() for up to MAX_BLOBS blobs of `peer` in one request and one reply: the request's cost on both
        sides (its messages, the peer's wake, the completion) is paid once for them all."""
        if not 0 < len(reads) <= MAX_BLOBS:
            raise ValueError(f"a request asks for 1 to {MAX_BLOBS} blobs, not {len(reads)}")
        if self._failed:
            return False
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return False
        if token is not self._token:  # the first request of this loop (a mount): the pump starts with it
            self._token = token
            trio.lowlevel.spawn_system_task(self._pump, name="fanstore-peer-replies")
        if self._in_flight[peer] >= self._options.max_in_flight or self._transport.skipped(peer):
            return False
        tag = self._next_tag
        self._next_tag = tag + 1 if tag < self._last_tag else self._first_tag
        buffer = bytearray(reply_room(sum(read.length for read in reads), len(reads)))
        receive = self._comm.Irecv([buffer, self._mpi.BYTE], source=peer, tag=tag)
        message = request_message(tag, RING_REPLY_BELL | (QUIET_REPLY if ahead else 0), reads)
        send = self._comm.Isend([message, self._mpi.BYTE], dest=peer, tag=TAG_REQUEST)
        self._bell.ring(peer)
        self._pending.append(_LoopFetch(peer, reads, tag, buffer, receive, send,
                                        time.monotonic() + self._options.timeout))
        self._receives.append(receive)
        if not send.Test():  # a request is a few dozen bytes: it has mostly gone already
            self._sends.append(send)
        self._in_flight[peer] += 1
        self.counters[peer].asked += 1
        if self._timer is not None and self._timer.deadline == math.inf:  # the pump waits with no timer
            self._arm(self._timer)
        return True

    def collect(self) -> None:
        """Complete, now, the requests whose replies have come: called by the loop where it runs anyway (the mount,
        before each read), so replies that ring nobody cost no wake of their own. The pump's timer is pushed back
        when something came, as when the pump itself finds it."""
        if not self._pending or self._failed:
            return
        try:
            if self._complete():
                self._check_deadline()
                if self._timer is not None:
                    self._arm(self._timer)
        except Exception:  # noqa: BLE001 - as in the pump: a bug costs the requests out, never the read
            self._failed = True
            log.exception("rank %d: %s; the MPI thread asks from now on", self._transport.rank, _FAILED)
            self._hand_over(_FAILED)

    async def _pump(self) -> None:
        """Complete the loop's requests as their replies ring, until the loop ends. A failure here (a bug) must
        cost the requests out, which fall back, never the mount: the MPI thread asks from then on."""
        reason = "the mount has ended"
        try:
            await self._complete_as_rung()
        except Exception:  # noqa: BLE001 - see above; trio's Cancelled, at the loop's end, is not an Exception
            self._failed = True
            reason = _FAILED
            log.exception("rank %d: %s; the MPI thread asks from now on", self._transport.rank, reason)
        finally:
            self._hand_over(reason)

    async def _complete_as_rung(self) -> None:
        fd = self._bell.reply_fileno()
        spin_until = 0.0
        while True:
            with trio.CancelScope() as self._timer:
                self._arm(self._timer)
                while True:
                    rung = False
                    if self._pending and time.monotonic() < spin_until:
                        await trio.lowlevel.checkpoint()
                    else:
                        await trio.lowlevel.wait_readable(fd)
                        rung = True
                    if self._failed:  # a read's collect met a bug and handed everything over
                        return
                    if rung:
                        self._bell.take_replies()
                    if (self._complete() or rung) and self._pending:
                        spin_until = time.monotonic() + SPIN
                    self._check_deadline()
                    self._arm(self._timer)
            self._timer = None  # it fired: poll, as after a ring
            if self._failed:
                return
            self._complete()
            self._check_deadline()

    def _arm(self, timer: trio.CancelScope) -> None:
        """The pump's timer: at most WAIT_WHILE_OUT ahead while anything is out, and no later than the oldest
        request's deadline, moved only when it must be (see WAIT_WHILE_OUT). Once nothing is out it is left to
        fire once, and the pump then waits with none: a reader asks again within a fraction of a millisecond, and
        disarming the timer at each reply to arm it at the next request cost more than that one wake."""
        wait = WAIT_WHILE_OUT
        if self._pending:
            wait = min(wait, max(0.0, self._pending[0].deadline - time.monotonic()))
        elif not self._sends and timer.deadline == math.inf:
            return  # idle: nothing wakes the pump but a ring
        now = trio.current_time()
        remaining = timer.deadline - now
        if remaining > wait or remaining < WAIT_WHILE_OUT / 2:
            timer.deadline = now + wait

    def _check_deadline(self) -> None:
        if self._pending and self._pending[0].deadline < time.monotonic():
            self._give_up_on(self._pending[0].peer)

    def _complete(self) -> bool:
        """Complete what has come; True if anything had."""
        MPI = self._mpi
        if self._sends:
            done_sends = MPI.Request.Testsome(self._sends)
            if done_sends:
                finished = set(done_sends)
                self._sends = [send for i, send in enumerate(self._sends) if i not in finished]
        if not self._pending:
            return False
        statuses = self._statuses
        if len(self._receives) == 1:  # a reader that fetches no files ahead has one request out at a time
            if not self._receives[0].Test(statuses[0]):
                return False
            completed = [(self._pending[0], statuses[0].Get_count(MPI.BYTE))]
            self._pending, self._receives = [], []
        else:
            while len(statuses) < len(self._receives):
                statuses.append(MPI.Status())
            done = MPI.Request.Testsome(self._receives, statuses)
            if not done:
                return False
            finished = set(done)
            completed = [(self._pending[i], statuses[k].Get_count(MPI.BYTE)) for k, i in enumerate(done)]
            self._pending = [fetch for i, fetch in enumerate(self._pending) if i not in finished]
            self._receives = [receive for i, receive in enumerate(self._receives) if i not in finished]
        for fetch, count in completed:
            self._in_flight[fetch.peer] -= 1
            self._finish(fetch, count)
        return True

    def _finish(self, fetch: _LoopFetch, count: int) -> None:
        # Views of the receive buffer, which is the readers' now.
        hand_out_reply(fetch.peer, fetch.reads, fetch.buffer, count, self.counters[fetch.peer])

    def _give_up_on(self, peer: int) -> None:
        """A request to `peer` is past its deadline: cancel every one of the loop's to it, and tell the MPI thread,
        which skips the peer for a while."""
        mine = [fetch for fetch in self._pending if fetch.peer == peer]
        requests = self._cancel(mine)
        self._transport.missed_deadline(peer, [(peer, fetch.tag) for fetch in mine], requests)
        error = f"rank {peer} did not answer within {self._options.timeout:g} s"
        self._fail(mine, error)

    def _cancel(self, fetches: list[_LoopFetch]) -> list[Any]:
        """Cancel these fetches' MPI requests and stop polling them; they are returned for the MPI thread to
        complete."""
        cancelled = []
        for fetch in fetches:
            for request in (fetch.receive, fetch.send):
                if request:  # a completed request is MPI_REQUEST_NULL, which is false and cannot be cancelled
                    request.Cancel()
                    cancelled.append(request)
        gone = {id(request) for request in cancelled}
        dropped = {id(fetch) for fetch in fetches}
        self._receives = [r for r, f in zip(self._receives, self._pending) if id(f) not in dropped]
        self._pending = [fetch for fetch in self._pending if id(fetch) not in dropped]
        self._sends = [send for send in self._sends if id(send) not in gone]
        for fetch in fetches:
            self._in_flight[fetch.peer] -= 1
        return cancelled

    def _fail(self, fetches: list[_LoopFetch], error: str) -> None:
        for fetch in fetches:
            self.counters[fetch.peer].failed += len(fetch.reads)
            for read in fetch.reads:
                read.done(None, ChunkUnavailable(error, chunk_id=read.chunk_id))

    def _hand_over(self, reason: str) -> None:
        """The pump has ended (the mount is down, or a bug): what is still out fails with `reason`, and its MPI
        requests go to the MPI thread to complete."""
        pending = list(self._pending)
        requests = self._cancel(pending) + [send for send in self._sends if send]
        self._sends = []
        self._transport.adopt(requests, [(fetch.peer, fetch.tag) for fetch in pending])
        self._fail(pending, reason)
        self._token = None
