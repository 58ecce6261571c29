"""Run by tests/test_serve_source_contract.py under `mpiexec -n 2`: the exact-blob ChunkSource contract
(tests/chunk_source_contract.py) against a rank's serve sources, over real MPI.

Both ranks stage their share of DEST (Stager) and run a PeerTransport serving peers from the staged copy
(RequestChecker), with doorbells, as `fanstore serve` does. Rank 0 then runs every test of the contract, without
pytest, against PeerChunkSource (rank 1's blobs alone: ALL_BLOBS is False, its own blobs are ChunkUnavailable) and
PlacedChunkSource (the mount's source under serve: its staged copy, rank 1, DEST behind both), each source made
afresh for each test, and checks that rank 1, not DEST, gave rank 1's blobs. Rank 1 serves until rank 0 is done.
Each rank prints one JSON line: rank 0, by source and test, "ok" or the failure's traceback.

    mpiexec -n 2 python serve_source_contract.py DEST WORKDIR
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import mpi4py

mpi4py.rc.thread_level = "multiple"  # as `fanstore serve` asks: readers post their own requests to peers
from mpi4py import MPI  # noqa: E402

from chunk_source_contract import ExactBlobContract, contract_checks, dataset_blobs  # noqa: E402
from fanstore.core.chunk_source import ChunkSource, LocalChunkSource  # noqa: E402
from fanstore.core.index import Index  # noqa: E402
from fanstore.errors import say_line  # noqa: E402
from fanstore.serve.doorbell import open_doorbell  # noqa: E402
from fanstore.serve.node import RequestChecker  # noqa: E402
from fanstore.serve.placement import NO_OWNER, ChunkOwners, place  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.sources import PeerChunkSource, PlacedChunkSource  # noqa: E402
from fanstore.serve.staged_source import StagedChunkSource  # noqa: E402
from fanstore.serve.staging import Stager  # noqa: E402
from fanstore.serve.transport import PeerOptions, PeerTransport  # noqa: E402

PEER_TIMEOUT = 20.0  # a deadline no loaded machine misses: a missed one would skip rank 1 and fail the checks


class PeerContract(ExactBlobContract):
    """PeerChunkSource serves the blobs other ranks store, and reads them without waiting (start_read)."""

    ALL_BLOBS = False
    STARTS_READS = True

    def __init__(self, owners: ChunkOwners, rank: int) -> None:
        self.owners, self.rank = owners, rank

    def serves(self, chunk_id: int, offset: int) -> bool:
        return self.owners.owner(chunk_id, offset) not in (self.rank, NO_OWNER)


class PlacedContract(ExactBlobContract):
    """PlacedChunkSource serves every blob, and starts the reads of the blobs its peers store."""

    STARTS_READS = True


def run_contract(contract: ExactBlobContract, dataset: Path, make_source: Callable[[], ChunkSource]) -> \
        dict[str, str]:
    """Each test of the contract, in order: "ok", or what failed (a pytest failure is a BaseException)."""
    results = {}
    for name in contract_checks(type(contract)):
        try:
            getattr(contract, name)(dataset, make_source)
        except BaseException as exc:  # noqa: BLE001 - reported, and the other tests still run
            results[name] = "".join(traceback.format_exception(exc))[-4000:]
        else:
            results[name] = "ok"
    return results


def answered_by_the_peer(transport: PeerTransport, make_placed: Callable[[], PlacedChunkSource],
                         remote: list[tuple[int, int, int]]) -> str:
    """Rank 1's blobs read through PlacedChunkSource came from rank 1, none from DEST: the contract alone would
    pass on DEST behind the peer."""
    fetched_before = transport.counters[1].fetched
    with make_placed() as source:
        for blob in remote:
            source.read(*blob)
        source.read_many(remote)
        fallback = source.counters.fallback
    fetched = transport.counters[1].fetched - fetched_before
    return "ok" if (fallback, fetched) == (0, 2 * len(remote)) else f"fallback {fallback}, fetched {fetched}"


def main(dest: Path, workdir: Path) -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    index = Index.load(dest)
    placement = place(index, comm.Get_size())
    blobs = placement.blobs
    sizes = index.chunks["size"]
    local_dir = workdir / f"local{rank}"
    Stager(comm, index, placement, dest, local_dir).run()
    bell = open_doorbell(comm)
    served_dest = LocalChunkSource(dest, sizes)
    staged = StagedChunkSource(LocalChunkSource(local_dir, sizes), served_dest, rank)
    transport = PeerTransport(comm, RequestChecker(rank, placement, blobs, staged, len(sizes), set()),
                              PeerOptions(timeout=PEER_TIMEOUT), bell)
    transport.start()
    seen: dict[str, Any] = {"rank": rank}
    if rank == 0:
        owners = placement.owners

        def make_peers() -> PeerChunkSource:
            return PeerChunkSource(transport, owners)

        def make_placed() -> PlacedChunkSource:
            dest_source = LocalChunkSource(dest, sizes)
            return PlacedChunkSource(rank, owners, StagedChunkSource(LocalChunkSource(local_dir, sizes),
                                                                     dest_source, rank),
                                     PeerChunkSource(transport, owners), dest_source)

        remote = [blob for blob in dataset_blobs(dest) if owners.owner(blob[0], blob[1]) == 1]
        seen["blobs"] = {"of rank 1": len(remote), "all": len(blobs)}
        seen["contract"] = {
            "PeerChunkSource": run_contract(PeerContract(owners, rank), dest, make_peers),
            "PlacedChunkSource": {**run_contract(PlacedContract(), dest, make_placed),
                                  "answered_by_the_peer": answered_by_the_peer(transport, make_placed, remote)},
        }
    transport.collective(lambda comm: (comm.Ibarrier(), lambda: None)).result()  # rank 0 is done asking
    seen["served"] = transport.counters[1 - rank].served
    transport.stop()
    if bell is not None:
        bell.close()
    staged.close()
    wait_all([comm.Ibarrier()])
    comm.Free()
    say_line(json.dumps(seen), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
