"""The pack journal: what an interrupted pack had finished, so running the same command again resumes.

It lives in DEST/.fanstore-pack/ while a pack runs and is removed once the index is written. A chunk is recorded
only after its file is complete and synced; a chunk file with no record is discarded and written again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PackError
from .durable import write_atomically

JOURNAL_DIR = ".fanstore-pack"
STATE_FILE = "state.json"
JOURNAL_VERSION = 2  # 2: plan positions are (file, block) pairs, and chunk records list their blocks


@dataclass(slots=True)
class ChunkRecord:
    """A finished chunk and every planned file and block from plan position (first_file, first_block) up to
    (end_file, end_block): a block number above 0 is a position inside a file stored in blocks."""

    chunk_id: int
    group: int
    size: int
    first_file: int
    end_file: int
    first_block: int = 0
    end_block: int = 0
    # [path, size, mtime_ns, mode, chunk, offset, stored_len, codec, checksum, flags] per file finished here
    files: list[list[Any]] = field(default_factory=list)
    # [plan number, block, offset, stored_len, codec, checksum] per block written into this chunk
    blocks: list[list[int]] = field(default_factory=list)
    # [path, reason] per skipped file
    problems: list[list[str]] = field(default_factory=list)


class JournalError(PackError):
    """DEST holds a journal this fanstore cannot resume (another journal version, or damaged)."""


class PackJournal:
    def __init__(self, dataset_dir: Path) -> None:
        self.dir = dataset_dir / JOURNAL_DIR

    def exists(self) -> bool:
        return (self.dir / STATE_FILE).is_file()

    def start(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(self.dir / STATE_FILE, {"journal_version": JOURNAL_VERSION, **state})

    def state(self) -> dict[str, Any]:
        """The journal's state, refused with one line if this fanstore did not write it in this version."""
        path = self.dir / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise JournalError(f"{path}: cannot read the interrupted pack's journal ({exc}); pass --force to "
                               "start the pack afresh") from None
        version = state.get("journal_version") if isinstance(state, dict) else None
        if version != JOURNAL_VERSION:
            raise JournalError(f"{path}: the interrupted pack was journaled by another fanstore (journal version "
                               f"{version!r}, this one resumes version {JOURNAL_VERSION}); pass --force to start "
                               "the pack afresh")
        return state

    def save_dictionary(self, name: str, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.dir / f"{name}.zdict", data)

    def load_dictionary(self, name: str) -> bytes | None:
        path = self.dir / f"{name}.zdict"
        return path.read_bytes() if path.is_file() else None

    def record_chunk(self, record: ChunkRecord) -> None:
        # By hand, not dataclasses.asdict: that deep-copies every file row, seconds per GB of small files.
        fields = {"chunk_id": record.chunk_id, "group": record.group, "size": record.size,
                  "first_file": record.first_file, "end_file": record.end_file,
                  "first_block": record.first_block, "end_block": record.end_block, "files": record.files,
                  "blocks": record.blocks, "problems": record.problems}
        _write_json_atomically(self.dir / f"chunk-{record.chunk_id:08d}.json", fields)

    def finished_chunks(self) -> list[ChunkRecord]:
        """Records of chunks 0..k-1 with no gap; a torn record (crash mid-write) cannot exist, see durable.write_atomically."""
        records = []
        while True:
            path = self.dir / f"chunk-{len(records):08d}.json"
            if not path.is_file():
                return records
            try:
                records.append(ChunkRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                raise JournalError(f"{path}: the interrupted pack's journal is damaged ({exc}); pass --force to "
                                   "start the pack afresh") from None

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_json_atomically(path: Path, value: Any) -> None:
    write_atomically(path, json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8"))
