"""Which node stores which bytes of a dataset: a deterministic function of the index and the node count, so every
rank of a job computes the same placement on its own, without a message (docs/SERVE.md, "Placement").

Replicated chunks go to every node. The other chunks' blob bytes, in chunk order, form one stream cut into N
consecutive ranges of nearly equal size at blob boundaries (at a chunk boundary when one is close): rank r stores
range r, whole chunks plus at most two partial ones. Cutting between blobs rather than between chunks is what keeps
the fullest node within a few percent of the mean when there are only a few chunks per node.
"""

from __future__ import annotations

import heapq
import numbers
import stat
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError, UsageError
from ..core.format import CHUNK_HEADER_LEN, FLAG_BLOCKED, NO_CHUNK

if TYPE_CHECKING:
    from ..core.index import Index

__all__ = ["MAX_NODES", "NO_OWNER", "BlobTable", "Piece", "Placement", "place"]

MAX_NODES = 4096
NO_OWNER = -1  # owner() of a replicated chunk: every node holds it
_SPLIT = -2  # marks a chunk stored in pieces on several nodes in the per-chunk owner list
# A cut moves to a chunk boundary that lies within 1/CHUNK_TOLERANCE of a node's share from the ideal cut.
CHUNK_TOLERANCE = 100
# Stream positions are int64 and cut arithmetic multiplies them by the node count in Python ints; a dataset this
# large (4 EiB) comes only from a crafted index.
_MAX_STREAM = 1 << 62


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, end) of one chunk file that one node stores. start is 0 when the piece begins at the chunk's
    first blob (the header is always staged with any piece), end is a blob boundary."""

    chunk: int
    start: int
    end: int


class BlobTable:
    """Every stored blob of a dataset (files stored whole and blocks alike) as four columns sorted by (chunk, offset):
    where placement may cut a chunk, and what staging checks each piece's bytes against."""

    __slots__ = ("chunk", "offset", "stored_len", "checksum", "_rows")

    def __init__(self, chunk: np.ndarray, offset: np.ndarray, stored_len: np.ndarray, checksum: np.ndarray,
                 chunk_count: int) -> None:
        order = np.lexsort((offset, chunk))
        self.chunk: np.ndarray = np.asarray(chunk, dtype=np.uint32)[order]
        self.offset: np.ndarray = np.asarray(offset, dtype=np.uint64)[order]
        self.stored_len: np.ndarray = np.asarray(stored_len, dtype=np.uint64)[order]
        self.checksum: np.ndarray = np.asarray(checksum, dtype=np.uint64)[order]
        # The blobs of chunk c are rows _rows[c] to _rows[c + 1].
        self._rows: list[int] = np.searchsorted(self.chunk, np.arange(chunk_count + 1, dtype=np.int64)).tolist()

    @classmethod
    def of(cls, index: Index) -> "BlobTable":
        """The blobs of an index: each regular file stored whole that has one (empty files have none), and every
        block of the files stored in blocks (those files' own entries locate only their first block)."""
        entries = index.entries
        whole = (((entries["mode"] & 0o170000) == stat.S_IFREG) & (entries["chunk"] != NO_CHUNK)
                 & ((entries["flags"] & FLAG_BLOCKED) == 0))
        files, blocks = entries[whole], index.blocks
        return cls(np.concatenate((files["chunk"], blocks["chunk"])),
                   np.concatenate((files["offset"], blocks["offset"])),
                   np.concatenate((files["stored_len"], blocks["stored_len"].astype(np.uint64))),
                   np.concatenate((files["checksum"], blocks["checksum"])), len(index.chunks))

    def __len__(self) -> int:
        return len(self.chunk)

    def blob_row(self, chunk: int, offset: int, length: int) -> int | None:
        """The row of the blob of `length` bytes at `offset` of `chunk`; None when no blob is exactly there (what a
        request from a peer or a local reader must name: never part of a blob, two blobs, or bytes between)."""
        if not 0 <= chunk < len(self._rows) - 1 or offset < 0:
            return None
        first, last = self._rows[chunk], self._rows[chunk + 1]
        row = first + int(self.offset[first:last].searchsorted(offset))  # one search: a peer's every blob comes here
        if row == last or self.offset[row] != offset or self.stored_len[row] != length or \
                (row + 1 < last and self.offset[row + 1] == offset):
            return None
        return row

    def in_range(self, chunk: int, start: int, end: int) -> slice:
        """Rows of the blobs of `chunk` that start in [start, end). For a Piece these are exactly the blobs it holds,
        each whole: placement cuts a chunk only where no blob spans the cut."""
        first, last = self._rows[chunk], self._rows[chunk + 1]
        offsets = self.offset[first:last]
        return slice(first + int(offsets.searchsorted(np.uint64(start))),
                     first + int(offsets.searchsorted(np.uint64(end))))


class ChunkOwners:
    """Which rank stores the blob at each (chunk, offset): all that a node's readers need of a placement. The serve
    process places the dataset once per node and hands this to its readers (HELLO), so that no DataLoader worker
    places it again (placing reads every blob of the index: seconds and a private copy at ten million files)."""

    __slots__ = ("nodes", "_owner", "_splits")

    def __init__(self, nodes: int, owner: list[int],
                 splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        self.nodes = nodes
        self._owner = owner  # per chunk: a rank, NO_OWNER (replicated) or _SPLIT; a list indexes faster than numpy
        self._splits = splits  # split chunk -> (its pieces' start offsets, their ranks)

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, chunk: int, offset: int) -> int:
        """The rank storing the blob at `offset` of `chunk`; NO_OWNER for a replicated chunk (every rank has it)."""
        rank = self._owner[chunk]
        if rank != _SPLIT:
            return rank
        starts, ranks = self._splits[chunk]
        return ranks[bisect_right(starts, offset) - 1]

    def owners_of(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """`owner` of many blobs at once, in numpy: a chunk's owner, and for the blobs of split chunks their piece's
        (one searchsorted per split chunk, of which there are fewer than nodes). For what is asked once per
        dataset (which files a node gets from peers): a Python call per blob is seconds at ten million."""
        chunks = np.asarray(chunks, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        owners = np.asarray(self._owner, dtype=np.int64)[chunks]
        split = np.flatnonzero(owners == _SPLIT)
        if len(split):
            order = split[np.argsort(chunks[split], kind="stable")]
            split_chunks, firsts = np.unique(chunks[order], return_index=True)
            for chunk, blobs in zip(split_chunks.tolist(), np.split(order, firsts[1:])):
                starts, ranks = self._splits[chunk]
                pieces = np.searchsorted(np.asarray(starts, dtype=np.int64), offsets[blobs], side="right") - 1
                owners[blobs] = np.asarray(ranks, dtype=np.int64)[pieces]
        return owners

    def is_local(self, rank: int, chunk: int, offset: int) -> bool:
        """Whether `rank` stores the blob at `offset` of `chunk`: it is replicated, or in one of the rank's pieces."""
        holder = self._owner[chunk]
        if holder == _SPLIT:
            starts, ranks = self._splits[chunk]
            holder = ranks[bisect_right(starts, offset) - 1]
        return holder == rank or holder == NO_OWNER

    def to_json(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "owner": self._owner,
                "splits": [[chunk, list(starts), list(ranks)] for chunk, (starts, ranks) in self._splits.items()]}

    @classmethod
    def from_json(cls, data: Any, chunk_count: int, what: str) -> "ChunkOwners":
        """The owners `to_json` described, checked against a dataset of `chunk_count` chunks; FormatError naming
        `what` (where the description came from) if they do not fit it."""
        try:
            nodes, owner = int(data["nodes"]), [int(rank) for rank in data["owner"]]
            splits = {int(chunk): (tuple(int(s) for s in starts), tuple(int(r) for r in ranks))
                      for chunk, starts, ranks in data["splits"]}
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{what}: the placement is not one of chunk owners") from None
        fits = 1 <= nodes <= MAX_NODES and len(owner) == chunk_count and all(
            _SPLIT <= rank < nodes for rank in owner)
        fits = fits and {chunk for chunk, rank in enumerate(owner) if rank == _SPLIT} == set(splits) and all(
            starts and len(starts) == len(ranks) and starts[0] == 0 and list(starts) == sorted(starts)
            and all(0 <= rank < nodes for rank in ranks) for starts, ranks in splits.values())
        if not fits:
            raise FormatError(f"{what}: the placement does not fit this dataset's {chunk_count} chunks")
        return cls(nodes, owner, splits)


class Placement:
    """Where every stored byte of a dataset lives on `nodes` nodes; made by place(), read-only once made."""

    __slots__ = ("nodes", "blobs", "replicated_chunks", "replicated_bytes", "split_chunks", "owners", "owner",
                 "is_local", "_piece_rows", "_pieces", "_spread_bytes", "_readers")

    def __init__(self, chunk_sizes: np.ndarray, replicated: np.ndarray, blobs: BlobTable, nodes: int) -> None:
        sizes = np.asarray(chunk_sizes, dtype=np.int64)
        replicated = np.asarray(replicated, dtype=bool)
        self.nodes = nodes
        # Every stored blob, which staging checks what it moves against and the rank checks its peers' and readers'
        # requests against: one table a job (a sort of every blob: 1.3 s at 10^7 files, three times before).
        self.blobs = blobs
        spread = np.flatnonzero(~replicated)
        bodies = sizes[spread] - CHUNK_HEADER_LEN
        starts = np.cumsum(bodies) - bodies  # each spread chunk's first blob byte in the stream
        total = int(bodies.sum())
        chunk_bounds = np.append(starts, total)
        bounds = _sorted_union(chunk_bounds, _blob_starts(blobs, spread, starts, len(sizes)))
        cuts = _cut_positions(total, nodes, chunk_bounds, bounds)
        # A stream position belongs to the rank whose range holds it; the end of the stream to the last rank.
        cut_array = np.array(cuts, dtype=np.int64)
        first = np.minimum(np.searchsorted(cut_array, starts, "right") - 1, nodes - 1)
        last = np.minimum(np.searchsorted(cut_array, starts + np.maximum(bodies, 1) - 1, "right") - 1, nodes - 1)
        whole, split = first == last, first != last
        owner = np.full(len(sizes), NO_OWNER, dtype=np.int64)
        owner[spread[whole]] = first[whole]
        owner[spread[split]] = _SPLIT
        owner_list: list[int] = owner.tolist()  # indexing a list is several times faster than a numpy array
        split_pieces = _split_pieces(cuts, spread[split], starts[split], starts[split] + bodies[split], first[split],
                                     last[split])
        piece_lists: dict[int, tuple[list[int], list[int]]] = {}
        for chunk, start, _end, rank in split_pieces:
            piece_starts, piece_ranks = piece_lists.setdefault(chunk, ([], []))
            piece_starts.append(start)
            piece_ranks.append(rank)
        splits = {chunk: (tuple(offsets), tuple(ranks)) for chunk, (offsets, ranks) in piece_lists.items()}
        self.split_chunks: tuple[int, ...] = tuple(splits)
        self.owners = ChunkOwners(nodes, owner_list, splits)
        self.owner = self.owners.owner  # bound once: the read path asks for every blob
        self.is_local = self.owners.is_local
        whole_pieces = np.stack((spread[whole], np.zeros(len(first[whole]), dtype=np.int64), sizes[spread[whole]],
                                 first[whole]), axis=1)
        pieces = np.concatenate((whole_pieces, np.array(split_pieces, dtype=np.int64).reshape(-1, 4)))
        pieces = pieces[np.lexsort((pieces[:, 0], pieces[:, 3]))]  # by rank, then chunk
        rows = np.searchsorted(pieces[:, 3], np.arange(nodes + 1))
        self._piece_rows: list[int] = rows.tolist()
        self._pieces: list[list[int]] = pieces[:, :3].tolist()  # chunk, start, end
        # A piece that starts after the header stages the header too.
        piece_bytes = pieces[:, 2] - pieces[:, 1] + np.where(pieces[:, 1] > 0, CHUNK_HEADER_LEN, 0)
        cumulative = np.concatenate(([0], np.cumsum(piece_bytes)))
        self._spread_bytes: list[int] = (cumulative[rows[1:]] - cumulative[rows[:-1]]).tolist()
        replicated_ids = np.flatnonzero(replicated)
        self.replicated_chunks: tuple[int, ...] = tuple(replicated_ids.tolist())
        self.replicated_bytes = int(sizes[replicated_ids].sum())
        self._readers = _replicated_readers(self.replicated_chunks, sizes.tolist(), self._spread_bytes)

    def pieces(self, rank: int) -> list[Piece]:
        """The spread pieces `rank` stores, by chunk: consecutive chunks, the first and last possibly partial."""
        self._check_rank(rank)
        return [Piece(*piece) for piece in self._pieces[self._piece_rows[rank] : self._piece_rows[rank + 1]]]

    def replicated_reader(self, chunk: int) -> int:
        """The rank that reads replicated `chunk` from DEST while staging and sends it to the others."""
        try:
            return self._readers[chunk]
        except KeyError:
            raise UsageError(f"chunk {chunk} is not a replicated chunk") from None

    def replicated_readers(self) -> dict[int, int]:
        """Replicated chunk -> the rank that reads it from DEST while staging (a fresh dict)."""
        return dict(self._readers)

    def spread_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s pieces, with the header staged with each piece that starts after it."""
        self._check_rank(rank)
        return self._spread_bytes[rank]

    def stored_bytes(self, rank: int) -> int:
        """Bytes `rank`'s local directory needs: its pieces and every replicated chunk, headers included."""
        return self.spread_bytes(rank) + self.replicated_bytes

    def staging_read_bytes(self) -> int:
        """Bytes the whole job reads from DEST to stage: each piece by its rank, each replicated chunk once."""
        return sum(self._spread_bytes) + self.replicated_bytes

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.nodes:
            raise UsageError(f"rank {rank} is not a rank of this {self.nodes}-node placement (0 to {self.nodes - 1})")

    def __repr__(self) -> str:
        return (f"<Placement of {len(self.owners)} chunks on {self.nodes} nodes: {len(self.replicated_chunks)} "
                f"replicated, {len(self.split_chunks)} split>")


def place(index: Index, nodes: int) -> Placement:
    """The placement every rank of a `nodes`-node job computes alone from the same index (docs/SERVE.md)."""
    if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral) or not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes: must be a whole number from 1 to {MAX_NODES}, got {nodes!r}")
    sizes = index.chunks["size"]
    if float(sizes.sum(dtype=np.float64)) >= _MAX_STREAM:
        raise FormatError(f"{index.path}: chunks: {len(sizes)} chunks hold 2^62 bytes or more, too many to place")
    replicated_groups = np.array([bool(group["replicated"]) for group in index.groups])
    replicated = replicated_groups[index.chunks["group"]]
    return Placement(sizes.astype(np.int64), replicated, BlobTable.of(index), int(nodes))


def _sorted_union(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The sorted distinct values of two int64 arrays, each sorted already (as stream positions are): a merge, O(n).
    np.union1d hashes them instead, which took 12.8 s for 10^7 positions against 0.07 s for this."""
    merged = np.concatenate((first, second))
    merged.sort(kind="stable")  # a merge of the two sorted runs
    if not len(merged):
        return merged
    distinct = np.empty(len(merged), dtype=bool)
    distinct[0] = True
    np.not_equal(merged[1:], merged[:-1], out=distinct[1:])
    return merged[distinct]


def _blob_starts(blobs: BlobTable, spread: np.ndarray, starts: np.ndarray, chunk_count: int) -> np.ndarray:
    """Stream positions where a spread chunk may be cut: the starts of its blobs that no earlier blob reaches past
    (every blob of a fanstore pack; a crafted index's overlapping blobs are never cut apart)."""
    stream_start = np.full(chunk_count, -1, dtype=np.int64)
    stream_start[spread] = starts
    blob_chunk_start = stream_start[blobs.chunk]
    in_spread = blob_chunk_start >= 0
    positions = blob_chunk_start[in_spread] + blobs.offset[in_spread].astype(np.int64) - CHUNK_HEADER_LEN
    if not len(positions):
        return positions
    # Blobs lie inside their chunks, so in stream order a blob can only reach past blobs of its own chunk.
    reach = np.maximum.accumulate(positions + blobs.stored_len[in_spread].astype(np.int64))
    clear = np.ones(len(positions), dtype=bool)
    clear[1:] = positions[1:] >= reach[:-1]
    return positions[clear]


def _split_pieces(cuts: list[int], chunks: np.ndarray, begins: np.ndarray, ends: np.ndarray, first: np.ndarray,
                  last: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(chunk, start, end, rank) of each piece of the chunks the cuts cross, whose bytes lie at stream positions
    begins..ends and meet ranks first..last; in chunk file offsets. Ranks whose range is empty get no piece."""
    pieces = []
    for chunk, begin, end, low_rank, high_rank in zip(chunks.tolist(), begins.tolist(), ends.tolist(), first.tolist(),
                                                      last.tolist()):
        for rank in range(low_rank, high_rank + 1):
            low, high = max(begin, cuts[rank]), min(end, cuts[rank + 1])
            if low < high:
                pieces.append((chunk, low - begin + CHUNK_HEADER_LEN if low > begin else 0,
                               high - begin + CHUNK_HEADER_LEN, rank))
    return pieces


def _cut_positions(total: int, nodes: int, chunk_bounds: np.ndarray, bounds: np.ndarray) -> list[int]:
    """Cut r (r = 1..N-1) at the chunk boundary nearest r*T/N when it lies within T/N/CHUNK_TOLERANCE of it, else
    at the nearest blob boundary; cut 0 is 0, cut N is T. Computed in integers, so every rank agrees exactly."""
    cuts = [0]
    for rank in range(1, nodes):
        aim = rank * total  # the ideal cut is aim / nodes
        cut = _nearest(chunk_bounds, aim, nodes)
        if abs(cut * nodes - aim) * CHUNK_TOLERANCE > total:
            cut = _nearest(bounds, aim, nodes)
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return cuts


def _nearest(positions: np.ndarray, aim: int, nodes: int) -> int:
    """The sorted `positions` element nearest aim / nodes; the lower of two equally near. positions[0] is 0."""
    above = int(positions.searchsorted(aim // nodes, "right"))
    below = int(positions[above - 1])
    if above == len(positions):
        return below
    upper = int(positions[above])
    return upper if upper * nodes - aim < aim - below * nodes else below


def _replicated_readers(chunks: tuple[int, ...], sizes: list[int], spread_bytes: list[int]) -> dict[int, int]:
    """Each replicated chunk, largest first (then by id), to the rank that has the fewest bytes to read from DEST so
    far, its own pieces counted (then the lowest rank): every replicated byte is read once, and no rank much more."""
    loads = [(load, rank) for rank, load in enumerate(spread_bytes)]
    heapq.heapify(loads)
    readers = {}
    for chunk in sorted(chunks, key=lambda c: (-sizes[c], c)):
        load, rank = heapq.heappop(loads)
        readers[chunk] = rank
        heapq.heappush(loads, (load + sizes[chunk], rank))
    return dict(sorted(readers.items()))
