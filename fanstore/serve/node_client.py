"""A reader's side of a `fanstore serve` node (fanstore.torch workers): the index and the chunks this node stores are
read from its local directory, the other chunks through the node's serve process (node_endpoint), never through
FUSE; DEST only when those fail.

Imports nothing of MPI: a DataLoader worker is not an MPI process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..core.api import Dataset
from ..core.chunk_source import ChunkSource, FallbackChunkSource, LocalChunkSource
from ..errors import ChunkError, ChunkUnavailable, DatasetNotFound, UsageError
from ..core.format import FLAG_BLOCKED, INDEX_NAME
from ..core.index import Index
from .blob_arena import ArenaView
from .node_endpoint import ANSWER_DEADLINE, ENVIRONMENT, unix_address
from .node_protocol import (ARENA, COUNTS, HELLO, MAX_RETURNED, OK, PLAN, PLAN_ROW, READ, READS, READS_MAX_BLOBS,
                            READS_MAX_BYTES, READS_ROW, READS_SHARED, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC,
                            SHARED_ROW, STATS, TOKEN, TURNED_AWAY)
from .placement import NO_OWNER, ChunkOwners
from .reader_counts import DEST, LOCAL, ReaderCounts
from .staged_source import PlacedReads, StagedChunkSource
from .statuses import status_error

log = logging.getLogger("fanstore.serve")

# What each request asks of the serve process, for the message of one whose connection it turned away.
_ASKED = {HELLO: "to describe its dataset", READ: "to read a blob", PLAN: "to take this process's epoch plan",
          STATS: "to give its counters", READS: "to read blobs", ARENA: "to lend its arena",
          READS_SHARED: "to read blobs", COUNTS: "to take this reader's counts"}


class TurnedAway(ChunkUnavailable):
    """The serve process turned this thread's connection away (past its connection limit, out of descriptors) and
    closed it, whatever was asked: the message names its reason; the next request opens a new connection."""


class _Link:
    """One thread's socket to the serve process, with what it was lent: the tokens of replies whose blobs are still
    in use, and those to give back with its next request."""

    __slots__ = ("socket", "returned", "lent", "closing")

    def __init__(self, connection: socket.socket) -> None:
        self.socket = connection
        self.returned: deque[int] = deque()
        self.lent = 0  # replies lent on it whose views live
        self.closing = False  # closed once they are gone (closing the socket would let their slots be reused)


class NodeConnection:
    """One socket to the serve process per thread (requests and replies alternate on a socket), and the node's
    arena mapped once for them all."""

    def __init__(self, path: str, deadline: float = ANSWER_DEADLINE) -> None:
        """`deadline`: seconds each wait on the serve process may last; once one passed, this process asks it
        nothing more (each ask is ChunkUnavailable at once: its reads go to DEST)."""
        self.path = path
        # The sockets' kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO), set once a socket: a request costs no more calls.
        self._deadline = struct.pack("ll", int(deadline), int(deadline % 1 * 1e6))
        self.deadline = deadline
        self._silent: str | None = None  # why this process asks the serve process nothing more
        self._local = threading.local()
        self._links: set[_Link] = set()  # every thread's, for close
        # Reentrant: a lent reply's last view may go, and give its token back, in any code, this lock's too.
        self._lock = threading.RLock()
        self._closed = False
        self._arena: ArenaView | None = None
        self._arena_asked = False
        self._arena_lock = threading.Lock()

    def answer_within(self, deadline: float) -> None:
        """Wait `deadline` seconds for each answer from now on (the node's figure, from HELLO), on sockets open
        already too."""
        self._deadline = struct.pack("ll", int(deadline), int(deadline % 1 * 1e6))
        self.deadline = deadline
        with self._lock:
            links = list(self._links)
        for link in links:
            try:
                link.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._deadline)
                link.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._deadline)
            except OSError:
                pass  # closed meanwhile: its next ask opens another, with the new deadline

    def _link(self) -> _Link:
        if self._closed:
            raise ChunkUnavailable(f"{self.path}: the connection to the node's serve process is closed")
        if self._silent is not None:
            raise ChunkUnavailable(self._silent)
        link = getattr(self._local, "link", None)
        if link is None:
            try:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as exc:
                raise ChunkUnavailable(f"{self.path}: cannot reach the node's serve process: {exc.strerror} (this "
                                       f"process's `ulimit -n`)") from None
            try:
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._deadline)
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._deadline)  # connect's too
                with unix_address(Path(self.path)) as address:
                    connection.connect(address)
            except OSError as exc:
                connection.close()
                # (a name too long for a Unix socket, even through its directory's descriptor, has no strerror)
                raise self._unanswered(exc, f"cannot reach the node's serve process: {exc.strerror or exc}") from None
            link = _Link(connection)
            with self._lock:
                if self._closed:
                    connection.close()
                    raise ChunkUnavailable(f"{self.path}: the connection to the node's serve process is closed")
                self._links.add(link)
            self._local.link = link
        return link

    def _socket(self) -> socket.socket:
        return self._link().socket

    def _drop(self, connection: socket.socket) -> None:
        """This thread's socket failed: closed at once (the serve process gave back whatever it lent on it when it
        went, or sees it go now; a view still held reads what the slot holds until it is used again, and this
        thread reads nothing more through it)."""
        link = self._local.link
        self._local.link = None
        with self._lock:
            self._links.discard(link)
        connection.close()

    def _unanswered(self, exc: OSError, otherwise: str) -> ChunkUnavailable:
        """The error of a wait that failed: past its deadline, the serve process is not answering, and this process
        asks it nothing more (every other thread's next ask fails at once, not after a deadline of its own)."""
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK) and not isinstance(exc, TimeoutError):
            return ChunkUnavailable(f"{self.path}: {otherwise}")
        self._silent = (f"{self.path}: the node's serve process has not answered for {self.deadline:g} s: it may be "
                        f"out of file descriptors (its log says so; raise `ulimit -n` for the job) or stopped; this "
                        f"process asks it nothing more")
        return ChunkUnavailable(self._silent)

    def lent_reply(self) -> Callable[[int], None]:
        """Count a reply lent on this thread's socket; returns what its views' finalizer calls with its token."""
        link = getattr(self._local, "link", None) or self._link()  # the socket the reply came on, whatever came since
        with self._lock:
            link.lent += 1

        def given_back(token: int) -> None:
            with self._lock:
                link.lent -= 1
                link.returned.append(token)
                if link.closing and not link.lent:
                    link.socket.close()

        return given_back

    def returned(self) -> deque[int]:
        """This thread's tokens of lent replies whose views are gone, to give back on its socket (the one that lent
        them: a new socket starts with none, its old one's went with it)."""
        return self._link().returned

    def arena(self) -> ArenaView | None:
        """The node's arena mapped read-only, asked for once (the process's other threads wait for that answer);
        None where the node has none."""
        with self._arena_lock:
            if not self._arena_asked:
                self._arena = self._ask_arena()
                self._arena_asked = True
            return self._arena

    def _ask_arena(self) -> ArenaView | None:
        """The node's arena, None where it has none (REFUSED: READS, then); ChunkUnavailable where it could not be
        asked, the connection turned away too (the arena is asked again on the next connection)."""
        status, payload, fds = self._request(ARENA, descriptors=1)
        try:
            return _map_arena(self.path, fds[0], bytes(payload)) if status == OK and fds else None
        finally:
            for fd in fds:
                os.close(fd)

    def refusal(self, what: str, reason: str) -> str:
        """The message for a request the serve process refused (`what` it refused, "to describe its dataset"), its
        reason said: a connection turned away, past the node's limit or out of descriptors, names why."""
        return f"{self.path}: the node's serve process refused {what}: {reason}"

    def close(self) -> None:
        """Close every thread's socket; asking after it is ChunkUnavailable. A socket on which blobs are lent and
        still in use closes once they are gone: the serve process gives a closed connection's slots back, to be
        received into again, and a decoder must not read them then. Only this process's descriptors close (no
        shutdown): a forked child closing what it inherited leaves its parent's connections alone."""
        with self._lock:
            self._closed = True
            links, self._links = self._links, set()
            for link in links:
                if link.lent:
                    link.closing = True
                else:
                    link.socket.close()

    def ask(self, kind: int, chunk: int = 0, offset: int = 0, length: int = 0, payload: bytes = b"") -> \
            tuple[int, bytes]:
        """The reply's status and payload; ChunkUnavailable where there is none (TurnedAway, naming the node's
        reason, where the node turned this thread's connection away: the next ask opens another)."""
        status, reply = self.ask_view(kind, chunk, offset, length, payload)
        return status, bytes(reply)

    def ask_view(self, kind: int, chunk: int = 0, offset: int = 0, length: int = 0, payload: bytes = b"") -> \
            tuple[int, memoryview]:
        """`ask`, the payload as a view of the buffer it was received into: blobs are not copied again."""
        status, reply, _ = self._request(kind, chunk, offset, length, payload)
        return status, reply

    def _request(self, kind: int, chunk: int = 0, offset: int = 0, length: int = 0, payload: bytes = b"",
                 descriptors: int = 0) -> tuple[int, memoryview, list[int]]:
        """A request on this thread's socket and its reply (`_exchange`'s), whatever its kind: the one place a
        connection that cannot go on is dropped and said so, the next request opening another. One that failed is
        ChunkUnavailable; one the node turned away is TurnedAway naming the node's reason, where a refusal of the
        request itself (REFUSED) is returned and the connection goes on."""
        connection = self._socket()
        try:
            status, reply, fds = self._exchange(connection, REQUEST.pack(REQUEST_MAGIC, kind, chunk, offset, length)
                                                + payload, descriptors)
        except OSError as exc:
            self._drop(connection)
            raise self._unanswered(exc, f"the node's serve process did not answer: {exc}") from None
        if status != TURNED_AWAY:
            return status, reply, fds
        for fd in fds:
            os.close(fd)
        self._drop(connection)  # the node closed it after its reason
        raise TurnedAway(self.refusal(_ASKED[kind], bytes(reply).decode("utf-8", "replace")))

    @staticmethod
    def _exchange(connection: socket.socket, request: bytes, descriptors: int = 0) -> \
            tuple[int, memoryview, list[int]]:
        """Send a request and read its reply: its status, its payload (a refusal's reason where not OK) and the
        descriptors it carried (at most `descriptors`; the caller closes them). The one place a reply is read: a
        connection turned away may be closed before the request goes, and its TURNED_AWAY reply waits to be read all
        the same, so a send that finds it closed is not the error."""
        try:
            connection.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us: a connection turned away has its reason waiting to be read
        fds: list[int] = []
        header: bytes | memoryview
        try:
            if descriptors:
                header, fds, _, _ = socket.recv_fds(connection, REPLY.size, descriptors)
                if len(header) < REPLY.size:
                    header += bytes(_receive(connection, REPLY.size - len(header)))
            else:
                header = _receive(connection, REPLY.size)
            magic, status, size = REPLY.unpack(header)
            if magic != REPLY_MAGIC:
                raise ConnectionError("a malformed reply")
            return status, _receive(connection, size), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise


def _map_arena(path: str, fd: int, description: bytes) -> ArenaView | None:
    """The arena the serve process sent, mapped; None (blobs then come through the socket) where it cannot be: a
    mapping this process is refused (its address space, say) is not a serve process that does not answer."""
    try:
        return ArenaView(fd, int(json.loads(description)["size"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: the node's arena cannot be mapped here (%s); remote blobs come through the socket", path, exc)
        return None


def _receive(connection: socket.socket, size: int) -> memoryview:
    view = memoryview(np.empty(size, np.uint8))  # not zeroed: a batch's megabytes, every byte received into
    got = 0
    while got < size:
        count = connection.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("the serve process closed the connection")
        got += count
    return view


class NodeServeSource(ChunkSource):
    """Blobs asked of the node's serve process (which gets each from its owner over MPI, or from DEST)."""

    def __init__(self, connection: NodeConnection) -> None:
        self.connection = connection

    def read(self, chunk_id: int, offset: int, length: int) -> memoryview:
        try:
            status, payload = self.connection.ask_view(READ, chunk_id, offset, length)
        except ChunkUnavailable as exc:
            raise _not_answered(exc, chunk_id, offset) from None
        if status == OK:
            return payload
        raise status_error(status, bytes(payload).decode("utf-8", "replace"), chunk_id)

    def read_many(self, blobs: Sequence[tuple[int, int, int]]) -> list[bytes | memoryview | ChunkError]:
        """One READS a READS_MAX_BLOBS blobs or READS_MAX_BYTES bytes: one round trip, one reply buffer whose views
        are the blobs."""
        results: list[bytes | memoryview | ChunkError] = []
        first = 0
        while first < len(blobs):
            last, size = first, 0
            while last < len(blobs) and last - first < READS_MAX_BLOBS and \
                    (last == first or size + blobs[last][2] <= READS_MAX_BYTES):
                size += blobs[last][2]
                last += 1
            results += self._read_some(blobs[first:last])
            first = last
        return results

    def _read_some(self, blobs: Sequence[tuple[int, int, int]]) -> list[bytes | memoryview | ChunkError]:
        try:
            arena = self.connection.arena()
        except ChunkUnavailable as exc:
            return [_not_answered(exc, chunk_id, offset) for chunk_id, offset, _ in blobs]
        if arena is not None:
            return self._read_shared(blobs, arena)
        if len(blobs) == 1:  # a READ's reply has no table
            return super().read_many(blobs)
        rows = np.array(blobs, dtype=np.int64).view(PLAN_ROW).reshape(-1)
        try:
            status, payload = self.connection.ask_view(READS, length=len(rows), payload=rows.tobytes())
        except ChunkUnavailable as exc:
            return [_not_answered(exc, chunk_id, offset) for chunk_id, offset, _ in blobs]
        if status != OK:
            # Refused whole, at a row out of range (the node names the first): each blob asked alone gets its own
            # answer, as read_many promises, the good ones their bytes.
            return super().read_many(blobs)
        table = np.frombuffer(payload[: len(blobs) * READS_ROW.itemsize], dtype=READS_ROW)
        results: list[bytes | memoryview | ChunkError] = []
        start = len(blobs) * READS_ROW.itemsize
        for (chunk_id, _, _), blob_status, length in zip(blobs, table["status"].tolist(), table["length"].tolist()):
            blob = payload[start : start + length]
            start += length
            if blob_status == OK:
                results.append(blob)
            else:
                results.append(status_error(blob_status, bytes(blob).decode("utf-8", "replace"), chunk_id))
        return results

    def _read_shared(self, blobs: Sequence[tuple[int, int, int]],
                     arena: ArenaView) -> list[bytes | memoryview | ChunkError]:
        """A READS_SHARED: the blobs the serve process lends are views of the arena, valid while they live (their
        token goes back with this thread's next request once the last is gone); the others come in the reply."""
        rows = np.array(blobs, dtype=np.int64).view(PLAN_ROW).reshape(-1)
        try:
            returned = self.connection.returned()
            tokens = [returned.popleft() for _ in range(min(len(returned), MAX_RETURNED))]
            status, payload = self.connection.ask_view(READS_SHARED, len(tokens), 0, len(rows),
                                                       rows.tobytes() + np.array(tokens, dtype="<u8").tobytes())
        except ChunkUnavailable as exc:
            return [_not_answered(exc, chunk_id, offset) for chunk_id, offset, _ in blobs]
        table_end = TOKEN.size + len(blobs) * SHARED_ROW.itemsize
        if status != OK or len(payload) < table_end:
            return super().read_many(blobs)  # each asked alone gets its own answer, as read_many promises
        token = TOKEN.unpack_from(payload)[0]
        lent = arena.lend(token, self.connection.lent_reply()) if token else None  # the token goes back with its views
        table = np.frombuffer(payload[TOKEN.size : table_end], dtype=SHARED_ROW)
        results: list[bytes | memoryview | ChunkError] = []
        start = table_end
        for (chunk_id, offset, _), blob_status, length, place in zip(
                blobs, table["status"].tolist(), table["length"].tolist(), table["place"].tolist()):
            if place < 0:
                blob: memoryview = payload[start : start + length]
                start += length
            elif lent is not None and place + length <= arena.size:
                blob = lent[place : place + length]
            else:
                results.append(ChunkUnavailable(f"chunk {chunk_id} at {offset}: the node's serve process lent a blob "
                                                f"outside its arena", chunk_id=chunk_id))
                continue
            if blob_status == OK:
                results.append(blob)
            else:
                results.append(status_error(blob_status, bytes(blob).decode("utf-8", "replace"), chunk_id))
        return results

    def close(self) -> None:
        self.connection.close()


def _not_answered(exc: ChunkUnavailable, chunk_id: int, offset: int) -> ChunkUnavailable:
    """The serve process could not be asked (gone, or the connection closed), as the error of one blob: naming its
    chunk, as every ChunkError does."""
    return ChunkUnavailable(f"chunk {chunk_id} at {offset}: {exc}", chunk_id=chunk_id)


class NodeChunkSource(PlacedReads):
    """A served dataset as one reader of the node sees it (PlacedReads): this rank's staged copy, the node's serve
    process for the other blobs (DEST when it cannot be reached: the job goes on reading, slower, rather than
    fail)."""

    def __init__(self, connection: NodeConnection, rank: int, placement: ChunkOwners, local: StagedChunkSource,
                 dest: ChunkSource, direct: frozenset[int], plan_rows: int | None = None) -> None:
        super().__init__(rank, placement, local,
                         FallbackChunkSource(NodeServeSource(connection), dest, on_fallback=self._fell_back), dest,
                         direct)
        self._connection = connection
        self._plan_rows = plan_rows  # the longest plan the serve process takes (its dataset's blobs), if known
        self._plan_refusal_said = False  # a plan the node did not take is logged once
        self._reported = False
        self.fallbacks = 0
        # What this reader reads without the serve process, told to it for --stats.
        self._counts = ReaderCounts(lambda kind, length, payload: connection.ask(kind, length=length,
                                                                                 payload=payload)[0],
                                    lambda: (local.dest_reads, local.dest_bytes))
        self._counts.report_at_exit(self)

    def _read_local(self, chunk_id: int, offset: int, length: int) -> bytes:
        blob = self._local.read(chunk_id, offset, length)
        self._counts.count(LOCAL, length)
        return blob

    def _read_direct(self, chunk_id: int, offset: int, length: int) -> bytes:
        blob = self._dest.read(chunk_id, offset, length)
        self._counts.count(DEST, length)
        return blob

    def close(self) -> None:
        self._counts.report()
        super().close()

    def _fell_back(self, reason: ChunkUnavailable, length: int) -> None:
        self.fallbacks += 1
        self._counts.count(DEST, length)
        if not self._reported:
            self._reported = True
            log.warning("%s; reading such files from the dataset directory", reason)

    def announce(self, index: Index, entries: np.ndarray) -> None:
        """The files this process reads next, in order: the serve process fetches their remote blobs ahead, for this
        process's plan alone (another training process on the node has its own). An order longer than the dataset
        (a sampler that draws with replacement) is announced up to the longest plan the node takes."""
        rows = index.entries[entries]
        rows = rows[(rows["flags"] & FLAG_BLOCKED) == 0]  # large files are read block by block, as they come
        rows = rows[rows["stored_len"] > 0]
        remote = [i for i, (chunk, offset) in enumerate(zip(rows["chunk"].tolist(), rows["offset"].tolist()))
                  if chunk not in self._direct and self._placement.owner(chunk, offset) not in (NO_OWNER, self._rank)]
        remote = remote[:self._plan_rows]
        plan = np.zeros(len(remote), dtype=PLAN_ROW)
        plan["chunk"], plan["offset"], plan["length"] = (rows["chunk"][remote], rows["offset"][remote],
                                                         rows["stored_len"][remote])
        # A hint: refused (the node keeps as many plans as it takes) or not delivered, the epoch reads all the same,
        # its remote files fetched as they are read; said once (it raised from EpochSampler.__iter__, ending training).
        try:
            status, payload = self._connection.ask(PLAN, length=len(plan), payload=plan.tobytes())
            reason = "" if status == OK else payload.decode("utf-8", "replace")
        except ChunkError as exc:
            reason = str(exc)
        if reason and not self._plan_refusal_said:
            self._plan_refusal_said = True
            log.warning("the node's serve process did not take this process's epoch plan (%s): its remote files are "
                        "fetched as they are read, not ahead", reason)

    def stats(self) -> dict[str, Any]:
        return {"socket": self._connection.path, "fallbacks": self.fallbacks}


def open_served_dataset(socket_path: str | None = None) -> Dataset:
    """The dataset of the `fanstore serve` node this process runs on (found through FANSTORE_SERVE_SOCKET). The index
    is loaded from the node's copy in its local directory: every worker of every epoch opens one, and DEST, the
    shared file system, is what fanstore keeps them off."""
    path = socket_path or os.environ.get(ENVIRONMENT)
    if not path:
        raise UsageError(f"no dataset given and {ENVIRONMENT} is not set: pass a packed dataset directory, or run "
                         f"under `fanstore serve ... -- COMMAND` (or set {ENVIRONMENT} to the node's socket, "
                         f"the third line of its ready file)")
    connection = NodeConnection(path)
    try:
        status, payload = connection.ask(HELLO)
    except TurnedAway as exc:  # the node's limit, or its descriptors: the job's to raise, not a serve process gone
        raise UsageError(str(exc)) from None
    if status != OK:
        raise UsageError(connection.refusal(_ASKED[HELLO], payload.decode("utf-8", "replace")))
    node = json.loads(payload)
    if isinstance(node.get("answer_within"), (int, float)) and node["answer_within"] > connection.deadline:
        connection.answer_within(float(node["answer_within"]))
    try:
        index = Index.load(node["index_dir"])
    except DatasetNotFound:
        raise DatasetNotFound(f"{Path(node['index_dir']) / INDEX_NAME}: the node's copy of the index is gone (the "
                              f"serve process writes it once staged: removed from --local-dir since?)") from None
    sizes = index.chunks["size"]
    dest = LocalChunkSource(node["dest"], sizes)
    rank = int(node["rank"])
    owners = ChunkOwners.from_json(node.get("owners"), len(sizes), f"{path}: the node's serve process")
    source = NodeChunkSource(connection, rank, owners,
                             StagedChunkSource(LocalChunkSource(Path(node["local_dir"]), sizes), dest, rank), dest,
                             frozenset(int(c) for c in node["direct"]), node.get("blobs"))
    return Dataset(index, source)
