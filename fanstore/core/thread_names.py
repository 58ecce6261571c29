"""fanstore's long-lived threads named in the kernel too, not only in Python (which names threads only for itself
before 3.14): `top -H`, `ps -L` and /proc/PID/task/TID/comm then tell a serve rank's MPI thread from its FUSE loop
and its fetcher, and bench_serve reports each thread's CPU per file by that name."""

from __future__ import annotations

import threading

from .libc import prctl

_PR_SET_NAME = 15  # prctl's option number (linux/prctl.h)
_KERNEL_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL
_PREFIX = "fanstore-"  # every such thread's Python name starts so; the kernel's 15 bytes are kept for the rest


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (by default its Python name), less the 'fanstore-' prefix and cut to 15
    bytes, as its kernel name. Does nothing where prctl is not there (not Linux): a name is a convenience."""
    text = (threading.current_thread().name if name is None else name).removeprefix(_PREFIX)
    prctl(_PR_SET_NAME, text.encode()[:_KERNEL_NAME_BYTES])
