"""The serve process's door for the training job's own readers on this node (fanstore.torch workers).

A reader reads chunks this node stores straight from its local directory; for the others it asks the serve process
here, over a Unix socket in that directory, and gets the stored blob (still compressed: the reader verifies and
decodes it, in parallel with the other workers). An epoch's plan (the remote blobs in the order the sampler
drew) makes the serve process fetch them ahead from their owners, bounded in bytes.

Wire format, little-endian. A request: REQUEST (magic FSNQ, kind, chunk, offset, length) and, for PLAN, `length`
rows of (chunk, offset, length) as int64. A reply: REPLY (magic FSNP, status, payload length) and the payload:
the blob, the node's description (HELLO, JSON), its readers' counters (STATS, JSON), or a UTF-8 reason (status
not OK).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import socketserver
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..chunk_source import BlobRead, ChunkSource
from ..errors import ChunkCorrupt, ChunkError
from .placement import BlobTable

log = logging.getLogger("fanstore.serve")

SOCKET_NAME = "fanstore-node.sock"
UNIX_PATH_MAX = 108  # bytes of a Unix socket's path, its final NUL included (Linux's sockaddr_un)
ENVIRONMENT = "FANSTORE_SERVE_SOCKET"  # set for COMMAND; a job started otherwise sets it from the ready file
REQUEST = struct.Struct("<4sIIQQ")  # magic, kind, chunk, offset, length (PLAN: rows that follow)
REPLY = struct.Struct("<4sIQ")  # magic, status, payload length
REQUEST_MAGIC, REPLY_MAGIC = b"FSNQ", b"FSNP"
HELLO, READ, PLAN, STATS = 1, 2, 3, 4
OK, REFUSED, UNAVAILABLE, CORRUPT = 0, 1, 2, 3
PLAN_ROW = np.dtype([("chunk", "<i8"), ("offset", "<i8"), ("length", "<i8")])
MAX_PLAN_ROWS = 1 << 26
AHEAD_BYTES = 256 << 20  # remote blobs fetched ahead and not read yet, at most
# Of those, bytes asked of peers and not come yet: a request queued behind many others could miss its deadline.
AHEAD_IN_FLIGHT = 16 << 20
AHEAD_ROWS = 64  # plan rows started at once; the source asks each peer for its blobs among them together


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address to bind or connect a Unix socket at `path` by. A job's local directory may lie deeper than
    the 107 bytes Linux takes: such a path is reached through a descriptor of its directory, /proc/self/fd/N/NAME,
    held open until the bind or connect is done."""
    if len(os.fsencode(path)) < UNIX_PATH_MAX:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


class BlobsAhead:
    """Remote blobs of the current plan, fetched in plan order and held until read once. One thread starts the
    fetches (ChunkSource.start_reads: each peer's blobs several to a request), and they are handed over as they
    arrive: no thread waits for a peer."""

    def __init__(self, start_reads: Callable[[Sequence[BlobRead]], list[bool]], capacity: int = AHEAD_BYTES,
                 in_flight: int = AHEAD_IN_FLIGHT) -> None:
        self._start_reads = start_reads
        self._capacity = capacity
        self._in_flight = in_flight
        self._held: OrderedDict[tuple[int, int], bytes | memoryview] = OrderedDict()
        self._held_bytes = 0
        self._reserved = 0  # bytes asked for and not come yet
        self._asked: dict[int, int] = {}  # fetch number -> its length, while it is asked and not come
        self._fetch_number = 0
        self._plan: list[tuple[int, int, int]] = []
        self._next = 0
        self._generation = 0
        self._changed = threading.Condition()
        self._closed = False
        self.hits = self.fetched = self.failed_batches = 0
        self._thread = threading.Thread(target=self._work, name="fanstore-node-ahead", daemon=True)
        self._thread.start()

    def replace_plan(self, rows: list[tuple[int, int, int]]) -> None:
        with self._changed:
            self._plan = rows
            self._next = 0
            self._generation += 1
            self._held.clear()
            self._held_bytes = 0
            self._changed.notify_all()

    def take(self, chunk: int, offset: int) -> bytes | memoryview | None:
        """The blob if it was fetched ahead (it is then forgotten: each is read once an epoch), else None."""
        with self._changed:
            blob = self._held.pop((chunk, offset), None)
            if blob is not None:
                self._held_bytes -= len(blob)
                self.hits += 1
                self._changed.notify_all()
            return blob

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._next >= len(self._plan) or self._full()):
                    self._changed.wait()
                if self._closed:
                    return
                reads: list[BlobRead] = []
                numbers: list[int] = []
                while self._next < len(self._plan) and len(reads) < AHEAD_ROWS and (not reads or not self._full()):
                    chunk, offset, length = self._plan[self._next]
                    self._next += 1
                    self._fetch_number += 1
                    self._asked[self._fetch_number] = length
                    numbers.append(self._fetch_number)
                    self._reserved += length  # so that what is asked stays within the bounds
                    reads.append(BlobRead(chunk, offset, length, functools.partial(
                        self._arrived, self._generation, self._fetch_number, chunk, offset)))
            try:
                started = self._start_reads(reads)
            except Exception:  # noqa: BLE001 - a bug in a source must not end fetching ahead for the whole job
                self._batch_failed(numbers)
                continue
            for read, read_started in zip(reads, started):
                if not read_started:  # stored on this node after all: its reader reads it from here
                    read.done(None, None)

    def _batch_failed(self, numbers: list[int]) -> None:
        """Forget a batch the source failed to start (a late answer to any of it is dropped): its readers fetch
        those blobs themselves, and the next batch is tried."""
        self.failed_batches += 1
        if self.failed_batches == 1:
            log.exception("fetching ahead for this node's readers failed; they fetch those %d blobs themselves",
                          len(numbers))
        with self._changed:
            for number in numbers:
                self._release(number)
            self._changed.notify_all()

    def _release(self, number: int) -> bool:
        """Ends fetch `number`'s reservation, once: False if it had ended already."""
        length = self._asked.pop(number, None)
        if length is None:
            return False
        self._reserved -= length
        return True

    def _full(self) -> bool:
        return self._held_bytes + self._reserved >= self._capacity or self._reserved >= self._in_flight

    def _arrived(self, generation: int, number: int, chunk: int, offset: int, blob: bytes | memoryview | None,
                 _error: ChunkError | None) -> None:
        """A fetch's outcome, from the MPI thread. A blob that did not come is left to its reader, which meets the
        error itself when it asks, and reports it."""
        with self._changed:
            if self._release(number) and blob is not None and generation == self._generation and not self._closed:
                self._held[(chunk, offset)] = blob
                self._held_bytes += len(blob)
                self.fetched += 1
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()


class NodeEndpoint:
    """Serves HELLO, READ and PLAN to this node's readers from a thread per connection."""

    def __init__(self, local_dir: Path, description: dict[str, Any], source: ChunkSource, blobs: BlobTable,
                 chunk_count: int) -> None:
        self.path = local_dir / SOCKET_NAME
        self._hello = json.dumps(description).encode()
        self._source = source
        self._blobs = blobs
        self._chunk_count = chunk_count
        self.ahead = BlobsAhead(source.start_reads)
        self.asked = 0
        self.path.unlink(missing_ok=True)  # left by a killed job
        endpoint = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                endpoint._serve(self.request)

        with unix_address(self.path) as address:
            self._server = socketserver.ThreadingUnixStreamServer(address, Handler)
        self._server.daemon_threads = True
        os.chmod(self.path, 0o600)  # this user's readers only
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="fanstore-node-endpoint", daemon=True)
        self._thread.start()

    def _serve(self, connection: socket.socket) -> None:
        stream = connection.makefile("rb")
        try:
            while True:
                header = stream.read(REQUEST.size)
                if len(header) < REQUEST.size:
                    return
                magic, kind, chunk, offset, length = REQUEST.unpack(header)
                if magic != REQUEST_MAGIC:
                    log.warning("a local reader sent a malformed request: connection closed")
                    return
                if kind == PLAN:
                    if length > MAX_PLAN_ROWS:
                        self._reply(connection, REFUSED, f"a plan of {length} rows is too long".encode())
                        return
                    raw = stream.read(length * PLAN_ROW.itemsize)
                    if len(raw) < length * PLAN_ROW.itemsize:
                        return
                    self.ahead.replace_plan(self._blobs_of(np.frombuffer(raw, dtype=PLAN_ROW)))
                    self._reply(connection, OK, b"")
                elif kind == HELLO:
                    self._reply(connection, OK, self._hello)
                elif kind == STATS:
                    self._reply(connection, OK, json.dumps(self.stats()).encode())
                elif kind == READ:
                    self._answer_read(connection, chunk, offset, length)
                else:
                    self._reply(connection, REFUSED, f"unknown request kind {kind}".encode())
        except OSError:
            return  # the reader went away
        finally:
            stream.close()
            connection.close()

    def stats(self) -> dict[str, int]:
        """The node's readers: blobs they asked for, blobs fetched ahead, and how many of their reads found one."""
        return {"asked": self.asked, "fetched_ahead": self.ahead.fetched, "ahead_hits": self.ahead.hits,
                "ahead_failed_batches": self.ahead.failed_batches}

    def _answer_read(self, connection: socket.socket, chunk: int, offset: int, length: int) -> None:
        self.asked += 1
        blob = self.ahead.take(chunk, offset)
        try:
            if blob is None or len(blob) != length:
                blob = self._read_checked(chunk, offset, length)
        except _Refused as exc:
            self._reply(connection, REFUSED, str(exc).encode())
        except ChunkCorrupt as exc:
            self._reply(connection, CORRUPT, str(exc).encode())
        except ChunkError as exc:
            self._reply(connection, UNAVAILABLE, str(exc).encode())
        else:
            self._reply(connection, OK, blob)

    def _blobs_of(self, plan: np.ndarray) -> list[tuple[int, int, int]]:
        """The plan's rows that name whole blobs of the dataset: no fetch ahead reads outside one."""
        return [(chunk, offset, length) for chunk, offset, length in plan.tolist()
                if self._blobs.blob_row(chunk, offset, length) is not None]

    def _read_checked(self, chunk: int, offset: int, length: int) -> bytes:
        """Whole blobs of the dataset only: a reader's request never reads outside one."""
        if not 0 <= chunk < self._chunk_count:
            raise _Refused(f"chunk {chunk} is not in the dataset")
        if self._blobs.blob_row(chunk, offset, length) is None:
            raise _Refused(f"chunk {chunk}: no blob of {length} bytes at offset {offset}")
        return self._source.read(chunk, offset, length)

    @staticmethod
    def _reply(connection: socket.socket, status: int, payload: bytes) -> None:
        connection.sendall(REPLY.pack(REPLY_MAGIC, status, len(payload)) + payload)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.ahead.close()
        self.path.unlink(missing_ok=True)


class _Refused(ChunkError):
    """A request for bytes that are not one blob of the dataset."""
