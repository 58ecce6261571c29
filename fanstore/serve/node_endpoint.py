"""The serve process's door for the training job's own readers on this node (fanstore.torch workers).

A reader reads chunks this node stores straight from its local directory; for the others it asks the serve process
here, over a Unix socket in that directory, and gets the stored blob (still compressed: the reader verifies and
decodes it, in parallel with the other workers). Each training process's epoch plan (the remote blobs in the order
its sampler drew) goes to the node's one holder of blobs fetched ahead (blobs_ahead.py), which the mount shares.
The wire format and its checks are node_protocol.py's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from ..core.chunk_source import BlobRead, ChunkSource
from ..core.descriptors import descriptor_limit, descriptors_in_use
from ..core.thread_names import name_os_thread
from ..errors import ChunkError
from .blobs_ahead import BlobsAhead, PlanRefused
from .blob_arena import BlobArena
from .node_protocol import (ARENA, COUNTS, HELLO, KIND_NAMES, LENT_MAX_BYTES, MAX_RETURNED, NO_ARENA, OK, PLAN,
                            PLAN_ROW, READ, READ_COUNTS, READS, READS_MAX_BLOBS, READS_MAX_BYTES, READS_ROW,
                            READS_SHARED, REFUSED, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, SHARED_ROW, TOKEN,
                            TURNED_AWAY, BlobLookup, Refused)
from .statuses import status_of

log = logging.getLogger("fanstore.serve")

SOCKET_NAME = "fanstore-node.sock"
UNIX_PATH_MAX = 108  # bytes of a Unix socket's path, its final NUL included (Linux's sockaddr_un)
ENVIRONMENT = "FANSTORE_SERVE_SOCKET"  # set for COMMAND; a job started otherwise sets it from the ready file
PLAN_PIECE_ROWS = 1 << 16  # plan rows read and checked at a time (1.5 MiB)
# How long a READS waits for the blobs it fetched before it reads the missing ones itself: every fetch has its own
# deadline (RemoteBlobs), so this only guards against a fetch that never answers.
READS_WAIT = 600.0
IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)
MAX_CONNECTIONS = 4096  # readers' connections at once, however many descriptors the process may open
# Bytes of blobs the node's connections answer at once, from reading a request to sending its reply: without it,
# each connection held up to READS_MAX_BYTES while its reader did not take the reply (30 connections asking one
# 15 kB blob 4,096 times each took a serve process from 64 MB to 1.9 GB). A reply not taken within SEND_TIMEOUT
# seconds closes its connection, so a reader that stops reading holds its share that long at most.
REPLY_BYTES = 256 << 20
SEND_TIMEOUT = 60.0
# How long a reader waits on one answer of the serve process before it takes it for stuck, at least (readers start
# with it, and take the node's own figure from HELLO: answer_within).
ANSWER_DEADLINE = 120.0
# How long the accepting thread waits before it accepts again when the process has no descriptor for a connection,
# doubling from the first to the last while none comes free: the listener stays readable, and polling it again at
# once took 85% of a core.
ACCEPT_BACKOFF = (0.01, 1.0)


def connection_limit() -> int:
    """Connections the endpoint takes at once: each costs a descriptor and a thread, and without a limit 1,100 idle
    ones took every descriptor of a 1,024 limit (the rank's own chunk reads failed, then its end). A quarter of the
    descriptors still free when the endpoint starts, the rest staying the process's (its chunk files, MPI's): a
    quarter of the limit itself (16 of 48) counted the 45 that MPI, FUSE and the arena hold already, so accept failed
    with EMFILE before the limit could turn anyone away."""
    limit = descriptor_limit()
    if limit is None:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, (limit - descriptors_in_use()) // 4))


class _Lent:
    """The blobs of the arena one connection's reader holds, by token: each keeps its slot from being used again
    until the reader gives the token back, or the connection closes (its process ended, however)."""

    def __init__(self) -> None:
        self.blobs: dict[int, list[memoryview]] = {}
        self.bytes: dict[int, int] = {}
        self.held = 0  # bytes lent and not given back
        self._next = 1

    def lend(self, blobs: list[memoryview], size: int) -> int:
        token, self._next = self._next, self._next + 1
        self.blobs[token], self.bytes[token] = blobs, size
        self.held += size
        return token

    def give_back(self, tokens: list[int]) -> None:
        """Refused for a token this connection does not hold (after giving back the others)."""
        unknown = [token for token in tokens if token not in self.blobs]
        for token in tokens:
            if self.blobs.pop(token, None) is not None:
                self.held -= self.bytes.pop(token)
        if unknown:
            raise Refused(f"token {unknown[0]}: not lent on this connection (given back twice, or never lent)")


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


def answer_within(peer_timeout: float, max_in_flight: int) -> float:
    """Seconds a node's readers wait on one answer before they take its serve process for stuck: longer than a
    working one ever makes them wait (a blob fetched behind `max_in_flight` other requests to its peer, each allowed
    `peer_timeout`, then read from DEST; room for its reply, which a reader not taking its own holds SEND_TIMEOUT at
    most), and ANSWER_DEADLINE at least. Told to readers in HELLO, so that a long --peer-timeout is no stuck node."""
    return max(ANSWER_DEADLINE, peer_timeout * (1 + max_in_flight) + SEND_TIMEOUT)


class NodeEndpoint:
    """Serves HELLO, READ, READS, PLAN and STATS to this node's readers from a thread per connection.

    What a connection can make this process hold is bounded by the dataset, never by what the reader claims: a
    request is checked field by field before use (node_protocol.BlobLookup), a plan is read and checked in pieces
    of PLAN_PIECE_ROWS rows, has at most as many rows as the dataset has blobs, and is kept as 4-byte blob rows of
    the remote blobs it names; it is given back when its process announces the next one or its connection
    closes. A refused request gets one reply that names the field at fault; the connection goes on unless what
    follows can no longer be told apart (a bad magic, a plan longer than the dataset)."""

    def __init__(self, local_dir: Path, description: dict[str, Any], source: ChunkSource, lookup: BlobLookup,
                 ahead: BlobsAhead, arena: BlobArena | None = None, max_connections: int | None = None) -> None:
        """`ahead`: the node's holder of blobs fetched ahead, the endpoint's plans' and the mount's (closed by its
        owner, the node). `arena`: the shared memory the rank receives remote blobs into, lent to readers that ask
        READS_SHARED (closed by its owner, the node). `max_connections`: connections served at once (default
        connection_limit())."""
        self.path = local_dir / SOCKET_NAME
        self._lookup = lookup
        # `blobs`: the longest plan taken (a reader cuts a longer order: a sampler may draw with replacement).
        self._hello = json.dumps({**description, "blobs": len(lookup)}).encode()
        self._source = source
        self._remote: np.ndarray | None = None  # per blob row: whether this node fetches it from a peer
        self._remote_lock = threading.Lock()
        self._refusals = 0  # requests refused; the first is logged
        self._refusals_lock = threading.Lock()  # and the lending and connection counters
        self.ahead = ahead
        self._arena = arena
        self._lent_blobs = self._inline_blobs = 0  # READS_SHARED's blobs read in the arena, and sent through the socket
        # What the node's readers read without this process, as they report it (COUNTS): local blobs and bytes, DEST
        # blobs and bytes.
        self._reader_counts = [0, 0, 0, 0]
        self._limit = connection_limit() if max_connections is None else max_connections
        self._replying = 0  # bytes of blobs being answered now, all connections together (REPLY_BYTES at most)
        self._reply_room = threading.Condition(threading.Lock())
        self._connections = self.turned_away = 0  # connections open now, and those refused for the limit
        self.out_of_descriptors = 0  # accepts that failed for want of a descriptor (EMFILE, ENFILE)
        self._accept_delay = ACCEPT_BACKOFF[0]  # the accepting thread's alone
        self.path.unlink(missing_ok=True)  # left by a killed job
        endpoint = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                name_os_thread("node-client")
                endpoint._serve(self.request)

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

            def get_request(self) -> tuple[socket.socket, Any]:
                try:
                    request = super().get_request()
                except OSError as exc:  # socketserver goes on to its next poll
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        endpoint._out_of_descriptors(self.socket)
                    raise
                endpoint._accept_delay = ACCEPT_BACKOFF[0]
                if endpoint._spare is None:  # taken again once descriptors come back (an open only while none)
                    endpoint._spare = _spare_descriptor()
                return request

            def verify_request(self, request: Any, client_address: Any) -> bool:
                return endpoint._admit(request)

            def handle_error(self, request: Any, client_address: Any) -> None:
                log.warning("a reader's connection to this node's serve process failed: %r", sys.exc_info()[1])

        with unix_address(self.path) as address:
            self._server = Server(address, Handler)
        os.chmod(self.path, 0o600)  # this user's readers only
        self._spare = _spare_descriptor()  # given up to accept a reader only to say it has none (the thread's alone)
        self._thread = threading.Thread(target=self._accept, name="fanstore-node-endpoint", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        name_os_thread()
        self._server.serve_forever(poll_interval=0.5)

    def _admit(self, connection: socket.socket) -> bool:
        """Whether a new connection is served (its thread starts); past the limit it is told why and closed."""
        with self._refusals_lock:
            admitted = self._connections < self._limit
            self._connections += admitted
            self.turned_away += not admitted
            first = self.turned_away == 1
        if admitted:
            return True
        reason = (f"this node's serve process takes {self._limit} reader connections at once, and has as many "
                  "(a quarter of the descriptors it had free: raise `ulimit -n` for more)")
        _turn_away(connection, reason)
        if first:
            log.warning("%s (--stats counts the connections turned away)", reason)
        return False

    def _out_of_descriptors(self, listener: socket.socket) -> None:
        """accept failed for want of a descriptor: the reader first in line is told so at once, through the spare
        descriptor given back for it (it waited on its first reply for good); with none spare, the accepting thread
        backs off. Logged once, counted (--stats)."""
        with self._refusals_lock:
            self.out_of_descriptors += 1
            first = self.out_of_descriptors == 1
        reason = (f"this node's serve process is out of file descriptors (`ulimit -n`: {descriptor_limit()}): "
                  "raise `ulimit -n` for the job")
        if first:
            log.warning("%s (--stats counts the connections turned away for it)", reason)
        if self._spare is not None:
            os.close(self._spare)
            try:
                connection, _ = listener.accept()  # the one waiting: the listener polled readable
            except OSError:
                connection = None
            if connection is not None:
                _turn_away(connection, reason)
                connection.close()
            self._spare = _spare_descriptor()  # the descriptor just given back, unless another thread took it
            if connection is not None:
                return
        time.sleep(self._accept_delay)
        self._accept_delay = min(2 * self._accept_delay, ACCEPT_BACKOFF[1])

    def _serve(self, connection: socket.socket) -> None:
        """One connection's requests, in turn, until it closes; then its plan is given back."""
        holder = id(connection)  # its plans' holder: unique while it is open, and they go before it closes
        lent = _Lent()  # dropped with the connection: its slots come back
        stream = connection.makefile("rb")
        # Sends alone time out (an idle reader between requests is no fault): a reply not taken ends the connection.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0))
        try:
            process = _peer_process(connection)
            while True:
                header = stream.read(REQUEST.size)
                if len(header) < REQUEST.size:
                    return
                try:
                    if not self._answer(connection, stream, holder, process, lent, *REQUEST.unpack(header)):
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
            with self._refusals_lock:
                self._connections -= 1

    def _answer(self, connection: socket.socket, stream: BinaryIO, holder: int, process: int, lent: _Lent,
                magic: bytes, kind: int, chunk: int, offset: int, length: int) -> bool:
        """Answer one request; False when the connection ended in the middle of it. Refused for a bad one."""
        if magic != REQUEST_MAGIC:
            raise Refused(f"magic {magic!r}: a request starts with {REQUEST_MAGIC!r}", fatal=True)
        if kind not in KIND_NAMES:
            raise Refused(f"kind {kind}: the kinds are " + ", ".join(f"{k} {n}" for k, n in KIND_NAMES.items()))
        if kind == READ:
            self._answer_read(connection, self._lookup.read_row(chunk, offset, length), length)
            return True
        if kind == READS_SHARED:
            return self._answer_reads_shared(connection, stream, lent, chunk, offset, length)
        if kind == COUNTS:
            return self._take_counts(connection, stream, chunk, offset, length)
        rows_follow = kind in (PLAN, READS)
        unused = {"chunk": chunk, "offset": offset} if rows_follow else \
            {"chunk": chunk, "offset": offset, "length": length}
        for field, value in unused.items():
            if value:
                raise Refused(f"{field} {value}: {KIND_NAMES[kind]} takes 0 there", fatal=rows_follow)
        if kind == PLAN:
            return self._take_plan(connection, stream, holder, process, length)
        if kind == READS:
            return self._answer_reads(connection, stream, length)
        if kind == ARENA:
            self._answer_arena(connection)
            return True
        self._reply(connection, OK, self._hello if kind == HELLO else json.dumps(self.stats()).encode())
        return True

    def _take_counts(self, connection: socket.socket, stream: BinaryIO, chunk: int, offset: int, length: int) -> bool:
        """A reader's own reads since its last COUNTS, added to the node's for --stats. False when the connection
        ended in the middle of it."""
        if chunk or offset or length != READ_COUNTS.size:
            raise Refused(f"COUNTS takes chunk 0, offset 0 and length {READ_COUNTS.size} (got {chunk}, {offset}, "
                          f"{length})", fatal=True)
        raw = stream.read(READ_COUNTS.size)
        if len(raw) < READ_COUNTS.size:
            return False
        counts = READ_COUNTS.unpack(raw)
        if max(counts) >= 1 << 53:
            raise Refused(f"COUNTS value {max(counts)}: each is below 2^53")
        with self._refusals_lock:
            self._reader_counts = [total + count for total, count in zip(self._reader_counts, counts)]
        self._reply(connection, OK, b"")
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
            refusals, lent, not_lent = self._refusals, self._lent_blobs, self._inline_blobs
            local, local_bytes, dest, dest_bytes = self._reader_counts
            turned_away, out_of_descriptors = self.turned_away, self.out_of_descriptors
        arena = self._arena.stats() if self._arena is not None else {}
        return {**self.ahead.stats(), "refused": refusals, "lent": lent, "not_lent": not_lent,
                "readers_local": local, "readers_local_bytes": local_bytes, "readers_dest": dest,
                "readers_dest_bytes": dest_bytes,
                "turned_away": turned_away, "out_of_descriptors": out_of_descriptors, **arena}

    def _answer_read(self, connection: socket.socket, row: int, length: int) -> None:
        with self._room_for(length):
            blob = self.ahead.take(row)
            try:
                if blob is None or len(blob) != length:
                    blob = self._source.read(*self._lookup.locate(row))
            except ChunkError as exc:
                self._reply(connection, status_of(exc), str(exc).encode())
            else:
                self._reply(connection, OK, blob)

    @contextlib.contextmanager
    def _room_for(self, size: int) -> Iterator[None]:
        """Hold `size` bytes of REPLY_BYTES while a request is answered, waiting while other connections' replies
        hold them; Refused after READS_WAIT (the node is that busy, or its readers have stopped taking replies). A
        blob larger than REPLY_BYTES (a file stored whole, however large) takes all of it, alone."""
        size = min(size, REPLY_BYTES)
        with self._reply_room:
            if not self._reply_room.wait_for(lambda: self._replying + size <= REPLY_BYTES, READS_WAIT):
                raise Refused(f"the node's readers are sent {REPLY_BYTES} bytes of replies at once, and have been "
                              f"for {READS_WAIT:g} s")
            self._replying += size
        try:
            yield
        finally:
            with self._reply_room:
                self._replying -= size
                self._reply_room.notify_all()

    def _answer_arena(self, connection: socket.socket) -> None:
        """The arena's descriptor (SCM_RIGHTS) with the reply's first bytes; REFUSED where this node has none."""
        if self._arena is None:
            raise Refused(NO_ARENA)
        payload = json.dumps({"size": self._arena.size}).encode()
        message = REPLY.pack(REPLY_MAGIC, OK, len(payload)) + payload
        sent = socket.send_fds(connection, [message], [self._arena.reader_fd])
        if sent < len(message):
            connection.sendall(message[sent:])

    def _answer_reads_shared(self, connection: socket.socket, stream: BinaryIO, lent: _Lent, returned: int,
                             offset: int, count: int) -> bool:
        """A READS whose blobs in the arena are lent, not sent: the reader reads them where they lie, through its
        mapping. The tokens it gives back come first. False when the connection ended in the middle of it."""
        if self._arena is None:
            raise Refused(NO_ARENA, fatal=True)
        if offset:
            raise Refused(f"offset {offset}: READS_SHARED takes 0 there", fatal=True)
        if not 1 <= count <= READS_MAX_BLOBS:
            raise Refused(f"length {count}: a READS_SHARED asks for 1 to {READS_MAX_BLOBS} blobs", fatal=True)
        if returned > MAX_RETURNED:
            raise Refused(f"chunk {returned}: a READS_SHARED gives back 0 to {MAX_RETURNED} tokens", fatal=True)
        raw = stream.read(count * PLAN_ROW.itemsize + returned * TOKEN.size)
        if len(raw) < count * PLAN_ROW.itemsize + returned * TOKEN.size:
            return False
        lent.give_back(np.frombuffer(raw, dtype="<u8", offset=count * PLAN_ROW.itemsize).tolist())
        rows, lengths, total = self._checked(np.frombuffer(raw, dtype=PLAN_ROW, count=count), "READS_SHARED")
        with self._room_for(total):
            self._lend_or_send(connection, lent, rows, lengths)
        return True

    def _lend_or_send(self, connection: socket.socket, lent: _Lent, rows: list[int], lengths: list[int]) -> None:
        """READS_SHARED's reply: the blobs that lie in the arena lent (a token and their places), the others sent."""
        count = len(rows)
        statuses, blobs = self._gather(rows, lengths)
        table = np.zeros(count, dtype=SHARED_ROW)
        table["status"] = statuses
        table["length"] = [len(blob) for blob in blobs]
        places = [-1] * count
        lending: list[memoryview] = []
        lending_bytes = 0
        inline: list[bytes | memoryview] = []
        place_of, room = self._arena.place, LENT_MAX_BYTES - lent.held
        for number, (status, blob) in enumerate(zip(statuses, blobs)):
            place = place_of(blob) if status == OK and lending_bytes + len(blob) <= room else -1
            if place >= 0:
                places[number] = place
                lending.append(blob)  # type: ignore[arg-type]
                lending_bytes += len(blob)
            else:
                inline.append(blob)
        table["place"] = places
        token = lent.lend(lending, lending_bytes) if lending else 0
        with self._refusals_lock:
            self._lent_blobs += len(lending)
            self._inline_blobs += count - len(lending)
        size = TOKEN.size + table.nbytes + sum(len(blob) for blob in inline)
        _send_buffers(connection, [REPLY.pack(REPLY_MAGIC, OK, size), TOKEN.pack(token), table.tobytes(), *inline])

    def _answer_reads(self, connection: socket.socket, stream: BinaryIO, count: int) -> bool:
        """Several blobs in one round trip (a DataLoader batch's, a prefetch window's): each taken from the holder
        (waiting for one on its way) or fetched now, each peer's together in one request; the reply sends them
        as they lie, with no copy into one buffer. False when the connection ended in the middle of it."""
        if not 1 <= count <= READS_MAX_BLOBS:
            raise Refused(f"length {count}: a READS asks for 1 to {READS_MAX_BLOBS} blobs", fatal=True)
        raw = stream.read(count * PLAN_ROW.itemsize)
        if len(raw) < count * PLAN_ROW.itemsize:
            return False
        rows, lengths, total = self._checked(np.frombuffer(raw, dtype=PLAN_ROW), "READS")
        with self._room_for(total):
            statuses, blobs = self._gather(rows, lengths)
            table = np.empty(count, dtype=READS_ROW)
            table["status"] = statuses
            table["length"] = [len(blob) for blob in blobs]
            header = REPLY.pack(REPLY_MAGIC, OK, table.nbytes + int(table["length"].sum()))
            _send_buffers(connection, [header, table.tobytes(), *blobs])
        return True

    def _checked(self, asked: np.ndarray, kind: str) -> tuple[list[int], list[int], int]:
        """A READS' or READS_SHARED's rows, checked: each one's blob row and length, and their bytes in all.
        Refused by row, or for asking more than READS_MAX_BYTES in all (the connection goes on: the request was
        read whole)."""
        rows = self._lookup.plan_rows(asked, 0, f"{kind} row")
        total = int(asked["length"].sum())
        if total > READS_MAX_BYTES:
            raise Refused(f"a {kind} of {total} bytes: at most {READS_MAX_BYTES} bytes of blobs a request")
        return rows.tolist(), asked["length"].tolist(), total

    def _gather(self, rows: list[int], lengths: list[int]) -> tuple[list[int], list[bytes | memoryview]]:
        """Each blob's status and bytes (its blob, or the reason it failed). Blobs fetched ahead or on their way
        come from the holder; the others this node gets from peers are asked for together (ChunkSource.start_reads)
        and come on the MPI thread; all are waited for at once, and whatever did not come is read here, the usual
        way (DEST behind a peer)."""
        count = len(rows)
        blobs: list[bytes | memoryview | None] = [None] * count
        statuses = [int(OK)] * count
        waiting = [count + 1]  # and this thread's own share, given back once every fetch was started
        lock = threading.Lock()
        all_here = threading.Event()

        def deliver(number: int, blob: bytes | memoryview | None, _error: ChunkError | None = None) -> None:
            if number >= 0:
                blobs[number] = blob
            with lock:
                waiting[0] -= 1
                if waiting[0] == 0:
                    all_here.set()

        remote = self._remote_blobs()
        reads: list[BlobRead] = []
        read_numbers: list[int] = []
        for number, (row, length, claimed) in enumerate(zip(rows, lengths, self.ahead.claim_many(rows, deliver))):
            if claimed:
                continue
            if row < 0:
                statuses[number] = int(REFUSED)
                deliver(number, b"no blob of %d bytes there" % length)
            elif remote[row]:
                reads.append(BlobRead(*self._lookup.locate(row), functools.partial(deliver, number)))
                read_numbers.append(number)
            else:
                deliver(number, None)  # this node's own: read below
        if reads:
            for number, started in zip(read_numbers, self._source.start_reads(reads)):
                if not started:
                    deliver(number, None)
        deliver(-1, None)  # this thread's share: every blob was claimed, asked for or settled above
        all_here.wait(READS_WAIT)
        for number, (row, length) in enumerate(zip(rows, lengths)):
            blob = blobs[number]
            if statuses[number] == OK and (blob is None or len(blob) != length):
                try:
                    blobs[number] = self._source.read(*self._lookup.locate(row))
                except ChunkError as exc:
                    statuses[number], blobs[number] = int(status_of(exc)), str(exc).encode()
        return statuses, blobs  # type: ignore[return-value]

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
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        self.path.unlink(missing_ok=True)


def _spare_descriptor() -> int | None:
    """A descriptor held for the moment the process has no other: None where it has none to hold."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _turn_away(connection: socket.socket, reason: str) -> None:
    """A TURNED_AWAY reply naming `reason`, left in the socket for the reader's first request (the connection is
    closed after it): a reader tells it from a refusal of that request, whichever it was; never blocks the accepting
    thread."""
    payload = reason.encode()
    try:
        connection.send(REPLY.pack(REPLY_MAGIC, TURNED_AWAY, len(payload)) + payload, socket.MSG_DONTWAIT)
    except OSError:
        pass


def _send_buffers(connection: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """sendall of several buffers with sendmsg: the kernel gathers them, no copy into one."""
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    first = 0
    while first < len(views):
        sent = connection.sendmsg(views[first : first + IOV_MAX])
        while sent:
            if sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


def _peer_process(connection: socket.socket) -> int:
    """The process at the other end of a Unix socket (SO_PEERCRED): a training process's plan is its own, whichever
    of its connections brought it."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[0]
