"""Staging's parts that need no MPI: spans cut at blob boundaries, per-blob checks, the manifest of a local dir and
the hold a job keeps on it.

Staging itself, with MPI, runs in tests/test_serve.py."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest

from conftest import make_tree
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.format import CHUNK_HEADER_LEN, FORMAT_MINOR, INDEX_NAME, chunk_file_name
from fanstore.serve.placement import BlobTable
from fanstore.serve.blob_spans import Span, check_span, header_problem, spans_of
from fanstore.serve.local_dir import LOCK_NAME, LocalDirectory, StagingBroken, StagingError, claim_local_dir, \
    copy_index
from fanstore.serve.staging import dataset_identity, index_identity


def _packed(tmp_path):
    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3", chunk_size=64 * 1024, workers=1))
    return dest


def test_spans_cover_a_range_in_whole_blobs(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        blobs = BlobTable.of(ds.index)
        sizes = ds.index.chunks["size"]
    starts = set(blobs.offset.tolist())
    for chunk, size in enumerate(sizes.tolist()):
        for span_bytes in (1, 5000, 1 << 30):
            spans = spans_of(blobs, chunk, 0, size, span_bytes)
            assert spans[0].start == 0 and spans[-1].end == size
            assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
            assert all(s.start in starts for s in spans[1:])  # every cut is a blob boundary
            if span_bytes == 1 << 30:
                assert len(spans) == 1


def test_check_span_names_the_damaged_blob(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        blobs = BlobTable.of(ds.index)
        size = int(ds.index.chunks["size"][0])
    data = bytearray((dest / chunk_file_name(0)).read_bytes())
    span = Span(0, 0, size)
    assert check_span(blobs, span, data) == []
    rows = blobs.in_range(0, 0, size)
    second = int(blobs.offset[rows][1])
    data[second + 3] ^= 0xFF
    assert check_span(blobs, span, data) == [second]
    assert check_span(blobs, Span(0, 0, CHUNK_HEADER_LEN), data[:CHUNK_HEADER_LEN]) == []


@pytest.mark.parametrize("offset, said", [
    (0, "chunk 2 is not a fanstore chunk file (bad magic)"),
    (8, f"fanstore format version 254.{FORMAT_MINOR} is not supported (this fanstore reads version 1.x)"),
    (12, "holds chunk 253, the index expects chunk 2"),
])
def test_a_damaged_header_is_named_though_no_blob_covers_it(tmp_path, offset, said):
    """The header holds no blob, so blob checksums never see it: it is checked as a reader checks it."""
    dest = _packed(tmp_path)
    path = dest / chunk_file_name(2)
    data = bytearray(path.read_bytes())
    header, rest = Span(2, 0, CHUNK_HEADER_LEN), Span(2, CHUNK_HEADER_LEN, len(data))
    assert header_problem(header, data[:CHUNK_HEADER_LEN], path) is None
    data[offset] ^= 0xFF
    assert header_problem(header, data[:CHUNK_HEADER_LEN], path) == f"{path}: {said}"
    assert header_problem(Span(2, 0, len(data)), data, path) == f"{path}: {said}"
    assert header_problem(rest, data[CHUNK_HEADER_LEN:], path) is None  # a span that does not start the chunk


def test_a_local_chunk_that_is_not_a_regular_file_reads_as_missing(tmp_path):
    """A fifo in a chunk file's place must not hold staging's check of what an earlier job left."""
    local = LocalDirectory(tmp_path / "local", np.array([4096], dtype=np.uint64))
    local.chunk_path(0).parent.mkdir(parents=True)
    os.mkfifo(local.chunk_path(0))
    assert local.read(Span(0, 0, CHUNK_HEADER_LEN)) is None


def test_manifest_is_for_one_dataset_only(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    local = LocalDirectory(tmp_path / "local", sizes)
    local.path.mkdir()
    identity = dataset_identity(dest)
    local.write_manifest(identity, {0: [(0, 100)], 3: [(32, 64)]})
    assert local.read_manifest(identity) == {0: [(0, 100)], 3: [(32, 64)]}
    assert local.read_manifest("another dataset") == {}
    (local.path / "fanstore-staged.json").write_text("{not json")
    assert local.read_manifest(identity) == {}


def test_the_index_copy_is_dest_s_bytes_and_a_directory_that_cannot_take_it_is_named(tmp_path):
    dest = _packed(tmp_path)
    data = (dest / INDEX_NAME).read_bytes()
    assert index_identity(data) == dataset_identity(dest)
    local = tmp_path / "local"
    local.mkdir()
    assert copy_index(local, data, 0) == local / INDEX_NAME
    assert (local / INDEX_NAME).read_bytes() == data
    blocked = tmp_path / "blocked"
    (blocked / INDEX_NAME).mkdir(parents=True)
    with pytest.raises(StagingBroken, match=rf"^rank 3 on \S+: --local-dir {blocked}: cannot write "
                                            rf"{blocked / INDEX_NAME}: Is a directory$"):
        copy_index(blocked, data, 3)


def test_a_chunk_file_starts_sparse_and_empty(tmp_path):
    dest = _packed(tmp_path)
    with open_dataset(dest) as ds:
        sizes = ds.index.chunks["size"].copy()
    local = LocalDirectory(tmp_path / "local", sizes)
    stale = local.chunk_path(1)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\xff" * int(sizes[1]))  # an earlier dataset's bytes
    local.open_for_staging(1, keep=False)
    local.write(1, 0, b"H" * CHUNK_HEADER_LEN)
    local.close()
    data = stale.read_bytes()
    assert len(data) == sizes[1] and data[:CHUNK_HEADER_LEN] == b"H" * CHUNK_HEADER_LEN
    assert not np.frombuffer(data[CHUNK_HEADER_LEN:], np.uint8).any()


def test_a_local_dir_is_held_by_one_job_at_a_time(tmp_path):
    held = claim_local_dir(tmp_path)
    try:
        with pytest.raises(StagingError, match=rf"--local-dir {tmp_path}: in use by another fanstore serve "
                                               rf"\(pid {os.getpid()}\); give each job its own"):
            claim_local_dir(tmp_path)
        # A holder on another host: the directory is on a file system several nodes share.
        os.pwrite(held, b"4242 node17\n", 0)
        with pytest.raises(StagingError, match="in use by fanstore serve pid 4242 on node17: is it on a shared file "
                                               "system"):
            claim_local_dir(tmp_path)
    finally:
        os.close(held)
    os.close(claim_local_dir(tmp_path))  # the hold ends with its holder


def test_a_local_dir_without_flock_is_used_unheld_and_one_that_cannot_be_is_one_error(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    with monkeypatch.context() as patched:  # Lustre mounted noflock, say
        patched.setattr(fcntl, "flock", no_flock)
        assert claim_local_dir(tmp_path) is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / LOCK_NAME).mkdir()
    with pytest.raises(StagingError, match=rf"--local-dir {tmp_path}/other: cannot use it: Is a directory"):
        claim_local_dir(tmp_path / "other")


def test_a_local_chunk_that_is_a_fifo_fails_staging_naming_it(tmp_path):
    """Staging opens its share's chunk files to write in place: one that was a fifo failed the job with
    "--local-dir DIR: cannot write to it: Invalid argument" (ftruncate of a fifo), naming no file. The error names
    the file and says what it is not."""
    local = LocalDirectory(tmp_path / "local", np.array([4096], dtype=np.uint64))
    local.chunk_path(0).parent.mkdir(parents=True)
    os.mkfifo(local.chunk_path(0))
    for keep in (False, True):
        with pytest.raises(OSError) as refused:
            local.open_for_staging(0, keep=keep)
        assert (refused.value.filename, refused.value.strerror) == (str(local.chunk_path(0)), "not a regular file")
    local.close()
