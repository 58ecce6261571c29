"""Stored blobs between ranks over MPI, from one thread that owns MPI once the job has started.

The MPI thread serves peers: requests from them are found with Improbe, checked by the node's `RequestServer`, and
answered from local chunks; a request may ask for up to MAX_BLOBS blobs, answered in one reply, where a blob the rank
cannot give costs that blob alone (the messages: peer_messages.py). It also runs the job's collectives and sends
verdicts, and polls everything with Testsome and a backing-off sleep (polling.Backoff): no blocking MPI call after
start-up, so an idle rank costs a few percent of a core. With a doorbell (doorbell.py), each request and each reply
also rings its receiver, which then sleeps until rung.

This rank's own requests to peers are remote_blobs.py's (RemoteBlobs, one state machine: tags, the per-peer cap,
deadlines, cancel); `fetch`, `fetch_later`, `fetch_many_later` and `ping` hand them to it. The MPI thread drives
that machine (each turn: completions, queued posts, deadlines) and drops the replies it gave up on when they come.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..core.chunk_source import BlobRead, ReadDone
from ..errors import ChunkError, ChunkUnavailable
from .blob_arena import BlobArena
from .doorbell import Doorbell
from .peer_messages import FIRST_REPLY_TAG, MAX_BLOBS, MORE_BLOB, PING, REASON_ROOM, REPLY_HEADER, REPLY_MAGIC, \
    REQUEST, REQUEST_MAGIC, TAG_REQUEST, TAG_VERDICT, VERDICT, VERDICT_MAGIC, \
    PeerCounters, error_reply, partial_reply
from ..core.thread_names import name_os_thread
from .polling import Backoff, precise_sleeps, wait_all
from .remote_blobs import PeerOptions, RemoteBlobs
from .statuses import RequestRefused, Status, status_of

log = logging.getLogger("fanstore.serve")

# How much longer than `timeout` a reply we send may take to be received before it is cancelled: the requester
# gave up on it by then.
_SEND_GRACE = 4.0


class RequestServer(Protocol):
    """What a rank serves its peers: each blob asked is checked first, then read straight into the reply."""

    def check(self, peer: int, chunk: int, offset: int, length: int) -> None:
        """RequestRefused when `peer` may not ask this of this rank (no such blob here), a ChunkError when this
        rank cannot give it now. Before any memory is taken for the reply: the lengths a peer names are its own."""

    def read_into(self, chunk: int, offset: int, length: int, out: memoryview) -> None:
        """The checked blob, written into `out` (its `length` bytes of the reply); a ChunkError if it cannot be."""


def mpi_failure(exc: Exception) -> str:
    """One line for an MPI error: the innermost cause of MPICH's error stack (say `process_vm_readv failed
    (errno 3)`: the peer has died), not its first line, which only gives the class."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    innermost = lines[-1].rsplit(": ", 1)[-1].strip() if lines else ""
    return f"MPI error: {innermost or type(exc).__name__}"


@dataclass(frozen=True)
class _Verdict:
    peer: int
    message: bytes


class PeerTransport:
    """Fetches from peers and serves them, on `comm` (a duplicate of the job's communicator, ours alone)."""

    def __init__(self, comm: Any, server: RequestServer, options: PeerOptions = PeerOptions(),
                 bell: Doorbell | None = None, arena: BlobArena | None = None) -> None:
        """`arena`: the node's shared memory, where this rank's requests receive their replies (blob_arena.py)."""
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.options = options
        self.counters = [PeerCounters() for _ in range(self.size)]  # both ways, per peer (see peer_counters)
        self._server = server
        self._tag_limit = int(comm.Get_attr(MPI.TAG_UB))
        self._submitted: deque[_Verdict | tuple[Callable[[Any], tuple[Any, Callable[[], Any]]], Future]] = deque()
        self._requests: list[Any] = []  # MPI requests being polled, with what to do when each completes
        self._on_complete: list[Callable[[Any], None]] = []
        self._collectives: list[Future] = []
        self._collective_callbacks: set[Callable[[Any], None]] = set()
        # Replies we send, by id(request): (the request, when to give up on it), and the peer each goes to.
        self._send_deadlines: dict[int, tuple[Any, float]] = {}
        self._sending_to: dict[int, int] = {}
        self._statuses: list[Any] = []  # reused by every Testsome: a turn of the loop allocates nothing
        self._probe_status = MPI.Status()
        self._verdict: tuple[int, int, str] | None = None  # written by the MPI thread, read by the lifecycle
        self.bell = bell
        self._to_ring: set[int] = set()  # peers sent a request or reply this turn: rung once, at its end
        self._backoff = Backoff.rung_by(bell)
        # This rank's own requests to peers: one state machine, which this thread drives.
        self.remote = RemoteBlobs(comm, options, self.counters, bell, MPI.Query_thread() == MPI.THREAD_MULTIPLE,
                                  self._backoff.wake, self._tag_limit, arena)
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # the MPI thread has ended: fetches fail at once
        self._alone = threading.Lock()  # collectives once the MPI thread has stopped (_collective_alone)
        self._thread = threading.Thread(target=self._run, name="fanstore-mpi", daemon=True)
        self._failure: BaseException | None = None
        self.host = socket.gethostname()

    # --- the readers' side ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def fetch(self, peer: int, chunk: int, offset: int, length: int) -> bytes:
        """The stored blob at `offset` of `chunk`, from rank `peer` (RemoteBlobs.fetch)."""
        return self.remote.fetch(peer, chunk, offset, length)

    def fetch_later(self, peer: int, chunk: int, offset: int, length: int, done: ReadDone) -> None:
        """`fetch` for a caller that must not wait: `done(blob, None)` or `done(None, ChunkError)` comes later
        (by the request's deadline), or at once once the transport has stopped, and must only hand the outcome
        on."""
        self.remote.ask(peer, (BlobRead(chunk, offset, length, done),))

    def fetch_many_later(self, peer: int, reads: Sequence[BlobRead]) -> None:
        """`fetch_later` for up to MAX_BLOBS blobs of `peer` in one request; each read's `done` is called."""
        self.remote.ask(peer, reads)

    def ping(self, peer: int, done: ReadDone) -> None:
        """Ask `peer` whether it is there: `done(b"", None)` when it answers, `done(None, ChunkUnavailable)` when
        it misses the deadline (a peer skipped for having missed one is asked all the same: a ping is how this
        rank learns it is back). Counted nowhere."""
        self.remote.ask(peer, (BlobRead(0, 0, 0, done),), flags=PING)

    def send_verdict(self, peer: int, status: int, reason: str) -> None:
        """Tell `peer` the job's status when the ranks cannot agree on it (some are lost): it ends with it."""
        message = VERDICT.pack(VERDICT_MAGIC, status) + reason.encode()[:REASON_ROOM]
        self._submitted.append(_Verdict(peer, message))
        self._backoff.wake()

    @property
    def verdict(self) -> tuple[int, int, str] | None:
        """(rank that sent it, status, reason) of a verdict this rank was sent, or None."""
        return self._verdict

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
        name_os_thread()
        precise_sleeps()
        remote = self.remote
        try:
            while not self._stopping.is_set():
                progressed = bool(self._submitted) and self._take_submitted()
                progressed |= remote.drive()
                progressed |= self._poll_requests()
                progressed |= self._receive_messages()
                if self._to_ring:
                    self._ring_peers()
                busy = self._busy()
                if self._send_deadlines:
                    self._enforce_send_deadlines()
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
        """A request of ours this thread drives is queued or in flight, or a reply we send is: its completion is
        awaited closely and its deadline watched."""
        return bool(self._send_deadlines) or self.remote.busy()

    def _take_submitted(self) -> bool:
        progressed = False
        while self._submitted:
            item = self._submitted.popleft()
            progressed = True
            if isinstance(item, _Verdict):
                self._send_to(item.peer, item.message, TAG_VERDICT)
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

    @staticmethod
    def _settle(future: Future, result: Callable[[], Any]) -> None:
        try:
            future.set_result(result())
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            future.set_exception(exc)

    def _ring_peers(self) -> None:
        """One ring per peer a turn, however many requests and replies went to it: a batch wakes it once."""
        if self.bell is not None:
            for peer in self._to_ring:
                self.bell.ring(peer)
        self._to_ring.clear()

    def peer_counters(self) -> list[PeerCounters]:
        """What went between this rank and each peer: blobs asked and fetched, served, failed, refused."""
        return self.counters

    def skipped(self, peer: int) -> bool:
        """`peer` missed a deadline lately, so its files are read elsewhere for now."""
        return self.remote.skipped(peer)

    def _enforce_send_deadlines(self) -> None:
        """A reply we send that its asker has not taken long after it gave up on it is cancelled."""
        now = time.monotonic()
        for key, (request, give_up_at) in list(self._send_deadlines.items()):
            if give_up_at < now:
                del self._send_deadlines[key]
                request.Cancel()  # stays polled until the cancel completes
                peer = self._sending_to.pop(key, None)
                if peer is not None:  # past its grace: the peer is judged by its deadline again
                    self.remote.sending(peer, False, delivered=False)

    def _fail_submitted(self) -> None:
        """Fail what was handed over but never taken (the MPI thread has stopped); safe from any thread."""
        while True:
            try:
                item = self._submitted.popleft()
            except IndexError:
                return
            if not isinstance(item, _Verdict):
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
        for k, i in enumerate(done):
            self._send_deadlines.pop(id(self._requests[i]), None)
            peer = self._sending_to.pop(id(self._requests[i]), None)
            if peer is not None:
                self.remote.sending(peer, False, delivered=not statuses[k].Is_cancelled())
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
            elif self.remote.forget(source, tag):
                pass  # the reply to a request given up on
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
            self._send_to(source, REPLY_HEADER.pack(REPLY_MAGIC, Status.OK), tag)
            return
        blobs = [(chunk, offset, length)]
        if more:
            blobs.extend(MORE_BLOB.iter_unpack(memoryview(message)[REQUEST.size:]))
        try:
            asked_bytes = sum(blob[2] for blob in blobs)
            if more and asked_bytes > self.options.max_reply_bytes:
                raise RequestRefused(f"{len(blobs)} blobs of {asked_bytes} bytes in all: more than "
                                     f"{self.options.max_reply_bytes} bytes in one reply")
            reply, served = self._reply(source, blobs, partial_allowed=bool(more))
            counters.served += len(served)
            counters.served_bytes += sum(map(len, served))
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
        self._send_to(source, reply, tag)

    def _send_to(self, peer: int, message: Any, tag: int) -> None:
        """Send a reply or a verdict, given up on past its grace. This rank's own requests to `peer` wait behind it on
        their connection: RemoteBlobs is told while it is on its way (within its grace) and when it got through."""
        send = self.comm.Isend([message, self._mpi.BYTE], dest=peer, tag=tag)
        self._send_deadlines[id(send)] = (send, time.monotonic() + _SEND_GRACE * self.options.timeout)
        self._sending_to[id(send)] = peer
        self.remote.sending(peer, True)
        self._poll(send, lambda _status, message=message: None)  # the closure keeps the buffer alive until sent
        self._to_ring.add(peer)

    def _reply(self, source: int, blobs: list[tuple[int, int, int]], partial_allowed: bool
               ) -> tuple[Any, list[memoryview]]:
        """The reply to a request, its blobs read in place one after the other after the header (one copy of each
        byte, into memory taken once every blob asked is known to be one), and the blobs it carries. A blob this rank
        cannot give costs that blob alone where the request asked for several (a partial reply, which says why the
        first one failed); else its error is raised, as a refusal always is."""
        statuses, reasons = bytearray(len(blobs)), []

        def failed(number: int, exc: ChunkError) -> None:
            if not partial_allowed:
                raise exc
            statuses[number] = status_of(exc)
            reasons.append(str(exc))

        for number, (chunk, offset, length) in enumerate(blobs):
            try:
                self._server.check(source, chunk, offset, length)
            except ChunkError as exc:
                failed(number, exc)
        checked_bytes = sum(length for (_, _, length), status in zip(blobs, statuses) if status == Status.OK)
        reply = np.empty(REPLY_HEADER.size + checked_bytes, np.uint8)  # every byte is written before it is sent
        REPLY_HEADER.pack_into(reply, 0, REPLY_MAGIC, Status.OK)
        view, at, served = memoryview(reply), REPLY_HEADER.size, []
        for number, (chunk, offset, length) in enumerate(blobs):
            if statuses[number] != Status.OK:
                continue
            out = view[at : at + length]
            at += length
            try:
                self._server.read_into(chunk, offset, length, out)
                served.append(out)
            except ChunkError as exc:
                failed(number, exc)
        if reasons:
            asked_bytes = sum(length for _, _, length in blobs)
            return partial_reply(bytes(statuses), served, reasons[0], asked_bytes), served
        return reply, served

    def _shut_down(self) -> None:
        error_text = "the MPI thread has stopped" if self._failure is None else f"the MPI thread failed: " \
            f"{self._failure!r}"
        self._stopped.set()
        self.remote.stop(error_text)
        self._fail_submitted()
        for request, on_complete in zip(self._requests, self._on_complete):
            if request and on_complete not in self._collective_callbacks:  # a collective cannot be cancelled
                request.Cancel()
        for future in self._collectives:
            if not future.done():
                future.set_exception(ChunkUnavailable(error_text))
        self._requests.clear()
        self._on_complete.clear()
