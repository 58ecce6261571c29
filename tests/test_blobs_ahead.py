"""The serve process's fetches ahead for the node's PyTorch readers (fanstore/serve/blobs_ahead.py), one plan per
training process, over a source that answers from another thread, as the transport's MPI thread does; and the
node's socket in a deep directory. The whole path, with real MPI and real readers, runs in tests/serve_torch_job.py
and tests/serve_torch_processes.py."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from conftest import numbered_files
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.chunk_source import BlobRead, LocalChunkSource
from fanstore.errors import ChunkUnavailable
from fanstore.serve.blobs_ahead import BLOB_OVERHEAD, MOUNT_PLAN, BlobsAhead, EntriesAhead, PlanRefused
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


def lookup_blob(dataset, lookup, row) -> bytes:
    """The stored bytes of blob `row`, read straight from the dataset's chunk file."""
    return LocalChunkSource(dataset.path, dataset.index.chunks["size"]).read(*lookup.locate(int(row)))


def plan_of(dataset, lookup) -> np.ndarray:
    """Every file's blob row, in path order."""
    rows = []
    for path in sorted(dataset.files()):
        entry = dataset.index.entries[dataset.resolve(path)]
        rows.append(lookup.read_row(int(entry["chunk"]), int(entry["offset"]), int(entry["stored_len"])))
    return np.array(rows, dtype=lookup.row_dtype)


def ahead_of(source, lookup, **bounds) -> BlobsAhead:
    return BlobsAhead(source, lookup.locate, **bounds)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def length_of(lookup, row) -> int:
    return lookup.locate(int(row))[2]


def cost_of(lookup, row) -> int:
    """What holding blob `row` counts in the bounds."""
    return length_of(lookup, row) + BLOB_OVERHEAD


def test_every_blob_of_the_plan_is_fetched_once_within_the_bounds(dataset, lookup):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    largest = max(length_of(lookup, row) for row in plan)
    ahead = ahead_of(source, lookup, capacity=20_000, in_flight=6_000)
    try:
        ahead.replace_plan(1, "c1", plan)
        for row in plan:  # the reader takes each in turn, making room for the next
            wait_for(lambda row=row: ahead.holds(int(row)), f"blob row {row}")
            assert ahead.take(int(row)) is not None
        assert ahead.cancelled == 0 and ahead.fetched == ahead.hits == len(plan)
        assert source.most_out <= 6_000 + largest  # a new batch starts only below the in-flight bound
        assert ahead.stats()["ahead_held_bytes"] == 0
    finally:
        ahead.close()


def test_a_blob_that_fails_or_is_local_is_left_to_its_reader_and_the_rest_still_come(dataset, lookup):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    source.failing = {lookup.locate(int(plan[3]))[0]}
    source.local = {lookup.locate(int(plan[-1]))[0]}
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "c1", plan)
        left = {int(row) for row in plan if lookup.locate(int(row))[0] in source.failing | source.local}
        wait_for(lambda: ahead.fetched == len(plan) - len(left), "every other blob")
        assert ahead.stats()["plans"]["1"]["outstanding_bytes"] == sum(
            cost_of(lookup, row) for row in plan if int(row) not in left)  # what did not come is not held
        assert all(ahead.take(row) is None for row in left)
        row = next(int(row) for row in plan if int(row) not in left)
        assert bytes(ahead.take(row)) == source._chunks.read(*lookup.locate(row))
    finally:
        ahead.close()


def test_a_new_plan_of_a_process_gives_back_what_came_for_its_old_one(dataset, lookup):
    source = AnsweredLater(dataset, delay=0.2)
    plan = plan_of(dataset, lookup)
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "c1", plan[:10])
        time.sleep(0.05)  # asked, not come yet
        ahead.replace_plan(1, "c2", plan[10:20])  # the same process, from another of its connections
        wait_for(lambda: ahead.fetched == 10 and source.out == 0, "the new plan's blobs")
        assert ahead.stats()["ahead_held_bytes"] == sum(cost_of(lookup, row) for row in plan[10:20])
        assert all(ahead.take(int(row)) is None for row in plan[:10])
        assert all(ahead.take(int(row)) is not None for row in plan[10:20])
        ahead.drop_plans_of("c1")  # the first connection closes: its plan was replaced already
        assert list(ahead.stats()["plans"]) == ["1"]
        ahead.drop_plans_of("c2")
        assert ahead.stats()["plans"] == {} and ahead.stats()["ahead_held_bytes"] == 0
    finally:
        ahead.close()


def test_each_process_has_its_plan_and_both_are_fetched_ahead_within_one_bound(dataset, lookup):
    """Two training processes on a node, each announcing its own half: neither replaces the other, fetches take
    turns by need, and together they stay within the bounds."""
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    first, second = plan[0::2], plan[1::2]
    largest = max(cost_of(lookup, row) for row in plan)
    ahead = ahead_of(source, lookup, capacity=12_000, in_flight=5_000)
    try:
        ahead.replace_plan(101, "a", first)
        ahead.replace_plan(102, "b", second)
        wait_for(lambda: ahead.stats()["ahead_held_bytes"] + ahead.stats()["ahead_asked_bytes"] >= 12_000 - largest,
                 "the bound filled")
        time.sleep(0.05)
        stats = ahead.stats()
        assert stats["ahead_held_bytes"] + stats["ahead_asked_bytes"] <= 12_000 + largest
        held = {owner: counters["outstanding_bytes"] for owner, counters in stats["plans"].items()}
        assert held["101"] > 0 and held["102"] > 0  # both, not the last announced alone
        for row_a, row_b in zip(first, second):  # both processes read, in turn
            for row in (row_a, row_b):
                wait_for(lambda row=row: ahead.holds(int(row)), f"blob row {row}")
                assert ahead.take(int(row)) is not None
        stats = ahead.stats()
        assert stats["plans"]["101"]["hits"] == len(first) and stats["plans"]["102"]["hits"] == len(second)
        assert source.most_out <= 5_000 + largest
    finally:
        ahead.close()


def test_a_process_that_does_not_read_gives_back_what_it_holds_past_its_share(dataset, lookup):
    """A plan announced and never read fills the bound; when a second process announces, the first gives back its
    furthest blobs down to its share, and the second's are fetched ahead as it reads: no process starves another."""
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    idle, reading = plan[:30], plan[30:]
    ahead = ahead_of(source, lookup, capacity=20_000)
    try:
        ahead.replace_plan(1, "idle", idle)
        wait_for(lambda: ahead.stats()["ahead_held_bytes"] >= 20_000 - 4_000 or ahead.fetched == len(idle),
                 "the idle plan's blobs")
        ahead.replace_plan(2, "reading", reading)
        for row in reading:
            wait_for(lambda row=row: ahead.holds(int(row)), f"the reading plan's blob row {row}")
            assert ahead.take(int(row)) is not None
        stats = ahead.stats()
        assert stats["plans"]["2"]["hits"] == len(reading) and stats["ahead_given_back"] > 0
        # Once the reading plan has every row started, the idle one may fill the bound again: nothing else needs it.
    finally:
        ahead.close()


def test_a_blob_two_plans_list_is_fetched_once_and_held_until_both_read_it(dataset, lookup):
    source = AnsweredLater(dataset)
    plan = plan_of(dataset, lookup)
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "a", plan[:5])
        ahead.replace_plan(2, "b", plan[:5])
        wait_for(lambda: ahead.fetched == 5, "the shared blobs")
        time.sleep(0.02)
        assert ahead.fetched == 5 and source.most_out <= sum(length_of(lookup, row) for row in plan[:5])
        assert all(ahead.take(int(row)) is not None for row in plan[:5])
        assert all(ahead.take(int(row)) is not None for row in plan[:5])  # the second reader's
        assert ahead.take(int(plan[0])) is None and ahead.stats()["ahead_held_bytes"] == 0
    finally:
        ahead.close()


def test_a_read_before_its_blob_was_started_cancels_the_start_and_one_while_on_its_way_waits(dataset, lookup):
    """A reader ahead of the fetches reads a blob itself: the fetcher must not fetch it afterwards and hold it. A
    read of a blob on its way waits for that fetch, and is its one reader: never a second fetch, nothing held."""
    source = AnsweredLater(dataset, delay=0.3)
    plan = plan_of(dataset, lookup)
    length = length_of(lookup, plan[0])
    ahead = ahead_of(source, lookup, in_flight=length)  # one blob at a time
    try:
        ahead.replace_plan(1, "a", plan[:4])
        wait_for(lambda: source.out > 0, "the first fetch")
        assert ahead.take(int(plan[2])) is None  # read before it was started
        assert bytes(ahead.take(int(plan[0]))) == bytes(lookup_blob(dataset, lookup, plan[0]))  # on its way
        assert ahead.joined == 1
        wait_for(lambda: ahead.fetched == 3 and source.out == 0, "the other two")
        time.sleep(0.4)
        assert ahead.fetched == 3 and ahead.cancelled == 1
        assert ahead.stats()["ahead_held_bytes"] == sum(cost_of(lookup, row) for row in (plan[1], plan[3]))
    finally:
        ahead.close()


def test_a_read_that_waits_for_a_blob_whose_fetch_fails_is_no_hit(dataset, lookup):
    """--stats' hits are reads the holder answered: one that waited for a fetch that failed reads its blob itself."""
    source = AnsweredLater(dataset, delay=0.2)
    plan = plan_of(dataset, lookup)
    chunks = [lookup.locate(int(row))[0] for row in plan]
    failing = chunks[0]
    good = [int(row) for row, chunk in zip(plan, chunks) if chunk != failing][:3]
    source.failing.add(failing)
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "a", np.array([plan[0], *good], dtype=plan.dtype))
        wait_for(lambda: source.out > 0, "the fetches")
        assert ahead.take(int(plan[0])) is None  # it waited, and the fetch failed: its reader fetches it
        assert all(ahead.take(row) is not None for row in good)
        stats = ahead.stats()
        assert stats["ahead_hits"] == stats["plans"]["1"]["hits"] == len(good)
        assert stats["ahead_joined_failed"] == 1 and stats["ahead_joined"] <= len(good)
    finally:
        ahead.close()


def test_a_read_wakes_the_fetcher_only_when_it_makes_the_room_the_fetcher_waits_for(dataset, lookup):
    source = AnsweredLater(dataset, delay=0.001)
    plan = plan_of(dataset, lookup)
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "a", plan)
        wait_for(lambda: ahead.fetched == len(plan), "the whole plan")
        wakeups = ahead.wakeups
        assert all(ahead.take(int(row)) is not None for row in plan)
        assert ahead.wakeups == wakeups  # nothing left to fetch: no read woke the fetcher
    finally:
        ahead.close()
    bounded = ahead_of(AnsweredLater(dataset, delay=0.001), lookup, capacity=length_of(lookup, plan[0]))
    try:
        bounded.replace_plan(1, "a", plan[:3])
        wait_for(lambda: bounded.fetched == 1, "the first blob")
        wakeups = bounded.wakeups
        assert bounded.take(int(plan[0])) is not None
        wait_for(lambda: bounded.fetched == 2, "the second blob, once the first made room")
        assert bounded.wakeups == wakeups + 1
    finally:
        bounded.close()


def test_a_node_keeps_plans_of_a_bounded_number_of_processes(dataset, lookup):
    ahead = ahead_of(AnsweredLater(dataset), lookup, max_plans=2)
    plan = plan_of(dataset, lookup)
    try:
        ahead.replace_plan(1, "a", plan[:2])
        ahead.replace_plan(2, "b", plan[2:4])
        with pytest.raises(PlanRefused, match="2 processes at most"):
            ahead.replace_plan(3, "c", plan[4:6])
        ahead.replace_plan(2, "b", plan[6:8])  # a process with a plan may always replace it
        ahead.drop_plans_of("a")
        ahead.replace_plan(3, "c", plan[4:6])
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
    ahead = ahead_of(FailsOnce(source), lookup,
                     in_flight=sum(cost_of(lookup, row) for row in plan[:first_batch]))
    try:
        ahead.replace_plan(1, "a", plan)
        rest = plan[first_batch:]
        for row in rest:
            wait_for(lambda row=row: ahead.holds(int(row)), f"blob row {row}")
            assert ahead.take(int(row)) is not None
        wait_for(lambda: source.out == 0, "the first batch's one started read")
        # The failed batch, its one started read too, is left to the readers; its bytes no longer count as asked,
        # so the bound let the rest through and nothing of the next plan is held back.
        assert all(ahead.take(int(row)) is None for row in plan[:first_batch])
        assert ahead.failed_batches == 1 and ahead.fetched == len(rest)
        assert "fetching ahead for this node's readers failed" in caplog.text and "a bug in the source" in caplog.text
        ahead.replace_plan(1, "a", plan[:first_batch])
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


def test_the_mount_and_a_training_process_share_one_holder(dataset, lookup):
    """The mount's plan (by entry: EntriesAhead) and a training process's plan (by blob row) name the same blobs:
    each is fetched once, within the one bound, and both readers get it; nothing stays held after."""
    source = AnsweredLater(dataset)
    ahead = ahead_of(source, lookup)
    paths = sorted(dataset.files())
    entries = np.array([dataset.resolve(path) for path in paths])
    mount = EntriesAhead(ahead, lookup, dataset.index, np.ones(len(dataset.index.entries), dtype=bool))
    try:
        mount.follow(entries, start_now=True)
        ahead.replace_plan(4242, "a connection", plan_of(dataset, lookup))
        wait_for(lambda: ahead.fetched == len(paths), "both plans")
        time.sleep(0.02)
        assert ahead.fetched == len(paths) and set(ahead.stats()["plans"]) == {MOUNT_PLAN, "4242"}
        got: list[bytes] = []
        for entry in entries:
            assert mount.claim(int(entry), lambda blob, error: got.append(bytes(blob)))
        assert got == [lookup_blob(dataset, lookup, row) for row in plan_of(dataset, lookup)]
        assert all(ahead.take(int(row)) is not None for row in plan_of(dataset, lookup))
        assert ahead.stats()["ahead_held_bytes"] == 0 and mount.stats()["hits"] == len(paths)
    finally:
        ahead.close()


def test_a_read_waiting_for_a_blob_is_answered_when_the_holder_closes(dataset, lookup):
    """A blob on its way when the node shuts down: the read waiting for it is told it will not come (it then reads
    the usual way), never left waiting."""
    source = AnsweredLater(dataset, delay=2)
    plan = plan_of(dataset, lookup)
    ahead = ahead_of(source, lookup)
    ahead.replace_plan(1, "a", plan[:1])
    wait_for(lambda: source.out > 0, "the fetch")
    outcome: list = []
    assert ahead.claim(int(plan[0]), lambda blob, error: outcome.append((blob, error)))
    ahead.close()
    assert len(outcome) == 1 and outcome[0][0] is None and "closed" in str(outcome[0][1])


def test_a_plan_with_a_limit_starts_only_what_its_reader_allows(dataset, lookup):
    """The mount's plan is fetched a window ahead of its reader: rows past the limit wait for `allow`."""
    source = AnsweredLater(dataset, delay=0.001)
    plan = plan_of(dataset, lookup)
    ahead = ahead_of(source, lookup)
    try:
        ahead.replace_plan(1, "a", plan, limit=0)
        time.sleep(0.05)
        assert ahead.stats()["plans"]["1"]["started"] == 0
        ahead.allow(1, 5)
        wait_for(lambda: ahead.fetched == 5, "the allowed rows")
        ahead.allow(1, 3)  # a limit never moves back
        time.sleep(0.05)
        assert ahead.fetched == 5 and ahead.stats()["plans"]["1"]["started"] == 5
    finally:
        ahead.close()
