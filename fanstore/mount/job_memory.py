"""How much memory this job may still use: the machine's available memory, and the limit of its memory cgroup.

Under SLURM (and in most containers) a job's memory is a cgroup limit, and the OOM killer ends the job there
whatever the machine has free. Pages written to a tmpfs (`/dev/shm`) are charged to the cgroup of the process that
writes them and stay charged while the files exist, so a node's local directory there and the mount's decoded cache
draw on the same limit. `job_memory` answers for both users, the cache's default size (mount.cache_bound) and the
space check before staging (serve/staging.py), from /proc and /sys alone.

Every path is read below `root` ("/" but in tests, which build a fake /proc and /sys there). What cannot be read
(no cgroup file system mounted, a cgroup path outside the mount, a file missing) counts as no limit, never as an
error: the machine's memory still bounds the answer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.units import format_bytes

# A limit at or above this is "none": cgroup v1 writes no limit as 2**63 less a page, v2 as "max".
NO_LIMIT = 1 << 60
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # whose pages are memory, charged to the writer's cgroup
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class CgroupLimit:
    """The memory cgroup whose limit leaves this process the least: it or one above it."""

    path: str  # as /proc/self/cgroup names it: "/slurm/uid_1000/job_42"
    version: int  # 1 or 2
    limit: int  # bytes: memory.limit_in_bytes (v1) or memory.max (v2)
    used: int  # bytes charged to it now (its cgroups below included), less the page cache it can drop

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used)

    def describe(self) -> str:
        return (f"this job's memory cgroup {self.path} (limit {format_bytes(self.limit)}, "
                f"{format_bytes(self.used)} in use)")


@dataclass(frozen=True, slots=True)
class JobMemory:
    machine_available: int  # bytes: MemAvailable in /proc/meminfo
    cgroup: CgroupLimit | None  # None: no memory cgroup above this process sets a limit (or none can be read)

    @property
    def available(self) -> int:
        """Bytes this job may still take: the lesser of the machine's available memory and its cgroup's room."""
        return self.machine_available if self.cgroup is None else min(self.machine_available, self.cgroup.left)

    @property
    def bound_by_cgroup(self) -> bool:
        return self.cgroup is not None and self.cgroup.left < self.machine_available

    def describe(self) -> str:
        """Where `available` comes from, for a log line or a refusal: "the 3.6 GB left in this job's memory
        cgroup /slurm/job_42 (limit 4.8 GB, 1.2 GB in use)"."""
        said = f"the machine's available memory, {format_bytes(self.machine_available)} (MemAvailable)"
        if self.cgroup is None:
            return said
        if self.bound_by_cgroup:
            return f"the {format_bytes(self.cgroup.left)} left in {self.cgroup.describe()}"
        return f"{said}; {self.cgroup.describe()} leaves more"


def job_memory(root: Path = Path("/")) -> JobMemory:
    """How much memory this process, and every process of its cgroup, may still take; read afresh on each call."""
    return JobMemory(_mem_available(root), _cgroup_limit(root))


def memory_file_system(path: Path, root: Path = Path("/")) -> str | None:
    """The type of the file system holding `path` when its files are memory (tmpfs, ramfs), else None.

    Read from mountinfo: the innermost mount at or above `path`, links followed.
    """
    target = os.path.realpath(path)
    best, best_type = "", None
    for fields in _mountinfo(root):
        mountpoint = fields[4]
        if target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/"):
            if len(mountpoint) >= len(best):
                best, best_type = mountpoint, fields[fields.index("-") + 1]
    return best_type if best_type in MEMORY_FILE_SYSTEMS else None


def _mem_available(root: Path) -> int:
    try:
        with open(root / "proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


def _mountinfo(root: Path) -> list[list[str]]:
    """The fields of each line of mountinfo, mount root and mount point unescaped ("\\040" for a space)."""
    try:
        text = (root / "proc/self/mountinfo").read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return []
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        fields[3] = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[3])
        fields[4] = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4])
        mounts.append(fields)
    return mounts


def _own_cgroup(root: Path) -> tuple[int, str] | None:
    """(version, path) of this process's memory cgroup: the v1 hierarchy with the memory controller if there is
    one, else the v2 hierarchy (line `0::`; a cgroup there without the memory controller has no memory.max)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return 1, path
        if number == "0" and controllers == "":
            unified = path
    return None if unified is None else (2, unified)


def _cgroup_directory(root: Path, version: int, path: str) -> tuple[Path, Path] | None:
    """Where the cgroup `path` is mounted: (its directory, the directory of the mount's root), or None."""
    for fields in _mountinfo(root):
        fs_type, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if (version == 1 and fs_type == "cgroup" and "memory" in options) or (version == 2 and fs_type == "cgroup2"):
            mount_root, mountpoint = fields[3], root / fields[4].lstrip("/")
            inside = os.path.relpath(path, mount_root)
            if inside == ".":
                return mountpoint, mountpoint
            if not inside.startswith(".."):
                return mountpoint / inside, mountpoint
    return None


def _cgroup_limit(root: Path) -> CgroupLimit | None:
    """The cgroup, among this process's and those above it up to the mount's root, that leaves the least room."""
    own = _own_cgroup(root)
    if own is None:
        return None
    version, path = own
    found = _cgroup_directory(root, version, path)
    if found is None:
        return None
    directory, top = found
    tightest = None
    while True:
        level = _read_level(directory, version, path)
        if level is not None and (tightest is None or level.left < tightest.left):
            tightest = level
        if directory == top or path in ("", "/"):
            return tightest
        if version == 1 and _read_text(directory.parent / "memory.use_hierarchy") == "0":
            return tightest  # v1 without hierarchy: the parent's limit does not count what is below it
        directory, path = directory.parent, os.path.dirname(path.rstrip("/")) or "/"


def _read_level(directory: Path, version: int, path: str) -> CgroupLimit | None:
    """One cgroup's limit and use, or None where it sets no limit or its files cannot be read."""
    limit_file, usage_file = ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else \
        ("memory.max", "memory.current")
    limit_text = _read_text(directory / limit_file)
    if limit_text is None or limit_text == "max":
        return None
    try:
        limit, used = int(limit_text), int(_read_text(directory / usage_file) or "")
    except ValueError:
        return None
    if limit >= NO_LIMIT:
        return None
    # Page cache not recently used is dropped before the OOM killer runs, so it is room, not use (as the kubelet
    # counts a container's working set). A tmpfs's pages are not in it: without swap they stay until removed.
    stat = _memory_stat(directory / "memory.stat")
    droppable = stat.get("total_inactive_file", stat.get("inactive_file", 0)) if version == 1 else \
        stat.get("inactive_file", 0)
    return CgroupLimit(path, version, limit, max(0, used - droppable))


def _memory_stat(path: Path) -> dict[str, int]:
    values = {}
    for line in (_read_text(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[name] = int(value)
    return values


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
