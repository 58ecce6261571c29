"""Run by tests/test_serve.py under `mpiexec -n 2`: rank 0 asks rank 1 for blobs through its one state machine
(remote_blobs.RemoteBlobs), from a trio loop and from other threads, each posting its own requests, which the MPI
thread drives.

Both ranks run a PeerTransport with doorbells, as `fanstore serve` does. Rank 1 serves blobs of made-up chunks:
chunk 1 is `BLOB`, chunk 3 is `OTHER`, chunk 4 is `BLOB` too but the ring of its reply is lost (a UDP datagram can
be), chunk 2 is refused, chunk 5 is corrupt, chunk 7 meets a bug in the server, a request for chunk 9 holds rank
1's MPI thread for STALL seconds (a stalled peer), and one for chunk 11 (`BLOB` too) holds it for SLOW seconds,
well within the deadline, so that the requests posted after it are sure to be out when they are cancelled.

Rank 0 asks from a trio loop: a good blob; several in one request, several of which one is refused, and several of
which one is corrupt (also from another thread); one whose reply's ring is lost; a refused one; a refused and a
corrupt one of a few bytes (from the loop and from another thread); the server's bug; more than the cap from the
loop and from threads at once (one cap); a cancel of a queued request and of one in flight; the stalled one with
several in flight (past the deadline, the reads go to DEST); one after the skip is over; one still out when the loop
ends. Then one from the main thread, with no loop; last, a bug ends rank 0's MPI thread, and the job still ends
together. It prints one JSON line of what it saw; rank 1 prints what its transport counted.

    mpiexec -n 2 python serve_remote_blobs.py
"""

from __future__ import annotations

import json
import sys
import threading
import time

import mpi4py

mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402
import trio  # noqa: E402

from fanstore.core.chunk_source import BlobRead, ChunkSource, FallbackChunkSource  # noqa: E402
from fanstore.errors import ChunkCorrupt, ChunkError, ChunkUnavailable, say_line  # noqa: E402
from fanstore.serve.doorbell import open_doorbell  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.remote_blobs import RemoteBlobs  # noqa: E402
from fanstore.serve.statuses import RequestRefused  # noqa: E402
from fanstore.serve.transport import PeerOptions, PeerTransport  # noqa: E402

BLOB = bytes(range(256)) * 300
OTHER = bytes(range(255, -1, -1)) * 100
TIMEOUT = 0.5
RETRY_AFTER = 1.0
STALL = 3.0
SLOW_CHUNK, SLOW = 11, 0.2
CAP = 3
LOST_RING = 4
SERVING_BUG = 7  # rank 1's server meets a bug (not a ChunkError) serving this chunk
CORRUPT = 5  # rank 1 finds this chunk's blobs corrupt, with a reason far longer than a small blob
SMALL = 5  # bytes of a small blob: its reply's reason is longer than the blob
rings_to_lose: list[int] = []  # rank 1: the replies whose ring to the asker is not sent


def failed(error: ChunkError) -> str:
    """An error an asker was given, with its kind (statuses.py: a peer's CORRUPT is corrupt, the rest unavailable)."""
    return f"{'corrupt' if isinstance(error, ChunkCorrupt) else 'unavailable'}: {error}"


class Server:
    """Rank 1's blobs of made-up chunks, each kind of answer a chunk of its own (transport.RequestServer)."""

    def check(self, peer: int, chunk: int, offset: int, length: int) -> None:
        if chunk == 9:
            time.sleep(STALL)
        if chunk == SLOW_CHUNK:
            time.sleep(SLOW)
            chunk = 1
        if chunk == SERVING_BUG:
            raise RuntimeError("injected while serving")
        if chunk == CORRUPT:
            raise ChunkCorrupt(f"chunk {chunk} at {offset}: {'its copy here fails its checksum; ' * 20}read it "
                               "elsewhere")
        if chunk == LOST_RING:
            rings_to_lose.append(peer)
            chunk = 1
        if chunk == 3 and offset == 0 and length == len(OTHER):
            return
        if chunk != 1 or offset != 0 or length != len(BLOB):
            raise RequestRefused(f"chunk {chunk} at {offset} is not a blob of this rank")

    def read_into(self, chunk: int, offset: int, length: int, out: memoryview) -> None:
        out[:] = OTHER if chunk == 3 else BLOB


async def ask(remote: RemoteBlobs, chunk: int, length: int = len(BLOB)) -> tuple[bool, object]:
    arrived = trio.Event()
    outcome: list[object] = []
    token = trio.lowlevel.current_trio_token()

    def done(blob: bytes | None, error: ChunkError | None) -> None:  # on the MPI thread, or here when it fails at once
        outcome.append(bytes(blob) if error is None else failed(error))
        token.run_sync_soon(arrived.set)

    taken = remote.ask(1, (BlobRead(chunk, 0, length, done),)) is not None
    await arrived.wait()
    return taken, outcome[0]


async def ask_many(remote: RemoteBlobs, chunks: list[int]) -> tuple[bool, list[object]]:
    """Several blobs of rank 1 in one request: what each one's `done` got, in the order asked."""
    outcomes: dict[int, object] = {}
    arrived = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def done_for(number: int):
        def done(blob: memoryview | None, error: ChunkError | None) -> None:
            outcomes[number] = bytes(blob) if error is None else failed(error)
            if len(outcomes) == len(chunks):
                token.run_sync_soon(arrived.set)
        return done

    reads = [BlobRead(chunk, 0, len(OTHER if chunk == 3 else BLOB), done_for(number))
             for number, chunk in enumerate(chunks)]
    taken = remote.ask(1, reads) is not None
    await arrived.wait()
    return taken, [outcomes[number] for number in range(len(chunks))]


def ignore(blob: object, error: object) -> None:
    pass


class Peer(ChunkSource):
    """Rank 1's blobs, asked through the transport, as sources.PeerChunkSource asks the owner."""

    def __init__(self, transport: PeerTransport) -> None:
        self.transport = transport

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        return self.transport.fetch(1, chunk_id, offset, length)


class Dest(ChunkSource):
    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        return b"from DEST"


async def one_cap(remote: RemoteBlobs) -> list[object]:
    """CAP + 3 requests from the loop and CAP + 3 from two threads at once: never more than CAP in flight to rank 1,
    and every one answered."""
    answered: list[bool] = []
    most = [0]

    def done(blob, error) -> None:
        answered.append(error is None and bytes(blob) == BLOB)
        most[0] = max(most[0], remote.in_flight(1))

    def from_a_thread(count: int) -> None:
        for _ in range(count):
            remote.ask(1, (BlobRead(1, 0, len(BLOB), done),))
            most[0] = max(most[0], remote.in_flight(1))

    threads = [threading.Thread(target=from_a_thread, args=(CAP // 2 + 2,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in range(CAP + 3):
        remote.ask(1, (BlobRead(1, 0, len(BLOB), done),))
        most[0] = max(most[0], remote.in_flight(1))
    for thread in threads:
        thread.join()
    asked = CAP + 3 + 2 * (CAP // 2 + 2)
    deadline = time.monotonic() + TIMEOUT
    while len(answered) < asked and time.monotonic() < deadline:
        await trio.sleep(0.01)
    return [most[0], len(answered) == asked and all(answered)]


async def cancels(remote: RemoteBlobs) -> list[object]:
    """A request cancelled while queued and one cancelled in flight: each gets 'cancelled' at once, its slot is
    free, and the late reply to the one in flight is dropped without a word."""
    outcomes: list[str] = []

    def done(blob, error) -> None:
        outcomes.append("blob" if error is None else str(error))

    # The first holds rank 1's MPI thread (SLOW): the others cannot be answered before they are cancelled, however
    # late this loop runs on a loaded machine.
    requests = [remote.ask(1, (BlobRead(SLOW_CHUNK, 0, len(BLOB), done),))]
    requests += [remote.ask(1, (BlobRead(1, 0, len(BLOB), done),)) for _ in range(CAP)]  # the last one queued
    cancelled = [remote.cancel(requests[-1]), remote.cancel(requests[1])]
    in_flight_after = remote.in_flight(1)
    await trio.sleep(SLOW + 0.3)
    return [cancelled, in_flight_after, outcomes.count("rank 1: the request was cancelled"), outcomes.count("blob"),
            remote.cancel(requests[2])]


async def stalled(remote: RemoteBlobs, transport: PeerTransport) -> list[object]:
    """Rank 1 stalls with several requests in flight: each misses the deadline, and a read through the fallback
    source gets DEST's bytes by then."""
    outcomes: list[str] = []
    remote.ask(1, (BlobRead(9, 0, len(BLOB), ignore),))  # holds rank 1's MPI thread
    for _ in range(CAP - 1):
        remote.ask(1, (BlobRead(1, 0, len(BLOB), lambda blob, error: outcomes.append(str(error))),))
    in_flight = remote.in_flight(1)
    started = time.monotonic()
    read = await trio.to_thread.run_sync(FallbackChunkSource(Peer(transport), Dest()).read, 1, 0, len(BLOB))
    return [in_flight, read.decode(), round(time.monotonic() - started, 1),
            sum("did not answer within 0.5 s" in outcome for outcome in outcomes)]


async def rank_0(transport: PeerTransport) -> dict[str, object]:
    remote = transport.remote
    seen: dict[str, object] = {}
    taken, blob = await ask(remote, 1)
    seen["good"] = taken and blob == BLOB
    taken, blobs = await ask_many(remote, [1, 3, 1])  # each blob to its own reader, counted one by one
    seen["several"] = (taken, blobs == [BLOB, OTHER, BLOB], transport.counters[1].fetched)
    taken, blobs = await ask_many(remote, [1, 2, 3])  # one refused: the request fails, each read falls back
    seen["several, one refused"] = (taken, [str(blob) for blob in blobs])
    # One the peer finds corrupt costs that one alone, asked from the loop and from another thread.
    taken, blobs = await ask_many(remote, [1, CORRUPT, 3])
    seen["several, one corrupt"] = (taken, [blob if isinstance(blob, str) else blob == BLOB or blob == OTHER
                                            for blob in blobs])
    seen["several, one corrupt, from a thread"] = await trio.to_thread.run_sync(fetch_many_outcomes, transport)
    started = time.monotonic()
    taken, blob = await ask(remote, LOST_RING)  # found by the MPI thread's polling, well before the deadline
    seen["ring lost"] = (taken and blob == BLOB, time.monotonic() - started < TIMEOUT / 2)
    taken, reply = await ask(remote, 2)
    seen["refused"] = taken and isinstance(reply, str) and "refused" in reply
    # Replies that carry a reason longer than the few bytes asked: each fails its request alone, with its reason,
    # from the loop and from another thread, and both go on asking.
    seen["small, refused"] = [str(reply) for reply in (await ask(remote, 2, SMALL))[1:]]
    seen["small, corrupt"] = [str(reply) for reply in (await ask(remote, CORRUPT, SMALL))[1:]]
    seen["small, from a thread"] = await trio.to_thread.run_sync(fetch_outcomes, transport)
    seen["asked after"] = (await ask(remote, 1))[1] == BLOB
    taken, reply = await ask(remote, SERVING_BUG)  # costs that request, not rank 1's MPI thread: the next is served
    seen["serving bug"] = (taken, reply, (await ask(remote, 1))[1] == BLOB)
    seen["one cap"] = await one_cap(remote)
    seen["cancel"] = await cancels(remote)
    seen["stalled"] = await stalled(remote, transport)
    seen["skipped after"] = (transport.skipped(1), remote.ask(1, (BlobRead(1, 0, len(BLOB), ignore),)) is None)
    await trio.sleep(RETRY_AFTER + 0.2)
    # Rank 1's MPI thread is still held: this request is out when the loop ends, and meets its deadline all the same.
    seen["left out at the end"] = remote.ask(1, (BlobRead(1, 0, len(BLOB), lambda blob, error: left_out.append(failed(error) if error else bytes(blob) == BLOB)),)) is not None
    return seen


left_out: list[object] = []  # what the request out when the loop ended got, from the MPI thread


def fetch_many_outcomes(transport: PeerTransport) -> list[object]:
    """What the MPI thread's one request for a good blob, a corrupt one and another good one gives each."""
    outcomes: dict[int, object] = {}
    arrived = threading.Event()

    def done_for(number: int):
        def done(blob, error) -> None:
            outcomes[number] = bytes(blob) in (BLOB, OTHER) if error is None else failed(error)
            if len(outcomes) == 3:
                arrived.set()
        return done

    transport.fetch_many_later(1, [BlobRead(chunk, 0, len(OTHER if chunk == 3 else BLOB), done_for(number))
                                   for number, chunk in enumerate((1, CORRUPT, 3))])
    arrived.wait(10)
    return [outcomes.get(number) for number in range(3)]


def fetch_outcomes(transport: PeerTransport) -> list[str]:
    """What the MPI thread's fetches of a small refused blob, a small corrupt one and a good one give."""
    outcomes = []
    for chunk, length in ((2, SMALL), (CORRUPT, SMALL), (1, len(BLOB))):
        try:
            outcomes.append("the blob" if transport.fetch(1, chunk, 0, length) == BLOB else "another blob")
        except ChunkError as exc:
            outcomes.append(failed(exc))
    return outcomes


def kill_the_mpi_thread(transport: PeerTransport) -> dict[str, object]:
    """A bug that ends rank 0's MPI thread: from then on its fetches fail at once (the reads fall back), and the
    collectives that end the job run on a thread of their own, so rank 1 is not left waiting for rank 0."""
    def broken() -> bool:
        raise RuntimeError("injected in the MPI thread")

    transport._receive_messages = broken  # type: ignore[method-assign]
    transport._backoff.wake()
    deadline = time.monotonic() + 5
    while transport._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        outcome = "the blob" if transport.fetch(1, 1, 0, len(BLOB)) == BLOB else "another blob"
    except ChunkUnavailable as exc:
        outcome = f"unavailable: {exc}"
    return {"MPI thread ended": (not transport._thread.is_alive(), outcome)}


def main() -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    bell = open_doorbell(comm)
    if bell is None or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        say_line(json.dumps({"rank": rank, "error": "no doorbell or no MPI_THREAD_MULTIPLE"}), sys.stdout)
        return 1
    if rank == 1:
        ring = bell.ring

        def ring_unless_lost(peer: int) -> None:
            if rings_to_lose:
                rings_to_lose.pop()
            else:
                ring(peer)

        bell.ring = ring_unless_lost  # type: ignore[method-assign]
    transport = PeerTransport(comm, Server(), PeerOptions(timeout=TIMEOUT, retry_after=RETRY_AFTER,
                                                       max_in_flight=CAP), bell)
    transport.start()
    if rank == 0:
        seen = trio.run(rank_0, transport)
        time.sleep(STALL)  # the stalled peer answers meanwhile: its late replies reach the MPI thread
        seen["left out, answered"] = left_out
        seen["from the MPI thread alone"] = "the blob" if transport.fetch(1, 1, 0, len(BLOB)) == BLOB else "?"
        seen["refused from 1"] = transport.counters[1].refused
        seen.update(kill_the_mpi_thread(transport))
    else:
        seen = {}
    transport.collective(lambda comm: (comm.Ibarrier(), lambda: None)).result()
    if rank == 1:
        seen["served"] = transport.counters[0].served
    transport.stop()
    bell.close()
    wait_all([comm.Ibarrier()])
    comm.Free()
    say_line(json.dumps({"rank": rank, **seen}), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
