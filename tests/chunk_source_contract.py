"""What every ChunkSource must do, in two parts (fanstore/core/chunk_source.py says what is promised):

- ExactBlobContract: what the read path asks of every source, the serve ones included. A blob is a file's stored
  bytes at (chunk, offset, stored length) as the index lists them; the node's serve process and a peer rank serve
  blobs and nothing else. Reads, read_many, start_read/start_reads, errors that name the chunk, reads from many
  threads, close and may_block, each for blobs.
- ChunkSourceContract (ExactBlobContract and more): what a source over chunk files does besides, any byte range
  (the header, part of a blob, nothing at all).

A source gets these tests by subclassing one of them and providing the `make_source` fixture. Where a source
legitimately differs, a capability flag of the class says how, and the contract checks the other side of it:

    BYTE_RANGES   any range reads (a range that is no blob reads right or, when False, is ChunkUnavailable)
    ALL_BLOBS     every blob reads (when False, `serves` says which do; the others are ChunkUnavailable)
    STARTS_READS  start_read/start_reads read some blobs without waiting (when False, they start none)

Each test takes only `dataset` (a packed dataset whose files lie in its sibling `src`) and `make_source`, so that a
script run under mpiexec (tests/serve_source_contract.py) runs the same tests on a rank, without pytest.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tree
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.chunk_source import BlobRead, ChunkSource, ChunkUnavailable
from fanstore.core.format import CHUNK_HEADER_LEN, chunk_file_name
from fanstore.core.index import Index
from fanstore.errors import ChunkError
from fanstore.serve.placement import BlobTable

CALLBACK_WAIT = 30.0  # seconds a started read may take to call back, on a loaded machine


def pack_contract_dataset(root: Path) -> Path:
    """The dataset the contract reads: make_tree's files in ROOT/src, packed into ROOT/ds, 16 KiB chunks."""
    dest = root / "ds"
    pack(make_tree(root / "src"), dest, PackOptions(codec="zstd:3", chunk_size=16 * 1024, workers=1))
    return dest


def dataset_blobs(dataset: Path) -> list[tuple[int, int, int]]:
    """(chunk, offset, stored length) of every blob of the dataset, files stored whole and blocks alike."""
    table = BlobTable.of(Index.load(dataset))
    return list(zip(table.chunk.tolist(), table.offset.tolist(), table.stored_len.tolist()))


def chunk_bytes(dataset: Path) -> dict[int, bytes]:
    """Every chunk file's bytes, by chunk id."""
    count = len(Index.load(dataset).chunks)
    return {chunk: (dataset / chunk_file_name(chunk)).read_bytes() for chunk in range(count)}


def assert_names_the_chunk(error: BaseException, chunk_id: int, kind: type[ChunkError] = ChunkUnavailable) -> None:
    assert isinstance(error, kind), f"chunk {chunk_id}: {type(error).__name__}: {error}"
    assert error.chunk_id == chunk_id and f"chunk {chunk_id}" in str(error), (error.chunk_id, str(error))


class ExactBlobContract:
    BYTE_RANGES = False
    ALL_BLOBS = True
    STARTS_READS = False

    def serves(self, chunk_id: int, offset: int) -> bool:
        """Whether the source reads the blob at `offset` of `chunk_id` (ALL_BLOBS: every one)."""
        return True

    @pytest.fixture
    def dataset(self, tmp_path) -> Path:
        return pack_contract_dataset(tmp_path)

    @pytest.fixture
    def make_source(self, dataset):
        """Returns a callable giving a fresh ChunkSource over `dataset`; subclasses override."""
        raise NotImplementedError

    def _expect(self, source: ChunkSource, blob: tuple[int, int, int], raw: dict[int, bytes],
                result: object) -> None:
        """`result` (bytes, a view, or an error) is what the source must give for `blob`."""
        chunk_id, offset, length = blob
        if self.serves(chunk_id, offset):
            assert not isinstance(result, BaseException), f"{blob}: {result!r}"
            assert bytes(result) == raw[chunk_id][offset:offset + length], blob  # type: ignore[arg-type]
        else:
            assert_names_the_chunk(result, chunk_id)  # type: ignore[arg-type]

    def _read(self, source: ChunkSource, blob: tuple[int, int, int]) -> object:
        try:
            return source.read(*blob)
        except ChunkError as exc:
            return exc

    def test_is_a_chunk_source(self, dataset, make_source):
        with make_source() as source:
            assert isinstance(source, ChunkSource)

    def test_reads_each_blob(self, dataset, make_source):
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        assert len(raw) > 2 and len(blobs) > len(raw)
        served = [blob for blob in blobs if self.serves(blob[0], blob[1])]
        assert served and (self.ALL_BLOBS == (len(served) == len(blobs))), (len(served), len(blobs))
        with make_source() as source:
            for blob in blobs:
                self._expect(source, blob, raw, self._read(source, blob))

    def test_serves_the_read_path(self, dataset, make_source):
        """A Reader over the source reads every file (ALL_BLOBS), or each file right or ChunkUnavailable."""
        src = dataset.parent / "src"
        with open_dataset(dataset, source=make_source()) as ds:
            read = 0
            for path in ds.files():
                try:
                    data = ds.read(path)
                except ChunkUnavailable:
                    assert not self.ALL_BLOBS, path
                    continue
                assert data == (src / path).read_bytes(), path
                read += 1
            assert read > 0

    def test_reads_many_in_any_order_as_it_reads_one(self, dataset, make_source):
        """read_many: each blob's bytes or its error in the place asked, in any order, a blob asked twice, a
        missing chunk and a blob past its chunk's end among them (their errors in their places, naming the chunk)."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        rng = np.random.default_rng(31)
        asked = [blobs[number] for number in rng.permutation(len(blobs))] + blobs[:3] + blobs[-2:]
        missing = (len(raw) + 5, CHUNK_HEADER_LEN, 10)
        past_end = (0, len(raw[0]) - 2, 10)
        asked.insert(1, missing)
        asked.insert(len(asked) // 2, past_end)
        with make_source() as source:
            results = source.read_many(asked)
            assert len(results) == len(asked)
            for blob, result in zip(asked, results):
                if blob in (missing, past_end):
                    assert_names_the_chunk(result, blob[0])
                else:
                    self._expect(source, blob, raw, result)
            assert source.read_many([]) == []

    def test_a_missing_chunk_and_a_blob_past_its_chunk_name_the_chunk(self, dataset, make_source):
        raw = chunk_bytes(dataset)
        with make_source() as source:
            missing = len(raw) + 5
            with pytest.raises(ChunkUnavailable) as failed:
                source.read(missing, CHUNK_HEADER_LEN, 10)
            assert_names_the_chunk(failed.value, missing)
            for chunk_id in (0, len(raw) - 1):
                with pytest.raises(ChunkUnavailable) as failed:
                    source.read(chunk_id, len(raw[chunk_id]) - 2, 10)
                assert_names_the_chunk(failed.value, chunk_id)

    def test_a_range_that_is_no_blob_reads_right_or_is_unavailable(self, dataset, make_source):
        """The header, part of a blob, a blob and a byte more: the chunk's bytes there (BYTE_RANGES, or a source
        with DEST behind it), or ChunkUnavailable naming the chunk; never other bytes, never another error."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        firsts = {}
        for blob in blobs:
            firsts.setdefault(blob[0], blob)
        with make_source() as source:
            for chunk_id, offset, length in firsts.values():
                for blob in ((chunk_id, 0, CHUNK_HEADER_LEN), (chunk_id, offset + 1, length - 1),
                             (chunk_id, offset, length + 1)):
                    if blob[2] < 1 or blob[1] + blob[2] > len(raw[chunk_id]):
                        continue
                    result = self._read(source, blob)
                    if isinstance(result, BaseException):
                        assert not self.BYTE_RANGES, f"{blob}: {result!r}"
                        assert_names_the_chunk(result, chunk_id)
                    else:
                        assert bytes(result) == raw[chunk_id][blob[1]:blob[1] + blob[2]], blob

    def test_started_reads_call_back_once_with_the_blob_or_an_error(self, dataset, make_source):
        """start_read and start_reads (a blob asked twice, a missing chunk among them): a read started (True) calls
        `done` exactly once, with the blob (a blob it serves) or a ChunkError naming the chunk; one not started
        (False) never. STARTS_READS: whether the source starts any."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        missing = (len(raw) + 5, CHUNK_HEADER_LEN, 10)
        singly = blobs + [missing]
        together = blobs[::-1] + blobs[:2] + [missing]
        calls: dict[int, list[tuple[bytes | None, BaseException | None]]] = {}
        lock = threading.Lock()

        def done_for(number: int):
            def done(data, error) -> None:
                with lock:
                    calls.setdefault(number, []).append((None if data is None else bytes(data), error))
            return done

        with make_source() as source:
            started = [source.start_read(*blob, done_for(number)) for number, blob in enumerate(singly)]
            reads = [BlobRead(*blob, done_for(len(singly) + number)) for number, blob in enumerate(together)]
            started += source.start_reads(reads)
            asked = singly + together
            assert len(started) == len(asked) and all(isinstance(flag, bool) for flag in started)
            deadline = time.monotonic() + CALLBACK_WAIT
            while time.monotonic() < deadline:
                with lock:
                    if all(number in calls for number, flag in enumerate(started) if flag):
                        break
                time.sleep(0.005)
            time.sleep(0.05)  # a second call would come now
            with lock:
                outcome = dict(calls)
        assert any(started) == self.STARTS_READS, started
        for number, (blob, flag) in enumerate(zip(asked, started)):
            if not flag:
                assert number not in outcome, blob
                continue
            assert len(outcome.get(number, [])) == 1, (blob, outcome.get(number))
            (data, error), = outcome[number]
            assert (data is None) != (error is None), (blob, data, error)
            if blob != missing and self.serves(blob[0], blob[1]):
                assert error is None and data == raw[blob[0]][blob[1]:blob[1] + blob[2]], (blob, error)
            else:
                assert_names_the_chunk(error, blob[0])

    def test_another_copy_is_the_same_bytes_or_none(self, dataset, make_source):
        """What the reader asks for a blob that failed its checksum: the same bytes from another copy, or
        ChunkUnavailable naming the chunk where the source keeps no other (the reader then calls it corrupt)."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        with make_source() as source:
            for chunk_id, offset, length in blobs[:: max(1, len(blobs) // 8)]:
                try:
                    other = source.read_other_copy(chunk_id, offset, length)
                except ChunkUnavailable as exc:
                    assert_names_the_chunk(exc, chunk_id)
                else:
                    assert bytes(other) == raw[chunk_id][offset:offset + length]

    def test_concurrent_reads(self, dataset, make_source):
        """Threads reading blobs each in its own order, one at a time and several together, all at once."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        errors: list[BaseException] = []

        def reader(source: ChunkSource, seed: int) -> None:
            try:
                order = [blobs[number] for number in np.random.default_rng(seed).permutation(len(blobs))][:40]
                for blob in order:
                    self._expect(source, blob, raw, self._read(source, blob))
                for blob, result in zip(order[:20], source.read_many(order[:20])):
                    self._expect(source, blob, raw, result)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        with make_source() as source:
            threads = [threading.Thread(target=reader, args=(source, seed)) for seed in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert errors == [], errors[:3]

    def test_reads_after_close_are_unavailable(self, dataset, make_source):
        """close releases what the source holds; a read after it is ChunkUnavailable for that chunk, and read_many
        gives each blob's error in its place."""
        blobs, raw = dataset_blobs(dataset), chunk_bytes(dataset)
        served = [blob for blob in blobs if self.serves(blob[0], blob[1])]
        source = make_source()
        for blob in served:
            assert bytes(source.read(*blob)) == raw[blob[0]][blob[1]:blob[1] + blob[2]]
        source.close()
        for blob in served:
            with pytest.raises(ChunkUnavailable) as failed:
                source.read(*blob)
            assert failed.value.chunk_id == blob[0], (blob, str(failed.value))
        results = source.read_many(served)
        assert len(results) == len(served)
        for blob, result in zip(served, results):
            assert isinstance(result, ChunkUnavailable) and result.chunk_id == blob[0], (blob, result)

    def test_may_block_answers_for_every_blob_at_once(self, dataset, make_source):
        blobs = dataset_blobs(dataset)
        chunks = np.array([blob[0] for blob in blobs], dtype=np.int64)
        offsets = np.array([blob[1] for blob in blobs], dtype=np.int64)
        with make_source() as source:
            slow = source.may_block(chunks, offsets)
            assert isinstance(slow, np.ndarray) and slow.dtype == bool and slow.shape == (len(blobs),)
            assert np.array_equal(source.may_block(chunks[::-1], offsets[::-1]), slow[::-1])
            empty = source.may_block(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
            assert empty.shape == (0,)


class ChunkSourceContract(ExactBlobContract):
    """A source over chunk files: besides blobs, any byte range of a chunk reads."""

    BYTE_RANGES = True

    def test_reads_exact_ranges(self, dataset, make_source):
        with open_dataset(dataset) as ds, make_source() as source:
            chunk_count = len(ds.index.chunks)
            assert chunk_count > 2
            for chunk_id in range(chunk_count):
                raw = (dataset / chunk_file_name(chunk_id)).read_bytes()
                assert source.read(chunk_id, 0, CHUNK_HEADER_LEN) == raw[:CHUNK_HEADER_LEN]
                assert source.read(chunk_id, CHUNK_HEADER_LEN, 17) == raw[CHUNK_HEADER_LEN:CHUNK_HEADER_LEN + 17]
                assert source.read(chunk_id, len(raw) - 5, 5) == raw[-5:]
                assert source.read(chunk_id, 40, 0) == b""

    def test_concurrent_range_reads(self, dataset, make_source):
        with open_dataset(dataset) as ds, make_source() as source:
            expected = {c: (dataset / chunk_file_name(c)).read_bytes() for c in range(len(ds.index.chunks))}
            errors: list[BaseException] = []

            def reader(seed: int) -> None:
                try:
                    for i in range(200):
                        chunk = (seed + i) % len(expected)
                        offset = (i * 97) % max(1, len(expected[chunk]) - 64)
                        assert source.read(chunk, offset, 64) == expected[chunk][offset:offset + 64]
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []


def contract_checks(contract: type[ExactBlobContract]) -> list[str]:
    """The names of a contract class's tests, in the order written: what a script runs without pytest."""
    names = []
    for klass in reversed(contract.__mro__):
        names += [name for name in vars(klass) if name.startswith("test_") and name not in names]
    return names
