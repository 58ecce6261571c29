"""The node socket (fanstore/serve/node_endpoint.py) over a real Unix socket, the way a hostile or broken reader would
use it: every field of a request and every row of a plan is range-checked, a bad one answers one refusal naming it,
and what a connection can make the serve process hold is bounded by the dataset and given back. The same probes
against a real `mpiexec -n 2 fanstore serve` job, with the serve process's memory read from /proc, are in
test_a_serve_job_refuses_hostile_requests_and_holds_no_more_for_them."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, numbered_files
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.chunk_source import BlobRead, ChunkSource, LocalChunkSource
from fanstore.errors import ChunkUnavailable
from fanstore.serve.blobs_ahead import BLOB_OVERHEAD, BlobsAhead
from fanstore.serve import node_endpoint
from fanstore.serve.node_client import open_served_dataset
from fanstore.serve.node_endpoint import NodeEndpoint
from fanstore.serve.node_protocol import (HELLO, OK, PLAN, PLAN_ROW, READ, REFUSED, REPLY, REPLY_MAGIC, REQUEST,
                                          READS, READS_MAX_BLOBS, READS_ROW, REQUEST_MAGIC, STATS, TURNED_AWAY,
                                          BlobLookup)
from fanstore.serve.placement import BlobTable


class HalfRemote(ChunkSource):
    """A node's source over a dataset directory: blobs of odd chunks are 'remote' (may_block; fetched ahead from a
    thread of their own, as the transport's would), blobs of even chunks are this node's."""

    def __init__(self, dataset) -> None:
        self.chunks = LocalChunkSource(dataset.path, dataset.index.chunks["size"])
        self.started: list[tuple[int, int]] = []
        self.batches: list[int] = []  # blobs started by each start_reads call
        self._lock = threading.Lock()

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        return self.chunks.read(chunk_id, offset, length)

    def may_block(self, chunks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return np.asarray(chunks) % 2 == 1

    def start_reads(self, reads, ahead: bool = False) -> list[bool]:
        started = [read.chunk_id % 2 == 1 for read in reads]
        remote = [read for read, ok in zip(reads, started) if ok]
        with self._lock:
            self.started += [(read.chunk_id, read.offset) for read in remote]
            self.batches.append(len(remote))
        threading.Timer(0.001, self._answer, (remote,)).start()
        return started

    def _answer(self, reads: list[BlobRead]) -> None:
        for read in reads:
            read.done(self.chunks.read(read.chunk_id, read.offset, read.length), None)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("endpoint")
    numbered_files(root / "src", 80, lambda number: 500 + 61 * number)
    pack(root / "src", root / "ds", PackOptions(codec="none", chunk_size=8 * 1024, workers=1))
    with open_dataset(root / "ds") as ds:
        yield ds


@pytest.fixture
def endpoint(dataset, tmp_path):
    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    node = NodeEndpoint(tmp_path, {"rank": 0}, source, lookup, ahead)
    node.source = source
    yield node
    node.close()
    ahead.close()


class Reader:
    """A connection to the node socket that sends what it is told, byte for byte."""

    def __init__(self, path: Path) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket.connect(str(path))
        self.socket.settimeout(10)

    def ask(self, kind: int, chunk: int = 0, offset: int = 0, length: int = 0, payload: bytes = b"",
            magic: bytes = REQUEST_MAGIC) -> tuple[int, bytes]:
        self.socket.sendall(REQUEST.pack(magic, kind, chunk, offset, length) + payload)
        return self.reply()

    def reply(self) -> tuple[int, bytes]:
        magic, status, size = REPLY.unpack(self.exactly(REPLY.size))
        assert magic == REPLY_MAGIC
        return status, self.exactly(size)

    def exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            more = self.socket.recv(size - len(data))
            assert more, "the node closed the connection"
            data += more
        return data

    def closed(self) -> bool:
        """Whether the node closed this connection (nothing more comes, ever; a reset if what was sent was unread)."""
        try:
            return self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.socket.close()


def blobs_of(dataset) -> list[tuple[int, int, int]]:
    """(chunk, offset, stored length) of every file, in path order."""
    rows = []
    for path in sorted(dataset.files()):
        entry = dataset.index.entries[dataset.resolve(path)]
        rows.append((int(entry["chunk"]), int(entry["offset"]), int(entry["stored_len"])))
    return rows


def plan_bytes(rows) -> bytes:
    return np.array(rows, dtype=PLAN_ROW).tobytes()


def test_each_bad_field_of_a_request_is_refused_once_by_name_and_the_connection_goes_on(dataset, endpoint):
    chunk, offset, length = blobs_of(dataset)[0]
    largest = max(row[2] for row in blobs_of(dataset))
    chunks = len(dataset.index.chunks)
    cases = {  # what is sent: (kind, chunk, offset, length) -> the reason's start
        (READ, chunk, 2**64 - 1, length): f"offset {2**64 - 1} of chunk {chunk}: past the end of the chunk's blobs",
        (READ, chunk, 2**63, length): f"offset {2**63} of chunk {chunk}: past the end",
        (READ, 2**32 - 1, offset, length): f"chunk {2**32 - 1}: the dataset's chunks are 0 to {chunks - 1}",
        (READ, chunks, offset, length): f"chunk {chunks}: the dataset's chunks are 0 to {chunks - 1}",
        (READ, chunk, offset, 0): f"length 0: a blob of this dataset is 1 to {largest} bytes long",
        (READ, chunk, offset, 2**64 - 1): f"length {2**64 - 1}: a blob of this dataset is 1 to {largest} bytes",
        (READ, chunk, offset, largest + 1): f"length {largest + 1}: a blob",
        (READ, chunk, offset + 1, length - 1): f"no blob of {length - 1} bytes at offset {offset + 1} of chunk",
        (READ, chunk, offset, length + 1): f"no blob of {length + 1} bytes at offset {offset} of chunk",
        (HELLO, 5, 0, 0): "chunk 5: HELLO takes 0 there",
        (STATS, 0, 0, 1): "length 1: STATS takes 0 there",
        (99, 0, 0, 0): "kind 99: the kinds are 1 HELLO, 2 READ, 3 PLAN, 4 STATS",
    }
    reader = Reader(endpoint.path)
    try:
        for request, reason in cases.items():
            status, payload = reader.ask(*request)
            assert (status, payload.decode()[:len(reason)]) == (REFUSED, reason), request
            assert reader.ask(HELLO)[0] == OK  # one reply, and the connection still answers
        assert reader.ask(READ, chunk, offset, length) == (OK, dataset.reader.source.read(chunk, offset, length))
        assert endpoint.stats()["refused"] == len(cases)
    finally:
        reader.close()


def test_a_request_whose_end_cannot_be_told_is_refused_once_and_its_connection_closed(dataset, endpoint):
    blob_count = len(BlobTable.of(dataset.index))
    cases = [  # (magic, kind, chunk, offset, length) -> the reason's start
        ((b"XXXX", HELLO, 0, 0, 0), "magic b'XXXX': a request starts with b'FSNQ'"),
        ((REQUEST_MAGIC, PLAN, 0, 0, 1 << 24), f"length {1 << 24}: a plan has at most as many rows as the dataset "
                                               f"has blobs ({blob_count})"),
        ((REQUEST_MAGIC, PLAN, 0, 0, 2**64 - 1), f"length {2**64 - 1}: a plan has at most"),
        ((REQUEST_MAGIC, PLAN, 3, 0, 1), "chunk 3: PLAN takes 0 there"),
        ((REQUEST_MAGIC, PLAN, 0, 7, 1), "offset 7: PLAN takes 0 there"),
    ]
    for (magic, *fields), reason in cases:
        reader = Reader(endpoint.path)
        try:
            status, payload = reader.ask(*fields, magic=magic)
            assert (status, payload.decode()[:len(reason)]) == (REFUSED, reason)
            assert reader.closed()
        finally:
            reader.close()
    other = Reader(endpoint.path)  # the node goes on serving
    assert other.ask(HELLO)[0] == OK
    other.close()


def test_a_plan_row_out_of_range_refuses_the_plan_by_row_and_field_and_the_connection_goes_on(dataset, endpoint):
    blobs = blobs_of(dataset)
    chunk, offset, length = blobs[1]
    largest = max(row[2] for row in blobs)
    cases = {
        (-1, offset, length): "plan row 2: chunk -1: the dataset's chunks are 0 to",
        (chunk, -5, length): f"plan row 2: offset -5 of chunk {chunk}: negative",
        (chunk, 2**63 - 1, length): f"plan row 2: offset {2**63 - 1} of chunk {chunk}: past the end",
        (chunk, offset, 0): "plan row 2: length 0: a blob of this dataset is 1 to",
        (chunk, offset, -1): "plan row 2: length -1: a blob",
        (chunk, offset, largest + 1): f"plan row 2: length {largest + 1}: a blob",
    }
    reader = Reader(endpoint.path)
    try:
        for bad, reason in cases.items():
            rows = [blobs[0], blobs[1], bad, blobs[2]]
            status, payload = reader.ask(PLAN, length=len(rows), payload=plan_bytes(rows))
            assert (status, payload.decode()[:len(reason)]) == (REFUSED, reason), bad
            assert endpoint.stats()["plans"] == {}  # nothing of a refused plan is kept
        assert reader.ask(PLAN, length=len(blobs), payload=plan_bytes(blobs)) == (OK, b"")
    finally:
        reader.close()


def test_a_plan_keeps_only_the_remote_blobs_it_names_and_is_given_back_when_its_connection_closes(dataset,
                                                                                                endpoint):
    blobs = blobs_of(dataset)
    not_blobs = [(chunk, offset + 1, 1) for chunk, offset, _ in blobs[:5]]  # in range, inside a blob
    remote = [row for row in blobs[5:] if row[0] % 2 == 1]
    reader = Reader(endpoint.path)
    try:
        rows = blobs[5:] + not_blobs
        assert reader.ask(PLAN, length=len(rows), payload=plan_bytes(rows)) == (OK, b"")
        (plan,) = endpoint.stats()["plans"].values()
        assert plan["rows"] == len(remote)
        # The node's readers read every remote blob (fetched ahead by now, on their way, or read before its fetch
        # started, which then is not started: on a loaded machine the reader may overtake the fetching thread).
        for chunk, offset, length in remote:
            assert reader.ask(READ, chunk, offset, length) == (OK, endpoint.source.read(chunk, offset, length))
        started = endpoint.source.started
        assert len(started) == len(set(started)) and set(started) <= {(chunk, offset) for chunk, offset, _ in remote}
        assert len(started) + endpoint.stats()["ahead_cancelled"] == len(remote)
    finally:
        reader.close()
    wait_until_true(lambda: endpoint.stats()["plans"] == {}, "the plan given back")
    assert endpoint.stats()["ahead_held_bytes"] == 0


def test_a_plan_has_at_most_as_many_rows_as_the_dataset_has_blobs(dataset, endpoint):
    remote = [row for row in blobs_of(dataset) if row[0] % 2 == 1]
    most = len(BlobTable.of(dataset.index))
    reader = Reader(endpoint.path)
    try:
        rows = (remote * most)[:most]  # a blob listed many times (a sampler may draw with replacement)
        assert reader.ask(PLAN, length=len(rows), payload=plan_bytes(rows)) == (OK, b"")
        assert [plan["rows"] for plan in endpoint.stats()["plans"].values()] == [most]
        assert json.loads(reader.ask(HELLO)[1])["blobs"] == most  # what a reader cuts its plan to
    finally:
        reader.close()
    reader = Reader(endpoint.path)
    try:
        rows = (remote * (most + 1))[:most + 1]
        status, payload = reader.ask(PLAN, length=len(rows), payload=plan_bytes(rows))
        assert status == REFUSED and payload.decode().startswith(f"length {most + 1}: a plan has at most")
    finally:
        reader.close()


def test_a_plan_cut_short_by_its_reader_is_dropped_with_its_connection(dataset, endpoint):
    blobs = blobs_of(dataset)
    reader = Reader(endpoint.path)
    reader.socket.sendall(REQUEST.pack(REQUEST_MAGIC, PLAN, 0, 0, len(blobs)) + plan_bytes(blobs)[:-5])
    reader.socket.shutdown(socket.SHUT_WR)
    assert reader.closed()
    reader.close()
    assert endpoint.stats()["plans"] == {}
    other = Reader(endpoint.path)
    assert other.ask(HELLO)[0] == OK
    other.close()


OTHER_PROCESS = r"""
import socket, sys
import numpy as np
from fanstore.serve.node_protocol import PLAN, PLAN_ROW, REPLY, REQUEST, REQUEST_MAGIC
rows = np.array([tuple(int(v) for v in row.split(",")) for row in sys.argv[2:]], dtype=PLAN_ROW)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
    connection.connect(sys.argv[1])
    connection.sendall(REQUEST.pack(REQUEST_MAGIC, PLAN, 0, 0, len(rows)) + rows.tobytes())
    connection.recv(REPLY.size)
    print("announced", flush=True)
    sys.stdin.readline()  # holds its connection, and so its plan, until told
"""


def test_each_process_has_a_plan_of_its_own_whichever_connection_brings_it(dataset, endpoint):
    """A DataLoader's parent announces on one connection, its workers read on others; a second training process
    on the node announces its own order. A process's new plan replaces its own, never another process's."""
    remote = [row for row in blobs_of(dataset) if row[0] % 2 == 1]
    mine, theirs = remote[: len(remote) // 2], remote[len(remote) // 2 :]
    other = subprocess.Popen([sys.executable, "-c", OTHER_PROCESS, str(endpoint.path),
                              *(",".join(map(str, row)) for row in theirs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    first, second = Reader(endpoint.path), Reader(endpoint.path)
    try:
        assert other.stdout.readline() == "announced\n"
        assert first.ask(PLAN, length=len(remote), payload=plan_bytes(remote)) == (OK, b"")
        assert second.ask(PLAN, length=len(mine), payload=plan_bytes(mine)) == (OK, b"")  # replaces the first
        plans = endpoint.stats()["plans"]
        assert {owner: plan["rows"] for owner, plan in plans.items()} == {str(os.getpid()): len(mine),
                                                                          str(other.pid): len(theirs)}
        first.close()  # its plan was replaced: closing it gives back nothing of the second's
        wait_until_true(lambda: endpoint.stats()["ahead_held_bytes"] == sum(row[2] + BLOB_OVERHEAD for row in remote),
                        "both plans fetched ahead")
        assert set(endpoint.stats()["plans"]) == {str(os.getpid()), str(other.pid)}
        for chunk, offset, length in remote:  # whoever reads a blob takes it
            assert second.ask(READ, chunk, offset, length) == (OK, endpoint.source.read(chunk, offset, length))
        stats = endpoint.stats()
        assert stats["ahead_hits"] == len(remote) and stats["plans"][str(other.pid)]["hits"] == len(theirs)
    finally:
        other.communicate("\n", timeout=10)
        second.close()
    wait_until_true(lambda: endpoint.stats()["plans"] == {}, "both plans given back")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """4,000 small files: a maximal plan (as many rows as blobs) is worth measuring."""
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(7)
    for number in range(4000):
        path = root / "src" / f"d{number % 10}" / f"f{number:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 16, 200 + number % 1800, np.uint8).tobytes())
    pack(root / "src", root / "dest", PackOptions(codec="zstd:3", chunk_size=64 * 1024, workers=1))
    return root / "src", root / "dest"


# The serve process's resident memory may grow this much while it refuses the probes and holds a maximal plan of
# this dataset (4,000 rows: 16 KiB kept) and serves every file: its threads' stacks touched, its allocator's pools.
RSS_GROWTH_KIB = 24 << 10


def test_a_serve_job_refuses_hostile_requests_and_holds_no_more_for_them(served, tmp_path):
    """The probes that found it: a plan of 2^24 rows took a serve process from 74 MiB to 3.3 GiB (3 GiB stayed),
    a READ at offset 2^64-1 ended its connection with an OverflowError traceback. Now each hostile request answers
    one refusal naming its field, the serve process's memory stays within RSS_GROWTH_KIB of what it was, plans are
    given back with their connections, and the job goes on serving every file right."""
    from test_serve import _REASON, MPIEXEC

    if _REASON is not None:
        pytest.skip(f"needs FUSE and MPI: {_REASON}")
    src, dest = served
    for rank in range(2):
        (tmp_path / f"mp{rank}").mkdir()
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "fanstore", "serve", str(dest),
                           str(tmp_path / "mp{rank}"), "--local-dir", str(tmp_path / "local{rank}"), "--quiet",
                           "--", sys.executable, str(Path(__file__).with_name("serve_node_probe.py")), str(src),
                           str(dest)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    results = {line["rank"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert set(results) == {0, 1}, done.stdout
    for rank, result in results.items():
        answers = result["answers"]
        assert {status for status, _ in answers.values()} == {REFUSED}, answers  # one refusal each
        assert answers["plan of 2^24 rows"][1].startswith(
            f"length {1 << 24}: a plan has at most as many rows as the dataset has blobs ({result['blobs']})"), answers
        assert answers["READ at offset 2^64-1"][1].startswith(f"offset {2**64 - 1} of chunk "), answers
        assert answers["plan with a negative offset"][1].startswith(f"plan row 1: offset {-(2**63)} of chunk "), \
            answers
        assert answers["bad magic"][1].startswith("magic b'QQQQ'"), answers
        assert result["closed"] == {"plan of 2^24 rows": True, "bad magic": True}, result  # those two alone
        assert result["hello_after"] == OK and result["maximal_plan"] == [OK, ""], result
        assert result["plan_rows_held"] == [result["blobs"]] and result["plans_after"] == {}, result
        rss = result["rss_kib"]
        assert max(rss.values()) - rss["before"] <= RSS_GROWTH_KIB, rss
        assert result["bad"] == 0 and result["read"] == 4000, result
    assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr, done.stderr
    print({rank: result["rss_kib"] for rank, result in results.items()})


def wait_until_true(condition, what: str, timeout: float = 10) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def split_reads_reply(payload: bytes, count: int) -> list[tuple[int, bytes]]:
    """A READS reply's (status, bytes) of each blob asked, in order; every byte of the payload accounted for."""
    table = np.frombuffer(payload[: count * READS_ROW.itemsize], dtype=READS_ROW)
    parts, start = [], count * READS_ROW.itemsize
    for status, length in table.tolist():
        parts.append((status, payload[start : start + length]))
        start += length
    assert start == len(payload)
    return parts


def test_reads_answers_many_blobs_in_one_reply_each_with_its_own_status(dataset, endpoint):
    """One READS round trip: every blob named, in the order asked, whether fetched ahead (from the holder), fetched
    now (the remote ones together, in one start_reads) or this node's own; a row that names no blob gets its own
    REFUSED, and the others still come."""
    blobs = blobs_of(dataset)
    chunk, offset, length = blobs[3]
    inside = (chunk, offset + 1, length - 1)
    rows = blobs[:10] + [inside] + blobs[10:]
    remote = [row for row in blobs if row[0] % 2 == 1]
    planned, fetched_now = remote[: len(remote) // 2], remote[len(remote) // 2 :]
    assert planned and fetched_now and len(remote) < len(blobs)
    reader = Reader(endpoint.path)
    try:
        assert reader.ask(PLAN, length=len(planned), payload=plan_bytes(planned)) == (OK, b"")
        wait_until_true(lambda: endpoint.stats()["plans"][str(os.getpid())]["started"] == len(planned),
                        "the plan started")
        status, payload = reader.ask(READS, length=len(rows), payload=plan_bytes(rows))
        assert status == OK
        for row, (blob_status, part) in zip(rows, split_reads_reply(payload, len(rows))):
            if row == inside:
                assert blob_status == REFUSED and part.startswith(b"no blob"), part
            else:
                assert (blob_status, part) == (OK, endpoint.source.read(*row)), row
        assert endpoint.source.batches[-1] == len(fetched_now)  # the others, asked for together
        assert endpoint.stats()["ahead_hits"] == len(planned)
        assert reader.ask(HELLO)[0] == OK
    finally:
        reader.close()


def test_a_reads_out_of_bounds_is_refused_by_name(dataset, endpoint, monkeypatch):
    """A READS asks for 1 to READS_MAX_BLOBS blobs (else what follows cannot be told: the connection closes), of
    at most READS_MAX_BYTES together, each row checked as a plan's is (the connection goes on)."""
    blobs = blobs_of(dataset)
    for count, reason in ((0, "length 0: a READS asks for 1 to"), (READS_MAX_BLOBS + 1, f"length {READS_MAX_BLOBS + 1}")):
        reader = Reader(endpoint.path)
        try:
            status, payload = reader.ask(READS, length=count)
            assert (status, payload.decode()[:len(reason)]) == (REFUSED, reason)
            assert reader.closed()
        finally:
            reader.close()
    monkeypatch.setattr(node_endpoint, "READS_MAX_BYTES", blobs[0][2] + blobs[1][2] - 1)
    reader = Reader(endpoint.path)
    try:
        status, payload = reader.ask(READS, length=2, payload=plan_bytes(blobs[:2]))
        assert (status, payload.decode()) == (REFUSED, f"a READS of {blobs[0][2] + blobs[1][2]} bytes: at most "
                                                       f"{blobs[0][2] + blobs[1][2] - 1} bytes of blobs a request")
        bad = [blobs[0], (blobs[1][0], -5, blobs[1][2])]
        status, payload = reader.ask(READS, length=2, payload=plan_bytes(bad))
        assert (status, payload.decode()) == (REFUSED, f"READS row 1: offset -5 of chunk {blobs[1][0]}: negative")
        status, payload = reader.ask(READS, length=1, payload=plan_bytes(blobs[:1]))
        assert split_reads_reply(payload, 1) == [(OK, endpoint.source.read(*blobs[0]))]
    finally:
        reader.close()


def _hello_as_a_client_asks(reader: Reader) -> tuple[int, bytes]:
    """HELLO as node_client sends it: a connection turned away may be closed before the request goes, and its
    reason is read all the same."""
    try:
        reader.socket.sendall(REQUEST.pack(REQUEST_MAGIC, HELLO, 0, 0, 0))
    except (BrokenPipeError, ConnectionResetError):
        pass
    return reader.reply()


def test_connections_past_the_limit_are_told_why_and_closed_and_a_place_comes_back(dataset, tmp_path):
    """Each connection costs a descriptor and a thread: 1,100 idle ones (each 4 bytes of a request) took every
    descriptor of a 1,024 limit, the rank's own chunk reads failed and then its end. Past the limit a connection is
    answered TURNED_AWAY (not REFUSED: its request is not at fault), naming the limit, and closed; the ones served go
    on, and a place that frees is taken again."""
    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    node = NodeEndpoint(tmp_path, {"rank": 0}, source, lookup, ahead, max_connections=4)
    try:
        held = [Reader(node.path) for _ in range(4)]
        for reader in held:
            assert reader.ask(HELLO)[0] == OK
        held[0].socket.sendall(REQUEST_MAGIC)  # half a request: its connection still counts
        extra = Reader(node.path)
        status, reason = _hello_as_a_client_asks(extra)
        assert status == TURNED_AWAY and reason.decode().startswith(
            "this node's serve process takes 4 reader connections at once, and has as many"), reason
        assert extra.closed()
        assert held[1].ask(HELLO)[0] == OK
        held[0].close()
        wait_until_true(lambda: _hello_as_a_client_asks(Reader(node.path))[0] == OK, "a freed place taken again")
        assert node.stats()["turned_away"] >= 1
    finally:
        node.close()
        ahead.close()


@pytest.mark.parametrize("closed_first", [False, True])
def test_a_reader_turned_away_when_it_asks_for_the_arena_says_the_node_s_reason(dataset, tmp_path, closed_first):
    """A reader thread's first request is often ARENA: turned away (past the node's connection limit), it said
    "Broken pipe" where the node had closed the connection before the request went, or took the refusal for a node
    without an arena and never asked again. It now reads the node's reason as HELLO does, says it, and asks again on
    its next connection; a node without an arena is still told apart."""
    from fanstore.errors import ChunkUnavailable
    from fanstore.serve.node_client import NodeConnection

    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    node = NodeEndpoint(tmp_path, {"rank": 0}, source, lookup, ahead, max_connections=1)
    try:
        held = Reader(node.path)
        assert held.ask(HELLO)[0] == OK
        reader = NodeConnection(str(node.path))
        if closed_first:  # the node has answered and closed: the request's send fails (EPIPE)
            poller = select.poll()
            poller.register(reader._socket(), select.POLLHUP)
            assert poller.poll(10_000), "the node did not close the connection it turned away"
        with pytest.raises(ChunkUnavailable) as refused:
            reader.arena()
        assert str(refused.value).startswith(
            f"{node.path}: the node's serve process refused to lend its arena: this node's serve process takes 1 "
            f"reader connections at once, and has as many"), refused.value
        held.close()

        def asked_again() -> bool:
            try:
                return reader.arena() is None  # this node has none: READS, as before
            except ChunkUnavailable:
                return False

        wait_until_true(asked_again, "the arena asked again once a place is free")
        assert node.stats()["turned_away"] >= 1
    finally:
        node.close()
        ahead.close()


def _ask_as_a_reader_does(kind: str, source, blobs: list[tuple[int, int, int]]) -> list:
    """What a reader's request of `kind` gives, sent the way node_client sends it: a read's blobs or errors, one per
    blob; another request's (status, payload), or the error it raised."""
    from fanstore.errors import ChunkUnavailable
    from fanstore.serve.node_protocol import COUNTS, READ_COUNTS

    connection = source.connection
    try:
        if kind == "READ":
            return [source.read(*blobs[0])]
        if kind in ("READS", "READS_SHARED"):  # READS_SHARED where the node lends an arena
            return source.read_many(blobs)
        if kind == "PLAN":
            return [connection.ask(PLAN, length=len(blobs), payload=plan_bytes(blobs))]
        if kind == "COUNTS":
            return [connection.ask(COUNTS, length=READ_COUNTS.size, payload=READ_COUNTS.pack(1, 2, 3, 4))]
        return [connection.ask({"HELLO": HELLO, "STATS": STATS}[kind])]
    except ChunkUnavailable as exc:
        return [exc]


@pytest.mark.parametrize("kind", ["HELLO", "READ", "READS", "READS_SHARED", "PLAN", "COUNTS", "STATS"])
def test_a_reader_turned_away_on_any_request_says_the_node_s_reason_and_asks_again_on_a_new_connection(
        dataset, tmp_path, kind):
    """A connection turned away (past the node's connection limit) is answered with the node's reason and closed,
    whatever it asked first. A READS or READS_SHARED took that for a bad request and asked each blob again on the
    closed socket (the reason lost: 'the serve process closed the connection'), and any other request kept the
    socket until the next one failed on it. Each now says the node's reason, asks nothing more on that connection,
    and the next request, once the node has room, is answered on a new one."""
    from concurrent.futures import ThreadPoolExecutor

    from fanstore.errors import ChunkUnavailable
    from fanstore.serve.blob_arena import BlobArena
    from fanstore.serve.node_client import NodeConnection, NodeServeSource

    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    arena = BlobArena(1 << 20) if kind == "READS_SHARED" else None
    node = NodeEndpoint(tmp_path, {"rank": 0}, source, lookup, ahead, arena, max_connections=2)
    other_thread = ThreadPoolExecutor(1)
    reader = NodeServeSource(NodeConnection(str(node.path)))
    try:
        # The reader's process maps the arena (or learns there is none) on another thread's connection, and a
        # reader of another process holds the node's last place: this thread's connection is turned away.
        assert (other_thread.submit(reader.connection.arena).result() is not None) == (arena is not None)
        held = Reader(node.path)
        assert held.ask(HELLO)[0] == OK
        blobs = [blob for blob in blobs_of(dataset) if blob[0] % 2 == 1][:3]  # remote: asked of the node
        reason = "this node's serve process takes 2 reader connections at once, and has as many"
        answers = _ask_as_a_reader_does(kind, reader, blobs)
        reads_blobs = kind in ("READS", "READS_SHARED")  # not taken for a bad request, asked again blob by blob
        assert len(answers) == (len(blobs) if reads_blobs else 1), answers
        assert all(isinstance(answer, ChunkUnavailable) and reason in str(answer) for answer in answers), answers
        assert not reads_blobs or all("refused to read blobs: " in str(answer) for answer in answers), answers
        assert node.stats()["turned_away"] == 1, "a blob was asked again after the node turned its connection away"
        held.close()
        wait_until_true(lambda: node._connections < 2, "the held connection's place given back")
        answers = _ask_as_a_reader_does(kind, reader, blobs)
        if kind in ("READ", "READS", "READS_SHARED"):
            assert [bytes(answer) for answer in answers] == [source.read(*blob) for blob in blobs[:len(answers)]]
        else:
            assert answers[0][0] == OK, answers
        assert node.stats()["turned_away"] == 1
    finally:
        reader.close()
        other_thread.shutdown()
        node.close()
        ahead.close()
        if arena is not None:
            arena.close()


def test_a_reply_its_reader_does_not_take_holds_the_node_s_reply_bytes_until_its_connection_times_out(
        dataset, endpoint, monkeypatch):
    """Replies being answered hold at most REPLY_BYTES, all connections together: 30 readers that each asked a 15 kB
    blob 4,096 times and never read took a serve process from 64 MB to 1.9 GB. Here one stalled reply holds all of
    it: another reader's request waits for room, and gets it once the stalled connection's send times out (and it
    is closed), not before."""
    own = [blob for blob in blobs_of(dataset) if blob[0] % 2 == 0]  # this node's: read on the connection's thread
    big = max(own, key=lambda blob: blob[2])
    monkeypatch.setattr(node_endpoint, "REPLY_BYTES", READS_MAX_BLOBS * big[2])
    monkeypatch.setattr(node_endpoint, "SEND_TIMEOUT", 2)
    stalled = Reader(endpoint.path)
    stalled.socket.sendall(REQUEST.pack(REQUEST_MAGIC, READS, 0, 0, READS_MAX_BLOBS)
                           + plan_bytes([big] * READS_MAX_BLOBS))  # ~20 MB of reply: more than a socket holds
    wait_until_true(lambda: stalled.socket.recv(1, socket.MSG_PEEK), "the stalled reply's first bytes")
    other = Reader(endpoint.path)
    other.socket.sendall(REQUEST.pack(REQUEST_MAGIC, READS, 0, 0, 1) + plan_bytes([big]))
    other.socket.settimeout(0.5)
    with pytest.raises(socket.timeout):
        other.socket.recv(1)  # no room while the stalled reply holds it
    other.socket.settimeout(10)
    assert split_reads_reply(other.reply()[1], 1) == [(OK, endpoint.source.read(*big))]
    received = 0
    while not stalled.closed():  # what its reply got into the socket, then the end
        received += 1
    assert received < READS_MAX_BLOBS * big[2]
    stalled.close()
    other.close()


def test_a_blob_larger_than_the_reply_bytes_is_answered_alone(dataset, endpoint, monkeypatch):
    """A file stored whole may be larger than all replies may hold at once (--blocks-above 0): it takes all of it,
    alone, rather than waiting for room that never comes."""
    own = [blob for blob in blobs_of(dataset) if blob[0] % 2 == 0]
    big = max(own, key=lambda blob: blob[2])
    monkeypatch.setattr(node_endpoint, "REPLY_BYTES", big[2] - 1)
    monkeypatch.setattr(node_endpoint, "READS_WAIT", 5.0)
    reader = Reader(endpoint.path)
    try:
        assert reader.ask(READ, *big) == (OK, endpoint.source.read(*big))
        status, payload = reader.ask(READS, length=2, payload=plan_bytes([big, big]))
        assert split_reads_reply(payload, 2) == [(OK, endpoint.source.read(*big))] * 2
    finally:
        reader.close()


def test_a_plan_the_node_does_not_take_is_said_once_and_the_epoch_reads_all_the_same(dataset, tmp_path, caplog):
    """Past the node's plans (MAX_PLANS processes; none here), EpochSampler.__iter__ raised ChunkUnavailable and
    ended training: a plan is a hint. The reader says once that its files are fetched as read, and reads them."""
    from fanstore.serve.node_client import open_served_dataset
    from fanstore.serve.placement import place

    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate, max_plans=0)
    path = str(dataset.path)
    description = {"dest": path, "local_dir": path, "index_dir": path, "rank": 0, "size": 2, "direct": [],
                   "owners": place(dataset.index, 2).owners.to_json()}
    node = NodeEndpoint(tmp_path, description, source, lookup, ahead)
    try:
        with open_served_dataset(str(node.path)) as served:
            entries = np.array([served.resolve(name) for name in sorted(served.files())])
            with caplog.at_level("WARNING", logger="fanstore.serve"):
                served.reader.source.announce(served.index, entries)
                served.reader.source.announce(served.index, entries)
            said = [record.getMessage() for record in caplog.records if "epoch plan" in record.getMessage()]
            assert len(said) == 1 and "keeps plans of 0 processes at most" in said[0], said
            assert all(served.read(name) == dataset.read(name) for name in served.files())
    finally:
        node.close()
        ahead.close()


class StarvedEndpoint:
    """tests/serve_starved_endpoint.py: a real endpoint in a process with no descriptor left, `spare` its own or
    not."""

    def __init__(self, dataset, directory: Path, spare: bool) -> None:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("serve_starved_endpoint.py")),
                                         str(dataset.path), str(directory), "spare" if spare else "none"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        line = self.process.stdout.readline()
        assert line, self.process.communicate(timeout=10)
        self.socket = json.loads(line)["socket"]

    def say(self, what: str) -> None:
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()

    def stats(self) -> dict:
        self.say("stats")
        return json.loads(self.process.stdout.readline())

    def end(self) -> str:
        """Its log."""
        return self.process.communicate(timeout=10)[1]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def test_a_reader_the_serve_process_has_no_descriptor_for_is_told_so_at_once(dataset, tmp_path):
    """The probe: a serve process out of descriptors (a soft limit of 48 with MPI holding 45) failed every accept
    with EMFILE, and each reader waited on its HELLO for good. The endpoint keeps one spare descriptor for that: it
    gives it back to accept the reader, tells it why (one line: out of file descriptors, raise `ulimit -n`) and
    closes it; the reader's error is that line, at once. Logged once, counted each time."""
    from fanstore.errors import UsageError
    from fanstore.serve.node_client import open_served_dataset

    node = StarvedEndpoint(dataset, tmp_path, spare=True)
    try:
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(UsageError) as refused:
                open_served_dataset(node.socket)
        assert time.monotonic() - started < 5
        assert str(refused.value) == (f"{node.socket}: the node's serve process refused to describe its dataset: this "
                                      f"node's serve process is out of file descriptors (`ulimit -n`: 64): raise "
                                      f"`ulimit -n` for the job"), refused.value
        assert node.stats()["out_of_descriptors"] == 3
        log = node.end()
        assert log.count("out of file descriptors") == 1 and "Traceback" not in log, log
    finally:
        node.kill()


def test_a_serve_process_that_cannot_accept_costs_its_reader_a_deadline_and_no_spinning(dataset, tmp_path):
    """Out of descriptors with none spare, the endpoint cannot even say why: its accepting thread backs off (it polled
    the readable listener again at once, 85% of a core) and the reader gives up at its deadline, with one line
    naming the cause and what to do; the process's other threads ask nothing more (at once, not a deadline each),
    so its reads go to DEST. Once a descriptor comes back, a new reader is served."""
    from fanstore.errors import ChunkUnavailable
    from fanstore.serve.node_client import NodeConnection

    node = StarvedEndpoint(dataset, tmp_path, spare=False)
    try:
        reader = NodeConnection(node.socket, deadline=1.0)
        cpu = node.stats()["cpu"]
        started = time.monotonic()
        with pytest.raises(ChunkUnavailable) as unanswered:
            reader.ask(HELLO)
        assert 1.0 <= time.monotonic() - started < 3
        assert str(unanswered.value) == (f"{node.socket}: the node's serve process has not answered for 1 s: it may "
                                         f"be out of file descriptors (its log says so; raise `ulimit -n` for the "
                                         f"job) or stopped; this process asks it nothing more")
        other_thread: list[BaseException] = []
        started = time.monotonic()
        worker = threading.Thread(target=lambda: other_thread.append(pytest.raises(ChunkUnavailable, reader.ask,
                                                                                   HELLO).value))
        worker.start()
        worker.join()
        assert time.monotonic() - started < 0.5 and str(other_thread[0]) == str(unanswered.value)
        time.sleep(2)  # its connection still waits to be accepted: the listener stays readable
        stats = node.stats()
        assert stats["cpu"] - cpu < 0.5 and stats["out_of_descriptors"] >= 1, (cpu, stats)
        node.say("free")
        assert NodeConnection(node.socket, deadline=10).ask(HELLO)[0] == OK
        log = node.end()
        assert log.count("out of file descriptors") == 1 and "Traceback" not in log, log
    finally:
        node.kill()


def test_a_reader_waits_as_long_as_its_node_says_a_working_one_may_take(dataset, tmp_path):
    """A reader's deadline was 120 s whatever the job: a node with --peer-timeout 60 may work on one READS for minutes
    (a fetch behind --max-in-flight others, each allowed its timeout), and its readers took it for stuck and read
    DEST for good. The node says its figure in HELLO; the reader takes it, on the socket HELLO came on too."""
    import socket as sockets
    import struct as structs

    from fanstore.serve.node_client import open_served_dataset
    from fanstore.serve.node_endpoint import ANSWER_DEADLINE, SEND_TIMEOUT, answer_within
    from fanstore.serve.placement import place

    assert answer_within(5.0, 8) == ANSWER_DEADLINE  # the defaults
    assert answer_within(60.0, 8) == 60.0 * 9 + SEND_TIMEOUT
    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    path = str(dataset.path)
    description = {"dest": path, "local_dir": path, "index_dir": path, "rank": 0, "size": 2, "direct": [],
                   "owners": place(dataset.index, 2).owners.to_json(), "answer_within": answer_within(60.0, 8)}
    node = NodeEndpoint(tmp_path, description, source, lookup, ahead)
    try:
        with open_served_dataset(str(node.path)) as served:
            connection = served.reader.source._connection
            assert connection.deadline == 600.0
            for link in connection._links:  # the socket HELLO came on, and any opened since
                seconds, _ = structs.unpack("ll", link.socket.getsockopt(sockets.SOL_SOCKET, sockets.SO_RCVTIMEO, 16))
                assert seconds == 600
            assert all(served.read(name) == dataset.read(name) for name in served.files())
    finally:
        node.close()
        ahead.close()


def _read_in_a_forked_child(served, names) -> None:
    for name in names:
        served.read(name)


def test_what_readers_read_themselves_is_told_to_the_node_once_from_each_process(dataset, tmp_path):
    """--stats said `0 local` for a job whose fanstore.torch readers read half their files from the node's chunks:
    they read those themselves. Each reader tells the node (COUNTS) on close, at its process's end (a forked
    DataLoader worker's too, which multiprocessing ends with os._exit), and once a second: every local blob once,
    a forked child's never counted again by its parent. A malformed COUNTS is refused by name."""
    import multiprocessing

    from fanstore.serve.node_client import NodeConnection, open_served_dataset
    from fanstore.serve.node_protocol import COUNTS, READ_COUNTS, REFUSED
    from fanstore.serve.placement import place

    source = HalfRemote(dataset)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    path = str(dataset.path)
    owners = place(dataset.index, 2).owners
    description = {"dest": path, "local_dir": path, "index_dir": path, "rank": 0, "size": 2, "direct": [],
                   "owners": owners.to_json()}
    node = NodeEndpoint(tmp_path, description, source, lookup, ahead)
    names = sorted(dataset.files())

    def local_of(some) -> tuple[int, int]:
        entries = [dataset.index.entries[dataset.resolve(name)] for name in some]
        mine = [e for e in entries if owners.owner(int(e["chunk"]), int(e["offset"])) == 0]
        return len(mine), sum(int(e["stored_len"]) for e in mine)

    try:
        served = open_served_dataset(str(node.path))
        first, second = names[: len(names) // 2], names[len(names) // 2 :]
        for name in first:
            served.read(name)
        child = multiprocessing.get_context("fork").Process(target=_read_in_a_forked_child, args=(served, second))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        stats = node.stats()
        assert (stats["readers_local"], stats["readers_local_bytes"]) == local_of(second)  # the child's, at its end
        served.close()
        stats = node.stats()
        assert (stats["readers_local"], stats["readers_local_bytes"]) == local_of(names) and local_of(first)[0] > 0
        assert stats["readers_dest"] == stats["readers_dest_bytes"] == 0
        reader = NodeConnection(str(node.path))
        assert reader.ask(COUNTS, length=READ_COUNTS.size, payload=READ_COUNTS.pack(1 << 53, 0, 0, 0)) == (
            REFUSED, b"COUNTS value 9007199254740992: each is below 2^53")
        status, reason = reader.ask(COUNTS, length=3, payload=b"abc")
        assert status == REFUSED and b"COUNTS takes chunk 0, offset 0 and length 32" in reason
        assert node.stats()["readers_local"] == local_of(names)[0]
    finally:
        node.close()
        ahead.close()


def test_a_socket_path_no_unix_socket_can_have_is_named_with_its_reason(tmp_path):
    """FANSTORE_SERVE_SOCKET set by hand to a name longer than a Unix socket's address takes even through its
    directory's descriptor: Python's OSError carries no strerror then, and the reader's error ended in 'None'."""
    path = tmp_path / ("s" * 120)
    with pytest.raises(ChunkUnavailable) as raised:
        open_served_dataset(str(path))
    assert str(raised.value) == f"{path}: cannot reach the node's serve process: AF_UNIX path too long"
