"""`fanstore verify`: read, checksum and decode every blob, and list the files and chunks that fail, and the paths the
index lists but cannot find."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .api import Dataset
from ..errors import ChunkError


@dataclass(slots=True)
class VerifyReport:
    files_checked: int = 0
    raw_bytes: int = 0
    bad: list[ChunkError] = field(default_factory=list)  # one per file that fails, naming it
    bad_chunks: dict[int, ChunkError] = field(default_factory=dict)  # chunk files that cannot serve at all
    unfindable: list[str] = field(default_factory=list)  # paths the index lists but its lookups miss

    @property
    def ok(self) -> bool:
        return not self.bad and not self.bad_chunks and not self.unfindable


def chunk_problems(ds: Dataset) -> dict[int, ChunkError]:
    """The chunk files of a local dataset that are missing, unreadable or not what the index says; checks each
    file's type, header and size only, so it costs one open per chunk (empty for sources that are not local)."""
    check = getattr(ds.reader.source, "check", None)
    if check is None:
        return {}
    problems = {chunk: check(chunk) for chunk in range(len(ds.index.chunks))}
    return {chunk: problem for chunk, problem in problems.items() if problem is not None}


def verify_dataset(ds: Dataset, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every file in storage order (sequential chunk reads), a block at a time for files stored in blocks
    (memory stays a block's whatever the file's size); a bad blob is listed, not fatal."""
    report = VerifyReport(bad_chunks=chunk_problems(ds),
                          unfindable=[ds.index.path_of(entry) for entry in ds.index.unfindable().tolist()])
    reader = ds.reader
    for entry in ds.index.iter_files():
        try:
            blocks = ds.index.block_count(entry)
            if blocks:
                report.raw_bytes += sum(len(reader.read_block(entry, block)) for block in range(blocks))
            else:
                report.raw_bytes += len(reader.read(entry))
        except ChunkError as exc:
            report.bad.append(exc)
        report.files_checked += 1
        if progress is not None:
            progress(report.files_checked)
    return report
