"""Large files stored in blocks (format 1.1): byte-exact at every boundary, each block decodable alone, a read
anywhere decodes about the blocks it touches, and packing one needs memory for a few blocks, not the file."""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, dir_bytes, run_cli
from fanstore import ChunkCorrupt, PackOptions, open_dataset, pack
from fanstore.core.format import FLAG_BLOCKED, chunk_file_name

BLOCK = 4096
ABOVE = 3 * BLOCK


def _options(**changes) -> PackOptions:
    return PackOptions(**{"codec": "zstd:3", "block_size": BLOCK, "blocks_above": ABOVE, "chunk_size": 16 * BLOCK,
                          "workers": 1, **changes})


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Files at and around every boundary: the threshold, whole blocks, one byte over; compressible, random and
    mixed blocks (some stored raw), and a file spanning several chunks."""
    root = tmp_path_factory.mktemp("blocks") / "src"
    root.mkdir()
    rng = np.random.default_rng(3)
    smooth = np.cumsum(rng.standard_normal(200_000)).astype(np.float32).tobytes()
    noise = rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    sizes = {"at_threshold.bin": ABOVE, "one_over.bin": ABOVE + 1, "whole_blocks.bin": 5 * BLOCK,
             "one_past_blocks.bin": 5 * BLOCK + 1, "many_chunks.bin": 150_000}
    for name, size in sizes.items():
        (root / name).write_bytes(smooth[:size])
    (root / "random.bin").write_bytes(noise[:9 * BLOCK + 17])
    (root / "mixed.bin").write_bytes(b"".join(noise[i * BLOCK:(i + 1) * BLOCK] if i % 2 else smooth[:BLOCK]
                                              for i in range(7)))
    (root / "small.txt").write_text("a small file stays whole\n")
    (root / "lines.txt").write_text("".join(f"line {i:05d} of a text file read with readline\n" for i in range(900)))
    (root / "empty").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def packed(tree, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("blocks_ds") / "ds"
    pack(tree, dest, _options())
    return dest


def test_every_file_reads_back_and_only_large_ones_are_blocked(tree, packed):
    with open_dataset(packed) as ds:
        assert ds.index.toc["version"] == "1.2" and ds.index.block_size == BLOCK
        for path in tree.iterdir():
            entry = ds.index.lookup(path.name)
            size = path.stat().st_size
            assert ds.read(path.name) == path.read_bytes(), path.name
            assert bool(ds.index.entries[entry]["flags"] & FLAG_BLOCKED) == (size > ABOVE), path.name
            assert ds.index.block_count(entry) == (-(-size // BLOCK) if size > ABOVE else 0)
        codecs = {ds.index.codecs[int(c)]["spec"] for c in ds.index.blocks["codec"]}
        assert codecs == {"none", "zstd:3"}  # random blocks stored as they are, the others compressed
        many = ds.index.lookup("many_chunks.bin")
        first = int(ds.index.entries[many]["offset"])
        chunks = set(ds.index.blocks["chunk"][first : first + ds.index.block_count(many)].tolist())
        assert len(chunks) > 1  # a file in blocks may span chunks
    assert run_cli("verify", str(packed)).returncode == 0


def test_random_reads_seeks_and_lines_through_the_api(tree, packed):
    rng = random.Random(8)
    with open_dataset(packed) as ds:
        for name in ("many_chunks.bin", "mixed.bin", "one_past_blocks.bin", "lines.txt"):
            original = (tree / name).read_bytes()
            with ds.open(name) as f:
                for _ in range(150):
                    offset = rng.randrange(len(original) + 5)
                    length = rng.choice([1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
                    f.seek(offset)
                    assert f.read(length) == original[offset:offset + length], (name, offset, length)
                f.seek(BLOCK - 3)
                assert f.read() == original[BLOCK - 3:]
        with ds.open("lines.txt") as f:
            assert [line for line in f] == (tree / "lines.txt").read_bytes().splitlines(keepends=True)
        with ds.open("one_past_blocks.bin") as f:
            f.seek(-2, os.SEEK_END)
            assert f.read() == (tree / "one_past_blocks.bin").read_bytes()[-2:]
            with pytest.raises(ValueError, match="whence"):
                f.seek(0, 7)


def test_a_read_decodes_only_the_blocks_it_touches(tree, packed):
    with open_dataset(packed) as ds:
        decoded: list[int] = []
        read_block = ds.reader.read_block

        def counting(entry: int, block: int) -> bytes:
            decoded.append(block)
            return read_block(entry, block)

        ds.reader.read_block = counting  # type: ignore[method-assign]
        original = (tree / "many_chunks.bin").read_bytes()
        rng = random.Random(2)
        with ds.open("many_chunks.bin") as f:
            for _ in range(100):
                offset = rng.randrange(len(original) - 4096)
                f.seek(offset)
                assert f.read(4096) == original[offset:offset + 4096]
            assert len(decoded) <= 100 * 2  # a 4 KiB read touches one block, or two across a boundary
            decoded.clear()
            f.seek(0)
            while f.read(1000):
                pass
            assert decoded == list(range(ds.index.block_count(ds.index.lookup("many_chunks.bin"))))


def test_same_bytes_whatever_the_worker_count(tree, packed, tmp_path):
    pack(tree, tmp_path / "two", _options(workers=2))
    assert dir_bytes(tmp_path / "two") == dir_bytes(packed)


def test_a_damaged_block_fails_its_file_only_and_is_named(tree, packed, tmp_path):
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-a", str(packed), str(damaged)], check=True)
    with open_dataset(damaged) as ds:
        entry = ds.index.lookup("many_chunks.bin")
        row = ds.index.blocks[int(ds.index.entries[entry]["offset"]) + 5]
        chunk, offset = int(row["chunk"]), int(row["offset"])
    chunk_path = damaged / chunk_file_name(chunk)
    data = bytearray(chunk_path.read_bytes())
    data[offset] ^= 0x40
    chunk_path.write_bytes(bytes(data))
    with open_dataset(damaged) as ds:
        with pytest.raises(ChunkCorrupt, match=r"many_chunks\.bin \(block 5\): checksum mismatch"):
            ds.read("many_chunks.bin")
        with ds.open("many_chunks.bin") as f:  # the blocks before and after still read
            assert f.read(5 * BLOCK) == (tree / "many_chunks.bin").read_bytes()[:5 * BLOCK]
            f.seek(6 * BLOCK)
            assert f.read(BLOCK) == (tree / "many_chunks.bin").read_bytes()[6 * BLOCK:7 * BLOCK]
        for path in tree.iterdir():
            if path.name != "many_chunks.bin":
                assert ds.read(path.name) == path.read_bytes()
    verify = run_cli("verify", str(damaged))
    assert verify.returncode == 1 and "BAD many_chunks.bin (block 5)" in verify.stdout and "1 bad" in verify.stdout


def test_bad_block_options_are_one_line(tree, tmp_path):
    from conftest import assert_one_line_error

    for option, value in (("--block-size", "1K"), ("--block-size", "2GiB"), ("--blocks-above", "lots")):
        assert_one_line_error(run_cli("fanstore-pack", str(tree), str(tmp_path / "ds"), option, value), option)


# Runs argv[2:] and writes the largest RSS any process of it reached to argv[1]. A process started straight from
# pytest would inherit pytest's high-water RSS (Linux keeps the largest RSS across exec, and a vfork child shares
# its parent's memory until then): with torch imported at collection, pytest holds several hundred MiB. This small
# launcher's own RSS is all the command can inherit.
_PEAK_RSS_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _peak_rss_of(command: list[str], tmp_path: Path) -> tuple[int, subprocess.CompletedProcess]:
    """Run `command` and return the largest RSS any process of it reached (workers included), in bytes."""
    report = tmp_path / "peak-rss"
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS_LAUNCHER, str(report), *command], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return int(report.read_text()), done


def test_packing_a_large_file_needs_a_few_blocks_of_memory_not_the_file(tmp_path):
    """1 GiB (sparse, so it costs no disk) packed by two workers: blocks are read and compressed one batch at a
    time, so no process holds the file. Stored whole, the worker and the packer would each hold all of it."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "huge.bin", "wb") as f:
        f.truncate(1 << 30)
        f.seek(123_456_789)
        f.write(b"a needle in the haystack")
    code = "import sys; from fanstore.cli import pack_main; sys.exit(pack_main())"
    peak, done = _peak_rss_of([sys.executable, "-c", code, str(src), str(tmp_path / "ds"), "--workers", "2",
                               "--quiet"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert peak < 200 << 20, f"peak RSS {peak >> 20} MiB while packing a 1 GiB file"
    with open_dataset(tmp_path / "ds") as ds, ds.open("huge.bin") as f:
        f.seek(123_456_789 - 5)
        assert f.read(34) == b"\0" * 5 + b"a needle in the haystack" + b"\0" * 5
        assert ds.index.block_count(ds.index.lookup("huge.bin")) == 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 1 << 30  # this test did not read it whole


def test_blosc_auto_shuffles_every_block_by_the_npy_element_size(tmp_path):
    # Only a .npy file's first block holds its header: the other blocks of a float64 array were shuffled by 4 bytes,
    # not 8, and stored 17% more than `:8` on a smooth field (the selector measured its pieces the same wrong way).
    src = tmp_path / "src"
    src.mkdir()
    field = np.sin(np.linspace(0, 60, 12 * BLOCK // 8)) * 1000 + np.round(np.linspace(0, 100, 12 * BLOCK // 8), 2)
    np.save(src / "field.npy", field.astype(np.float64))
    stored = {}
    for typesize in ("auto", "8"):
        dest = tmp_path / typesize
        pack(src, dest, _options(codec=f"blosc:zstd:5:shuffle:{typesize}"))
        with open_dataset(dest) as ds:
            entry = ds.index.entries[ds.index.lookup("field.npy")]
            assert entry["flags"] & FLAG_BLOCKED and ds.read("field.npy") == (src / "field.npy").read_bytes()
            stored[typesize] = int(entry["stored_len"])
    assert stored["auto"] == stored["8"]


def test_the_selector_measures_a_piece_as_the_packer_stores_its_block():
    from selector.measure import measure_kind
    from selector.sample import SampleFile

    import io

    array = np.cumsum(np.random.default_rng(5).standard_normal(40_000)).astype(np.float64)
    buffer = io.BytesIO()
    np.save(buffer, array)
    data = buffer.getvalue()
    piece = SampleFile("a.npy", "npy", 0, data[BLOCK:2 * BLOCK], len(data), offset=BLOCK, file_pieces=2,
                       head=data[:512])
    auto, eight = measure_kind("npy", [piece], ["blosc:zstd:5:shuffle:auto", "blosc:zstd:5:shuffle:8"], repeats=1)
    assert auto.stored_bytes == eight.stored_bytes
