"""Walk SRC once, in sorted order, into the list of what will be packed and the list of what cannot be.

A problem with one path (a fifo, a name that is not UTF-8, a symlink that leaves SRC, a directory that cannot be
listed) skips that path with a reason; only a missing or unusable SRC stops the walk.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError, quoted, shown_path
from ..core.index_check import link_target_problem
from .entry_columns import EntryColumns, EntryColumnsBuilder, SourceEntry, sorted_by_path

__all__ = ["Problem", "SourceEntry", "SourceTree", "walk_source"]


@dataclass(frozen=True, slots=True)
class Problem:
    """A path that is skipped, and why, in words a person can act on."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{shown_path(self.path)}: {self.reason}"


@dataclass(slots=True)
class SourceTree:
    """What a pack reads: a directory's walk, or the listing of SRC archives (walk_archive.py). For archives,
    `archives` holds each one's path and format (a member's `ino` is its key: archive number and place in the
    stream, see archive_source.py) and `identity` says who each archive file was, so a resume reads the same."""

    root: Path
    entries: EntryColumns = field(default_factory=lambda: EntryColumns.of(()))  # sorted by path
    problems: list[Problem] = field(default_factory=list)
    archives: tuple[tuple[Path, str], ...] = ()
    identity: tuple[str, ...] = ()
    linked: dict[int, int] = field(default_factory=dict)  # archives: a key hard links share -> files that read it

    @property
    def files(self) -> EntryColumns:
        return self.entries.take(np.flatnonzero(self.entries.is_file()))

    def file_numbers_in_read_order(self) -> np.ndarray:
        """The files' entry numbers in the order SRC gives them best: by path for a directory; for archives, in
        stream order, which cannot seek (so an archive whose members come in path order packs as its extracted
        directory)."""
        numbers = np.flatnonzero(self.entries.is_file())
        if self.archives:
            numbers = numbers[np.argsort(self.entries.ino[numbers], kind="stable")]
        return numbers

    def files_in_read_order(self) -> EntryColumns:
        return self.entries.take(self.file_numbers_in_read_order())


_SPECIAL_KINDS = {
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


# With an executor, the walk lists directories level by level itself until this many wait, then hands their
# subtrees to the executor in this many tasks.
_PARALLEL_FRONTIER = 64
_PARALLEL_TASKS = 16


def walk_source(src: str | os.PathLike[str], executor: Executor | None = None) -> SourceTree:
    """Everything under SRC that can be packed, sorted by path, and everything that cannot, with reasons.

    With an `executor` (worker processes), subtrees are walked in parallel: a walk is one stat per entry, which
    on a parallel file system is a metadata round trip, and on any file system one core's worth of system calls.
    """
    root = Path(src)
    try:
        root_stat = root.stat()
    except FileNotFoundError:
        raise UsageError(f"SRC {quoted(src)} does not exist") from None
    except OSError as exc:
        raise UsageError(f"SRC {quoted(src)} cannot be read: {exc.strerror}") from None
    if not stat.S_ISDIR(root_stat.st_mode):
        raise UsageError(f"SRC {quoted(src)} is not a directory")
    real_root = os.path.realpath(root)
    tree = SourceTree(root=root)
    entries = EntryColumnsBuilder()
    entries.add(SourceEntry("", stat.S_IMODE(root_stat.st_mode) | stat.S_IFDIR, 0, root_stat.st_mtime_ns))
    if executor is None:
        _walk_subtrees(os.fspath(root), real_root, [""], entries, tree.problems)
    else:
        _walk_in_parallel(os.fspath(root), real_root, executor, entries, tree.problems)
    tree.entries = sorted_by_path(entries.build())
    tree.problems.sort(key=lambda p: p.path)
    return tree


def _walk_in_parallel(root: str, real_root: str, executor: Executor, entries: EntryColumnsBuilder,
                      problems: list[Problem]) -> None:
    """List the top levels here until enough directories wait, then share their subtrees with the workers."""
    frontier = [""]
    while frontier and len(frontier) < _PARALLEL_FRONTIER:
        frontier = [sub for rel_dir in frontier for sub in _list_dir(root, real_root, rel_dir, entries, problems)]
    shares = [frontier[i::_PARALLEL_TASKS] for i in range(min(len(frontier), _PARALLEL_TASKS))]
    walks = [executor.submit(_walk_subtrees_apart, root, real_root, share) for share in shares]
    # This process walks shares from the back while the workers take them from the front (and while they are
    # still starting up): a share it can still cancel is one no worker has begun.
    for share, walk in zip(reversed(shares), reversed(walks)):
        if walk.cancel():
            _walk_subtrees(root, real_root, share, entries, problems)
    for walk in walks:
        if not walk.cancelled():
            columns, share_problems = walk.result()
            entries.extend(EntryColumns.from_columns(columns))
            problems.extend(share_problems)


def _walk_subtrees(root: str, real_root: str, rel_dirs: list[str], entries: EntryColumnsBuilder,
                   problems: list[Problem]) -> None:
    """Every entry below the directories `rel_dirs` (not themselves), depth first."""
    pending = list(reversed(rel_dirs))
    while pending:
        pending.extend(reversed(_list_dir(root, real_root, pending.pop(), entries, problems)))


def _walk_subtrees_apart(root: str, real_root: str, rel_dirs: list[str]) -> tuple[Any, list[Problem]]:
    """_walk_subtrees in a worker process. Entries go back as columns (a blob of paths, an array a field), which
    pickle and unpickle several times faster than one object per entry."""
    entries = EntryColumnsBuilder()
    problems: list[Problem] = []
    _walk_subtrees(root, real_root, rel_dirs, entries, problems)
    return entries.build().to_columns(), problems


def _list_dir(root: str, real_root: str, rel_dir: str, entries: EntryColumnsBuilder, problems: list[Problem]
              ) -> list[str]:
    """Add the entries of one directory (or what is wrong with them); returns its subdirectories."""
    abs_dir = os.path.join(root, rel_dir) if rel_dir else root
    try:
        with os.scandir(abs_dir) as listing:
            dir_entries = sorted(listing, key=_name_of)
    except OSError as exc:
        problems.append(Problem(rel_dir, f"cannot list directory: {exc.strerror}"))
        return []
    subdirs = []
    for dir_entry in dir_entries:
        name = dir_entry.name
        rel = f"{rel_dir}/{name}" if rel_dir else name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
            problems.append(Problem(shown, "name is not valid UTF-8; rename it to pack it"))
            continue
        entry = _entry_for(dir_entry, rel, real_root, problems)
        if entry is None:
            continue
        entries.add(entry)
        if stat.S_ISDIR(entry.mode):
            subdirs.append(rel)
    return subdirs


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
    if kind == stat.S_IFREG:
        if st.st_size == 0 and _reads_past_empty(abs_path, st.st_ino):
            problems.append(Problem(rel, "reads past the 0 bytes its size says (a /proc or /sys file?); copy it to "
                                         "a regular file to pack it"))
            return None
        return SourceEntry(rel, st.st_mode, st.st_size, st.st_mtime_ns, "", st.st_ino, st.st_ctime_ns)
    if kind == stat.S_IFDIR:
        return SourceEntry(rel, st.st_mode, 0, st.st_mtime_ns)
    if kind == stat.S_IFLNK:
        target = _inside_target(abs_path, rel, real_root)
        if target is None:
            problems.append(Problem(rel, f"symlink to {quoted(os.readlink(abs_path))} leaves SRC; skipped"))
            return None
        return SourceEntry(rel, st.st_mode, len(target.encode("utf-8")), st.st_mtime_ns, target)
    problems.append(Problem(rel, f"is {_SPECIAL_KINDS.get(kind, 'a special file')}; only files, directories "
                                 "and symlinks are packed"))
    return None


def _reads_past_empty(path: str, ino: int) -> bool:
    """Whether a file that says it is empty gives bytes (a /proc file does): packed as its size says, it would
    lose them without a word. A file that cannot be opened here is taken at its word, as it was before."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        # Still the empty file the walk saw (one written since is packed as the walk saw it, as before).
        return stat.S_ISREG(info.st_mode) and info.st_ino == ino and info.st_size == 0 and bool(os.pread(fd, 1, 0))
    except OSError:
        return False
    finally:
        os.close(fd)


def _inside_target(link_path: str, rel: str, real_root: str) -> str | None:
    """The link's target in a form that cannot leave the dataset (index_check.link_target_problem's), or None
    when it points outside SRC or is not UTF-8.

    A target already in that form is kept as written. Any other that resolves inside SRC (absolute, or leaving
    SRC and coming back in, or with an inner '..') is rewritten relative to where it resolves: from the link's
    directory up to a common ancestor, then down through real directories only.
    """
    target = os.readlink(link_path)
    try:
        encoded = target.encode("utf-8")
    except UnicodeEncodeError:
        return None
    link_dir = os.path.realpath(os.path.dirname(link_path))
    resolved = os.path.realpath(os.path.join(link_dir, target))
    if resolved != real_root and not resolved.startswith(real_root + os.sep):
        return None
    if link_target_problem(encoded, rel.count("/")) is None:
        return target
    return os.path.relpath(resolved, link_dir)
