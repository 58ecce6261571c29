"""The Python API: `open_dataset(DEST)` gives a read-only view of a packed dataset, no FUSE needed."""

from __future__ import annotations

import io
import os
import posixpath
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Iterator

from .chunk_source import ChunkSource, LocalChunkSource
from .errors import PathNotFound
from .index import Index, normalize_path
from .reader import Reader

_MAX_SYMLINK_HOPS = 40


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
    """A read-only, seekable binary file over the decoded bytes of one dataset file."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._pos = 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        raise io.UnsupportedOperation(f"{self.name}: the dataset is read-only")

    def truncate(self, size: int | None = None) -> int:
        raise io.UnsupportedOperation(f"{self.name}: the dataset is read-only")

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._checkClosed()
        count = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:count] = self._view[self._pos : self._pos + count]
        self._pos += count
        return count

    def readall(self) -> bytes:
        self._checkClosed()
        data = bytes(self._view[self._pos :])
        self._pos = len(self._view)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._view.release()
        super().close()


class Dataset:
    """A packed dataset: paths as in SRC, '/'-separated and relative ('' or '/' is the root)."""

    def __init__(self, index: Index, source: ChunkSource) -> None:
        self.index = index
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

    def resolve(self, path: str | os.PathLike[str]) -> int:
        """Entry number of a path, following symlinks (they all stay inside the dataset)."""
        current = normalize_path(path)
        for _ in range(_MAX_SYMLINK_HOPS):
            entry = self._lookup_following_parents(current)
            if not stat.S_ISLNK(int(self.index.entries[entry]["mode"])):
                return entry
            current = self._link_destination(current, entry)
        raise PathNotFound(f"{os.fspath(path)!r}: too many levels of symbolic links")

    def _lookup_following_parents(self, path: str) -> int:
        try:
            return self.index.lookup(path)
        except PathNotFound:
            # A directory on the way may be a symlink: resolve the longest existing prefix and retry.
            head, _, tail = path.rpartition("/")
            if not head:
                raise
            parent = self.resolve(head)
            if not stat.S_ISDIR(int(self.index.entries[parent]["mode"])):
                raise
            return self.index.lookup(posixpath.join(self.index.path_of(parent), tail))

    def _link_destination(self, link_path: str, entry: int) -> str:
        target = self.index.link_target(entry)
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
        if joined.startswith("..") or joined.startswith("/"):
            raise PathNotFound(f"{link_path!r}: symlink points outside the dataset")
        return "" if joined == "." else joined

    def read(self, path: str | os.PathLike[str]) -> bytes:
        """The whole original content of a file; ChunkCorrupt if its blob is damaged (other files still read)."""
        entry = self.resolve(path)
        if stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
            raise IsADirectoryError(f"{os.fspath(path)!r} is a directory")
        return self.reader.read(entry)

    def open(self, path: str | os.PathLike[str]) -> BlobFile:
        """A seekable, read-only binary file object."""
        return BlobFile(self.read(path), normalize_path(path))

    def stat(self, path: str | os.PathLike[str], follow_symlinks: bool = True) -> EntryStat:
        entry = self.resolve(path) if follow_symlinks else self.index.lookup(path)
        return self.stat_entry(entry)

    def stat_entry(self, entry: int) -> EntryStat:
        rec = self.index.entries[entry]
        mode = int(rec["mode"])
        nlink = 2 + sum(1 for c in self.index.children(entry) if stat.S_ISDIR(int(self.index.entries[c]["mode"]))) \
            if stat.S_ISDIR(mode) else 1
        return EntryStat(st_ino=entry + 1, st_mode=mode, st_size=int(rec["size"]),
                         st_mtime_ns=int(rec["mtime_ns"]), st_nlink=nlink)

    def readlink(self, path: str | os.PathLike[str]) -> str:
        entry = self.index.lookup(path)
        if not stat.S_ISLNK(int(self.index.entries[entry]["mode"])):
            raise OSError(22, f"{os.fspath(path)!r} is not a symbolic link")
        return self.index.link_target(entry)

    def listdir(self, path: str | os.PathLike[str] = "") -> list[str]:
        """Names in a directory, sorted, like os.listdir."""
        entry = self.resolve(path)
        if not stat.S_ISDIR(int(self.index.entries[entry]["mode"])):
            raise NotADirectoryError(f"{os.fspath(path)!r} is not a directory")
        return [self.index.path_of(c).rpartition("/")[2] for c in self.index.children(entry)]

    def walk(self, top: str | os.PathLike[str] = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like os.walk (top-down, symlinks to directories not followed): (dirpath, dirnames, filenames)."""
        start = self.resolve(top)
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


def open_dataset(path: str | os.PathLike[str], source: ChunkSource | None = None) -> Dataset:
    """Open a packed dataset directory; the index is checked (magic, version, checksum) and loaded once."""
    index = Index.load(path)
    if source is None:
        source = LocalChunkSource(Path(path), index.chunks["size"])
    return Dataset(index, source)
