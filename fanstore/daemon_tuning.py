"""How the mount daemon process is tuned for many small requests: pyfuse3's session loop and glibc's malloc.

Both change process-wide behaviour, so only the daemon (`fanstore mount`, bench/ram_fs.py) calls them, once,
before it serves. Each returns False and changes nothing where its hook is missing.
"""

from __future__ import annotations

import ctypes
import select
import types


def keep_freed_memory(largest_block: int = 32 << 20) -> bool:
    """Have glibc keep freed decode buffers (blocks up to `largest_block`) for reuse instead of handing them back.

    By default glibc maps large blocks afresh and unmaps them on free, and gives the top of its heap back to the
    kernel, so each decode page-faults its output buffers in again: lz4 into 2 MiB took 2.0 ms that way, 0.5 ms
    with this. The daemon decodes all day, so it keeps that memory. False where glibc is not the allocator.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, largest_block)) and bool(mallopt(m_trim_threshold, 4 * largest_block))


def install_fast_session_loop(yield_every: int = 16) -> bool:
    """Let pyfuse3 take a request that is already waiting without a trip through trio's scheduler.

    For every request pyfuse3's loop takes a trio.Lock and then waits in trio.lowlevel.wait_readable; each yields
    to the scheduler, which polls epoll, even when the next request is queued already. pyfuse3 reaches trio
    through its module attribute `pyfuse3.trio` (pyfuse3.asyncio swaps it the same way). This gives it a trio
    whose lock takes a free lock without yielding and whose wait_readable returns at once when a zero-timeout
    poll finds a request; every `yield_every` requests in a row it waits the ordinary way, so other tasks
    (signals, decode threads handing results back) still run. Nothing can read the request between the poll and
    pyfuse3's read of it: the loop is one thread and does not yield in between. False if pyfuse3 has no such hook.
    """
    import pyfuse3
    import trio

    if getattr(pyfuse3, "trio", None) is not trio:
        return False
    poller = select.poll()
    polled_fds: set[int] = set()
    in_a_row = [0]

    class FreeLockWithoutYield:
        def __init__(self) -> None:
            self._lock = trio.Lock()

        async def __aenter__(self) -> None:
            try:
                self._lock.acquire_nowait()
            except trio.WouldBlock:
                await self._lock.acquire()

        async def __aexit__(self, *exc_info: object) -> None:
            self._lock.release()

    async def wait_readable(fd: int) -> None:
        if fd not in polled_fds:
            poller.register(fd, select.POLLIN)
            polled_fds.add(fd)
        if in_a_row[0] < yield_every and poller.poll(0):
            in_a_row[0] += 1
            return
        in_a_row[0] = 0
        await trio.lowlevel.wait_readable(fd)

    lowlevel = types.ModuleType("fanstore_trio_lowlevel")
    lowlevel.__getattr__ = lambda name: getattr(trio.lowlevel, name)  # type: ignore[method-assign]
    lowlevel.wait_readable = wait_readable  # type: ignore[attr-defined]
    fast_trio = types.ModuleType("fanstore_trio")
    fast_trio.__getattr__ = lambda name: getattr(trio, name)  # type: ignore[method-assign]
    fast_trio.Lock = FreeLockWithoutYield  # type: ignore[attr-defined]
    fast_trio.lowlevel = lowlevel  # type: ignore[attr-defined]
    pyfuse3.trio = fast_trio  # type: ignore[attr-defined]
    return True
