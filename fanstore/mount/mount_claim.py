"""One mount at a time at a mount point: the check that MOUNTPOINT is free and the mount itself, as one step.

check_mountpoint reads mountinfo, and the mount comes later (under serve, after staging): two jobs given the same
MOUNTPOINT at once both found it free and both mounted, one over the other, and the first job's command read the
second job's dataset there (other bytes under the same names), then lost its files when the second unmounted. So a
mount holds an flock on the mount point's own directory, taken before the last look at mountinfo and kept until the
mount is gone; the kernel drops it when the process ends, however it ends.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.flocks import lock_now
from ..errors import FanstoreError
from .mountinfo import fuse_mounted_at


class MountpointUnavailable(FanstoreError, OSError):
    """The mount point cannot be had: another process is mounting there, has mounted there since it was checked, or
    it is gone."""


class MountpointClaim:
    """This process's hold on `mountpoint` (an existing directory nothing is mounted on), until `close`."""

    def __init__(self, mountpoint: Path) -> None:
        """MountpointUnavailable where another mount holds it or came since check_mountpoint looked."""
        self.mountpoint = mountpoint
        # Opened before anything is mounted here, so the lock is on the directory below any mount to come: another
        # process that opens it later reaches the same directory (and waits its turn) or, once mounted, the mount
        # (and finds it in mountinfo).
        try:
            self._fd: int | None = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:  # gone or replaced since it was checked
            raise MountpointUnavailable(f"{mountpoint}: cannot mount here: {exc.strerror}") from None
        try:
            lock_now(self._fd)
        except BlockingIOError:
            self.close()
            raise MountpointUnavailable(f"{mountpoint}: another process is mounting a dataset here (another job "
                                        f"given the same MOUNTPOINT?); give each its own") from None
        except OSError:  # flock failing otherwise: mountinfo alone, as where there is none
            pass
        if fuse_mounted_at(mountpoint):
            self.close()
            raise MountpointUnavailable(f"{mountpoint}: mounted by another process since it was checked (another "
                                        f"job given the same MOUNTPOINT?); give each its own")

    def close(self) -> None:
        """The mount is gone: another may take the mount point."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
