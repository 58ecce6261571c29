"""A node's staged copy of its chunks, with DEST behind it for what is found damaged there, and how a rank's reads
are sent by the placement: its own blobs to that copy, the others to a remote path, all of a chunk staged with a
fault to DEST. The mount's source (sources.py) and a PyTorch reader's (node_client.py) differ only in the remote
path."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Sequence

from ..core.chunk_source import ChunkSource, LocalChunkSource
from ..errors import ChunkCorrupt, ChunkError, ChunkUnavailable
from .placement import ChunkOwners

log = logging.getLogger("fanstore.serve")


def not_in_dataset(chunk_id: int, chunk_count: int) -> ChunkUnavailable:
    """The error of a read that names a chunk the placement does not know (a chunk id never is an index into it
    unchecked: -1 would read as the last chunk, past the end as an IndexError)."""
    return ChunkUnavailable(f"chunk {chunk_id} is not in the dataset (chunks 0 to {chunk_count - 1})",
                            chunk_id=chunk_id)


class StagedChunkSource(ChunkSource):
    """This node's staged copy of its chunks, with DEST behind it. Staging verified every blob, but node-local
    storage can still be damaged while the job runs: a blob whose copy here cannot be read (its file gone,
    unreadable or short) or fails its checksum (which the reader checks, then asks read_other_copy) is read from
    DEST instead, and the damage is logged once per chunk. A blob damaged in DEST too is corrupt, as anywhere."""

    def __init__(self, staged: LocalChunkSource, dest: ChunkSource, rank: int) -> None:
        self._staged = staged
        self._dest = dest
        self._rank = rank
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.dest_reads = 0  # blobs read from DEST because the copy here is damaged
        self.dest_bytes = 0

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        try:
            return self._staged.read(chunk_id, offset, length)
        except ChunkError as exc:
            if self._closed:
                raise  # closed, not damaged: nothing to read from DEST either
            self.report_damaged(chunk_id, str(exc), isinstance(exc, ChunkCorrupt))
        return self._from_dest(chunk_id, offset, length)

    def read_staged_into(self, chunk_id: int, offset: int, length: int, out: memoryview) -> None:
        """The copy here alone, into `out`, for a peer's reply (the MPI thread must never wait on DEST; the peer
        reads DEST itself)."""
        try:
            self._staged.read_into(chunk_id, offset, length, out)
        except ChunkError as exc:
            if not self._closed:  # closed, not damaged: a peer asking as the rank ends is no damage to report
                self.report_damaged(chunk_id, str(exc), isinstance(exc, ChunkCorrupt))
            raise

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        if self._closed:
            raise ChunkUnavailable(f"{self.path(chunk_id)}: chunk {chunk_id}: the node's copy is closed",
                                   chunk_id=chunk_id)
        self.report_damaged(chunk_id, f"{self.path(chunk_id)}: a blob at offset {offset} fails its checksum")
        return self._from_dest(chunk_id, offset, length)

    def path(self, chunk_id: int) -> Path:
        return self._staged.path(chunk_id)

    def report_damaged(self, chunk_id: int, what: str, damaged: bool = True) -> None:
        """Once per chunk. `damaged` False: the copy could not be read (too many open files, a disk error), which
        says nothing of its bytes."""
        with self._lock:
            if chunk_id in self._reported:
                return
            self._reported.add(chunk_id)
        log.warning("rank %d: %s: this node's copy of chunk %d %s; what fails of it is read from DEST", self._rank,
                    what, chunk_id, "is damaged" if damaged else "could not be read")

    def _from_dest(self, chunk_id: int, offset: int, length: int) -> bytes:
        data = self._dest.read(chunk_id, offset, length)
        with self._lock:
            self.dest_reads += 1
            self.dest_bytes += length
        return data

    def close(self) -> None:
        """Closes the copy and DEST behind it (a source given to others too closes once: a second close does
        nothing): a read after it is ChunkUnavailable, not a damaged copy read from DEST."""
        self._closed = True
        self._staged.close()
        self._dest.close()


class PlacedReads(ChunkSource):
    """Sends each read where the placement puts its blob: this rank's staged copy, or `remote`; a chunk staged with
    a fault (`direct`) is read from DEST, whatever it gives."""

    def __init__(self, rank: int, placement: ChunkOwners, local: StagedChunkSource, remote: ChunkSource,
                 dest: ChunkSource, direct: set[int] | frozenset[int]) -> None:
        self._rank = rank
        self._placement = placement
        self._local = local
        self._remote = remote
        self._dest = dest
        self._direct = frozenset(direct)
        self._chunk_count = len(placement)

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        if not 0 <= chunk_id < self._chunk_count:
            raise not_in_dataset(chunk_id, self._chunk_count)
        if chunk_id in self._direct:
            return self._read_direct(chunk_id, offset, length)
        if self._placement.is_local(self._rank, chunk_id, offset):
            return self._read_local(chunk_id, offset, length)
        return self._remote.read(chunk_id, offset, length)

    def _read_local(self, chunk_id: int, offset: int, length: int) -> bytes:
        return self._local.read(chunk_id, offset, length)

    def _read_direct(self, chunk_id: int, offset: int, length: int) -> bytes:
        return self._dest.read(chunk_id, offset, length)

    def read_many(self, blobs: Sequence[tuple[int, int, int]]) -> list[bytes | memoryview | ChunkError]:
        """The remote ones among `blobs` asked of `remote` together; the others read here, one by one."""
        results: list[bytes | memoryview | ChunkError | None] = [None] * len(blobs)
        remote = [number for number, (chunk_id, offset, _) in enumerate(blobs) if self._from_peer(chunk_id, offset)]
        for number, result in zip(remote, self._remote.read_many([blobs[number] for number in remote])):
            results[number] = result
        for number, blob in enumerate(blobs):
            if results[number] is None:
                try:
                    results[number] = self.read(*blob)
                except ChunkError as exc:
                    results[number] = exc
        return results  # type: ignore[return-value]

    def _from_peer(self, chunk_id: int, offset: int) -> bool:
        """Whether a read of the blob at `offset` of `chunk_id` goes to `remote`."""
        return 0 <= chunk_id < self._chunk_count and not (
            chunk_id in self._direct or self._placement.is_local(self._rank, chunk_id, offset))

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        if not 0 <= chunk_id < self._chunk_count:
            raise not_in_dataset(chunk_id, self._chunk_count)
        if chunk_id in self._direct:
            return super().read_other_copy(chunk_id, offset, length)  # DEST's was the only one
        if self._placement.is_local(self._rank, chunk_id, offset):
            return self._local.read_other_copy(chunk_id, offset, length)
        return self._remote.read_other_copy(chunk_id, offset, length)

    def close(self) -> None:
        self._local.close()
        self._remote.close()
