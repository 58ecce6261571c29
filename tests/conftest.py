"""Shared helpers: a small realistic source tree, tree digests, and running the real CLI in a subprocess."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def make_tree(root: Path) -> Path:
    """Files of the kinds a training set has, plus the awkward cases: empty files and dirs, symlinks, odd names."""
    rng = np.random.default_rng(7)
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "dog").mkdir(parents=True)
    (root / "val" / "cat").mkdir(parents=True)
    (root / "empty_dir" / "nested_empty").mkdir(parents=True)
    for i in range(40):
        label = "cat" if i % 2 else "dog"
        header = b"\x89PNG\r\n\x1a\n" + i.to_bytes(4, "little")
        (root / "train" / label / f"img_{i:03d}.png").write_bytes(header + rng.integers(0, 8, 3000, np.uint8).tobytes())
    for i in range(10):
        (root / "val" / "cat" / f"img_{i:03d}.png").write_bytes(rng.integers(0, 256, 2000, np.uint8).tobytes())
    field = np.cumsum(rng.standard_normal((64, 256)), axis=1).astype(np.float32)
    np.save(root / "field.npy", field)
    (root / "labels.txt").write_text("".join(f"train/x/img_{i:03d}.png\t{i % 2}\n" for i in range(40)))
    (root / "empty.txt").write_bytes(b"")
    (root / "random.bin").write_bytes(rng.integers(0, 256, 200_000, np.uint8).tobytes())
    (root / "名前 with spaces.txt").write_text("unicode name\n" * 20)
    os.symlink("field.npy", root / "latest.npy")
    os.symlink("train/cat", root / "cats")
    return root


def numbered_files(root: Path, count: int, size: Callable[[int], int]) -> list[str]:
    """`count` files in a new directory `root`: f000.bin holds the byte 0 `size(0)` times, f001.bin the byte 1, and
    so on, so no two neighbours are alike. Their names, in directory order."""
    root.mkdir(parents=True)
    names = [f"f{number:03d}.bin" for number in range(count)]
    for number, name in enumerate(names):
        (root / name).write_bytes(bytes([number % 256]) * size(number))
    return names


def python2_npy(array: np.ndarray) -> bytes:
    """`array` as numpy on Python 2 saved it: a version 1.0 .npy whose header writes the shape's integers as longs,
    `(64L, 256L)`, which Python 3 cannot read without filtering (numpy's loader then warns)."""
    shape = "(" + "".join(f"{length}L, " for length in array.shape).rstrip(" ") + ")"
    header = f"{{'descr': '{array.dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"  # the array starts at a multiple of 64 bytes
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1") + array.tobytes()


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src")


def tree_digest(root: Path) -> dict[str, str]:
    """Path -> sha256 of content (files), 'dir' (directories) or 'link:TARGET' (symlinks)."""
    result = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                result[rel] = "link:" + os.readlink(full)
            elif full.is_dir():
                result[rel] = "dir"
            else:
                result[rel] = hashlib.sha256(full.read_bytes()).hexdigest()
    return result


def dataset_digest(ds) -> dict[str, str]:
    """The same digest, taken through the Python API."""
    import stat

    result = {}
    for dirpath, dirnames, filenames in ds.walk():
        for name in dirnames + filenames:
            rel = f"{dirpath}/{name}" if dirpath else name
            mode = ds.stat(rel, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                result[rel] = "link:" + ds.readlink(rel)
            elif stat.S_ISDIR(mode):
                result[rel] = "dir"
            else:
                result[rel] = hashlib.sha256(ds.read(rel)).hexdigest()
    return result


def dir_bytes(root: Path) -> dict[str, bytes]:
    """Every file of a dataset directory, for byte-identity checks."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def flip_byte(path: Path, offset: int) -> None:
    """Damage a file in place: the byte at `offset`, inverted."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def run_cli(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Runs `python -m fanstore ARGS` (or `fanstore-pack` with args[0] == 'fanstore-pack') for real, in the checkout
    unless `cwd` says where, with the variables of `env` added to this process's environment."""
    if args and args[0] == "fanstore-pack":
        cmd = [sys.executable, "-c", "import sys; from fanstore.__main__ import pack_main; sys.exit(pack_main())", *args[1:]]
    else:
        cmd = [sys.executable, "-m", "fanstore", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **kwargs.pop("env", {})}
    kwargs.setdefault("cwd", REPO)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A bad input ends with a non-zero exit and one error line naming the culprit, never a traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


class PausedPack:
    """A real fanstore-pack process that stops at a pause point (fanstore/core/pause.py): `wait` returns once it is
    there, so a test kills it, or fills its disk, at exactly that moment and not whenever a poll happens to look."""

    def __init__(self, src: Path, dest: Path, args: list[str], event: str, pause_dir: Path) -> None:
        self.event = event
        self.dir = pause_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("paused", "resume"):
            (self.dir / name).unlink(missing_ok=True)
        code = "import sys; from fanstore.__main__ import pack_main; sys.exit(pack_main())"
        env = {**os.environ, "PYTHONPATH": str(REPO), "FANSTORE_PAUSE_AT": event, "FANSTORE_PAUSE_DIR": str(self.dir)}
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(src), str(dest), *args], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def wait(self, timeout: float = 180) -> "PausedPack":
        deadline = time.monotonic() + timeout
        while not (self.dir / "paused").exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the pack ended ({self.proc.returncode}) before pausing at {self.event}: "
                                     f"{self.proc.stderr.read()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the pack did not reach {self.event} in {timeout} s")
            time.sleep(0.01)
        return self

    def resume(self) -> subprocess.CompletedProcess:
        (self.dir / "resume").write_text("")
        out, err = self.proc.communicate(timeout=300)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill_group(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=60)


@pytest.fixture
def paused_pack(tmp_path):
    """Starts PausedPacks and waits for them to pause; any still running when the test ends (it failed before
    resuming or killing one) is killed with its workers, so no paused pack outlives its test."""
    started: list[PausedPack] = []

    def start(src: Path, dest: Path, args: list[str], event: str) -> PausedPack:
        paused = PausedPack(src, dest, args, event, tmp_path / f"pause-{len(started)}")
        started.append(paused)
        return paused.wait()

    yield start
    for paused in started:
        if paused.proc.poll() is None:
            paused.kill_group()


@contextlib.contextmanager
def mounted(target: Path, *mount_args: str, purpose: str) -> Iterator[Path]:
    """`mount MOUNT_ARGS TARGET` for the block (detached after it), or the test skipped: it cannot `purpose` here."""
    done = subprocess.run(["mount", *mount_args, str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot {purpose} (needs root): {done.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)])


def wait_until(condition, what: str, timeout: float = 60) -> None:
    """Poll `condition` until it holds: the barrier tests use in place of sleeping and hoping."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.002)


def auto_unmount_helpers(mountpoint: Path) -> list[int]:
    """The fusermount3 processes libfuse left waiting to unmount `mountpoint` once its daemon is gone (the mount
    option auto_unmount), found by their command line: `fusermount3 -o OPTIONS -- MOUNTPOINT`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"fusermount3" and argv[-1] == os.fsencode(mountpoint):
            found.append(int(pid))
    return found


def kill_auto_unmount_helper(mountpoint: Path) -> None:
    """SIGKILL the auto-unmount helper of the mount at `mountpoint` (it blocks every other signal), and wait until
    it is gone: a test that kills the daemon next leaves a stale mount, as a daemon killed with its helper does."""
    helpers = auto_unmount_helpers(mountpoint)
    assert helpers, f"no auto-unmount helper serves {mountpoint}"
    for pid in helpers:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not auto_unmount_helpers(mountpoint), f"the auto-unmount helper of {mountpoint} gone", 10)


def listened_on(path: Path) -> bool:
    """Whether a process listens on the Unix socket `path` (a killed one's closes as its exit ends)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as reader:
        try:
            reader.connect(str(path))
            return True
        except ConnectionRefusedError:
            return False
