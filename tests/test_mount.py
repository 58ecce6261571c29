"""The FUSE view, mounted for real: bytes, attributes, concurrency, read-only errors, EIO, lifecycle, cache bound."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import random
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error, auto_unmount_helpers, dir_bytes, kill_auto_unmount_helper, \
    make_tree, run_cli, tree_digest, wait_until
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.format import CHUNK_HEADER_LEN, chunk_file_name
from fanstore.errors import UsageError
from fanstore.mount.job_memory import job_memory
from fanstore.mount.mount import DEFAULT_CACHE_FRACTION, READ_AHEAD_KIB, default_log_path, fuse_mounted_at, \
    read_ahead_setting, resolve_mountpoint
from fanstore.core.units import format_bytes

if not os.path.exists("/dev/fuse"):
    pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested", allow_module_level=True)
pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")


def _daemon_pid(mountpoint: Path) -> int:
    out = subprocess.run(["pgrep", "-f", f"fanstore mount .* {mountpoint}( |$)"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stdout
    return pids[0]


class Mounted:
    """A real background mount through the CLI; always unmounted at the end."""

    def __init__(self, dataset: Path, mountpoint: Path, *args: str) -> None:
        self.dataset, self.mountpoint, self.args = dataset, mountpoint, args
        self.log = mountpoint.parent / f"{mountpoint.name}.log"

    def __enter__(self) -> "Mounted":
        self.mountpoint.mkdir(exist_ok=True)
        run_cli("mount", str(self.dataset), str(self.mountpoint), "--log", str(self.log), *self.args, check=True)
        self.pid = _daemon_pid(self.mountpoint)
        return self

    def __exit__(self, *exc_info: object) -> None:
        resolved = Path(os.path.realpath(self.mountpoint))  # mountinfo lists it so, whatever the CLI resolves
        if fuse_mounted_at(resolved):
            run_cli("umount", str(resolved))
        _wait_gone(self.pid)


def _is_stale(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _wait_gone(pid: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return  # exited, waiting to be reaped by its parent
        time.sleep(0.05)
    raise AssertionError(f"mount daemon {pid} is still running {timeout} s after unmount")


@contextlib.contextmanager
def _left_unmounted(mountpoint: Path):
    """Whatever the test makes of `mountpoint`, nothing stays mounted there."""
    try:
        yield
    finally:
        if fuse_mounted_at(mountpoint):
            pid = _daemon_pid(mountpoint)
            run_cli("umount", str(mountpoint))
            _wait_gone(pid)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mount")
    src = make_tree(root / "src")
    setuid_file = src / "setuid_tool"
    setuid_file.write_bytes(b"#!/bin/sh\necho hi\n")
    setuid_file.chmod(0o4755)
    rng = np.random.default_rng(1)
    (src / "big").mkdir()
    for i in range(6):
        (src / "big" / f"part_{i}.bin").write_bytes(
            np.repeat(rng.integers(0, 255, 300_000, dtype=np.uint8), 2).tobytes())
    pack(src, root / "ds", PackOptions(codec="zstd:3", chunk_size=256 * 1024, workers=2))
    return src, root / "ds"


@pytest.fixture
def mounted(packed, tmp_path):
    src, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        yield src, mount.mountpoint


def test_tree_bytes_and_attributes_match(mounted):
    src, mnt = mounted
    assert tree_digest(mnt) == tree_digest(src)
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        ours, theirs = os.lstat(mnt / rel), os.lstat(path)
        if not path.is_dir() or path.is_symlink():  # a directory's size is the file system's own business
            assert ours.st_size == theirs.st_size, rel
        assert ours.st_mtime_ns == theirs.st_mtime_ns, rel
        assert ours.st_mode == theirs.st_mode & ~0o6000, rel
    assert os.stat(mnt / "setuid_tool").st_mode & 0o4000 == 0
    assert os.listdir(mnt / "empty_dir" / "nested_empty") == []
    assert [d for d, _, _ in os.walk(mnt)] and sorted(os.listdir(mnt)) == sorted(os.listdir(src))


def test_directories_list_dot_entries_and_count_links_as_on_disk(packed, mounted):
    """Every directory said st_nlink 2 and listed no '.' and '..' (`ls -a` showed two entries fewer, code counting
    a directory's links or entries was misled); the API's stat said the right count. A name longer than statfs's
    255 bytes is ENAMETOOLONG, not ENOENT."""
    src, mnt = mounted
    with open_dataset(packed[1]) as ds:
        for path in [src, *(path for path in src.rglob("*") if path.is_dir() and not path.is_symlink())]:
            rel = path.relative_to(src)
            assert os.stat(mnt / rel).st_nlink == os.stat(path).st_nlink == ds.stat(str(rel)).st_nlink, rel
            listed = subprocess.run(["ls", "-a", str(mnt / rel)], capture_output=True, text=True, check=True).stdout
            original = subprocess.run(["ls", "-a", str(path)], capture_output=True, text=True, check=True).stdout
            assert listed == original, rel
    with pytest.raises(OSError) as too_long:
        os.stat(mnt / ("n" * 300))
    assert too_long.value.errno == errno.ENAMETOOLONG


def test_read_ahead_is_raised_where_root_may(mounted):
    """A 2 MiB file then costs 2 read requests instead of 16; only root may write the mount's bdi setting."""
    _, mnt = mounted
    setting = read_ahead_setting(mnt)
    assert setting is not None
    if os.geteuid() != 0 or not os.access(setting, os.W_OK):
        pytest.skip(f"not root, or {setting} is not writable here: the kernel's default read-ahead stays")
    deadline = time.monotonic() + 10  # the daemon sets it just after the kernel's INIT
    while int(setting.read_text()) != READ_AHEAD_KIB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(setting.read_text()) == READ_AHEAD_KIB


def test_random_reads_seek_and_mmap(mounted):
    src, mnt = mounted
    rng = random.Random(4)
    files = [p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink()]
    for rel in files:
        original = (src / rel).read_bytes()
        with open(mnt / rel, "rb") as f:
            for _ in range(5):
                offset = rng.randrange(0, len(original) + 10)
                length = rng.choice([1, 17, 4096, 131072, 1 << 20])
                f.seek(offset)
                assert f.read(length) == original[offset:offset + length], rel
            if original:
                with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                    assert mapped[:] == original
                    assert mapped[len(original) // 2:] == original[len(original) // 2:]


def test_concurrent_threads_and_processes(mounted):
    src, mnt = mounted
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    expected = {f: hashlib.sha256((src / f).read_bytes()).hexdigest() for f in files}

    def read_all(seed: int) -> list[str]:
        order = files[:]
        random.Random(seed).shuffle(order)
        order += ["big/part_0.bin"] * 3  # the same file from every thread too
        return [f for f in order if hashlib.sha256((mnt / f).read_bytes()).hexdigest() != expected[f]]

    script = ("import hashlib,sys,pathlib; m=pathlib.Path(sys.argv[1]); "
              "[print(hashlib.sha256((m/f).read_bytes()).hexdigest(), f) for f in sys.argv[2:]]")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(mnt), *files], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    with ThreadPoolExecutor(8) as pool:
        mismatches = sum(pool.map(read_all, range(8)), [])
    assert mismatches == []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        for line in out.splitlines():
            digest, name = line.split(" ", 1)
            assert digest == expected[name], name


def test_writes_get_erofs(mounted):
    _, mnt = mounted
    attempts = [
        lambda: open(mnt / "labels.txt", "r+b"),
        lambda: open(mnt / "new.txt", "wb"),
        lambda: os.rename(mnt / "labels.txt", mnt / "renamed.txt"),
        lambda: os.unlink(mnt / "labels.txt"),
        lambda: os.mkdir(mnt / "newdir"),
        lambda: os.rmdir(mnt / "empty_dir" / "nested_empty"),
        lambda: os.symlink("labels.txt", mnt / "l2"),
        lambda: os.chmod(mnt / "labels.txt", 0o600),
        lambda: os.truncate(mnt / "labels.txt", 0),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS


def test_a_read_only_open_with_o_append_reads(mounted):
    """O_RDONLY|O_APPEND writes nothing, and a read-only bind mount or squashfuse opens it; the mount answered
    EROFS. O_APPEND with write access is still EROFS."""
    src, mnt = mounted
    descriptor = os.open(mnt / "labels.txt", os.O_RDONLY | os.O_APPEND)
    try:
        assert os.pread(descriptor, 1 << 20, 0) == (src / "labels.txt").read_bytes()
    finally:
        os.close(descriptor)
    with pytest.raises(OSError) as caught:
        os.open(mnt / "labels.txt", os.O_WRONLY | os.O_APPEND)
    assert caught.value.errno == errno.EROFS


def test_a_dest_packed_again_while_mounted_reads_as_it_was_mounted(tmp_path):
    """`fanstore-pack --force` over a mounted DEST replaces its index and chunk files. The mount keeps the old
    index, but opened a chunk file at its first read: every file of a chunk not read before the pack then failed
    with EIO (the new chunk read at the old offsets), while the chunks read before still served the old bytes.
    The mount holds its chunk files from the start now, so it serves the dataset as mounted, as squashfuse
    serves the image it opened."""
    rng = np.random.default_rng(3)
    before, after = tmp_path / "before", tmp_path / "after"
    for tree, count in ((before, 12), (after, 9)):
        tree.mkdir()
        for number in range(count):
            (tree / f"f{number:02d}.bin").write_bytes(rng.integers(0, 255, 40_000 + number, dtype=np.uint8).tobytes())
    dataset = tmp_path / "ds"
    pack(before, dataset, PackOptions(codec="zstd:1", chunk_size=128 * 1024, workers=1))
    with open_dataset(dataset) as ds:
        assert len(ds.index.chunks) >= 3
    with Mounted(dataset, tmp_path / "mnt", "--prefetch", "0") as mount:
        pack(after, dataset, PackOptions(codec="none", chunk_size=64 * 1024, workers=1, force=True))
        for path in sorted(before.iterdir()):
            assert (mount.mountpoint / path.name).read_bytes() == path.read_bytes(), path.name


def test_corrupt_blob_is_eio_for_that_file_only(packed, tmp_path):
    src, ds = packed
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-a", str(ds), str(damaged)], check=True)
    with open_dataset(damaged) as dataset:
        entry = dataset.index.lookup("big/part_3.bin")
        rec = dataset.index.entries[entry]
        chunk, offset = int(rec["chunk"]), int(rec["offset"])
    chunk_path = damaged / chunk_file_name(chunk)
    data = bytearray(chunk_path.read_bytes())
    data[offset + 100] ^= 0xFF
    chunk_path.write_bytes(bytes(data))
    with Mounted(damaged, tmp_path / "mnt") as mount:
        with pytest.raises(OSError) as caught:
            (mount.mountpoint / "big" / "part_3.bin").read_bytes()
        assert caught.value.errno == errno.EIO
        with pytest.raises(OSError):
            (mount.mountpoint / "big" / "part_3.bin").read_bytes()
        for other in ("big/part_2.bin", "big/part_4.bin", "labels.txt", "field.npy"):
            assert (mount.mountpoint / other).read_bytes() == (src / other).read_bytes()
    log_lines = [line for line in mount.log.read_text().splitlines() if "EIO" in line]
    assert len(log_lines) == 1, log_lines
    assert "big/part_3.bin" in log_lines[0] and f"chunk {chunk}" in log_lines[0]
    assert offset >= CHUNK_HEADER_LEN


def _files_by_chunk(dataset: Path) -> dict[int, list[str]]:
    with open_dataset(dataset) as ds:
        by_chunk: dict[int, list[str]] = {}
        for entry in ds.index.iter_files():
            by_chunk.setdefault(int(ds.index.entries[entry]["chunk"]), []).append(ds.index.path_of(entry))
    return by_chunk


def _assert_only_chunk_fails(src: Path, mountpoint: Path, by_chunk: dict[int, list[str]], bad_chunk: int) -> None:
    """Every file of `bad_chunk` answers EIO, twice; every other file reads as in SRC; the view stays whole."""
    for _ in range(2):
        for chunk, paths in by_chunk.items():
            for rel in paths:
                if chunk == bad_chunk:
                    with pytest.raises(OSError) as caught:
                        (mountpoint / rel).read_bytes()
                    assert caught.value.errno == errno.EIO, rel
                else:
                    assert (mountpoint / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert os.path.ismount(mountpoint) and sorted(os.listdir(mountpoint)) == sorted(os.listdir(src))


def test_a_chunk_that_is_a_directory_fails_its_files_not_the_mount(packed, tmp_path):
    src, ds = packed
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-a", str(ds), str(damaged)], check=True)
    by_chunk = _files_by_chunk(damaged)
    bad_chunk = max(by_chunk, key=lambda c: len(by_chunk[c]))
    (damaged / chunk_file_name(bad_chunk)).unlink()
    (damaged / chunk_file_name(bad_chunk)).mkdir()
    with Mounted(damaged, tmp_path / "mnt") as mount:
        _assert_only_chunk_fails(src, mount.mountpoint, by_chunk, bad_chunk)
        os.kill(mount.pid, 0)  # the daemon still serves
    lines = [line for line in mount.log.read_text().splitlines() if "EIO" in line]
    assert len(lines) == 1 and f"chunk {bad_chunk} is not a regular file" in lines[0], lines


def test_a_disk_answering_eio_fails_the_files_of_that_chunk_not_the_mount(packed, tmp_path):
    """The chunk file lies on a file system that answers EIO for it: another fanstore mount, whose only blob, that
    chunk file's bytes, is damaged. So the daemon's own reads of the chunk fail as a failing disk's would."""
    src, ds = packed
    dataset = tmp_path / "dataset"
    subprocess.run(["cp", "-a", str(ds), str(dataset)], check=True)
    by_chunk = _files_by_chunk(dataset)
    bad_chunk = max(by_chunk, key=lambda c: len(by_chunk[c]))
    disk_src = tmp_path / "disk_src"
    disk_src.mkdir()
    (dataset / chunk_file_name(bad_chunk)).rename(disk_src / "chunk.fsc")
    pack(disk_src, tmp_path / "disk", PackOptions(codec="none", workers=1))
    disk_chunk = tmp_path / "disk" / chunk_file_name(0)
    stored = bytearray(disk_chunk.read_bytes())
    stored[len(stored) // 2] ^= 0xFF
    disk_chunk.write_bytes(bytes(stored))
    with Mounted(tmp_path / "disk", tmp_path / "failing_disk") as disk:
        (dataset / chunk_file_name(bad_chunk)).symlink_to(disk.mountpoint / "chunk.fsc")
        with pytest.raises(OSError) as caught:
            (disk.mountpoint / "chunk.fsc").read_bytes()
        assert caught.value.errno == errno.EIO  # the "disk" fails as intended
        with Mounted(dataset, tmp_path / "mnt") as mount:
            _assert_only_chunk_fails(src, mount.mountpoint, by_chunk, bad_chunk)
            os.kill(mount.pid, 0)
    lines = [line for line in mount.log.read_text().splitlines() if "EIO" in line]
    assert len(lines) == 1 and f"chunk {bad_chunk}" in lines[0] and "Input/output error" in lines[0], lines
    assert "corrupt" not in lines[0] and "checksum" not in lines[0]  # unavailable, not called corruption


def test_umount_during_reads_ends_cleanly(packed, tmp_path):
    _, ds = packed
    mount = Mounted(ds, tmp_path / "mnt")
    with mount:
        script = ("import os,sys,pathlib\nm=pathlib.Path(sys.argv[1])\nfirst=True\n"
                  "while True:\n"
                  "    try:\n"
                  "        if not [p.read_bytes() for p in m.rglob('*.bin')]:\n"
                  "            sys.exit(0)  # the mount is gone: the plain directory under it is empty\n"
                  "    except OSError:\n"
                  "        sys.exit(0)\n"
                  "    if first:\n"
                  "        print('reading', flush=True)\n"
                  "        first=False\n")
        readers = [subprocess.Popen([sys.executable, "-c", script, str(mount.mountpoint)], stdout=subprocess.PIPE,
                                    text=True) for _ in range(3)]
        for reader in readers:  # each has read every file once and goes on reading
            assert reader.stdout.readline() == "reading\n", "a reader stopped before the unmount"
        umount = run_cli("umount", str(mount.mountpoint), timeout=30)
        assert umount.returncode == 0, umount.stderr
        for reader in readers:
            try:
                reader.wait(timeout=30)
            except subprocess.TimeoutExpired:
                reader.kill()
                raise AssertionError("a reader hung after the unmount")
        _wait_gone(mount.pid)
        assert not os.path.ismount(mount.mountpoint)


def test_sigterm_unmounts(packed, tmp_path):
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        os.kill(mount.pid, signal.SIGTERM)
        _wait_gone(mount.pid)
        assert not os.path.ismount(mount.mountpoint)


def test_foreground_logs_to_log_when_given_else_to_stderr(packed, tmp_path):
    """`--foreground --log FILE` logs to FILE, as --help says --log does: it went to stderr, FILE never made."""
    _, ds = packed
    mountpoint, log = tmp_path / "mnt", tmp_path / "fg.log"
    mountpoint.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "fanstore", "mount", str(ds), str(mountpoint), "--foreground",
               "--cache-size", "4MiB"]
    for given_log in (True, False):
        daemon = subprocess.Popen(command + (["--log", str(log)] if given_log else []), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        with _left_unmounted(mountpoint):
            wait_until(lambda: fuse_mounted_at(mountpoint), "the foreground mount", timeout=30)
            daemon.send_signal(signal.SIGTERM)
            out, err = daemon.communicate(timeout=30)
        assert daemon.returncode == 0, err
        said = log.read_text() if given_log else err
        assert f"{mountpoint}: cache 4.19 MB: --cache-size 4MiB" in said, (said, err)
        assert "signal 15: unmounting" in said, said
        if given_log:
            assert err == "" and out == "", (out, err)


def test_the_unmount_line_prints_counts_and_sizes_as_docs_output_md_says(tmp_path):
    """The log's closing line counts and sizes as every output does (docs/OUTPUT.md): it said `1 misses` and
    `524288 bytes held`, bytes where every other size is in SI units."""
    src, mountpoint, log = tmp_path / "src", tmp_path / "mnt", tmp_path / "fg.log"
    src.mkdir()
    mountpoint.mkdir()
    rng = np.random.default_rng(2)
    (src / "big.bin").write_bytes(np.repeat(rng.integers(0, 255, 600_000, dtype=np.uint8), 2).tobytes())
    pack(src, tmp_path / "ds", PackOptions(codec="zstd:3", blocks_above=512 * 1024, block_size=512 * 1024, workers=1))
    daemon = subprocess.Popen([sys.executable, "-m", "fanstore", "mount", str(tmp_path / "ds"), str(mountpoint),
                               "--foreground", "--log", str(log), "--prefetch", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    with _left_unmounted(mountpoint):
        wait_until(lambda: fuse_mounted_at(mountpoint), "the foreground mount", timeout=30)
        with open(mountpoint / "big.bin", "rb") as f:
            assert f.read(1) != b""
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=30)
    assert daemon.returncode == 0
    line = log.read_text().splitlines()[-1]
    said = re.search(r"unmounted (\S+); cache: (1 hit|(?!1 )[\d,]+ hits), 1 miss, 0 waits, 0 evictions, (.*) held$",
                     line)
    assert said and said[1] == str(mountpoint) and said[3] == "524 kB", line


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_as_the_mount_appears_unmounts_it_as_one_a_moment_later(packed, tmp_path, signal_number):
    """The mount is in mountinfo from its start, before the session loop takes signals: a SIGTERM then was raised
    inside the loop (a traceback, exit 1; seen in a CI run), or, a moment earlier, left the mount behind. It is noted
    and acted on once the loop runs: unmounted, exit 0, as a signal a moment later."""
    _, ds = packed
    mountpoint, pause = tmp_path / "mnt", tmp_path / "pause"
    mountpoint.mkdir()
    pause.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "FANSTORE_PAUSE_AT": "mount: mounted",
           "FANSTORE_PAUSE_DIR": str(pause)}
    daemon = subprocess.Popen([sys.executable, "-m", "fanstore", "mount", str(ds), str(mountpoint), "--foreground"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    with _left_unmounted(mountpoint):
        wait_until(lambda: (pause / "paused").exists() or daemon.poll() is not None, "the mount's pause", timeout=30)
        assert fuse_mounted_at(mountpoint)
        daemon.send_signal(signal_number)
        (pause / "resume").touch()
        out, err = daemon.communicate(timeout=30)
        assert daemon.returncode == 0 and "Traceback" not in err, err
        assert f"signal {int(signal_number)}: unmounting" in err, err
        assert not fuse_mounted_at(mountpoint)


def _cache_attributes(mountpoint: Path) -> None:
    """Make the kernel hold the mount's attributes (for a day): from then on a stat never reaches the daemon."""
    os.stat(mountpoint)
    for entry in os.scandir(mountpoint):
        entry.stat(follow_symlinks=False)
    (mountpoint / "labels.txt").read_bytes()


def test_killed_daemon_leaves_no_mount(packed, tmp_path):
    """SIGKILL (the OOM killer's) runs no handler: the mount stayed, every access ENOTCONN until someone unmounted
    it. libfuse's auto-unmount helper removes it once the daemon is gone, and ends."""
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        _cache_attributes(mount.mountpoint)
        assert auto_unmount_helpers(mount.mountpoint)
        os.kill(mount.pid, signal.SIGKILL)
        _wait_gone(mount.pid)
        wait_until(lambda: not fuse_mounted_at(mount.mountpoint), "the killed daemon's mount removed", 10)
        assert os.listdir(mount.mountpoint) == [] and not os.path.ismount(mount.mountpoint)
        wait_until(lambda: not auto_unmount_helpers(mount.mountpoint), "the auto-unmount helper ended", 10)


def test_a_killed_daemon_ends_its_connection_before_its_helper_wakes(packed, tmp_path):
    """A dying process's files are released in the reverse order of their descriptors' numbers (Linux 4.3 on). The
    helper's socket, numbered above /dev/fuse, went first: the helper woke and asked the mount while it was still
    connected, its request ended ECONNABORTED rather than ENOTCONN, and it left the mount stale (6 kills in 20 on a
    busy machine). So the daemon holds /dev/fuse above that socket too."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is missing: no way to see a Unix socket's peer")
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        [helper] = auto_unmount_helpers(mount.mountpoint)
        [helper_end] = [target for target in _descriptors(helper).values() if target.startswith("socket:")]
        listing = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, check=True).stdout
        pattern = rf"\* (\d+)\s+\* {helper_end[len('socket:['):-1]}\s.*pid={mount.pid},fd=(\d+)\)"
        socket_fd = int(re.search(pattern, listing)[2])
        fuse_fds = [fd for fd, target in _descriptors(mount.pid).items() if target == "/dev/fuse"]
        assert max(fuse_fds) > socket_fd, (fuse_fds, socket_fd)


def _descriptors(pid: int) -> dict[int, str]:
    """What each of a process's descriptors refers to: a path, `socket:[INODE]`, ..."""
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def test_without_fusermount3_the_mount_goes_on_without_auto_unmount(packed, tmp_path):
    """libfuse mounts through fusermount3 to auto-unmount, and fails without one; root mounts without it (mount(2)),
    so the mount goes on without auto_unmount, and its log says so."""
    if os.geteuid() != 0:
        pytest.skip("only root mounts without fusermount3")
    src, ds = packed
    mountpoint, log = tmp_path / "mnt", tmp_path / "mnt.log"
    mountpoint.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": str(tmp_path / "no-such-directory")}
    done = subprocess.run([sys.executable, "-m", "fanstore", "mount", str(ds), str(mountpoint), "--log", str(log)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    with _left_unmounted(mountpoint):
        assert done.returncode == 0, done.stderr
        pid = _daemon_pid(mountpoint)
        assert (mountpoint / "labels.txt").read_bytes() == (src / "labels.txt").read_bytes()
        assert not auto_unmount_helpers(mountpoint)
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
    assert "fusermount3 is not installed (Debian package fuse3): mounted without auto_unmount" in log.read_text()


def test_killed_daemon_is_reported_as_stale_though_its_attributes_are_cached(packed, tmp_path):
    """A stale mount, as a daemon killed together with its auto-unmount helper leaves one."""
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        _cache_attributes(mount.mountpoint)
        kill_auto_unmount_helper(mount.mountpoint)
        os.kill(mount.pid, signal.SIGKILL)
        _wait_gone(mount.pid)
        os.stat(mount.mountpoint)  # still answered, from the cache: why a stat cannot tell a stale mount
        again = run_cli("mount", str(ds), str(mount.mountpoint), timeout=30)
        assert_one_line_error(again, "stale mount", f"fanstore umount {mount.mountpoint}")
        run_cli("umount", str(mount.mountpoint), check=True)
        assert not _is_stale(mount.mountpoint) and not os.path.ismount(mount.mountpoint)


def test_stopped_daemon_is_reported_as_not_answering(packed, tmp_path):
    """A hung daemon must not hang the CLI: it gets a few seconds to answer, then is named as not answering."""
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        _cache_attributes(mount.mountpoint)
        os.kill(mount.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            again = run_cli("mount", str(ds), str(mount.mountpoint), timeout=30)
            assert time.monotonic() - started < 15
            assert_one_line_error(again, "not answering", f"fanstore umount {mount.mountpoint}")
            run_cli("umount", str(mount.mountpoint), check=True, timeout=30)  # what the message advises
            assert not fuse_mounted_at(mount.mountpoint)
        finally:
            os.kill(mount.pid, signal.SIGCONT)


def test_mount_and_umount_through_a_symlinked_mount_point(packed, tmp_path):
    """mountinfo lists the resolved path; `umount LINK` must find the mount that `mount DS LINK` made."""
    src, ds = packed
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to("real")
    with Mounted(ds, link) as mount:
        assert fuse_mounted_at(tmp_path / "real") and fuse_mounted_at(link)
        assert (link / "labels.txt").read_bytes() == (src / "labels.txt").read_bytes()
        again = run_cli("mount", str(ds), str(link))
        assert_one_line_error(again, "already mounted", str(tmp_path / "real"))
        run_cli("umount", str(link), check=True)
        _wait_gone(mount.pid)
        assert not fuse_mounted_at(tmp_path / "real")


def test_a_dest_and_mount_point_named_like_options_mount_after_a_double_dash(packed, tmp_path):
    """`fanstore mount -- -ds -mnt` is how a DEST or MOUNTPOINT starting with '-' is given: the background daemon
    was handed its own options after that `--`, took them for arguments, and exited with status 2."""
    src, ds = packed
    shutil.copytree(ds, tmp_path / "-ds")
    (tmp_path / "-mnt").mkdir()
    command = [sys.executable, "-m", "fanstore"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    mounted = subprocess.run([*command, "mount", "--log", "daemon.log", "--", "-ds", "-mnt"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    with _left_unmounted(tmp_path / "-mnt"):
        assert mounted.returncode == 0, mounted.stderr
        assert (tmp_path / "-mnt" / "labels.txt").read_bytes() == (src / "labels.txt").read_bytes()
        subprocess.run([*command, "umount", "--", "-mnt"], cwd=tmp_path, env=env, check=True, capture_output=True)
        assert not fuse_mounted_at(tmp_path / "-mnt")


def test_resolve_mountpoint_follows_links_with_readlink(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "to_b").symlink_to("a/b")  # relative
    (tmp_path / "a" / "up").symlink_to(tmp_path)  # absolute
    (tmp_path / "chain").symlink_to("a/up/to_b")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path / "a")
    assert resolve_mountpoint(Path("b")) == tmp_path / "a" / "b"
    assert resolve_mountpoint(tmp_path / "chain") == tmp_path / "a" / "b"
    assert resolve_mountpoint(tmp_path / "to_b" / ".." / "b" / ".") == tmp_path / "a" / "b"  # `..` after the link
    assert resolve_mountpoint(tmp_path / "chain" / "not_yet") == tmp_path / "a" / "b" / "not_yet"
    with pytest.raises(UsageError, match="too many levels of symbolic links"):
        resolve_mountpoint(tmp_path / "loop")


@pytest.mark.parametrize("command, needles", [
    ("mount {ds} {tmp}/absent", ["{tmp}/absent", "does not exist"]),
    ("mount {ds} {tmp}/file", ["{tmp}/file", "not a directory"]),
    ("mount {ds} {tmp}/full", ["{tmp}/full' is not empty (it holds 'kept.txt')", "would hide"]),
    ("mount {tmp} {tmp}/mp", ["{tmp}", "not a fanstore dataset"]),
    ("mount {tmp}/file {tmp}/mp", ["{tmp}/file", "is a file"]),
    ("mount {ds} {tmp}/mp --cache-size -1", ["--cache-size", "-1"]),
    ("mount {ds} {tmp}/mp --prefetch -1", ["--prefetch", "-1"]),
    ("mount {ds} {tmp}/mp --prefetch-list {tmp}/dir", ["--prefetch-list", "{tmp}/dir", "Is a directory"]),
    ("mount {ds} {tmp}/mp --prefetch 0 --prefetch-list {tmp}/absent", ["--prefetch-list", "{tmp}/absent"]),
    ("mount {ds} {tmp}/mp --prefetch-list {tmp}/binary", ["--prefetch-list", "{tmp}/binary: entry 1: not UTF-8 text"]),
    ("mount {ds} {tmp}/mp --kernel-timeout -1", ["--kernel-timeout", "-1"]),
    ("mount {ds} {tmp}/mp --kernel-timeout nan", ["--kernel-timeout", "nan"]),
    ("mount {ds} {tmp}/mp --log {tmp}/no_dir/mount.log", ["--log", "{tmp}/no_dir/mount.log", "No such file"]),
    ("mount {ds} {tmp}/mp --log {tmp}/dir", ["--log", "{tmp}/dir", "Is a directory"]),
    ("mount {ds} {tmp}/mp --log {tmp}/file/mount.log", ["--log", "{tmp}/file/mount.log", "Not a directory"]),
    ("mount {tmp}/dir/ds {tmp}/dir", ["MOUNTPOINT {tmp}/dir", "DEST {tmp}/dir/ds lies inside it"]),
    ("mount {tmp}/dir/ds {tmp}/dir --foreground", ["MOUNTPOINT {tmp}/dir", "DEST {tmp}/dir/ds lies inside it"]),
    ("mount {tmp}/dir/link {tmp}/dir", ["MOUNTPOINT {tmp}/dir", "DEST {tmp}/dir/link lies inside it"]),
    ("mount {tmp}/mp/../dir/ds {tmp}/dir", ["MOUNTPOINT {tmp}/dir", "DEST {tmp}/mp/../dir/ds lies inside it"]),
    ("mount {ds} {tmp}/mp --log {tmp}/mp/mount.log", ["MOUNTPOINT {tmp}/mp", "--log {tmp}/mp/mount.log lies inside"]),
    ("umount {tmp}/mp", ["{tmp}/mp", "no FUSE file system is mounted"]),
    ("umount {tmp}/absent", ["{tmp}/absent", "does not exist"]),
    ("umount {tmp}/file", ["{tmp}/file", "not a directory"]),
])
def test_mount_argument_errors_are_one_line(packed, tmp_path, monkeypatch, command, needles):
    _, ds = packed
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # a default log, if any, stays in here
    for directory in ("mp", "dir"):
        (tmp_path / directory).mkdir()
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("a file the mount would hide")
    (tmp_path / "binary").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")  # an image given for the epoch's list
    shutil.copytree(ds, tmp_path / "dir" / "ds")  # a dataset inside a mount point, as given or through a link
    (tmp_path / "dir" / "link").symlink_to(ds)
    args = [arg.format(ds=ds, tmp=tmp_path) for arg in command.split()]
    with _left_unmounted(tmp_path / "mp"):
        failed = run_cli(*args, timeout=30)
    assert_one_line_error(failed, *(needle.format(tmp=tmp_path) for needle in needles))
    assert not fuse_mounted_at(tmp_path / "mp")


@pytest.mark.parametrize("dest, mountpoint, options, needle", [
    ("ds", "ds/chunks", [], "MOUNTPOINT {tmp}/ds/chunks is DEST's chunk directory ds/chunks: "),
    ("ds", "ds/chunks", ["--foreground"], "MOUNTPOINT {tmp}/ds/chunks is DEST's chunk directory ds/chunks: "),
    ("ds", "to_chunks", [], "MOUNTPOINT {tmp}/ds/chunks is DEST's chunk directory ds/chunks: "),
    ("to_ds", "ds/chunks", [], "MOUNTPOINT {tmp}/ds/chunks is DEST's chunk directory to_ds/chunks: "),
    ("linked", "store", [], "MOUNTPOINT {tmp}/store: DEST's chunk directory linked/chunks lies inside it"),
    ("linked", "store", ["--foreground"], "MOUNTPOINT {tmp}/store: DEST's chunk directory linked/chunks lies inside"),
    ("ds", "bind/chunks", [], "MOUNTPOINT {tmp}/bind/chunks is DEST's chunk directory ds/chunks: "),
], ids=["relative", "relative, foreground", "through a link", "DEST through a link", "chunks a link under it",
        "chunks a link under it, foreground", "bind-mounted"])
def test_a_mountpoint_hiding_the_chunks_is_refused_before_mounting(packed, tmp_path, monkeypatch, dest, mountpoint,
                                                                   options, needle):
    """A mount over the dataset's chunk directory hides the chunk files from the daemon itself: every read would go
    through its own mount and wait on itself for good, its readers in uninterruptible sleep. Refused in one line
    before mounting, whatever way it is given: relative, through a link, a chunk directory that is a link, a bind
    mount."""
    _, ds = packed
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the default log stays in here
    shutil.copytree(ds, tmp_path / "ds")
    (tmp_path / "to_chunks").symlink_to("ds/chunks")
    (tmp_path / "to_ds").symlink_to("ds")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "fanstore.index").write_bytes((ds / "fanstore.index").read_bytes())
    shutil.copytree(ds / "chunks", tmp_path / "store" / "chunks")
    (tmp_path / "linked" / "chunks").symlink_to(tmp_path / "store" / "chunks")
    if mountpoint.startswith("bind/"):
        (tmp_path / "bind").mkdir()
        mounted = subprocess.run(["mount", "--bind", str(tmp_path / "ds"), str(tmp_path / "bind")],
                                 capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root): {mounted.stderr.decode().strip()}")
    resolved = Path(os.path.realpath(tmp_path / mountpoint))
    try:
        failed = subprocess.run([sys.executable, "-m", "fanstore", "mount", dest, mountpoint, *options],
                                capture_output=True, text=True, cwd=tmp_path, timeout=30,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        if fuse_mounted_at(resolved):  # mounted after all: its daemon ends once unmounted
            run_cli("umount", str(resolved))
        if mountpoint.startswith("bind/"):
            subprocess.run(["umount", "-l", str(tmp_path / "bind")], check=True)
    assert_one_line_error(failed, needle.format(tmp=tmp_path), "the mount would hide it from fanstore itself")
    assert not fuse_mounted_at(resolved)


@pytest.mark.parametrize("log, needle", [
    ("{dest}/fanstore.index", "--log {dest}/fanstore.index lies inside DEST {dest}"),
    ("{dest}/chunks/mount.log", "--log {dest}/chunks/mount.log lies inside DEST {dest}"),
    ("{tmp}/link/fanstore.index",
     "--log {tmp}/link/fanstore.index (links followed: {dest}/fanstore.index) lies inside DEST {dest}"),
    (None, "the default log (--log puts it elsewhere) {default_log} lies inside DEST {dest}"),
])
def test_a_mount_log_in_dest_is_refused_and_dest_left_as_it_was(packed, tmp_path, monkeypatch, log, needle):
    """The daemon appends to its log: one in DEST (its index, say) would ruin the dataset, and nothing but a pack
    writes there. The default log too, in a DEST that happens to be the runtime directory."""
    _, ds = packed
    dest = tmp_path / "ds"
    shutil.copytree(ds, dest)
    (tmp_path / "link").symlink_to(dest)
    (tmp_path / "mp").mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(dest))
    before, files_before = tree_digest(dest), dir_bytes(dest)
    options = ["--log", log.format(dest=dest, tmp=tmp_path)] if log else []
    with _left_unmounted(tmp_path / "mp"):
        failed = run_cli("mount", str(dest), str(tmp_path / "mp"), *options, timeout=30)
    default_log = default_log_path(Path(os.path.realpath(tmp_path / "mp")))
    assert default_log.parent == dest / "fanstore"
    assert_one_line_error(failed, needle.format(dest=dest, tmp=tmp_path, default_log=default_log))
    assert not fuse_mounted_at(tmp_path / "mp")
    assert tree_digest(dest) == before and dir_bytes(dest) == files_before


@pytest.mark.parametrize("runtime_dir", [True, False], ids=["XDG_RUNTIME_DIR", "home-cache"])
def test_default_log_is_private(packed, tmp_path, monkeypatch, runtime_dir):
    _, ds = packed
    if runtime_dir:
        (tmp_path / "run").mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
        log_dir = tmp_path / "run" / "fanstore"
    else:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        log_dir = tmp_path / "home" / ".cache" / "fanstore"
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log = default_log_path(Path(os.path.realpath(mountpoint)))
    assert log.parent == log_dir
    with _left_unmounted(mountpoint):
        mounted = run_cli("mount", str(ds), str(mountpoint), check=True, timeout=30)
        assert f"log {log})" in mounted.stdout
        pid = _daemon_pid(mountpoint)
        run_cli("umount", str(mountpoint), check=True)
        _wait_gone(pid)
    assert stat.S_IMODE(os.lstat(log_dir).st_mode) == 0o700
    assert stat.S_ISREG(os.lstat(log).st_mode) and stat.S_IMODE(os.lstat(log).st_mode) == 0o600
    assert "unmounted" in log.read_text()


def test_mounts_at_two_directories_named_alike_log_apart(packed, tmp_path, monkeypatch):
    """Two mount points both named `mnt`: each daemon logs to a file of its own, named after the whole path."""
    _, ds = packed
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    mountpoints = [tmp_path / side / "mnt" for side in ("a", "b")]
    logs = [default_log_path(Path(os.path.realpath(mountpoint))) for mountpoint in mountpoints]
    assert logs[0] != logs[1] and all(log.parent == tmp_path / "run" / "fanstore" for log in logs)
    with contextlib.ExitStack() as unmount_all:
        for mountpoint, log in zip(mountpoints, logs):
            mountpoint.mkdir(parents=True)
            unmount_all.enter_context(_left_unmounted(mountpoint))
            mounted = run_cli("mount", str(ds), str(mountpoint), check=True, timeout=30)
            assert f"log {log})" in mounted.stdout
        for mountpoint in mountpoints:
            pid = _daemon_pid(mountpoint)
            run_cli("umount", str(mountpoint), check=True)
            _wait_gone(pid)
    for log, mountpoint, other in zip(logs, mountpoints, reversed(mountpoints)):
        text = log.read_text()
        assert f"{mountpoint}: cache" in text and "unmounted" in text and str(other) not in text, text


@pytest.mark.parametrize("plant, needle", [
    ("symlinked log", "is a symbolic link"),
    ("symlinked directory", "is a symbolic link"),
    ("directory writable by all", "not private"),
    ("log of another user", "not a regular file of this user's"),
    ("fifo", "remove it"),
])
def test_default_log_refuses_what_another_user_could_plant(packed, tmp_path, monkeypatch, plant, needle):
    """The daemon (often root) must never append through a planted link to a file it was not meant to touch."""
    _, ds = packed
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    log_dir = tmp_path / "run" / "fanstore"
    log = default_log_path(Path(os.path.realpath(tmp_path / "mnt")))
    assert log.parent == log_dir
    victim = tmp_path / "victim" / log.name  # where either symlink leads
    victim.parent.mkdir()
    victim.write_text("precious\n")
    if plant == "symlinked directory":
        log_dir.symlink_to(victim.parent)
    else:
        log_dir.mkdir(mode=0o700)
    if plant == "symlinked log":
        log.symlink_to(victim)
    elif plant == "directory writable by all":
        log_dir.chmod(0o777)
    elif plant == "log of another user":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        log.write_text("")
        os.chown(log, 65534, 65534)
    elif plant == "fifo":
        os.mkfifo(log)
    (tmp_path / "mnt").mkdir()
    with _left_unmounted(tmp_path / "mnt"):
        refused = run_cli("mount", str(ds), str(tmp_path / "mnt"), timeout=30)
    assert_one_line_error(refused, str(log_dir), needle)
    assert victim.read_text() == "precious\n"
    assert not fuse_mounted_at(tmp_path / "mnt")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cache_stays_within_its_bound_over_three_epochs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(9)
    for i in range(48):
        (src / f"f{i:02d}.bin").write_bytes(np.repeat(rng.integers(0, 255, 512 * 1024, dtype=np.uint8), 2).tobytes())
    pack(src, tmp_path / "ds", PackOptions(codec="lz4", workers=1))
    cache_size = 4 << 20
    # keep_cache off and short kernel timeouts: every epoch must go through the daemon and its cache.
    with Mounted(tmp_path / "ds", tmp_path / "mnt", "--cache-size", "4MiB", "--no-keep-cache") as mount:
        before = _rss(mount.pid)
        peak = before
        for _epoch in range(3):
            for i in range(48):
                with open(mount.mountpoint / f"f{i:02d}.bin", "rb") as f:
                    while f.read(1 << 20):
                        pass
                fd = os.open(mount.mountpoint / f"f{i:02d}.bin", os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                peak = max(peak, _rss(mount.pid))
    total = 48 * 1024 * 1024
    assert peak - before < cache_size + 12 * (1 << 20), (peak - before, total)
    assert "evictions" in mount.log.read_text()
    assert f"{mount.mountpoint}: cache 4.19 MB: --cache-size 4MiB\n" in mount.log.read_text()


def test_the_default_cache_is_a_quarter_of_what_the_job_may_use_and_the_log_says_which(packed, tmp_path):
    """No --cache-size: a quarter of the machine's available memory, or of the room its memory cgroup leaves
    where that is less (job_memory; tests/test_job_memory.py and the serve job in a cgroup test the cgroup's part).
    The log's line says which, and the counters give the bound."""
    _, ds = packed
    with Mounted(ds, tmp_path / "mnt") as mount:
        capacity = _daemon_stats(mount.mountpoint)["cache"]["capacity"]
        said = re.search(rf"^\S+ \S+ fanstore: {mount.mountpoint}: cache (\S+ \S+): a quarter of (.*)$",
                         mount.log.read_text(), re.M)
    expected = job_memory().available * DEFAULT_CACHE_FRACTION
    assert abs(capacity - expected) < 0.1 * expected, (capacity, expected)  # what was available has moved since
    assert said and said[1] == format_bytes(capacity), mount.log.read_text()
    assert re.fullmatch(r"the machine's available memory, .* \(MemAvailable\)(; .* leaves more)?|"
                        r"the .* left in this job's memory cgroup .* \(limit .*, .* in use\)", said[2]), said[2]


def _daemon_stats(mountpoint: Path) -> dict:
    """The daemon's counters, from the virtual attribute on its root."""
    return json.loads(os.getxattr(mountpoint, "user.fanstore.stats"))


def test_the_stats_attribute_is_readable_and_not_listed(mounted):
    _, mnt = mounted
    (mnt / "labels.txt").read_bytes()
    stats = _daemon_stats(mnt)
    assert set(stats["cache"]) >= {"hits", "misses", "waits", "evictions", "bytes_held", "capacity"}
    assert set(stats["prefetch"]) == {"pending", "decoded", "in_order", "fetches_at_open", "kernel_trust"}
    assert os.listxattr(mnt) == []  # copying tools do not carry it along
    with pytest.raises(OSError):
        os.getxattr(mnt / "labels.txt", "user.fanstore.stats")


def test_the_stats_attribute_reads_in_a_buffer_of_the_size_it_said(mounted):
    """getfattr asks for an attribute's size, then for its value in a buffer of that size. A file read in between
    moved a counter, the value grew a digit past the buffer and the read failed with ERANGE (5 in 300 under
    load). The same process's next ask within a second gets the reply it was sized by."""
    import ctypes

    src, mnt = mounted
    libc = ctypes.CDLL(None, use_errno=True)
    files = [path.relative_to(src) for path in sorted(src.rglob("*")) if path.is_file() and not path.is_symlink()]
    sizes = set()
    for rel in files:
        size = libc.getxattr(bytes(mnt), b"user.fanstore.stats", None, 0)
        assert size > 0, os.strerror(ctypes.get_errno())
        sizes.add(size)
        (mnt / rel).read_bytes()  # counters move
        value = ctypes.create_string_buffer(size)
        got = libc.getxattr(bytes(mnt), b"user.fanstore.stats", value, size)
        assert got == size, (rel, os.strerror(ctypes.get_errno()))
        json.loads(value.raw)
    assert len(sizes) > 1  # the value did grow along the way


def test_a_large_file_is_read_a_block_at_a_time_within_the_cache(tmp_path):
    """A 48 MiB array stored in 1 MiB blocks, through a mount with a 4 MiB cache: whole reads stay byte-exact
    with the daemon's memory near its cache, and a random 4 KiB read decodes about one block."""
    src = tmp_path / "src"
    src.mkdir()
    data = np.cumsum(np.random.default_rng(4).standard_normal(12 << 20)).astype(np.float32).tobytes()
    (src / "array.f32").write_bytes(data)
    pack(src, tmp_path / "ds", PackOptions(codec="zstd:3", workers=1))
    with Mounted(tmp_path / "ds", tmp_path / "mnt", "--cache-size", "4MiB") as mount:
        path = mount.mountpoint / "array.f32"
        before = _rss(mount.pid)
        peak = before
        for _ in range(2):
            with open(path, "rb") as f:
                read = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    read.update(chunk)
                    peak = max(peak, _rss(mount.pid))
            assert read.hexdigest() == hashlib.sha256(data).hexdigest()
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next pass must come from the daemon again
            os.close(fd)
        assert peak - before < (4 << 20) + (24 << 20), f"RSS grew {(peak - before) >> 20} MiB for a 48 MiB file"
        loaded = _daemon_stats(mount.mountpoint)["cache"]["loaded_bytes"]
        rng = random.Random(6)
        reads = 200
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(reads):
                offset = rng.randrange(len(data) - 4096)
                assert os.pread(fd, 4096, offset) == data[offset:offset + 4096]
        finally:
            os.close(fd)
        decoded = _daemon_stats(mount.mountpoint)["cache"]["loaded_bytes"] - loaded
        assert decoded <= 1.5 * reads * (1 << 20), f"{decoded >> 20} MiB decoded for {reads} random 4 KiB reads"


def test_prefetch_decodes_ahead_in_directory_and_list_order(packed, tmp_path):
    _, ds = packed
    small = sorted(f"train/cat/{name}" for name in os.listdir(packed[0] / "train" / "cat"))

    def hits(*args: str, order: list[str]) -> int:
        """Cache hits of one pass in `order`. After each file the test waits until prefetch has nothing queued
        (as a trainer computes meanwhile), so every file prefetch should have decoded is decoded: no timing."""
        with Mounted(ds, tmp_path / "mnt", *args) as mount:
            for rel in order:
                (mount.mountpoint / rel).read_bytes()
                wait_until(lambda: _daemon_stats(mount.mountpoint)["prefetch"]["pending"] == 0, "prefetch caught up")
            stats = _daemon_stats(mount.mountpoint)
        assert f"{stats['cache']['hits']} hits" in mount.log.read_text()  # the unmount line says the same
        return stats["cache"]["hits"]

    assert hits("--prefetch", "0", order=small) == 0
    assert hits("--prefetch", "4", order=small) == 0  # small files decode on request: not worth a thread
    # In directory order, each file but the first was decoded ahead of its read.
    assert hits("--prefetch", "4", "--prefetch-min-size", "0", order=small) == len(small) - 1
    shuffled = small[:]
    random.Random(2).shuffle(shuffled)
    listing = tmp_path / "epoch.txt"
    listing.write_text("\n".join(shuffled) + "\n")
    assert hits("--prefetch", "4", "--prefetch-min-size", "0", "--prefetch-list", str(listing),
                order=shuffled) == len(small) - 1
    # The same order as a script reading the mount writes it: paths through the mount point.
    listing.write_text("\n".join(str(tmp_path / "mnt" / rel) for rel in shuffled) + "\n")
    assert hits("--prefetch", "4", "--prefetch-min-size", "0", "--prefetch-list", str(listing),
                order=shuffled) == len(small) - 1
    # Through a link and '..' (the link `cats` leads to train/cat, whose '..' is train): resolved as the kernel
    # resolves them, the same files; '..' was looked up as a name, and the mount refused the list.
    listing.write_text("\n".join(f"cats/../cat/{Path(rel).name}" for rel in shuffled) + "\n")
    assert hits("--prefetch", "4", "--prefetch-min-size", "0", "--prefetch-list", str(listing),
                order=shuffled) == len(small) - 1
    bad = tmp_path / "bad.txt"
    (tmp_path / "mnt2").mkdir()
    # A name the dataset lacks, a directory (taken without a word), a file named as a directory (taken as the file).
    for line, said in (("not/there.png", "'not/there.png' is not in the dataset"),
                       ("train/cat", "'train/cat' is a directory"),
                       ("train/cat/img_001.png/", "'train/cat/img_001.png' is not a directory")):
        bad.write_text(f"train/cat/img_001.png\n{line}\n")
        assert_one_line_error(run_cli("mount", str(ds), str(tmp_path / "mnt2"), "--log", str(tmp_path / "log"),
                                      "--prefetch-list", str(bad)),
                              "bad.txt:2", said)


def test_prefetch_comes_back_once_the_kernel_drops_the_files_it_held(tmp_path):
    """A file sent whole stays in the kernel's page cache, and prefetching it again would be wasted; but the kernel
    drops files when memory is short (a dataset larger than memory, every epoch), and then prefetch must work
    again, or every epoch after the first reads without it."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(4)
    count = 40
    names = [f"f{i:02d}.bin" for i in range(count)]
    for name in names:
        (src / name).write_bytes(np.repeat(rng.integers(0, 255, 32 * 1024, dtype=np.uint8), 2).tobytes())
    pack(src, tmp_path / "ds", PackOptions(codec="lz4", workers=1))
    with Mounted(tmp_path / "ds", tmp_path / "mnt", "--prefetch", "4", "--prefetch-min-size", "0") as mount:

        def epoch(drop_first: bool) -> tuple[int, int]:
            """Cache hits and files decoded in one pass in directory order."""
            if drop_first:
                for name in names:
                    fd = os.open(mount.mountpoint / name, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            before = _daemon_stats(mount.mountpoint)
            for name in names:
                path = mount.mountpoint / name
                assert path.read_bytes() == (src / name).read_bytes()
                wait_until(lambda: _daemon_stats(mount.mountpoint)["prefetch"]["pending"] == 0, "prefetch caught up")
            after = _daemon_stats(mount.mountpoint)
            return (after["cache"]["hits"] - before["cache"]["hits"],
                    after["prefetch"]["decoded"] - before["prefetch"]["decoded"])

        assert epoch(drop_first=False)[0] == count - 1
        # The kernel holds every file: the reads never reach the daemon, and nothing is decoded for nothing.
        assert epoch(drop_first=False) == (0, 0)
        assert _daemon_stats(mount.mountpoint)["prefetch"]["kernel_trust"] == 1.0
        # The kernel has dropped every file: after a few reads show it, prefetch decodes ahead again.
        hits, _ = epoch(drop_first=True)
        assert hits >= count - 16, f"{hits} of {count} files were decoded ahead after the kernel dropped them all"
        assert _daemon_stats(mount.mountpoint)["prefetch"]["kernel_trust"] < 0.5


def test_the_session_loop_hook_is_still_there():
    """The mount's fast session loop swaps pyfuse3's `trio` module attribute; a pyfuse3 without it would quietly
    serve through its own slower loop. Checked in a fresh interpreter: the swap is process-wide."""
    code = ("import pyfuse3, trio; from fanstore.mount.daemon_tuning import install_fast_session_loop; "
            "assert install_fast_session_loop(); assert pyfuse3.trio is not trio; "
            "assert pyfuse3.trio.Lock is not trio.Lock")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


# Another FUSE file system than fanstore's: an empty read-only directory, mounted at argv[1] as `fuse.other`.
_OTHER_FUSE = """
import stat, sys
import pyfuse3, trio

class Empty(pyfuse3.Operations):
    async def getattr(self, inode, ctx=None):
        attr = pyfuse3.EntryAttributes()
        attr.st_ino, attr.st_mode, attr.st_nlink = inode, stat.S_IFDIR | 0o755, 2
        return attr

pyfuse3.init(Empty(), sys.argv[1], {"ro", "fsname=other", "subtype=other"})
try:
    trio.run(pyfuse3.main)
finally:
    pyfuse3.close()
"""


def test_umount_leaves_a_file_system_that_is_not_fanstores(packed, tmp_path):
    """`fanstore umount` of a mount point that another FUSE file system uses (sshfs, squashfuse: a path mistyped)
    unmounted it all the same; it now refuses, naming what is mounted there."""
    mountpoint = tmp_path / "other"
    mountpoint.mkdir()
    other = subprocess.Popen([sys.executable, "-c", _OTHER_FUSE, str(mountpoint)])
    try:
        wait_until(lambda: fuse_mounted_at(mountpoint) or other.poll() is not None, "the other file system mounted")
        assert other.poll() is None, "the other FUSE file system did not start"
        assert_one_line_error(run_cli("umount", str(mountpoint)), f"MOUNTPOINT '{mountpoint}'", "fuse.other",
                              "not a fanstore mount")
        assert fuse_mounted_at(mountpoint)
        # and `fanstore mount` there says how to end it: with fusermount3, not with the umount that refuses it
        assert_one_line_error(run_cli("mount", str(packed[1]), str(mountpoint)), "already mounted here",
                              f"`fusermount3 -u {mountpoint}` (it is not fanstore's) first")
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)])
        other.wait(timeout=30)


def test_a_log_that_is_a_fifo_no_one_reads_is_refused_not_waited_on(packed, tmp_path):
    """`--log FIFO` with no reader hung the mount in its open for good; one with a reader (`--log >(logger)`) logs
    there, as before."""
    _, ds = packed
    mountpoint, fifo = tmp_path / "mnt", tmp_path / "log.fifo"
    mountpoint.mkdir()
    os.mkfifo(fifo)
    for foreground in ((), ("--foreground",)):
        refused = run_cli("mount", str(ds), str(mountpoint), "--log", str(fifo), *foreground, timeout=60)
        assert_one_line_error(refused, f"--log '{fifo}'", "a fifo that no process reads")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mounted_here = run_cli("mount", str(ds), str(mountpoint), "--log", str(fifo), timeout=60)
        assert mounted_here.returncode == 0, mounted_here.stderr
        assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(packed[0]))
    finally:
        run_cli("umount", str(mountpoint))
        os.close(reader)


def test_a_background_mount_refuses_a_prefetch_list_its_daemon_cannot_read(packed, tmp_path):
    """A background mount's daemon opens --prefetch-list itself, after this command: a fifo no one writes held it
    (and this command, waiting on it) for good, and a pipe of the caller's shell (`--prefetch-list <(...)`,
    /dev/fd/N) was said not to exist. Both are refused, saying to write the list to a file or mount --foreground."""
    _, ds = packed
    mountpoint, fifo = tmp_path / "mnt", tmp_path / "order.fifo"
    mountpoint.mkdir()
    os.mkfifo(fifo)
    read_end, write_end = os.pipe()
    os.write(write_end, b"labels.txt\n")
    os.close(write_end)
    try:
        for path, keywords in ((str(fifo), {}), (f"/dev/fd/{read_end}", {"pass_fds": (read_end,)})):
            refused = run_cli("mount", str(ds), str(mountpoint), "--prefetch-list", path, timeout=60, **keywords)
            assert_one_line_error(refused, f"--prefetch-list {path!r} is a pipe or fifo", "--foreground")
            assert not fuse_mounted_at(mountpoint)
    finally:
        os.close(read_end)
        run_cli("umount", str(mountpoint))


def test_a_command_a_message_suggests_runs_as_pasted_for_any_path(packed, tmp_path):
    """`fanstore umount my mnt` (a mount point with a space) or `fanstore umount -mnt` were the commands the mount's
    messages said to run: pasted, they unmounted nothing. Each path in a suggested command is quoted for the shell."""
    _, ds = packed
    for name in ("my mnt", "-mnt"):
        (tmp_path / name).mkdir()
        mounted_here = run_cli("mount", str(ds), f"./{name}" if name.startswith("-") else name, cwd=tmp_path)
        try:
            assert mounted_here.returncode == 0, mounted_here.stderr
            suggested = re.search(r"`(fanstore umount [^`]*)` to unmount", mounted_here.stdout).group(1)
            again = run_cli("mount", str(ds), str(tmp_path / name))
            assert_one_line_error(again, "already mounted here")
            then = re.search(r"`(fanstore umount [^`]*)` first", again.stderr).group(1)
            for command in (then, suggested):  # each as a shell runs it: the last one unmounts
                words = shlex.split(command)
                assert words[2] in (str(tmp_path / name), name, f"./{name}"), command
            unmounted = run_cli(*shlex.split(suggested)[1:], cwd=tmp_path)
            assert unmounted.returncode == 0 and not fuse_mounted_at(tmp_path / name), unmounted.stderr
        finally:
            run_cli("umount", str(tmp_path / name))


def test_a_mount_point_another_file_system_is_mounted_on_says_to_mount_elsewhere(packed, tmp_path):
    """A tmpfs (no FUSE) mounted at MOUNTPOINT was refused with 'fanstore umount MOUNTPOINT first', which unmounts
    FUSE file systems only and refused it."""
    from conftest import mounted as mounted_with  # this module's `mounted` is a fixture

    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    with mounted_with(mountpoint, "-t", "tmpfs", "tmpfs", purpose="mount a tmpfs"):
        refused = run_cli("mount", str(packed[1]), str(mountpoint))
        assert_one_line_error(refused, f"{mountpoint}: another file system is mounted here; mount elsewhere")


def test_the_default_log_ignores_an_empty_or_relative_home_or_runtime_dir(tmp_path, monkeypatch):
    """HOME='' put the default log in /.cache on the root file system, and HOME or XDG_RUNTIME_DIR relative (a job
    script's `HOME=scratch`) in a directory made under wherever the mount was run. As the XDG spec says, a relative
    or empty one is ignored: the home is then the user's from the password database."""
    import pwd

    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "relative").mkdir()
    for variables in ({"HOME": ""}, {"HOME": "relative"}, {"HOME": "relative", "XDG_RUNTIME_DIR": "relative"}):
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        log = default_log_path(Path("/mnt/x"))
        assert log.parent == home / ".cache" / "fanstore", (variables, log)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_log_path(Path("/mnt/x")).parent == tmp_path / "fanstore"
