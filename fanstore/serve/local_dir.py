"""A serve rank's local directory: held for the job, DEST's chunk files under their names as sparse files of the
rank's bytes, the manifest of the ranges verified there, and, once staged, the copy of DEST's index.

staging.py decides what goes in and checks it; this is where it is kept, so that a job restarted on the same nodes
finds it again (the manifest) and no other job undoes it meanwhile (the lock).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import stat
from pathlib import Path
from typing import Iterable

import numpy as np

from ..core.durable import write_atomically
from ..core.flocks import lock_now
from ..core.format import INDEX_NAME, chunk_file_name
from ..errors import FanstoreError
from .blob_spans import Span

MANIFEST_NAME = "fanstore-staged.json"
LOCK_NAME = "fanstore-serve.lock"  # held by the job that uses the directory (claim_local_dir)
WATCHDOG_LOG = "fanstore-watchdog.log"  # what the rank's watchdog (watchdog.py) did
MANIFEST_VERSION = 1


class StagingError(FanstoreError):
    """This rank's local directory cannot take its share, or another rank's cannot (that rank says why)."""


class StagingBroken(StagingError):
    """This rank's local directory failed once the ranks had begun moving bytes (full, out of inodes, an I/O
    error), or took no copy of the index once they were done: the others are half-way through the same collective
    work, or about to wait on this rank, so the job has to end."""


def check_written_in_place(path: Path, chunks: Iterable[int]) -> None:
    """The files a rank writes in place in its local directory (the lock, the watchdog's log, the chunk files of
    its share, `chunks`) must be its own: a symbolic link there, or a hard link (a directory made with `cp -al` or
    `cp -as` of DEST), would have staging truncate and overwrite the file it leads to, DEST's own chunk files and
    index among them. The lock and the log are opened at start, where anything but a file stopped the rank: a
    directory in a traceback, a fifo for good (opening it to write waits for a reader). StagingError naming the
    first such file; the files written atomically (the manifest, the index copy) replace a link and need no check,
    and a chunk file that is not a file fails staging, naming it."""
    opened_at_start = (path / LOCK_NAME, path / WATCHDOG_LOG)
    for name in (*opened_at_start, *(path / chunk_file_name(chunk) for chunk in chunks)):
        try:
            info = os.lstat(name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StagingError(f"--local-dir {path}: cannot look at {name}: {exc.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            raise StagingError(f"--local-dir {path}: {name} is a symbolic link (to {os.readlink(name)}): fanstore "
                               f"writes that file in place and would write through the link; remove it")
        if name in opened_at_start and not stat.S_ISREG(info.st_mode):
            raise StagingError(f"--local-dir {path}: {name} is {_kind_of(info.st_mode)}, not a file: fanstore keeps "
                               f"a file of its own there; remove it")
        if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            raise StagingError(f"--local-dir {path}: {name} is a hard link ({info.st_nlink} names, a copy made with "
                               f"`cp -al`?): fanstore writes that file in place and would change every name's; "
                               f"remove it")


def _kind_of(mode: int) -> str:
    """What a directory entry that is not a regular file is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((kind for is_kind, kind in kinds if is_kind(mode)), "not a regular file")


def claim_local_dir(path: Path) -> int | None:
    """Hold the local directory for this job: another job on this node staging into it at the same time would undo
    this one's chunk files and remove its readers' socket. The hold is an flock, which the kernel drops when the
    process ends, however it ends; the descriptor returned keeps it (None where the file system has no flock)."""
    try:
        lock = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # another user's directory, say
        raise StagingError(f"--local-dir {path}: cannot use it: {exc.strerror}") from None
    try:
        held = lock_now(lock)
    except BlockingIOError:
        holder = os.pread(lock, 256, 0).decode("utf-8", "replace").split()
        os.close(lock)
        pid, host = (holder + ["unknown", "unknown"])[:2]
        if host in (socket.gethostname(), "unknown"):
            raise StagingError(f"--local-dir {path}: in use by another fanstore serve (pid {pid}); give each job "
                               f"its own") from None
        raise StagingError(f"--local-dir {path}: in use by fanstore serve pid {pid} on {host}: is it on a shared "
                           f"file system? Each node needs its own, on node-local storage") from None
    except OSError as exc:
        os.close(lock)
        raise StagingError(f"--local-dir {path}: cannot lock {LOCK_NAME}: {exc.strerror}") from None
    if not held:
        os.close(lock)
        return None  # a file system without flock (Lustre mounted noflock): node-local storage has it
    try:  # who holds it, for another job's message: a note, which a full directory need not stop the job for
        os.ftruncate(lock, 0)
        os.pwrite(lock, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # the space check says what a full directory lacks; the other job's message then says "unknown"
    return lock


def copy_index(local_dir: Path, index_bytes: bytes | mmap.mmap, rank: int) -> Path:
    """Put DEST's index file, byte for byte, in the local directory under its own name, once staging succeeded: the
    node's readers (every DataLoader worker, every epoch) load it from there, never from DEST. The directory failing
    here ends the job as it does during staging (StagingBroken): the other ranks are about to wait on this one."""
    path = local_dir / INDEX_NAME
    try:
        write_atomically(path, index_bytes)
    except OSError as exc:
        raise StagingBroken(f"rank {rank} on {socket.gethostname()}: --local-dir {local_dir}: cannot write {path}: "
                            f"{exc.strerror}") from None
    return path


class LocalDirectory:
    """A rank's local directory: sparse chunk files under DEST's names, and the manifest of verified ranges."""

    def __init__(self, path: Path, chunk_sizes: np.ndarray) -> None:
        self.path = path
        self._sizes = [int(size) for size in chunk_sizes]
        self._fds: dict[int, int] = {}

    def chunk_path(self, chunk: int) -> Path:
        return self.path / chunk_file_name(chunk)

    def read_manifest(self, identity: str) -> dict[int, list[tuple[int, int]]]:
        """Ranges this directory holds verified for the dataset `identity`; nothing for another dataset."""
        try:
            manifest = json.loads((self.path / MANIFEST_NAME).read_text())
            if manifest.get("version") != MANIFEST_VERSION or manifest.get("dataset") != identity:
                return {}
            return {int(chunk): [(int(a), int(b)) for a, b in ranges] for chunk, ranges in manifest["chunks"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def write_manifest(self, identity: str, ranges: dict[int, list[tuple[int, int]]]) -> None:
        manifest = {"version": MANIFEST_VERSION, "dataset": identity,
                    "chunks": {str(chunk): sorted(spans) for chunk, spans in sorted(ranges.items())}}
        write_atomically(self.path / MANIFEST_NAME, json.dumps(manifest).encode())

    def forget_manifest(self) -> None:
        """Staging is about to change the directory: until it ends, nothing in it counts as verified."""
        try:
            (self.path / MANIFEST_NAME).unlink()
        except FileNotFoundError:
            pass

    def read(self, span: Span) -> bytes | None:
        """The span's bytes as the local file holds them, or None when the file is missing, not a regular file (a
        fifo put there must not hold the read), or not the chunk's size."""
        try:
            fd = os.open(self.chunk_path(span.chunk), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != self._sizes[span.chunk]:
                return None
            data = os.pread(fd, span.end - span.start, span.start)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) == span.end - span.start else None

    def open_for_staging(self, chunk: int, keep: bool) -> None:
        """Open a chunk file to write into; unless it holds ranges to `keep`, start it empty (a sparse file of the
        chunk's size), so no byte of an earlier dataset stays behind in its holes."""
        path = self.chunk_path(chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a fifo: its ftruncate said only "Invalid argument"
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            if not keep:
                os.ftruncate(fd, 0)
            os.ftruncate(fd, self._sizes[chunk])
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, exc.filename or str(path)) from None
        self._fds[chunk] = fd

    def write(self, chunk: int, start: int, data: bytes | memoryview) -> None:
        written = os.pwrite(self._fds[chunk], data, start)
        while written < len(data):
            written += os.pwrite(self._fds[chunk], memoryview(data)[written:], start + written)

    def close(self, sync: bool = True) -> None:
        for fd in self._fds.values():
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        self._fds.clear()
