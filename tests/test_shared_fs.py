"""bench/shared_fs.py, the simulated parallel file system the cluster bench runs on: a real model process and real
FUSE mounts, read with plain open and read. Each test checks one of the model's rules by the RPCs it counts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, wait_until

sys.path.insert(0, str(REPO / "bench"))
import shared_fs  # noqa: E402

if not os.path.exists("/dev/fuse"):
    pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested", allow_module_level=True)
pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")

KIB, MIB = 1024, 1 << 20
FAST = shared_fs.Parameters(mds_floor=0.0, oss_latency=0.0, page_cache=MIB)


def make_files(root: Path, sizes: dict[str, int]) -> Path:
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([len(name) % 256]) * size)
    return root


def read(path: Path, block: int = 1 << 20) -> bytes:
    """The file, in reads of `block` bytes (unbuffered: the reads the file system sees are these)."""
    with open(path, "rb", buffering=0) as opened:
        data = b""
        while chunk := opened.read(block):
            data += chunk
        return data


def epoch(fs: shared_fs.SharedFileSystem, name: str) -> dict:
    """The RPCs counted since the last mark, which this call ends (a new phase `name` begins)."""
    fs.mark(name)
    return fs.report()["phases"][-2]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_files(tmp_path / "shared", {"a/one.jpg": 100 * KIB, "a/two.jpg": 400 * KIB, "a/three.jpg": 400 * KIB,
                                            "b/four.jpg": 400 * KIB, "big.bin": 3 * MIB + 5})


def test_a_file_costs_an_intent_open_a_close_and_its_data_once_per_node(tree: Path, tmp_path: Path) -> None:
    with shared_fs.SharedFileSystem(tree, tmp_path / "fs", 2, FAST) as fs:
        epoch(fs, "first")
        assert read(fs.mountpoint(0) / "a/one.jpg") == (tree / "a/one.jpg").read_bytes()
        first = epoch(fs, "again")
        # The directory's lookup, the file's lookup (its intent-open: the open sends nothing more), the close.
        assert first["rpcs"] == {"lookup": 2, "close": 1, "read": 1}
        assert first["read_bytes"] == 100 * KIB
        read(fs.mountpoint(0) / "a/one.jpg")
        again = epoch(fs, "other node")
        # Names and attributes are cached, and so are the pages: an open and a close.
        assert again["rpcs"] == {"open": 1, "close": 1}
        read(fs.mountpoint(1) / "a/one.jpg")
        other = epoch(fs, "end")
        assert other["rpcs"] == {"lookup": 2, "close": 1, "read": 1}, "each node has its own caches"


def test_reads_travel_in_rpcs_of_at_most_a_mib_read_ahead_when_sequential(tree: Path, tmp_path: Path) -> None:
    with shared_fs.SharedFileSystem(tree, tmp_path / "fs", 1, shared_fs.Parameters(page_cache=16 * MIB)) as fs:
        epoch(fs, "big")
        assert read(fs.mountpoint(0) / "big.bin", 128 * KIB) == (tree / "big.bin").read_bytes()
        big = epoch(fs, "end")
        assert big["read_bytes"] == 3 * MIB + 5, "each byte once"
        # The first read alone (nothing says yet that the reader goes on), then the rest of its 1 MiB window and
        # the three after it (the last holds 5 bytes), read ahead.
        assert big["rpcs"]["read"] == 5


def test_the_page_cache_is_bounded(tree: Path, tmp_path: Path) -> None:
    with shared_fs.SharedFileSystem(tree, tmp_path / "fs", 1, FAST) as fs:
        mount = fs.mountpoint(0)
        for name in ("a/two.jpg", "a/three.jpg", "b/four.jpg"):  # 1.2 MiB through a 1 MiB page cache
            read(mount / name)
        epoch(fs, "reread")
        read(mount / "b/four.jpg")
        assert epoch(fs, "evicted")["rpcs"].get("read", 0) == 0, "the last file read is still cached"
        read(mount / "a/two.jpg")
        evicted = epoch(fs, "end")
        # Least recently used first, page by page: what 1.2 MiB left of the first file in 1 MiB was its start.
        assert evicted["rpcs"]["read"] == 1 and evicted["read_bytes"] == 3 * 400 * KIB - MIB


def test_metadata_latency_grows_with_the_background_load(tree: Path, tmp_path: Path) -> None:
    configured = {}
    for background in (0.0, 0.9):
        slow = shared_fs.Parameters(mds_capacity=1000, mds_background=background, mds_floor=1e-3, oss_latency=0.0)
        with shared_fs.SharedFileSystem(tree, tmp_path / f"fs{background}", 1, slow) as fs:
            for _ in range(40):
                read(fs.mountpoint(0) / "a/one.jpg")
            phase = fs.report()["phases"][-1]
        latency = phase["metadata_latency"]
        assert latency["count"] == 82  # two lookups, then an open and a close for each read
        assert latency["configured_p50"] >= 1e-3, "never under the floor"
        configured[background] = latency["configured_p50"]
    # Alone, an RPC waits for its own service (1 ms on average); with 90% of the server taken, about ten times that.
    assert configured[0.9] > configured[0.0] + 2e-3, configured


def test_ranks_meet_at_a_barrier_that_begins_a_phase(tree: Path, tmp_path: Path) -> None:
    with shared_fs.SharedFileSystem(tree, tmp_path / "fs", 1, FAST) as fs:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import shared_fs; "
                "shared_fs.control(__import__('pathlib').Path(sys.argv[2]), 'barrier', name='epoch 1', size=2)")
        waiting = [subprocess.Popen([sys.executable, "-c", code, str(REPO / "bench"), str(fs.socket)])
                   for _ in range(2)]
        for process in waiting:
            assert process.wait(30) == 0
        assert [phase["name"] for phase in fs.report()["phases"]] == ["start", "epoch 1"]


def test_a_mount_ends_when_the_model_dies_and_nothing_is_left(tree: Path, tmp_path: Path) -> None:
    with shared_fs.SharedFileSystem(tree, tmp_path / "fs", 2, FAST) as fs:
        processes = list(fs._processes)
        os.kill(processes[0].pid, signal.SIGKILL)  # the model
        wait_until(lambda: not any(os.path.ismount(m) for m in fs.mountpoints), "the mounts gone", 10)
    assert all(process.poll() is not None for process in processes)
    assert not any(mountpoint.exists() for mountpoint in fs.mountpoints) and not fs.socket.exists()


@pytest.mark.parametrize("option, value", [("--mds-background", "1.0"), ("--mds-capacity", "0"),
                                           ("--oss-bandwidth", "0"), ("--mds-floor", "-1"),
                                           ("--oss-in-flight", "0"), ("--rpc-size", "3000"), ("--mds-background", "nan"),
                                           ("--time-scale", "0.5"), ("--page-cache", "lots")])
def test_impossible_parameters_are_refused_in_one_line(tmp_path: Path, option: str, value: str) -> None:
    for script in ("shared_fs.py", "bench_cluster.py"):
        arguments = [str(tmp_path), str(tmp_path / "mnt")] if script == "shared_fs.py" else []
        proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *arguments, option, value],
                              capture_output=True, text=True, timeout=120)
        assert_one_line_error(proc, option)
