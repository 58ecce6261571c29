"""Decoded files kept in memory, least recently used first out, bounded in bytes.

The cache is given a loader and knows nothing of chunks or codecs. Concurrent requests for the same file share
one load (the reader and a prefetch thread never decode the same file twice at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Hashable


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    waits: int = 0  # requests that waited for another's load of the same key instead of loading it again
    loaded_bytes: int = 0  # bytes the misses loaded (decoded): what the reads cost
    evictions: int = 0
    bytes_held: int = 0
    entries_held: int = 0


class DecodedCache:
    """`get(key)` returns the cached value or loads it once; memory held never exceeds `capacity` bytes.

    A value larger than the whole capacity is returned but not kept.
    """

    def __init__(self, capacity: int, loader: Callable[[Hashable], bytes]) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be 0 or more bytes, got {capacity}")
        self.capacity = capacity
        self._loader = loader
        self._values: OrderedDict[Hashable, bytes] = OrderedDict()
        self._loading: dict[Hashable, Future[bytes]] = {}
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get(self, key: Hashable) -> bytes:
        with self._lock:
            value = self._hit(key)
            if value is not None:
                return value
            pending = self._loading.get(key)
            if pending is None:
                pending = self._loading[key] = Future()
                owner = True
                self._stats.misses += 1
            else:
                owner = False
                self._stats.waits += 1
        if not owner:
            return pending.result()
        try:
            value = self._loader(key)
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._loading[key]
            self._stats.loaded_bytes += len(value)
            self._insert(key, value)
        pending.set_result(value)
        return value

    def load_uncached(self, key: Hashable) -> bytes:
        """Load a value without keeping it, for a consumer that takes all of it at once and keeps it itself (the
        kernel's page cache, for a file served whole in one reply): caching it would only cost a copy's memory."""
        return self._loader(key)

    def put(self, key: Hashable, value: bytes) -> None:
        """Keep a value its caller loaded another way (a blob fetched by an event loop, decoded there), unless it
        is held already or a load of it is under way (that load keeps it)."""
        with self._lock:
            if key not in self._values and key not in self._loading:
                self._stats.loaded_bytes += len(value)
                self._insert(key, value)

    def peek(self, key: Hashable) -> bytes | None:
        """The cached value, or None without loading: lets an event loop serve hits without a thread hop."""
        with self._lock:
            return self._hit(key)

    def _hit(self, key: Hashable) -> bytes | None:
        """The value if cached, now the most recently used; the caller holds the lock."""
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
            self._stats.hits += 1
        return value

    def discard(self, key: Hashable) -> None:
        """Forget a value now (not counted as an eviction): its reader has all of it, keeping it is only memory."""
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._stats.bytes_held -= len(value)

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._values or key in self._loading

    def _insert(self, key: int, value: bytes) -> None:
        size = len(value)
        if size > self.capacity:
            return
        while self._stats.bytes_held + size > self.capacity:
            _, evicted = self._values.popitem(last=False)
            self._stats.bytes_held -= len(evicted)
            self._stats.evictions += 1
        self._values[key] = value
        self._stats.bytes_held += size

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._stats.hits, self._stats.misses, self._stats.waits, self._stats.loaded_bytes,
                              self._stats.evictions, self._stats.bytes_held, len(self._values))
