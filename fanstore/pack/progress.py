"""How far a pack has got, for the person who waits: a PackProgress handed to the pack's progress callback every
PROGRESS_INTERVAL while it compresses, and once at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .chunk_builder import ChunkBuilder

PROGRESS_INTERVAL = 0.1  # seconds between progress callbacks: once per file costs more than packing a small file


@dataclass(frozen=True, slots=True)
class PackProgress:
    """How far a pack has got, handed to the progress callback every PROGRESS_INTERVAL and at the end."""

    files_done: int
    files_total: int
    raw_done: int
    raw_total: int
    stored_done: int


class ProgressReport:
    """Hands the progress callback how far the pack has got: every PROGRESS_INTERVAL, and at the end."""

    def __init__(self, progress: Callable[[PackProgress], None] | None, builder: ChunkBuilder, files_total: int,
                 raw_total: int) -> None:
        self._progress, self._builder = progress, builder
        self._files_total, self._raw_total = files_total, raw_total
        self._next = 0.0

    def now(self) -> None:
        if self._progress is not None:
            builder = self._builder
            self._progress(PackProgress(builder.files_done + len(builder.skipped), self._files_total,
                                        builder.raw_done, self._raw_total, builder.stored_done))

    def every_interval(self) -> None:
        if time.monotonic() >= self._next:
            self.now()
            self._next = time.monotonic() + PROGRESS_INTERVAL
