"""Which files the kernel's page cache holds whole, as far as the mount can tell.

With keep_cache, a file the mount has sent whole stays in the kernel's page cache, and its later reads never reach
the mount: decoding or fetching it ahead again would be wasted work. But the kernel drops pages when memory is short
and does not say so. A dataset larger than the page cache is dropped as an epoch goes on, so trusting a flag set
once per file would keep every later epoch from prefetching at all.

What the mount does see is each open. A file sent whole and opened again either is read from its start (the kernel
dropped it) or is released unread (the kernel held it). The recent share of the second kind says how far the flags
can be trusted: while most such files turn out dropped, files are fetched and decoded ahead as if never sent. A
wrong guess costs a file decoded ahead that the kernel held, or one read not prefetched; never a wrong byte.
"""

from __future__ import annotations

__all__ = ["KernelHolds"]

# Weight of one open's outcome in the trust: after a change (the page cache fills up, or memory frees), about 11
# opens of sent files tip it past one half.
_LEARN = 1 / 16


class KernelHolds:
    """Per file: whether the kernel holds it whole. Kept on the mount's event loop; read by prefetch threads too
    (a stale answer costs one decode, never a wrong byte)."""

    __slots__ = ("_sent", "_opened", "_trust")

    def __init__(self, count: int) -> None:
        self._sent = bytearray(count)  # sent whole, and not asked for again since
        self._opened: set[int] = set()  # sent files opened again, until read or released
        self._trust = 1.0  # recent share of those opens that the kernel answered itself

    def holds(self, entry: int) -> bool:
        return bool(self._sent[entry]) and self._trust >= 0.5

    def sent_whole(self, entry: int) -> None:
        """Every byte of `entry` went out with keep_cache: the kernel holds it now."""
        self._sent[entry] = 1

    def opened(self, entry: int) -> None:
        if self._sent[entry]:
            self._opened.add(entry)

    def read_from_start(self, entry: int) -> None:
        """The kernel asks for the start of `entry`, so it does not hold it (any more)."""
        if self._sent[entry]:
            self._sent[entry] = 0
            if entry in self._opened:
                self._opened.discard(entry)
                self._trust -= self._trust * _LEARN

    def released(self, entry: int) -> None:
        if entry in self._opened:  # opened after being sent, and closed with no read: the kernel answered it
            self._opened.discard(entry)
            self._trust += (1.0 - self._trust) * _LEARN

    @property
    def trust(self) -> float:
        """The recent share of sent files, opened again, that the kernel still held (for the mount's counters)."""
        return self._trust
