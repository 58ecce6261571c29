"""The Python API as the README describes it: what it keeps between reads."""

from __future__ import annotations

import pytest

from fanstore import ChunkCorrupt, PackOptions, open_dataset, pack
from fanstore.core.format import chunk_file_name


def test_the_api_keeps_no_decoded_cache(source_tree, tmp_path):
    """README: every `read` reads, verifies and decodes the file again. A blob damaged after a first read fails
    the second: had the first read's bytes been kept, the second would have returned them."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds:
        original = (source_tree / "labels.txt").read_bytes()
        assert ds.read("labels.txt") == original
        with ds.open("labels.txt") as opened:
            assert opened.read() == original
        entry = ds.index.lookup("labels.txt")
        chunk, offset = int(ds.index.entries["chunk"][entry]), int(ds.index.entries["offset"][entry])
        with open(dest / chunk_file_name(chunk), "r+b") as chunk_file:  # the same inode the dataset has open
            chunk_file.seek(offset)
            first = chunk_file.read(1)
            chunk_file.seek(offset)
            chunk_file.write(bytes([first[0] ^ 0xFF]))
        with pytest.raises(ChunkCorrupt, match="labels.txt"):
            ds.read("labels.txt")
        with pytest.raises(ChunkCorrupt, match="labels.txt"), ds.open("labels.txt") as reopened:
            reopened.read()
