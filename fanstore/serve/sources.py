"""The chunk sources of a rank under `fanstore serve`: its local directory, its peers, and DEST behind them.

    PlacedChunkSource -> StagedChunkSource(local directory -> blobs this rank stores, replicated ones included,
                                           DEST            -> for a blob whose staged copy is found damaged)
                      -> FallbackChunkSource(PeerChunkSource -> the owning rank over MPI,
                                             DEST            -> when the peer is skipped, misses its deadline or
                                                                cannot give the blob, or what it gave fails its
                                                                checksum: once, then the blob is corrupt)

The read path above them (Reader, cache, mount, API) is the single-node one; it never knows which answered.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from ..core.chunk_source import BlobRead, ChunkSource, FallbackChunkSource, ReadDone
from ..errors import ChunkCorrupt, ChunkError, ChunkUnavailable
from .placement import NO_OWNER, ChunkOwners
from .staged_source import PlacedReads, StagedChunkSource, not_in_dataset
from .peer_messages import MAX_BLOBS
from .transport import PeerTransport

log = logging.getLogger("fanstore.serve")

# Bytes of blobs one request asks for at most (a larger blob goes alone): the first file of a batch waits for the
# whole reply, and the serving rank holds it twice while it builds it.
BATCH_BYTES = 4 << 20


def batches(reads: Sequence[BlobRead], limit: int = BATCH_BYTES) -> list[list[BlobRead]]:
    """`reads` in order, cut into requests of at most MAX_BLOBS blobs and `limit` bytes (or one larger blob)."""
    cut: list[list[BlobRead]] = []
    batch: list[BlobRead] = []
    size = 0
    for read in reads:
        if batch and (len(batch) == MAX_BLOBS or size + read.length > limit):
            cut.append(batch)
            batch, size = [], 0
        batch.append(read)
        size += read.length
    if batch:
        cut.append(batch)
    return cut


class PeerChunkSource(ChunkSource):
    """Blobs stored on other ranks, asked of their owner over the transport (the node's, which outlives this source:
    close stops this source's reads, not the transport)."""

    def __init__(self, transport: PeerTransport, placement: ChunkOwners) -> None:
        self.transport = transport
        self._remote = transport.remote  # every request to a peer goes through this rank's one state machine
        self._placement = placement
        self._rank = transport.rank
        self._chunk_count = len(placement)
        self._closed = False

    def _owner(self, chunk_id: int, offset: int) -> int:
        """The other rank that stores the blob, or NO_OWNER (this rank's, a replicated one, or no chunk of the
        dataset): those are not this source's to read."""
        if self._closed or not 0 <= chunk_id < self._chunk_count:
            return NO_OWNER
        owner = self._placement.owner(chunk_id, offset)
        return NO_OWNER if owner == self._rank else owner

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        owner = self._owner(chunk_id, offset)
        if owner == NO_OWNER:
            if self._closed:
                raise ChunkUnavailable(f"chunk {chunk_id}: the peers' source is closed", chunk_id=chunk_id)
            if not 0 <= chunk_id < self._chunk_count:
                raise not_in_dataset(chunk_id, self._chunk_count)
            raise ChunkUnavailable(f"chunk {chunk_id} at {offset} is not stored by another rank", chunk_id=chunk_id)
        return self.transport.fetch(owner, chunk_id, offset, length)

    def start_read(self, chunk_id: int, offset: int, length: int, done: ReadDone, ahead: bool = False) -> bool:
        owner = self._owner(chunk_id, offset)
        if owner == NO_OWNER:
            return False
        self._remote.ask(owner, (BlobRead(chunk_id, offset, length, done),), hand_over=ahead)
        return True

    def start_reads(self, reads: Sequence[BlobRead], ahead: bool = False) -> list[bool]:
        """The blobs of each owner among `reads` in as few requests as `batches` allows."""
        started = [False] * len(reads)
        by_owner: dict[int, list[BlobRead]] = {}
        owner_of = self._owner
        for number, read in enumerate(reads):
            owner = owner_of(read.chunk_id, read.offset)
            if owner != NO_OWNER:
                by_owner.setdefault(owner, []).append(read)
                started[number] = True
        for owner, owned in by_owner.items():
            for batch in batches(owned):
                self._remote.ask(owner, batch, hand_over=ahead)
        return started

    def close(self) -> None:
        self._closed = True

    def may_block(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return np.ones(len(chunks), dtype=bool)


@dataclass
class SourceCounters:
    """Reads of this rank by where their stored bytes came from (peers are counted by the transport)."""

    local: int = 0
    local_bytes: int = 0
    fallback: int = 0  # blobs read from DEST: their peer could not give them or its copy is damaged, or ours is
    fallback_bytes: int = 0


class PlacedChunkSource(PlacedReads):
    """The mount's source under serve: this rank's staged copy, or its peers with DEST behind them (PlacedReads);
    counts where each read went, and logs once per chunk a peer's copy found damaged (by the peer, or by this
    rank's checksum of what it sent)."""

    def __init__(self, rank: int, placement: ChunkOwners, local: StagedChunkSource, peers: PeerChunkSource,
                 dest: ChunkSource, direct: set[int] | frozenset[int] = frozenset()) -> None:
        self._fallback = FallbackChunkSource(peers, dest, on_fallback=self._count_fallback)
        super().__init__(rank, placement, local, self._fallback, dest, direct)
        self._peers = peers
        self.counters = SourceCounters()
        self._lock = threading.Lock()
        self._damaged_on_peers: set[int] = set()  # chunks whose damage on a peer is logged

    def _read_local(self, chunk_id: int, offset: int, length: int) -> bytes:
        data = self._local.read(chunk_id, offset, length)
        with self._lock:
            self.counters.local += 1
            self.counters.local_bytes += length
        return data

    def start_read(self, chunk_id: int, offset: int, length: int, done: ReadDone, ahead: bool = False) -> bool:
        """The peer alone: if it cannot give the blob, the caller's `read` goes through the fallback to DEST."""
        return self._from_peer(chunk_id, offset) and self._peers.start_read(chunk_id, offset, length, done, ahead)

    def start_reads(self, reads: Sequence[BlobRead], ahead: bool = False) -> list[bool]:
        started = [False] * len(reads)
        remote = [number for number, read in enumerate(reads) if self._from_peer(read.chunk_id, read.offset)]
        for number, ok in zip(remote, self._peers.start_reads([reads[number] for number in remote], ahead)):
            started[number] = ok
        return started

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        # The peer sent what its copy holds: that copy is damaged. Unless the peer could not give the blob, and
        # these bytes were DEST's (damaged there: the fallback says so).
        if self._from_peer(chunk_id, offset) and not self._fallback.gave(chunk_id, offset):
            self._report_damaged_on_peer(chunk_id, f"rank {self._placement.owner(chunk_id, offset)} sent chunk "
                                                   f"{chunk_id} at {offset}, which fails its checksum")
        return super().read_other_copy(chunk_id, offset, length)

    def _count_fallback(self, reason: ChunkError, length: int) -> None:
        with self._lock:
            self.counters.fallback += 1
            self.counters.fallback_bytes += length
        if isinstance(reason, ChunkCorrupt):
            self._report_damaged_on_peer(reason.chunk_id, str(reason))

    def _report_damaged_on_peer(self, chunk_id: int, what: str) -> None:
        with self._lock:
            if chunk_id in self._damaged_on_peers:
                return
            self._damaged_on_peers.add(chunk_id)
        log.warning("rank %d: %s; what fails of chunk %d is read from DEST", self._rank, what, chunk_id)

    def may_block(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """_from_peer of every blob, in numpy (asked once per dataset, for every file)."""
        owners = self._placement.owners_of(chunks, offsets)
        here = (owners == self._rank) | (owners == NO_OWNER)
        if self._direct:
            here |= np.isin(np.asarray(chunks, dtype=np.int64), np.fromiter(self._direct, dtype=np.int64))
        return ~here

    def stats(self) -> dict[str, Any]:
        """Reads by where they came from: this rank's directory, each peer, DEST when a peer could not answer."""
        with self._lock:
            counters = asdict(self.counters)
        # A blob of this rank's own whose copy here is damaged was read from DEST, not locally.
        damaged, damaged_bytes = self._local.dest_reads, self._local.dest_bytes
        counters["local"] -= damaged
        counters["local_bytes"] -= damaged_bytes
        counters["fallback"] += damaged
        counters["fallback_bytes"] += damaged_bytes
        counters["peers"] = {str(peer): asdict(peer_counters) for peer, peer_counters
                             in enumerate(self._peers.transport.peer_counters()) if peer != self._rank}
        return counters
