"""What the CLI's help and messages say is what the code does: each claim that was once wrong is checked here
against the behaviour it describes, through the real CLI."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from conftest import run_cli
from fanstore import open_dataset
from fanstore.fuse_ops import INLINE_DECODE_BYTES
from fanstore.info import SKIPPED_SHOWN

CHUNK_SIZE = 4096


def _help(*command: str) -> str:
    """A command's --help, its lines joined (argparse wraps them at the terminal's width)."""
    return " ".join(run_cli(*command, "--help", check=True).stdout.split())


def test_chunk_size_bounds_chunks_of_stored_blobs_not_files(tmp_path: Path) -> None:
    """--chunk-size speaks of blobs: a chunk holding several is at most SIZE, a blob larger than SIZE is alone in
    its chunk, and a file larger than SIZE stored in blocks is spread over chunks (it does not get one)."""
    assert "next stored blob (a file stored whole, or one block) would take it past SIZE" in _help("pack")
    assert "a blob larger than SIZE gets a chunk of its own" in _help("pack")
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    src.mkdir()
    for number in range(12):
        (src / f"row_{number:02d}.txt").write_text(" ".join(map(str, rng.integers(0, 99, 300))))
    (src / "whole.bin").write_bytes(rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    (src / "blocks.bin").write_bytes(rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(src), str(dest), "--codec", "zstd:3", "--chunk-size", str(CHUNK_SIZE),
            "--block-size", "4KiB", "--blocks-above", "12KiB", "--workers", "1", "--quiet", check=True)
    with open_dataset(dest) as ds:
        chunks = ds.index.chunks
        assert (chunks["size"][chunks["files"] > 1] <= CHUNK_SIZE).all() and (chunks["files"] > 1).any()
        whole = ds.index.lookup("whole.bin")
        assert int(ds.index.entries["stored_len"][whole]) > CHUNK_SIZE
        assert chunks["files"][int(ds.index.entries["chunk"][whole])] == 1
        blocked = ds.index.block_rows(ds.index.lookup("blocks.bin"))
        assert len(set(ds.index.blocks["chunk"][blocked.start : blocked.stop].tolist())) > 1


def test_prefetch_help_names_the_size_below_which_nothing_is_prefetched() -> None:
    """Prefetch skips blobs stored in fewer than --prefetch-min-size bytes (the mount's default, fuse_ops'
    INLINE_DECODE_BYTES; test_mount checks the behaviour); both commands' --prefetch help says so."""
    assert INLINE_DECODE_BYTES == 256 << 10
    mount_help = _help("mount")
    assert "decode ahead those of the next N files (in --prefetch-list order, else directory order) stored in at " \
           "least --prefetch-min-size bytes" in mount_help
    assert "--prefetch-min-size SIZE prefetch only files stored in at least SIZE bytes (default 256KiB" in mount_help
    assert "the next N files that are stored on another node or in at least 256KiB" in _help("serve")


def _make_fifos(src: Path, count: int) -> list[str]:
    (src / "pipes").mkdir(parents=True)
    for number in range(count):
        os.mkfifo(src / "pipes" / f"fifo_{number:03d}")
    (src / "data.txt").write_text("kept\n")
    return [f"pipes/fifo_{number:03d}" for number in range(count)]


def test_every_skipped_path_is_listed_or_counted_with_how_to_list_them(tmp_path: Path) -> None:
    """The pack warns of 20 and `fanstore info` lists 50; each says how many more and names the command that lists
    every one, and that command does."""
    count = SKIPPED_SHOWN + 10
    fifos = _make_fifos(tmp_path / "src", count)
    dest = tmp_path / "ds"
    packed = run_cli("fanstore-pack", str(tmp_path / "src"), str(dest), "--quiet", check=True)
    command = f"`fanstore info {dest} --all-skipped`"
    warnings = [line for line in packed.stderr.splitlines() if line.startswith("warning:")]
    assert warnings[-1] == f"warning: ... and {count - 20} more skipped ({command} lists them all)"
    assert len(warnings) == 21 and f"{count} skipped" in packed.stdout

    def listed(output: str) -> list[str]:
        return [line.split(":")[0].strip() for line in output.splitlines() if line.startswith("  pipes/")]

    info = run_cli("info", str(dest), check=True).stdout
    assert f"skipped      {count} path(s):" in info
    assert listed(info) == fifos[:SKIPPED_SHOWN]
    assert f"  ... and {count - SKIPPED_SHOWN} more: {command} lists them all" in info.splitlines()
    every = run_cli("info", str(dest), "--all-skipped", check=True).stdout
    assert listed(every) == fifos and "more:" not in every
