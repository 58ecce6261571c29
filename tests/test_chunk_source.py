"""The local chunk source passes the shared ChunkSource contract, and checks chunk headers (wrong ones are corrupt)."""

from __future__ import annotations

import pytest

from chunk_source_contract import ChunkSourceContract
from fanstore import open_dataset
from fanstore.chunk_source import LocalChunkSource
from fanstore.errors import ChunkCorrupt
from fanstore.format import chunk_file_name


class TestLocalChunkSource(ChunkSourceContract):
    @pytest.fixture
    def make_source(self, dataset):
        with open_dataset(dataset) as ds:
            sizes = ds.index.chunks["size"].copy()
        return lambda: LocalChunkSource(dataset, sizes)


def test_chunk_with_a_wrong_header_is_refused(tmp_path):
    from conftest import make_tree
    from fanstore import PackOptions, pack

    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    first, second = dest / chunk_file_name(0), dest / chunk_file_name(1)
    swapped = second.read_bytes()[:32] + first.read_bytes()[32:]
    first.write_bytes(swapped)
    with LocalChunkSource(dest, sizes) as source, pytest.raises(ChunkCorrupt, match="holds chunk 1"):
        source.read(0, 32, 4)
    first.write_bytes(b"JUNKJUNK" + swapped[8:])
    with LocalChunkSource(dest, sizes) as source, pytest.raises(ChunkCorrupt, match="not a fanstore chunk"):
        source.read(0, 32, 4)
