"""`fanstore serve` on three separate nodes (tests/separate_nodes.py) whose links lose datagrams or go down, as real
networks do: the doorbells stay on, a cut node is given up on, and every file arrives whole. Losses come from
SeparateNodes' link impairer (raw packet sockets), where the kernel has no netem."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from fanstore import PackOptions, pack
from fanstore.mount.mount import fuse_unavailable_reason
from separate_nodes import SeparateNodes, unavailable_reason
from test_separate_nodes import LOCAL_DIR, MOUNTPOINT, environment, kill_what_is_left
from test_serve import MPIEXEC, RANKS, _mpi_unavailable_reason


def _impairer_unavailable_reason() -> str | None:
    """Why a link cannot be made lossy here: SeparateNodes' link impairer needs raw packet sockets."""
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    except OSError as exc:
        return f"no raw packet sockets (AF_PACKET: {exc.strerror}) for the link impairer"
    return None


_REASON = fuse_unavailable_reason() or _mpi_unavailable_reason() or unavailable_reason()
_REASON = _REASON or _impairer_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs FUSE, MPI, namespaces and raw sockets: {_REASON}")

# Each rank named in READERS reads every file through FileDataset(None) (the node's serve process), THREADS batches at
# once, and compares each with SRC: each batch asks the serving ranks for several blobs in one request each.
READER = r"""
import os, sys, threading
from fanstore.errors import say_line
from fanstore.torch import FileDataset
src, threads, batch, readers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
names = names if os.environ["FANSTORE_RANK"] in readers else []
problems = []
with FileDataset(None, paths=names) as dataset:
    batches = [list(range(i, min(i + batch, len(names)))) for i in range(0, len(names), batch)]
    def read(first):
        for items in batches[first::threads]:
            for item, data in zip(items, dataset[items]):
                with open(os.path.join(src, names[item]), "rb") as original:
                    if original.read() != bytes(data):
                        problems.append(names[item])
    readers = [threading.Thread(target=read, args=(k,)) for k in range(threads)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
say_line(f"rank {os.environ['FANSTORE_RANK']}: " + ("ok" if not problems else f"differs: {problems[:3]}"), sys.stdout)
sys.exit(1 if problems else 0)
"""


def _incompressible(base: Path, count: int, size: int, seed: int, chunk_size: int) -> tuple[Path, Path]:
    """SRC of `count` files of `size` random bytes in four folders, and DEST packed from it."""
    src, dest = base / "src", base / "dest"
    rng = np.random.default_rng(seed)
    for number in range(count):
        folder = src / f"d{number % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{number:03d}.bin").write_bytes(rng.integers(0, 256, size, np.uint8).tobytes())
    pack(src, dest, PackOptions(codec="zstd:1", chunk_size=chunk_size, workers=1))
    return src, dest


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """48 files of 256 KiB that do not compress: 4 MiB stored on each node."""
    return _incompressible(tmp_path_factory.mktemp("adversity"), 48, 256 << 10, 5, 1 << 20)


@pytest.fixture(scope="module")
def large_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """24 files of 1 MiB that do not compress: replies of several MiB, which MPI sends by rendezvous (the send
    completes once the receiver has the bytes, not once they are buffered)."""
    return _incompressible(tmp_path_factory.mktemp("adversity_large"), 24, 1 << 20, 6, 4 << 20)


def run_job(dest: Path, src: Path, tmp_path: Path, serve_options: list[str], threads: int, batch: int,
            readers: tuple[int, ...], impaired: dict[int, str]) -> tuple[int, str, str]:
    """A job of separate nodes whose links are impaired as SeparateNodes takes it, every rank running READER: its
    status, stdout and stderr."""
    reader = tmp_path / "reader.py"
    reader.write_text(READER)
    with SeparateNodes(RANKS, tmp_path, keep_visible=[src.parent], impaired=impaired) as nodes:
        serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR, "--stats",
                 "--quiet", *serve_options, "--", sys.executable, str(reader), str(src), str(threads), str(batch),
                 ",".join(map(str, readers))]
        job = subprocess.Popen([str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(nodes),
                               start_new_session=True)
        try:
            out, err = job.communicate(timeout=240)
        finally:
            kill_what_is_left(job, dest)
    return job.returncode, out, err


def peer_lines(out: str, rank: int) -> dict[int, tuple[int, int]]:
    """Rank `rank`'s --stats: blobs fetched from and failed with each peer."""
    block = re.search(rf"^rank {rank} \(.*?(?=^rank |^job |\Z)", out, re.M | re.S)
    assert block is not None, out
    return {int(peer): (int(fetched.replace(",", "")), int(failed.replace(",", "")))
            for peer, fetched, failed in re.findall(r"^  from rank (\d+): ([\d,]+) blobs? .*; failed ([\d,]+),",
                                                    block[0], re.M)}


@pytest.mark.parametrize("udp_loss", [0.5, 1.0])
def test_doorbells_stay_on_when_the_link_loses_some_datagrams(dataset: tuple[Path, Path], tmp_path: Path,
                                                              udp_loss: float) -> None:
    """Node 2's link loses half the UDP datagrams that cross it (tests/separate_nodes.py's impairer, where the kernel
    has no netem): the start-up check's rings are rung again until acknowledged, so the bells stay on (rung once,
    4 datagrams crossing it, they were off in 4 jobs of 4). Where it loses every one, they are off on every rank,
    and the job runs without them. Either way every file is read right."""
    src, dest = dataset
    code, out, err = run_job(dest, src, tmp_path, [], threads=2, batch=4, readers=(0, 1, 2),
                             impaired={2: f"0 0 0 {udp_loss}"})
    assert code == 0, out + err
    assert out.count(": ok\n") == RANKS, out + err
    bells = "on" if udp_loss < 1 else "off"
    assert ("doorbells off" in err) == (bells == "off"), err
    assert len(re.findall(rf"^rank \d \(node\d\): .* doorbell {bells}\b", out, re.M)) == RANKS, out


# Each rank reads every file in batches of 8 through FileDataset(None) until STOP exists (STOP-reading-RANK once
# it has read every file once).
READ_UNTIL = r"""
import os, sys
from fanstore.errors import say_line
from fanstore.torch import FileDataset
src, stop = sys.argv[1], sys.argv[2]
names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
original = {name: open(os.path.join(src, name), "rb").read() for name in names}
problems = []
with FileDataset(None, paths=names) as dataset:
    while not os.path.exists(stop):
        for first in range(0, len(names), 8):
            items = list(range(first, min(first + 8, len(names))))
            problems += [names[item] for item, data in zip(items, dataset[items])
                         if bytes(data) != original[names[item]]]
        open(f"{stop}-reading-{os.environ['FANSTORE_RANK']}", "w").close()
say_line(f"rank {os.environ['FANSTORE_RANK']}: " + ("ok" if not problems else f"differs: {problems[:3]}"), sys.stdout)
sys.exit(1 if problems else 0)
"""


def test_a_link_that_goes_down_mid_read_is_given_up_on_by_every_rank(large_files: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    """Node 2's link goes down for 8 s (4 deadlines) while every node reads and answers the others: each of nodes 0
    and 1 gives node 2 up and reads its files from DEST meanwhile, even the one that was sending node 2 a reply when
    the link went (its clock runs, only longer); nothing differs, the job ends with status 0 once it is back."""
    src, dest = large_files
    reader = tmp_path / "read_until.py"
    reader.write_text(READ_UNTIL)
    with SeparateNodes(RANKS, tmp_path, keep_visible=[src.parent]) as nodes:
        serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR, "--stats",
                 "--quiet", "--peer-timeout", "2", "--peer-retry", "30", "--", sys.executable, str(reader), str(src),
                 str(tmp_path / "stop")]
        job = subprocess.Popen([str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(nodes),
                               start_new_session=True)
        try:
            wait_until(lambda: job.poll() is not None or all(
                (tmp_path / f"stop-reading-{rank}").exists() for rank in range(RANKS)), "every node reading", 120)
            assert job.poll() is None, job.communicate()
            nodes.set_link(2, up=False)
            time.sleep(8)
            nodes.set_link(2, up=True)
            (tmp_path / "stop").touch()
            out, err = job.communicate(timeout=120)
        finally:
            kill_what_is_left(job, dest)
    assert job.returncode == 0, out + err
    assert out.count(": ok\n") == RANKS, out + err
    for rank in (0, 1):
        assert peer_lines(out, rank)[2][1] > 0, out  # requests to node 2 given up on
    fallbacks = re.findall(r"^  from DEST \(fallback\): ([\d,]+) blobs", out, re.M)
    assert len(fallbacks) == RANKS and all(int(count.replace(",", "")) > 0 for count in fallbacks), out
    assert "Traceback" not in err, err
