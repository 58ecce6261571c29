"""This rank's requests for blobs stored on other ranks: the one state machine that asks peers.

One object owns every request of the rank, whoever asks (the mount's event loop, the reader's threads, the node
endpoint's threads, the lifecycle's pings): one range of reply tags, one cap of `max_in_flight` requests per peer,
one deadline rule (past it, everything to that peer is cancelled, the peer is skipped for `retry_after` seconds
and the reads fall back to DEST), `cancel`, and one list of replies given up on, which the MPI thread drops when
they come. Its state sits behind one lock.

The deadline judges the peer, not one request's whole wait: a peer misses it when its oldest request in flight has
had `timeout` seconds since it was posted and since the peer's last reply to this rank. A peer answers its requests
in turn, so on a slow link (or a busy peer) the last of several large replies comes long after it was asked, while
each comes well within `timeout` of the one before; timed from the ask, 8 requests of 4 MiB from two ranks over
100 Mbit/s missed 5 s and a healthy peer was skipped for DEST. Nor does it run while a reply (or verdict) of this
rank's is on its way to the peer, within that send's grace (transport.py: 4 deadlines), and one that got through
counts as the peer's reply does (`sending`): a request leaves after the replies before it on their connection, so a
rank whose own link was slow heard nothing in time from peers that answered each request as it came. A peer this
rank was sending to when its link died is thus given up on within 5 deadlines, not 1. Every request is still over
within `longest_wait()` of its ask (the readers' own guards count on it).

A request a reader waits for is posted (the reply's Irecv, then the request's Isend, then a ring of the peer's bell)
by the thread that asks, where the library lets any thread call MPI (MPI_THREAD_MULTIPLE); a request for blobs
fetched ahead of their reader (`hand_over`), and any request past the cap or under MPI_THREAD_SERIALIZED, is queued
and posted by the driver. One thread drives: the MPI thread (transport.py), which each turn completes what came
(Testsome), posts what is queued and has a slot, and enforces deadlines; the peer's reply rings its bell. The
asker's `done` is called there, so a blob fetched ahead of its reader costs the mount's event loop nothing when
it comes.

Why these threads. Measured with bench/bench_remote_blobs.py (`mpiexec -n 2`, rank 0 and a trio loop on CPU 0,
rank 1 serving 56 KiB blobs on CPU 1, 20,000 blobs, rounds by turns within one job, medians; CPU us per blob of the
reading rank, whole process / its loop thread; a shared 2-CPU VM, whose load moves every figure between jobs, so
compare within a table only). First the two requesters this replaced: the loop posting and completing
(loop_requests.py) against handing each request to the MPI thread (transport.py), 3 rounds:

    16 blobs ahead, 8 a request (--prefetch-list):   35.0 / 33.8  against   73.7 / 20.2
    one request per read, none ahead (--prefetch 0): 138.2 / 136.3  against  229.6 / 57.6

Then this machine three ways, 3 rounds: driven by the loop (an intermediate version with a pump task on the reply
bell, as loop_requests.py had); driven by the MPI thread, which also posts; driven by the MPI thread, the asking
thread posting:

    ahead:  32.8 / 31.9    34.1 / 7.8    31.7 / 15.6
    one:   119.6 / 118.2  176.4 / 48.9   87.9 / 48.7

Most of the old MPI-thread way's cost was that path's own (a copy of each reply, its queues), not the thread's.
Driving from the MPI thread keeps the completions, and so the blobs fetched ahead, off the mount's loop. Last, this
version, 5 rounds (a busier machine): posted where asked against handed to the MPI thread (`hand_over`):

    ahead:  39.4 / 16.9    41.9 / 10.0
    one:   210.7 / 92.6   230.5 / 62.6

A read that waits saves the hand-off by posting its own request (20 us of the rank's CPU); blobs fetched ahead are
handed over, which takes 7 us a blob off the mount's loop, the thread that also answers every FUSE request, for
2.5 us more of the rank's CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..core.chunk_source import BlobRead
from ..errors import ChunkError, ChunkUnavailable
from .blob_arena import BlobArena
from .doorbell import Doorbell
from .options import PeerOptions
from .peer_messages import FIRST_REPLY_TAG, MAX_BLOBS, PING, REPLY_HEADER, REPLY_MAGIC, TAG_REQUEST, PeerCounters, \
    hand_out_reply, reply_room, request_message
from .statuses import Status

log = logging.getLogger("fanstore.serve")

# How long the tag of a reply given up on is remembered, in `retry_after`s: its reply, if it ever comes, is dropped.
_FORGET_AFTER = 10


# Where a request is: queued (waiting for a slot), in flight (posted), or over (answered, failed or cancelled).
_QUEUED, _IN_FLIGHT, _OVER = 0, 1, 2


@dataclass(eq=False, slots=True)
class Request:
    """One request to a peer for one or more of its blobs (or a ping); the handle `cancel` takes."""

    peer: int
    reads: Sequence[BlobRead]
    flags: int  # PING, or none
    give_up_at: float  # over by then whatever the peer does: `longest_wait()` after the ask
    posted_at: float = 0.0
    state: int = _QUEUED
    tag: int = 0
    buffer: np.ndarray | None = None  # uint8, uninitialised: the reply's bytes land here, and its blobs are views
    receive: Any = None
    send: Any = None

    @property
    def blobs(self) -> int:
        """Blobs asked, as the counters count them: a ping asks for none."""
        return 0 if self.flags & PING else len(self.reads)


@dataclass
class _Peer:
    queued: deque = field(default_factory=deque)
    in_flight: list = field(default_factory=list)  # in the order posted: the first is the one the deadline watches
    skip_until: float = 0.0
    answered_at: float = 0.0  # when its last reply to this rank came
    sending: int = 0  # replies (and verdicts) of this rank's on their way to it, within their grace
    delivered_at: float = 0.0  # when the last of them got through
    reported: bool = False
    silent_since: float | None = None  # when the oldest request posted since the peer last answered was posted
    lost: bool = False  # for good: never asked again


class RemoteBlobs:
    """Every request of this rank to its peers, on `comm`; see the module's docstring for who posts and who drives.

    `any_thread`: the library gives MPI_THREAD_MULTIPLE, so the asking thread posts; `wake_mpi_thread` cuts the
    MPI thread's sleep short when it has a request to post."""

    def __init__(self, comm: Any, options: PeerOptions, counters: list[PeerCounters], bell: Doorbell | None,
                 any_thread: bool, wake_mpi_thread: Callable[[], None], tag_limit: int,
                 arena: BlobArena | None = None) -> None:
        """`arena`: where replies are received, so that the node's readers read their blobs where they land
        (private memory when it is full or absent)."""
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.options = options
        self.counters = counters
        self._bell = bell
        self.any_thread = any_thread
        self._wake_mpi_thread = wake_mpi_thread
        self._lock = threading.Lock()
        self._peers = [_Peer() for _ in range(self.size)]
        self._first_tag, self._last_tag = FIRST_REPLY_TAG, tag_limit
        self._next_tag = FIRST_REPLY_TAG
        self._polled: list[Any] = []  # MPI requests to complete: each in-flight request's receive, unfinished sends
        self._polled_for: list[Request | None] = []  # whose receive each is (None: a send)
        self._statuses: list[Any] = []  # reused by every Testsome
        self._abandoned: dict[tuple[int, int], float] = {}  # (peer, tag) of replies given up on -> forget when
        self.outstanding = 0  # requests queued or in flight
        self._stopped_reason: str | None = None
        self._lost_after = options.lost_after_seconds()
        self._arena = arena

    # --- asking: any thread ---------------------------------------------------------------------------------------

    def ask(self, peer: int, reads: Sequence[BlobRead], flags: int = 0, hand_over: bool = False) -> Request | None:
        """Ask `peer` for `reads` (1 to MAX_BLOBS blobs of it) in one request: each read's `done` is called once,
        by the request's deadline (from the MPI thread, or at once when the peer is skipped or this has stopped).
        `hand_over`: the MPI thread posts it (blobs fetched ahead: nobody waits, and the asker, the mount's loop,
        has better to do). Returns the request, for `cancel`; None if it failed at once."""
        if not 0 < len(reads) <= MAX_BLOBS:
            raise ValueError(f"a request asks for 1 to {MAX_BLOBS} blobs, not {len(reads)}")
        request = Request(peer, reads, flags, time.monotonic() + self.longest_wait())
        error: ChunkUnavailable | None = None
        posted = False
        given_up: list[tuple[Request, ChunkUnavailable]] = []
        with self._lock:
            if 0 <= peer < self.size and self._silent_too_long(self._peers[peer], time.monotonic()):
                given_up = self._lose(peer, time.monotonic())  # found here: the MPI thread idles when nothing is out
            if self._stopped_reason is not None:
                error = ChunkUnavailable(f"rank {peer}: {self._stopped_reason}", chunk_id=reads[0].chunk_id)
            elif not 0 <= peer < self.size or peer == self.rank:
                error = ChunkUnavailable(f"rank {peer} is not a peer of rank {self.rank}", chunk_id=reads[0].chunk_id)
                peer = self.rank
            elif self._peers[peer].lost:
                error = ChunkUnavailable(f"rank {peer} is lost for this job: it answered nothing for "
                                         f"{self._lost_after:g} s", chunk_id=reads[0].chunk_id)
            elif self._peers[peer].skip_until > time.monotonic() and not flags & PING:
                error = ChunkUnavailable(f"rank {peer} is skipped for now: it missed a deadline of "
                                         f"{self.options.timeout:g} s", chunk_id=reads[0].chunk_id)
            else:
                state = self._peers[peer]
                self.outstanding += 1
                if not hand_over and self._posts_here() and len(state.in_flight) < self.options.max_in_flight:
                    self._post(request)
                    posted = True
                else:
                    state.queued.append(request)
            if error is not None:
                self.counters[peer].failed += request.blobs
        for request_given_up, reason in given_up:
            self._fail_reads(request_given_up.reads, reason)
        if error is not None:
            self._fail_reads(reads, error)
            return None
        if not posted:
            self._wake_mpi_thread()  # it must post it
        elif self._bell is not None:
            self._bell.ring(peer)  # the reply rings the MPI thread's bell, which completes it
        return request

    def fetch(self, peer: int, chunk: int, offset: int, length: int) -> bytes:
        """The stored blob at `offset` of `chunk`, from rank `peer`, waited for; ChunkUnavailable when the peer
        cannot give it in time, ChunkCorrupt when it found its copy corrupt (statuses.py; either way the caller
        reads it elsewhere). Not on the MPI thread, which would wait for itself."""
        arrived = threading.Event()
        outcome: list[tuple[bytes | memoryview | None, ChunkError | None]] = []

        def done(result: bytes | memoryview | None, error: ChunkError | None) -> None:
            outcome.append((result, error))
            arrived.set()

        self.ask(peer, (BlobRead(chunk, offset, length, done),))
        # Every request ends by longest_wait(); this wait only guards against the MPI thread being gone.
        if not arrived.wait(self.longest_wait() + 5):
            raise ChunkUnavailable(f"rank {peer}: no answer for chunk {chunk} (nothing drives the requests)",
                                   chunk_id=chunk)
        result, error = outcome[0]
        if error is not None:
            raise error
        return bytes(result)  # type: ignore[arg-type]

    def longest_wait(self) -> float:
        """Seconds a request may last at most, however steadily its peer answers the requests before it: its turn
        behind `max_in_flight` others, each given `timeout`, then its own."""
        return self.options.timeout * (1 + self.options.max_in_flight)

    def cancel(self, request: Request) -> bool:
        """Give up on `request` (its reader no longer wants it): its slot is freed at once and its reply, if it
        comes, is dropped; each read's `done` gets ChunkUnavailable. False when it was over already."""
        with self._lock:
            if request.state == _OVER:
                return False
            state = self._peers[request.peer]
            if request.state == _QUEUED:
                state.queued.remove(request)
            else:
                state.in_flight.remove(request)
                # Where only the MPI thread may call MPI, the receive stays posted and its reply is dropped.
                self._abandon(request, time.monotonic(), cancel_mpi=self._posts_here())
            request.state = _OVER
            self.outstanding -= 1
        self._fail_reads(request.reads, ChunkUnavailable(f"rank {request.peer}: the request was cancelled",
                                                         chunk_id=request.reads[0].chunk_id))
        return True

    def lost_peers(self) -> list[int]:
        """The peers lost for good (see PeerOptions.lost_after), as of now: nothing may be posted to them."""
        given_up: list[tuple[Request, ChunkUnavailable]] = []
        with self._lock:
            now = time.monotonic()
            for number, state in enumerate(self._peers):
                if self._silent_too_long(state, now):
                    given_up.extend(self._lose(number, now))
            lost = [number for number, state in enumerate(self._peers) if state.lost]
        for request, reason in given_up:
            self._fail_reads(request.reads, reason)
        return lost

    def sending(self, peer: int, started: bool, delivered: bool = False) -> None:
        """The MPI thread began (`started`) sending `peer` a message of its own, or that send is over: `delivered`
        (it got through) or not (cancelled, or past its grace). This rank's requests wait behind it meanwhile."""
        with self._lock:
            state = self._peers[peer]
            state.sending += 1 if started else -1
            if delivered:
                state.delivered_at = time.monotonic()

    def skipped(self, peer: int) -> bool:
        """`peer` missed a deadline lately, so its files are read elsewhere for now."""
        return self._peers[peer].skip_until > time.monotonic()

    def in_flight(self, peer: int) -> int:
        """Requests posted to `peer` and not over: never more than `max_in_flight`."""
        return len(self._peers[peer].in_flight)

    # --- driving: the MPI thread ------------------------------------------------------------------------------

    def drive(self) -> bool:
        """Complete what has come, post what is queued and has a slot, and enforce deadlines: each turn of the MPI
        thread's loop. True if anything happened."""
        if not self._polled and not self.outstanding:  # read unlocked: a request asked meanwhile waits a turn
            return False
        completed: list[tuple[Request, int]] = []
        failed: list[tuple[Request, ChunkUnavailable]] = []
        rings: set[int] = set()
        with self._lock:
            progressed = self._complete(completed)
            if self.outstanding:  # a slot freed by a reply, a cancel or a deadline, or asked where none may post
                progressed |= self._post_queued(rings)
            now = time.monotonic()
            for number, state in enumerate(self._peers):
                if self._past_deadline(state, now):
                    failed.extend(self._give_up_on(number, now))
                    progressed = True
                if self._silent_too_long(state, now):
                    failed.extend(self._lose(number, now))
                    progressed = True
            if self._abandoned and progressed:
                for key in [key for key, forget_at in self._abandoned.items() if forget_at < now]:
                    del self._abandoned[key]
        if self._bell is not None:
            for peer in rings:
                self._bell.ring(peer)
        for request, count in completed:
            self._call_back(self._hand_out, request, count)
        for request, error in failed:
            self._call_back(self._fail_reads, request.reads, error)
        return progressed

    def _call_back(self, outcome: Callable[..., None], *args: Any) -> None:
        """An asker's `done` runs on the MPI thread: a bug in one costs that read (logged), never the thread that
        every other request and collective needs."""
        try:
            outcome(*args)
        except Exception:  # noqa: BLE001 - see above
            log.exception("rank %d: a reader's callback for a blob from a peer failed", self.rank)

    def forget(self, peer: int, tag: int) -> bool:
        """A reply came that no receive matched: True if it is one given up on (the MPI thread drops it)."""
        with self._lock:
            return self._abandoned.pop((peer, tag), None) is not None

    def busy(self) -> bool:
        """Something is out: the MPI thread watches closely (deadlines, completions)."""
        return self.outstanding > 0 or bool(self._polled)

    def stop(self, reason: str) -> None:
        """Fail everything queued or in flight with `reason`, cancel its MPI requests, and fail every later `ask`
        at once: the MPI thread has ended, so nothing would complete them. From the MPI thread, last."""
        failed: list[Request] = []
        with self._lock:
            self._stopped_reason = reason
            for state in self._peers:
                failed.extend(state.in_flight)
                failed.extend(state.queued)
                state.in_flight.clear()
                state.queued.clear()
            for mpi_request in self._polled:
                if mpi_request:
                    mpi_request.Cancel()
            self._polled.clear()
            self._polled_for.clear()
            self.outstanding = 0
            for request in failed:
                request.state = _OVER
        for request in failed:
            self._fail_reads(request.reads, ChunkUnavailable(f"rank {request.peer}: {reason}",
                                                             chunk_id=request.reads[0].chunk_id))

    # --- the state machine, under the lock -------------------------------------------------------------------

    def _posts_here(self) -> bool:
        """The calling thread may post a request now: any thread, where the library allows it."""
        return self.any_thread or threading.current_thread().name == "fanstore-mpi"

    def _post(self, request: Request) -> None:
        tag = self._next_tag
        self._next_tag = tag + 1 if tag < self._last_tag else self._first_tag
        request.tag = tag
        # Not zeroed: a bytearray of a reply's size (a batch's blobs, megabytes) was a memset a request, half the CPU of
        # the thread that fetches ahead (py-spy --gil); the receive writes every byte that is read.
        room = reply_room(sum(read.length for read in request.reads), len(request.reads))
        slot = self._arena.slot(room) if self._arena is not None else None
        request.buffer = slot if slot is not None else np.empty(room, np.uint8)
        MPI = self._mpi
        # The reply's receive is posted before the request leaves, so the reply never waits unexpected.
        request.receive = self._comm.Irecv([request.buffer, MPI.BYTE], source=request.peer, tag=tag)
        request.send = self._comm.Isend([request_message(tag, request.flags, request.reads), MPI.BYTE], dest=request.peer,
                                        tag=TAG_REQUEST)
        request.state = _IN_FLIGHT
        request.posted_at = time.monotonic()
        state = self._peers[request.peer]
        state.in_flight.append(request)
        if state.silent_since is None:
            state.silent_since = request.posted_at
        self._polled.append(request.receive)
        self._polled_for.append(request)
        if not request.send.Test():  # a request is a few dozen bytes: it has mostly gone already
            self._polled.append(request.send)
            self._polled_for.append(None)
        self.counters[request.peer].asked += not request.flags & PING

    def _post_queued(self, rings: set[int]) -> bool:
        posted = False
        cap = self.options.max_in_flight
        for number, state in enumerate(self._peers):
            while state.queued and len(state.in_flight) < cap:
                self._post(state.queued.popleft())
                rings.add(number)
                posted = True
        return posted

    def _complete(self, completed: list[tuple[Request, int]]) -> bool:
        """Testsome over every MPI request polled; the requests whose replies came go into `completed`."""
        polled = self._polled
        if not polled:
            return False
        MPI = self._mpi
        statuses = self._statuses
        while len(statuses) < len(polled):
            statuses.append(MPI.Status())
        done = MPI.Request.Testsome(polled, statuses)
        if not done:
            return False
        finished = set(done)
        # MPI_Testsome fills statuses in completion order: the k-th status is that of request done[k].
        for k, i in enumerate(done):
            request = self._polled_for[i]
            status = statuses[k]
            if request is None or request.state != _IN_FLIGHT or status.Is_cancelled():
                continue  # a send, or a receive given up on (cancelled, or come just then: dropped)
            request.state = _OVER
            state = self._peers[request.peer]
            state.in_flight.remove(request)
            state.silent_since = None  # it answers: its connection is alive
            state.answered_at = time.monotonic()
            self.outstanding -= 1
            completed.append((request, status.Get_count(MPI.BYTE)))
        self._polled = [r for i, r in enumerate(polled) if i not in finished]
        self._polled_for = [r for i, r in enumerate(self._polled_for) if i not in finished]
        return True

    def _abandon(self, request: Request, now: float, cancel_mpi: bool = True) -> None:
        """Cancel an in-flight request's MPI requests (they stay polled until the cancels complete) and remember
        its tag, so that its reply, if it comes, is dropped."""
        for mpi_request in (request.receive, request.send) if cancel_mpi else ():
            if mpi_request:  # a completed request is MPI_REQUEST_NULL, which is false and cannot be cancelled
                mpi_request.Cancel()
        self._abandoned[(request.peer, request.tag)] = now + _FORGET_AFTER * self.options.retry_after
        request.buffer = None

    def _give_up_on(self, number: int, now: float, quiet: bool = False) -> list[tuple[Request, ChunkUnavailable]]:
        """A request to `number` is past its deadline: cancel everything in flight to it, fail everything queued,
        and skip it for a while. Returns what to fail, once the lock is let go."""
        state = self._peers[number]
        state.skip_until = now + self.options.retry_after
        if not state.reported and not quiet:
            state.reported = True
            log.warning("rank %d: no answer within %g s; reading its files from the dataset directory for %g s",
                        number, self.options.timeout, self.options.retry_after)
        reason = f"rank {number} did not answer within {self.options.timeout:g} s"
        failed = []
        for request in state.in_flight:
            self._abandon(request, now)
        for request in [*state.in_flight, *state.queued]:
            request.state = _OVER
            self.counters[number].failed += request.blobs
            failed.append((request, ChunkUnavailable(reason, chunk_id=request.reads[0].chunk_id)))
        self.outstanding -= len(state.in_flight) + len(state.queued)
        state.in_flight.clear()
        state.queued.clear()
        return failed

    def _past_deadline(self, state: _Peer, now: float) -> bool:
        """The peer left its oldest request in flight `timeout` seconds since it was posted, since its last reply
        and since this rank's last message to it got through, none on its way meanwhile; or a request of it is past
        `give_up_at`."""
        if state.in_flight and not state.sending and \
                max(state.in_flight[0].posted_at, state.answered_at, state.delivered_at) + self.options.timeout < now:
            return True
        return any(request.give_up_at < now for request in state.in_flight) or \
            bool(state.queued) and state.queued[0].give_up_at < now

    def _silent_too_long(self, state: _Peer, now: float) -> bool:
        return not state.lost and state.silent_since is not None and now - state.silent_since > self._lost_after

    def _lose(self, number: int, now: float) -> list[tuple[Request, ChunkUnavailable]]:
        """`number` has answered nothing for `lost_after` seconds: give up on what is out to it, as at a deadline,
        and never post to it again in this job. Returns what to fail, once the lock is let go."""
        state = self._peers[number]
        state.lost = True
        log.warning("rank %d: answered nothing for %g s, near the time TCP gives a connection up (after which a "
                    "message to it would crash this process in the MPI library): lost for this job; its files are "
                    "read from the dataset directory", number, now - (state.silent_since or now))
        return self._give_up_on(number, now, quiet=True)

    # --- outcomes, outside the lock -------------------------------------------------------------------------

    def _hand_out(self, request: Request, count: int) -> None:
        buffer, request.buffer = request.buffer, None
        if request.flags & PING:
            answered = count >= REPLY_HEADER.size and REPLY_HEADER.unpack_from(buffer) == (REPLY_MAGIC, Status.OK)
            request.reads[0].done(b"" if answered else None, None if answered else ChunkUnavailable(
                f"rank {request.peer} sent a malformed answer to a ping ({count} bytes)"))
            return
        # Views of the receive buffer, which is the readers' now.
        hand_out_reply(request.peer, request.reads, buffer, count, self.counters[request.peer])  # type: ignore

    @staticmethod
    def _fail_reads(reads: Sequence[BlobRead], error: ChunkUnavailable) -> None:
        for read in reads:
            read.done(None, ChunkUnavailable(str(error), chunk_id=read.chunk_id))
