"""DecodedCache: bounded in bytes, least recently used out, one load per key however many ask at once."""

from __future__ import annotations

import threading

import pytest

from conftest import wait_until
from fanstore.core.cache import DecodedCache


def loader_of(sizes: dict[int, int], calls: list[int]):
    def load(key: int) -> bytes:
        calls.append(key)
        return bytes([key % 256]) * sizes[key]
    return load


def test_bytes_bound_and_lru_order():
    calls: list[int] = []
    cache = DecodedCache(100, loader_of({1: 40, 2: 40, 3: 40}, calls))
    cache.get(1)
    cache.get(2)
    cache.get(1)  # 1 is now the most recently used: 2 goes first
    cache.get(3)
    stats = cache.stats()
    assert stats.bytes_held <= 100 and stats.evictions == 1
    assert cache.contains(1) and cache.contains(3) and not cache.contains(2)
    assert (stats.hits, stats.misses) == (1, 3)
    cache.get(2)
    assert calls == [1, 2, 3, 2]


def test_a_value_larger_than_the_capacity_is_returned_not_kept():
    cache = DecodedCache(10, loader_of({1: 11}, []))
    assert len(cache.get(1)) == 11
    assert not cache.contains(1) and cache.stats().bytes_held == 0


def test_peek_never_loads():
    calls: list[int] = []
    cache = DecodedCache(100, loader_of({1: 5}, calls))
    assert cache.peek(1) is None and calls == []
    cache.get(1)
    assert cache.peek(1) == b"\x01" * 5 and cache.stats().hits == 1


def test_put_keeps_a_value_loaded_elsewhere_once_and_within_the_bound():
    """A value an event loop fetched and decoded itself joins the cache as a load would; putting a key held
    already, or being loaded, changes nothing, so the bytes held stay the values' own."""
    release = threading.Event()

    def held_load(key: int) -> bytes:
        release.wait(timeout=60)
        return b"l" * 30

    cache = DecodedCache(100, held_load)
    cache.put(1, b"p" * 40)
    cache.put(1, b"q" * 40)
    assert cache.get(1) == b"p" * 40 and cache.stats().bytes_held == 40
    loading = threading.Thread(target=cache.get, args=(2,))
    loading.start()
    wait_until(lambda: cache.contains(2), "the load of key 2 under way")
    cache.put(2, b"p" * 30)  # the load under way keeps its own value
    release.set()
    loading.join()
    assert cache.peek(2) == b"l" * 30 and cache.stats().bytes_held == 70
    cache.put(3, b"p" * 50)  # past the bound: the least recently used goes
    stats = cache.stats()
    assert stats.bytes_held <= 100 and stats.evictions == 1 and cache.peek(3) == b"p" * 50


def test_concurrent_gets_share_one_load():
    """The loader is held until the seven other threads are known to wait for it: no timing assumption."""
    calls: list[int] = []
    release = threading.Event()

    def held_load(key: int) -> bytes:
        calls.append(key)
        release.wait(timeout=60)
        return b"x" * 10

    cache = DecodedCache(100, held_load)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(7))) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: cache.stats().waits == 7, "seven threads waiting for one load")
    release.set()
    for thread in threads:
        thread.join()
    assert calls == [7] and results == [b"x" * 10] * 8
    assert (cache.stats().misses, cache.stats().waits) == (1, 7)


def test_a_failed_load_reaches_every_waiter_and_is_not_cached():
    attempts: list[int] = []
    release = threading.Event()

    def failing(key: int) -> bytes:
        attempts.append(key)
        release.wait(timeout=60)
        raise OSError("corrupt")

    cache = DecodedCache(100, failing)
    errors: list[BaseException] = []

    def get() -> None:
        try:
            cache.get(3)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: cache.stats().waits == 3, "three threads waiting for the failing load")
    release.set()
    for thread in threads:
        thread.join()
    assert len(errors) == 4 and attempts == [3]
    with pytest.raises(OSError):
        cache.get(3)  # tried again, not remembered as a value
    assert attempts == [3, 3] and not cache.contains(3)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        DecodedCache(-1, lambda key: b"")
