"""The index file: written deterministically, checked on open, looked up without a Python object per file."""

from __future__ import annotations

import mmap
import stat
import struct

import numpy as np
import pytest

from fanstore.core import index_file
from fanstore.errors import DatasetNotFound, FormatError, PathNotFound
from fanstore.core.format import CHUNK_DTYPE, INDEX_NAME
from fanstore.core.index import EntryRecord, Index, build_index_bytes, normalize_path, write_index_atomically
from fanstore.core.index_file import read_index_file

DIR = stat.S_IFDIR | 0o755
FILE = stat.S_IFREG | 0o644
LINK = stat.S_IFLNK | 0o777


def _records() -> list[EntryRecord]:
    return [
        EntryRecord("", DIR, 1),
        EntryRecord("b", DIR, 2),
        EntryRecord("a.txt", FILE, 3, size=10, chunk=0, offset=32, stored_len=8, codec=1, checksum=99),
        EntryRecord("b/z.bin", FILE, 4, size=5, chunk=0, offset=40, stored_len=5),
        EntryRecord("b/c", DIR, 5),
        EntryRecord("b/c/deep.txt", FILE, 6, size=0),
        EntryRecord("link", LINK, 7, link_target="b/z.bin"),
    ]


def _write(tmp_path, records=None, meta=None):
    chunks = np.array([(45, 0, 2)], dtype=CHUNK_DTYPE)
    data = build_index_bytes(records or _records(), chunks, [{"name": "spread", "replicated": False, "patterns": []}],
                             [{"id": 0, "spec": "none", "dictionary": None},
                              {"id": 1, "spec": "zstd:3", "dictionary": None}], {}, meta or {})
    write_index_atomically(tmp_path, data)
    return data


def test_lookup_children_and_links(tmp_path):
    _write(tmp_path)
    index = Index.load(tmp_path)
    assert len(index) == 7 and index.file_count == 3
    entry = index.lookup("b/z.bin")
    assert index.path_of(entry) == "b/z.bin"
    rec = index.entries[entry]
    assert (int(rec["size"]), int(rec["offset"]), int(rec["stored_len"])) == (5, 40, 5)
    assert index.lookup("/b//z.bin/") == entry
    root_children = [index.path_of(c) for c in index.children(0)]
    assert root_children == ["a.txt", "b", "link"]
    assert [index.path_of(c) for c in index.children(index.lookup("b"))] == ["b/c", "b/z.bin"]
    assert list(index.children(index.lookup("a.txt"))) == []
    assert index.link_target(index.lookup("link")) == "b/z.bin"
    with pytest.raises(PathNotFound, match="nope"):
        index.lookup("nope")
    # Entries are breadth-first: parents never decrease.
    assert np.all(np.diff(index.entries["parent"][1:].astype(np.int64)) >= 0)


def test_lookup_key_takes_exact_index_spelling_only(tmp_path):
    _write(tmp_path)
    index = Index.load(tmp_path)
    assert index.lookup_key(b"b/c/deep.txt") == index.lookup("b/c/deep.txt")
    assert index.lookup_key(b"b//c/deep.txt") is None  # not normalized: the caller's job
    assert index.lookup_key(b"b/c/absent") is None
    assert index.lookup_key(b"") == 0


def test_same_records_give_same_bytes_in_any_order(tmp_path):
    first = _write(tmp_path)
    second = _write(tmp_path, list(reversed(_records())))
    assert first == second


def test_unknown_major_version_is_refused_with_its_number(tmp_path):
    data = bytearray(_write(tmp_path))
    struct.pack_into("<H", data, 8, 7)
    (tmp_path / INDEX_NAME).write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"version 7\.\d+ is not supported"):
        Index.load(tmp_path)


def test_bad_magic_truncation_and_corruption_are_refused(tmp_path):
    data = _write(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(b"NOTANIDX" + data[8:])
    with pytest.raises(FormatError, match="bad magic"):
        Index.load(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(data[:40])
    with pytest.raises(FormatError, match="truncated"):
        Index.load(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(data[:-9])
    with pytest.raises(FormatError, match="truncated"):
        Index.load(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(data + b"appended")
    with pytest.raises(FormatError, match=r"index is longer than its header says \(body \d+ of \d+ bytes\)"):
        Index.load(tmp_path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    (tmp_path / INDEX_NAME).write_bytes(bytes(flipped))
    with pytest.raises(FormatError, match="checksum"):
        Index.load(tmp_path)


def test_an_index_from_bytes_read_once_is_the_one_load_gives_and_checked_the_same(tmp_path):
    """`fanstore serve` reads DEST's index once, to parse, checksum and copy the same bytes: from_bytes must load
    what load loads, and refuse what load refuses, naming the path it is given."""
    data = _write(tmp_path)
    assert read_index_file(tmp_path) == data
    loaded, from_bytes = Index.load(tmp_path), Index.from_bytes(tmp_path / INDEX_NAME, data)
    assert from_bytes.path == loaded.path and from_bytes.toc == loaded.toc
    assert from_bytes.path_of(from_bytes.lookup("b/z.bin")) == "b/z.bin"
    named = tmp_path / "copy" / INDEX_NAME
    with pytest.raises(FormatError, match=rf"^{named}: index is truncated"):
        Index.from_bytes(named, data[:-9])


def test_missing_dataset_is_named(tmp_path):
    with pytest.raises(DatasetNotFound, match="no such dataset"):
        Index.load(tmp_path / "absent")
    with pytest.raises(DatasetNotFound, match="not a fanstore dataset"):
        Index.load(tmp_path)


def test_records_need_parents(tmp_path):
    with pytest.raises(ValueError, match="no parent"):
        build_index_bytes([EntryRecord("", DIR, 0), EntryRecord("x/y", FILE, 0)], np.zeros(0, CHUNK_DTYPE), [],
                          [], {}, {})


def test_normalize_path():
    assert normalize_path("/a/./b//c/") == "a/b/c"
    assert normalize_path("") == ""


def test_million_entries_stay_compact(tmp_path):
    """The memory goal in numbers: a large index costs the arrays, not a Python object per file."""
    count = 200_000
    records = [EntryRecord("", DIR, 0)] + [EntryRecord(f"d{i // 1000:03d}", DIR, 0) for i in range(0, count, 1000)]
    records += [EntryRecord(f"d{i // 1000:03d}/f{i:07d}.jpg", FILE, 0, size=1, chunk=0, offset=32, stored_len=1)
                for i in range(count)]
    _write(tmp_path, records)
    index = Index.load(tmp_path)
    per_entry = sum(a.nbytes for a in (index.entries, index.path_hash, index.hash_order, index._first_child))
    per_entry = (per_entry + len(index.paths)) / len(index)
    assert per_entry < 150
    assert index.path_of(index.lookup("d123/f0123456.jpg")) == "d123/f0123456.jpg"


def _mapped(array: np.ndarray) -> bool:
    """Whether an array reads a map of a file in place (its base chain ends in an mmap), not a copy."""
    base = array
    while isinstance(base, np.ndarray) or isinstance(base, memoryview):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return isinstance(base, mmap.mmap)


def test_the_index_is_mapped_and_read_in_place(tmp_path):
    """Every process of a node maps the same index file: its arrays are the page cache's, shared, not copies."""
    _write(tmp_path)
    index = Index.load(tmp_path)
    for array in (index.entries, index.path_hash, index.hash_order, index.chunks, index._first_child,
                  index.files_in_path_order()):
        assert _mapped(array) and not array.flags.writeable
    assert [index.path_of(int(e)) for e in index.files_in_path_order()] == ["a.txt", "b/c/deep.txt", "b/z.bin"]


def test_the_full_check_runs_once_per_index_file(tmp_path, monkeypatch):
    """The pass over every entry runs once per node for one index file: the next process finds its stamp. An index
    file replaced (even by the same bytes), or changed in place, is checked again; the checksum always is."""
    calls = []
    real_check = index_file.check_arrays
    monkeypatch.setattr(index_file, "check_arrays", lambda *args: calls.append(1) or real_check(*args))
    data = _write(tmp_path)
    Index.load(tmp_path)
    Index.load(tmp_path)
    assert len(calls) == 1
    write_index_atomically(tmp_path, data)  # the same bytes, another file
    Index.load(tmp_path)
    assert len(calls) == 2
    damaged = bytearray(data)
    damaged[-1] ^= 1  # changed in place: checked again, and the checksum refuses it
    (tmp_path / INDEX_NAME).write_bytes(bytes(damaged))
    with pytest.raises(FormatError, match="checksum"):
        Index.load(tmp_path)


@pytest.mark.parametrize("size", [0, 10, 64, 100, -8])
def test_a_truncated_index_file_is_refused_in_one_line(tmp_path, size):
    """Mapped or read, a short index file is refused naming it; nothing past its end is touched (no SIGBUS)."""
    data = _write(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(data[:size])
    with pytest.raises(FormatError, match=f"{INDEX_NAME}: .*truncated"):
        Index.load(tmp_path)


def test_fields_are_read_by_name_whatever_the_dtypes_order():
    """format.fields_view takes fields by name: a dtype with its fields in another order gives the same values, so a
    reordered dtype cannot swap them silently; the view shares the rows' memory (made once at open, no copy)."""
    from fanstore.core.format import fields_view

    shuffled = np.dtype([("mode", "<u4"), ("size", "<u8"), ("mtime_ns", "<i8")])
    rows = np.array([(0o100644, 4096, -7), (0o40755, 0, 3)], dtype=shuffled)
    view = fields_view(rows, "size", "mtime_ns", "mode")
    assert view[0].item() == (4096, -7, 0o100644)
    assert view[1].item() == (0, 3, 0o40755)
    rows["size"][1] = 9
    assert view[1].item() == (9, 3, 0o40755)
    with pytest.raises(ValueError, match="nothing"):
        fields_view(rows, "nothing", "size")
    with pytest.raises(ValueError):
        fields_view(rows, "size")
