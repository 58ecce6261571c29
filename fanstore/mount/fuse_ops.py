"""The FUSE file system: a thin translation of kernel requests into the read path (index, cache, reader).

Inode n is index entry n-1 (the root, entry 0, is pyfuse3's ROOT_INODE 1), so no inode table is built. The
tree never changes while mounted, so entries and attributes are given long timeouts and files keep their page
cache across opens: the kernel answers repeat requests without asking this process. For the same reason a file
served whole leaves the decoded cache: the kernel's page cache holds it, and a second copy would only be memory.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import pyfuse3
import trio

from ..core.cache import DecodedCache
from ..core.chunk_source import ChunkSource
from ..errors import ChunkCorrupt, ChunkError, ChunkUnavailable, FanstoreError, fuse_errno_of, quoted
from ..core.format import FLAG_BLOCKED, INDEX_XATTR, MAX_NAME_BYTES, fields_view
from ..core.index import Index
from .kernel_holds import KernelHolds
from .options import INLINE_DECODE_BYTES
from .fuse_failures import HANDLE_FIRST, answers_every_failure
from .prefetch import CacheKey, FetchedAhead, Prefetcher, may_block_flags
from ..core.reader import Reader

log = logging.getLogger("fanstore.mount")

# The view is immutable: let the kernel keep names and attributes for a day.
KERNEL_CACHE_TIMEOUT = 24 * 3600.0
# Blocks decoded ahead of a reader going through a file stored in blocks: at 1 MiB a block, the kernel's 1 MiB
# read-ahead alone would start each decode only a block before the reader needs it.
BLOCKS_READ_AHEAD = 2
# Threads that wait for blobs from other nodes: mostly waiting, so more of them than cores, which keeps several
# requests in flight per peer.
FETCH_THREADS = 16
# Fetches begun at a file's open for the read that follows, at most: opens that never read leave no more behind.
FETCHES_HELD = 64
_DROPPED_MODE_BITS = stat.S_ISUID | stat.S_ISGID
# An open that would write. O_APPEND is not one: with O_RDONLY it only reads, as a read-only bind mount or
# squashfuse lets it.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
# The daemon's counters, read from the mount point's root (`getfattr -n user.fanstore.stats MP`): for operators,
# and for tests that must wait until prefetch has caught up. Not listed, as CephFS's virtual attributes are not,
# so tools that copy attributes do not copy it.
STATS_XATTR = b"user.fanstore.stats"
_INDEX_XATTR = INDEX_XATTR.encode()  # see core/format.py
# getfattr asks for an attribute's size, then for its value in a buffer of that size: a process asking again within
# this many seconds gets the reply it was sized by, else a counter that grew in between made it ERANGE.
STATS_REPLY_KEPT_S = 1.0


def _read_only() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class _Fetching:
    """A file's stored blob on its way from another node: fetched for its open or read (ChunkSource.start_read),
    or ahead of the reader by the node's holder (FetchedAhead.claim). The loop is woken when it arrives only if a
    read waits for it."""

    __slots__ = ("_token", "_loop_thread", "_done", "_waiter", "stored")

    def __init__(self, token: trio.lowlevel.TrioToken, loop_thread: int) -> None:
        self._token = token
        self._loop_thread = loop_thread  # made on the loop; a source may also answer there
        self._done = False
        self._waiter: trio.Event | None = None
        self.stored: bytes | memoryview | None = None  # None once arrived: the try failed

    def arrive(self, stored: bytes | memoryview | None, _error: ChunkError | None = None) -> None:
        """From the transport's thread, or from the loop itself (then with no hand-off through trio's queue). On
        an error the usual path reads the file again, and reports what it meets.

        No lock: `wait` sets its waiter before it looks at `_done`, and this sets `_done` before it looks at the
        waiter, so under the GIL at least one of them sees the other's write (both may: the waiter is then set
        once more, which is harmless)."""
        self.stored = stored
        self._done = True
        waiter = self._waiter
        if waiter is not None:
            if threading.get_ident() == self._loop_thread:
                waiter.set()
                return
            try:
                self._token.run_sync_soon(waiter.set)
            except trio.RunFinishedError:  # unmounted meanwhile: nobody waits any more
                pass

    async def wait(self) -> bytes | memoryview | None:
        """The blob, or None when the try failed; on the loop."""
        if not self._done:
            waiter = self._waiter = trio.Event()
            if not self._done:
                await waiter.wait()
        return self.stored


class PrefetchView:
    """The decoded cache as the prefetcher sees it: a file the kernel holds counts as cached, because decoding it
    ahead would be wasted work (a prefetch queued before the reader got there, or a second epoch)."""

    def __init__(self, cache: DecodedCache, kernel_holds: KernelHolds) -> None:
        self._cache = cache
        self._kernel_holds = kernel_holds

    def contains(self, key: int | tuple[int, int]) -> bool:
        return (type(key) is int and self._kernel_holds.holds(key)) or self._cache.contains(key)

    def get(self, key: int | tuple[int, int]) -> bytes:
        return b"" if type(key) is int and self._kernel_holds.holds(key) else self._cache.get(key)


@answers_every_failure
class FanstoreOperations(pyfuse3.Operations):
    """Read-only operations over one dataset; every write-side request answers EROFS, and any failure answers
    its request with an errno (see answers_every_failure)."""

    def __init__(self, index: Index, cache: DecodedCache, prefetcher: Prefetcher | None, decode_threads: int,
                 keep_cache: bool = True, timeout: float = KERNEL_CACHE_TIMEOUT,
                 kernel_holds: KernelHolds | None = None, source: ChunkSource | None = None,
                 fetch_threads: int = FETCH_THREADS, may_block: np.ndarray | None = None,
                 reader: Reader | None = None, ahead: FetchedAhead | None = None) -> None:
        super().__init__()
        self.index = index
        self.cache = cache
        self.prefetcher = prefetcher
        self.keep_cache = keep_cache
        self.timeout = timeout
        self._entries = index.entries
        self._attribute_rows = fields_view(index.entries, "size", "mtime_ns", "mode")  # by name: format.fields_view
        self._stored_len = index.entries["stored_len"]
        self._size = index.entries["size"]
        self._mode = index.entries["mode"]  # column views: one field of one entry without building its row
        self._blocked = (index.entries["flags"] & FLAG_BLOCKED) != 0
        self._block_size = index.block_size
        self._read_end: dict[int, int] = {}  # where the last read of each file stored in blocks ended
        # Bytes served of each file being read, and which files the kernel holds whole (see _count_served).
        self._served: dict[int, int] = {}
        self._kernel_holds = kernel_holds if kernel_holds is not None else KernelHolds(len(index.entries))
        self._decode_limiter = trio.CapacityLimiter(max(1, decode_threads))
        # Files whose blob may take long to come (from another node) never make the event loop wait: the loop starts
        # the fetch, from open on, and is called back (_start_fetch); other reads of them (a retry, a file stored in
        # blocks) run in threads of their own, so waiting on a slow peer does not hold the threads that decode.
        self._source = source
        self._reader = reader  # with `source`: files from another node are fetched by the loop (_start_fetch)
        self._chunk = index.entries["chunk"]
        self._offset = index.entries["offset"]
        self._may_block = may_block if may_block is not None else may_block_flags(index, source)
        self._fetch_limiter = trio.CapacityLimiter(max(1, fetch_threads))
        # Files from another node whose fetch began at their open, until read or released; the oldest go first
        # past FETCHES_HELD.
        self._opened: dict[int, _Fetching] = {}
        # Files from another node fetched ahead of the reader, by the node's holder: the loop tells it the order
        # (a prefetch list, once, by the mount; else the directory read in order, see _leave_to_holder) and takes
        # each file's blob at its read. None on a single node.
        self._ahead = ahead if reader is not None and source is not None else None
        self._holder_follows_directories = self._ahead is not None and prefetcher is not None and \
            not prefetcher.order.listed
        self._planned_directory = -1  # the directory whose files the holder fetches ahead now (-1: none)
        self._parent = index.entries["parent"]
        self._others_fetch = self._leave_to_holder if self._ahead is not None else None
        self._blocks_limiter = self._fetch_limiter if self._may_block.any() else self._decode_limiter
        self._uid, self._gid = os.getuid(), os.getgid()
        self._reported: set[tuple[str, object]] = set()
        self._stats_replies: dict[int, tuple[float, bytes]] = {}  # process id -> (when, reply), see _stats_reply
        self.initialized = trio.Event()
        total = int(index.entries["size"].sum())
        self._index_identity = None if index.file_identity is None else json.dumps(index.file_identity).encode()
        self._statfs = pyfuse3.StatvfsData()
        self._statfs.f_bsize = self._statfs.f_frsize = 4096
        self._statfs.f_blocks = (total + 4095) // 4096
        self._statfs.f_bfree = self._statfs.f_bavail = 0
        self._statfs.f_files = len(index)
        self._statfs.f_ffree = self._statfs.f_favail = 0
        self._statfs.f_namemax = MAX_NAME_BYTES

    def init(self) -> None:
        """pyfuse3 calls this while answering the kernel's INIT; waiters run once the answer is written."""
        self.initialized.set()

    # --- names and attributes -------------------------------------------------------------------------------

    def _entry(self, inode: int) -> int:
        entry = inode - 1
        if not 0 <= entry < len(self._entries):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return entry

    def _attributes(self, entry: int) -> pyfuse3.EntryAttributes:
        size, mtime_ns, mode = self._attribute_rows[entry].item()
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = entry + 1
        attrs.st_mode = mode & ~_DROPPED_MODE_BITS
        attrs.st_nlink = self.index.link_count(entry) if stat.S_ISDIR(mode) else 1
        attrs.st_size = size
        attrs.st_blksize = 128 * 1024
        attrs.st_blocks = (size + 511) // 512
        attrs.st_uid, attrs.st_gid = self._uid, self._gid
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = mtime_ns
        attrs.entry_timeout = attrs.attr_timeout = self.timeout
        return attrs

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._entry(parent_inode)
        if len(name) > MAX_NAME_BYTES:  # as statfs says: not merely absent
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            return self._attributes(parent)
        if name == b"..":
            return self._attributes(int(self._entries[parent]["parent"]))
        parent_path = self.index.path_bytes(parent)
        entry = self.index.lookup_key(parent_path + b"/" + name if parent_path else name)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(entry)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self._entry(inode))

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        entry = self._entry(inode)
        if not stat.S_ISLNK(int(self._mode[entry])):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self.index.link_target(entry).encode("utf-8")

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        entry = self._entry(inode)
        if not stat.S_ISDIR(int(self._mode[entry])):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return entry

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # '.' and '..' first, as a directory on disk lists them (`ls -a`, code that counts entries), then the children.
        # The offset of each is its position in the listing plus one: stable, since the listing never changes.
        children = self.index.children(fh)
        for position in range(start_id, len(children) + 2):
            if position < 2:
                name, entry = (b".", fh) if position == 0 else (b"..", int(self._entries[fh]["parent"]))
            else:
                entry = children[position - 2]
                name = self.index.path_bytes(entry).rpartition(b"/")[2]
            if not pyfuse3.readdir_reply(token, name, self._attributes(entry), position + 1):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        return self._statfs

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR:
            return self._stats_reply(ctx.pid)
        if name == _INDEX_XATTR and self._index_identity is not None:
            return self._index_identity
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    def _stats_reply(self, pid: int) -> bytes:
        """The counters as JSON; the reply a process had within STATS_REPLY_KEPT_S is given to it once more, so
        that a size asked for first still fits the value asked for next."""
        now = time.monotonic()
        kept = self._stats_replies.pop(pid, None)
        if kept is not None and now - kept[0] < STATS_REPLY_KEPT_S:
            return kept[1]
        reply = json.dumps(self.stats()).encode()
        self._stats_replies = {other: (when, old) for other, (when, old) in self._stats_replies.items()
                               if now - when < STATS_REPLY_KEPT_S}
        self._stats_replies[pid] = (now, reply)
        return reply

    def stats(self) -> dict[str, Any]:
        """The daemon's counters, as `getfattr -n user.fanstore.stats MOUNTPOINT` shows them."""
        prefetch = self.prefetcher.stats() if self.prefetcher is not None else {"pending": 0, "decoded": 0}
        prefetch["fetches_at_open"] = len(self._opened)  # begun at an open, not read yet
        prefetch["kernel_trust"] = round(self._kernel_holds.trust, 3)  # see KernelHolds
        stats = {"cache": {**dataclasses.asdict(self.cache.stats()), "capacity": self.cache.capacity},
                 "prefetch": prefetch}
        if self._ahead is not None:
            stats["ahead"] = self._ahead.stats()  # the mount's plan in the node's holder
        source = self._source.stats() if self._source is not None else {}
        if source:
            stats["source"] = source
        return stats

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return []

    # --- file contents ---------------------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        entry = self._entry(inode)
        if flags & _WRITE_FLAGS:
            raise _read_only()
        if not stat.S_ISREG(int(self._mode[entry])):
            raise pyfuse3.FUSEError(errno.EISDIR)
        self._kernel_holds.opened(entry)
        if self._may_block[entry] and self._needs_fetch(entry):
            # A file from another node that the kernel does not hold: its read comes next, so its blob is taken
            # now (from the holder, if fetched ahead) or fetched, and the peer's round trip overlaps the open's
            # reply and the reader's read request.
            fetching = self._start_fetch(entry)
            if fetching is not None:
                self._hold(entry, fetching)
        return pyfuse3.FileInfo(fh=entry, keep_cache=self.keep_cache)

    async def read(self, fh: int, off: int, size: int) -> memoryview | bytes:
        if self._blocked[fh]:
            return await self._read_blocks(fh, off, size)
        # A fetch begun at this file's open is this read's.
        fetching = self._opened.pop(fh, None) if self._may_block[fh] else None
        if off == 0:
            # The kernel asks for the start of a file, so it does not hold it (any more): decode the next ones.
            # Not at open, which also comes for files the kernel still holds (a second epoch).
            self._kernel_holds.read_from_start(fh)
            if self.prefetcher is not None:
                self.prefetcher.withdraw(fh)
                self.prefetcher.accessed(fh, self._others_fetch)
            if self._ahead is not None:
                self._ahead.reached(fh)
        data = self.cache.peek(fh)
        if data is None:
            load = self._loader_for(fh, off, size)
            if self._may_block[fh]:
                whole = load == self.cache.load_uncached
                if fetching is None and whole:
                    fetching = self._start_fetch(fh)
                data = await self._fetched(fh, fetching) if fetching is not None else None
                if data is not None and not whole:
                    self.cache.put(fh, data)  # read in parts: the next parts come from the cache
                if data is None:
                    data = await trio.to_thread.run_sync(load, fh, limiter=self._fetch_limiter)
            elif self._stored_len[fh] <= INLINE_DECODE_BYTES:
                data = load(fh)
            else:
                data = await trio.to_thread.run_sync(load, fh, limiter=self._decode_limiter)
        reply = memoryview(data)[off : off + size]  # pyfuse3 replies from the buffer: no copy of the slice
        if self.keep_cache:
            self._count_served(fh, len(reply), len(data))
        return reply

    def _start_fetch(self, entry: int) -> _Fetching | None:
        """The blob of a file from another node, on its way: taken from the node's holder if fetched ahead (or on
        its way there), else fetched for this read. Either way the loop is called back when it arrives (or the try
        fails), so no thread sits waiting for the peer (a thread's hand-offs each way cost more CPU than decoding
        the file). None when the source has no such path."""
        if self._reader is None or self._source is None:
            return None
        fetching = _Fetching(trio.lowlevel.current_trio_token(), threading.get_ident())
        if self._ahead is not None and self._ahead.claim(entry, fetching.arrive):
            return fetching
        if not self._source.start_read(int(self._chunk[entry]), int(self._offset[entry]),
                                       int(self._stored_len[entry]), fetching.arrive):
            return None
        return fetching

    def _needs_fetch(self, entry: int) -> bool:
        """Neither a fetch begun at an open, nor the kernel, nor the cache has the file."""
        return not (entry in self._opened or self._kernel_holds.holds(entry) or self.cache.contains(entry))

    def _hold(self, entry: int, fetching: _Fetching) -> None:
        """Keep a fetch begun at a file's open for its read; the oldest go first past FETCHES_HELD."""
        opened = self._opened
        opened[entry] = fetching
        if len(opened) > FETCHES_HELD:
            del opened[next(iter(opened))]  # its read, if it ever comes, fetches again

    def _leave_to_holder(self, entry: int, keys: list[CacheKey], followed: bool,
                         in_order: bool) -> list[CacheKey]:
        """Of the prefetcher's next files, those from another node are the holder's to fetch ahead (still stored:
        their reads decode them as local ones are); the others are returned, for the prefetcher's threads.

        Without a prefetch list, the holder is told the rest of a directory once a read there follows a recent one
        while most reads do (one plan a directory, not one per read), and nothing once most reads stop following
        the order: a blob fetched for a reader that skips around would come for nothing."""
        if self._holder_follows_directories:
            directory = int(self._parent[entry])
            if followed and in_order and directory != self._planned_directory:
                self._ahead.follow(np.arange(entry + 1, self.index.children(directory).stop),  # type: ignore[union-attr]
                                   start_now=True)
                self._planned_directory = directory
            elif not in_order and self._planned_directory >= 0:
                self._ahead.follow(np.empty(0, dtype=np.int64))  # type: ignore[union-attr]
                self._planned_directory = -1
        covers = self._ahead.covers  # type: ignore[union-attr]
        return [key for key in keys if type(key) is not int or not covers[key]]

    async def _fetched(self, entry: int, fetching: _Fetching) -> bytes | None:
        """The file, decoded from the blob `fetching` brings; None when that try failed: the caller then reads the
        file off the loop, the usual way, which falls back to DEST. A blob that came but fails its checksum is
        read from the other copy (DEST) once, off the loop; if that one fails too the file is corrupt. A sound blob
        that does not decode is ChunkCorrupt at once: DEST holds the same bytes."""
        stored = await fetching.wait()
        if stored is None:
            return None
        reader = self._reader
        if self._stored_len[entry] <= INLINE_DECODE_BYTES:
            decoded = reader.decode_fetched(entry, stored)  # type: ignore[union-attr]
        else:
            decoded = await trio.to_thread.run_sync(reader.decode_fetched, entry,  # type: ignore[union-attr]
                                                    stored, limiter=self._decode_limiter)
        if decoded is None:
            return await trio.to_thread.run_sync(reader.read_other_copy, entry,  # type: ignore[union-attr]
                                                 limiter=self._fetch_limiter)
        return decoded

    async def _read_blocks(self, entry: int, off: int, size: int) -> memoryview | bytes:
        """A read of a file stored in blocks decodes only the blocks it touches, each cached under (entry, block):
        memory stays near the cache size whatever the file's size. A reader going on where its last read ended
        gets the next blocks decoded ahead."""
        end = min(off + size, int(self._size[entry]))
        if end <= off:
            return b""
        block_size = self._block_size
        first, last = off // block_size, (end - 1) // block_size
        if self.prefetcher is not None and self._read_end.get(entry) == off:
            for ahead in range(last + 1, min(last + 1 + BLOCKS_READ_AHEAD, self.index.block_count(entry))):
                self.prefetcher.prefetch((entry, ahead))
        self._read_end[entry] = end
        parts = []
        for block in range(first, last + 1):
            key = (entry, block)
            data = self.cache.peek(key)
            if data is None:
                data = await trio.to_thread.run_sync(self.cache.get, key, limiter=self._blocks_limiter)
            start = block * block_size
            parts.append(memoryview(data)[max(off, start) - start : end - start])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _loader_for(self, entry: int, off: int, size: int) -> Callable[[int], bytes]:
        """A file that goes out whole in one reply is the kernel's to keep from then on (keep_cache), so it is
        decoded for that reply alone, unless a prefetch is decoding it into the cache already."""
        whole = self.keep_cache and off == 0 and size >= self._size[entry]
        if whole and (self.prefetcher is None or not self.cache.contains(entry)):
            return self.cache.load_uncached
        return self.cache.get

    def _count_served(self, entry: int, count: int, size: int) -> None:
        """Once every byte of a file went out with keep_cache on, the kernel's page cache holds it: the decoded
        copy is dropped (its memory is reused by the next decode instead of new memory being faulted in)."""
        served = self._served.pop(entry, 0) + count
        if served < size:
            self._served[entry] = served
            return
        self.cache.discard(entry)
        self._kernel_holds.sent_whole(entry)

    async def release(self, fh: int) -> None:
        # Opened but not read (or read by another handle already): a fetch begun at open arrives to nobody.
        self._opened.pop(fh, None)
        self._kernel_holds.released(fh)

    def report_failure(self, handler: str, args: tuple[Any, ...], exc: Exception) -> int:
        """Log a failed request once per damaged file, unavailable chunk or kind of fault; return its errno."""
        code = fuse_errno_of(exc)
        if isinstance(exc, ChunkCorrupt):
            key: tuple[str, object] = ("corrupt", exc.path)
        elif isinstance(exc, ChunkUnavailable):
            key = ("unavailable", exc.chunk_id)
        elif isinstance(exc, FanstoreError):
            key = (type(exc).__name__, str(exc))
        else:
            key = (handler, type(exc).__name__)
        if key not in self._reported:
            self._reported.add(key)
            what = str(exc) if isinstance(exc, FanstoreError) else f"{type(exc).__name__}: {exc} " \
                f"(in {handler}{self._describe(handler, args)})"
            log.error("%s: %s", errno.errorcode.get(code, code), what)
        return code

    def _describe(self, handler: str, args: tuple[Any, ...]) -> str:
        """The file a request was about, for a log line: its first argument is a file handle (an entry number)
        or an inode (entry + 1)."""
        if not args or type(args[0]) is not int:
            return ""
        entry = args[0] if handler in HANDLE_FIRST else args[0] - 1
        try:
            return f", {quoted(self.index.path_of(entry))}"
        except Exception:  # noqa: BLE001 - only a log line's detail
            return f", {'handle' if handler in HANDLE_FIRST else 'inode'} {args[0]}"

    # --- everything that would change the tree ---------------------------------------------------------------

    async def setattr(self, inode, attr, fields, fh, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def mknod(self, parent_inode, name, mode, rdev, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def mkdir(self, parent_inode, name, mode, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def unlink(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def rmdir(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def symlink(self, parent_inode, name, target, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def link(self, inode, new_parent_inode, new_name, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def create(self, parent_inode, name, mode, flags, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def write(self, fh, off, buf):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def setxattr(self, inode, name, value, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()

    async def removexattr(self, inode, name, ctx):  # type: ignore[no-untyped-def]
        raise _read_only()
