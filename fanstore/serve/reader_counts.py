"""What a node's reader reads without its serve process (this rank's staged chunks, DEST), told to that process for
`fanstore serve --stats`: a fanstore.torch worker reads its local blobs itself, and the rank's counters, which only
see what passes through the serve process, said 0 local reads for a job that read half its files locally.

A reader counts in its own memory and tells the serve process (COUNTS) at most once every REPORT_SECONDS, when it
closes, and when its process ends (a DataLoader worker ends through multiprocessing, which runs this at exit). A
process killed outright loses what it read since its last report: at most REPORT_SECONDS of reads.
"""

from __future__ import annotations

import multiprocessing.util
import os
import threading
import time
import weakref
from typing import Callable

from ..errors import ChunkError
from .node_protocol import COUNTS, OK, READ_COUNTS

REPORT_SECONDS = 1.0
LOCAL, DEST = 0, 2  # where a count goes: local blobs then bytes, DEST blobs then bytes (READ_COUNTS' order)


class ReaderCounts:
    """One reader's counts since its last report. `ask(kind, length, payload)` sends a request on the reader's
    connection and returns its status; `damaged()` is how many local reads the staged copy answered from DEST (its
    copy was damaged), which are DEST reads, not local ones."""

    def __init__(self, ask: Callable[[int, int, bytes], int], damaged: Callable[[], tuple[int, int]]) -> None:
        self._ask = ask
        self._damaged = damaged
        self._lock = threading.Lock()
        self._counts = [0, 0, 0, 0]
        self._damaged_told = (0, 0)
        self._report_at = time.monotonic() + REPORT_SECONDS
        self._pid = os.getpid()
        # At the end of the process: multiprocessing's exit runs it in its children (DataLoader workers, which end
        # with os._exit, past atexit) and in the main process alike. A weak reference to the owner: it goes with it.
        self._owner: weakref.ref | None = None

    def report_at_exit(self, owner: object) -> None:
        """Report what is left when `owner` is collected or its process ends, whichever comes first (in a forked
        child too, which multiprocessing starts with no finalizer of its parent's)."""
        self._owner = weakref.ref(owner)
        multiprocessing.util.Finalize(owner, self.report, exitpriority=10)

    def count(self, where: int, length: int) -> None:
        """One blob of `length` bytes read from `where` (LOCAL or DEST); reported once REPORT_SECONDS have passed."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's counts are its parent's to report
                self._forked()
            counts = self._counts
            counts[where] += 1
            counts[where + 1] += length
            due = time.monotonic() >= self._report_at
        if due:
            self.report()

    def report(self) -> None:
        """Tell the serve process what was read since the last report; kept for the next one if it cannot be told."""
        with self._lock:
            if self._pid != os.getpid():
                self._forked()
            damaged = self._damaged()
            local, local_bytes, dest, dest_bytes = self._counts
            new, new_bytes = damaged[0] - self._damaged_told[0], damaged[1] - self._damaged_told[1]
            counts = (local - new, local_bytes - new_bytes, dest + new, dest_bytes + new_bytes)
            self._counts = [0, 0, 0, 0]
            self._damaged_told = damaged
            self._report_at = time.monotonic() + REPORT_SECONDS
        if not any(counts):
            return
        try:
            told = self._ask(COUNTS, READ_COUNTS.size, READ_COUNTS.pack(*(max(0, c) for c in counts))) == OK
        except ChunkError:
            told = False
        if not told:  # the serve process is gone or busy: the counts wait for the next report
            with self._lock:
                self._counts = [mine + kept for mine, kept in zip(self._counts, counts)]

    def _forked(self) -> None:
        self._pid = os.getpid()
        self._counts = [0, 0, 0, 0]
        self._damaged_told = self._damaged()
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            multiprocessing.util.Finalize(owner, self.report, exitpriority=10)
