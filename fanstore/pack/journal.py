"""The pack journal: what an interrupted pack had finished, so running the same command again resumes.

It lives in DEST/.fanstore-pack/ while a pack runs and is removed once the index is written. A chunk is recorded
only after its file is complete and synced; a chunk file with no record is discarded and written again.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from ..core.durable import write_atomically
from ..errors import PackError, quoted
from .entry_columns import SLICE, PathColumn, PathList, PlannedPaths
from .walk import Problem

JOURNAL_DIR = ".fanstore-pack"
STATE_FILE = "state.json"
# 2: plan positions are (file, block) pairs, and chunk records list their blocks.
# 3: the state and every row are named records (chunk records hold one named column per field), not positional.
JOURNAL_VERSION = 3
_RECORD_NAME = re.compile(r"chunk-([0-9]{8})\.json")


@dataclass(frozen=True, slots=True)
class JournalState:
    """What a pack is: a resume goes on only with the same fingerprint (source listing and output-defining
    options), and reuses the codec selection of the interrupted run (measured speeds differ from run to run)."""

    fingerprint: str
    options: dict[str, Any]
    codecs: list[dict[str, Any]]
    selection: dict[str, Any] | None = None


class FileRow(NamedTuple):
    """A file finished in a chunk, with the entry fields the index will record (a named tuple: a pack makes one
    per file). For a file stored in blocks: its first block's chunk and codec, its blocks' total stored length,
    offset and checksum 0 (the index gives it the row of its first block)."""

    path: str
    size: int
    mtime_ns: int
    mode: int
    chunk: int
    offset: int
    stored_len: int
    codec: int
    checksum: int
    flags: int


# Each field's array type: the narrowest that holds every value the index can record (a mode, a chunk id, a codec
# row and the flags are the index's u4, u4, u1 and u1).
_TYPECODES = {"size": "Q", "mtime_ns": "q", "mode": "I", "chunk": "I", "offset": "Q", "stored_len": "Q",
              "codec": "B", "checksum": "Q", "flags": "B"}
if array("I").itemsize != 4:
    raise ImportError("array('I') must hold 4 bytes")


class FileRows:
    """The files finished in a chunk, as FileRow's fields in columns: the path's bytes, its end and 50 bytes of
    numbers a file, each field in an array of its own type (not a named tuple, its string and its integers: about
    280 B; nor nine u64 words, 72 B): a pack holds a row for every file until its index's layout holds them."""

    WORDS = FileRow._fields[1:]  # every field but the path
    __slots__ = ("paths", "_columns")  # paths: the files' paths (with plan paths, `append` takes a plan number)

    def __init__(self, plan_paths: PathColumn | None = None) -> None:
        """With `plan_paths`, the plan's, a row names its file by plan number (4 B), not by its path's bytes."""
        self.paths: PathList | PlannedPaths = PathList() if plan_paths is None else PlannedPaths(plan_paths)
        self._columns = tuple(array(_TYPECODES[name]) for name in self.WORDS)

    def append(self, path: Any, size: int, mtime_ns: int, mode: int, chunk: int, offset: int, stored_len: int,
               codec: int, checksum: int, flags: int) -> None:
        self.paths.append(path)
        columns = self._columns
        columns[0].append(size)
        columns[1].append(mtime_ns)
        columns[2].append(mode)
        columns[3].append(chunk)
        columns[4].append(offset)
        columns[5].append(stored_len)
        columns[6].append(codec)
        columns[7].append(checksum)
        columns[8].append(flags)

    def __len__(self) -> int:
        return len(self.paths)

    def column(self, name: str) -> np.ndarray:
        """One field of every row, a copy (int64 for mtime_ns, uint64 for the others; not "path": see `paths`)."""
        values = self._columns[self.WORDS.index(name)]
        wide = np.int64 if name == "mtime_ns" else np.uint64
        if not len(values):
            return np.zeros(0, dtype=wide)
        view = np.frombuffer(values, dtype=values.typecode)
        column = view.astype(wide)
        del view  # the array's buffer is exported while a view of it lives: no row could be appended
        return column

    def __iter__(self) -> Iterator[FileRow]:
        for path, *numbers in zip(self.paths, *self._columns):
            yield FileRow(path, *numbers)

    @classmethod
    def from_columns(cls, columns: dict[str, list[Any]]) -> "FileRows":
        """The rows of a journal record's named columns (checked by _rows' rules: exactly FileRow's fields, lists of
        one length); ValueError if a value is not an integer of its field's range."""
        _rows(FileRow._fields, columns, lambda row: None)
        rows = cls()
        if not all(isinstance(path, str) for path in columns["path"]):
            raise ValueError("a path is not a string")
        rows.paths = PathList(columns["path"])
        if not all(type(value) is int for name in cls.WORDS for value in columns[name]):
            raise ValueError("a row field holds a value that is not an integer")
        try:
            rows._columns = tuple(array(_TYPECODES[name], columns[name]) for name in cls.WORDS)
        except OverflowError as exc:
            raise ValueError(f"a row field holds a value out of its range ({exc})") from None
        return rows


class BlockRow(NamedTuple):
    """One block of a file stored in blocks, written into a chunk: `file` is the file's number in the plan."""

    file: int
    block: int
    offset: int
    stored_len: int
    codec: int
    checksum: int


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
    files: FileRows = field(default_factory=FileRows)  # the files finished in this range
    blocks: list[BlockRow] = field(default_factory=list)  # the blocks written into this chunk
    problems: list[Problem] = field(default_factory=list)  # the files of this range skipped


_RECORD_SCALARS = ("chunk_id", "group", "size", "first_file", "end_file", "first_block", "end_block")


class JournalError(PackError):
    """DEST holds a journal this fanstore cannot resume (another journal version, or damaged)."""


class PackJournal:
    def __init__(self, dataset_dir: Path) -> None:
        self.dir = dataset_dir / JOURNAL_DIR

    def exists(self) -> bool:
        return (self.dir / STATE_FILE).is_file()

    def start(self, state: JournalState) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fields = {"fingerprint": state.fingerprint, "options": state.options, "codecs": state.codecs,
                  "selection": state.selection}
        _write_json_atomically(self.dir / STATE_FILE, {"journal_version": JOURNAL_VERSION, **fields})

    def state(self) -> JournalState:
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
                               f"{quoted(version)}, this one resumes version {JOURNAL_VERSION}); pass --force to start "
                               "the pack afresh")
        del state["journal_version"]
        try:
            return JournalState(**state)
        except TypeError as exc:
            raise JournalError(f"{path}: the interrupted pack's journal is damaged ({exc}); pass --force to start "
                               "the pack afresh") from None

    def save_dictionary(self, name: str, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.dir / f"{name}.zdict", data)

    def load_dictionary(self, name: str) -> bytes | None:
        path = self.dir / f"{name}.zdict"
        return path.read_bytes() if path.is_file() else None

    def record_chunk(self, record: ChunkRecord) -> None:
        """Written as named columns, one list per field: as cheap as positional rows (a journal holds a row per
        packed file), and a field can be neither misplaced nor mistaken for another."""
        fields: dict[str, Any] = {name: getattr(record, name) for name in _RECORD_SCALARS}
        files = record.files
        # A column of the files is made as its turn to be written comes, and written a slice at a time: a chunk of
        # small files holds a row for each of a million files, whose columns as lists and as JSON were a pack's peak
        # of memory.
        fields["files"] = {"path": lambda: files.paths,
                           **{name: functools.partial(files.column, name) for name in FileRows.WORDS}}
        fields["blocks"] = _columns(BlockRow._fields, record.blocks)
        fields["problems"] = _columns(("path", "reason"), [(p.path, p.reason) for p in record.problems])
        write_atomically(self.dir / f"chunk-{record.chunk_id:08d}.json", _json_pieces(fields))

    def finished_chunks(self) -> list[ChunkRecord]:
        """Records of chunks 0..k-1 with no gap; a torn record (crash mid-write) cannot exist (durable.py)."""
        records = []
        while True:
            path = self.dir / f"chunk-{len(records):08d}.json"
            if not path.is_file():
                return records
            try:
                fields = json.loads(path.read_text())
                if not isinstance(fields, dict) or set(fields) != {*_RECORD_SCALARS, "files", "blocks", "problems"}:
                    raise ValueError("not a chunk record")
                records.append(ChunkRecord(
                    **{name: fields[name] for name in _RECORD_SCALARS},
                    files=FileRows.from_columns(fields["files"]),
                    blocks=_rows(BlockRow._fields, fields["blocks"], BlockRow._make),
                    problems=_rows(("path", "reason"), fields["problems"], lambda row: Problem(*row))))
            except (OSError, ValueError, TypeError) as exc:
                raise JournalError(f"{path}: the interrupted pack's journal is damaged ({exc}); pass --force to "
                                   "start the pack afresh") from None

    def forget_chunks_from(self, first: int) -> None:
        """Remove the records of chunks `first` and later, including any past a gap, which finished_chunks never
        reads but a later run would once the gap is filled again."""
        if not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            number = _RECORD_NAME.fullmatch(path.name)
            if number is not None and int(number.group(1)) >= first:
                path.unlink()

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _columns(names: tuple[str, ...], rows: Sequence[Sequence[Any]]) -> dict[str, list[Any]]:
    """Rows as one list per named field."""
    return {name: list(column) for name, column in zip(names, zip(*rows))} if rows else {name: [] for name in names}


def _rows(names: tuple[str, ...], columns: Any, make: Callable[[Iterable[Any]], Any]) -> list[Any]:
    """The rows of named columns, which must be exactly `names`, each a list of the same length."""
    if not isinstance(columns, dict) or set(columns) != set(names):
        raise ValueError(f"columns {sorted(columns) if isinstance(columns, dict) else columns!r}, expected "
                         f"{sorted(names)}")
    lists = [columns[name] for name in names]
    if not all(isinstance(column, list) and len(column) == len(lists[0]) for column in lists):
        raise ValueError(f"columns {list(names)} are not lists of one length")
    return [make(row) for row in zip(*lists)]


def _json_pieces(value: Any) -> Iterator[bytes]:
    """The bytes of json.dumps(value, sort_keys=True, separators=(",", ":")) in pieces, a value of a dict at a time;
    a callable value is called when its turn comes (a column made only to be written)."""
    if callable(value):
        value = value()
    if isinstance(value, (PathList, PlannedPaths, np.ndarray)):
        yield from _json_list_pieces(value)
        return
    if not isinstance(value, dict):
        yield json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
        return
    yield b"{"
    for number, key in enumerate(sorted(value)):
        yield (b"," if number else b"") + json.dumps(key).encode("utf-8") + b":"
        yield from _json_pieces(value[key])
    yield b"}"


def _json_list_pieces(column: PathList | PlannedPaths | np.ndarray) -> Iterator[bytes]:
    """The bytes of json.dumps(list(column), separators=(",", ":")), a slice of the column at a time."""
    yield b"["
    for start in range(0, len(column), SLICE):
        piece = column[start : start + SLICE]
        listed = piece.tolist() if isinstance(piece, np.ndarray) else piece
        yield (b"," if start else b"") + json.dumps(listed, separators=(",", ":")).encode("utf-8")[1:-1]
    yield b"]"


def _write_json_atomically(path: Path, value: Any) -> None:
    write_atomically(path, json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8"))
