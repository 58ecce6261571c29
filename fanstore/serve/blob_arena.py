"""The node's shared memory for remote blobs: the serve process receives its peers' replies into it, and the node's
readers (DataLoader workers) read those blobs where they landed, through a read-only mapping of their own, instead
of having each one copied through the node socket (the serve process's send, the worker's receive, and the wake-ups
between them).

One owner, the serve process, cuts the arena into slots, a reply's receive buffer each. A slot is given back when
nothing in the serve process refers to it any more (the receive, the holder of blobs fetched ahead, the blobs lent
to a reader's connection): its numpy view's finalizer does it, so no path can give one back twice or too early. A
reader is lent the blobs of a reply under a token, and gives the token back, once its own views of them are gone,
with its next request on that connection; a connection that closes (its process died) gives back all it held.
When the arena is full, a receive gets private memory and its blobs go through the socket as before.

A reader's side (ArenaView) maps the arena read-only: it can read a blob where it lies, never write one.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np

log = logging.getLogger("fanstore.serve")

ARENA_BYTES = 512 << 20  # of address space; pages are taken as slots are first used, and stay with the node
SLOT_ALIGN = 64  # each slot starts on a cache line


class BlobArena:
    """The serve process's side: a memfd, mapped once, cut into slots first-fit from its start (slots used and
    given back in about the order they were taken keep to the arena's first pages)."""

    def __init__(self, size: int = ARENA_BYTES) -> None:
        self.size = size
        self.fd = os.memfd_create("fanstore-blob-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        # What readers are given: a descriptor opened read-only, so that none can map the arena writable and change
        # a blob another reader reads (between its checksum and its decoding, say).
        self.reader_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._array.__array_interface__["data"][0]
        self._lock = threading.Lock()
        # Slots given back, taken into the free ranges under the lock by the next slot() or stats(): a finalizer
        # may run in any thread at any allocation, the lock's holder too, so it only appends (atomic).
        self._given_back: collections.deque[tuple[int, int]] = collections.deque()
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._ends: list[int] = [size]
        self.used = 0  # bytes in slots
        self.slots = 0
        self.full = 0  # slots asked for that did not fit

    def slot(self, length: int) -> np.ndarray | None:
        """A slot of `length` bytes (not zeroed), or None when no free range is that long. It is given back when
        the last view of it goes."""
        need = -(-max(length, 1) // SLOT_ALIGN) * SLOT_ALIGN
        with self._lock:
            self._take_back()
            for number, (start, end) in enumerate(zip(self._starts, self._ends)):
                if end - start >= need:
                    break
            else:
                self.full += 1
                return None
            if end - start == need:
                del self._starts[number], self._ends[number]
            else:
                self._starts[number] = start + need
            self.used += need
            self.slots += 1
        view = self._array[start : start + length]
        weakref.finalize(view, self._given_back.append, (start, need))
        return view  # views of it that keep it are memoryviews (a numpy slice of it would refer to the mapping)

    def _take_back(self) -> None:
        while self._given_back:
            self._free(*self._given_back.popleft())

    def _free(self, start: int, length: int) -> None:
        end = start + length
        self.used -= length
        self.slots -= 1
        number = bisect.bisect_left(self._starts, start)
        joins_before = number > 0 and self._ends[number - 1] == start
        joins_after = number < len(self._starts) and self._starts[number] == end
        if joins_before and joins_after:
            self._ends[number - 1] = self._ends[number]
            del self._starts[number], self._ends[number]
        elif joins_before:
            self._ends[number - 1] = end
        elif joins_after:
            self._starts[number] = start
        else:
            self._starts.insert(number, start)
            self._ends.insert(number, end)

    def place(self, blob: Any) -> int:
        """Where `blob` (a view of a slot) lies in the arena, or -1 for bytes elsewhere. Its address through ctypes:
        a fifth of numpy's cost (0.27 against 1.5 us), and this runs for every blob lent."""
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(blob)) - self.base
        except (TypeError, ValueError):  # read-only bytes (not a slot's), or empty
            return -1
        return address if 0 <= address and address + len(blob) <= self.size else -1

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._take_back()
            return {"arena_bytes": self.size, "arena_used": self.used, "arena_slots": self.slots,
                    "arena_full": self.full}

    def close(self) -> None:
        """The descriptors go; the mapping stays while views of it live (the process's end takes it)."""
        os.close(self.reader_fd)
        os.close(self.fd)


def open_arena(size: int = ARENA_BYTES) -> BlobArena | None:
    """The node's arena, or None where the system gives none (no memfd): readers then get every blob through the
    socket."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        return BlobArena(size)
    except OSError as exc:
        log.info("no shared arena for remote blobs (%s): the node's readers get them through the socket", exc)
        return None


class ArenaView:
    """A reader's read-only mapping of the node's arena. `lend` gives the view one reply's blobs are sliced from:
    its finalizer hands the reply's token to `give_back` once every slice of it is gone (whichever thread drops
    the last)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size

    def lend(self, token: int, give_back: Callable[[int], None]) -> memoryview:
        """The whole arena as one reply's view: its blobs are slices of it, and each slice keeps the reply's array
        alive (a numpy slice would not: numpy refers a view of a view to the memory's owner, the mapping)."""
        reply = self._array[:]
        weakref.finalize(reply, give_back, token)
        return memoryview(reply)
