"""The walk's entries in columns: one blob of paths and one array a field, not one Python object an entry.

A pack holds every entry of SRC until its index is written. As a tuple, a path string and integer objects each, an
entry took about 230 B; in columns it takes its path's bytes and 48 B. An entry is made a SourceEntry only when
asked for (`columns[i]`), for the few places that read one entry at a time.
"""

from __future__ import annotations

import stat
from array import array
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

# Work over every entry goes a slice at a time: what a slice makes (Python ints and strings) is never held for all.
SLICE = 1 << 16
NARROW_ENDS_BELOW = 1 << 32  # a path blob shorter than this keeps its ends in 32 bits (tests lower it)


class SourceEntry(NamedTuple):
    """A directory, regular file or symlink of SRC, with the metadata the index keeps: one entry of EntryColumns,
    as the code that reads one entry at a time sees it."""

    path: str  # relative to SRC, '/'-separated; "" is SRC itself
    mode: int
    size: int
    mtime_ns: int
    link_target: str = ""
    # Who the file was at the walk: the packer reads only that file, unchanged since (a same-size rewrite changes
    # the ctime, a swap the inode). An archive member's is its key, its place in the archives (archive_source.py).
    ino: int = 0
    ctime_ns: int = 0

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)


class PathColumn(Sequence[str]):
    """Paths as one UTF-8 blob and the offset where each ends: `column[i]` is path i, `column.encoded(i)` its
    bytes (a sequence of them for bisect: `column.as_bytes`)."""

    __slots__ = ("blob", "ends")

    def __init__(self, blob: bytes, ends: np.ndarray) -> None:
        # 4 B a path where the blob is under 4 GiB (it is, short of 10^8 long paths): the walk's and the plan's
        # columns stand together at a pack's peak
        self.blob, self.ends = blob, ends.astype(np.uint32, copy=False) if len(blob) < NARROW_ENDS_BELOW else ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, number: int) -> str:  # type: ignore[override]
        return self.encoded(number).decode("utf-8")

    def encoded(self, number: int) -> bytes:
        ends = self.ends
        return self.blob[ends.item(number - 1) if number else 0 : ends.item(number)]

    def lengths(self) -> np.ndarray:
        return np.diff(self.ends, prepend=np.int64(0))

    def encoded_slice(self, start: int, stop: int) -> list[bytes]:
        """Paths [start, stop) as bytes."""
        ends = self.ends[start:stop].tolist()
        begin = int(self.ends[start - 1]) if start else 0
        blob, found = self.blob, []
        for end in ends:
            found.append(blob[begin:end])
            begin = end
        return found

    @property
    def as_bytes(self) -> _EncodedPaths:
        return _EncodedPaths(self)

    def gather(self, numbers: np.ndarray) -> list[bytes]:
        """The paths `numbers` names, in that order, as bytes."""
        ends = self.ends[numbers]
        starts = ends - self.lengths_of(numbers)
        whole = self.blob
        return [whole[start:end] for start, end in zip(starts.tolist(), ends.tolist())]

    def gather_into(self, numbers: np.ndarray, into: np.ndarray) -> int:
        """The paths `numbers` names, in that order, back to back at the start of the byte array `into`; returns how
        many bytes they took. A slice at a time: never a second copy of them all, as `take(...).blob` is a moment."""
        cursor = 0
        for first in range(0, len(numbers), SLICE):
            joined = b"".join(self.gather(numbers[first : first + SLICE]))
            into[cursor : cursor + len(joined)] = np.frombuffer(joined, dtype=np.uint8)
            cursor += len(joined)
        return cursor

    def lengths_of(self, numbers: np.ndarray) -> np.ndarray:
        """The lengths of the paths `numbers` names (int64)."""
        ends = self.ends[numbers].astype(np.int64)
        return ends - np.where(numbers > 0, self.ends[np.maximum(numbers, 1) - 1], 0)

    def take(self, numbers: np.ndarray) -> PathColumn:
        """The paths `numbers` name, in that order, as a column of their own."""
        ends = self.ends[numbers]
        starts = ends - self.lengths()[numbers]
        slices, whole = [], self.blob
        for first in range(0, len(numbers), SLICE):
            pieces = zip(starts[first : first + SLICE].tolist(), ends[first : first + SLICE].tolist())
            slices.append(b"".join([whole[start:end] for start, end in pieces]))
        return PathColumn(b"".join(slices), np.cumsum(ends - starts, dtype=np.int64))


class _EncodedPaths(Sequence[bytes]):
    """A PathColumn's paths as bytes, for bisect."""

    __slots__ = ("column",)

    def __init__(self, column: PathColumn) -> None:
        self.column = column

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, number: int) -> bytes:  # type: ignore[override]
        return self.column.encoded(number)


_NUMBERS = ("mode", "size", "mtime_ns", "ino", "ctime_ns")


class EntryColumns(Sequence[SourceEntry]):
    """Entries of a walk: `paths`, one numpy array a number field (mode, size, mtime_ns, ino, ctime_ns), and the
    link targets of the symlinks among them, by entry number."""

    __slots__ = ("paths", "mode", "size", "mtime_ns", "ino", "ctime_ns", "link_targets")

    def __init__(self, paths: PathColumn, numbers: dict[str, np.ndarray], link_targets: dict[int, str]) -> None:
        self.paths = paths
        self.mode, self.size, self.mtime_ns = numbers["mode"], numbers["size"], numbers["mtime_ns"]
        self.ino, self.ctime_ns = numbers["ino"], numbers["ctime_ns"]
        self.link_targets = link_targets

    @classmethod
    def of(cls, entries: Iterable[SourceEntry]) -> EntryColumns:
        builder = EntryColumnsBuilder()
        for entry in entries:
            builder.add(entry)
        return builder.build()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, number: int) -> SourceEntry:  # type: ignore[override]
        return SourceEntry(self.paths[number], self.mode.item(number), self.size.item(number),
                           self.mtime_ns.item(number), self.link_targets.get(number, ""), self.ino.item(number),
                           self.ctime_ns.item(number))

    def __iter__(self) -> Iterator[SourceEntry]:
        for start in range(0, len(self), SLICE):
            stop = min(start + SLICE, len(self))
            paths = self.paths.encoded_slice(start, stop)
            columns = [getattr(self, name)[start:stop].tolist() for name in _NUMBERS]
            for offset, (path, mode, size, mtime_ns, ino, ctime_ns) in enumerate(zip(paths, *columns)):
                yield SourceEntry(path.decode("utf-8"), mode, size, mtime_ns,
                                  self.link_targets.get(start + offset, ""), ino, ctime_ns)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EntryColumns):
            return NotImplemented
        return (self.paths.blob == other.paths.blob and np.array_equal(self.paths.ends, other.paths.ends)
                and all(np.array_equal(getattr(self, name), getattr(other, name)) for name in _NUMBERS)
                and self.link_targets == other.link_targets)

    def is_file(self) -> np.ndarray:
        return (self.mode & stat.S_IFMT(0o177777)) == stat.S_IFREG

    def take(self, numbers: np.ndarray) -> EntryColumns:
        """The entries `numbers` names, in that order."""
        numbers = np.asarray(numbers, dtype=np.int64)
        place = {int(old): new for new, old in enumerate(numbers.tolist())} if self.link_targets else {}
        targets = {place[old]: target for old, target in self.link_targets.items() if old in place}
        return EntryColumns(self.paths.take(numbers), {name: _taken(getattr(self, name), numbers) for name in _NUMBERS},
                            targets)

    def to_columns(self) -> tuple[bytes, np.ndarray, dict[str, np.ndarray], dict[int, str]]:
        """What pickles fast to and from a worker process: the blob, the ends, the numbers, the targets."""
        return self.paths.blob, self.paths.ends, {name: getattr(self, name) for name in _NUMBERS}, self.link_targets

    @classmethod
    def from_columns(cls, columns: tuple[bytes, np.ndarray, dict[str, np.ndarray], dict[int, str]]) -> EntryColumns:
        blob, ends, numbers, targets = columns
        return cls(PathColumn(blob, ends), numbers, targets)


# Times a column holds (int64 nanoseconds: 1677 to 2262). A file dated outside is packed with the nearest one: a
# file dated 2300 ended a pack in an OverflowError traceback, and its bytes are what a reader wants.
_NS_MIN, _NS_MAX = -(2**63), 2**63 - 1


def time_column(ns: int) -> int:
    """A time in nanoseconds as a column holds it (the nearest one it can), to store it or compare a stat with it."""
    return min(max(ns, _NS_MIN), _NS_MAX)


class EntryColumnsBuilder:
    """Entries appended one at a time into growing columns (8 B a number, the path's bytes), not a list of tuples."""

    __slots__ = ("_blob", "_ends", "_numbers", "_targets")

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = array("q")
        self._numbers = {name: array("Q" if name == "ino" else "q") for name in _NUMBERS}
        self._targets: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, entry: SourceEntry) -> None:
        if entry.link_target:
            self._targets[len(self._ends)] = entry.link_target
        self._blob += entry.path.encode("utf-8")
        self._ends.append(len(self._blob))
        numbers = self._numbers
        numbers["mode"].append(entry.mode)
        numbers["size"].append(entry.size)
        numbers["mtime_ns"].append(time_column(entry.mtime_ns))
        numbers["ino"].append(entry.ino)
        numbers["ctime_ns"].append(time_column(entry.ctime_ns))

    def extend(self, columns: EntryColumns, start: int = 0, stop: int | None = None) -> None:
        """Entries [start, stop) of `columns` (a worker's walk, all of it), after those added."""
        stop = len(columns) if stop is None else stop
        base, blob_base = len(self._ends) - start, len(self._blob)
        self._targets.update({base + number: target for number, target in columns.link_targets.items()
                              if start <= number < stop})
        first = int(columns.paths.ends[start - 1]) if start else 0
        self._blob += columns.paths.blob[first : int(columns.paths.ends[stop - 1]) if stop else 0]
        self._ends.frombytes((columns.paths.ends[start:stop].astype(np.int64) - first + blob_base).tobytes())
        for name, column in self._numbers.items():
            values = getattr(columns, name)[start:stop]
            column.frombytes(values.astype(np.uint64 if column.typecode == "Q" else np.int64).tobytes())

    def build(self) -> EntryColumns:
        """The columns, on the builder's own arrays (not copied: the builder is done with)."""
        # st_mode in its 32 bits: 4 B a member less, in the walk and again in the plan
        numbers = {name: _one_value_or_all(_array_of(column).astype(np.uint32) if name == "mode" else _array_of(column))
                   for name, column in self._numbers.items()}
        self._numbers = {name: array(column.typecode) for name, column in self._numbers.items()}
        blob, self._blob = bytes(self._blob), bytearray()
        ends, self._ends = _array_of(self._ends), array("q")  # PathColumn keeps what it needs of them
        return EntryColumns(PathColumn(blob, ends), numbers, dict(self._targets))


def _array_of(column: array) -> np.ndarray:
    """An array('q' or 'Q') as numpy, sharing its memory."""
    dtype = np.uint64 if column.typecode == "Q" else np.int64
    return np.frombuffer(column, dtype=dtype) if len(column) else np.zeros(0, dtype)


def _one_value_or_all(column: np.ndarray) -> np.ndarray:
    """A column whose entries all hold one value, as that value seen `len(column)` times (read-only, no memory a
    member): an archive member's ctime, 0 for every member, was 8 B a member in the walk and again in the plan."""
    if len(column) > 1 and not (column != column[0]).any():
        return np.broadcast_to(column[:1].copy(), column.shape)  # a copy: the column's memory goes
    return column


def _taken(column: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """column[numbers], a column of one value kept as one (_one_value_or_all)."""
    if column.strides == (0,) and len(column) and len(numbers):
        return np.broadcast_to(column[:1].copy(), (len(numbers),))
    return column[numbers]


def sorted_by_path(columns: EntryColumns) -> EntryColumns:
    """The entries in UTF-8 byte order of their paths (a stable sort); as they are when they are in it already."""
    if in_path_order(columns.paths):
        return columns
    return columns.take(np.array(sorted(range(len(columns)), key=columns.paths.encoded), dtype=np.int64))


def in_path_order(paths: PathColumn, strictly: bool = False) -> bool:
    """Whether the paths are in UTF-8 byte order (`strictly`: and none is given twice)."""
    previous = None
    for start in range(0, len(paths), SLICE):
        for path in paths.encoded_slice(start, min(start + SLICE, len(paths))):
            if previous is not None and (path < previous or (strictly and path == previous)):
                return False
            previous = path
    return True


class PathList(Sequence[str]):
    """Paths appended one at a time, held as one UTF-8 blob and each one's end: the path's bytes and 8 B, where a
    list of strings holds about 77 B a path (a chunk record holds one for each file it packed)."""

    __slots__ = ("_blob", "_ends")

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._blob = bytearray()
        self._ends = array("q")
        for path in paths:
            self.append(path)

    def append(self, path: str) -> None:
        self._blob += path.encode("utf-8")
        self._ends.append(len(self._blob))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, at: int | slice) -> Any:
        if isinstance(at, slice):
            return [self[number] for number in range(*at.indices(len(self)))]
        end = self._ends[at]  # IndexError past the end, as a list's
        number = at if at >= 0 else at + len(self._ends)
        return self._blob[self._ends[number - 1] if number else 0 : end].decode("utf-8")


class PlannedPaths(Sequence[str]):
    """The paths of files of a plan, appended one at a time by their plan numbers: 4 B a path, not its bytes again
    (a chunk record names each file it packed; the plan's column holds the paths)."""

    __slots__ = ("_column", "_numbers")

    def __init__(self, column: PathColumn) -> None:
        self._column = column
        self._numbers = array("I")  # a plan holds fewer than 2^32 files (an index's entry numbers are u4)

    def append(self, number: int) -> None:
        self._numbers.append(number)

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, at: int | slice) -> Any:
        if isinstance(at, slice):
            numbers = np.frombuffer(self._numbers, dtype=np.uint32)[at] if len(self._numbers) else np.zeros(0, int)
            listed = [path.decode("utf-8") for path in self._column.gather(numbers)]
            del numbers  # the array's buffer is exported while a view of it lives: no number could be appended
            return listed
        return self._column[self._numbers[at]]
