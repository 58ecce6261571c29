"""Keep a pack's freed memory from staying in the heap.

glibc raises its mmap threshold each time a large block is freed, so that the pack's many mid-sized arrays (the
walk's columns, a chunk record's growing columns, a slice's temporaries) come from the heap, which keeps what they
free: at 10^6 members about 100 MiB, which each next step's peak then stood on. The `fanstore pack` command fixes
the threshold for its process; a pack run as a library call only trims the heap between its steps (the threshold
is the whole process's). Where glibc is not, both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MAPPED_APART_FROM = 128 << 10  # glibc's own starting threshold


def give_back_free_heap() -> None:
    """The heap's free pages back to the system (malloc_trim)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def map_large_blocks_apart() -> None:
    """Blocks of 128 KiB and more mapped on their own, and so returned when freed, for the rest of the process
    (the dynamic threshold off): for a process that runs one pack, the `fanstore pack` command."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MAPPED_APART_FROM)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None or "libc" not in name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None
