"""A node's staged copy with DEST behind it (fanstore/serve/staged_source.py), read as the mount and the PyTorch
readers of a served node read it, with no MPI: a blob damaged in the copy is read from DEST, once logged per
chunk; damaged in DEST too, it is corrupt. A served job with real damage runs in tests/test_serve.py."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from chunk_source_contract import ChunkSourceContract
from conftest import flip_byte, make_tree
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.chunk_source import LocalChunkSource
from fanstore.errors import ChunkCorrupt, ChunkUnavailable
from fanstore.core.format import chunk_file_name
from fanstore.core.reader import Reader
from fanstore.serve.node_client import NodeChunkSource, NodeConnection
from fanstore.serve.placement import place
from fanstore.serve.staged_source import StagedChunkSource


@pytest.fixture
def staged(tmp_path):
    """A packed dataset (DEST), a node's copy of its chunks, and the files stored whole, by path."""
    src, dest, copy = make_tree(tmp_path / "src"), tmp_path / "dest", tmp_path / "local"
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=64 * 1024, workers=1))
    shutil.copytree(dest / "chunks", copy / "chunks")
    with open_dataset(dest) as ds:
        files = {path: ds.resolve(path) for path in ("random.bin", "field.npy", "labels.txt")}
        index = ds.index
    return src, dest, copy, index, files


def _damage_blob(directory: Path, index, entry: int) -> Path:
    row = index.entries[entry]
    chunk = directory / chunk_file_name(int(row["chunk"]))
    flip_byte(chunk, int(row["offset"]) + int(row["stored_len"]) // 2)
    return chunk


def _staged_source(dest: Path, copy: Path, index) -> StagedChunkSource:
    sizes = index.chunks["size"]
    return StagedChunkSource(LocalChunkSource(copy, sizes), LocalChunkSource(dest, sizes), rank=0)


def test_a_blob_damaged_in_the_copy_is_read_from_dest_and_logged_once(staged, caplog):
    src, dest, copy, index, files = staged
    damaged = _damage_blob(copy, index, files["random.bin"])
    source = _staged_source(dest, copy, index)
    reader = Reader(index, source)
    with caplog.at_level(logging.WARNING, logger="fanstore.serve"):
        for _ in range(3):
            assert reader.read(files["random.bin"]) == (src / "random.bin").read_bytes()
    assert source.dest_reads == 3
    lines = [r.getMessage() for r in caplog.records if "this node's copy" in r.getMessage()]
    assert len(lines) == 1 and str(damaged) in lines[0], lines


def test_reads_after_close_are_unavailable_and_report_no_damage(staged, caplog):
    """A rank that ends closes its copy while a peer may still ask it for a blob (its MPI thread serves until it
    stops): that read fails as the copy being closed, and no chunk is logged as damaged, by either way of reading."""
    src, dest, copy, index, files = staged
    row = index.entries[files["random.bin"]]
    blob = int(row["chunk"]), int(row["offset"]), int(row["stored_len"])
    source = _staged_source(dest, copy, index)
    source.close()
    with caplog.at_level(logging.WARNING, logger="fanstore.serve"):
        with pytest.raises(ChunkUnavailable, match="closed"):
            source.read(*blob)
        with pytest.raises(ChunkUnavailable, match="closed"):
            source.read_staged_into(*blob, memoryview(bytearray(blob[2])))
    assert not [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert source.dest_reads == 0


def test_a_copy_cut_short_or_gone_is_read_from_dest(staged):
    src, dest, copy, index, files = staged
    cut = copy / chunk_file_name(int(index.entries[files["field.npy"]]["chunk"]))
    os.truncate(cut, 100)
    gone = copy / chunk_file_name(int(index.entries[files["labels.txt"]]["chunk"]))
    if gone != cut:
        gone.unlink()
    reader = Reader(index, _staged_source(dest, copy, index))
    for path, entry in files.items():
        assert reader.read(entry) == (src / path).read_bytes(), path


def test_a_blob_damaged_in_the_copy_and_in_dest_is_corrupt(staged):
    _, dest, copy, index, files = staged
    _damage_blob(copy, index, files["random.bin"])
    _damage_blob(dest, index, files["random.bin"])
    with pytest.raises(ChunkCorrupt, match="random.bin: checksum mismatch"):
        Reader(index, _staged_source(dest, copy, index)).read(files["random.bin"])


def test_a_pytorch_reader_of_a_served_node_reads_a_damaged_blob_from_dest(staged, tmp_path):
    """fanstore.torch under serve reads this node's chunks itself (NodeChunkSource); on one node every blob is
    local, so the node's serve process (absent here) is never asked."""
    src, dest, copy, index, files = staged
    _damage_blob(copy, index, files["random.bin"])
    sizes = index.chunks["size"]
    dest_source = LocalChunkSource(dest, sizes)
    source = NodeChunkSource(NodeConnection(str(tmp_path / "no-serve-process")), 0, place(index, 1).owners,
                             StagedChunkSource(LocalChunkSource(copy, sizes), dest_source, 0), dest_source,
                             frozenset())
    assert Reader(index, source).read(files["random.bin"]) == (src / "random.bin").read_bytes()


class TestStagedChunkSource(ChunkSourceContract):
    """A node's staged copy holding every other chunk (the rest gone from it, as after damage), DEST behind it: the
    source passes the contract whichever copy answers."""

    @pytest.fixture
    def make_source(self, dataset, tmp_path):
        with open_dataset(dataset) as ds:
            sizes = ds.index.chunks["size"].copy()
        copy = tmp_path / "local"
        shutil.copytree(dataset / "chunks", copy / "chunks")
        for chunk_id in range(1, len(sizes), 2):
            (copy / chunk_file_name(chunk_id)).unlink()
        return lambda: StagedChunkSource(LocalChunkSource(copy, sizes), LocalChunkSource(dataset, sizes), rank=0)
