"""The ready file a rank without COMMAND writes once every rank is mounted (its mount point, its pid, its readers'
socket, a line each), as found at start: one a killed job left is removed, so that a batch script waiting for it
waits for this job; one a running job serves from is that job's, and is refused, not taken over.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from ..mount.mountinfo import FANSTORE_SUBTYPE, fuse_type


def serving_from(ready_file: Path) -> tuple[int, str] | None:
    """The pid and mount point a ready file names, where that process is a running fanstore serve and its mount
    point a fanstore mount: the file is a live job's. None for a file left by a job that ended, or none."""
    try:
        lines = ready_file.read_text(encoding="utf-8", errors="surrogateescape").split("\n")
        mountpoint, pid = lines[0], int(lines[1])
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    if b"serve" not in argv or not any(b"fanstore" in word for word in argv[:3]):  # python -m fanstore serve
        return None
    try:
        mounted = fuse_type(Path(mountpoint)) == f"fuse.{FANSTORE_SUBTYPE}"
    except OSError:
        mounted = False
    return (pid, mountpoint) if mounted else None


def clear_left_ready_file(ready_file: Path, option: str) -> None:
    """Remove the ready file a killed job left at this rank's path; refuse one a running job serves from (two jobs
    on one node given the same --ready-file: the second took the first's over, and a script that signals the pid
    it reads there signalled the wrong job). `option`: how the path was given, for the message."""
    live = serving_from(ready_file)
    if live is not None:
        raise UsageError(f"{option}: {ready_file} is a running job's (pid {live[0]}, serving {live[1]}); give each "
                         f"job its own")
    try:
        ready_file.unlink(missing_ok=True)
    except OSError as exc:
        raise UsageError(f"{option}: cannot remove the one an earlier job left, {ready_file}: {exc.strerror}") \
            from None
