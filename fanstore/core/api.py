"""The Python API: `open_dataset(DEST)` gives a read-only view of a packed dataset, no FUSE needed.

It keeps no decoded cache: every read fetches, verifies and decodes again (a BlobFile keeps only the part it
decoded last). Decoded bytes are kept where reads repeat or run ahead: the mount's DecodedCache, fanstore.torch.
"""

from __future__ import annotations

import io
import operator
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator, Sequence

import numpy as np

from .chunk_source import ChunkSource, LocalChunkSource
from ..errors import FanstoreError, IsADirectory, NotADirectory, NotASymlink, SeekRefused, UsageError, quoted, \
    shown_path
from .index import Index, normalize_path
from .path_walk import PathWalk
from .reader import Reader


@dataclass(frozen=True, slots=True)
class EntryStat:
    """What `os.stat` would say of the original file; field names follow os.stat_result."""

    st_ino: int
    st_mode: int
    st_size: int
    st_mtime_ns: int
    st_nlink: int

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9


class BlobFile(io.RawIOBase):
    """A read-only, seekable binary file over one dataset file, decoded as reads reach it.

    A file stored in blocks is decoded a block at a time, and the block read last is kept: a sequential read
    decodes each block once, a small read anywhere about one block, whatever the file's size. A file stored
    whole is decoded at its first read.
    """

    def __init__(self, reader: Reader, entry: int, name: str) -> None:
        super().__init__()
        self.name = name
        self._reader = reader
        self._entry = entry
        self._size = int(reader.index.entries[entry]["size"])
        blocked = reader.index.block_count(entry) > 0
        self._part_size = reader.block_size if blocked else max(1, self._size)
        self._load_part = (lambda part: reader.read_block(entry, part)) if blocked else (
            lambda part: reader.read(entry))
        self._part_number = -1
        self._part = b""
        self._pos = 0

    def readable(self) -> bool:
        self._checkClosed()  # ValueError once closed, as a file's: a library asks before it reads
        return True

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def write(self, data: object) -> int:
        raise io.UnsupportedOperation(f"{self.name}: the dataset is read-only")

    def truncate(self, size: int | None = None) -> int:
        raise io.UnsupportedOperation(f"{self.name}: the dataset is read-only")

    def _part_at(self, position: int) -> tuple[bytes, int]:
        """The decoded part (a block, or the whole file) holding `position`, and where `position` lies in it."""
        number = position // self._part_size
        if number != self._part_number:
            self._part = self._load_part(number)
            self._part_number = number
        return self._part, position - number * self._part_size

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._checkClosed()
        with memoryview(buffer) as target, target.cast("B") as into:
            count = 0
            while count < len(into) and self._pos < self._size:
                part, start = self._part_at(self._pos)
                taken = min(len(part) - start, len(into) - count)
                into[count : count + taken] = memoryview(part)[start : start + taken]
                count += taken
                self._pos += taken
        return count

    def read(self, size: int | None = -1) -> bytes:
        """As a file's: `size` None or negative reads to the end (io.RawIOBase's refuses None). A size past the end
        asks for what is left: io.RawIOBase allocates `size` bytes first, so read(10**12) of a small file was a
        MemoryError where io.BytesIO gives the file."""
        if size is None or size < 0:
            return self.readall()
        return super().read(min(size, max(0, self._size - self._pos)))

    def readall(self) -> bytes:
        self._checkClosed()
        if self._pos == 0 and not self._reader.index.block_count(self._entry):
            self._pos = self._size
            return self._reader.read(self._entry)
        parts = []
        while self._pos < self._size:
            part, start = self._part_at(self._pos)
            parts.append(part[start:])
            self._pos += len(part) - start
        return b"".join(parts)

    def readline(self, size: int | None = -1) -> bytes:
        """One line, found in the decoded bytes directly (io's default reads a byte at a time)."""
        self._checkClosed()
        left = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        parts = []
        while left > 0:
            part, start = self._part_at(self._pos)
            stop = min(len(part), start + left)
            newline = part.find(b"\n", start, stop)
            end = stop if newline < 0 else newline + 1
            parts.append(part[start:end])
            self._pos += end - start
            left -= end - start
            if newline >= 0:
                break
        return b"".join(parts)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        offset = operator.index(offset)  # TypeError for 1.5 here, as a file's seek gives, not at the next read
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}
        if whence not in bases:
            raise SeekRefused(f"{self.name}: invalid whence {whence!r} (use io.SEEK_SET, SEEK_CUR or SEEK_END)")
        if bases[whence] + offset < 0:
            raise SeekRefused(f"{self.name}: negative seek position {bases[whence] + offset}")
        self._pos = bases[whence] + offset
        return self._pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def close(self) -> None:
        self._part = b""
        super().close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused as an open file's pickle is, in words: pickle failed deep in the index with "cannot pickle
        memoryview objects", which named neither the file nor what to do (a spawned DataLoader worker given a
        dataset that holds an open file)."""
        raise TypeError(f"{shown_path(self.name)}: an open dataset file cannot be pickled, as an open file cannot: "
                        f"pickle its Dataset (it opens again where it lands) and open the file there")


class Dataset:
    """A packed dataset: paths as in SRC, '/'-separated and relative ('' or '/' is the root)."""

    def __init__(self, index: Index, source: ChunkSource) -> None:
        self.index = index
        self.path_walk = PathWalk(index)  # how a path names an entry (the kernel's way)
        self.reader = Reader(index, source)
        self.path = index.path.parent

    def __len__(self) -> int:
        """Number of regular files."""
        return self.index.file_count

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.reader.source.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what opens it again (a spawn or forkserver DataLoader worker, a multiprocessing pool): the
        index maps a file and the source holds descriptors, which no pickle carries. A dataset read through another
        source (a serve node's) is opened again in the process that needs it."""
        source = self.reader.source
        if type(source) is not LocalChunkSource or Path(source.directory) != Path(self.path):
            raise TypeError(f"a dataset read through {type(source).__name__} cannot be pickled: open it in the process "
                            "that reads it, or use fanstore.torch.FileDataset, which pickles as its source's name")
        return open_pickled_dataset, (str(self.path), self.index.file_identity)

    def for_forked_child(self) -> "Dataset | None":
        """In a process forked from the one that opened this dataset: the same dataset, its index shared with the
        parent's memory (copy-on-write, never written) and its open chunk files taken over, so the child reads
        without opening or reading anything again; None if its source cannot be carried over (the child opens
        its own)."""
        source = self.reader.source.for_forked_child()
        return None if source is None else Dataset(self.index, source)

    def resolve(self, path: str | os.PathLike[str], follow_symlinks: bool = True) -> int:
        """Entry number of a path, following symlinks (they all stay inside the dataset); with `follow_symlinks`
        False, a link at the end is the entry (links on the way are followed, as lstat does). See PathWalk."""
        return self.path_walk.resolve(path, follow_symlinks)

    def resolve_many(self, paths: Sequence[str], errors: dict[int, FanstoreError] | None = None) -> np.ndarray:
        """Entry numbers of many paths, as `resolve` gives them (the same errors), in one vectorized search; given
        `errors`, a path that does not resolve is -1 and its error kept there by its place (PathWalk.resolve_many)."""
        return self.path_walk.resolve_many(paths, errors)

    def read(self, path: str | os.PathLike[str]) -> bytes:
        """The whole original content of a file. ChunkCorrupt if its stored bytes are damaged, ChunkUnavailable if
        they cannot be read now; other files still read."""
        return self.reader.read(self._file_entry(path))

    def open(self, path: str | os.PathLike[str]) -> BlobFile:
        """A seekable, read-only binary file object; it decodes as reads reach it (see BlobFile)."""
        return BlobFile(self.reader, self._file_entry(path), normalize_path(path))

    def _file_entry(self, path: str | os.PathLike[str]) -> int:
        entry = self.resolve(path)
        if stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
            raise IsADirectory(f"{quoted(path)} is a directory")
        return entry

    def stat(self, path: str | os.PathLike[str], follow_symlinks: bool = True) -> EntryStat:
        return self.stat_entry(self.resolve(path, follow_symlinks))

    def stat_entry(self, entry: int) -> EntryStat:
        rec = self.index.entries[entry]
        mode = int(rec["mode"])
        return EntryStat(st_ino=entry + 1, st_mode=mode, st_size=int(rec["size"]),
                         st_mtime_ns=int(rec["mtime_ns"]), st_nlink=self.index.link_count(entry))

    def readlink(self, path: str | os.PathLike[str]) -> str:
        entry = self.resolve(path, follow_symlinks=False)
        if not stat.S_ISLNK(int(self.index.entries[entry]["mode"])):
            raise NotASymlink(f"{quoted(path)} is not a symbolic link")
        return self.index.link_target(entry)

    def listdir(self, path: str | os.PathLike[str] = "") -> list[str]:
        """Names in a directory, sorted, like os.listdir."""
        entry = self.resolve(path)
        if not stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
            raise NotADirectory(f"{quoted(path)} is not a directory")
        return [self.index.path_of(c).rpartition("/")[2] for c in self.index.children(entry)]

    def walk(self, top: str | os.PathLike[str] = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like os.walk (top-down, symlinks to directories not followed): (dirpath, dirnames, filenames). A top that is
        not a directory gives nothing, as os.walk's; one that is not there is PathNotFound."""
        start = self.resolve(top)
        if not stat.S_ISDIR(int(self.index.entries[start]["mode"])):
            return
        pending = [start]
        while pending:
            entry = pending.pop()
            dirnames, filenames, subdirs = [], [], []
            for child in self.index.children(entry):
                name = self.index.path_of(child).rpartition("/")[2]
                if stat.S_ISDIR(int(self.index.entries[child]["mode"])):
                    dirnames.append(name)
                    subdirs.append(child)
                else:
                    filenames.append(name)
            yield self.index.path_of(entry), dirnames, filenames
            pending.extend(reversed(subdirs))

    def files(self) -> Iterator[str]:
        """Paths of every regular file, in storage order (the fastest order to read them all)."""
        return (self.index.path_of(e) for e in self.index.iter_files())


def open_pickled_dataset(path: str, identity: tuple[int, int, int, int] | None) -> Dataset:
    """A pickled Dataset where it lands: the dataset that was pickled, or one error if DEST was packed again since
    (a spawned worker would read the new pack's files while the process that pickled it reads the old one's)."""
    dataset = open_dataset(path)
    if identity is not None and dataset.index.file_identity != tuple(identity):
        dataset.close()
        raise UsageError(f"{shown_path(path)}: packed again since this dataset was pickled (its index file is "
                         f"another now): open the dataset again in the process that pickled it")
    return dataset


def open_dataset(path: str | os.PathLike[str], source: ChunkSource | None = None) -> Dataset:
    """Open a packed dataset directory; the index is checked (magic, version, checksum) and loaded once."""
    if path is None:  # FileDataset(None) reads a served node's dataset: a caller may take None to mean it here too
        raise UsageError("open_dataset: no dataset given: pass a packed dataset directory (under `fanstore serve`, "
                         "fanstore.torch.FileDataset(None) reads the node's dataset without FUSE, and every rank's "
                         "MOUNTPOINT shows all of it)")
    if not os.fspath(path):
        raise UsageError("open_dataset: an empty path (an unset variable?) names no dataset; Path('') would be the "
                         "current directory")
    # Absolute from here on: chunk files are opened as reads reach them, and a pickled dataset opens again in another
    # process, both maybe after the working directory changed, where a relative DEST named another place.
    path = Path(path).absolute()
    index = Index.load(path)
    if source is None:
        source = LocalChunkSource(path, index.chunks["size"])
    return Dataset(index, source)
