"""The serve process's door for the training job's own readers on this node (fanstore.torch workers).

A reader reads chunks this node stores straight from its local directory; for the others it asks the serve process
here, over a Unix socket in that directory, and gets the stored blob (still compressed: the reader verifies and
decodes it, in parallel with the other workers). Each training process's epoch plan (the remote blobs in the order
its sampler drew) goes to the node's one holder of blobs fetched ahead (blobs_ahead.py), which the mount shares.
The wire format and its checks are node_protocol.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from ..chunk_source import ChunkSource
from ..errors import ChunkError
from .blobs_ahead import BlobsAhead, PlanRefused
from .node_protocol import (HELLO, KIND_NAMES, OK, PLAN, PLAN_ROW, READ, REFUSED, REPLY, REPLY_MAGIC, REQUEST,
                            REQUEST_MAGIC, BlobLookup, Refused)
from .statuses import status_of

log = logging.getLogger("fanstore.serve")

SOCKET_NAME = "fanstore-node.sock"
UNIX_PATH_MAX = 108  # bytes of a Unix socket's path, its final NUL included (Linux's sockaddr_un)
ENVIRONMENT = "FANSTORE_SERVE_SOCKET"  # set for COMMAND; a job started otherwise sets it from the ready file
PLAN_PIECE_ROWS = 1 << 16  # plan rows read and checked at a time (1.5 MiB)


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


class NodeEndpoint:
    """Serves HELLO, READ, PLAN and STATS to this node's readers from a thread per connection.

    What a connection can make this process hold is bounded by the dataset, never by what the reader claims: a
    request is checked field by field before use (node_protocol.BlobLookup), a plan is read and checked in pieces
    of PLAN_PIECE_ROWS rows, has at most as many rows as the dataset has blobs, and is kept as 4-byte blob rows of
    the remote blobs it names; it is given back when its process announces the next one or its connection
    closes. A refused request gets one reply that names the field at fault; the connection goes on unless what
    follows can no longer be told apart (a bad magic, a plan longer than the dataset)."""

    def __init__(self, local_dir: Path, description: dict[str, Any], source: ChunkSource, lookup: BlobLookup,
                 ahead: BlobsAhead) -> None:
        """`ahead`: the node's holder of blobs fetched ahead, the endpoint's plans' and the mount's (closed by its
        owner, the node)."""
        self.path = local_dir / SOCKET_NAME
        self._lookup = lookup
        # `blobs`: the longest plan taken (a reader cuts a longer order: a sampler may draw with replacement).
        self._hello = json.dumps({**description, "blobs": len(lookup)}).encode()
        self._source = source
        self._remote: np.ndarray | None = None  # per blob row: whether this node fetches it from a peer
        self._remote_lock = threading.Lock()
        self._refusals = 0  # requests refused; the first is logged
        self._refusals_lock = threading.Lock()
        self.ahead = ahead
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
        """One connection's requests, in turn, until it closes; then its plan is given back."""
        holder = id(connection)  # its plans' holder: unique while it is open, and they go before it closes
        stream = connection.makefile("rb")
        try:
            process = _peer_process(connection)
            while True:
                header = stream.read(REQUEST.size)
                if len(header) < REQUEST.size:
                    return
                try:
                    if not self._answer(connection, stream, holder, process, *REQUEST.unpack(header)):
                        return
                except Refused as refused:
                    self._refused(connection, refused)
                    if refused.fatal:
                        return
        except OSError:
            return  # the reader went away
        finally:
            self.ahead.drop_plans_of(holder)
            stream.close()
            connection.close()

    def _answer(self, connection: socket.socket, stream: BinaryIO, holder: int, process: int, magic: bytes,
                kind: int, chunk: int, offset: int, length: int) -> bool:
        """Answer one request; False when the connection ended in the middle of it. Refused for a bad one."""
        if magic != REQUEST_MAGIC:
            raise Refused(f"magic {magic!r}: a request starts with {REQUEST_MAGIC!r}", fatal=True)
        if kind not in KIND_NAMES:
            raise Refused(f"kind {kind}: the kinds are " + ", ".join(f"{k} {n}" for k, n in KIND_NAMES.items()))
        if kind == READ:
            self._answer_read(connection, self._lookup.read_row(chunk, offset, length), length)
            return True
        unused = {"chunk": chunk, "offset": offset} if kind == PLAN else \
            {"chunk": chunk, "offset": offset, "length": length}
        for field, value in unused.items():
            if value:
                raise Refused(f"{field} {value}: {KIND_NAMES[kind]} takes 0 there", fatal=kind == PLAN)
        if kind == PLAN:
            return self._take_plan(connection, stream, holder, process, length)
        self._reply(connection, OK, self._hello if kind == HELLO else json.dumps(self.stats()).encode())
        return True

    def _take_plan(self, connection: socket.socket, stream: BinaryIO, holder: int, process: int,
                   rows: int) -> bool:
        """Read a plan of `rows` rows piece by piece; keep the rows that name remote blobs, as blob rows, as
        `process`'s plan. False when the connection ended in the middle of it."""
        if rows > len(self._lookup):
            raise Refused(f"length {rows}: a plan has at most as many rows as the dataset has blobs "
                          f"({len(self._lookup)})", fatal=True)
        remote = self._remote_blobs()
        kept: list[np.ndarray] = []
        refused: Refused | None = None
        for first in range(0, rows, PLAN_PIECE_ROWS):
            count = min(PLAN_PIECE_ROWS, rows - first)
            raw = stream.read(count * PLAN_ROW.itemsize)
            if len(raw) < count * PLAN_ROW.itemsize:
                return False
            if refused is not None:
                continue  # read to its end, so that the connection goes on after the one reply
            try:
                found = self._lookup.plan_rows(np.frombuffer(raw, dtype=PLAN_ROW), first)
            except Refused as exc:
                refused, kept = exc, []
                continue
            found = found[found >= 0]
            kept.append(found[remote[found]].astype(self._lookup.row_dtype))
        if refused is not None:
            raise refused
        try:
            self.ahead.replace_plan(process, holder, np.concatenate(kept) if kept else
                                    np.empty(0, dtype=self._lookup.row_dtype))
        except PlanRefused as exc:
            raise Refused(str(exc)) from None
        self._reply(connection, OK, b"")
        return True

    def _remote_blobs(self) -> np.ndarray:
        """Per blob row, whether this node gets it from a peer: worked out once, at the first plan."""
        with self._remote_lock:
            if self._remote is None:
                blobs = self._lookup.blobs
                self._remote = self._source.may_block(blobs.chunk.astype(np.int64), blobs.offset.astype(np.int64))
            return self._remote

    def stats(self) -> dict[str, Any]:
        """The node's readers: blobs they asked for, blobs fetched ahead, how many of their reads found one, and
        each plan's counters (by the process that announced it)."""
        with self._refusals_lock:
            refusals = self._refusals
        return {**self.ahead.stats(), "refused": refusals}

    def _answer_read(self, connection: socket.socket, row: int, length: int) -> None:
        blob = self.ahead.take(row)
        try:
            if blob is None or len(blob) != length:
                blob = self._source.read(*self._lookup.locate(row))
        except ChunkError as exc:
            self._reply(connection, status_of(exc), str(exc).encode())
        else:
            self._reply(connection, OK, blob)

    def _refused(self, connection: socket.socket, refused: Refused) -> None:
        with self._refusals_lock:
            self._refusals += 1
            first = self._refusals == 1
        if first:
            log.warning("a reader on this node sent a request the node does not take: %s (--stats counts any more)",
                        refused)
        self._reply(connection, REFUSED, str(refused).encode())

    @staticmethod
    def _reply(connection: socket.socket, status: int, payload: bytes | memoryview) -> None:
        connection.sendall(REPLY.pack(REPLY_MAGIC, status, len(payload)) + payload)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def _peer_process(connection: socket.socket) -> int:
    """The process at the other end of a Unix socket (SO_PEERCRED): a training process's plan is its own, whichever
    of its connections brought it."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[0]
