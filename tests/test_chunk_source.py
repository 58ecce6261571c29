"""The local chunk source passes the shared ChunkSource contract, and checks chunk headers (wrong ones are corrupt)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest

from chunk_source_contract import ChunkSourceContract
from fanstore import open_dataset
from conftest import REPO
from fanstore.core.chunk_source import FallbackChunkSource, LocalChunkSource, default_max_open_chunks
from fanstore.errors import ChunkCorrupt, ChunkUnavailable
from fanstore.core.format import chunk_file_name


class TestLocalChunkSource(ChunkSourceContract):
    @pytest.fixture
    def make_source(self, dataset):
        with open_dataset(dataset) as ds:
            sizes = ds.index.chunks["size"].copy()
        return lambda: LocalChunkSource(dataset, sizes)


class TestFallbackChunkSource(ChunkSourceContract):
    """A primary that cannot give anything (its directory holds no chunk), the dataset behind it: every read
    comes through the fallback, and unknown chunks and reads past the end still name the chunk."""

    @pytest.fixture
    def make_source(self, dataset, tmp_path):
        with open_dataset(dataset) as ds:
            sizes = ds.index.chunks["size"].copy()
        empty = tmp_path / "nothing_staged"
        empty.mkdir()
        return lambda: FallbackChunkSource(LocalChunkSource(empty, sizes), LocalChunkSource(dataset, sizes))


def test_fallback_counts_what_it_could_not_have_from_the_primary(tmp_path):
    from conftest import make_tree
    from fanstore import PackOptions, pack

    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    partial = tmp_path / "partial"
    (partial / "chunks").mkdir(parents=True)
    (partial / chunk_file_name(0)).write_bytes((dest / chunk_file_name(0)).read_bytes())
    fell_back: list[tuple[int, int]] = []
    source = FallbackChunkSource(LocalChunkSource(partial, sizes), LocalChunkSource(dest, sizes),
                                 on_fallback=lambda exc, length: fell_back.append((exc.chunk_id, length)))
    with open_dataset(dest, source=source) as ds:
        for path in ds.files():
            assert ds.read(path) == (tmp_path / "src" / path).read_bytes()
    assert fell_back and all(chunk != 0 for chunk, _ in fell_back)
    assert not source.may_block(np.array([0, 1]), np.array([32, 32])).any()


class _CountingSource(LocalChunkSource):
    """A local source that counts its reads, by (chunk, offset)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: Counter[tuple[int, int]] = Counter()

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        self.reads[(chunk_id, offset)] += 1
        return super().read(chunk_id, offset, length)


def test_fallback_reads_what_the_primary_has_corrupt_from_the_fallback_once(tmp_path):
    """A primary copy found corrupt (a chunk file with a wrong header: ChunkCorrupt), or whose bytes fail the
    reader's checksum (read_other_copy), is read from the fallback, once a blob and counted; damaged in the
    fallback too, the file is ChunkCorrupt naming the chunk, after one read of the fallback, and the others read."""
    from conftest import flip_byte, make_tree
    from fanstore import PackOptions, pack

    src, dest, copy = tmp_path / "src", tmp_path / "ds", tmp_path / "copy"
    pack(make_tree(src), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    shutil.copytree(dest, copy)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
        rows = {path: ds.index.entries[ds.resolve(path)] for path in ds.files()}
        blobs = {path: (int(row["chunk"]), int(row["offset"]), int(row["stored_len"])) for path, row in rows.items()}
    whole = {path: blob for path, blob in blobs.items() if blob[2] > 16}
    flipped_path, (flipped_chunk, flipped_offset, flipped_length) = next(iter(whole.items()))
    bad_header_chunk = next(chunk for chunk, _, _ in whole.values() if chunk != flipped_chunk)
    flip_byte(copy / chunk_file_name(flipped_chunk), flipped_offset + flipped_length // 2)
    flip_byte(copy / chunk_file_name(bad_header_chunk), 0)
    fell_back: list[tuple[str, int]] = []

    def copy_then_dest() -> tuple[FallbackChunkSource, _CountingSource]:
        fallback = _CountingSource(dest, sizes)
        return FallbackChunkSource(LocalChunkSource(copy, sizes), fallback, on_fallback=lambda exc, length:
                                   fell_back.append((type(exc).__name__, exc.chunk_id))), fallback

    source, fallback = copy_then_dest()
    with open_dataset(dest, source=source) as ds:
        for path in ds.files():
            assert ds.read(path) == (src / path).read_bytes(), path
    assert fallback.reads[(flipped_chunk, flipped_offset)] == 1
    assert fell_back.count(("ChunkCorrupt", flipped_chunk)) == 1
    in_bad_header = [path for path, blob in blobs.items() if blob[0] == bad_header_chunk and blob[2]]
    assert fell_back.count(("ChunkCorrupt", bad_header_chunk)) == len(in_bad_header)
    assert {kind for kind, _ in fell_back} == {"ChunkCorrupt"}

    flip_byte(dest / chunk_file_name(flipped_chunk), flipped_offset + flipped_length // 2)
    source, fallback = copy_then_dest()
    with open_dataset(dest, source=source) as ds:
        with pytest.raises(ChunkCorrupt, match=f"chunk {flipped_chunk} ") as failed:
            ds.read(flipped_path)
        assert failed.value.chunk_id == flipped_chunk and isinstance(failed.value, OSError)
        assert fallback.reads[(flipped_chunk, flipped_offset)] == 1
        others = [path for path in whole if path != flipped_path]
        assert all(ds.read(path) == (src / path).read_bytes() for path in others)


def test_bytes_the_fallback_gave_that_fail_the_checksum_are_its_damage_final_and_not_counted_when_unread(tmp_path):
    """The primary cannot give a blob (a peer refusing a chunk it could not verify), the fallback (DEST) gives
    damaged bytes: the reader's ChunkCorrupt names the fallback's file, the fallback is not read again, nothing
    blames the primary (a peer was logged as having sent bytes it never sent), and only blobs the fallback gave
    are counted (one it failed to read was counted as read)."""
    from conftest import flip_byte, make_tree
    from fanstore import PackOptions, pack

    src, dest, empty = tmp_path / "src", tmp_path / "ds", tmp_path / "empty"
    pack(make_tree(src), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    (empty / "chunks").mkdir(parents=True)  # the primary: holds nothing (ChunkUnavailable for every blob)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
        rows = {path: ds.index.entries[ds.resolve(path)] for path in ds.files()}
    whole = {path: (int(row["chunk"]), int(row["offset"]), int(row["stored_len"])) for path, row in rows.items()
             if int(row["stored_len"]) > 16 and not int(row["flags"])}
    path, (chunk, offset, length) = next(iter(whole.items()))
    flip_byte(dest / chunk_file_name(chunk), offset + length // 2)
    fell_back: list[int] = []
    fallback = _CountingSource(dest, sizes)
    source = FallbackChunkSource(LocalChunkSource(empty, sizes), fallback,
                                 on_fallback=lambda exc, size: fell_back.append(size))
    with open_dataset(dest, source=source) as ds:
        with pytest.raises(ChunkCorrupt, match=rf"checksum mismatch in chunk {chunk} \(chunks/{chunk:08d}.fsc at "
                                               rf"offset {offset:,}, {length:,} bytes\)"):
            ds.read(path)
        assert fallback.reads[(chunk, offset)] == 1 and fell_back == [length]
        os.truncate(dest / chunk_file_name(chunk), offset + 1)  # now the fallback cannot give it either
        fell_back.clear()
        with pytest.raises(ChunkCorrupt, match="short"):
            ds.read(path)
        assert fell_back == []


class _PrimaryThatFailsThenDamages(LocalChunkSource):
    """A primary that cannot give any blob the first time it is asked (a peer timing out), and gives it with one
    byte flipped after (its copy damaged)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[tuple[int, int]] = set()

    def read(self, chunk_id: int, offset: int, length: int) -> bytes:
        if (chunk_id, offset) not in self.asked:
            self.asked.add((chunk_id, offset))
            raise ChunkUnavailable(f"chunk {chunk_id}: not now", chunk_id=chunk_id)
        data = bytearray(super().read(chunk_id, offset, length))
        data[len(data) // 2] ^= 0xFF
        return bytes(data)


def test_a_blob_the_fallback_gave_once_is_read_from_it_again_when_the_primary_gives_it_damaged_later(tmp_path):
    """What the fallback gave is final only for the read that got it: the same blob given later by the primary,
    damaged, is read from the fallback again, not refused as the fallback's damage."""
    from conftest import make_tree
    from fanstore import PackOptions, pack

    src, dest = tmp_path / "src", tmp_path / "ds"
    pack(make_tree(src), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    source = FallbackChunkSource(_PrimaryThatFailsThenDamages(dest, sizes), LocalChunkSource(dest, sizes))
    with open_dataset(dest, source=source) as ds:
        path = next(path for path in ds.files() if (src / path).stat().st_size > 100)
        assert ds.read(path) == (src / path).read_bytes()  # from the fallback: the primary could not give it
        assert ds.read(path) == (src / path).read_bytes()  # the primary's damaged, so the fallback's again


def test_chunk_with_a_wrong_header_is_refused(tmp_path):
    from conftest import make_tree
    from fanstore import PackOptions, pack

    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    first, second = dest / chunk_file_name(0), dest / chunk_file_name(1)
    swapped = second.read_bytes()[:32] + first.read_bytes()[32:]
    first.write_bytes(swapped)
    with LocalChunkSource(dest, sizes) as source, pytest.raises(ChunkCorrupt, match="holds chunk 1"):
        source.read(0, 32, 4)
    first.write_bytes(b"JUNKJUNK" + swapped[8:])
    with LocalChunkSource(dest, sizes) as source, pytest.raises(ChunkCorrupt, match="not a fanstore chunk"):
        source.read(0, 32, 4)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def packed_chunks(tmp_path):
    from conftest import make_tree
    from fanstore import PackOptions, pack

    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(chunk_size=16 * 1024, workers=1))
    with open_dataset(dest) as ds:
        return dest, ds.index.chunks["size"].copy()


@pytest.mark.parametrize("damage", ["directory", "fifo", "wrong_header", "truncated", "missing", "unreadable"])
def test_failed_opens_leak_no_descriptor_and_say_what_failed(packed_chunks, damage):
    dest, sizes = packed_chunks
    path = dest / chunk_file_name(1)
    data = path.read_bytes()
    path.unlink()
    if damage == "directory":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)  # opened without blocking, then refused
    elif damage == "wrong_header":
        path.write_bytes(b"JUNKJUNK" + data[8:])
    elif damage == "truncated":
        path.write_bytes(data[:-3])
    elif damage == "unreadable":
        path.symlink_to(path)  # a loop: ELOOP, as a disk error would be
    expected = ChunkCorrupt if damage in ("wrong_header", "truncated") else ChunkUnavailable
    with LocalChunkSource(dest, sizes) as source:
        before = _open_fds()
        for _ in range(50):
            with pytest.raises(expected, match="chunk 1"):
                source.read(1, 40, 10)
        assert _open_fds() == before
        assert source.read(0, 40, 10) == (dest / chunk_file_name(0)).read_bytes()[40:50]  # others still read


def test_a_closed_dataset_is_unavailable_not_corrupt(packed_chunks):
    dest, _ = packed_chunks
    ds = open_dataset(dest)
    path = next(iter(ds.files()))
    ds.read(path)
    ds.close()
    with pytest.raises(ChunkUnavailable, match="closed"):
        ds.read(path)


def test_a_read_into_a_buffer_is_the_read(packed_chunks, tmp_path):
    """LocalChunkSource.read_into (what a rank serving a peer fills its reply with) gives what read gives, and its
    errors: a range outside the chunk is unavailable, a chunk file cut short since it was opened is corrupt, each
    naming the chunk."""
    dest, sizes = packed_chunks
    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)
    with LocalChunkSource(copy, sizes) as source:
        for chunk in range(len(sizes)):
            length = min(int(sizes[chunk]), 4096)
            out = bytearray(length + 2)
            source.read_into(chunk, int(sizes[chunk]) - length, length, memoryview(out)[1 : 1 + length])
            assert bytes(out[1 : 1 + length]) == source.read(chunk, int(sizes[chunk]) - length, length)
            assert out[0] == out[-1] == 0  # nothing written outside the view
        with pytest.raises(ChunkUnavailable, match="chunk 0"):
            source.read_into(0, int(sizes[0]) - 1, 2, memoryview(bytearray(2)))
        os.truncate(source.path(0), int(sizes[0]) - 10)  # opened above: the file shrank since
        with pytest.raises(ChunkCorrupt, match="chunk 0"):
            source.read_into(0, int(sizes[0]) - 20, 20, memoryview(bytearray(20)))


def test_open_chunk_files_stay_within_their_bound(packed_chunks):
    dest, sizes = packed_chunks
    assert len(sizes) >= 6
    with LocalChunkSource(dest, sizes, max_open=2) as source:
        before = _open_fds()
        for _ in range(3):
            for chunk in range(len(sizes)):
                assert source.read(chunk, 0, 8) == b"FANSTCHK"
                assert _open_fds() - before <= 2
    assert default_max_open_chunks() >= 8


def test_too_many_open_files_is_unavailable_and_passes(packed_chunks, tmp_path):
    """Out of descriptors, the source gives back its own and tries again; when none can be had at all, the read
    is unavailable (a later one may work), never called corruption."""
    dest, _ = packed_chunks
    code = f"""
import os, resource, sys
sys.path.insert(0, {str(REPO)!r})
from fanstore import open_dataset
from fanstore.errors import ChunkUnavailable
ds = open_dataset({str(dest)!r})
paths = list(ds.files())
for path in paths:  # opens every chunk
    ds.read(path)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open('/dev/null', os.O_RDONLY))
except OSError:
    pass
ds.reader.source._evict_idle(keep=0)  # every chunk closed, and the freed descriptors taken by others
while True:
    try:
        held.append(os.open('/dev/null', os.O_RDONLY))
    except OSError:
        break
try:
    ds.read(paths[0])
    print("read")
except ChunkUnavailable as exc:
    print("unavailable:", exc)
for fd in held:
    os.close(fd)
print("after:", len(ds.read(paths[0])))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, after = proc.stdout.splitlines()
    assert first.startswith("unavailable:") and "Too many open files" in first and "corrupt" not in first
    assert after.startswith("after:")


def test_a_forked_child_reads_though_a_thread_of_the_parent_held_the_source_at_the_fork(packed_chunks):
    """A user's torch Dataset holding open_dataset(...) reaches its forked DataLoader workers as the parent's object.
    A thread of the parent that held the source's lock at the fork (it closes an evicted chunk file under it) left
    the child's copy held for good: the child's first read waited forever (58 of 300 children hung, with a reading
    thread and one chunk file open at a time). Here the parent's thread holds the lock across the fork, and the
    child reads every chunk all the same."""
    dest, sizes = packed_chunks
    source = LocalChunkSource(dest, sizes, max_open=1)
    expected = [(dest / chunk_file_name(chunk)).read_bytes()[40:50] for chunk in range(len(sizes))]
    assert source.read(0, 40, 10) == expected[0]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with source._lock:  # as a thread of the parent inside the source when the fork comes
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(20)  # a child that waits forever ends by SIGALRM
            read = [source.read(chunk, 40, 10) for chunk in range(len(sizes))]
            os._exit(0 if read == expected else 1)
        finally:
            os._exit(2)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with wait status {status}"
    source.close()
