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
        """Write this epoch's order of item numbers; readers see all of it or the previous one, never a part."""
        self._published += 1
        data = np.concatenate([np.array([self._published], dtype=np.int64), np.asarray(order, dtype=np.int64)])
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data.tobytes())
        os.replace(temporary, self.path)

    def current(self) -> tuple[int, np.ndarray]:
        """(serial, order) as last published, the serial counting publications from 1; (-1, empty) before the
        first. Re-read only when the file changed."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return self._serial, self._order
        identity = (info.st_ino, info.st_mtime_ns)
        if identity != self._seen:
            data = np.fromfile(self.path, dtype=np.int64)
            if len(data):
                self._seen, self._serial, self._order = identity, int(data[0]), data[1:]
        return self._serial, self._order

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
