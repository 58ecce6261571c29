"""Where a chunk's bytes come from. The read path asks a ChunkSource for (chunk, offset, length) and does not
care whether the answer comes from a local file, an MPI peer or a shared file system."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

import numpy as np

from .errors import FanstoreError, FormatError
from .format import CHUNK_HEADER_LEN, check_chunk_header, chunk_file_name


class ChunkUnavailable(FanstoreError, OSError):
    """A chunk cannot be had (missing, unreadable, truncated); the files in other chunks still read."""


class ChunkSource(ABC):
    """Bytes of stored blobs, by chunk id, offset and length. Implementations are safe to call from many threads."""

    @abstractmethod
    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset` of chunk `chunk_id`, or ChunkUnavailable naming the chunk."""

    def close(self) -> None:
        """Release what the source holds open; reads after close are an error."""

    def __enter__(self) -> "ChunkSource":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LocalChunkSource(ChunkSource):
    """Chunk files in a dataset directory on this node, each opened once (header checked) and read with pread."""

    def __init__(self, dataset_dir: str | os.PathLike[str], chunk_sizes: np.ndarray) -> None:
        self._dir = Path(dataset_dir)
        self._sizes = [int(s) for s in chunk_sizes]
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _fd(self, chunk_id: int) -> int:
        fd = self._fds.get(chunk_id)
        if fd is not None:
            return fd
        with self._lock:
            if self._closed:
                raise ChunkUnavailable(f"{self._dir}: chunk source is closed")
            fd = self._fds.get(chunk_id)
            if fd is None:
                fd = self._open_checked(chunk_id)
                self._fds[chunk_id] = fd
        return fd

    def _open_checked(self, chunk_id: int) -> int:
        path = self._dir / chunk_file_name(chunk_id)
        if not 0 <= chunk_id < len(self._sizes):
            raise ChunkUnavailable(f"{path}: chunk {chunk_id} is not in the index")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ChunkUnavailable(f"{path}: cannot open chunk {chunk_id}: {exc.strerror}") from None
        try:
            check_chunk_header(os.pread(fd, CHUNK_HEADER_LEN, 0), chunk_id, path)
            size = os.fstat(fd).st_size
            if size != self._sizes[chunk_id]:
                raise FormatError(f"{path}: chunk {chunk_id} is {size} bytes, the index says {self._sizes[chunk_id]}")
        except FormatError as exc:
            os.close(fd)
            raise ChunkUnavailable(str(exc)) from None
        return fd

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        data = os.pread(self._fd(chunk_id), length, offset)
        if len(data) != length:
            raise ChunkUnavailable(
                f"{self._dir / chunk_file_name(chunk_id)}: short read of chunk {chunk_id} at offset {offset}"
            )
        return data

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
