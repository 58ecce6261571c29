"""The FUSE handlers, called directly: any failure answers its one request with an errno, never ends the loop.

The mounted tests (test_mount.py) show a damaged chunk and a failing disk cost only their files; these show the
rule holds for every handler and every kind of exception, including ones a real dataset cannot provoke (a bug).
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import threading
import time

import numpy as np

import pytest

pyfuse3 = pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")
trio = pytest.importorskip("trio")

from conftest import make_tree, numbered_files  # noqa: E402
from fanstore import PackOptions, open_dataset, pack  # noqa: E402
from fanstore.core.cache import DecodedCache  # noqa: E402
from fanstore.core.chunk_source import LocalChunkSource  # noqa: E402
from fanstore.errors import ChunkCorrupt, ChunkUnavailable  # noqa: E402
from fanstore.mount import fuse_ops  # noqa: E402
from fanstore.mount.fuse_ops import FanstoreOperations, PrefetchView  # noqa: E402
from fanstore.mount.kernel_holds import KernelHolds  # noqa: E402
from fanstore.mount.prefetch import FileOrder, Prefetcher  # noqa: E402
from fanstore.core.reader import Reader  # noqa: E402
from fanstore.serve import blobs_ahead  # noqa: E402
from fanstore.serve.blobs_ahead import BlobsAhead, EntriesAhead  # noqa: E402
from fanstore.serve.node_protocol import BlobLookup  # noqa: E402
from fanstore.serve.placement import BlobTable  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuse_ops")
    pack(make_tree(root / "src"), root / "ds", PackOptions(codec="zstd:3", workers=1))
    with open_dataset(root / "ds") as ds:
        yield ds


def operations_failing_with(dataset, exc: BaseException) -> FanstoreOperations:
    def load(key: int) -> bytes:
        raise exc
    return FanstoreOperations(dataset.index, DecodedCache(1 << 20, load), None, decode_threads=1)


def test_every_handler_the_class_defines_answers_with_an_errno():
    handlers = {name for name, value in vars(FanstoreOperations).items()
                if inspect.iscoroutinefunction(value) and name in vars(pyfuse3.Operations)}
    assert {"lookup", "getattr", "read", "open", "readdir", "readlink", "statfs"} <= handlers
    unwrapped = sorted(name for name in handlers if not getattr(vars(FanstoreOperations)[name], "answers_errno", False))
    assert unwrapped == []


@pytest.mark.parametrize("exc, code", [
    (ChunkCorrupt("labels.txt: checksum mismatch in chunk 0", path="labels.txt", chunk_id=0), errno.EIO),
    (ChunkUnavailable("chunks/00000000.fsc: cannot open chunk 0: Too many open files", chunk_id=0), errno.EIO),
    (OSError(errno.EMFILE, "Too many open files"), errno.EMFILE),
    (MemoryError(), errno.ENOMEM),
    (OverflowError("Python int too large to convert to C long"), errno.EIO),
    (IndexError("index 7 is out of bounds"), errno.EIO),
    (ZeroDivisionError("a bug"), errno.EIO),
])
def test_a_failing_read_answers_its_errno_and_logs_once(dataset, caplog, exc, code):
    operations = operations_failing_with(dataset, exc)
    entry = dataset.index.lookup("labels.txt")
    with caplog.at_level(logging.ERROR, logger="fanstore.mount"):
        for _ in range(3):
            with pytest.raises(pyfuse3.FUSEError) as caught:
                trio.run(operations.read, entry, 0, 4096)
            assert caught.value.errno == code
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(errno.errorcode[code])
    if not isinstance(exc, (ChunkCorrupt, ChunkUnavailable)):
        assert type(exc).__name__ in lines[0] and "'labels.txt'" in lines[0]  # what failed, and on which file


def test_a_handler_given_nonsense_answers_not_raises(dataset):
    operations = operations_failing_with(dataset, AssertionError("not reached"))
    bad_inode = len(dataset.index.entries) + 10
    for call in (lambda: operations.getattr(bad_inode, None), lambda: operations.lookup(bad_inode, b"x", None),
                 lambda: operations.opendir(bad_inode, None), lambda: operations.readlink(1, None),
                 lambda: operations.read(2**70, 0, 10)):
        with pytest.raises(pyfuse3.FUSEError) as caught:
            trio.run(call)
        assert caught.value.errno in (errno.ENOENT, errno.EINVAL, errno.EIO)



class DeliveredLater(LocalChunkSource):
    """The dataset's own chunk files, every blob 'slow' (as another node's are): `start_read` answers from a thread
    of its own, as the serve transport's MPI thread does (or, 'ok, on the loop', later from the event loop itself,
    as a source may), and can be told to fail or to corrupt the blob."""

    def __init__(self, dataset_dir, sizes, first_try: str = "ok") -> None:
        super().__init__(dataset_dir, sizes)
        self.first_try = first_try
        self.started: list[int] = []
        self.read_by_thread: list[int] = []
        self.batches: list[int] = []  # blobs of each start_reads call (the node's holder fetching ahead)

    def read(self, chunk_id, offset, length):
        self.read_by_thread.append(chunk_id)
        stored = super().read(chunk_id, offset, length)
        return _damaged(stored) if self.first_try == "corrupt everywhere" else stored

    def read_other_copy(self, chunk_id, offset, length):  # as serve's DEST behind a peer
        return self.read(chunk_id, offset, length)

    def start_reads(self, reads, ahead=False):
        self.batches.append(len(reads))
        return super().start_reads(reads, ahead)

    def start_read(self, chunk_id, offset, length, done, ahead=False):
        if self.first_try == "no fetch of its own":  # as a chunk staged with a fault: read from DEST, by `read`
            return False
        self.started.append(chunk_id)
        if self.first_try == "unavailable at once":  # as the transport answers once its MPI thread has stopped
            done(None, ChunkUnavailable("the MPI thread has stopped", chunk_id=chunk_id))
            return True

        def deliver() -> None:
            if self.first_try == "unavailable":
                done(None, ChunkUnavailable("rank 2 did not answer within 1 s", chunk_id=chunk_id))
                return
            stored = super(DeliveredLater, self).read(chunk_id, offset, length)
            done(_damaged(stored) if self.first_try.startswith("corrupt") else stored, None)

        if self.first_try == "ok, on the loop":  # after the read has begun to wait for it
            async def deliver_soon() -> None:
                await trio.sleep(0.01)
                deliver()

            trio.lowlevel.spawn_system_task(deliver_soon)
        else:
            threading.Timer(0.01, deliver).start()
        return True

    def may_block(self, chunks, offsets):
        return np.ones(len(chunks), dtype=bool)


def _damaged(stored: bytes) -> bytes:
    return bytes([stored[0] ^ 0xFF]) + stored[1:]


def slow_operations(dataset, first_try: str = "ok", prefetch_list: list[str] | None = None,
                    depth: int = 0, started: bool = True) -> tuple[FanstoreOperations, DeliveredLater]:
    """The mount's operations over DeliveredLater, as under serve: with `depth`, a prefetcher `depth` files ahead
    (over `prefetch_list`, else each directory's listing) and the node's holder of blobs fetched ahead, told the
    list as the mount tells it (and, if `started`, every file of it started before the first read). Close both
    with `close_ahead`."""
    source = DeliveredLater(dataset.path, dataset.index.chunks["size"], first_try)
    reader = Reader(dataset.index, source)
    cache = DecodedCache(1 << 20, reader.load)
    kernel_holds = KernelHolds(len(dataset.index.entries))
    remote = np.ones(len(dataset.index.entries), dtype=bool)
    prefetcher = ahead = None
    if depth:
        lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
        source.holder = BlobsAhead(source.start_reads, lookup.locate)
        ahead = EntriesAhead(source.holder, lookup, dataset.index, remote)
        listed = [dataset.index.lookup(path) for path in prefetch_list or []]
        prefetcher = Prefetcher(PrefetchView(cache, kernel_holds), FileOrder(dataset.index, listed or None,
                                                                             slow=remote), depth, threads=2)
        if listed:
            ahead.follow(np.array(listed))  # as the mount does; fetched from the first read on
        if listed and started:  # here, given the time to start them all before it
            ahead.reached(listed[0])
            deadline = time.monotonic() + 10
            while source.holder.stats()["plans"]["mount"]["started"] < len(set(listed)):
                assert time.monotonic() < deadline, "the holder did not start the list's files"
                time.sleep(0.001)
    operations = FanstoreOperations(dataset.index, cache, prefetcher, decode_threads=1, kernel_holds=kernel_holds,
                                    source=source, reader=reader, may_block=remote, ahead=ahead)
    return operations, source


def close_ahead(operations: FanstoreOperations, source: DeliveredLater) -> None:
    operations.prefetcher.close()
    source.holder.close()


async def open_read_release(operations: FanstoreOperations, entry: int) -> bytes:
    info = await operations.open(entry + 1, os.O_RDONLY, None)
    try:
        return bytes(await operations.read(info.fh, 0, int(operations.index.entries["size"][entry]) + 4096))
    finally:
        await operations.release(info.fh)


@pytest.mark.parametrize("first_try", ["ok", "unavailable", "unavailable at once", "corrupt", "corrupt everywhere"])
def test_a_slow_file_read_whole_is_fetched_by_the_loop_and_a_failed_try_falls_back(dataset, first_try):
    """No thread waits for a blob from another node: the loop starts the fetch and is called back. If that try
    fails, or brings a blob that does not match its checksum, the file is read the usual way (which under serve
    falls back to DEST, and takes DEST's copy of a blob that fails); a blob corrupt there too is EIO."""
    operations, source = slow_operations(dataset, first_try)
    entry = dataset.index.lookup("labels.txt")
    size = int(dataset.index.entries["size"][entry])

    async def read_whole() -> bytes:
        return bytes(await operations.read(entry, 0, size + 4096))

    if first_try == "corrupt everywhere":
        with pytest.raises(pyfuse3.FUSEError) as caught:
            trio.run(read_whole)
        assert caught.value.errno == errno.EIO
        assert source.read_by_thread == [int(dataset.index.entries["chunk"][entry])]
        return
    assert trio.run(read_whole) == dataset.read("labels.txt")
    assert len(source.started) == 1
    assert source.read_by_thread == ([] if first_try == "ok" else [int(dataset.index.entries["chunk"][entry])])


@pytest.mark.parametrize("first_try", ["ok", "ok, on the loop", "unavailable", "corrupt", "corrupt everywhere"])
def test_a_slow_file_is_fetched_from_its_open_and_the_read_takes_that_fetch(dataset, first_try):
    """The peer's round trip overlaps the open's reply and the reader's read request: the fetch starts at open,
    and the read that follows waits for that one, never a second; a failed or corrupt try still falls back, and
    corrupt everywhere is EIO."""
    operations, source = slow_operations(dataset, first_try)
    entry = dataset.index.lookup("labels.txt")
    size = int(dataset.index.entries["size"][entry])

    async def open_then_read() -> bytes:
        info = await operations.open(entry + 1, os.O_RDONLY, None)
        assert source.started == [int(dataset.index.entries["chunk"][entry])]  # before any read
        try:
            return bytes(await operations.read(info.fh, 0, size + 4096))
        finally:
            await operations.release(info.fh)

    if first_try == "corrupt everywhere":
        with pytest.raises(pyfuse3.FUSEError) as caught:
            trio.run(open_then_read)
        assert caught.value.errno == errno.EIO
        return
    assert trio.run(open_then_read) == dataset.read("labels.txt")
    assert len(source.started) == 1
    assert source.read_by_thread == ([] if first_try.startswith("ok") else
                                     [int(dataset.index.entries["chunk"][entry])])


def test_a_slow_file_read_in_parts_after_its_open_is_fetched_once(dataset):
    """A reader that takes a file in small reads (a zip's directory, an HDF5 header) gets every part from the one
    fetch begun at open, kept in the decoded cache; no thread reads it again."""
    operations, source = slow_operations(dataset)
    entry = dataset.index.lookup("labels.txt")
    expected = dataset.read("labels.txt")

    async def read_in_parts() -> bytes:
        info = await operations.open(entry + 1, os.O_RDONLY, None)
        parts = [bytes(await operations.read(info.fh, start, 7)) for start in range(0, len(expected), 7)]
        await operations.release(info.fh)
        return b"".join(parts)

    assert trio.run(read_in_parts) == expected
    assert len(source.started) == 1 and source.read_by_thread == []


def test_an_open_without_a_read_leaves_nothing_and_the_kernels_files_are_not_fetched(dataset):
    """A fetch begun at an open that reads nothing is dropped at release: the next open fetches afresh. A file the
    kernel holds whole (a second epoch) is not fetched at its open at all."""
    operations, source = slow_operations(dataset)
    entry = dataset.index.lookup("labels.txt")
    size = int(dataset.index.entries["size"][entry])

    async def scenario() -> bytes:
        info = await operations.open(entry + 1, os.O_RDONLY, None)
        await operations.release(info.fh)
        info = await operations.open(entry + 1, os.O_RDONLY, None)
        data = bytes(await operations.read(info.fh, 0, size))  # whole: the kernel holds it from now on
        await operations.release(info.fh)
        info = await operations.open(entry + 1, os.O_RDONLY, None)
        await operations.release(info.fh)
        return data

    assert trio.run(scenario) == dataset.read("labels.txt")
    assert len(source.started) == 2  # the first open's, then the second's; none at the third
    assert operations.stats()["cache"]["bytes_held"] == 0  # nothing left behind for the files read whole


def train_files(dataset) -> list[str]:
    return sorted(path for path in dataset.files() if path.startswith("train/"))


def read_in_order(operations: FanstoreOperations, source: DeliveredLater, dataset, order: list[str]) -> dict:
    """Open, read whole and release each file of `order` through `operations`, checked against the API's bytes;
    the counters after, the prefetcher and the holder closed."""
    entries = [dataset.index.lookup(path) for path in order]

    async def epoch() -> list[bytes]:
        with trio.fail_after(30):  # a fetch nobody hands over would hang its read
            return [await open_read_release(operations, entry) for entry in entries]

    try:
        assert trio.run(epoch) == [dataset.read(path) for path in order]
        return operations.stats()
    finally:
        close_ahead(operations, source)


@pytest.mark.parametrize("first_try", ["ok", "unavailable", "corrupt"])
def test_files_of_a_prefetch_list_are_fetched_ahead_by_the_holder_and_their_reads_take_those_blobs(dataset,
                                                                                                  first_try):
    """The list is the mount's plan in the node's holder, which fetches its files ahead from their nodes, still
    stored, on its own thread: each read (from its open) takes its file's blob, come or on its way, and the loop
    starts no fetch of its own; no prefetch thread reads one. If the holder's try fails, the file is read the
    usual way (which falls back to DEST under serve); a blob that comes and fails its checksum is read from the
    other copy (DEST) once, never asked of the peer again."""
    order = train_files(dataset)[:12]
    operations, source = slow_operations(dataset, first_try, prefetch_list=order, depth=4)
    chunks = sorted(int(dataset.index.entries["chunk"][dataset.index.lookup(path)]) for path in order)
    stats = read_in_order(operations, source, dataset, order)
    assert stats["prefetch"]["decoded"] == 0 and stats["prefetch"]["fetches_at_open"] == 0
    if first_try == "ok":
        assert sorted(source.started) == chunks  # once each, by the holder
        assert stats["ahead"]["hits"] == len(order) and source.read_by_thread == []
    elif first_try == "corrupt":
        assert sorted(source.started) == chunks and stats["ahead"]["hits"] == len(order)
        assert sorted(source.read_by_thread) == chunks  # each one's other copy, once
    else:
        assert set(source.started) == set(chunks) and sorted(source.read_by_thread) == chunks


def test_the_holder_asks_for_a_lists_files_together(dataset):
    """One wake of the MPI thread, one of the peer and one ring back should carry several files: the holder starts
    the list's files together (serve's source asks each peer for its blobs among them in one request)."""
    order = train_files(dataset)[:20]
    operations, source = slow_operations(dataset, prefetch_list=order, depth=6)
    read_in_order(operations, source, dataset, order)
    assert source.batches == [len(order)]


def test_files_the_holder_cannot_fetch_are_read_by_their_reads(dataset):
    """A file whose blob has no fetch of its own (under serve, a chunk read from DEST) is given back by the holder,
    and read whole and right by its read."""
    order = train_files(dataset)[:8]
    operations, source = slow_operations(dataset, "no fetch of its own", prefetch_list=order, depth=4)
    stats = read_in_order(operations, source, dataset, order)
    assert source.started == [] and stats["ahead"]["hits"] == 0
    assert len(source.read_by_thread) == len(order)


def test_a_list_is_fetched_a_window_ahead_of_the_reader(dataset, monkeypatch):
    """Told at mount, a list is fetched from the reader's first read on, at most MOUNT_WINDOW files ahead of it: a
    rank whose reader has not started (or stopped) does not fetch its whole epoch."""
    monkeypatch.setattr(blobs_ahead, "MOUNT_WINDOW", 4)
    monkeypatch.setattr(blobs_ahead, "REACHED_STEP", 1)
    order = train_files(dataset)[:20]
    operations, source = slow_operations(dataset, prefetch_list=order, depth=2, started=False)
    entries = [dataset.index.lookup(path) for path in order]

    async def epoch() -> list[int]:
        started = []
        for entry in entries:
            await open_read_release(operations, entry)
            await trio.sleep(0.02)  # the holder's thread catches up
            started.append(source.holder.stats()["plans"]["mount"]["started"])
        return started

    try:
        time.sleep(0.05)
        assert source.holder.stats()["plans"]["mount"]["started"] == 0
        started = trio.run(epoch)
    finally:
        close_ahead(operations, source)
    assert all(count <= place + 1 + 4 for place, count in enumerate(started)), (started, source.holder.stats())
    assert started[-1] == len(order) - 1, (started, source.holder.stats())  # the first: by its own read


def test_without_a_list_the_holder_fetches_a_directory_ahead_only_while_the_reader_follows_it(tmp_path):
    """With no prefetch list the mount tells the holder the rest of the directory being read in order, once, from
    the second read that follows another: a single read (a `cat`) fetches nothing ahead. For a reader that does not
    follow the order (a shuffled sampler with no list) fetching ahead would bring blobs from their nodes for
    nothing: the plan is withdrawn once most reads come out of order, and told again once they follow it."""
    numbered_files(tmp_path / "src", 120, lambda _number: 3000)
    pack(tmp_path / "src", tmp_path / "ds", PackOptions(codec="zstd:3", workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        order = sorted(ds.files())
        operations, source = slow_operations(ds, depth=2)
        # Strided: each read 3 places after the last, never within the 2 the prefetcher looks ahead.
        async def plan_after_each(paths: list[str]) -> list[int]:
            rows = []
            for path in paths:
                assert await open_read_release(operations, ds.index.lookup(path)) == ds.read(path)
                rows.append(operations.stats()["ahead"]["rows"])
            return rows

        try:
            single = trio.run(plan_after_each, order[:1])
            following = trio.run(plan_after_each, order[1:30])
            strided = trio.run(plan_after_each, order[30:90:3])
            again = trio.run(plan_after_each, order[90:])
            fetched = source.holder.fetched  # all plans told, each replacing the last
        finally:
            close_ahead(operations, source)
    assert single == [0]
    assert following == [len(order) - 2] * len(following), following  # told once, at the second read
    # About 11 reads out of order tip the share below one half: the plan goes, and is not told again ...
    assert 0 not in strided[:5] and set(strided[12:]) == {0}, strided
    assert again[-1] > 0, again  # ... until reads follow the order again
    assert fetched >= len(order) // 2


def test_fetches_begun_at_open_and_never_read_are_bounded(dataset, monkeypatch):
    """A reader that opens files and reads none of them (a `stat`-like tool that opens) leaves at most FETCHES_HELD
    fetches begun at open behind, the oldest dropped first; a dropped one's read, if it comes, fetches again."""
    monkeypatch.setattr(fuse_ops, "FETCHES_HELD", 3)
    entries = [dataset.index.lookup(path) for path in train_files(dataset)]
    operations, source = slow_operations(dataset)

    async def open_each() -> int:
        most = 0
        for entry in entries:
            await operations.open(entry + 1, os.O_RDONLY, None)  # never read, never released
            most = max(most, operations.stats()["prefetch"]["fetches_at_open"])
        await trio.sleep(0.05)  # the fetches arrive, to nobody
        return most

    most = trio.run(open_each)
    fetches = len(source.started)
    first = bytes(trio.run(operations.read, entries[0], 0, int(dataset.index.entries["size"][entries[0]])))
    assert most == 3 and len(entries) > 3 and fetches == len(entries)
    assert first == dataset.read(train_files(dataset)[0])
    assert len(source.started) == fetches + 1  # dropped, so fetched again
