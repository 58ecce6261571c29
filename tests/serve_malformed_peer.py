"""Run by tests/test_serve.py under `mpiexec -n 3`: rank 2 sends rank 0 malformed requests, by hand.

Ranks 0 and 1 stage and serve as `fanstore serve` does (Stager, PeerTransport, RequestChecker); rank 2 stages too,
then, from its main thread, sends rank 0 every kind of bad request and one good one. Afterwards ranks 0 and 1 must
still serve each other. Every rank prints one JSON line of what it saw.

    mpiexec -n 3 python serve_malformed_peer.py DEST WORKDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mpi4py

mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402
import xxhash  # noqa: E402

from fanstore.chunk_source import LocalChunkSource  # noqa: E402
from fanstore.errors import say_line  # noqa: E402
from fanstore.index import Index  # noqa: E402
from fanstore.serve.node import RequestChecker  # noqa: E402
from fanstore.serve.placement import BlobTable, place  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.staged_source import StagedChunkSource  # noqa: E402
from fanstore.serve.staging import Stager  # noqa: E402
from fanstore.serve.transport import FIRST_REPLY_TAG, OK, REFUSED, REPLY_HEADER, REPLY_MAGIC, REQUEST, \
    REQUEST_MAGIC, TAG_REQUEST, PeerOptions, PeerTransport  # noqa: E402


def blob_owned_by(placement, blobs: BlobTable, rank: int) -> tuple[int, int, int, int]:
    for chunk, offset, length, checksum in zip(blobs.chunk.tolist(), blobs.offset.tolist(),
                                               blobs.stored_len.tolist(), blobs.checksum.tolist()):
        if placement.owner(chunk, offset) == rank:
            return chunk, offset, length, checksum
    raise SystemExit(f"no blob is stored on rank {rank}")


def attack(comm, placement, blobs: BlobTable, sizes: list[int]) -> dict[str, object]:
    chunk, offset, length, checksum = blob_owned_by(placement, blobs, 0)
    other = blob_owned_by(placement, blobs, 1)
    answered = {  # name: (request fields, reply expected)
        "unknown chunk": ((10**6, 0, 10), REFUSED),
        "chunk of another rank": ((other[0], other[1], other[2]), REFUSED),
        "inside a blob": ((chunk, offset + 1, length - 1), REFUSED),
        "past the chunk": ((chunk, sizes[chunk] - 4, 1 << 40), REFUSED),
        "the header": ((chunk, 0, 32), REFUSED),
        "a good one": ((chunk, offset, length), OK),
    }
    dropped = {
        "short": (b"xx", TAG_REQUEST),
        "bad magic": (REQUEST.pack(b"XXXX", FIRST_REPLY_TAG, chunk, 0, offset, length), TAG_REQUEST),
        "reply tag 0": (REQUEST.pack(REQUEST_MAGIC, 0, chunk, 0, offset, length), TAG_REQUEST),
        "unknown tag": (REQUEST.pack(REQUEST_MAGIC, FIRST_REPLY_TAG, chunk, 0, offset, length), 7),
    }
    requests, replies = [], {}
    for name, (message, tag) in dropped.items():
        requests.append(comm.Isend([message, MPI.BYTE], dest=0, tag=tag))
    for number, (name, ((c, o, n), _)) in enumerate(answered.items()):
        tag = FIRST_REPLY_TAG + 1000 + number
        buffer = bytearray(REPLY_HEADER.size + (n if name == "a good one" else 4096))
        replies[name] = buffer
        requests.append(comm.Irecv([buffer, MPI.BYTE], source=0, tag=tag))
        requests.append(comm.Isend([REQUEST.pack(REQUEST_MAGIC, tag, c, 0, o, n), MPI.BYTE], dest=0, tag=TAG_REQUEST))
    wait_all(requests, deadline=time.monotonic() + 30, what="replies from rank 0")
    seen = {}
    for name, (_, expected) in answered.items():
        magic, status = REPLY_HEADER.unpack_from(replies[name])
        good = magic == REPLY_MAGIC and status == expected
        if name == "a good one":
            good = good and xxhash.xxh3_64_intdigest(replies[name][REPLY_HEADER.size:]) == checksum
        seen[name] = "as expected" if good else f"status {status}"
    return seen


def main(dest: Path, workdir: Path) -> None:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    index = Index.load(dest)
    placement = place(index, comm.Get_size())
    blobs = BlobTable.of(index)
    sizes = [int(size) for size in index.chunks["size"]]
    local_dir = workdir / f"local{rank}"
    Stager(comm, index, placement, dest, local_dir).run()
    if rank == 2:
        seen = attack(comm, placement, blobs, sizes)
        wait_all([comm.Ibarrier()])  # the attack is over
        wait_all([comm.Ibarrier()])  # ranks 0 and 1 have served each other
        say_line(json.dumps({"rank": 2, "replies": seen}), sys.stdout)
        return
    local = StagedChunkSource(LocalChunkSource(local_dir, sizes), LocalChunkSource(dest, sizes), rank)
    transport = PeerTransport(comm, RequestChecker(rank, placement, blobs, local, len(sizes), set()),
                              PeerOptions(timeout=10))
    transport.start()
    transport.collective(lambda c: (c.Ibarrier(), lambda: None)).result()
    chunk, offset, length, checksum = blob_owned_by(placement, blobs, 1 - rank)
    fetched = transport.fetch(1 - rank, chunk, offset, length)
    transport.collective(lambda c: (c.Ibarrier(), lambda: None)).result()
    transport.stop()
    counters = transport.counters[2]
    say_line(json.dumps({"rank": rank, "peer_served": xxhash.xxh3_64_intdigest(fetched) == checksum,
                         "refused_from_2": counters.refused, "served_to_2": counters.served}), sys.stdout)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
