"""A real pack process killed with SIGKILL at several points resumes to byte-identical output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, dir_bytes, run_cli

ARGS = ["--codec", "zstd-dict:19", "--chunk-size", "256KiB", "--replicate", "val/**", "--workers", "2", "--quiet"]


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory) -> Path:
    """Enough data at a slow level that a pack takes a few seconds and writes dozens of chunks."""
    root = tmp_path_factory.mktemp("resume") / "src"
    rng = np.random.default_rng(11)
    for split, count in (("train", 700), ("val", 150)):
        for i in range(count):
            folder = root / split / f"class_{i % 7}"
            folder.mkdir(parents=True, exist_ok=True)
            smooth = np.cumsum(rng.standard_normal(4096 + (i % 5) * 1024)).astype(np.float32)
            (folder / f"sample_{i:04d}.npy").write_bytes(smooth.tobytes())
    (root / "empty").mkdir()
    (root / "zero.bin").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def reference(big_tree, tmp_path_factory) -> dict[str, bytes]:
    dest = tmp_path_factory.mktemp("reference") / "ds"
    run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    return dir_bytes(dest)


def _start_pack(src: Path, dest: Path) -> subprocess.Popen:
    code = "import sys; from fanstore.cli import pack_main; sys.exit(pack_main())"
    return subprocess.Popen([sys.executable, "-c", code, str(src), str(dest), *ARGS],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _chunks_written(dest: Path) -> int:
    chunk_dir = dest / "chunks"
    return sum(1 for p in chunk_dir.iterdir() if p.suffix == ".fsc") if chunk_dir.is_dir() else 0


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("kill_after_chunks", [0, 1, 5, 20])
def test_sigkill_then_resume_is_byte_identical(big_tree, reference, tmp_path, kill_after_chunks):
    dest = tmp_path / "ds"
    proc = _start_pack(big_tree, dest)
    deadline = time.monotonic() + 60
    while _chunks_written(dest) < kill_after_chunks and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if kill_after_chunks == 0:
        time.sleep(0.3)  # mid-walk or mid-dictionary-training
    assert proc.poll() is None, "the pack finished before it could be killed; make the test tree larger"
    _kill_group(proc)
    assert not (dest / "fanstore.index").exists(), "an interrupted pack must not look complete"
    resumed = run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert "packed" in resumed.stdout
    if kill_after_chunks >= 5:
        assert "chunks kept from the interrupted run" in resumed.stdout
    assert dir_bytes(dest) == reference


def test_killed_twice_then_resumed(big_tree, reference, tmp_path):
    dest = tmp_path / "ds"
    for target in (3, 12):
        proc = _start_pack(big_tree, dest)
        while _chunks_written(dest) < target and proc.poll() is None:
            time.sleep(0.005)
        _kill_group(proc)
    run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert dir_bytes(dest) == reference


def test_resume_with_other_options_is_refused(big_tree, tmp_path):
    dest = tmp_path / "ds"
    proc = _start_pack(big_tree, dest)
    while _chunks_written(dest) < 2 and proc.poll() is None:
        time.sleep(0.005)
    _kill_group(proc)
    other = run_cli("fanstore-pack", str(big_tree), str(dest), "--codec", "lz4", "--quiet")
    assert other.returncode != 0 and "interrupted pack" in other.stderr and "Traceback" not in other.stderr
    forced = run_cli("fanstore-pack", str(big_tree), str(dest), "--codec", "lz4", "--quiet", "--force")
    assert forced.returncode == 0, forced.stderr
