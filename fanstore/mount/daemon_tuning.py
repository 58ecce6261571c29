"""How the mount daemon process is tuned for many small requests: pyfuse3's session loop (its malloc setting is
core/allocator.py's, which the other decoding processes share).

It changes process-wide behaviour, so only the daemon (`fanstore mount`, bench/ram_fs.py) calls it, once, before
it serves. It returns False and changes nothing where its hook is missing.
"""

from __future__ import annotations

import select
import types
from typing import Awaitable, Callable


def install_fast_session_loop(yield_every: int = 16) -> bool:
    """Let pyfuse3 take a request that is already waiting without a trip through trio's scheduler.

    For every request pyfuse3's loop takes a trio.Lock and then waits in trio.lowlevel.wait_readable; each yields
    to the scheduler, which polls epoll, even when the next request is queued already. pyfuse3 reaches trio
    through its module attribute `pyfuse3.trio` (pyfuse3.asyncio swaps it the same way). This gives it a trio
    whose lock is taken without yielding when free and is not handed over on release (see BargingLock), and
    whose wait_readable returns at once when a zero-timeout
    poll finds a request; every `yield_every` requests in a row it waits the ordinary way, so other tasks
    (signals, decode threads handing results back) still run. Nothing can read the request between the poll and
    pyfuse3's read of it: the loop is one thread and does not yield in between. False if pyfuse3 has no such hook.
    """
    import pyfuse3
    import trio

    if getattr(pyfuse3, "trio", None) is not trio:
        return False
    fast_trio = _trio_with(trio, _barging_lock_class(trio), _polling_wait_readable(trio, yield_every))
    pyfuse3.trio = fast_trio  # type: ignore[attr-defined]
    return True


def _barging_lock_class(trio: types.ModuleType) -> type:
    """The BargingLock class over the `trio` given (imported only once a mount is about to serve)."""

    class BargingLock:
        """pyfuse3's read lock, taken without yielding when free, and not handed to a waiting task on release.

        trio.Lock is fair: releasing it hands it to the task parked on it. pyfuse3 releases the lock as soon as a
        request is readable and, when its handler does not await, comes straight back for it: with a fair lock
        every request then parks the serving task and wakes the other. Here the lock is only marked free and
        one waiter is woken; the task coming back takes it first, and the woken one parks again when it runs.
        When a handler does await (a decode thread), the woken task takes the lock and serves the next request.
        """

        def __init__(self) -> None:
            self._held = False
            self._waiters = trio.lowlevel.ParkingLot()

        async def __aenter__(self) -> None:
            while self._held:
                await self._waiters.park()
            self._held = True

        async def __aexit__(self, *exc_info: object) -> None:
            self._held = False
            self._waiters.unpark()

    return BargingLock


def _polling_wait_readable(trio: types.ModuleType, yield_every: int) -> Callable[[int], Awaitable[None]]:
    """trio.lowlevel.wait_readable, but returning at once when a zero-timeout poll finds the descriptor readable,
    `yield_every` times in a row at most."""
    poller = select.poll()
    polled_fds: set[int] = set()
    in_a_row = [0]

    async def wait_readable(fd: int) -> None:
        if fd not in polled_fds:
            poller.register(fd, select.POLLIN)
            polled_fds.add(fd)
        if in_a_row[0] < yield_every and poller.poll(0):
            in_a_row[0] += 1
            return
        in_a_row[0] = 0
        await trio.lowlevel.wait_readable(fd)

    return wait_readable


def _trio_with(trio: types.ModuleType, lock: type, wait_readable: Callable[[int], Awaitable[None]]) -> types.ModuleType:
    """A stand-in for the trio module as pyfuse3 uses it: trio's own names, but for Lock and
    lowlevel.wait_readable."""
    lowlevel = types.ModuleType("fanstore_trio_lowlevel")
    lowlevel.__getattr__ = lambda name: getattr(trio.lowlevel, name)  # type: ignore[method-assign]
    lowlevel.wait_readable = wait_readable  # type: ignore[attr-defined]
    fast_trio = types.ModuleType("fanstore_trio")
    fast_trio.__getattr__ = lambda name: getattr(trio, name)  # type: ignore[method-assign]
    fast_trio.Lock = lock  # type: ignore[attr-defined]
    fast_trio.lowlevel = lowlevel  # type: ignore[attr-defined]
    return fast_trio
