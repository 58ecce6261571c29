"""Where FUSE file systems are mounted, read from /proc/self/mountinfo and never by a lookup that a hung daemon could
make wait: mount points resolved as mountinfo spells them, the mount holding a path, a mount's read-ahead."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable

from ..errors import UsageError, quoted

log = logging.getLogger("fanstore.mount")


def fuse_device(mountpoint: Path) -> str | None:
    """The `major:minor` of the FUSE mount at `mountpoint` (its backing device, hence its sysfs bdi), or None."""
    mounts = fuse_mounts()
    return mounts.get(str(_resolve(mountpoint, mounts)))


def resolve_mountpoint(mountpoint: Path) -> Path:
    """`mountpoint` as /proc/self/mountinfo spells it: absolute, every symlink followed.

    Unlike os.path.realpath it looks nothing up at or below a FUSE mount, whose daemon may be gone (ENOTCONN) or
    hung (the lookup would wait forever); elsewhere symlinks are followed with readlink alone.
    """
    return _resolve(mountpoint, fuse_mounts())


def read_ahead_setting(mountpoint: Path) -> Path | None:
    """The sysfs file holding the read-ahead (KiB) of the FUSE mount at `mountpoint`, or None if none is mounted."""
    device = fuse_device(mountpoint)
    return None if device is None else Path("/sys/class/bdi") / device / "read_ahead_kb"


def set_read_ahead(mountpoint: Path, kib: int) -> int | None:
    """Set the read-ahead of the FUSE mount at `mountpoint`; returns the value in effect, None if unknown.

    It must be set after the kernel has had the INIT reply, which caps it at what the file system answered
    then. Writing it needs root; otherwise the kernel default stays, and that is all that is lost.
    """
    setting = read_ahead_setting(mountpoint)
    if setting is None:
        return None
    try:
        if kib > 0:
            setting.write_text(f"{kib}\n")
        return int(setting.read_text())
    except (OSError, ValueError) as exc:
        log.info("read-ahead of %s left as it is: %s", mountpoint, exc)
        return None


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
_MAX_SYMLINKS = 40  # the kernel's limit for one lookup


FANSTORE_SUBTYPE = "fanstore"  # the FUSE subtype a fanstore mount is given, mountinfo's type `fuse.fanstore`


def fuse_mounts() -> dict[str, str]:
    """Mount point -> `major:minor` of every FUSE file system in /proc/self/mountinfo, the latest one per path."""
    return {mountpoint: device for mountpoint, (device, _) in _fuse_mounts().items()}


def fuse_type(mountpoint: Path) -> str | None:
    """The type mountinfo gives the latest FUSE mount at the resolved `mountpoint` (`fuse.fanstore`, `fuse.sshfs`),
    or None where none is."""
    found = _fuse_mounts().get(str(mountpoint))
    return None if found is None else found[1]


def _fuse_mounts() -> dict[str, tuple[str, str]]:
    """Mount point -> (`major:minor`, type) of every FUSE file system in /proc/self/mountinfo, the latest per path."""
    mounts = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            fs_type = fields[fields.index("-") + 1]
            if fs_type in ("fuse", "fuseblk") or fs_type.startswith("fuse."):
                mounts[_unescape(fields[4])] = (fields[2], fs_type)
    return mounts


def fuse_mount_holding(path: str, mounts: Iterable[str]) -> str | None:
    """The innermost of the FUSE `mounts` at or above the resolved `path`, or None."""
    holders = [mount for mount in mounts if path == mount or path.startswith(mount.rstrip("/") + "/")]
    return max(holders, key=len, default=None)


def _resolve(mountpoint: Path, mounts: Iterable[str]) -> Path:
    resolved = "/"
    # os.getcwd only for a relative path: it fails where the current directory was removed.
    absolute = mountpoint if mountpoint.is_absolute() else os.path.join(os.getcwd(), mountpoint)
    pending = str(absolute).split("/")[::-1]  # a stack: the next component last
    links_followed = 0
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, name)
        resolved = candidate
        if fuse_mount_holding(candidate, mounts) is not None:
            continue  # at or inside a FUSE mount: taken as written
        try:
            target = os.readlink(candidate)
        except OSError:
            continue  # not a symlink (EINVAL), or nothing there: the checks that follow say which
        links_followed += 1
        if links_followed > _MAX_SYMLINKS:
            raise UsageError(f"MOUNTPOINT {quoted(mountpoint)}: too many levels of symbolic links")
        resolved = "/" if target.startswith("/") else os.path.dirname(candidate)
        pending.extend(target.split("/")[::-1])
    return Path(resolved)


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)  # "\040" for a space, ...


def fuse_mounted_at(mountpoint: Path) -> bool:
    """Whether /proc/self/mountinfo lists a FUSE mount at `mountpoint`; unlike a stat, this never waits on a
    daemon that has stopped answering."""
    return fuse_device(mountpoint) is not None
