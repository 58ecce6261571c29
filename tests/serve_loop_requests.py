"""Run by tests/test_serve.py under `mpiexec -n 2`: rank 0's event loop asks rank 1 for blobs itself.

Both ranks run a PeerTransport with doorbells, as `fanstore serve` does. Rank 1 serves blobs of made-up chunks:
chunk 1 is `BLOB`, chunk 3 is `OTHER`, chunk 4 is `BLOB` too but the ring of its reply is lost (a UDP datagram can
be), chunk 2 is refused, chunk 5 is corrupt, chunk 7 meets a bug in the server, and a request for chunk 9 holds rank
1's MPI thread for STALL seconds (a stalled peer).

Rank 0 asks from a trio loop through LoopRequests: a good blob; several in one request, several of which one is
refused, and several of which one is corrupt (also through the MPI thread); one whose ring is lost; a refused one;
a refused and a corrupt one of a few bytes (from the loop and from the MPI thread); two fetched ahead (one
collected, one left to the pump); the server's bug; more than the cap allows; the stalled one (past its deadline);
one after the skip is over; one left out when the loop ends. Then, from a second loop, one that meets a bug in the
pump, and from a third, one that meets it in `collect`; last, a bug ends rank 0's MPI thread, and the job still
ends together. It prints one JSON line of what it saw; rank 1 prints what its transport counted.

    mpiexec -n 2 python serve_loop_requests.py
"""

from __future__ import annotations

import json
import select
import sys
import threading
import time

import mpi4py

mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402
import trio  # noqa: E402

from fanstore.chunk_source import BlobRead  # noqa: E402
from fanstore.errors import ChunkCorrupt, ChunkError, ChunkUnavailable, say_line  # noqa: E402
from fanstore.serve.doorbell import Doorbell, open_doorbell  # noqa: E402
from fanstore.serve.loop_requests import LoopRequests  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.statuses import RequestRefused  # noqa: E402
from fanstore.serve.transport import PeerOptions, PeerTransport  # noqa: E402

BLOB = bytes(range(256)) * 300
OTHER = bytes(range(255, -1, -1)) * 100
TIMEOUT = 0.5
RETRY_AFTER = 1.0
STALL = 3.0
CAP = 3
LOST_RING = 4
SERVING_BUG = 7  # rank 1's server meets a bug (not a ChunkError) serving this chunk
CORRUPT = 5  # rank 1 finds this chunk's blobs corrupt, with a reason far longer than a small blob
SMALL = 5  # bytes of a small blob: its reply's reason is longer than the blob
rings_to_lose: list[int] = []  # rank 1: the replies whose ring to the asker's reply bell is not sent


def failed(error: ChunkError) -> str:
    """An error an asker was given, with its kind (statuses.py: a peer's CORRUPT is corrupt, the rest unavailable)."""
    return f"{'corrupt' if isinstance(error, ChunkCorrupt) else 'unavailable'}: {error}"


def serve(peer: int, chunk: int, offset: int, length: int) -> bytes:
    if chunk == 9:
        time.sleep(STALL)
    if chunk == SERVING_BUG:
        raise RuntimeError("injected while serving")
    if chunk == CORRUPT:
        raise ChunkCorrupt(f"chunk {chunk} at {offset}: {'its copy here fails its checksum; ' * 20}read it elsewhere")
    if chunk == LOST_RING:
        rings_to_lose.append(peer)
        chunk = 1
    if chunk == 3 and offset == 0 and length == len(OTHER):
        return OTHER
    if chunk != 1 or offset != 0 or length != len(BLOB):
        raise RequestRefused(f"chunk {chunk} at {offset} is not a blob of this rank")
    return BLOB


async def ask(loop: LoopRequests, chunk: int, length: int = len(BLOB), ahead: bool = False) -> tuple[bool, object]:
    arrived = trio.Event()
    outcome: list[object] = []

    def done(blob: bytes | None, error: ChunkError | None) -> None:
        outcome.append(blob if error is None else failed(error))
        arrived.set()

    if not loop.start(1, chunk, 0, length, done, ahead):
        return False, None
    await arrived.wait()
    return True, outcome[0]


async def ask_many(loop: LoopRequests, chunks: list[int]) -> tuple[bool, list[object]]:
    """Several blobs of rank 1 in one request: what each one's `done` got, in the order asked."""
    outcomes: dict[int, object] = {}
    arrived = trio.Event()

    def done_for(number: int):
        def done(blob: memoryview | None, error: ChunkError | None) -> None:
            outcomes[number] = bytes(blob) if error is None else failed(error)
            if len(outcomes) == len(chunks):
                arrived.set()
        return done

    reads = [BlobRead(chunk, 0, len(OTHER if chunk == 3 else BLOB), done_for(number))
             for number, chunk in enumerate(chunks)]
    if not loop.start_many(1, reads):
        return False, []
    await arrived.wait()
    return True, [outcomes[number] for number in range(len(chunks))]


async def rank_0(loop: LoopRequests, transport: PeerTransport, bell: Doorbell) -> dict[str, object]:
    seen: dict[str, object] = {}
    taken, blob = await ask(loop, 1)
    seen["good"] = taken and blob == BLOB
    seen["via the loop"] = (transport.loop_counters[1].fetched, transport.counters[1].fetched)
    taken, blobs = await ask_many(loop, [1, 3, 1])  # each blob to its own reader, counted one by one
    seen["several"] = (taken, blobs == [BLOB, OTHER, BLOB], transport.loop_counters[1].fetched)
    taken, blobs = await ask_many(loop, [1, 2, 3])  # one refused: the request fails, each read falls back
    seen["several, one refused"] = (taken, [str(blob) for blob in blobs])
    # One the peer finds corrupt costs that one alone, asked from the loop and from the MPI thread.
    taken, blobs = await ask_many(loop, [1, CORRUPT, 3])
    seen["several, one corrupt"] = (taken, [blob if isinstance(blob, str) else blob == BLOB or blob == OTHER
                                            for blob in blobs])
    seen["several, one corrupt, via the MPI thread"] = await trio.to_thread.run_sync(fetch_many_outcomes, transport)
    started = time.monotonic()
    taken, blob = await ask(loop, LOST_RING)  # found by the pump's timer, well before the deadline
    seen["ring lost"] = (taken and blob == BLOB, time.monotonic() - started < TIMEOUT / 2)
    taken, reply = await ask(loop, 2)
    seen["refused"] = taken and isinstance(reply, str) and "refused" in reply
    # Replies that carry a reason longer than the few bytes asked: each fails its request alone, with its reason,
    # from the loop and from the MPI thread, and both go on asking.
    seen["small, refused"] = [str(reply) for reply in (await ask(loop, 2, SMALL))[1:]]
    seen["small, corrupt"] = [str(reply) for reply in (await ask(loop, CORRUPT, SMALL))[1:]]
    seen["small, via the MPI thread"] = await trio.to_thread.run_sync(fetch_outcomes, transport)
    seen["asked after"] = (await ask(loop, 1))[1] == BLOB
    # A fetch ahead of the reader: its reply rings nobody, and is taken where the loop runs anyway (collect)...
    await trio.sleep(0.05)
    bell.take_replies()
    arrived: list[object] = []
    loop.start(1, 1, 0, len(BLOB), lambda blob, error: arrived.append(blob), ahead=True)
    time.sleep(0.2)  # the loop does nothing meanwhile: the reply comes, without a ring
    rung = bool(select.select([bell.reply_fileno()], [], [], 0)[0])
    loop.collect()
    seen["ahead"] = (rung, arrived == [BLOB])
    # ... or by the pump's timer when nothing collects it.
    started = time.monotonic()
    taken, blob = await ask(loop, 1, ahead=True)
    seen["ahead, not collected"] = (taken and blob == BLOB, time.monotonic() - started < TIMEOUT / 2)
    taken, reply = await ask(loop, SERVING_BUG)  # costs that request, not rank 1's MPI thread: the next is served
    seen["serving bug"] = (taken, reply, (await ask(loop, 1))[1] == BLOB)
    seen["cap"] = [loop.start(1, 1, 0, len(BLOB), lambda blob, error: None) for _ in range(CAP + 1)]
    await trio.sleep(0.2)  # those come back
    started = time.monotonic()
    taken, reply = await ask(loop, 9)
    seen["stalled"] = (taken, reply, round(time.monotonic() - started, 1))
    seen["skipped after"] = (transport.skipped(1), loop.start(1, 1, 0, len(BLOB), lambda blob, error: None))
    await trio.sleep(RETRY_AFTER + 0.2)
    # Rank 1's MPI thread is still held: this request is out when the loop ends, and handed over.
    seen["left out at the end"] = loop.start(1, 1, 0, len(BLOB), lambda blob, error: None)
    return seen


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


async def rank_0_meets_a_bug(loop: LoopRequests) -> dict[str, object]:
    """A bug in the pump (here, completing replies raises) costs the requests out, never the loop: they fail as
    unavailable (so they fall back), and from then on the MPI thread asks."""
    def broken() -> bool:
        raise RuntimeError("injected")

    loop._complete = broken  # type: ignore[method-assign]
    taken, reply = await ask(loop, 1)
    return {"bug": (taken, reply, loop.start(1, 1, 0, len(BLOB), lambda blob, error: None))}


async def rank_0_meets_a_bug_in_collect(loop: LoopRequests) -> dict[str, object]:
    """The same bug met where a read of the mount collects replies (a fresh LoopRequests): it costs the request
    out, never the read, and the pump stops with it."""
    def broken() -> bool:
        raise RuntimeError("injected in collect")

    loop._complete = broken  # type: ignore[method-assign]
    errors: list[str] = []
    taken = loop.start(1, 1, 0, len(BLOB), lambda blob, error: errors.append(str(error)), ahead=True)
    loop.collect()
    await trio.sleep(0.05)  # the pump, started with that request, meets the failure and ends without a word
    return {"bug in collect": (taken, errors, loop.start(1, 1, 0, len(BLOB), lambda blob, error: None))}


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
        ring_reply = bell.ring_reply

        def ring_reply_unless_lost(peer: int) -> None:
            if rings_to_lose:
                rings_to_lose.pop()
            else:
                ring_reply(peer)

        bell.ring_reply = ring_reply_unless_lost  # type: ignore[method-assign]
    transport = PeerTransport(comm, serve, PeerOptions(timeout=TIMEOUT, retry_after=RETRY_AFTER,
                                                       max_in_flight=CAP), bell)
    transport.start()
    if rank == 0:
        loop = LoopRequests(transport, bell)
        seen = trio.run(rank_0, loop, transport, bell)
        time.sleep(STALL)  # the stalled peer answers meanwhile: its late replies reach the MPI thread
        seen.update(trio.run(rank_0_meets_a_bug, loop))
        seen.update(trio.run(rank_0_meets_a_bug_in_collect, LoopRequests(transport, bell)))
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
