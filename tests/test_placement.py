"""Placement: every rank computes the same placement of a dataset over N nodes from the index alone; each spread blob
is stored by exactly one node, replicated chunks by all, and no node stores much more than its share."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, make_tree, run_cli
from fanstore import PackOptions, UsageError, pack
from fanstore.cli import main
from fanstore.errors import EXIT_DOES_NOT_FIT
from fanstore.core.format import CHUNK_DTYPE, CHUNK_HEADER_LEN, ENTRY_DTYPE, NO_CHUNK
from fanstore.core.index import Index
from fanstore.errors import FormatError
from fanstore.serve.placement import MAX_NODES, NO_OWNER, BlobTable, ChunkOwners, Piece, Placement, place

BLOB = 1000  # stored bytes of each file of the equal-chunks dataset (random bytes, stored as they are)
NODES = 12
SPREAD_CHUNKS = 4 * NODES + 1  # 16 blobs a chunk; whole chunks would put 5 on the fullest node, 1.22x the mean
BALANCE = 1.05  # the most max/mean of spread bytes per node may be when there are at least 4 chunks per node


@pytest.fixture(scope="module")
def equal_chunks(tmp_path_factory) -> Path:
    """SPREAD_CHUNKS equal spread chunks of 16 blobs, plus 3 replicated chunks."""
    root = tmp_path_factory.mktemp("equal")
    rng = np.random.default_rng(11)
    for number in range(SPREAD_CHUNKS * 16):
        folder = root / "src" / "train" / f"{number // 100:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{number:04d}.bin").write_bytes(rng.integers(0, 256, BLOB, np.uint8).tobytes())
    (root / "src" / "val").mkdir()
    for number in range(40):
        (root / "src" / "val" / f"{number:02d}.bin").write_bytes(rng.integers(0, 256, BLOB, np.uint8).tobytes())
    pack(root / "src", root / "ds", PackOptions(codec="none", chunk_size=16 * 1024, replicate=("val/**",), workers=1))
    return root / "ds"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """The usual awkward tree: files whole and in blocks, empty files, symlinks, a replicated group, odd sizes."""
    root = tmp_path_factory.mktemp("mixed")
    pack(make_tree(root / "src"), root / "ds", PackOptions(codec="zstd:3", chunk_size=16 * 1024, replicate=("val/**",),
                                                           block_size=4096, blocks_above=64 * 1024, workers=1))
    return root / "ds"


def synthetic_index(blob_sizes: np.ndarray, replicated_chunks: int = 0) -> Index:
    """An Index made straight from arrays (not checked, not written): `blob_sizes` is (chunks, blobs per chunk), the
    last `replicated_chunks` chunks in a replicated group. Cheap enough for tens of thousands of chunks."""
    chunks, per_chunk = blob_sizes.shape
    count = chunks * per_chunk
    entries = np.zeros(count + 1, dtype=ENTRY_DTYPE)
    entries[0]["mode"], entries[0]["chunk"] = stat.S_IFDIR | 0o755, NO_CHUNK
    files = entries[1:]
    files["mode"] = stat.S_IFREG | 0o644
    files["chunk"] = np.repeat(np.arange(chunks), per_chunk)
    files["offset"] = (CHUNK_HEADER_LEN + np.cumsum(blob_sizes, axis=1) - blob_sizes).ravel()
    files["stored_len"] = files["size"] = blob_sizes.ravel()
    table = np.zeros(chunks, dtype=CHUNK_DTYPE)
    table["size"] = CHUNK_HEADER_LEN + blob_sizes.sum(axis=1)
    table["files"] = per_chunk
    table["group"][chunks - replicated_chunks:] = 1
    toc = {"groups": [{"name": "spread", "replicated": False, "patterns": []},
                      {"name": "replicated", "replicated": True, "patterns": ["val/**"]}],
           "codecs": [{"id": 0, "spec": "none", "dictionary": None}], "sections": {}}
    sections = {"entries": entries, "paths": np.zeros(0, dtype=np.uint8), "path_hash": np.zeros(count + 1, np.uint64),
                "hash_order": np.zeros(count + 1, np.uint32), "chunks": table}
    return Index(Path("synthetic"), toc, sections)


def spread_ratio(placement: Placement) -> float:
    shares = [placement.spread_bytes(rank) for rank in range(placement.nodes)]
    return max(shares) / (sum(shares) / len(shares))


def assert_consistent(index: Index, placement: Placement) -> None:
    """Pieces tile every spread chunk file exactly once at blob boundaries; owner() and is_local() agree with them;
    replicated chunks are everyone's; the byte counts add up."""
    blobs = BlobTable.of(index)
    sizes = index.chunks["size"].astype(np.int64).tolist()
    replicated = {c for c, group in enumerate(index.chunks["group"]) if index.groups[group]["replicated"]}
    assert set(placement.replicated_chunks) == replicated
    nodes = placement.nodes
    parts: dict[int, list[tuple[int, int, int]]] = {}
    for rank in range(nodes):
        pieces = placement.pieces(rank)
        chunks = [piece.chunk for piece in pieces]
        assert chunks == list(range(chunks[0], chunks[0] + len(chunks))) if chunks else True  # consecutive
        for inner in pieces[1:-1]:  # only the first and last may be partial
            assert (inner.start, inner.end) == (0, sizes[inner.chunk])
        for piece in pieces:
            parts.setdefault(piece.chunk, []).append((piece.start, piece.end, rank))
        assert placement.spread_bytes(rank) == sum(p.end - p.start + (CHUNK_HEADER_LEN if p.start else 0)
                                                   for p in pieces)
        assert placement.stored_bytes(rank) == placement.spread_bytes(rank) + placement.replicated_bytes
    assert set(parts) == set(range(len(sizes))) - replicated
    for chunk, chunk_parts in parts.items():
        chunk_parts.sort()
        rows = blobs.in_range(chunk, 0, sizes[chunk])
        starts = set(blobs.offset[rows].tolist())
        assert chunk_parts[0][0] == 0 and chunk_parts[-1][1] == sizes[chunk]
        held = 0
        for (start, end, rank), following in zip(chunk_parts, chunk_parts[1:] + [None]):
            assert start < end
            assert following is None and end == sizes[chunk] or end == following[0] and end in starts
            assert start == 0 or start in starts
            piece_rows = blobs.in_range(chunk, start, end)
            held += piece_rows.stop - piece_rows.start
            for offset, length in zip(blobs.offset[piece_rows].tolist(), blobs.stored_len[piece_rows].tolist()):
                assert offset + length <= end  # the blob lies whole in the piece
                assert placement.owner(chunk, offset) == placement.owner(chunk, offset + length - 1) == rank
                assert placement.is_local(rank, chunk, offset)
                assert not placement.is_local((rank + 1) % nodes, chunk, offset) or nodes == 1
        assert held == rows.stop - rows.start  # every blob in exactly one piece
    for chunk in replicated:
        rows = blobs.in_range(chunk, 0, sizes[chunk])
        for offset in blobs.offset[rows].tolist():
            assert placement.owner(chunk, offset) == NO_OWNER
            assert all(placement.is_local(rank, chunk, offset) for rank in {0, nodes // 2, nodes - 1})
    assert placement.replicated_bytes == sum(sizes[c] for c in replicated)
    pieces_in_all = sum(len(chunk_parts) for chunk_parts in parts.values())
    spread_total = sum(placement.spread_bytes(rank) for rank in range(nodes))
    assert spread_total == sum(sizes[c] for c in parts) + CHUNK_HEADER_LEN * (pieces_in_all - len(parts))
    assert placement.staging_read_bytes() == spread_total + placement.replicated_bytes
    assert set(placement.split_chunks) == {c for c, chunk_parts in parts.items() if len(chunk_parts) > 1}
    readers = placement.replicated_readers()
    assert set(readers) == replicated and all(0 <= rank < nodes for rank in readers.values())
    assert all(placement.replicated_reader(chunk) == rank for chunk, rank in readers.items())


@pytest.mark.parametrize("nodes", [1, 2, 3, 7, 12, 50, 1000, MAX_NODES])
def test_pieces_tile_every_spread_chunk_and_owners_agree(mixed, equal_chunks, nodes):
    for dest in (mixed, equal_chunks):
        index = Index.load(dest)
        assert_consistent(index, place(index, nodes))


@pytest.mark.parametrize("nodes", [1, 3, 50])
def test_a_readers_chunk_owners_from_the_serve_process_say_what_the_placement_says(mixed, equal_chunks, nodes):
    """The serve process places once per node and hands its readers the owners as JSON (HELLO): they must answer
    owner() and is_local() as the placement does, for every blob; a description that does not fit is refused."""
    for dest in (mixed, equal_chunks):
        index = Index.load(dest)
        placement = place(index, nodes)
        owners = ChunkOwners.from_json(json.loads(json.dumps(placement.owners.to_json())), len(index.chunks), "x")
        blobs = BlobTable.of(index)
        for chunk, offset in zip(blobs.chunk.tolist(), blobs.offset.tolist()):
            assert owners.owner(chunk, offset) == placement.owner(chunk, offset)
            assert all(owners.is_local(rank, chunk, offset) == placement.is_local(rank, chunk, offset)
                       for rank in {0, nodes - 1})
        described = placement.owners.to_json()
        for wrong in (None, {**described, "nodes": 0}, {**described, "owner": described["owner"][:-1]},
                      {**described, "owner": [nodes] * len(described["owner"])}, {**described, "splits": "x"}):
            with pytest.raises(FormatError, match="^x: the placement"):
                ChunkOwners.from_json(wrong, len(index.chunks), "x")


@pytest.mark.parametrize("nodes", [1, 3, 7, 50, 1000])
def test_owners_of_many_blobs_at_once_are_each_ones_owner(mixed, equal_chunks, nodes):
    """ChunkOwners.owners_of answers, in numpy, what owner() answers blob by blob: split chunks (cut among
    ranks at blob boundaries), whole ones and replicated ones alike, in any order, a blob asked twice too."""
    split_seen = 0
    for dest in (mixed, equal_chunks):
        index = Index.load(dest)
        placement = place(index, nodes)
        owners = placement.owners
        split_seen += len(placement.split_chunks)
        blobs = BlobTable.of(index)
        order = np.random.default_rng(nodes).permutation(np.concatenate((np.arange(len(blobs)), [0])))
        chunks, offsets = blobs.chunk[order], blobs.offset[order]
        expected = [owners.owner(chunk, offset) for chunk, offset in zip(chunks.tolist(), offsets.tolist())]
        assert owners.owners_of(chunks, offsets).tolist() == expected
        assert owners.owners_of(chunks[:0], offsets[:0]).tolist() == []
    assert split_seen or nodes in (1, 1000), "no split chunk: the piece lookup went untested"


def test_same_index_same_nodes_same_placement(mixed):
    first, second = place(Index.load(mixed), 7), place(Index.load(mixed), 7)
    assert [first.pieces(r) for r in range(7)] == [second.pieces(r) for r in range(7)]
    assert first.replicated_readers() == second.replicated_readers()
    blobs = BlobTable.of(Index.load(mixed))
    for chunk, offset in zip(blobs.chunk.tolist(), blobs.offset.tolist()):
        assert first.owner(chunk, offset) == second.owner(chunk, offset)
    assert [first.stored_bytes(r) for r in range(7)] == [second.stored_bytes(r) for r in range(7)]


def test_one_node_stores_everything_whole(mixed):
    index = Index.load(mixed)
    placement = place(index, 1)
    spread = [c for c in range(len(index.chunks)) if c not in placement.replicated_chunks]
    assert placement.pieces(0) == [Piece(c, 0, int(index.chunks["size"][c])) for c in spread]
    assert placement.split_chunks == ()
    assert placement.stored_bytes(0) == placement.staging_read_bytes() == int(index.chunks["size"].sum())
    assert set(placement.replicated_readers().values()) == {0}


def test_more_nodes_than_blobs(mixed):
    index = Index.load(mixed)
    placement = place(index, MAX_NODES)
    blob_count = len(BlobTable.of(index))
    holding = [rank for rank in range(MAX_NODES) if placement.pieces(rank)]
    assert 0 < len(holding) <= blob_count < MAX_NODES
    assert sum(placement.spread_bytes(rank) == 0 for rank in range(MAX_NODES)) == MAX_NODES - len(holding)


def test_balance_on_a_packed_dataset_of_equal_chunks(equal_chunks):
    index = Index.load(equal_chunks)
    spread = index.chunks[index.chunks["group"] == 0]
    assert len(spread) == SPREAD_CHUNKS and len(set(spread["size"].tolist())) == 1  # equal chunks, as meant
    for nodes in range(1, NODES + 1):  # every N with at least 4 chunks a node, up to 4N+1 chunks
        assert spread_ratio(place(index, nodes)) <= BALANCE, nodes
    whole_chunks = 5 / (SPREAD_CHUNKS / NODES)  # what placing whole chunks would give at 4N+1
    assert whole_chunks > 1.2 and spread_ratio(place(index, NODES)) < 1.02


def test_balance_at_up_to_4096_nodes():
    rng = np.random.default_rng(5)
    # Blobs from 256 KiB to 4 MiB, the default block size's range, 16 a chunk: 4 chunks a node at N = 4096, plus one.
    index = synthetic_index(rng.integers(256 << 10, 4 << 20, size=(4 * MAX_NODES + 1, 16)), replicated_chunks=0)
    for nodes in (1, 2, 3, 5, 64, 999, MAX_NODES - 1, MAX_NODES):
        placement = place(index, nodes)
        assert spread_ratio(placement) <= BALANCE, nodes
    assert len(placement.split_chunks) < MAX_NODES  # at most one chunk per cut
    # Equal chunks of 16 equal blobs: a node's share is 64 blobs and a sixty-fourth, so the fullest holds 65.
    equal = place(synthetic_index(np.full((4 * MAX_NODES + 1, 16), 1 << 20)), MAX_NODES)
    assert spread_ratio(equal) <= 65 / 64 + 0.001


def test_replicated_readers_share_the_reading():
    # 8 replicated chunks of 4 MiB and 16 spread chunks of 4 MiB on 4 nodes: each node reads 4 spread + 2 replicated.
    index = synthetic_index(np.full((24, 4), 1 << 20), replicated_chunks=8)
    placement = place(index, 4)
    assert placement.replicated_chunks == tuple(range(16, 24))
    reads = [placement.spread_bytes(rank) for rank in range(4)]
    for chunk, rank in placement.replicated_readers().items():
        reads[rank] += int(index.chunks["size"][chunk])
    assert max(reads) == min(reads)
    assert placement.stored_bytes(0) == placement.spread_bytes(0) + 8 * int(index.chunks["size"][16])
    with pytest.raises(UsageError, match="chunk 3 is not a replicated chunk"):
        placement.replicated_reader(3)


def test_overlapping_blobs_of_a_crafted_index_are_never_cut_apart():
    # Chunk 0 holds one long blob and, inside it, the blobs of two more entries (as a crafted index may say).
    index = synthetic_index(np.full((1, 3), 1000))
    files = index.entries[1:]
    files["offset"][1:] = [CHUNK_HEADER_LEN + 100, CHUNK_HEADER_LEN + 500]
    files["stored_len"][0] = 3000
    index.chunks["size"][0] = CHUNK_HEADER_LEN + 3000
    placement = place(index, 2)
    assert placement.pieces(0) + placement.pieces(1) == [Piece(0, 0, CHUNK_HEADER_LEN + 3000)]
    assert_consistent(index, placement)


def test_no_spread_bytes_at_all():
    empty = synthetic_index(np.zeros((0, 1), dtype=np.int64))
    placement = place(empty, 3)
    assert [placement.pieces(r) for r in range(3)] == [[], [], []] and placement.staging_read_bytes() == 0
    only_replicated = place(synthetic_index(np.full((2, 2), 100), replicated_chunks=2), 3)
    assert only_replicated.stored_bytes(2) == only_replicated.replicated_bytes == 2 * (CHUNK_HEADER_LEN + 200)


@pytest.mark.parametrize("nodes", [0, -1, MAX_NODES + 1, 2.0, True, "4"])
def test_place_refuses_a_node_count_outside_1_to_4096(mixed, nodes):
    with pytest.raises(UsageError, match="--nodes"):
        place(Index.load(mixed), nodes)


def test_ranks_outside_the_placement_are_refused(mixed):
    placement = place(Index.load(mixed), 3)
    for rank in (-1, 3):
        with pytest.raises(UsageError, match=f"rank {rank} is not a rank"):
            placement.pieces(rank)
        with pytest.raises(UsageError, match="0 to 2"):
            placement.stored_bytes(rank)


@pytest.fixture
def plan_cli(capsys):
    """`fanstore plan ARGS` run in this process (faster than a fresh interpreter), as a CompletedProcess."""
    previous = signal.getsignal(signal.SIGTERM)  # the command line installs its own; this process keeps pytest's

    def run(*args: str) -> subprocess.CompletedProcess:
        code = main(["plan", *map(str, args)])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["fanstore", "plan", *args], code, out, err)

    yield run
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0"], "--nodes"), (["--nodes", "4097"], "--nodes"), (["--nodes", "x"], "--nodes"),
    (["--nodes", "4", "--local-capacity", "lots"], "--local-capacity"),
    (["--nodes", "4", "--local-capacity", "0"], "--local-capacity"),
])
def test_plan_bad_options_are_one_line(plan_cli, mixed, args, needle):
    assert_one_line_error(plan_cli(mixed, *args), needle)


def test_plan_of_no_dataset_is_one_line(plan_cli, tmp_path):
    assert_one_line_error(plan_cli(tmp_path / "absent", "--nodes", "2"), "no such dataset")


def test_plan_reports_shares_and_whether_they_fit(plan_cli, equal_chunks):
    placement = place(Index.load(equal_chunks), NODES)
    fullest = max(placement.stored_bytes(rank) for rank in range(NODES))
    report = plan_cli(equal_chunks, "--nodes", NODES)
    assert report.returncode == 0 and report.stderr == ""
    lines = dict(line.split(None, 1) for line in report.stdout.splitlines())
    assert lines["nodes"] == str(NODES)
    assert lines["chunks"].startswith(f"{SPREAD_CHUNKS + 3}: {SPREAD_CHUNKS} spread, 3 replicated; "
                                      f"{len(placement.split_chunks)} split between nodes")
    assert f"max/mean {spread_ratio(placement):.3f}" in lines["spread"]
    assert lines["capacity"].startswith("not checked")
    fits = plan_cli(equal_chunks, "--nodes", NODES, "--local-capacity", fullest)
    assert fits.returncode == 0 and "capacity     fits: the fullest node stores" in fits.stdout
    over = plan_cli(equal_chunks, "--nodes", NODES, "--local-capacity", fullest - 1)
    assert over.returncode == EXIT_DOES_NOT_FIT
    capacity = [line for line in over.stdout.splitlines() if line.startswith("capacity")]
    assert len(capacity) == 1 and "does not fit" in capacity[0] and "1 B over" in capacity[0]


def test_plan_through_the_real_command_line(equal_chunks):
    fits = run_cli("plan", str(equal_chunks), "--nodes", "4", "--local-capacity", "1GiB")
    assert fits.returncode == 0 and "fits" in fits.stdout, fits.stderr
    too_small = run_cli("plan", str(equal_chunks), "--nodes", "4", "--local-capacity", "64KiB")
    assert too_small.returncode == EXIT_DOES_NOT_FIT and "does not fit" in too_small.stdout
    assert too_small.stderr == ""
    assert "exit status:\n" in run_cli("plan", "--help").stdout
    assert f"\n  {EXIT_DOES_NOT_FIT}  the fullest node's share does not fit" in run_cli("plan", "--help").stdout


def test_a_request_must_name_exactly_one_blob():
    from fanstore.serve.placement import BlobTable

    blobs = BlobTable(np.array([0, 0, 1]), np.array([32, 132, 32]), np.array([100, 50, 7]), np.array([1, 2, 3]), 2)
    assert [blobs.blob_row(0, 32, 100), blobs.blob_row(0, 132, 50), blobs.blob_row(1, 32, 7)] == [0, 1, 2]
    for chunk, offset, length in [(0, 33, 99), (0, 32, 150), (0, 32, 99), (0, 0, 32), (1, 39, 1), (2, 32, 7),
                                  (-1, 32, 100), (0, -68, 100), (0, 182, 0)]:
        assert blobs.blob_row(chunk, offset, length) is None, (chunk, offset, length)


@pytest.mark.parametrize("seed", range(4))
def test_cut_positions_merge_as_a_union_would(seed):
    """The stream positions where chunks may be cut are merged from two sorted runs (O(n)); the result is what
    np.union1d gives, duplicates and empty runs included, and sorted input is no precondition of correctness."""
    from fanstore.serve.placement import _sorted_union

    rng = np.random.default_rng(seed)
    first = np.sort(rng.integers(0, 1000, rng.integers(0, 50))).astype(np.int64)
    second = np.sort(rng.integers(0, 1000, rng.integers(0, 500))).astype(np.int64)
    assert np.array_equal(_sorted_union(first, second), np.union1d(first, second))
    shuffled = rng.permutation(second)
    assert np.array_equal(_sorted_union(first, shuffled), np.union1d(first, shuffled))
    assert _sorted_union(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).tolist() == []


def test_blob_row_finds_exactly_one_whole_blob_and_nothing_else(mixed):
    """What a peer's request must name: the row of the blob of that length at that offset of that chunk; None for
    part of a blob, bytes between blobs, a length that is not the blob's, a chunk or offset out of range, and an
    offset where a crafted index put two blobs."""
    index = Index.load(mixed)
    blobs = BlobTable.of(index)
    for row, (chunk, offset, length) in enumerate(zip(blobs.chunk.tolist(), blobs.offset.tolist(),
                                                      blobs.stored_len.tolist())):
        assert blobs.blob_row(chunk, offset, length) == row
        assert blobs.blob_row(chunk, offset, length + 1) is None
        assert blobs.blob_row(chunk, offset + 1, length - 1) is None
    chunk, offset, length = int(blobs.chunk[0]), int(blobs.offset[0]), int(blobs.stored_len[0])
    for bad in ((-1, offset, length), (len(index.chunks), offset, length), (chunk, -1, length),
                (chunk, 2**63, length)):
        assert blobs.blob_row(*bad) is None
    twice = BlobTable([0, 0, 0], [0, 0, 10], [10, 10, 5], [1, 2, 3], 1)  # two blobs at offset 0 of chunk 0
    assert twice.blob_row(0, 0, 10) is None and twice.blob_row(0, 10, 5) == 2
