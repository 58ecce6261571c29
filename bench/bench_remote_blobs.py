"""bench_remote_blobs: which thread should drive the requests for remote blobs, the mount's event loop or the MPI
thread? Measured as CPU of the reading rank per remote blob.

Under `mpiexec -n 2`, both ranks run a PeerTransport with doorbells, as `fanstore serve` does. Rank 1 serves one
made-up blob of BLOB_BYTES (a 128 KiB lz4 file is stored in about 56 KiB) from memory. Rank 0 reads an epoch of
FILES blobs from a trio loop, as the mount does, each read waiting for its blob (fuse_ops' _Fetching), in the
ways given by --ways (by default every one, by turns, ROUNDS times):

  ahead-*   a window of WINDOW blobs is fetched ahead of the reader, half a window in one request at a time, as
            fuse_ops' _fetch_ahead did with --prefetch-list (the node's holder, serve/blobs_ahead.py, does it now,
            from its own thread);
  one-*     one request per read, none ahead (--prefetch 0);
  *-posted  posted by the loop (RemoteBlobs.ask), driven by the MPI thread: it completes each reply and calls
            back, which wakes the loop only where a read waits;
  *-handed  handed to the MPI thread, which posts and drives it (RemoteBlobs.ask(hand_over=True)).

`fanstore serve` posts a request a read waits for where it is asked (one-posted) and hands over the blobs fetched
ahead (ahead-handed), where MPI gives MPI_THREAD_MULTIPLE; under MPI_THREAD_SERIALIZED (--mpi-thread-only) it hands
every request over.

This file's first version compared the two requesters RemoteBlobs replaced: loop_requests.py (the loop posting and
completing) and the transport's MPI thread; an intermediate RemoteBlobs could also be driven by the loop (a pump on
the reply bell). Their figures are in remote_blobs.py's docstring.

CPU is rank 0's process CPU-time clock (every thread: the loop's and the MPI thread's) over the epoch, divided
by FILES; the loop thread's own share is its thread CPU clock. Placement: rank 0 on CPU 0, rank 1 on CPU 1
(each stands for a node), when the machine has two CPUs or more. Figures print per round, then the median.

    mpiexec -n 1 taskset -c 0 python bench/bench_remote_blobs.py : -n 1 taskset -c 1 python bench/bench_remote_blobs.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import mpi4py

mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402
import trio  # noqa: E402

from fanstore.core.chunk_source import BlobRead  # noqa: E402
from fanstore.serve.doorbell import open_doorbell  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.remote_blobs import RemoteBlobs  # noqa: E402
from fanstore.serve.transport import PeerOptions, PeerTransport  # noqa: E402

BLOB_BYTES = 56 * 1024
FILES = 20_000
WINDOW = 16
ROUNDS = 3
WAYS = ("ahead-posted", "ahead-handed", "one-posted", "one-handed")
BLOB = bytes(BLOB_BYTES)


class Server:
    """Rank 1's one blob, whatever is asked (transport.RequestServer)."""

    def check(self, peer: int, chunk: int, offset: int, length: int) -> None:
        pass

    def read_into(self, chunk: int, offset: int, length: int, out: memoryview) -> None:
        out[:] = BLOB


class Arrival:
    """A blob on its way to the loop: the loop is woken only if a read waits for it (fuse_ops' _Fetching)."""

    __slots__ = ("token", "loop_thread", "done", "waiter", "blob")

    def __init__(self, token: trio.lowlevel.TrioToken, loop_thread: int) -> None:
        self.token, self.loop_thread = token, loop_thread
        self.done, self.waiter, self.blob = False, None, None

    def arrive(self, blob: object, error: object = None) -> None:
        self.blob = blob
        self.done = True
        waiter = self.waiter
        if waiter is not None:
            if threading.get_ident() == self.loop_thread:
                waiter.set()
            else:
                self.token.run_sync_soon(waiter.set)

    async def wait(self) -> object:
        if not self.done:
            waiter = self.waiter = trio.Event()
            if not self.done:
                await waiter.wait()
        return self.blob


async def epoch(way: str, remote: RemoteBlobs, files: int) -> tuple[float, float]:
    """(process CPU us, loop thread CPU us) per blob over one epoch read `way`."""
    token, me = trio.lowlevel.current_trio_token(), threading.get_ident()
    ahead, hand_over = way.startswith("ahead"), way.endswith("handed")
    arrivals: dict[int, Arrival] = {}
    started = 0
    failures = 0
    process_0, thread_0 = time.process_time_ns(), time.thread_time_ns()
    for number in range(files):
        if ahead and started < min(files, number + WINDOW) and started - number <= WINDOW // 2:
            batch = range(started, min(files, started + WINDOW // 2))
            reads = []
            for key in batch:
                arrival = arrivals[key] = Arrival(token, me)
                reads.append(BlobRead(1, key * BLOB_BYTES, BLOB_BYTES, arrival.arrive))
            remote.ask(1, reads, hand_over=hand_over)
            started = batch[-1] + 1
        arrival = arrivals.pop(number, None)
        if arrival is None:
            arrival = Arrival(token, me)
            remote.ask(1, (BlobRead(1, number * BLOB_BYTES, BLOB_BYTES, arrival.arrive),), hand_over=hand_over)
            started = max(started, number + 1)
        if await arrival.wait() is None:
            failures += 1
    process_us = (time.process_time_ns() - process_0) / 1e3 / files
    thread_us = (time.thread_time_ns() - thread_0) / 1e3 / files
    if failures:
        raise RuntimeError(f"{way}: {failures} blobs failed")
    return process_us, thread_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=FILES)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    args = parser.parse_args()
    ways = args.ways.split(",")
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    bell = open_doorbell(comm)
    transport = PeerTransport(comm, Server(), PeerOptions(timeout=30.0, max_in_flight=8), bell)
    transport.start()
    if rank == 0:
        remote = transport.remote
        figures: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        trio.run(epoch, ways[0], remote, min(args.files, 2000))  # warm up
        for _ in range(args.rounds):
            for way in ways:
                figures[way].append(trio.run(epoch, way, remote, args.files))
        print(f"{args.files} blobs of {BLOB_BYTES} bytes from rank 1, {args.rounds} rounds by turns; "
              f"CPU us per blob of rank 0 (process / loop thread)")
        for way in ways:
            runs = "  ".join(f"{p:6.1f}/{t:5.1f}" for p, t in figures[way])
            print(f"  {way:11s} median {statistics.median(p for p, _ in figures[way]):6.1f} / "
                  f"{statistics.median(t for _, t in figures[way]):5.1f}   runs {runs}")
        print(json.dumps({way: figures[way] for way in ways}))
    transport.collective(lambda comm: (comm.Ibarrier(), lambda: None)).result()
    transport.stop()
    if bell is not None:
        bell.close()
    wait_all([comm.Ibarrier()])
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
