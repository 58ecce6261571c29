"""List SRC archives into the tree a pack reads, with the rules a directory walk applies to what is packed.

Members become entries of the same paths as an extraction would give, with nothing extracted: names are made
relative and normalised ('./a//b' is 'a/b'); a name that could leave the dataset ('../x', '/etc/x') is refused with
a warning, as are devices, fifos and symlinks that leave the dataset. A tar's hard link is a file of its own path
with its target's bytes, as extraction gives it (its key and size are the target's: the data is read again). A
path given twice takes the later member, as extraction does; a directory that only members imply is made, as
extraction makes it.
Directories no member states get the newest member's mtime: the same archive always gives the same dataset.

Memory: the members in columns (entry_columns.py): a member's path bytes and 44 B, whatever the archives hold.
"""

from __future__ import annotations

import bisect
import glob
import os
import posixpath
import stat
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from .archive_source import ARCHIVE_KEY_SHIFT, FORMATS, Damage, Member, archive_format, archive_identity, open_stream
from ..errors import UsageError, quoted
from ..core.format import MAX_NAME_BYTES, MAX_PATH_BYTES
from ..core.index_check import link_target_problem
from .entry_columns import SLICE, EntryColumns, EntryColumnsBuilder, in_path_order, sorted_by_path
from .walk import _SPECIAL_KINDS, Problem, SourceEntry, SourceTree, walk_source

_DIR_MODE = stat.S_IFDIR | 0o755
_KEY_MASK = (1 << ARCHIVE_KEY_SHIFT) - 1


def walk_archives(archives: Sequence[str | os.PathLike[str]], executor: Executor | None = None) -> SourceTree:
    """Every member of the archives that can be packed, sorted by path, and every one that cannot, with reasons.
    A damaged archive gives its members before the damage and one problem naming the archive and the offset.
    With an `executor` (worker processes), several archives (shards) are listed in parallel: listing a compressed
    tar is decompressing all of it."""
    paths = [Path(archive) for archive in archives]
    formats = [_format_of(path) for path in paths]
    seen: dict[str, Path] = {}
    for path in paths:
        first = seen.setdefault(os.path.realpath(path), path)
        if first is not path:
            also = "" if str(first) == str(path) else f" (as {quoted(first)} too)"
            raise UsageError(f"SRC: the archive {quoted(path)} is given twice{also}")
    if len(paths) > 1 << (63 - ARCHIVE_KEY_SHIFT):
        raise UsageError(f"SRC: at most {1 << (63 - ARCHIVE_KEY_SHIFT)} archives in one pack")
    listed = list(zip(range(len(paths)), paths, formats))
    if executor is not None and len(paths) > 1:
        listings = [_Listing(EntryColumns.from_columns(columns), *rest)
                    for columns, *rest in executor.map(_list_archive_apart, *zip(*listed))]
    else:
        listings = [_list_archive(number, path, fmt) for number, path, fmt in listed]
    linked = {key: reads for listing in listings for key, reads in listing.linked.items()}
    newest = max((listing.newest for listing in listings), default=0)
    root = next((listing.root for listing in reversed(listings) if listing.root is not None), None)
    problems = [problem for listing in listings for problem in listing.problems]
    members = listings[0].entries
    if len(listings) > 1:
        both = EntryColumnsBuilder()
        while listings:  # each listing let go of once copied: the members are held at most twice
            both.extend(listings.pop(0).entries)
        members = both.build()
    del listings
    root = root or SourceEntry("", _DIR_MODE, 0, newest)
    entries, parent_problems = _with_parents(_last_of_each_path(members), root, newest)
    problems += parent_problems
    problems.sort(key=lambda p: p.path)
    identity = tuple(f"{path}\0{archive_identity(path)}" for path in paths)
    return SourceTree(root=paths[0], entries=entries, problems=problems, archives=tuple(zip(paths, formats)),
                      identity=identity, linked=linked)


class _Listing(NamedTuple):
    """One archive's members as entries (keys carrying its number), what was refused, its newest mtime and the
    root entry a './' member gives."""

    entries: EntryColumns
    problems: list[Problem]
    newest: int
    root: SourceEntry | None
    linked: dict[int, int]  # key -> how many files read it, for a member that hard links share


def _list_archive(number: int, path: Path, fmt: str) -> _Listing:
    entries = EntryColumnsBuilder()
    problems: list[Problem] = []
    root: SourceEntry | None = None
    newest = 0
    hard_links: list[tuple[str, int, Member]] = []  # few, as a rule: resolved once every member is listed
    with open_stream(path, fmt) as stream:
        for member in stream:
            newest = max(newest, member.mtime_ns)
            key = number << ARCHIVE_KEY_SHIFT | member.key
            rel, refusal = dataset_path(member.name)
            if refusal:
                problems.append(Problem(_shown(member.name), f"{refusal} (in {path.name}); skipped"))
                continue
            if rel == "" and not stat.S_ISDIR(member.mode):  # the root ('.', './', ''): a directory, whatever it says
                problems.append(Problem(".", f"is {_kind_name(member)} in {path.name}, where the dataset's root, a "
                                             "directory, lies; skipped"))
                continue
            if member.hard_link:
                hard_links.append((rel, key, member))
                continue
            entry, reason = _entry_for(rel, key, member.mode, member.size, member.mtime_ns, member.link_target,
                                       member.refusal)
            if entry is None:  # worded as the directory walk words it: a pack of the extraction says the same
                problems.append(Problem(rel or ".", reason))
            elif rel == "":
                root = entry
            else:
                entries.add(entry)
        listed = entries.build()
        if stream.damage is not None:
            if fmt != "zip":  # a zip's members are listed whole or not at all
                listed = _whole_before(listed, stream.damage)
            problems.append(_damage_problem(stream.damage, fmt))
    linked: dict[int, int] = {}
    if hard_links:
        listed, linked = _with_hard_links(listed, hard_links, number, problems)
    return _Listing(listed, problems, newest, root, linked)


def _with_hard_links(listed: EntryColumns, hard_links: list[tuple[str, int, Member]], number: int,
                     problems: list[Problem]) -> tuple[EntryColumns, dict[int, int]]:
    """The listing with each hard link added as a file: its own path, mode and mtime, its target's key and size.
    The target is the last member of the linked name before the link (extraction links to what is there then),
    and must be a file packed from this archive; another link resolved before it counts. Returns the listing and,
    for each shared key, how many files read it."""
    names = {dataset_path(member.link_target)[0] for _, _, member in hard_links} - {""}
    # name -> (place in the archive, key of its data, size) of each file member of that name
    found: dict[str, list[tuple[int, int, int]]] = {}
    is_file = ((listed.mode & 0o170000) == stat.S_IFREG).tolist()
    for start in range(0, len(listed), SLICE):
        for at, path in enumerate(listed.paths.encoded_slice(start, min(start + SLICE, len(listed))), start):
            name = path.decode("utf-8")
            if name in names and is_file[at]:
                key = int(listed.ino[at])
                found.setdefault(name, []).append((key, key, int(listed.size[at])))
    added = EntryColumnsBuilder()
    added.extend(listed)
    linked: dict[int, int] = {}
    for rel, key, member in hard_links:
        target, _ = dataset_path(member.link_target)
        before = [candidate for candidate in found.get(target, []) if candidate[0] < key]
        if not before:
            problems.append(Problem(rel, f"is a hard link to {quoted(member.link_target)}, which is not a file "
                                         "packed before it in the archive; skipped"))
            continue
        _, target_key, size = max(before)
        added.add(SourceEntry(rel, stat.S_IFREG | (member.mode & 0o7777), size, member.mtime_ns, "", target_key))
        found.setdefault(rel, []).append((key, target_key, size))  # a later link may name this one
        linked[target_key] = linked.get(target_key, 1) + 1
    return added.build(), linked


def _list_archive_apart(number: int, path: Path, fmt: str
                        ) -> tuple[Any, list[Problem], int, SourceEntry | None, dict[int, int]]:
    """_list_archive in a worker process; entries go back as columns, which pickle several times faster."""
    listing = _list_archive(number, path, fmt)
    return listing.entries.to_columns(), listing.problems, listing.newest, listing.root, listing.linked


def source_paths(src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """SRC as paths, in the order packed: each as given, but a pattern (with * ? or [, naming no existing file)
    expanded into the files it matches, sorted (WebDataset shards: 'shards/train-*.tar'). Several SRC must be
    archives (walk_archives checks them)."""
    given = [src] if isinstance(src, (str, os.PathLike)) else list(src)
    if not given:
        raise UsageError("SRC: give a directory, or one or more archives")
    paths: list[Path] = []
    for item in given:
        text = os.fspath(item)
        if not text:  # Path('') is the current directory: the system calls take '' for no file
            raise UsageError("SRC: an empty path (an unset variable?)")
        if not os.path.lexists(text) and any(char in text for char in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise UsageError(f"SRC {quoted(text)}: no file matches this pattern")
            paths += map(Path, matches)
        else:
            paths.append(Path(text))
    for path in paths:
        check_lookup(path, "SRC")
    return paths


def check_lookup(path: Path, name: str) -> None:
    """UsageError naming `name` (SRC, DEST) where `path` cannot even be looked up, for a reason other than its
    absence or a file on the way, which the checks after it say: a name past the file system's limit, a directory on
    the way this user may not search, an I/O error. pathlib's is_dir and exists raise those, a traceback."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise UsageError(f"{name} {quoted(str(path))}: {exc.strerror}") from None


def walk_sources(sources: list[Path], executor: Executor | None = None) -> SourceTree:
    """The tree SRC gives: a directory's walk, or the listing of archives (walk_archive.source_paths's list)."""
    if len(sources) == 1 and sources[0].is_dir():
        return walk_source(sources[0], executor)
    return walk_archives(sources, executor)


def dataset_path(name: str) -> tuple[str, str]:
    """A member name as a dataset path ("" for the archive's root), or "" and why it is refused."""
    if name.startswith("/"):
        return "", "is an absolute path, which would leave the dataset"
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        return "", "has a '..' component, which could leave the dataset"
    path = "/".join(parts)
    if "\0" in path:
        return "", "contains a NUL byte"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "", "name is not valid UTF-8; rename it to pack it"
    # An archive's names are not bounded by a file system's, but a dataset's are (the index check refuses more).
    if len(encoded) > MAX_PATH_BYTES:
        return "", f"is {len(encoded):,} bytes long: a path holds at most {MAX_PATH_BYTES:,} (PATH_MAX)"
    longest = max(len(part.encode("utf-8")) for part in parts) if parts else 0
    if longest > MAX_NAME_BYTES:
        return "", f"has a name of {longest} bytes: a name holds at most {MAX_NAME_BYTES} (NAME_MAX)"
    return path, ""


def _format_of(path: Path) -> str:
    if not path.exists():
        raise UsageError(f"SRC {quoted(path)} does not exist")
    if path.is_dir():
        raise UsageError(f"SRC {quoted(path)} is a directory: several SRC must all be archives")
    if not path.is_file():  # a fifo would block the open until a writer came
        kind = _SPECIAL_KINDS.get(stat.S_IFMT(path.stat().st_mode), "not a regular file")
        raise UsageError(f"SRC {quoted(path)} is {kind}: SRC is a directory, or archive files")
    fmt = archive_format(path)
    if fmt is None:
        raise UsageError(f"SRC {quoted(path)} is not a directory, nor an archive fanstore reads "
                         f"({', '.join(FORMATS)})")
    return fmt


def _kind_name(member: Member) -> str:
    """What a member is, in a problem's words."""
    if member.hard_link:
        return "a hard link"
    kind = stat.S_IFMT(member.mode)
    return {stat.S_IFREG: "a file", stat.S_IFLNK: "a symlink"}.get(kind) or _SPECIAL_KINDS.get(kind, "a special file")


def _entry_for(rel: str, key: int, mode: int, size: int, mtime_ns: int, link_target: str, refusal: str
               ) -> tuple[SourceEntry | None, str]:
    kind = stat.S_IFMT(mode)
    if refusal:
        return None, refusal
    if kind == stat.S_IFREG:
        return SourceEntry(rel, mode, size, mtime_ns, "", key), ""
    if kind == stat.S_IFDIR:
        return SourceEntry(rel, mode, 0, mtime_ns, "", key), ""
    if kind == stat.S_IFLNK:
        target = _inside_target(link_target, rel)
        if target is None:
            return None, f"symlink to {quoted(link_target)} leaves SRC; skipped"
        return SourceEntry(rel, mode, len(target.encode("utf-8")), mtime_ns, target, key), ""
    what = _SPECIAL_KINDS.get(kind, "a special file")
    return None, f"is {what}; only files, directories and symlinks are packed"


def _inside_target(target: str, rel: str) -> str | None:
    """The link's target in the form the index keeps (see walk._inside_target), or None when it leaves the
    dataset. Resolved by name: an archive has no real directories to resolve through."""
    try:
        encoded = target.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if not target or target.startswith("/") or "\0" in target:
        return None
    link_dir = posixpath.dirname(rel)
    resolved = posixpath.normpath(posixpath.join(link_dir, target))
    if resolved == ".." or resolved.startswith("../"):
        return None
    if link_target_problem(encoded, rel.count("/")) is None:
        return target
    return posixpath.relpath(resolved, link_dir or ".")


def _whole_before(entries: EntryColumns, damage: Damage) -> EntryColumns:
    """The members of a damaged archive whose data ends before the damage."""
    ends = (entries.ino & np.uint64(_KEY_MASK)).astype(np.int64) + entries.size
    return entries.take(np.flatnonzero(ends <= damage.offset))


def _damage_problem(damage: Damage, fmt: str) -> Problem:
    """One line for a damaged archive, named by its file name: the index records skipped paths, and no path of
    the packing machine."""
    stream = "" if fmt in ("tar", "zip") else " of its decompressed tar stream"
    return Problem(damage.archive.name, f"damaged at byte {damage.offset:,}{stream} ({damage.reason}); the members "
                                        "before it are packed, none after")


def _last_of_each_path(entries: EntryColumns) -> EntryColumns:
    """Sorted by path, a path given more than once keeping its last member (as extraction leaves it). Members come
    in key order (archive, then place in it), so a stable sort by path puts a path's last member last."""
    if in_path_order(entries.paths, strictly=True):
        return entries
    entries = sorted_by_path(entries)
    paths, kept = entries.paths, []
    for start in range(0, len(paths), SLICE):
        encoded = paths.encoded_slice(start, min(start + SLICE + 1, len(paths)))
        kept += [start + n for n in range(min(SLICE, len(paths) - start))
                 if n + 1 == len(encoded) or encoded[n] != encoded[n + 1]]
    return entries if len(kept) == len(entries) else entries.take(np.array(kept, dtype=np.int64))


def _with_parents(entries: EntryColumns, root: SourceEntry, mtime_ns: int) -> tuple[EntryColumns, list[Problem]]:
    """The entries with the root and the directories their paths imply made; one whose parent is not a directory
    (a file, a symlink or something skipped) is refused, as extraction would fail on it."""
    directories = {b""}
    made: list[SourceEntry] = []
    refused: list[int] = []
    problems: list[Problem] = []
    is_dir = ((entries.mode & 0o170000) == stat.S_IFDIR).tolist()
    for start in range(0, len(entries), SLICE):
        for number, path in enumerate(entries.paths.encoded_slice(start, min(start + SLICE, len(entries))), start):
            parent = path.rpartition(b"/")[0]
            if parent in directories:
                if is_dir[number]:
                    directories.add(path)
                continue
            missing = []
            while parent not in directories:
                missing.append(parent)
                parent = parent.rpartition(b"/")[0]
            blocked = next((path for path in missing if _present(entries, path)), None)
            if blocked is not None:
                refused.append(number)
                problems.append(Problem(path.decode("utf-8"), f"its directory {quoted(blocked.decode('utf-8'))} is not "
                                                              "a directory in the archive (or was skipped); skipped"))
                continue
            directories.update(missing)
            made += [SourceEntry(made_path.decode("utf-8"), _DIR_MODE, 0, mtime_ns) for made_path in missing]
            if is_dir[number]:
                directories.add(path)
    if refused:
        entries = entries.take(np.setdiff1d(np.arange(len(entries)), refused))
    return _merged(entries, [root] + made), problems


def _merged(entries: EntryColumns, more: list[SourceEntry]) -> EntryColumns:
    """`entries` (in path order) and `more` (none of their paths), all in path order."""
    more.sort(key=lambda e: e.path.encode("utf-8"))
    both, copied = EntryColumnsBuilder(), 0
    for entry in more:
        at = bisect.bisect_left(entries.paths.as_bytes, entry.path.encode("utf-8"))
        both.extend(entries, copied, at)
        both.add(entry)
        copied = at
    both.extend(entries, copied)
    return both.build()


def _present(entries: EntryColumns, path: bytes) -> bool:
    at = bisect.bisect_left(entries.paths.as_bytes, path)
    return at < len(entries) and entries.paths.encoded(at) == path


def _shown(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
