"""A path to its entry, as the kernel looks a path up in the original directory: name by name, '..' from where a
link led, links followed within one budget of hops, a trailing '/' naming a directory. One implementation for every
path a person writes: the API's (Dataset.resolve) and a prefetch list's lines (mount/prefetch.py); the mount gets
the same from the kernel, which walks its names one lookup at a time.
"""

from __future__ import annotations

import os
import posixpath
import stat
from typing import Sequence

import numpy as np

from ..errors import FanstoreError, NotADirectory, PathNotFound, SymlinkLoop, quoted
from .index import Index, normalize_path

_MAX_SYMLINK_HOPS = 40  # the kernel's (MAXSYMLINKS)


class PathWalk:
    """Resolves paths in one index; made once per open dataset."""

    def __init__(self, index: Index) -> None:
        self.index = index
        # Entry 0, as the check at open holds every index to; not looked up by its hash, which a damaged hash table
        # misses (any path it misses is still listed and reached through the root; `fanstore verify` names it).
        self._root = 0

    def resolve(self, path: str | os.PathLike[str], follow_symlinks: bool = True) -> int:
        """Entry number of a path, following symlinks (they all stay inside the dataset); with `follow_symlinks`
        False, a link at the end is the entry (links on the way are followed, as lstat does)."""
        text = os.fsdecode(path)
        spelled = normalize_path(text)
        directory_wanted = _names_a_directory(text)  # a link there is followed
        follow = follow_symlinks or directory_wanted
        entry = None if "/../" in f"/{spelled}/" else self.index.lookup_key(spelled.encode("utf-8", "surrogateescape"))
        if entry is None or (follow and stat.S_ISLNK(int(self.index.entries[entry]["mode"]))):
            entry = self._walk(path, spelled, follow)  # a link or '..' on the way; or nothing there
        if directory_wanted and not stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
            raise NotADirectory(f"{quoted(path)}: {quoted(self.index.path_of(entry))} is not a directory")
        return entry

    def resolve_many(self, paths: Sequence[str], errors: dict[int, FanstoreError] | None = None) -> np.ndarray:
        """Entry numbers of many paths, as `resolve` gives them, in vectorized searches: paths spelled as the
        index spells them, or so once normalized, are found at once, the others ('..', a trailing '/', through a
        symlink) one by one. A path that does not resolve raises its error; given `errors`, its entry is -1
        instead and its error is kept there under its position (a list names how many lines it cannot use)."""
        entries = self.index.lookup_keys([path.encode("utf-8", "surrogateescape") for path in paths])
        missed = np.flatnonzero(entries < 0).tolist()
        if missed:  # spelled otherwise than the index ('./a', '/a', 'a//b'): most are found once normalized
            spelled = [normalize_path(paths[number]).encode("utf-8", "surrogateescape") for number in missed]
            for number, entry in zip(missed, self.index.lookup_keys(spelled).tolist()):
                if entry >= 0 and not _names_a_directory(paths[number]):  # else the walk says what it is
                    entries[number] = entry
        modes = self.index.entries["mode"][np.maximum(entries, 0)]
        for number in np.flatnonzero((entries < 0) | ((modes & 0o170000) == stat.S_IFLNK)).tolist():
            try:
                entries[number] = self.resolve(paths[number])
            except (PathNotFound, NotADirectory, SymlinkLoop) as exc:
                if errors is None:
                    raise
                entries[number] = -1
                errors[number] = exc
        return entries

    def _walk(self, path: str | os.PathLike[str], spelled: str, follow_last: bool) -> int:
        """`resolve` name by name, as the kernel looks a path up: one budget of _MAX_SYMLINK_HOPS links for the
        whole lookup, however links lead to links (each one's own budget let a loop through a directory link
        recurse without end), and a name that is not there ends it at once, however deep the path."""
        root = self._root
        pending = spelled.split("/")[::-1] if spelled else []  # a stack: the next name last
        here, entry, hops = "", root, 0
        while pending:
            if not stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
                raise NotADirectory(f"{quoted(path)}: {quoted(here)} is not a directory")
            name = pending.pop()
            if name == "..":  # `here` holds no link: its parent is where '..' leads (the root's is itself)
                here = posixpath.dirname(here)
                entry = self.index.lookup(here) if here else root
                continue
            candidate = f"{here}/{name}" if here else name
            found = self.index.lookup_key(candidate.encode("utf-8", "surrogateescape"))
            if found is None:
                raise PathNotFound(f"{quoted(path)}: no such file or directory in the dataset")
            if not stat.S_ISLNK(int(self.index.entries[found]["mode"])) or not (pending or follow_last):
                here, entry = candidate, found
                continue
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise SymlinkLoop(f"{quoted(path)}: too many levels of symbolic links")
            target = self._link_destination(found)  # from the root, normalized
            pending.extend(target.split("/")[::-1] if target else [])
            here, entry = "", root
        return entry

    def _link_destination(self, entry: int) -> str:
        """Where a link points, joined to the link's own path: every directory above an entry is a real one, so
        a '..' in the target climbs what the kernel would (not a symlinked directory the caller went through).
        The index check guarantees the result stays inside."""
        link_path = self.index.path_of(entry)
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), self.index.link_target(entry)))
        if joined.startswith("..") or joined.startswith("/"):
            raise PathNotFound(f"{quoted(link_path)}: symlink points outside the dataset")
        return "" if joined == "." else joined


def _names_a_directory(text: str) -> bool:
    """A trailing '/', '.' or '..' names a directory, as for the kernel."""
    return text.endswith("/") or text.rpartition("/")[2] in (".", "..")
