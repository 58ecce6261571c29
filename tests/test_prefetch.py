"""Prefetch: which files come next (directory order, a prefetch list, a size floor), and decoding them ahead."""

from __future__ import annotations

import os
import time

import pytest

from conftest import numbered_files
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.cache import DecodedCache
from fanstore.errors import UsageError
from fanstore.mount.prefetch import FileOrder, Prefetcher, read_prefetch_list


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    src = tmp_path_factory.mktemp("prefetch") / "src"
    (src / "d" / "sub").mkdir(parents=True)
    sizes = {"d/a.bin": 10, "d/b.bin": 5000, "d/c.bin": 0, "d/e.bin": 20, "d/f.bin": 6000, "other.bin": 30}
    for rel, size in sizes.items():
        (src / rel).write_bytes(b"z" * size)
    pack(src, src.parent / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(src.parent / "ds") as ds:
        yield ds


def paths(ds, entries):
    return [ds.index.path_of(e) for e in entries]


def test_directory_order_skips_directories_and_empty_files(dataset):
    order = FileOrder(dataset.index)
    # The next 4 entries of d/ are b, c, e, f (sub sorts last): the empty c is skipped.
    assert paths(dataset, order.after(dataset.index.lookup("d/a.bin"), 4)) == ["d/b.bin", "d/e.bin", "d/f.bin"]
    assert order.after(dataset.index.lookup("d/f.bin"), 4) == []  # only the directory d/sub follows


def test_a_size_floor_leaves_small_files_to_the_reader(dataset):
    order = FileOrder(dataset.index, min_stored_bytes=1000)
    assert paths(dataset, order.after(dataset.index.lookup("d/a.bin"), 4)) == ["d/b.bin", "d/f.bin"]


def test_list_order_wins_for_listed_files(dataset, tmp_path):
    listing = tmp_path / "epoch.txt"
    listing.write_text("d/f.bin\n\nother.bin\nd/a.bin\nd/f.bin\n")
    entries = read_prefetch_list(dataset.index, listing)
    order = FileOrder(dataset.index, entries)
    assert paths(dataset, order.after(dataset.index.lookup("d/f.bin"), 2)) == ["other.bin", "d/a.bin"]
    assert paths(dataset, order.after(dataset.index.lookup("d/b.bin"), 2)) == ["d/e.bin"]  # unlisted: directory


def test_a_bad_prefetch_list_names_file_and_line(dataset, tmp_path):
    listing = tmp_path / "bad.txt"
    listing.write_text("d/a.bin\nmissing.bin\n")
    with pytest.raises(UsageError, match=r"bad\.txt:2.*missing\.bin"):
        read_prefetch_list(dataset.index, listing)
    with pytest.raises(UsageError, match="cannot read"):
        read_prefetch_list(dataset.index, tmp_path / "absent.txt")


def test_a_list_may_name_files_through_the_mount_and_end_lines_as_windows_does(dataset, tmp_path):
    """A training script reading the mount writes the paths it opens (ImageFolder's samples are such paths)."""
    listing = tmp_path / "epoch.txt"
    mountpoint = tmp_path / "mnt"
    listing.write_bytes(f"{mountpoint}/d/f.bin\r\n./other.bin\r\n{mountpoint}//d/a.bin\n".encode())
    entries = read_prefetch_list(dataset.index, listing, mountpoint)
    assert entries == [dataset.index.lookup(p) for p in ("d/f.bin", "other.bin", "d/a.bin")]
    with pytest.raises(UsageError, match=rf"epoch\.txt:1: '{mountpoint}/d/f\.bin' is not in the dataset "
                                         r"\(1 more line of it names no file either\)$"):
        read_prefetch_list(dataset.index, listing)  # no mount point given: only dataset paths
    listing.write_text("d/a.bin\n/elsewhere/d/f.bin\n")
    with pytest.raises(UsageError, match=rf"epoch\.txt:2: .* \(a path through the mount starts with {mountpoint}/\)"):
        read_prefetch_list(dataset.index, listing, mountpoint)


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """A tree with links (to a file, to a directory, up and across) beside the dataset packed from it."""
    src = tmp_path_factory.mktemp("linked") / "src"
    (src / "d" / "sub").mkdir(parents=True)
    for rel in ("d/a.bin", "d/sub/s.bin", "other.bin"):
        (src / rel).write_bytes(rel.encode() * 100)
    os.symlink("../other.bin", src / "d" / "to_other")
    os.symlink("d/sub", src / "to_sub")
    os.symlink("../sub", src / "d" / "sub" / "loop")  # to d/sub itself
    pack(src, src.parent / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(src.parent / "ds") as ds:
        yield src, ds


# Lines the kernel resolves to a file of the original directory: '..' taken from where a link led, links followed.
RESOLVED_LINES = ["d/sub/../a.bin", "to_sub/../a.bin", "to_sub/s.bin", "d/to_other", "./d//sub/./s.bin", "/other.bin",
                  "d/sub/loop/loop/s.bin", "to_sub/loop/../../other.bin", "d/../d/sub/../../other.bin"]


def test_each_line_is_resolved_as_the_api_and_the_kernel_resolve_it(linked, tmp_path):
    """`..` in a line was looked up as a name (an error), and a link to a file was taken as the link, which is
    never decoded: each line now goes through the API's path walk, which follows the kernel's."""
    src, ds = linked
    listing = tmp_path / "epoch.txt"
    mountpoint = tmp_path / "mnt"
    listing.write_text("".join(f"{line}\n" for line in RESOLVED_LINES) + f"{mountpoint}/to_sub/../a.bin\n")
    entries = read_prefetch_list(ds.index, listing, mountpoint)
    kernel = [os.path.relpath(os.path.realpath(src / line.lstrip("/")), src) for line in RESOLVED_LINES]
    assert [ds.index.path_of(entry) for entry in entries] == kernel + ["d/a.bin"]
    assert entries[:-1] == [ds.resolve(line) for line in RESOLVED_LINES]


@pytest.mark.parametrize("line, problem", [
    ("d", "'d' is a directory; the list names the files to read, in order"),
    ("d/sub/", "'d/sub/' is a directory; the list names the files to read, in order"),
    ("to_sub", "'to_sub' is a directory; the list names the files to read, in order"),
    ("d/sub/..", "'d/sub/..' is a directory; the list names the files to read, in order"),
    ("d/a.bin/", "'d/a.bin/': 'd/a.bin' is not a directory"),
    ("d/a.bin/.", "'d/a.bin/.': 'd/a.bin' is not a directory"),
    ("d/to_other/", "'d/to_other/': 'other.bin' is not a directory"),
    ("d/a.bin/../a.bin", "'d/a.bin/../a.bin': 'd/a.bin' is not a directory"),
    ("d/sub/../nope.bin", "'d/sub/../nope.bin' is not in the dataset"),
], ids=["directory", "directory/", "link to a directory", "dir/..", "file/", "file/.", "link to a file/",
        "file/..", "missing after .."])
def test_a_line_that_names_no_file_is_an_error_naming_file_and_line(linked, tmp_path, line, problem):
    """A directory and a file named as a directory ('file/') were taken without a word (the first as nothing to
    read, the second as the file); like a name the dataset lacks, each is an error naming the list's file and
    line, and how many more lines name no file."""
    _, ds = linked
    listing = tmp_path / "epoch.txt"
    listing.write_text(f"d/a.bin\n{line}\nother.bin\n")
    with pytest.raises(UsageError) as raised:
        read_prefetch_list(ds.index, listing)
    assert str(raised.value) == f"--prefetch-list: {listing}:2: {problem}"
    listing.write_text(f"d/a.bin\n{line}\nother.bin\nd\nd/\n")
    with pytest.raises(UsageError, match=r"epoch\.txt:2: .* \(2 more lines of it name no file either\)$"):
        read_prefetch_list(ds.index, listing)


def test_a_list_that_is_not_text_names_its_first_bad_line(dataset, tmp_path):
    listing = tmp_path / "epoch.bin"
    listing.write_bytes(b"d/a.bin\n\x89PNG\r\n\x1a\n\xff\n")
    with pytest.raises(UsageError, match=r"epoch\.bin:2: not UTF-8 text"):
        read_prefetch_list(dataset.index, listing)
    listing.write_bytes(b"d/a.bin\0\x89PNG\r\n\x1a\n\x00\x00\xff\n")  # with a NUL: NUL-separated
    with pytest.raises(UsageError, match=r"epoch\.bin: entry 2: not UTF-8 text"):
        read_prefetch_list(dataset.index, listing)


@pytest.fixture(scope="module")
def spaced(tmp_path_factory):
    """Names a line cannot hold as the old reader read it: spaces or a tab at an end, a newline, a lone '\r'."""
    src = tmp_path_factory.mktemp("spaced") / "src"
    src.mkdir()
    for name in ("lead", " lead", "trail ", "tab\t", "new\nline", "cr\rname"):
        (src / name).write_bytes(name.encode() * 10)
    pack(src, src.parent / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(src.parent / "ds") as ds:
        yield ds


def test_a_line_is_taken_exactly_and_a_nul_separated_list_names_any_file(spaced, tmp_path):
    """Each line was stripped: ' lead' prefetched the other file 'lead', 'trail ' was refused as missing, and a
    name holding a newline or a '\r' could not be written at all. A line now keeps its spaces (only a '\r' before
    its '\n' goes), and a list holding a NUL is read as NUL-separated paths, as find -print0 writes them."""
    listing = tmp_path / "epoch.txt"
    listing.write_bytes(b" lead\r\ntrail \ntab\t\n\nlead\n")
    assert paths(spaced, read_prefetch_list(spaced.index, listing)) == [" lead", "trail ", "tab\t", "lead"]
    names = ["new\nline", "cr\rname", " lead", "trail "]
    listing.write_bytes("".join(f"{name}\0" for name in names).encode())
    assert paths(spaced, read_prefetch_list(spaced.index, listing)) == names
    listing.write_bytes(b"lead\0trail\0")
    with pytest.raises(UsageError) as raised:
        read_prefetch_list(spaced.index, listing)
    assert str(raised.value) == f"--prefetch-list: {listing}: entry 2: 'trail' is not in the dataset"


def test_the_prefetcher_decodes_the_next_files_into_the_cache(dataset):
    cache = DecodedCache(1 << 20, dataset.reader.read)
    prefetcher = Prefetcher(cache, FileOrder(dataset.index), depth=3, threads=2)  # b, (empty c), e
    try:
        prefetcher.accessed(dataset.index.lookup("d/a.bin"))
        deadline = time.monotonic() + 10
        wanted = [dataset.index.lookup(p) for p in ("d/b.bin", "d/e.bin")]
        while not all(cache.peek(e) is not None for e in wanted) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [cache.peek(e) for e in wanted] == [b"z" * 5000, b"z" * 20]
    finally:
        prefetcher.close()


def test_a_file_the_reader_takes_over_is_not_prefetched_as_well(dataset):
    """A prefetch still queued when the reader asks for its file is dropped: the file is loaded once, by the
    reader, not a second time by a prefetch thread after it (a remote file would be fetched twice)."""
    import threading

    gate = threading.Event()
    loads: list[int] = []

    def load(entry):
        gate.wait(10)
        loads.append(entry)
        return dataset.reader.read(entry)

    cache = DecodedCache(1 << 20, load)
    prefetcher = Prefetcher(cache, FileOrder(dataset.index), depth=3, threads=1)
    b, e = dataset.index.lookup("d/b.bin"), dataset.index.lookup("d/e.bin")
    try:
        prefetcher.accessed(dataset.index.lookup("d/a.bin"))  # b runs (held at the gate), e waits behind it
        assert prefetcher.withdraw(e) is True
        assert prefetcher.withdraw(e) is False
        gate.set()
        assert cache.load_uncached(e) == b"z" * 20  # the reader's own load
        deadline = time.monotonic() + 10
        while prefetcher.stats()["pending"] and time.monotonic() < deadline:  # let the queue drain
            time.sleep(0.01)
    finally:
        gate.set()
        prefetcher.close()
    assert sorted(loads) == sorted([b, e])  # b by the prefetch, e once, by the reader


def test_reads_follow_the_order_when_each_worker_reads_its_own_stretch(tmp_path):
    """Two DataLoader workers read batches 0 and 1 of the list at once, then 2 and 3: their reads interleave, but
    each lands just after one of the latest, so the reader follows the order; reads 3 places apart with a depth of
    2 do not, after a few of them."""
    names = numbered_files(tmp_path / "src", 64, lambda _number: 100)
    pack(tmp_path / "src", tmp_path / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        listed = [ds.index.lookup(name) for name in names]
        seen: list[bool] = []
        followed_each: list[bool] = []

        def record(entry: int, keys: list, followed: bool, in_order: bool) -> list:
            seen.append(in_order)
            followed_each.append(followed)
            return []  # nothing left for the threads: only the verdicts matter here

        # Batches of 8: the two workers take batches 0 and 1, then 2 and 3, ..., each reading its items in turn.
        two_workers = [listed[batch * 8 + item] for pair in range(0, 8, 2) for item in range(8)
                       for batch in (pair, pair + 1)]
        prefetcher = Prefetcher(DecodedCache(1 << 20, ds.reader.read), FileOrder(ds.index, listed), depth=2,
                                threads=1)
        try:
            for entry in two_workers:
                prefetcher.accessed(entry, record)
            assert all(seen), seen
            # Each read follows a recent one but the first of each pair's second batch (and the very first).
            assert followed_each.count(False) == 5, followed_each
            assert prefetcher.stats()["in_order"] > 0.9
            seen.clear()
            followed_each.clear()
            for entry in listed[::3]:
                prefetcher.accessed(entry, record)
            assert seen[:3] == [True] * 3 and not any(seen[12:]), seen
            assert not any(followed_each), followed_each  # each read on its own: none follows a recent one
            assert prefetcher.stats()["in_order"] < 0.5
        finally:
            prefetcher.close()
