"""Staging's parts that need no MPI: spans cut at blob boundaries, per-blob checks, the manifest of a local dir.

Staging itself, with MPI, runs in tests/test_serve.py."""

from __future__ import annotations

import numpy as np

from conftest import make_tree
from fanstore import PackOptions, open_dataset, pack
from fanstore.format import CHUNK_HEADER_LEN, chunk_file_name
from fanstore.serve.placement import BlobTable
from fanstore.serve.staging import LocalDirectory, Span, check_span, dataset_identity, spans_of


def _packed(tmp_path):
    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3", chunk_size=64 * 1024, workers=1))
    return dest


def test_spans_cover_a_range_in_whole_blobs(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        blobs = BlobTable.of(ds.index)
        sizes = ds.index.chunks["size"]
    starts = set(blobs.offset.tolist())
    for chunk, size in enumerate(sizes.tolist()):
        for span_bytes in (1, 5000, 1 << 30):
            spans = spans_of(blobs, chunk, 0, size, span_bytes)
            assert spans[0].start == 0 and spans[-1].end == size
            assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
            assert all(s.start in starts for s in spans[1:])  # every cut is a blob boundary
            if span_bytes == 1 << 30:
                assert len(spans) == 1


def test_check_span_names_the_damaged_blob(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        blobs = BlobTable.of(ds.index)
        size = int(ds.index.chunks["size"][0])
    data = bytearray((dest / chunk_file_name(0)).read_bytes())
    span = Span(0, 0, size)
    assert check_span(blobs, span, data) == []
    rows = blobs.in_range(0, 0, size)
    second = int(blobs.offset[rows][1])
    data[second + 3] ^= 0xFF
    assert check_span(blobs, span, data) == [second]
    assert check_span(blobs, Span(0, 0, CHUNK_HEADER_LEN), data[:CHUNK_HEADER_LEN]) == []


def test_manifest_is_for_one_dataset_only(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    local = LocalDirectory(tmp_path / "local", sizes)
    local.path.mkdir()
    identity = dataset_identity(dest)
    local.write_manifest(identity, {0: [(0, 100)], 3: [(32, 64)]})
    assert local.read_manifest(identity) == {0: [(0, 100)], 3: [(32, 64)]}
    assert local.read_manifest("another dataset") == {}
    (local.path / "fanstore-staged.json").write_text("{not json")
    assert local.read_manifest(identity) == {}


def test_a_chunk_file_starts_sparse_and_empty(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    local = LocalDirectory(tmp_path / "local", sizes)
    stale = local.chunk_path(1)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\xff" * int(sizes[1]))  # an earlier dataset's bytes
    local.open_for_staging(1, keep=False)
    local.write(1, 0, b"H" * CHUNK_HEADER_LEN)
    local.close()
    data = stale.read_bytes()
    assert len(data) == sizes[1] and data[:CHUNK_HEADER_LEN] == b"H" * CHUNK_HEADER_LEN
    assert not np.frombuffer(data[CHUNK_HEADER_LEN:], np.uint8).any()
