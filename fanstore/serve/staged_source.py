"""A node's staged copy of its chunks, with DEST behind it for what is found damaged there."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..chunk_source import ChunkSource, LocalChunkSource
from ..errors import ChunkError

log = logging.getLogger("fanstore.serve")


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
        self.dest_reads = 0  # blobs read from DEST because the copy here is damaged
        self.dest_bytes = 0

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        try:
            return self._staged.read(chunk_id, offset, length)
        except ChunkError as exc:
            self.report_damaged(chunk_id, str(exc))
        return self._from_dest(chunk_id, offset, length)

    def read_staged(self, chunk_id: int, offset: int, length: int) -> bytes:
        """The copy here alone, for a peer (the MPI thread must never wait on DEST; the peer reads DEST itself)."""
        try:
            return self._staged.read(chunk_id, offset, length)
        except ChunkError as exc:
            self.report_damaged(chunk_id, str(exc))
            raise

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        self.report_damaged(chunk_id, f"{self.path(chunk_id)}: a blob at offset {offset} fails its checksum")
        return self._from_dest(chunk_id, offset, length)

    def path(self, chunk_id: int) -> Path:
        return self._staged.path(chunk_id)

    def report_damaged(self, chunk_id: int, what: str) -> None:
        with self._lock:
            if chunk_id in self._reported:
                return
            self._reported.add(chunk_id)
        log.warning("rank %d: %s: this node's copy of chunk %d is damaged; what fails of it is read from DEST",
                    self._rank, what, chunk_id)

    def _from_dest(self, chunk_id: int, offset: int, length: int) -> bytes:
        data = self._dest.read(chunk_id, offset, length)
        with self._lock:
            self.dest_reads += 1
            self.dest_bytes += length
        return data

    def close(self) -> None:
        self._staged.close()
