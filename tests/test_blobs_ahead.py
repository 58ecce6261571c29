"""The serve process's fetches ahead for the node's PyTorch readers (fanstore/serve/blobs_ahead.py),
over a source that answers from another thread, as the transport's MPI thread does, and the node's socket in a
deep directory. The whole path, with real MPI and real readers, runs in tests/serve_torch_job.py."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from conftest import numbered_files
from fanstore import PackOptions, open_dataset, pack
from fanstore.chunk_source import BlobRead, LocalChunkSource
from fanstore.errors import ChunkUnavailable
from fanstore.serve.blobs_ahead import BLOB_OVERHEAD, BlobsAhead
from fanstore.serve.node_endpoint import SOCKET_NAME, UNIX_PATH_MAX, unix_address
from fanstore.serve.node_protocol import BlobLookup
from fanstore.serve.placement import BlobTable


class AnsweredLater:
    """start_reads over a dataset's chunk files: each blob comes from a thread of its own, after `delay`; blobs of
    chunks in `failing` fail as unavailable, of chunks in `local` are not started (stored on this node)."""

    def __init__(self, dataset, delay: float = 0.005) -> None:
        self._chunks = LocalChunkSource(dataset.path, dataset.index.chunks["size"])
        self.delay = delay
        self.failing: set[int] = set()
        self.local: set[int] = set()
        self.out = 0  # bytes asked for and not answered yet
        self.most_out = 0
        self._lock = threading.Lock()

    def __call__(self, reads: list[BlobRead]) -> list[bool]:
        started = [read.chunk_id not in self.local for read in reads]
        asked = [read for read, ok in zip(reads, started) if ok]
        with self._lock:
            self.out += sum(read.length for read in asked)
            self.most_out = max(self.most_out, self.out)
        threading.Timer(self.delay, self._answer, (asked,)).start()
        return started

    def _answer(self, reads: list[BlobRead]) -> None:
        for read in reads:
            with self._lock:
                self.out -= read.length
            if read.chunk_id in self.failing:
                read.done(None, ChunkUnavailable("rank 1 did not answer", chunk_id=read.chunk_id))
            else:
                read.done(self._chunks.read(read.chunk_id, read.offset, read.length), None)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ahead")
    numbered_files(root / "src", 60, lambda number: 1000 + 37 * number)
    pack(root / "src", root / "ds", PackOptions(codec="none", chunk_size=8 * 1024, workers=1))
    with open_dataset(root / "ds") as ds:
        yield ds


@pytest.fixture(scope="module")
def lookup(dataset):
    return BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))


def plan_of(dataset, lookup) -> np.ndarray:
    """Every file's blob row, in path order."""
    rows = []
    for path in sorted(dataset.files()):
        entry = dataset.index.entries[dataset.resolve(path)]
        rows.append(lookup.read_row(int(entry["chunk"]), int(entry["offset"]), int(entry["stored_len"])))
    return np.array(rows, dtype=lookup.row_dtype)


def cost_of(lookup, row) -> int:
    """What holding blob `row` counts in the bounds."""
    return lookup.locate(int(row))[2] + BLOB_OVERHEAD


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_every_blob_of_the_plan_is_fetched_once_within_the_bounds(dataset, lookup):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    largest = max(cost_of(lookup, row) for row in plan)
    ahead = BlobsAhead(source, lookup.locate, capacity=20_000, in_flight=6_000)
    try:
        ahead.replace_plan("c1", plan)
        for row in plan:  # the reader takes each in turn, making room for the next
            wait_for(lambda row=row: ahead.take(int(row)) is not None, f"blob row {row}")
        assert ahead.fetched == ahead.hits == len(plan)
        assert source.most_out <= 6_000 + largest  # a new batch starts only below the in-flight bound
    finally:
        ahead.close()


def test_a_blob_that_fails_or_is_local_is_left_to_its_reader_and_the_rest_still_come(dataset, lookup):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    source.failing = {lookup.locate(int(plan[3]))[0]}
    source.local = {lookup.locate(int(plan[-1]))[0]}
    ahead = BlobsAhead(source, lookup.locate)
    try:
        ahead.replace_plan("c1", plan)
        left = {int(row) for row in plan if lookup.locate(int(row))[0] in source.failing | source.local}
        wait_for(lambda: ahead.fetched == len(plan) - len(left), "every other blob")
        assert all(ahead.take(row) is None for row in left)
        row = next(int(row) for row in plan if int(row) not in left)
        assert bytes(ahead.take(row)) == source._chunks.read(*lookup.locate(row))
    finally:
        ahead.close()


def test_a_new_plan_drops_what_came_for_the_old_one_and_a_closed_connection_its_plan(dataset, lookup):
    source = AnsweredLater(dataset, delay=0.2)
    plan = plan_of(dataset, lookup)
    ahead = BlobsAhead(source, lookup.locate)
    try:
        ahead.replace_plan("c1", plan[:10])
        time.sleep(0.05)  # asked, not come yet
        ahead.replace_plan("c2", plan[10:20])
        wait_for(lambda: ahead.fetched == 10 and source.out == 0, "the new plan's blobs")
        assert ahead.stats()["ahead_held_bytes"] == sum(cost_of(lookup, row) for row in plan[10:20])
        assert all(ahead.take(int(row)) is None for row in plan[:10])
        assert all(ahead.take(int(row)) is not None for row in plan[10:20])
        ahead.replace_plan("c2", plan[20:30])
        wait_for(lambda: ahead.fetched == 20, "the third plan's blobs")
        ahead.drop_plan_of("c1")  # its plan was replaced: nothing of the current one goes
        assert list(ahead.stats()["plans"]) == ["c2"]
        ahead.drop_plan_of("c2")
        assert ahead.stats()["plans"] == {} and ahead.stats()["ahead_held_bytes"] == 0
    finally:
        ahead.close()


class FailsOnce:
    """A source whose first batch raises, after starting the first of its reads (a bug half-way through)."""

    def __init__(self, source: AnsweredLater) -> None:
        self.source = source
        self.calls = 0

    def __call__(self, reads: list[BlobRead]) -> list[bool]:
        self.calls += 1
        if self.calls == 1:
            self.source(reads[:1])
            raise RuntimeError("a bug in the source")
        return self.source(reads)


def test_a_batch_the_source_fails_to_start_is_logged_and_the_rest_of_the_plan_still_comes(dataset, lookup,
                                                                                         caplog):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    first_batch = 5
    ahead = BlobsAhead(FailsOnce(source), lookup.locate,
                       in_flight=sum(cost_of(lookup, row) for row in plan[:first_batch]))
    try:
        ahead.replace_plan("c1", plan)
        rest = plan[first_batch:]
        for row in rest:
            wait_for(lambda row=row: ahead.take(int(row)) is not None, f"blob row {row}")
        wait_for(lambda: source.out == 0, "the first batch's one started read")
        # The failed batch, its one started read too, is left to the readers; its bytes no longer count as asked,
        # so the bound let the rest through and nothing of the next plan is held back.
        assert all(ahead.take(int(row)) is None for row in plan[:first_batch])
        assert ahead.failed_batches == 1 and ahead.fetched == len(rest)
        assert "fetching ahead for this node's readers failed" in caplog.text and "a bug in the source" in caplog.text
        ahead.replace_plan("c1", plan[:first_batch])
        wait_for(lambda: ahead.fetched == len(plan), "the next plan's blobs")
    finally:
        ahead.close()


def test_a_unix_socket_deeper_than_linux_allows_binds_and_connects(tmp_path):
    """A job's local directory may be deeper than the 107 bytes a Unix socket's path may have."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / SOCKET_NAME
    assert len(os.fsencode(path)) >= UNIX_PATH_MAX
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        with unix_address(path) as address:
            server.bind(address)
        server.listen()
        assert path.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            with unix_address(path) as address:
                client.connect(address)
            client.sendall(b"ping")
            accepted, _ = server.accept()
            with accepted:
                assert accepted.recv(4) == b"ping"
