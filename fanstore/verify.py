"""`fanstore verify`: read, checksum and decode every blob, and list the files that fail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .api import Dataset
from .errors import ChunkError


@dataclass(slots=True)
class VerifyReport:
    files_checked: int = 0
    raw_bytes: int = 0
    bad: list[ChunkError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify_dataset(ds: Dataset, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every file in storage order (sequential chunk reads); a bad blob is listed, not fatal."""
    report = VerifyReport()
    for entry in ds.index.iter_files():
        try:
            data = ds.reader.read(entry)
            report.raw_bytes += len(data)
        except ChunkError as exc:
            report.bad.append(exc)
        report.files_checked += 1
        if progress is not None:
            progress(report.files_checked)
    return report
