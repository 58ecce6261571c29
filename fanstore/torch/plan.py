"""The epoch order, from the sampler (in the training process) to the readers (its DataLoader workers).

A sampler draws each epoch's order in the main process, after the workers have started, so the order cannot
travel with the pickled dataset. It goes through one small file instead, rewritten (atomically) at the start of
each epoch; a worker looks at the file's identity once per batch and reloads it when it changed. Works the same
whatever starts the workers (fork, spawn, forkserver) and costs one stat per batch.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np

_SHM = Path("/dev/shm")
_PREFIX = "fanstore-plan-"
_HEADER_BYTES = 16  # the serial and the bytes per number (int64 each), before the order


class EpochPlan:
    """One loader's epoch order: `publish` in the process that samples, `current` in those that read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._order = np.empty(0, dtype=np.int64)
        self._serial = -1
        self._published = 0

    @classmethod
    def create(cls) -> "EpochPlan":
        """A plan file of this process's own, removed when the plan object is collected or the process exits. A
        process that ends without running its exit handlers (killed, or leaving by os._exit) leaves its files:
        each new plan first removes those of processes that are gone."""
        folder = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else Path(tempfile.gettempdir())
        _remove_orphans(folder)
        plan = cls(str(folder / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.npy"))
        weakref.finalize(plan, _remove, plan.path, os.getpid())
        return plan

    def publish(self, order: Sequence[int] | np.ndarray) -> None:
        """Write this epoch's order of item numbers; readers see all of it or the previous one, never a part. The
        file holds the serial and the width of a number (4 bytes where every item fits, else 8), then the order."""
        self._published += 1
        order = np.asarray(order, dtype=np.int64)
        fits = not len(order) or (int(order.min()) >= -(2**31) and int(order.max()) < 2**31)
        numbers = order.astype(np.int32) if fits else order
        temporary = f"{self.path}.{uuid.uuid4().hex[:12]}.tmp"  # each publish its own: two threads may publish at once
        with open(temporary, "wb") as handle:
            handle.write(np.array([self._published, numbers.itemsize], dtype=np.int64).tobytes())
            handle.write(numbers.tobytes())
        os.replace(temporary, self.path)

    def current(self) -> tuple[int, np.ndarray]:
        """(serial, order) as last published, the serial counting publications from 1; (-1, empty) before the
        first. Re-read only when the file changed."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return self._serial, self._order
        if (info.st_ino, info.st_mtime_ns) != self._seen:
            self._load()
        return self._serial, self._order

    def _load(self) -> None:
        """Map the published order, not read it: every worker of the loader shares one copy. A plan file is never
        rewritten in place (publish renames a new one over it), so the mapped pages stay whole."""
        try:
            with open(self.path, "rb") as handle:
                info = os.fstat(handle.fileno())
                header = np.frombuffer(handle.read(_HEADER_BYTES), dtype=np.int64)
                if len(header) < 2 or int(header[1]) not in (4, 8):
                    return
                dtype = np.int32 if int(header[1]) == 4 else np.int64
                count = (info.st_size - _HEADER_BYTES) // dtype().itemsize
                order = (np.memmap(handle, dtype=dtype, mode="r", offset=_HEADER_BYTES, shape=(count,)) if count
                         else np.empty(0, dtype=dtype))
        except (FileNotFoundError, ValueError):  # replaced or removed meanwhile: the next batch looks again
            return
        self._seen, self._serial, self._order = (info.st_ino, info.st_mtime_ns), int(header[0]), order

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])  # type: ignore[misc]


def _remove_orphans(folder: Path) -> None:
    """Remove plan files whose creating process no longer runs (its pid is in the name)."""
    for path in folder.glob(f"{_PREFIX}*.npy*"):
        pid = path.name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            try:
                path.unlink()
            except OSError:  # removed meanwhile, or not ours to remove
                pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker's copy is collected too; only the creator removes the file
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
