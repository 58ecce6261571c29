"""The C library's calls Python does not offer (prctl, mallopt, malloc_trim), looked up one way: None where the
library lacks one (not Linux, not glibc), so that each caller does without what is only a tuning."""

from __future__ import annotations

import ctypes
import functools
from typing import Any


@functools.cache
def libc_function(name: str) -> Any | None:
    """The C library's function `name`, or None; looked up once a process (a thread per node-socket connection names
    itself: loading the library each time was a tenth of that thread's CPU)."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def prctl(option: int, value: int | bytes) -> bool:
    """prctl(option, value, 0, 0, 0) for the calling thread or process; False where it is missing or refused."""
    call = libc_function("prctl")
    return call is not None and call(option, value, 0, 0, 0) == 0
