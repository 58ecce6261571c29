"""Decode ahead of the reader: when a file is opened, the next files it will want are decoded into the cache by
background threads, so decoding overlaps the trainer's compute instead of sitting on its read path.

"Next" is the epoch order from a prefetch list (one path a line, as a training script's sampler writes it)
when the file is in it, else the following files of the same directory, in listing order.

A reader may not follow that order (a shuffled sampler with no list, a stale list). A file decoded ahead waits in
the cache, which is large, and is likely still there when its read comes, however late; but a file fetched ahead
from another node under serve is held for a few dozen reads only, so fetching ahead for such a reader is wasted
work on both nodes. So the prefetcher checks each read against the order, and tells whoever fetches ahead whether
most reads land shortly after one of the last few (several DataLoader workers each read their own stretch of the
order at once), as the kernel's read-ahead does within one file.
"""

from __future__ import annotations

import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ..core.cache import DecodedCache
from ..core.chunk_source import ChunkSource, ReadDone
from ..errors import FanstoreError, PathNotFound, UsageError, quoted
from ..core.format import FLAG_BLOCKED, NO_CHUNK
from ..core.index import Index
from ..core.path_walk import PathWalk
from ..core.thread_names import name_os_thread


# What the decoded cache holds: a file stored whole by its entry number, one block of a file stored in blocks by
# (entry, block).
CacheKey = int | tuple[int, int]


def may_block_flags(index: Index, source: ChunkSource | None) -> np.ndarray:
    """One flag per entry: its blob is one the source says may be slow to come (see ChunkSource.may_block)."""
    flags = np.zeros(len(index.entries), dtype=bool)
    if source is None:
        return flags
    entries = index.entries
    whole = (entries["chunk"] != NO_CHUNK) & ((entries["flags"] & FLAG_BLOCKED) == 0)
    flags[whole] = source.may_block(entries["chunk"][whole], entries["offset"][whole])
    return flags


class FetchedAhead(Protocol):
    """Files from other nodes fetched ahead of their reads by someone other than the mount (under serve, the
    node's one holder, serve/blobs_ahead.py), so that the mount's event loop does no work for them until their
    read. The mount tells it the order it expects (`follow`), and each read takes its file's blob (`claim`)."""

    covers: np.ndarray  # per entry: a file it fetches when the order names it

    def follow(self, entries: np.ndarray, start_now: bool = False) -> None:
        """The files the mount expects next, in order (replacing the order told before; empty: none), fetched a
        window ahead of the reader: from its first read among them, or (`start_now`) at once."""

    def reached(self, entry: int) -> None:
        """The mount's reader began reading `entry`: the window moves on if it is in the order followed."""

    def claim(self, entry: int, deliver: ReadDone) -> bool:
        """A read of `entry`: True when its blob was fetched ahead or is on its way; `deliver` gets it then
        (at once, or from another thread). False when it was not started: the reader fetches it."""

    def stats(self) -> dict[str, object]:
        """The mount's plan's counters."""


class FileOrder:
    """For an entry, the next `count` entries after it (in the list, else in its directory), keeping the files
    worth decoding ahead, as cache keys: a file stored in blocks is decoded ahead by its first block only."""

    def __init__(self, index: Index, prefetch_list: list[int] | None = None, min_stored_bytes: int = 0,
                 slow: np.ndarray | None = None) -> None:
        self._index = index
        entries = index.entries
        # Worth decoding ahead: regular files whose blob is at least min_stored_bytes, or whose blob is slow to come
        # (`slow`: from another node). Smaller local ones decode on the reader's own request faster than a prefetch
        # thread can be handed them (see fuse_ops.INLINE_DECODE_BYTES); a remote one waits on the network.
        large_or_slow = entries["stored_len"] >= min_stored_bytes
        if slow is not None:
            large_or_slow = large_or_slow | slow
        self._worth_prefetching = (((entries["mode"] & 0o170000) == stat.S_IFREG) & (entries["size"] > 0)
                                   & large_or_slow)
        self._list = np.asarray(prefetch_list if prefetch_list is not None else [], dtype=np.int64)
        self._position = np.full(len(entries), -1, dtype=np.int64)
        # A path listed twice keeps its first position.
        self._position[self._list[::-1]] = np.arange(len(self._list))[::-1]
        self._blocked = (entries["flags"] & FLAG_BLOCKED) != 0
        self._any_blocked = bool(self._blocked.any())  # else every key is an entry number (no per-key test)
        self._parent = entries["parent"]

    @property
    def listed(self) -> bool:
        """Whether the order comes from a prefetch list (else from each directory's listing)."""
        return len(self._list) > 0

    def place(self, entry: int) -> tuple[int, int]:
        """Where `entry` stands in this order, as (sequence, position): (-1, its line in the list), or (its directory,
        its entry number) for a file the list does not name. Within one sequence, positions run in reading order."""
        position = int(self._position[entry])
        return (-1, position) if position >= 0 else (int(self._parent[entry]), entry)

    def after(self, entry: int, count: int) -> list[CacheKey]:
        position = int(self._position[entry])
        if position >= 0:
            following = self._list[position + 1 : position + 1 + count]
        else:
            siblings = self._index.children(int(self._index.entries["parent"][entry]))
            following = np.arange(entry + 1, min(siblings.stop, entry + 1 + count))
        chosen = following[self._worth_prefetching[following]]
        if not self._any_blocked:
            return chosen.tolist()
        return [(entry, 0) if blocked else entry
                for entry, blocked in zip(chosen.tolist(), self._blocked[chosen].tolist())]


def read_prefetch_list(index: Index, path: Path, mountpoint: Path | None = None) -> list[int]:
    """Entries of a prefetch list file: one file's path a line, relative to the dataset's root or, given
    `mountpoint`, through the mount (what a training script that reads the mount has at hand), each resolved as the
    API resolves a path (core/path_walk.py: '..', links followed as the kernel follows them). A line that is not
    UTF-8 text, names nothing in the dataset, a directory, or a file as a directory ('file/') is an error naming
    the file and line: the list names the files read, and a line that reads nothing is a list gone wrong. A list
    holding a NUL byte is read as NUL-separated paths (`find -print0`), the way to name a file whose name holds a
    newline."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--prefetch-list: cannot read {quoted(path)}: {exc.strerror}") from None
    through_mount = f"{mountpoint}/" if mountpoint is not None else None
    names: list[tuple[str, str]] = []  # (where in the list, the path as written)
    relatives: list[str] = []
    for where, line in _list_items(path, raw):
        try:
            name = line.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--prefetch-list: {where}: not UTF-8 text (one dataset path a line)") from None
        names.append((where, name))
        relatives.append(name[len(through_mount):] if through_mount and name.startswith(through_mount) else name)
    errors: dict[int, FanstoreError] = {}
    entries = PathWalk(index).resolve_many(relatives, errors)
    directories = np.flatnonzero((entries >= 0) & ((index.entries["mode"][entries] & 0o170000) == stat.S_IFDIR))
    unusable = sorted([*errors, *directories.tolist()])
    if unusable:
        first = unusable[0]
        where, name = names[first]
        error = errors.get(first)
        if error is None:
            problem = f"{quoted(name)} is a directory; the list names the files to read, in order"
        elif isinstance(error, PathNotFound):
            hint = ""
            if through_mount and name.startswith("/"):
                hint = f" (a path through the mount starts with {through_mount})"
            problem = f"{quoted(name)} is not in the dataset{hint}"
        else:
            problem = str(error)  # a file named as a directory ('file/'), a link loop
        more = len(unusable) - 1
        also = f" ({more:,} more line{'s' if more > 1 else ''} of it name{'' if more > 1 else 's'} no file either)" \
            if more else ""
        raise UsageError(f"--prefetch-list: {where}: {problem}{also}")
    return entries.tolist()


def _list_items(path: Path, raw: bytes) -> list[tuple[str, bytes]]:
    """The paths a prefetch list's bytes hold, each with where it stands (`FILE:LINE`, or `FILE: entry N`), empty
    ones left out. A line ends at '\n' (or '\r\n'), and nothing else is taken off it: a name may start or end with
    a space or a tab, and a stripped line named another file or none. A name that holds a newline or a lone '\r'
    cannot be a line: such a list is written NUL-separated, and then each entry is taken exactly."""
    if b"\0" in raw:
        return [(f"{path}: entry {number}", item) for number, item in enumerate(raw.split(b"\0"), start=1) if item]
    lines = raw.split(b"\n")
    return [(f"{path}:{number}", line.removesuffix(b"\r")) for number, line in enumerate(lines, start=1)
            if line.removesuffix(b"\r")]


# See Prefetcher.accessed: (entry, the files after it, this read followed a recent one, most reads do) -> the files
# left to decode here.
ElsewhereAhead = Callable[[int, list[CacheKey], bool, bool], list[CacheKey]]
# How many of the latest reads a read may follow to count as in order: several DataLoader workers each read their
# own stretch of the order at once.
RECENT_READS = 8
# Weight of one read in the share of reads that follow the order: about 11 reads out of order in a row, from all in
# order, tip it below one half, and as many in order tip it back.
_LEARN = 1 / 16


class Prefetcher:
    """A small thread pool that decodes the files after each opened one into the cache, each file once."""

    def __init__(self, cache: DecodedCache, order: FileOrder, depth: int, threads: int) -> None:
        self._cache = cache
        self._order = order
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fanstore-prefetch",
                                        initializer=name_os_thread)
        self._scheduled: set[CacheKey] = set()  # queued or decoding now
        self._waiting: set[CacheKey] = set()  # queued, not started: the reader may still take one over
        self._lock = threading.Lock()
        self._closed = False
        self._decoded = 0
        self._recent: list[tuple[int, int]] = []  # places of the latest reads, oldest first
        self._in_order = 1.0  # recent share of reads that came shortly after one of those

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def order(self) -> FileOrder:
        return self._order

    def accessed(self, entry: int, others_fetch: ElsewhereAhead | None = None) -> None:
        """The reader began reading `entry`: queue decoding of the next `depth` files not cached yet. `others_fetch`,
        given `entry`, those files, whether this read came shortly after a recent one and whether most do, returns
        the ones left to decode here (the others are fetched ahead elsewhere)."""
        if self._depth <= 0:
            return
        followed, in_order = self._follows_order(entry)
        following = self._order.after(entry, self._depth)
        if others_fetch is not None:
            following = others_fetch(entry, following, followed, in_order)
        for key in following:
            self.prefetch(key)

    def _follows_order(self, entry: int) -> tuple[bool, bool]:
        """Whether `entry` comes at most `depth` places after one of the latest reads, and whether most reads do."""
        group, position = self._order.place(entry)
        depth = self._depth
        followed = any(group == seen_group and 0 < position - seen <= depth for seen_group, seen in self._recent)
        self._in_order += ((1.0 if followed else 0.0) - self._in_order) * _LEARN
        recent = self._recent
        recent.append((group, position))
        if len(recent) > RECENT_READS:
            del recent[0]
        return followed, self._in_order >= 0.5

    def prefetch(self, key: CacheKey) -> None:
        """Queue decoding `key` into the cache, unless it is there or queued already."""
        with self._lock:
            if self._closed or key in self._scheduled or self._cache.contains(key):
                return
            self._scheduled.add(key)
            self._waiting.add(key)
        self._pool.submit(self._decode, key)

    def withdraw(self, key: CacheKey) -> bool:
        """The reader wants `key` now: a prefetch of it that has not started is dropped (the reader loads it
        itself rather than wait behind the queue, and it is not loaded twice). False if none was waiting."""
        with self._lock:
            if key not in self._waiting:
                return False
            self._waiting.discard(key)
            self._scheduled.discard(key)
            return True

    def _decode(self, key: CacheKey) -> None:
        with self._lock:
            if key not in self._waiting:  # withdrawn by the reader
                return
            self._waiting.discard(key)
        try:
            self._cache.get(key)
        except Exception:  # noqa: BLE001 - a damaged file is reported when the reader itself reads it
            pass
        finally:
            with self._lock:
                self._scheduled.discard(key)
                self._decoded += 1

    def stats(self) -> dict[str, int | float]:
        """Decodes queued or running now, done so far, and the recent share of reads that followed the order."""
        with self._lock:
            return {"pending": len(self._scheduled), "decoded": self._decoded, "in_order": round(self._in_order, 3)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
