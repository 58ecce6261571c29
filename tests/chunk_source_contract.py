"""What every ChunkSource must do. A new source (MPI peer, shared-file-system fallback) gets these tests by
subclassing ChunkSourceContract and providing the `make_source` fixture."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import make_tree
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.chunk_source import ChunkSource, ChunkUnavailable
from fanstore.core.format import CHUNK_HEADER_LEN, NO_CHUNK, chunk_file_name


class ChunkSourceContract:
    @pytest.fixture
    def dataset(self, tmp_path) -> Path:
        dest = tmp_path / "ds"
        pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3", chunk_size=16 * 1024, workers=1))
        return dest

    @pytest.fixture
    def make_source(self, dataset):
        """Returns a callable giving a fresh ChunkSource over `dataset`; subclasses override."""
        raise NotImplementedError

    def test_reads_exact_ranges(self, dataset, make_source):
        with open_dataset(dataset) as ds, make_source() as source:
            chunk_count = len(ds.index.chunks)
            assert chunk_count > 2
            for chunk_id in range(chunk_count):
                raw = (dataset / chunk_file_name(chunk_id)).read_bytes()
                assert source.read(chunk_id, 0, CHUNK_HEADER_LEN) == raw[:CHUNK_HEADER_LEN]
                assert source.read(chunk_id, CHUNK_HEADER_LEN, 17) == raw[CHUNK_HEADER_LEN:CHUNK_HEADER_LEN + 17]
                assert source.read(chunk_id, len(raw) - 5, 5) == raw[-5:]
                assert source.read(chunk_id, 40, 0) == b""

    def test_serves_the_read_path(self, dataset, make_source):
        with open_dataset(dataset, source=make_source()) as ds:
            for path in ds.files():
                assert ds.read(path) == (dataset.parent / "src" / path).read_bytes()

    def test_unknown_chunk_and_read_past_end_name_the_chunk(self, dataset, make_source):
        with open_dataset(dataset) as ds, make_source() as source:
            count = len(ds.index.chunks)
            size = int(ds.index.chunks["size"][0])
            with pytest.raises(ChunkUnavailable, match=str(count + 5)):
                source.read(count + 5, 0, 10)
            with pytest.raises(ChunkUnavailable, match="chunk 0"):
                source.read(0, size - 2, 10)

    def test_another_copy_is_the_same_bytes_or_none(self, dataset, make_source):
        """What the reader asks for a blob that failed its checksum: the same bytes from another copy, or
        ChunkUnavailable naming the chunk where the source keeps no other (the reader then calls it corrupt)."""
        with make_source() as source:
            raw = (dataset / chunk_file_name(1)).read_bytes()
            try:
                other = source.read_other_copy(1, CHUNK_HEADER_LEN, 64)
            except ChunkUnavailable as exc:
                assert exc.chunk_id == 1 and "chunk 1" in str(exc)
            else:
                assert other == raw[CHUNK_HEADER_LEN:CHUNK_HEADER_LEN + 64]

    def test_concurrent_reads(self, dataset, make_source):
        with open_dataset(dataset) as ds, make_source() as source:
            expected = {c: (dataset / chunk_file_name(c)).read_bytes() for c in range(len(ds.index.chunks))}
            errors: list[BaseException] = []

            def reader(seed: int) -> None:
                try:
                    for i in range(200):
                        chunk = (seed + i) % len(expected)
                        offset = (i * 97) % max(1, len(expected[chunk]) - 64)
                        assert source.read(chunk, offset, 64) == expected[chunk][offset:offset + 64]
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []

    def test_reads_many_as_it_reads_one(self, dataset, make_source):
        """read_many: each blob's bytes as `read` gives them, in order, and in the place of one it cannot give, its
        error, naming the chunk."""
        with open_dataset(dataset) as ds, make_source() as source:
            entries = ds.index.entries
            files = entries[(entries["chunk"] != NO_CHUNK) & (entries["stored_len"] > 0)]
            blobs = [(int(c), int(o), int(n)) for c, o, n in zip(files["chunk"], files["offset"], files["stored_len"])]
            missing = len(ds.index.chunks) + 5
            blobs.insert(1, (missing, 0, 10))
            results = source.read_many(blobs)
            assert len(results) == len(blobs)
            assert isinstance(results[1], ChunkUnavailable) and results[1].chunk_id == missing
            for blob, result in zip(blobs[:1] + blobs[2:], results[:1] + results[2:]):
                assert bytes(result) == source.read(*blob)

    def test_is_a_chunk_source(self, make_source):
        with make_source() as source:
            assert isinstance(source, ChunkSource)
