"""MountOptions: what `fanstore mount` (and each rank of `fanstore serve`) is asked to do, each option's default,
check and help written here once. Light on purpose: the command line reads it to build its parser, and must not
load FUSE or trio to do so."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..core.options import option
from ..core.units import parse_size, size_option
from ..errors import UsageError

# FUSE mounts get the kernel's default read-ahead, 128 KiB: a 2 MiB file then costs 16 read requests. At 1 MiB
# (the most one FUSE read request carries) it costs 2.
READ_AHEAD_KIB = 1024
# A blob this small decodes (tens of microseconds) faster than a hand-off to a thread and back wakes the loop, so
# it is decoded on the event loop itself; larger ones go to the decode threads, where they overlap. Nor is it
# prefetched, by default (--prefetch-min-size).
INLINE_DECODE_BYTES = 256 * 1024


def _path(text: str, flag: str) -> Path | None:
    return Path(text) if text else None


def _size_or_zero(text: str, flag: str) -> int:
    return parse_size(text, flag, minimum=0)


def _prefetch_min_size(size: int | None) -> str:
    return size_option(INLINE_DECODE_BYTES if size is None else size)


@dataclass(frozen=True, slots=True)
class MountOptions:
    cache_size: int | None = option(  # bytes; None: a fraction of what the job may still use (mount.cache_bound)
        None, flag="--cache-size", metavar="SIZE", parse=parse_size,
        help="memory for decoded files, e.g. 4GiB (default: a quarter of what the job may still use: available RAM, "
             "or less where its memory cgroup's limit leaves less)")
    prefetch: int = option(  # files decoded ahead of the reader; 0 turns prefetch off
        8, flag="--prefetch", metavar="N", type=int,
        help="after each file opened, decode ahead those of the next N files (in --prefetch-list order, else "
             "directory order) stored in at least --prefetch-min-size bytes (default {default}; 0: off)")
    prefetch_list: Path | None = option(
        None, flag="--prefetch-list", metavar="FILE", parse=_path,
        help="epoch order to prefetch in: one file's path a line, in the dataset or through MOUNTPOINT, taken "
             "exactly (spaces too); or split by NUL bytes, as find -print0 writes it, for names holding a newline")
    prefetch_threads: int = option(  # 0: one per core
        0, flag="--prefetch-threads", metavar="K", type=int,
        help="threads decoding ahead (default {default}: one per core)")
    prefetch_min_size: int | None = option(  # bytes stored; None: INLINE_DECODE_BYTES
        None, flag="--prefetch-min-size", metavar="SIZE", parse=_size_or_zero, show=_prefetch_min_size,
        help="prefetch only files stored in at least SIZE bytes (default {default}: smaller ones decode on request "
             "faster than a thread is handed them)")
    decode_threads: int = 0  # 0: two per core
    allow_other: bool = option(False, flag="--allow-other", help="let other users read the mount")
    keep_cache: bool = option(True, flag="--no-keep-cache",
                              help="drop the kernel page cache on every open (for benchmarks)")
    kernel_timeout: float | None = option(  # seconds; None: the default long timeout (fuse_ops.KERNEL_CACHE_TIMEOUT)
        None, flag="--kernel-timeout", metavar="SECONDS", type=float,
        help="entry and attribute timeout (default one day; for benchmarks)")
    read_ahead_kib: int = READ_AHEAD_KIB  # set when the mount may (root); 0 leaves the kernel default
    fast_session_loop: bool = True  # see daemon_tuning.install_fast_session_loop

    def __post_init__(self) -> None:
        """The one check of these values, whoever builds them (the CLI, or Python): the option at fault is named."""
        if self.cache_size is not None and self.cache_size < 1:
            raise UsageError(f"--cache-size: must be 1 byte or more, got {self.cache_size}")
        if self.prefetch < 0:
            raise UsageError(f"--prefetch: must be 0 or more files, got {self.prefetch}")
        for option_name, value in (("--prefetch-threads", self.prefetch_threads),
                                   ("MountOptions.decode_threads", self.decode_threads),
                                   ("MountOptions.read_ahead_kib", self.read_ahead_kib)):
            if value < 0:
                raise UsageError(f"{option_name}: must be 0 or more, got {value}")
        if self.prefetch_min_size is not None and self.prefetch_min_size < 0:
            raise UsageError(f"--prefetch-min-size: must be 0 bytes or more, got {self.prefetch_min_size}")
        if self.kernel_timeout is not None and not 0 <= self.kernel_timeout < math.inf:  # nan fails both
            raise UsageError(f"--kernel-timeout: must be a finite number of seconds, 0 or more, got "
                             f"{self.kernel_timeout}")
