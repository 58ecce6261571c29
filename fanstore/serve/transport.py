"""Stored blobs between ranks over MPI, from one thread that owns MPI once the job has started.

A caller asks `fetch_later(peer, chunk, offset, length, done)` and is called back (an event loop, so no thread waits
for the peer), or asks `fetch` and waits on its own event; the MPI thread posts the
reply's Irecv, sends the 32-byte request, and polls everything in flight with Testsome and a backing-off sleep
(polling.Backoff): no blocking MPI call after start-up, so an idle rank costs a few percent of a core. Requests
from peers are found with Improbe, checked by the node's `RequestServer`, and answered from local chunks; a request
may ask for up to MAX_BLOBS blobs (the event loop's fetches ahead, loop_requests.py), answered in one reply, where a
blob the rank cannot give costs that blob alone (the messages: peer_messages.py). With a doorbell (doorbell.py), each
request and each reply also rings its receiver, which then sleeps until rung.

Faults cost a deadline, never a hang: a request not answered in `timeout` seconds is cancelled, the peer is
skipped for `retry_after` seconds (its queued requests fail at once, so readers fall back to the shared file
system), and a reply that arrives after its request was given up is received and dropped. At most
`max_in_flight` requests go to one peer at a time, so a stalled peer holds a few slots, not all of them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..chunk_source import BlobRead, ReadDone
from ..errors import ChunkError, ChunkUnavailable
from .doorbell import Doorbell
from .peer_messages import FIRST_REPLY_TAG, MAX_BLOBS, MORE_BLOB, PING, QUIET_REPLY, REASON_ROOM, REPLY_HEADER, \
    REPLY_MAGIC, REQUEST, REQUEST_MAGIC, RING_REPLY_BELL, TAG_REQUEST, TAG_VERDICT, VERDICT, VERDICT_MAGIC, \
    PeerCounters, error_reply, hand_out_reply, partial_reply, reply_room, request_message
from .polling import Backoff, precise_sleeps, wait_all
from .statuses import RequestRefused, Status, status_of

log = logging.getLogger("fanstore.serve")

# How much longer than `timeout` a reply we send may take to be received before it is cancelled: the requester
# gave up on it by then.
_SEND_GRACE = 4.0


class RequestServer(Protocol):
    def __call__(self, peer: int, chunk: int, offset: int, length: int) -> bytes:
        """The stored blob a peer asks for, checked; RequestRefused or a ChunkError otherwise."""


@dataclass(frozen=True, slots=True)
class PeerOptions:
    timeout: float = 5.0  # seconds a peer gets to answer one request
    retry_after: float = 30.0  # seconds a peer that missed a deadline is skipped
    max_in_flight: int = 8  # requests outstanding to one peer
    # Bytes a request for several blobs may ask for in all (one blob may be larger): the reply is built whole, so
    # this bounds what one request can make the serving rank hold. Askers stay far below (sources.BATCH_BYTES).
    max_reply_bytes: int = 64 << 20


def mpi_failure(exc: Exception) -> str:
    """One line for an MPI error: the innermost cause of MPICH's error stack (say `process_vm_readv failed
    (errno 3)`: the peer has died), not its first line, which only gives the class."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    innermost = lines[-1].rsplit(": ", 1)[-1].strip() if lines else ""
    return f"MPI error: {innermost or type(exc).__name__}"


@dataclass(eq=False)
class _Fetch:
    peer: int
    reads: Sequence[BlobRead]  # one blob, or several asked in one request; a ping's one read of 0 bytes
    flags: int = 0  # PING, or none
    deadline: float = 0.0
    tag: int = 0
    buffer: bytearray | None = None
    receive: Any = None
    send: Any = None

    @property
    def chunk(self) -> int:
        return self.reads[0].chunk_id

    @property
    def blobs(self) -> int:
        """Blobs asked, as the counters count them: a ping asks for none."""
        return 0 if self.flags & PING else len(self.reads)

    @property
    def total(self) -> int:
        """Bytes of every blob asked."""
        return sum(read.length for read in self.reads)

    def fail(self, error: ChunkError) -> None:
        self.buffer = None
        for read in self.reads:
            read.done(None, error)


@dataclass(frozen=True)
class _Verdict:
    peer: int
    message: bytes


@dataclass
class _GaveUp:
    """Handed from the event loop to the MPI thread: requests it cancelled, replies it no longer waits for."""

    peer: int  # skipped for `retry_after`, unless -1
    replies: list[tuple[int, int]]  # (peer, tag) of replies to drop
    requests: list[Any]  # cancelled MPI requests, polled until complete


@dataclass
class _Peer:
    queued: deque = field(default_factory=deque)
    in_flight: list = field(default_factory=list)
    skip_until: float = 0.0
    reported: bool = False


class PeerTransport:
    """Fetches from peers and serves them, on `comm` (a duplicate of the job's communicator, ours alone)."""

    def __init__(self, comm: Any, serve_request: RequestServer, options: PeerOptions = PeerOptions(),
                 bell: Doorbell | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.options = options
        self.counters = [PeerCounters() for _ in range(self.size)]  # the MPI thread's (see peer_counters)
        self.loop_counters = [PeerCounters() for _ in range(self.size)]  # the event loop's (loop_requests.py)
        self._serve_request = serve_request
        self._peers = [_Peer() for _ in range(self.size)]
        self._tag_limit = int(comm.Get_attr(MPI.TAG_UB))
        self._loop_first_tag = FIRST_REPLY_TAG + (self._tag_limit - FIRST_REPLY_TAG + 1) // 2
        self._next_tag = FIRST_REPLY_TAG
        self._submitted: deque[_Fetch | _GaveUp | tuple[Callable[[Any], tuple[Any, Callable[[], Any]]], Future]] = \
            deque()
        self._requests: list[Any] = []  # MPI requests being polled, with what to do when each completes
        self._on_complete: list[Callable[[Any], None]] = []
        self._collectives: list[Future] = []
        self._collective_callbacks: set[Callable[[Any], None]] = set()
        # Replies we send, by id(request): (the request, when to give up on it).
        self._send_deadlines: dict[int, tuple[Any, float]] = {}
        self._statuses: list[Any] = []  # reused by every Testsome: a turn of the loop allocates nothing
        self._probe_status = MPI.Status()
        self._abandoned: dict[tuple[int, int], float] = {}  # (peer, tag) of given-up requests -> forget when
        self._outstanding = 0  # our requests queued or in flight, to all peers
        self._verdict: tuple[int, int, str] | None = None  # written by the MPI thread, read by the lifecycle
        self.bell = bell
        self._to_ring: set[int] = set()  # peers sent a request or reply this turn: rung once, at its end
        self._to_ring_reply: set[int] = set()  # peers sent a reply their event loop waits for: rung likewise
        self._backoff = Backoff.rung_by(bell)
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # the MPI thread has ended: fetches fail at once
        self._stopped_reason = "the MPI thread has stopped"
        self._alone = threading.Lock()  # collectives once the MPI thread has stopped (_collective_alone)
        self._thread = threading.Thread(target=self._run, name="fanstore-mpi", daemon=True)
        self._failure: BaseException | None = None
        self.host = socket.gethostname()

    # --- the readers' side ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def fetch(self, peer: int, chunk: int, offset: int, length: int) -> bytes:
        """The stored blob at `offset` of `chunk`, from rank `peer`; ChunkUnavailable when the peer cannot give it
        in time, ChunkCorrupt when it found its copy corrupt (statuses.py; either way the caller reads it
        elsewhere)."""
        arrived = threading.Event()
        outcome: list[tuple[bytes | None, ChunkError | None]] = []

        def done(result: bytes | None, error: ChunkError | None) -> None:
            outcome.append((result, error))
            arrived.set()

        self.fetch_later(peer, chunk, offset, length, done)
        # The MPI thread ends every request by its deadline; this wait only guards against that thread being gone.
        if not arrived.wait(self.options.timeout * (1 + self.options.max_in_flight) + 5):
            raise ChunkUnavailable(f"rank {peer}: no answer for chunk {chunk} (the MPI thread has stopped)",
                                   chunk_id=chunk)
        result, error = outcome[0]
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def fetch_later(self, peer: int, chunk: int, offset: int, length: int, done: ReadDone) -> None:
        """`fetch` for a caller that must not wait: `done(blob, None)` or `done(None, ChunkError)` comes
        later from the MPI thread (by the request's deadline), or at once once the transport has stopped, and must
        only hand the outcome on."""
        self._submit(_Fetch(peer, (BlobRead(chunk, offset, length, done),)))

    def fetch_many_later(self, peer: int, reads: Sequence[BlobRead]) -> None:
        """`fetch_later` for up to MAX_BLOBS blobs of `peer` in one request; each read's `done` is called."""
        if not 0 < len(reads) <= MAX_BLOBS:
            raise ValueError(f"a request asks for 1 to {MAX_BLOBS} blobs, not {len(reads)}")
        self._submit(_Fetch(peer, tuple(reads)))

    def ping(self, peer: int, done: ReadDone) -> None:
        """Ask `peer` whether it is there: `done(b"", None)` when it answers, `done(None, ChunkUnavailable)` when
        it misses the deadline (a peer skipped for having missed one is asked all the same: a ping is how this
        rank learns it is back). Counted nowhere."""
        self._submit(_Fetch(peer, (BlobRead(0, 0, 0, done),), flags=PING))

    def send_verdict(self, peer: int, status: int, reason: str) -> None:
        """Tell `peer` the job's status when the ranks cannot agree on it (some are lost): it ends with it."""
        message = VERDICT.pack(VERDICT_MAGIC, status) + reason.encode()[:REASON_ROOM]
        self._submitted.append(_Verdict(peer, message))
        self._backoff.wake()

    @property
    def verdict(self) -> tuple[int, int, str] | None:
        """(rank that sent it, status, reason) of a verdict this rank was sent, or None."""
        return self._verdict

    def _submit(self, request: _Fetch) -> None:
        self._submitted.append(request)
        self._backoff.wake()
        if self._stopped.is_set():  # the MPI thread has ended (perhaps just now): nobody else will answer it
            self._fail_submitted()

    def collective(self, start: Callable[[Any], tuple[Any, Callable[[], Any]]]) -> Future:
        """Run a non-blocking collective in the MPI thread: `start(comm)` returns (request, result function); the
        future gets the result once the request completes, while peers go on being served."""
        future: Future = Future()
        self._submitted.append((start, future))
        self._backoff.wake()
        if self._stopped.is_set():  # the MPI thread has ended (perhaps just now): see _collective_alone
            self._fail_submitted()
        return future

    def _collective_alone(self, start: Callable[[Any], tuple[Any, Callable[[], Any]]], future: Future) -> None:
        """A collective handed over once the MPI thread has ended (a bug, logged): nobody else calls MPI then,
        so it runs on a thread of its own, and this rank still ends the job with the others (the agreement on the
        job's status, the counters) rather than leave them waiting for it."""
        def run() -> None:
            try:
                with self._alone:  # one at a time, as the MPI thread ran them
                    request, result = start(self.comm)
                    wait_all([request], what="a collective")
                future.set_result(result())
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)

        threading.Thread(target=run, name="fanstore-mpi-collective", daemon=True).start()

    def stop(self) -> None:
        """End the MPI thread; requests still waiting fail as unavailable, and every MPI request is cancelled."""
        self._stopping.set()
        self._backoff.wake()
        if self._thread.is_alive():
            self._thread.join()

    # --- the MPI thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        precise_sleeps()
        try:
            while not self._stopping.is_set():
                progressed = bool(self._submitted) and self._take_submitted()
                progressed |= self._outstanding > 0 and self._start_fetches()
                progressed |= self._poll_requests()
                progressed |= self._receive_messages()
                if self._to_ring or self._to_ring_reply:
                    self._ring_peers()
                busy = self._busy()
                if busy or self._abandoned:
                    self._enforce_deadlines()
                if progressed:
                    self._backoff.progressed()
                    continue
                self._backoff.sleep(self._backoff.linger_longest if busy else None)
        except self._mpi.Exception as exc:  # a peer died (the launcher ends the job soon), or the library failed
            self._failure = exc
            log.error("the MPI thread failed (%s); peers are no longer served or asked", mpi_failure(exc))
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail reads, not hang them
            self._failure = exc
            log.exception("the MPI thread failed; peers are no longer served or asked")
        finally:
            self._shut_down()

    def _busy(self) -> bool:
        """A request of ours is queued or in flight, or a reply we send is: its completion is awaited closely and
        its deadline watched."""
        return bool(self._send_deadlines) or self._outstanding > 0

    def _take_submitted(self) -> bool:
        progressed = False
        while self._submitted:
            item = self._submitted.popleft()
            progressed = True
            if isinstance(item, _Fetch):
                self._queue_fetch(item)
            elif isinstance(item, _GaveUp):
                self._take_gave_up(item)
            elif isinstance(item, _Verdict):
                send = self.comm.Isend([item.message, self._mpi.BYTE], dest=item.peer, tag=TAG_VERDICT)
                self._send_deadlines[id(send)] = (send, time.monotonic() + _SEND_GRACE * self.options.timeout)
                self._poll(send, lambda _status, message=item.message: None)  # keeps the buffer alive until sent
                self._to_ring.add(item.peer)
            else:
                start, future = item
                try:
                    request, result = start(self.comm)
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    future.set_exception(exc)
                    continue
                def settle(_status: Any, result: Callable[[], Any] = result, future: Future = future) -> None:
                    self._settle(future, result)

                self._collective_callbacks.add(settle)
                self._collectives.append(future)
                self._poll(request, settle)
        return progressed

    def _take_gave_up(self, gave_up: _GaveUp) -> None:
        now = time.monotonic()
        forget_at = now + 10 * self.options.retry_after
        for key in gave_up.replies:
            self._abandoned[key] = forget_at
        for request in gave_up.requests:
            if request:
                self._poll(request, lambda _status: None)
        if gave_up.peer >= 0:
            self._give_up_on(gave_up.peer, now)

    @staticmethod
    def _settle(future: Future, result: Callable[[], Any]) -> None:
        try:
            future.set_result(result())
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            future.set_exception(exc)

    def _queue_fetch(self, request: _Fetch) -> None:
        peer = self._peers[request.peer] if 0 <= request.peer < self.size else None
        if peer is None or request.peer == self.rank:
            self.counters[self.rank].failed += len(request.reads)
            request.fail(ChunkUnavailable(f"rank {request.peer} is not a peer of rank {self.rank}",
                                          chunk_id=request.chunk))
            return
        if peer.skip_until > time.monotonic() and not request.flags & PING:
            self.counters[request.peer].failed += len(request.reads)
            request.fail(self._skipped_error(request))
            return
        request.deadline = time.monotonic() + self.options.timeout
        peer.queued.append(request)
        self._outstanding += 1

    def _skipped_error(self, request: _Fetch) -> ChunkUnavailable:
        return ChunkUnavailable(f"rank {request.peer} is skipped for now: it missed a deadline of "
                                f"{self.options.timeout:g} s", chunk_id=request.chunk)

    def _start_fetches(self) -> bool:
        started = False
        for number, peer in enumerate(self._peers):
            while peer.queued and len(peer.in_flight) < self.options.max_in_flight:
                self._send_fetch(number, peer.queued.popleft())
                started = True
        return started

    def _send_fetch(self, peer: int, request: _Fetch) -> None:
        request.tag = self._take_tag()
        request.buffer = bytearray(reply_room(request.total, len(request.reads)))
        # The reply's receive is posted before the request leaves, so the reply never waits unexpected.
        request.receive = self.comm.Irecv([request.buffer, self._mpi.BYTE], source=peer, tag=request.tag)
        message = request_message(request.tag, request.flags, request.reads)
        request.send = self.comm.Isend([message, self._mpi.BYTE], dest=peer, tag=TAG_REQUEST)
        self.counters[peer].asked += not request.flags & PING
        self._peers[peer].in_flight.append(request)
        self._poll(request.send, lambda _status: None)
        self._to_ring.add(peer)
        self._poll(request.receive, lambda status, request=request: self._fetched(request, status))

    def _ring_peers(self) -> None:
        """One ring per peer a turn, however many requests and replies went to it: a batch wakes it once."""
        if self.bell is not None:
            for peer in self._to_ring:
                self.bell.ring(peer)
            for peer in self._to_ring_reply:
                self.bell.ring_reply(peer)
        self._to_ring.clear()
        self._to_ring_reply.clear()

    def _take_tag(self) -> int:
        tag = self._next_tag
        self._next_tag = tag + 1 if tag + 1 < self._loop_first_tag else FIRST_REPLY_TAG
        return tag

    def peer_counters(self) -> list[PeerCounters]:
        """What went between this rank and each peer, both threads' counters summed."""
        return [PeerCounters(*(getattr(a, name) + getattr(b, name) for name in PeerCounters.__dataclass_fields__))
                for a, b in zip(self.counters, self.loop_counters)]

    @property
    def loop_tags(self) -> tuple[int, int]:
        """The reply tags the event loop's requests use, first and last (loop_requests.py)."""
        return self._loop_first_tag, self._tag_limit

    def skipped(self, peer: int) -> bool:
        """`peer` missed a deadline lately, so its files are read elsewhere for now."""
        return self._peers[peer].skip_until > time.monotonic()

    def missed_deadline(self, peer: int, replies: list[tuple[int, int]], requests: list[Any]) -> None:
        """The event loop gave up on requests to `peer`: the MPI thread skips the peer as for its own (logged
        once), drops the replies if they come, and completes the loop's cancelled MPI requests."""
        self._peers[peer].skip_until = time.monotonic() + self.options.retry_after  # at once, for the loop's next
        self._submitted.append(_GaveUp(peer, replies, requests))
        self._backoff.wake()

    def adopt(self, requests: list[Any], replies: list[tuple[int, int]]) -> None:
        """The event loop has ended with these MPI requests (cancelled) still to complete, and these replies still
        to come: the MPI thread completes the one and drops the other."""
        self._submitted.append(_GaveUp(-1, replies, requests))
        self._backoff.wake()

    def _fetched(self, request: _Fetch, status: Any) -> None:
        peer = self._peers[request.peer]
        if request not in peer.in_flight:  # given up already: its receive was cancelled, or came in just then
            return
        peer.in_flight.remove(request)
        self._outstanding -= 1
        buffer, request.buffer = request.buffer, None
        if request.flags & PING:
            count = status.Get_count(self._mpi.BYTE)
            answered = count >= REPLY_HEADER.size and REPLY_HEADER.unpack_from(buffer) == (REPLY_MAGIC, Status.OK)
            request.reads[0].done(b"" if answered else None, None if answered else ChunkUnavailable(
                f"rank {request.peer} sent a malformed answer to a ping ({count} bytes)"))
            return
        # `fetch` gives bytes: the buffer goes back with the request
        hand_out_reply(request.peer, request.reads, buffer, status.Get_count(self._mpi.BYTE),  # type: ignore[arg-type]
                       self.counters[request.peer], copy=True)

    def _enforce_deadlines(self) -> None:
        """Runs every turn of the loop, so it looks at one request per peer: requests are queued, and sent, in the
        order of their deadlines, so the oldest one in flight (else the oldest queued) is the first to expire."""
        now = time.monotonic()
        for number, peer in enumerate(self._peers):
            oldest = peer.in_flight[0] if peer.in_flight else peer.queued[0] if peer.queued else None
            if oldest is not None and oldest.deadline < now:
                self._give_up_on(number, now)
        if self._send_deadlines:
            for key, (request, give_up_at) in list(self._send_deadlines.items()):
                if give_up_at < now:
                    del self._send_deadlines[key]
                    request.Cancel()  # stays polled until the cancel completes
        if self._abandoned:
            for key in [key for key, forget_at in self._abandoned.items() if forget_at < now]:
                del self._abandoned[key]

    def _give_up_on(self, number: int, now: float) -> None:
        """A request to `number` is past its deadline: cancel everything in flight to it, fail everything queued,
        and skip it for a while."""
        peer = self._peers[number]
        peer.skip_until = now + self.options.retry_after
        if not peer.reported:
            peer.reported = True
            log.warning("rank %d: no answer within %g s; reading its files from the dataset directory for %g s",
                        number, self.options.timeout, self.options.retry_after)
        error = ChunkUnavailable(f"rank {number} did not answer within {self.options.timeout:g} s")
        for request in peer.in_flight:
            for mpi_request in (request.receive, request.send):
                if mpi_request:  # a completed request is MPI_REQUEST_NULL, which is false and cannot be cancelled
                    mpi_request.Cancel()
            self._abandoned[(number, request.tag)] = now + 10 * self.options.retry_after
            self.counters[number].failed += request.blobs
            request.fail(ChunkUnavailable(str(error), chunk_id=request.chunk))
        for request in peer.queued:
            self.counters[number].failed += request.blobs
            request.fail(ChunkUnavailable(str(error), chunk_id=request.chunk))
        self._outstanding -= len(peer.in_flight) + len(peer.queued)
        peer.in_flight.clear()
        peer.queued.clear()

    def _fail_submitted(self) -> None:
        """Fail what was handed over but never taken (the MPI thread has stopped); safe from any thread."""
        while True:
            try:
                item = self._submitted.popleft()
            except IndexError:
                return
            if isinstance(item, _Fetch):
                item.fail(ChunkUnavailable(f"rank {item.peer}: {self._stopped_reason}", chunk_id=item.chunk))
            elif isinstance(item, _GaveUp):
                for request in item.requests:
                    if request:
                        request.Cancel()
            else:
                self._collective_alone(*item)

    def _poll(self, request: Any, on_complete: Callable[[Any], None]) -> None:
        self._requests.append(request)
        self._on_complete.append(on_complete)

    def _poll_requests(self) -> bool:
        if not self._requests:
            return False
        statuses = self._statuses
        while len(statuses) < len(self._requests):
            statuses.append(self._mpi.Status())
        done = self._mpi.Request.Testsome(self._requests, statuses)
        if not done:
            return False
        finished = set(done)
        # MPI_Testsome fills statuses in completion order: the k-th status is that of request done[k].
        callbacks = [(self._on_complete[i], statuses[k]) for k, i in enumerate(done)]
        for i in done:
            self._send_deadlines.pop(id(self._requests[i]), None)
        self._requests = [r for i, r in enumerate(self._requests) if i not in finished]
        self._on_complete = [c for i, c in enumerate(self._on_complete) if i not in finished]
        for on_complete, status in callbacks:
            if not status.Is_cancelled():
                on_complete(status)
        return True

    def _receive_messages(self) -> bool:
        """Take every message no posted receive matched: requests from peers, and replies given up on."""
        status = self._probe_status
        received = False
        while True:
            message = self.comm.Improbe(self._mpi.ANY_SOURCE, self._mpi.ANY_TAG, status)
            if message is None:
                return received
            received = True
            source, tag, count = status.Get_source(), status.Get_tag(), status.Get_count(self._mpi.BYTE)
            buffer = bytearray(count)
            message.Recv([buffer, self._mpi.BYTE])
            if tag == TAG_REQUEST:
                self._answer(source, buffer)
            elif tag == TAG_VERDICT and len(buffer) >= VERDICT.size and buffer[:4] == VERDICT_MAGIC:
                self._verdict = (source, VERDICT.unpack_from(buffer)[1],
                                 bytes(buffer[VERDICT.size:]).decode("utf-8", "replace"))
            elif (source, tag) in self._abandoned:
                del self._abandoned[(source, tag)]
            else:
                self.counters[source].refused += 1
                log.warning("rank %d sent an unexpected message (tag %d, %d bytes): dropped", source, tag, count)

    def _answer(self, source: int, message: bytearray) -> None:
        counters = self.counters[source]
        more, odd = divmod(len(message) - REQUEST.size, MORE_BLOB.size)
        if more < 0 or odd or more >= MAX_BLOBS or message[:4] != REQUEST_MAGIC:
            counters.refused += 1
            log.warning("rank %d sent a malformed request (%d bytes): dropped", source, len(message))
            return
        _, tag, chunk, flags, offset, length = REQUEST.unpack_from(message)
        if not FIRST_REPLY_TAG <= tag <= self._tag_limit:
            counters.refused += 1
            log.warning("rank %d sent a request with reply tag %d: dropped", source, tag)
            return
        if flags & PING:  # no blob: the answer is that this rank is here
            send = self.comm.Isend([REPLY_HEADER.pack(REPLY_MAGIC, Status.OK), self._mpi.BYTE], dest=source, tag=tag)
            self._send_deadlines[id(send)] = (send, time.monotonic() + _SEND_GRACE * self.options.timeout)
            self._poll(send, lambda _status: None)
            self._to_ring.add(source)
            return
        blobs = [(chunk, offset, length)]
        if more:
            blobs.extend(MORE_BLOB.iter_unpack(memoryview(message)[REQUEST.size:]))
        try:
            asked_bytes = sum(blob[2] for blob in blobs)
            if more and asked_bytes > self.options.max_reply_bytes:
                raise RequestRefused(f"{len(blobs)} blobs of {asked_bytes} bytes in all: more than "
                                     f"{self.options.max_reply_bytes} bytes in one reply")
            parts, statuses, reason = [], bytearray(len(blobs)), ""
            for number, (chunk, offset, length) in enumerate(blobs):
                try:
                    parts.append(self._serve_request(source, chunk, offset, length))
                except ChunkError as exc:
                    if not more:
                        raise
                    # One blob this rank cannot give costs that blob alone: the asker reads it elsewhere.
                    statuses[number] = status_of(exc)
                    reason = reason or str(exc)
            reply = partial_reply(bytes(statuses), parts, reason, asked_bytes) if reason else \
                b"".join([REPLY_HEADER.pack(REPLY_MAGIC, Status.OK), *parts])
            counters.served += len(parts)
            counters.served_bytes += sum(map(len, parts))
        except RequestRefused as exc:
            counters.refused += 1
            log.warning("rank %d: request refused: %s", source, exc)
            reply = error_reply(Status.REFUSED, str(exc))
        except ChunkError as exc:
            reply = error_reply(status_of(exc), str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug serving one request costs it (the peer falls back to DEST),
            # never this rank's MPI thread, which every other request and collective needs
            log.exception("rank %d: serving rank %d chunk %d at %d failed", self.rank, source, chunk, offset)
            reply = error_reply(Status.UNAVAILABLE, f"a bug on rank {self.rank}: {exc!r}")
        send = self.comm.Isend([reply, self._mpi.BYTE], dest=source, tag=tag)
        self._send_deadlines[id(send)] = (send, time.monotonic() + _SEND_GRACE * self.options.timeout)
        self._poll(send, lambda _status, reply=reply: None)  # the closure keeps the buffer alive until sent
        if not flags & QUIET_REPLY:
            (self._to_ring_reply if flags & RING_REPLY_BELL else self._to_ring).add(source)

    def _shut_down(self) -> None:
        error_text = "the MPI thread has stopped" if self._failure is None else f"the MPI thread failed: " \
            f"{self._failure!r}"
        self._stopped_reason = error_text
        self._stopped.set()
        for number, peer in enumerate(self._peers):
            for request in list(peer.in_flight) + list(peer.queued):
                request.fail(ChunkUnavailable(f"rank {number}: {error_text}", chunk_id=request.chunk))
            peer.in_flight.clear()
            peer.queued.clear()
        self._fail_submitted()
        for request, on_complete in zip(self._requests, self._on_complete):
            if request and on_complete not in self._collective_callbacks:  # a collective cannot be cancelled
                request.Cancel()
        for future in self._collectives:
            if not future.done():
                future.set_exception(ChunkUnavailable(error_text))
        self._requests.clear()
        self._on_complete.clear()
