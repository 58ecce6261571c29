"""One pack at a time in a DEST: two packs writing one DEST removed each other's chunk files and wrote an index of
chunks the other had replaced or removed (or died in a traceback), so a pack holds an flock on DEST's directory
from before it writes there until it ends.

The lock is on the directory itself, not on a file in it: DEST holds only what a pack writes (a finished dataset is
byte-identical to an uninterrupted pack), and the kernel drops an flock when its holder ends, however it ends, so a
killed pack leaves nothing to clean up. Where the file system has no flock on a directory (Lustre mounted
noflock, NFS), packs go on without it, as they did before.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from ..core.flocks import lock_now
from ..errors import UsageError, quoted

class DestLock:
    """Held from `take` until `release` (or the end of a `with`); `take` on a DEST that another pack holds raises
    UsageError naming DEST."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self._fd: int | None = None

    def take(self) -> None:
        """Lock DEST, a directory that exists; a second call does nothing."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return  # DEST cannot be opened (not a directory, no permission): the pack's own checks say so
        try:
            lock_now(fd)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"DEST {quoted(self.dest)} is being written by another fanstore-pack; let it end (or "
                             "stop it) and run this command again") from None
        except OSError:
            os.close(fd)
            raise
        self._fd = fd  # kept open without a lock where there is no flock: `take` is not retried

    def take_if_there(self) -> None:
        """Lock DEST now if it is a directory already, so that a second pack is refused before it walks SRC."""
        if self.dest.is_dir():
            self.take()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DestLock":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()
