"""Where a chunk's bytes come from. The read path asks a ChunkSource for (chunk, offset, length) and does not
care whether the answer comes from a local file, an MPI peer or a shared file system."""

from __future__ import annotations

import errno
import os
import resource
import stat
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..errors import ChunkCorrupt, ChunkError, ChunkUnavailable, FormatError
from .format import CHUNK_HEADER_LEN, check_chunk_header, chunk_file_name

__all__ = ["BlobRead", "ChunkSource", "ChunkUnavailable", "FallbackChunkSource", "LocalChunkSource", "ReadDone",
           "default_max_open_chunks"]

# Called once with the blob (or a view of a buffer the source hands over) or with the error; see start_read.
ReadDone = Callable[[bytes | memoryview | None, ChunkError | None], None]


class BlobRead(NamedTuple):
    """One blob to read without waiting (ChunkSource.start_reads)."""

    chunk_id: int
    offset: int
    length: int
    done: ReadDone


class ChunkSource(ABC):
    """Bytes of stored blobs, by chunk id, offset and length. Implementations are safe to call from many threads."""

    @abstractmethod
    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset` of chunk `chunk_id`. ChunkUnavailable when they cannot be had now,
        ChunkCorrupt when the chunk is not what the index says; both name the chunk."""

    def read_many(self, blobs: Sequence[tuple[int, int, int]]) -> list[bytes | memoryview | ChunkError]:
        """`read` of several blobs (chunk, offset, length), each one's bytes or its error, in order: a source that
        asks someone else (the node's serve process) asks for them in one round trip. The bytes may be views of
        one buffer the source hands over."""
        results: list[bytes | memoryview | ChunkError] = []
        for chunk_id, offset, length in blobs:
            try:
                results.append(self.read(chunk_id, offset, length))
            except ChunkError as exc:
                results.append(exc)
        return results

    def may_block(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """For each blob (chunk, offset), whether reading it may wait on something slow (another node, a deadline):
        the mount reads those off its event loop. Asked once at open, so a read decides by a lookup."""
        return np.zeros(len(chunks), dtype=bool)

    def start_read(self, chunk_id: int, offset: int, length: int, done: ReadDone, ahead: bool = False) -> bool:
        """Start a read of a blob that may_block says is slow, without waiting: `done(data, None)` or
        `done(None, error)` comes later, from another thread or the caller's event loop (`data` may be a view
        of a buffer the source hands over, not bytes). An event loop uses it so that no thread of its own
        waits for the blob. A first try only: after an error the caller reads it with `read`, which knows the
        fallbacks. False when this source has no such path (then `read` it). `ahead`: nobody waits for the
        blob yet (a fetch ahead of the reader), so the source may hand the asking to a thread of its own."""
        return False

    def start_reads(self, reads: Sequence[BlobRead], ahead: bool = False) -> list[bool]:
        """start_read for several blobs at once, each started or not as start_read would say: a source may ask for
        them together (one request to a peer for all of its blobs among them)."""
        return [self.start_read(*read, ahead=ahead) for read in reads]

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        """The same blob from another copy than the one `read` gave, which failed its checksum: a node's staged
        chunk has DEST behind it, so a damaged copy costs a read of DEST, not the file. ChunkUnavailable where
        there is no other copy (the default)."""
        raise ChunkUnavailable(f"chunk {chunk_id}: no other copy to read", chunk_id=chunk_id)

    def stats(self) -> dict[str, Any]:
        """Counters worth showing an operator (where reads came from), or nothing."""
        return {}

    def for_forked_child(self) -> "ChunkSource | None":
        """In a process forked from the one that made this source: a source for the child that takes over the
        descriptors the parent had open (inherited across the fork, valid as they are), or None when this source
        cannot be carried over (sockets, threads) and the child must open its own."""
        return None

    def close(self) -> None:
        """Release what the source holds open; reads after close raise ChunkUnavailable."""

    def __enter__(self) -> "ChunkSource":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def default_max_open_chunks() -> int:
    """How many chunk files a source keeps open: a quarter of the process's descriptor limit, so a dataset of
    thousands of chunks never exhausts it (and leaves room for the training job's own files)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(8, min(4096, soft // 4))


class _OpenChunk:
    """One open chunk file and how many reads are using its descriptor right now (it is closed only when none)."""

    __slots__ = ("fd", "users", "retired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.retired = False  # evicted or source closed: close the fd once the last user is done


class LocalChunkSource(ChunkSource):
    """Chunk files in a dataset directory on this node, opened on first use (type, header and size checked), read
    with pread, and kept open up to `max_open` at a time, least recently used closed first."""

    def __init__(self, dataset_dir: str | os.PathLike[str], chunk_sizes: np.ndarray | Sequence[int],
                 max_open: int | None = None) -> None:
        self._dir = Path(dataset_dir).absolute()  # chunk files open as reads reach them, whatever the cwd is then
        self._sizes = [int(s) for s in chunk_sizes]
        self._max_open = max(1, max_open if max_open is not None else default_max_open_chunks())
        self._open: OrderedDict[int, _OpenChunk] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        _LIVE_SOURCES.add(self)  # its lock made anew in a forked child (_after_fork_in_child)

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        handle = self._acquire_range(chunk_id, offset, length)
        try:
            data = os.pread(handle.fd, length, offset)
        except OSError as exc:
            raise self._unreadable(chunk_id, offset, exc) from None
        except MemoryError:  # pread allocates the blob: one too large fails its file, as a decode without memory
            raise ChunkUnavailable(f"{self.path(chunk_id)}: not enough memory to read {length} bytes of chunk "
                                   f"{chunk_id} at offset {offset}", chunk_id=chunk_id) from None
        finally:
            self._release(handle)
        if len(data) != length:
            raise self._shrank(chunk_id, offset, len(data), length)
        return data

    def read_into(self, chunk_id: int, offset: int, length: int, out: memoryview) -> None:
        """`read`, into `out` (writable, `length` bytes): a peer's reply is filled in place, blob after blob,
        instead of each blob read into bytes of its own and the lot joined (two copies of every byte)."""
        handle = self._acquire_range(chunk_id, offset, length)
        try:
            got = os.preadv(handle.fd, [out], offset)
        except OSError as exc:
            raise self._unreadable(chunk_id, offset, exc) from None
        finally:
            self._release(handle)
        if got != length:
            raise self._shrank(chunk_id, offset, got, length)

    def _acquire_range(self, chunk_id: int, offset: int, length: int) -> _OpenChunk:
        handle = self._acquire(chunk_id)  # checks chunk_id
        if offset < 0 or length < 0 or offset + length > self._sizes[chunk_id]:
            self._release(handle)
            raise ChunkUnavailable(f"{self.path(chunk_id)}: bytes {offset}..{offset + length} lie outside chunk "
                                   f"{chunk_id} ({self._sizes[chunk_id]} bytes)", chunk_id=chunk_id)
        return handle

    def _unreadable(self, chunk_id: int, offset: int, exc: OSError) -> ChunkUnavailable:
        return ChunkUnavailable(f"{self.path(chunk_id)}: cannot read chunk {chunk_id} at offset {offset}: "
                                f"{exc.strerror}", chunk_id=chunk_id)

    def _shrank(self, chunk_id: int, offset: int, got: int, length: int) -> ChunkCorrupt:
        return ChunkCorrupt(f"{self.path(chunk_id)}: short read of chunk {chunk_id} at offset {offset} "
                            f"({got} of {length} bytes): the file shrank", chunk_id=chunk_id)

    @property
    def directory(self) -> Path:
        """The dataset directory whose chunk files it reads."""
        return self._dir

    def path(self, chunk_id: int) -> Path:
        """The chunk file, for messages."""
        return self._dir / chunk_file_name(chunk_id)

    def open_ahead(self) -> int:
        """Open (and check) chunk files now, up to the bound, so that processes forked from this one inherit
        them: DataLoader workers, forked afresh each epoch, then open nothing on the shared file system (one open a
        chunk per job, not one per worker per epoch). A chunk that cannot be opened is left for its reads to report.
        Returns how many are open."""
        for chunk_id in range(min(len(self._sizes), self._max_open)):
            try:
                self._release(self._acquire(chunk_id))
            except ChunkError:
                continue
        with self._lock:
            return len(self._open)

    def for_forked_child(self) -> "LocalChunkSource":
        """A source for a forked child over the same directory that owns the descriptors this (inherited) copy
        held: the child's copy forgets them, so they are closed once, by the new source. No lock is taken: a
        thread of the parent may have held it at the fork, and in the child no other thread runs."""
        child = LocalChunkSource(self._dir, self._sizes, self._max_open)
        if not self._closed:
            for chunk_id, handle in self._open.items():
                if not handle.retired:
                    child._open[chunk_id] = _OpenChunk(handle.fd)
        self._open = OrderedDict()
        self._closed = True
        return child

    def _acquire(self, chunk_id: int) -> _OpenChunk:
        with self._lock:
            if self._closed:
                raise ChunkUnavailable(f"{self._dir}: the dataset is closed", chunk_id=chunk_id)
            handle = self._open.get(chunk_id)
            if handle is not None:
                self._open.move_to_end(chunk_id)
                handle.users += 1
                return handle
        fd = self._open_checked(chunk_id)  # outside the lock: an open may be slow, reads of open chunks go on
        with self._lock:
            if self._closed:
                os.close(fd)
                raise ChunkUnavailable(f"{self._dir}: the dataset is closed", chunk_id=chunk_id)
            handle = self._open.get(chunk_id)
            if handle is None:  # else another thread opened it meanwhile: use theirs
                handle = self._open[chunk_id] = _OpenChunk(fd)
                self._evict_idle(keep=self._max_open)
            else:
                os.close(fd)
            handle.users += 1
            return handle

    def _release(self, handle: _OpenChunk) -> None:
        with self._lock:
            handle.users -= 1
            if handle.retired and handle.users == 0:
                os.close(handle.fd)

    def _evict_idle(self, keep: int) -> None:
        """Close least recently used chunks until at most `keep` are open; a chunk being read is retired instead
        and closed by its last reader. The caller holds the lock."""
        while len(self._open) > keep:
            _, handle = self._open.popitem(last=False)
            handle.retired = True
            if handle.users == 0:
                os.close(handle.fd)

    def _open_checked(self, chunk_id: int) -> int:
        path = self.path(chunk_id)
        if not 0 <= chunk_id < len(self._sizes):
            raise ChunkUnavailable(f"{path}: chunk {chunk_id} is not in the index", chunk_id=chunk_id)
        # O_NONBLOCK: a chunk file replaced by a fifo must not block the reader (it has no effect on a file).
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise ChunkUnavailable(f"{path}: cannot open chunk {chunk_id}: {exc.strerror}",
                                       chunk_id=chunk_id) from None
            with self._lock:
                self._evict_idle(keep=0)  # out of descriptors: give back ours and try once more
            try:
                fd = os.open(path, flags)
            except OSError as again:
                raise ChunkUnavailable(f"{path}: cannot open chunk {chunk_id}: {again.strerror}",
                                       chunk_id=chunk_id) from None
        try:
            self._check_opened(fd, chunk_id, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_opened(self, fd: int, chunk_id: int, path: Path) -> None:
        try:
            info = os.fstat(fd)
            header = os.pread(fd, CHUNK_HEADER_LEN, 0) if stat.S_ISREG(info.st_mode) else b""
        except OSError as exc:
            raise ChunkUnavailable(f"{path}: cannot read chunk {chunk_id}: {exc.strerror}",
                                   chunk_id=chunk_id) from None
        if not stat.S_ISREG(info.st_mode):
            raise ChunkUnavailable(f"{path}: chunk {chunk_id} is not a regular file", chunk_id=chunk_id)
        try:
            check_chunk_header(header, chunk_id, path)
        except FormatError as exc:
            raise ChunkCorrupt(str(exc), chunk_id=chunk_id) from None
        if info.st_size != self._sizes[chunk_id]:
            raise ChunkCorrupt(f"{path}: chunk {chunk_id} is {info.st_size:,} bytes, the index says "
                               f"{self._sizes[chunk_id]:,}", chunk_id=chunk_id)

    def check(self, chunk_id: int) -> ChunkUnavailable | ChunkCorrupt | None:
        """Why chunk `chunk_id` cannot serve reads (missing, unreadable, not what the index says), or None: its
        file is opened and its type, header and size checked, without reading any blob."""
        try:
            os.close(self._open_checked(chunk_id))
        except (ChunkUnavailable, ChunkCorrupt) as exc:
            return exc
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._evict_idle(keep=0)

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        """A source dropped unclosed gives its descriptors back, as a file object does: a dataset opened for each
        item and never closed (`open_dataset(DEST).read(path)`) ran the process out of descriptors after about as
        many items as its limit. No lock is taken: nothing else can reach the source now. (`_close` is bound here:
        at interpreter exit the module's globals may be gone before the source is collected.)"""
        held = getattr(self, "_open", None)  # None when __init__ failed
        while held:
            try:
                _close(held.popitem()[1].fd)
            except OSError:
                pass

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own, and no reads in progress (the parent's threads that were reading
        do not exist here). A thread of the parent holding the lock at the fork (while it closed a chunk file, say)
        left the child's copy held for good, and the child's first read of the dataset waited forever."""
        self._lock = threading.Lock()
        for handle in self._open.values():
            handle.users = 0


# Every LocalChunkSource not yet collected, so that a forked child gets each a lock of its own: a user's torch
# Dataset holding `open_dataset(...)` reaches its forked DataLoader workers as the parent's object, lock and all.
_LIVE_SOURCES: "weakref.WeakSet[LocalChunkSource]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for source in list(_LIVE_SOURCES):
        source._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


_NONE_GIVEN: frozenset[tuple[int, int]] = frozenset()


class FallbackChunkSource(ChunkSource):
    """Reads from `primary`, and from `fallback` whatever `primary` cannot give (ChunkUnavailable) or gives from a
    copy found corrupt (ChunkCorrupt: a peer node's copy is damaged, DEST's may be sound): a peer node first, the
    shared file system when the peer is slow, gone or damaged. Bytes the primary gave that fail the reader's
    checksum are read from the fallback too (read_other_copy): either way, once; what the fallback gives is final.
    `on_fallback(error, length)` is told of each blob the fallback gave, once it gave it."""

    def __init__(self, primary: ChunkSource, fallback: ChunkSource,
                 on_fallback: Callable[[ChunkError, int], None] | None = None) -> None:
        self.primary = primary
        self.fallback = fallback
        self._on_fallback = on_fallback
        # Per thread, the blobs (chunk, offset) the fallback gave in its last read or read_many: a reader checks
        # what it read at once, on its thread, and bytes of these that fail are the fallback's copy damaged, not
        # the primary's (a peer that could not give a blob was blamed for DEST's).
        self._given = threading.local()

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        self._given.blobs = _NONE_GIVEN
        try:
            return self.primary.read(chunk_id, offset, length)
        except ChunkError as exc:
            return self._from_the_fallback(exc, chunk_id, offset, length)

    def read_many(self, blobs: Sequence[tuple[int, int, int]]) -> list[bytes | memoryview | ChunkError]:
        self._given.blobs = _NONE_GIVEN
        results = self.primary.read_many(blobs)
        for number, result in enumerate(results):
            if isinstance(result, ChunkError):
                try:
                    results[number] = self._from_the_fallback(result, *blobs[number])
                except ChunkError as exc:
                    results[number] = exc
        return results

    def gave(self, chunk_id: int, offset: int) -> bool:
        """Whether the fallback gave the blob at `offset` of `chunk_id` in this thread's last read (its bytes are
        final)."""
        return (chunk_id, offset) in getattr(self._given, "blobs", _NONE_GIVEN)

    def read_other_copy(self, chunk_id: int, offset: int, length: int) -> bytes:
        if self.gave(chunk_id, offset):
            path = getattr(self.fallback, "path", None)
            where = f"{path(chunk_id)}: " if path is not None else ""
            raise ChunkCorrupt(f"{where}chunk {chunk_id}: the blob at offset {offset} ({length} bytes), read from the "
                               "fallback copy, fails its checksum: that copy is damaged", chunk_id=chunk_id)
        return self._from_the_fallback(ChunkCorrupt(f"chunk {chunk_id}: the blob at offset {offset} ({length} bytes) "
                                                    f"fails its checksum", chunk_id=chunk_id),
                                       chunk_id, offset, length)

    def _from_the_fallback(self, reason: ChunkError, chunk_id: int, offset: int, length: int) -> bytes:
        data = self.fallback.read(chunk_id, offset, length)
        given = getattr(self._given, "blobs", _NONE_GIVEN)
        if given is _NONE_GIVEN:
            given = self._given.blobs = set()
        given.add((chunk_id, offset))
        if self._on_fallback is not None:
            self._on_fallback(reason, length)
        return data

    def may_block(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return self.primary.may_block(chunks, offsets) | self.fallback.may_block(chunks, offsets)

    def close(self) -> None:
        self.primary.close()
        self.fallback.close()
