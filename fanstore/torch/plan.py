"""The epoch order, from the sampler (in the training process) to the readers (its DataLoader workers).

A sampler draws each epoch's order in the main process, after the workers have started, so the order cannot
travel with the pickled dataset. It goes through memory the kernel alone keeps: each publication is a new memfd,
sealed once written, put in place of the last at one descriptor number of the training process (dup2, atomic),
and a worker opens it as /proc/PID/fd/N. A worker looks at that descriptor's identity once per batch and maps the
order again when it changed; where the sampler yields batches, their bounds travel with the order, so a worker
finds its next batches whatever their sizes. Works the same whatever starts the workers (fork, spawn, forkserver)
and costs one stat per batch. Nothing has a name in a file system: the memory goes when the training process and
the workers that map it have ended, however they end (a plan file in /dev/shm stayed after SIGKILL, SIGTERM or
os._exit).
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from typing import NamedTuple, Sequence

import numpy as np

_HEADER_BYTES = 24  # the serial, the bytes per number and how many numbers the order holds (int64 each)
_NAME = "fanstore-epoch-plan"  # what /proc/PID/maps and ls -l /proc/PID/fd show
_NONE = np.empty(0, dtype=np.int64)


class Publication(NamedTuple):
    """One publication, whole: its serial (counting from 1; -1 before the first), the order of item numbers, and
    where the sampler yielded batches, their bounds (batch k is order[bounds[k]:bounds[k + 1]]; empty otherwise)."""

    serial: int
    order: np.ndarray
    bounds: np.ndarray


class EpochPlan:
    """One loader's epoch order: `publish` in the process that samples, `current` in those that read."""

    def __init__(self, path: str | None) -> None:
        """`path`: where readers open the order, /proc/PID/fd/N of the publishing process (None: no readers
        elsewhere, where the system has no memfd)."""
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._latest = Publication(-1, _NONE, _NONE)  # set at once: a reader never pairs one order with other bounds
        self._published = 0
        self._owner: int | None = None  # the process whose descriptor `path` names: it publishes, and reads its own
        self._slot = -1  # that descriptor
        self._publishing = threading.Lock()  # two samplers of one dataset may publish from two threads

    @classmethod
    def create(cls) -> "EpochPlan":
        """A plan of this process's own; its descriptor is closed when the plan object is collected."""
        plan = cls(None)
        plan._take_slot()
        return plan

    def _take_slot(self) -> None:
        """Hold the descriptor each publication is put at, in this process (a child forked from the creator that
        publishes gets its own: the creator's descriptor table is not the child's)."""
        self._owner = os.getpid()
        if not hasattr(os, "memfd_create"):  # not Linux: this process alone sees its plan
            self.path = None
            return
        self._slot = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        self.path = f"/proc/{self._owner}/fd/{self._slot}"
        weakref.finalize(self, _close, self._slot, self._owner)

    def publish(self, order: Sequence[int] | np.ndarray, bounds: Sequence[int] | np.ndarray | None = None) -> None:
        """Publish this epoch's order of item numbers, and the bounds of its batches where the sampler yielded
        batches (0, then each batch's end); readers see all of it or the previous one, never a part. It holds the
        serial, the width of a number (4 bytes where every one fits, else 8) and the order's length, then the order,
        then the bounds."""
        order = np.ascontiguousarray(order, dtype=np.int64)
        bounds = _NONE if bounds is None else np.ascontiguousarray(bounds, dtype=np.int64)
        fits = not len(order) or (int(order.min()) >= -(2**31) and max(int(order.max()), len(order)) < 2**31)
        width = np.int32 if fits else np.int64
        numbers, limits = order.astype(width), bounds.astype(width)
        with self._publishing:
            if self._owner != os.getpid():
                self._take_slot()
            self._published += 1
            header = np.array([self._published, numbers.itemsize, len(numbers)], dtype=np.int64).tobytes()
            if self._slot >= 0:
                _put(self._slot, header, numbers, limits)
            self._latest = Publication(self._published, numbers, limits)

    def current(self) -> Publication:
        """The last publication; (-1, empty, empty) before the first. In another process, re-read only when the
        publication changed."""
        if self._owner == os.getpid() or self.path is None:
            return self._latest
        try:
            info = os.stat(self.path)
        except OSError:  # the publishing process is gone: its last order stands
            return self._latest
        if (info.st_ino, info.st_mtime_ns) != self._seen:
            self._load()
        return self._latest

    def _load(self) -> None:
        """Map the published order, not read it: every worker of the loader shares one copy. A publication is
        sealed, never written again (the next one is another memfd), so the mapped pages stay whole."""
        assert self.path is not None
        try:
            with open(self.path, "rb") as handle:
                info = os.fstat(handle.fileno())
                header = np.frombuffer(handle.read(_HEADER_BYTES), dtype=np.int64)
                if len(header) < 3 or int(header[1]) not in (4, 8):
                    return
                dtype = np.int32 if int(header[1]) == 4 else np.int64
                count = (info.st_size - _HEADER_BYTES) // dtype().itemsize
                numbers = (np.asarray(np.memmap(handle, dtype=dtype, mode="r", offset=_HEADER_BYTES, shape=(count,)))
                           if count else np.empty(0, dtype=dtype))  # a plain array: cheaper to index than a memmap
        except (OSError, ValueError):  # the publisher gone meanwhile: the next batch looks again
            return
        length = min(int(header[2]), count)
        self._seen = (info.st_ino, info.st_mtime_ns)
        self._latest = Publication(int(header[0]), numbers[:length], numbers[length:])

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])  # type: ignore[misc]


def _put(slot: int, header: bytes, numbers: np.ndarray, bounds: np.ndarray) -> None:
    """Write one publication into a memfd of its own, seal it, and put it at `slot` in one step (dup2)."""
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(fd, "wb", closefd=False) as out:
            out.write(header)
            out.write(memoryview(numbers).cast("B"))
            out.write(memoryview(bounds).cast("B"))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)  # what a reader maps stays as written
        os.dup2(fd, slot, inheritable=False)
    finally:
        os.close(fd)


def _close(slot: int, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker's copy is collected too; its descriptor table is its own
        try:
            os.close(slot)
        except OSError:
            pass
