"""Writes one chunk file. It appears under its final name only once complete and synced, so a chunk file that
exists is whole, and an interrupted pack leaves at most one `.partial` file to throw away."""

from __future__ import annotations

import os
from pathlib import Path

from .format import CHUNK_HEADER_LEN, chunk_file_name, pack_chunk_header
from .index import fsync_dir

PARTIAL_SUFFIX = ".partial"


class ChunkWriter:
    def __init__(self, dataset_dir: Path, chunk_id: int, group: int) -> None:
        self.chunk_id = chunk_id
        self.group = group
        self.final_path = dataset_dir / chunk_file_name(chunk_id)
        self.partial_path = self.final_path.with_name(self.final_path.name + PARTIAL_SUFFIX)
        self._file = open(self.partial_path, "wb")
        self._file.write(pack_chunk_header(chunk_id, group))
        self.size = CHUNK_HEADER_LEN
        self.blob_count = 0

    def append(self, blob: bytes) -> int:
        """Write a blob at the end of the chunk; returns its offset."""
        offset = self.size
        self._file.write(blob)
        self.size += len(blob)
        self.blob_count += 1
        return offset

    def finish(self) -> int:
        """Sync and publish the chunk under its final name; returns its size."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial_path, self.final_path)
        fsync_dir(self.final_path.parent)
        return self.size

    def abort(self) -> None:
        """Drop an unfinished chunk (interrupt, disk full): the resumed pack writes it again."""
        try:
            self._file.close()
        except OSError:
            pass
        self.partial_path.unlink(missing_ok=True)
