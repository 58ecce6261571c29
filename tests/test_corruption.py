"""A byte flipped anywhere in a chunk is reported for exactly the file it hits; every other file still reads."""

from __future__ import annotations

import random

import pytest

from conftest import run_cli
from fanstore import ChunkCorrupt, PackOptions, open_dataset, pack
from fanstore.core.format import CHUNK_HEADER_LEN, chunk_file_name


@pytest.fixture
def packed(source_tree, tmp_path):
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", chunk_size=32 * 1024, workers=1))
    return dest


def _blob_owner(ds, chunk_id, offset):
    for entry in ds.index.iter_files():
        rec = ds.index.entries[entry]
        if int(rec["chunk"]) == chunk_id and int(rec["offset"]) <= offset < int(rec["offset"]) + int(rec["stored_len"]):
            return ds.index.path_of(entry)
    raise AssertionError("offset is in no blob")


def test_each_flipped_byte_hits_exactly_one_file(packed, source_tree):
    rng = random.Random(5)
    with open_dataset(packed) as ds:
        chunk_sizes = [int(s) for s in ds.index.chunks["size"]]
    for _ in range(12):
        chunk_id = rng.randrange(len(chunk_sizes))
        offset = rng.randrange(CHUNK_HEADER_LEN, chunk_sizes[chunk_id])
        path = packed / chunk_file_name(chunk_id)
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            with open_dataset(packed) as ds:
                victim = _blob_owner(ds, chunk_id, offset)
                bad = []
                for entry in ds.index.iter_files():
                    name = ds.index.path_of(entry)
                    try:
                        assert ds.read(name) == (source_tree / name).read_bytes()
                    except ChunkCorrupt as exc:
                        assert name in str(exc) and f"chunk {chunk_id}" in str(exc)
                        assert exc.chunk_id == chunk_id
                        bad.append(name)
                assert bad == [victim]
            verify = run_cli("verify", str(packed))
            assert verify.returncode == 1
            assert [line for line in verify.stdout.splitlines() if line.startswith("BAD")] == [
                line for line in verify.stdout.splitlines() if line.startswith(f"BAD {victim}:")
            ]
            assert f"BAD {victim}:" in verify.stdout and "1 bad" in verify.stdout
        finally:
            path.write_bytes(original)


def test_missing_or_truncated_chunk_affects_only_its_files(packed, source_tree):
    victim_chunk = 1
    path = packed / chunk_file_name(victim_chunk)
    path.write_bytes(path.read_bytes()[:-5])
    with open_dataset(packed) as ds:
        for entry in ds.index.iter_files():
            name = ds.index.path_of(entry)
            chunk = int(ds.index.entries[entry]["chunk"])
            if chunk == victim_chunk:
                with pytest.raises(ChunkCorrupt, match=f"chunk {victim_chunk}"):
                    ds.read(name)
            else:
                assert ds.read(name) == (source_tree / name).read_bytes()
    path.unlink()
    verify = run_cli("verify", str(packed))
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    with open_dataset(packed) as ds:
        in_chunk = int((ds.index.entries["chunk"] == victim_chunk).sum())
    assert f"{in_chunk} bad" in verify.stdout


def test_a_chunk_cut_short_says_both_sizes_with_thousands_separators(tmp_path):
    """A chunk file cut short said `chunk 0 is 1000 bytes, the index says 4754356`: a byte count without the
    thousands separators every other count has (docs/OUTPUT.md: `stored bytes 321,407 (321 kB)`)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(random.Random(0).randbytes(12_345))
    pack(src, tmp_path / "ds", PackOptions(codec="none", workers=1))
    path = tmp_path / "ds" / chunk_file_name(0)
    size = path.stat().st_size
    with open(path, "r+b") as chunk_file:
        chunk_file.truncate(1_000)
    verify = run_cli("verify", str(tmp_path / "ds"))
    assert verify.returncode == 1, verify.stderr
    assert f"chunk 0 is 1,000 bytes, the index says {size:,}" in verify.stdout, verify.stdout


def test_a_checksum_mismatch_says_offset_and_length_with_thousands_separators(tmp_path):
    """verify's line for a damaged blob said `(chunks/00000000.fsc at offset 4504, 110602 bytes)`: exact counts
    without the separators docs/OUTPUT.md gives them."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(random.Random(0).randbytes(2_000))
    (src / "b.bin").write_bytes(random.Random(1).randbytes(12_345))
    pack(src, tmp_path / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        row = ds.index.entries[ds.resolve("b.bin")]
        offset, length = int(row["offset"]), int(row["stored_len"])
    with open(tmp_path / "ds" / chunk_file_name(0), "r+b") as chunk_file:
        chunk_file.seek(offset + 10)
        byte = chunk_file.read(1)
        chunk_file.seek(offset + 10)
        chunk_file.write(bytes([byte[0] ^ 0xFF]))
    verify = run_cli("verify", str(tmp_path / "ds"))
    assert verify.returncode == 1, verify.stderr
    assert f"BAD b.bin: checksum mismatch in chunk 0 (chunks/00000000.fsc at offset {offset:,}, 12,345 bytes)" in \
        verify.stdout, verify.stdout
