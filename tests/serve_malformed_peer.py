"""Run by tests/test_serve.py under `mpiexec -n 3`: rank 2 sends rank 0 malformed requests, by hand.

Ranks 0 and 1 stage and serve as `fanstore serve` does (Stager, PeerTransport, RequestChecker); rank 2 stages too,
then, from its main thread, sends rank 0 every kind of bad request and good ones, for one blob and for several.
Afterwards ranks 0 and 1 must still serve each other. Every rank prints one JSON line of what it saw.

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

from fanstore.core.chunk_source import LocalChunkSource  # noqa: E402
from fanstore.errors import say_line  # noqa: E402
from fanstore.core.index import Index  # noqa: E402
from fanstore.serve.node import RequestChecker  # noqa: E402
from fanstore.serve.placement import BlobTable, place  # noqa: E402
from fanstore.serve.polling import wait_all  # noqa: E402
from fanstore.serve.staged_source import StagedChunkSource  # noqa: E402
from fanstore.serve.staging import Stager  # noqa: E402
from fanstore.serve.peer_messages import FIRST_REPLY_TAG, MAX_BLOBS, MORE_BLOB, REPLY_HEADER, REPLY_MAGIC, \
    REQUEST, REQUEST_MAGIC, TAG_REQUEST  # noqa: E402
from fanstore.serve.statuses import Status  # noqa: E402
from fanstore.serve.transport import PeerOptions, PeerTransport  # noqa: E402


def blobs_owned_by(placement, blobs: BlobTable, rank: int) -> list[tuple[int, int, int, int]]:
    """The blobs `rank` stores, largest first."""
    owned = [(chunk, offset, length, checksum) for chunk, offset, length, checksum
             in zip(blobs.chunk.tolist(), blobs.offset.tolist(), blobs.stored_len.tolist(), blobs.checksum.tolist())
             if placement.owner(chunk, offset) == rank]
    if len(owned) < 2:
        raise SystemExit(f"fewer than two blobs are stored on rank {rank}")
    return sorted(owned, key=lambda blob: -blob[2])


def reply_limit(placement, blobs: BlobTable) -> int:
    """Rank 0's max_reply_bytes: three of its largest blobs, so that four of them in one request are too many."""
    return 3 * blobs_owned_by(placement, blobs, 0)[0][2]


def request(tag: int, *blobs: tuple[int, int, int]) -> bytes:
    """A request for one blob, or for several (the first in the header, the others after it)."""
    (chunk, offset, length), more = blobs[0], blobs[1:]
    return REQUEST.pack(REQUEST_MAGIC, tag, chunk, 0, offset, length) + b"".join(MORE_BLOB.pack(*blob) for blob in more)


def attack(comm, placement, blobs: BlobTable, sizes: list[int]) -> dict[str, object]:
    owned = blobs_owned_by(placement, blobs, 0)
    (chunk, offset, length, checksum), second = owned[0], owned[-1]
    good, other = (chunk, offset, length), blobs_owned_by(placement, blobs, 1)[0][:3]
    answered = {  # name: (the blobs asked, reply expected)
        "unknown chunk": ([(10**6, 0, 10)], Status.REFUSED),
        "chunk of another rank": ([other], Status.REFUSED),
        "inside a blob": ([(chunk, offset + 1, length - 1)], Status.REFUSED),
        "past the chunk": ([(chunk, sizes[chunk] - 4, 1 << 40)], Status.REFUSED),
        "the header": ([(chunk, 0, 32)], Status.REFUSED),
        "a bad blob after good ones": ([good, second[:3], (chunk, offset + 1, length - 1)], Status.REFUSED),
        "a good one": ([good], Status.OK),
        "several good ones": ([good, second[:3], good], Status.OK),
        "several, too many bytes": ([good] * 4, Status.REFUSED),
    }
    expected_bytes = {"a good one": [checksum], "several good ones": [checksum, second[3], checksum]}
    too_many = [good] * (MAX_BLOBS + 1)
    dropped = {
        "short": (b"xx", TAG_REQUEST),
        "bad magic": (b"XXXX" + request(FIRST_REPLY_TAG, good)[4:], TAG_REQUEST),
        "reply tag 0": (request(0, good), TAG_REQUEST),
        "unknown tag": (request(FIRST_REPLY_TAG, good), 7),
        "a blob cut short": (request(FIRST_REPLY_TAG, good, good)[:-3], TAG_REQUEST),
        "too many blobs": (request(FIRST_REPLY_TAG, *too_many), TAG_REQUEST),
    }
    requests, replies = [], {}
    for name, (message, tag) in dropped.items():
        requests.append(comm.Isend([message, MPI.BYTE], dest=0, tag=tag))
    for number, (name, (asked, _)) in enumerate(answered.items()):
        tag = FIRST_REPLY_TAG + 1000 + number
        buffer = bytearray(REPLY_HEADER.size + sum(blob[2] for blob in asked) if name in expected_bytes else 4096)
        replies[name] = buffer
        requests.append(comm.Irecv([buffer, MPI.BYTE], source=0, tag=tag))
        requests.append(comm.Isend([request(tag, *asked), MPI.BYTE], dest=0, tag=TAG_REQUEST))
    wait_all(requests, deadline=time.monotonic() + 30, what="replies from rank 0")
    seen = {}
    for name, (asked, expected) in answered.items():
        magic, status = REPLY_HEADER.unpack_from(replies[name])
        good_reply = magic == REPLY_MAGIC and status == expected
        if name in expected_bytes:
            start = REPLY_HEADER.size
            for (_, _, size), blob_checksum in zip(asked, expected_bytes[name]):
                good_reply = good_reply and xxhash.xxh3_64_intdigest(replies[name][start : start + size]) == blob_checksum
                start += size
        seen[name] = "as expected" if good_reply else f"status {status}"
    return seen


def main(dest: Path, workdir: Path) -> None:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    index = Index.load(dest)
    placement = place(index, comm.Get_size())
    blobs = placement.blobs
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
                              PeerOptions(timeout=10, max_reply_bytes=reply_limit(placement, blobs)))
    transport.start()
    transport.collective(lambda c: (c.Ibarrier(), lambda: None)).result()
    chunk, offset, length, checksum = blobs_owned_by(placement, blobs, 1 - rank)[0]
    fetched = transport.fetch(1 - rank, chunk, offset, length)
    transport.collective(lambda c: (c.Ibarrier(), lambda: None)).result()
    transport.stop()
    counters = transport.counters[2]
    say_line(json.dumps({"rank": rank, "peer_served": xxhash.xxh3_64_intdigest(fetched) == checksum,
                         "refused_from_2": counters.refused, "served_to_2": counters.served}), sys.stdout)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
