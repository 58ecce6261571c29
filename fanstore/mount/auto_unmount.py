"""libfuse's auto_unmount for `fanstore mount`: a daemon killed outright (SIGKILL, the OOM killer) runs no handler,
and its mount stayed behind, every access ENOTCONN until someone unmounted it.

With the option libfuse mounts through fusermount3 (root too, where it would call mount(2) itself), which stays as
a child of the daemon, in a session of its own and blocking every signal but SIGKILL, reading a socket whose other
end only the daemon holds. When the daemon ends, however it ends, the socket closes and fusermount3 unmounts
MOUNTPOINT if a fanstore mount there answers ENOTCONN (its daemon gone), then exits; after a clean unmount it finds
none and just exits. It goes by path, not by its own mount (fusermount3 3.14, util/fusermount.c
should_auto_unmount), so a live mount at the same path is left alone but any dead fanstore one there is removed:
serve ranks leave this to their watchdog, which removes only its rank's mount, by device.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("fanstore.mount")


def auto_unmount_option(mountpoint: Path) -> set[str]:
    """{"auto_unmount"} where fusermount3 is installed; else nothing, said in one log line: libfuse would fail to
    mount at all without it, and root mounts without it (mount(2))."""
    if shutil.which("fusermount3") is None:
        log.warning("%s: fusermount3 is not installed (Debian package fuse3): mounted without auto_unmount, so "
                    "a daemon killed outright leaves a stale mount", mountpoint)
        return set()
    return {"auto_unmount"}


class FuseDeviceReleasedFirst:
    """A second descriptor of this process's /dev/fuse, numbered above every descriptor open now, held from the
    mount until just before the session closes, so that a killed daemon's connection is ended before fusermount3
    wakes.

    A dying process's descriptors are closed in order of number, and the files released in the reverse order (the
    kernel's task_work runs last queued first, Linux 4.3 on). libfuse's end of fusermount3's socket is numbered just
    above /dev/fuse, so it was released first: fusermount3 woke and opened MOUNTPOINT before the kernel released
    /dev/fuse and ended the connection, its request ended ECONNABORTED rather than ENOTCONN, and it left the mount
    stale (6 kills in 20 on a busy two-core machine). With /dev/fuse's last descriptor above the socket's, the
    connection has ended by the time the socket closes.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        numbers = [int(name) for name in os.listdir("/proc/self/fd")]
        device = next((number for number in numbers if _target(number) == "/dev/fuse"), None)
        if device is not None:
            try:
                self._fd = fcntl.fcntl(device, fcntl.F_DUPFD_CLOEXEC, max(numbers) + 1)
            except OSError as exc:  # out of descriptors: the helper may then miss a killed daemon, as before
                log.info("/dev/fuse not held apart (%s): a killed daemon's mount may stay stale", exc.strerror)

    def close(self) -> None:
        """The session closes next: libfuse's descriptor is the last again, as libfuse expects."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _target(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor listing /proc/self/fd, closed since
        return None
