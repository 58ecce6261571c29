"""Walk SRC once, in sorted order, into the list of what will be packed and the list of what cannot be.

A problem with one path (a fifo, a name that is not UTF-8, a symlink that leaves SRC, a directory that cannot be
listed) skips that path with a reason; only a missing or unusable SRC stops the walk.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .errors import UsageError


class SourceEntry(NamedTuple):
    """A directory, regular file or symlink of SRC, with the metadata the index keeps (a named tuple: a walk
    makes one per file, and a tuple is made several times faster than a frozen dataclass)."""

    path: str  # relative to SRC, '/'-separated; "" is SRC itself
    mode: int
    size: int
    mtime_ns: int
    link_target: str = ""

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)


@dataclass(frozen=True, slots=True)
class Problem:
    """A path that is skipped, and why, in words a person can act on."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(slots=True)
class SourceTree:
    root: Path
    entries: list[SourceEntry] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def files(self) -> list[SourceEntry]:
        return [e for e in self.entries if e.is_file]


_SPECIAL_KINDS = {
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def walk_source(src: str | os.PathLike[str]) -> SourceTree:
    """Everything under SRC that can be packed, sorted by path, and everything that cannot, with reasons."""
    root = Path(src)
    try:
        root_stat = root.stat()
    except FileNotFoundError:
        raise UsageError(f"SRC {str(src)!r} does not exist") from None
    except OSError as exc:
        raise UsageError(f"SRC {str(src)!r} cannot be read: {exc.strerror}") from None
    if not stat.S_ISDIR(root_stat.st_mode):
        raise UsageError(f"SRC {str(src)!r} is not a directory")
    real_root = os.path.realpath(root)
    tree = SourceTree(root=root)
    tree.entries.append(SourceEntry("", stat.S_IMODE(root_stat.st_mode) | stat.S_IFDIR, 0, root_stat.st_mtime_ns))
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else os.fspath(root)
        try:
            with os.scandir(abs_dir) as listing:
                dir_entries = sorted(listing, key=_name_of)
        except OSError as exc:
            tree.problems.append(Problem(rel_dir, f"cannot list directory: {exc.strerror}"))
            continue
        subdirs = []
        for dir_entry in dir_entries:
            name = dir_entry.name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
                tree.problems.append(Problem(shown, "name is not valid UTF-8; rename it to pack it"))
                continue
            entry = _entry_for(dir_entry, rel, real_root, tree.problems)
            if entry is None:
                continue
            tree.entries.append(entry)
            if stat.S_ISDIR(entry.mode):
                subdirs.append(rel)
        pending.extend(reversed(subdirs))
    tree.entries.sort(key=lambda e: e.path.encode("utf-8"))
    tree.problems.sort(key=lambda p: p.path)
    return tree


def _name_of(dir_entry: os.DirEntry[str]) -> str:
    return dir_entry.name


def _entry_for(dir_entry: os.DirEntry[str], rel: str, real_root: str, problems: list[Problem]) -> SourceEntry | None:
    abs_path = dir_entry.path
    try:
        st = dir_entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        problems.append(Problem(rel, "vanished during the walk"))
        return None
    except OSError as exc:
        problems.append(Problem(rel, f"cannot stat: {exc.strerror}"))
        return None
    kind = stat.S_IFMT(st.st_mode)
    if kind in (stat.S_IFREG, stat.S_IFDIR):
        size = st.st_size if kind == stat.S_IFREG else 0
        return SourceEntry(rel, st.st_mode, size, st.st_mtime_ns)
    if kind == stat.S_IFLNK:
        target = _inside_target(abs_path, real_root)
        if target is None:
            problems.append(Problem(rel, f"symlink to {os.readlink(abs_path)!r} leaves SRC; skipped"))
            return None
        return SourceEntry(rel, st.st_mode, len(target.encode("utf-8")), st.st_mtime_ns, target)
    problems.append(Problem(rel, f"is {_SPECIAL_KINDS.get(kind, 'a special file')}; only files, directories "
                                 "and symlinks are packed"))
    return None


def _inside_target(link_path: str, real_root: str) -> str | None:
    """The link's target as a relative path when it stays inside SRC, else None (absolute ones are rewritten)."""
    target = os.readlink(link_path)
    link_dir = os.path.realpath(os.path.dirname(link_path))
    resolved = os.path.realpath(os.path.join(link_dir, target))
    if resolved != real_root and not resolved.startswith(real_root + os.sep):
        return None
    try:
        target.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if os.path.isabs(target):
        return os.path.relpath(resolved, link_dir)
    return target
