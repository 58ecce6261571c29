"""Places compressed blobs into chunk files in plan order and journals each chunk once it is safely on disk.

chunk_writer.py writes one chunk file; this decides which chunk each blob goes to: the open chunk, unless the
blob would take it past the chunk size or belongs to another group. A file stored in blocks may span chunks: a
chunk can close between two of its blocks, so a journaled position is a (file, block) pair, and a resumed pack
continues from inside the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import xxhash

from .batches import BlockLayout
from .blob_compressor import WHOLE_FILE, Skipped
from .codec_plan import NONE_ROW
from .compress import CompressedBatch
from .chunk_writer import ChunkWriter
from ..core.format import FLAG_BLOCKED, NO_CHUNK
from .journal import BlockRow, ChunkRecord, FileRows, PackJournal
from ..core.pause import pause_point
from .entry_columns import EntryColumns
from .walk import Problem

_EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")


class _BlockedFile:
    """The file stored in blocks whose blocks are being placed: where its first block went, its stored bytes."""

    __slots__ = ("number", "first_chunk", "codec", "stored")

    def __init__(self, number: int, first_chunk: int, codec: int) -> None:
        self.number, self.first_chunk, self.codec, self.stored = number, first_chunk, codec, 0


class ChunkBuilder:
    """Feeds batches of blobs into chunk files; `files_done`, `raw_done`, `stored_done` and `problems` say how
    far it got, `chunk_bytes()` what its chunk files take."""

    def __init__(self, dest: Path, journal: PackJournal, chunk_size: int, files: EntryColumns,
                 file_groups: Sequence[int], layout: BlockLayout, finished: list[ChunkRecord]) -> None:
        self.dest = dest
        self.journal = journal
        self.chunk_size = chunk_size
        self.files = files
        self.file_groups = file_groups
        self.layout = layout
        self.records = list(finished)
        self.next_chunk = len(finished)
        last = finished[-1] if finished else None
        # The open chunk's first plan position; plan files before next_number are accounted for.
        self.first_file, self.first_block = (last.end_file, last.end_block) if last else (0, 0)
        self.next_number = self.first_file
        self.writer: ChunkWriter | None = None
        self.rows = FileRows(files.paths)  # a row names its file by plan number
        self.blocks: list[BlockRow] = []
        self.problems: list[Problem] = []
        self.files_done = sum(len(r.files) for r in finished)
        self.raw_done = sum(int(r.files.column("size").sum()) for r in finished)
        self.stored_done = sum(int(r.files.column("stored_len").sum()) for r in finished)
        self.skipped: list[Problem] = [problem for r in finished for problem in r.problems]
        self._closed_bytes: dict[int, int] = {}  # group -> bytes of its closed chunk files, headers included
        for record in finished:
            if record.chunk_id != NO_CHUNK:
                self._closed_bytes[record.group] = self._closed_bytes.get(record.group, 0) + record.size
        self._skipped_blocked: set[int] = set()  # files in blocks that were skipped after some blocks went out
        self._blocked: _BlockedFile | None = None
        # Where compressing resumes: after the journaled chunks, inside a file in blocks, or past it if that file
        # was skipped part way.
        self.resume_from = (self.first_file, self.first_block)
        if self.first_block:
            path = files[self.first_file].path
            if any(problem.path == path for problem in self.skipped):
                self._skipped_blocked.add(self.first_file)
                self.next_number = self.first_file + 1
                self.resume_from = (self.first_file + 1, 0)
            else:
                self._blocked = self._resume_blocked_file(finished)

    def _resume_blocked_file(self, finished: list[ChunkRecord]) -> _BlockedFile:
        """The file a resumed pack continues inside of: its first block's chunk and stored bytes so far."""
        number = self.first_file
        placed = [(r.chunk_id, row) for r in finished for row in r.blocks if row.file == number]
        first_chunk, first_row = placed[0]
        blocked = _BlockedFile(number, first_chunk, first_row.codec)
        blocked.stored = sum(row.stored_len for _, row in placed)
        return blocked

    def add_batch(self, batch: CompressedBatch) -> None:
        """Record a batch's files and blocks and append their blobs, copying each run of blobs bound for one
        chunk at once (they lie back to back in `batch.blobs`)."""
        files, file_groups = self.files, self.file_groups
        run_start = run_end = 0  # blobs[run_start:run_end] belong to the open chunk but are not appended yet
        for result in batch.results:
            if type(result) is not tuple:
                self._append_run(batch.blobs[run_start:run_end])
                run_start = run_end
                self._skip(result)  # type: ignore[arg-type]
                continue
            number, block, blob_offset, stored_len, codec, checksum, raw_size = result
            if number in self._skipped_blocked:  # a later batch of a file already skipped: drop its blobs
                self._append_run(batch.blobs[run_start:run_end])
                run_start = run_end = blob_offset + stored_len
                continue
            if number != self.next_number:
                self._account_empty_files(number)
            writer = self.writer
            group = int(file_groups[number])
            pending = run_end - run_start
            overflows = writer is not None and writer.size + pending + stored_len > self.chunk_size
            if writer is not None and (writer.group != group or overflows):
                self._append_run(batch.blobs[run_start:run_end])
                self._close_chunk(number, max(block, 0))
                writer, pending = None, 0
            if writer is None:
                writer = self.writer = ChunkWriter(self.dest, self.next_chunk, group)
            if pending == 0:
                run_start = run_end = blob_offset
            offset = writer.size + pending
            run_end += stored_len
            self.raw_done += raw_size
            self.stored_done += stored_len
            entry = files[number]
            if block == WHOLE_FILE:
                self.rows.append(number, raw_size, entry.mtime_ns, entry.mode, writer.chunk_id, offset,
                                 stored_len, codec, checksum, 0)
                self._file_done(number)
                continue
            self.blocks.append(BlockRow(number, block, offset, stored_len, codec, checksum))
            if block == 0:
                self._blocked = _BlockedFile(number, writer.chunk_id, codec)
            blocked = self._blocked
            if blocked is None or blocked.number != number:
                raise RuntimeError(f"block {block} of plan file {number} arrived out of order")
            blocked.stored += stored_len
            if block == self.layout.blocks_of(entry.size) - 1:
                # offset: the file's first row in the blocks section, known once the index orders the files
                self.rows.append(number, entry.size, entry.mtime_ns, entry.mode, blocked.first_chunk, 0,
                                 blocked.stored, blocked.codec, 0, FLAG_BLOCKED)
                self._blocked = None
                self._file_done(number)
        self._append_run(batch.blobs[run_start:run_end])

    def _file_done(self, number: int) -> None:
        self.next_number = number + 1
        self.files_done += 1

    def _account_empty_files(self, upto: int) -> None:
        """Empty files have no blob and no task; they are recorded where the plan passes them."""
        while self.next_number < upto:
            entry = self.files[self.next_number]
            if entry.size == 0:
                self.rows.append(self.next_number, 0, entry.mtime_ns, entry.mode, NO_CHUNK, 0, 0, NONE_ROW,
                                 _EMPTY_CHECKSUM, 0)
                self.files_done += 1
            self.next_number += 1

    def _append_run(self, blobs: memoryview) -> None:
        if len(blobs):
            if self.writer is None:
                raise RuntimeError("blobs to append but no chunk is open")
            self.writer.append(blobs)

    def _skip(self, skipped: Skipped) -> None:
        number = skipped.number
        if number in self._skipped_blocked:
            return  # another batch of the same file found the same change
        self._account_empty_files(number)
        self.problems.append(skipped.problem)
        self.skipped.append(skipped.problem)
        if self.layout.blocks_of(self.files[number].size):
            # Its blocks already written stay in their chunks, unreferenced; the rest are dropped as they come.
            self._skipped_blocked.add(number)
            self.blocks = [row for row in self.blocks if row.file != number]
            self._blocked = None
        self.next_number = number + 1

    def _close_chunk(self, end_file: int, end_block: int) -> None:
        if self.writer is None:
            raise RuntimeError("no chunk is open")
        size = self.writer.finish()
        self._closed_bytes[self.writer.group] = self._closed_bytes.get(self.writer.group, 0) + size
        record = ChunkRecord(self.writer.chunk_id, self.writer.group, size, self.first_file, end_file,
                             self.first_block, end_block, self.rows, self.blocks, self.problems)
        self.journal.record_chunk(record)
        self.records.append(record)
        self.writer = None
        self.next_chunk += 1
        pause_point(f"chunk:{self.next_chunk}")
        self.first_file, self.first_block = end_file, end_block
        self.rows, self.blocks, self.problems = FileRows(self.files.paths), [], []

    def chunk_bytes(self) -> dict[int, int]:
        """Per group, the bytes of its chunk files so far, headers included: the closed ones and the open one (every
        blob of the batches added is in it: the running total a --fit pack watches)."""
        by_group = dict(self._closed_bytes)
        if self.writer is not None:
            by_group[self.writer.group] = by_group.get(self.writer.group, 0) + self.writer.size
        return by_group

    def close_all(self) -> list[ChunkRecord]:
        """Finish the last chunk; trailing empty files and skips go in a record with no chunk file."""
        self._account_empty_files(len(self.files))
        if self.writer is not None:
            self._close_chunk(len(self.files), 0)
        if len(self.rows) or self.problems:
            self.records.append(ChunkRecord(NO_CHUNK, 0, 0, self.first_file, len(self.files), self.first_block, 0,
                                            self.rows, [], self.problems))
            self.rows, self.problems = FileRows(self.files.paths), []
        return self.records

    def let_go(self) -> None:
        """After close_all: drop the plan's files, and this builder's hold on the records (a row a file), so that
        they go once their caller has placed them in the index."""
        self.files, self.file_groups, self.records = EntryColumns.of(()), [], []
        self.rows = FileRows()  # the open rows' planned paths would keep the plan's path column

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
