"""The pack journal: what an interrupted pack had finished, so running the same command again resumes.

It lives in DEST/.fanstore-pack/ while a pack runs and is removed once the index is written. A chunk is recorded
only after its file is complete and synced; a chunk file with no record is discarded and written again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .index import fsync_dir

JOURNAL_DIR = ".fanstore-pack"
STATE_FILE = "state.json"
JOURNAL_VERSION = 1


@dataclass(slots=True)
class ChunkRecord:
    """A finished chunk and every planned file in [first_file, end_file), blobs and skips alike."""

    chunk_id: int
    group: int
    size: int
    first_file: int
    end_file: int
    # [path, size, mtime_ns, mode, chunk, offset, stored_len, codec, checksum] per file
    files: list[list[Any]] = field(default_factory=list)
    # [path, reason] per skipped file
    problems: list[list[str]] = field(default_factory=list)


class PackJournal:
    def __init__(self, dataset_dir: Path) -> None:
        self.dir = dataset_dir / JOURNAL_DIR

    def exists(self) -> bool:
        return (self.dir / STATE_FILE).is_file()

    def start(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(self.dir / STATE_FILE, {"journal_version": JOURNAL_VERSION, **state})

    def state(self) -> dict[str, Any]:
        return json.loads((self.dir / STATE_FILE).read_text())

    def save_dictionary(self, name: str, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.dir / f"{name}.zdict", data)

    def load_dictionary(self, name: str) -> bytes | None:
        path = self.dir / f"{name}.zdict"
        return path.read_bytes() if path.is_file() else None

    def record_chunk(self, record: ChunkRecord) -> None:
        # By hand, not dataclasses.asdict: that deep-copies every file row, seconds per GB of small files.
        fields = {"chunk_id": record.chunk_id, "group": record.group, "size": record.size,
                  "first_file": record.first_file, "end_file": record.end_file, "files": record.files,
                  "problems": record.problems}
        _write_json_atomically(self.dir / f"chunk-{record.chunk_id:08d}.json", fields)

    def finished_chunks(self) -> list[ChunkRecord]:
        """Records of chunks 0..k-1 with no gap; a torn record (crash mid-write) cannot exist, see _write_atomically."""
        records = []
        while True:
            path = self.dir / f"chunk-{len(records):08d}.json"
            if not path.is_file():
                return records
            records.append(ChunkRecord(**json.loads(path.read_text())))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_json_atomically(path: Path, value: Any) -> None:
    _write_atomically(path, json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)
