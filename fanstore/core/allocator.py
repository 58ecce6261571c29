"""glibc's malloc, tuned for what a process does all day: one owner of these process-wide settings.

A process that decodes all day (the mount daemon, a serve rank, a DataLoader worker) keeps the memory it frees for
its next buffers; a process that runs one pack gives what it frees back, so each step's peak does not stand on the
last one's. Each is called once by the process it suits; where glibc is not the allocator, each does nothing.
"""

from __future__ import annotations

from .libc import libc_function

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's parameter numbers (malloc.h)
_MAPPED_APART_FROM = 128 << 10  # glibc's own starting mmap threshold


def keep_freed_memory(largest_block: int = 32 << 20) -> bool:
    """Have glibc keep freed decode buffers (blocks up to `largest_block`) for reuse instead of handing them back.

    By default glibc maps large blocks afresh and unmaps them on free, and gives the top of its heap back to the
    kernel, so each decode page-faults its output buffers in again: lz4 into 2 MiB took 2.0 ms that way, 0.5 ms
    with this. The daemon decodes all day, so it keeps that memory. One arena for all threads: with one per decode
    thread, each kept its own freed buffers, and over three epochs of 1 MiB files with a 4 MiB cache the daemon's
    RSS grew 13.8-17.0 MB instead of 7.6-8.6 MB. False where glibc is not the allocator.
    """
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    return (bool(mallopt(_M_ARENA_MAX, 1)) and bool(mallopt(_M_MMAP_THRESHOLD, largest_block))
            and bool(mallopt(_M_TRIM_THRESHOLD, 4 * largest_block)))


def map_large_blocks_apart() -> None:
    """Blocks of 128 KiB and more mapped on their own, and so returned when freed, for the rest of the process (the
    dynamic threshold off). glibc raises its mmap threshold each time a large block is freed, so a pack's many
    mid-sized arrays (the walk's columns, a chunk record's growing columns, a slice's temporaries) would come from
    the heap, which keeps what they free: about 100 MiB at 10^6 members. For a process that runs one pack (the
    `fanstore pack` command)."""
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MAPPED_APART_FROM)


def give_back_free_heap() -> None:
    """The heap's free pages back to the system (malloc_trim): between a pack's steps, where a library call cannot
    change the whole process's threshold."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)

