"""DEST's chunk files as staging reads them (fanstore/serve/dest_files.py): each opened once however many spans it
gives, closed after its last, a bounded number open at once, and a file that cannot be opened tried once.

Real files; the opens are counted by a wrapper of os.open given to the holder. Staging through it in a real job runs
in tests/test_serve.py."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from fanstore.core.format import chunk_file_name
from fanstore.serve.dest_files import DestChunkFiles, open_for_reading

SPAN = 1000


class CountingOpens:
    """os.open, counting the opens of each chunk file."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.opens: Counter[str] = Counter()

    def __call__(self, path: Path) -> int:
        self.opens[path.name] += 1
        return open_for_reading(path)

    def still_open(self) -> list[str]:
        """The chunk files of DEST this process holds open, by name (its descriptors' links in /proc)."""
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the descriptor listdir itself used
                continue
            if target.parent == self.dest / "chunks":
                found.append(target.name)
        return sorted(found)


def _name(chunk: int) -> str:
    return Path(chunk_file_name(chunk)).name


def _dest(tmp_path: Path, chunks: int, size: int = 4 * SPAN) -> Path:
    dest = tmp_path / "dest"
    for chunk in range(chunks):
        path = dest / chunk_file_name(chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([chunk]) * size)
    return dest


def test_a_chunk_of_several_spans_is_opened_once_and_closed_after_its_last(tmp_path):
    dest = _dest(tmp_path, 2)
    counting = CountingOpens(dest)
    files = DestChunkFiles(dest, open_file=counting)
    files.expect([0] * 4 + [1] * 4)
    for start in range(0, 4 * SPAN, SPAN):
        assert files.read(0, start, SPAN) == b"\0" * SPAN
        assert files.read(1, start, SPAN) == b"\1" * SPAN  # two chunks read in turn, as staging does
        if start < 3 * SPAN:
            assert len(counting.still_open()) == 2
    assert counting.opens == {_name(0): 1, _name(1): 1}
    assert counting.still_open() == []  # each closed after its last span, before close()


def test_a_span_taken_from_elsewhere_counts_towards_closing(tmp_path):
    """A replicated span the rank sends from its own verified copy: it reads nothing from DEST for it."""
    dest = _dest(tmp_path, 1)
    counting = CountingOpens(dest)
    files = DestChunkFiles(dest, open_file=counting)
    files.expect([0, 0, 0])
    files.read(0, 0, SPAN)
    files.done(0)
    assert counting.still_open()
    files.read(0, 2 * SPAN, SPAN)
    assert counting.still_open() == [] and sum(counting.opens.values()) == 1


def test_no_more_than_max_open_files_are_open_at_once(tmp_path):
    dest = _dest(tmp_path, 5)
    counting = CountingOpens(dest)
    with DestChunkFiles(dest, max_open=2, open_file=counting) as files:
        files.expect(chunk for chunk in range(5) for _ in range(2))
        for chunk in range(5):
            files.read(chunk, 0, SPAN)
            assert len(counting.still_open()) <= 2
        assert counting.still_open() == [_name(3), _name(4)]  # the others closed, least recently read first
        assert files.read(0, SPAN, SPAN) == b"\0" * SPAN  # opened again, past the bound: slower, still right
        assert counting.opens[_name(0)] == 2
    assert counting.still_open() == []  # close() at the end (staging ended, or failed) closes the rest


def test_a_missing_chunk_is_tried_once_and_its_error_given_for_each_span(tmp_path):
    dest = _dest(tmp_path, 2)
    (dest / chunk_file_name(1)).unlink()
    counting = CountingOpens(dest)  # counts tries, failed ones too
    with DestChunkFiles(dest, open_file=counting) as files:
        files.expect([0] * 3 + [1] * 3)
        for start in range(0, 3 * SPAN, SPAN):
            with pytest.raises(FileNotFoundError) as missing:
                files.read(1, start, SPAN)
            assert missing.value.strerror == "No such file or directory"
            assert files.read(0, start, SPAN) == b"\0" * SPAN  # its neighbour reads on
    assert counting.opens == {_name(0): 1, _name(1): 1}
    assert counting.still_open() == []


def test_a_chunk_cut_short_gives_fewer_bytes_past_its_end(tmp_path):
    dest = _dest(tmp_path, 1)
    os.truncate(dest / chunk_file_name(0), SPAN + 10)
    with DestChunkFiles(dest) as files:
        files.expect([0, 0])
        assert len(files.read(0, 0, SPAN)) == SPAN
        assert len(files.read(0, SPAN, SPAN)) == 10


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _device(path: Path) -> None:
    os.symlink("/dev/zero", path)


@pytest.mark.parametrize("make", [_fifo, _directory, _device], ids=["fifo", "directory", "device"])
def test_a_chunk_that_is_not_a_regular_file_is_an_error_for_its_spans_never_a_wait(tmp_path, make):
    """A chunk file replaced by a fifo blocked the staging rank in open() for good (the job never mounted), and one
    that is /dev/zero gave its zeros as the chunk's bytes. Each is an error naming it, its neighbour reads on."""
    dest = _dest(tmp_path, 2)
    (dest / chunk_file_name(1)).unlink()
    make(dest / chunk_file_name(1))
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("staging waited on a chunk file"))
    signal.alarm(10)
    try:
        with DestChunkFiles(dest) as files:
            files.expect([0, 1, 1])
            for start in (0, SPAN):
                with pytest.raises(OSError) as refused:
                    files.read(1, start, SPAN)
                assert refused.value.strerror == "not a regular file", refused.value
            assert files.read(0, 0, SPAN) == b"\0" * SPAN
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
