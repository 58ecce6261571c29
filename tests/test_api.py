"""The Python API as the README describes it: what it keeps between reads."""

from __future__ import annotations

import errno
import io
import gc
import multiprocessing
import os
import pickle
import re
import zipfile
from pathlib import Path

import pytest

from fanstore import ChunkCorrupt, PackOptions, UsageError, open_dataset, pack
from fanstore.core.chunk_source import FallbackChunkSource, LocalChunkSource
from fanstore.core.format import CHUNK_DIR, chunk_file_name


def test_the_api_keeps_no_decoded_cache(source_tree, tmp_path):
    """README: every `read` reads, verifies and decodes the file again. A blob damaged after a first read fails
    the second: had the first read's bytes been kept, the second would have returned them."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds:
        original = (source_tree / "labels.txt").read_bytes()
        assert ds.read("labels.txt") == original
        with ds.open("labels.txt") as opened:
            assert opened.read() == original
        entry = ds.index.lookup("labels.txt")
        chunk, offset = int(ds.index.entries["chunk"][entry]), int(ds.index.entries["offset"][entry])
        with open(dest / chunk_file_name(chunk), "r+b") as chunk_file:  # the same inode the dataset has open
            chunk_file.seek(offset)
            first = chunk_file.read(1)
            chunk_file.seek(offset)
            chunk_file.write(bytes([first[0] ^ 0xFF]))
        with pytest.raises(ChunkCorrupt, match="labels.txt"):
            ds.read("labels.txt")
        with pytest.raises(ChunkCorrupt, match="labels.txt"), ds.open("labels.txt") as reopened:
            reopened.read()


def _read_in_child(ds, path: str) -> bytes:
    return ds.read(path)


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_a_dataset_goes_to_a_spawned_process_as_what_opens_it_again(source_tree, tmp_path, start):
    """A user's own torch Dataset holding `open_dataset(...)` failed in spawn and forkserver DataLoader workers
    (cannot pickle memoryview objects): the dataset pickles as its directory, opened again where it lands. One read
    through another source (a serve node's) says it cannot be pickled and what to do, in one line."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds:
        clone = pickle.loads(pickle.dumps(ds))
        with clone:
            assert clone.read("labels.txt") == (source_tree / "labels.txt").read_bytes()
        with multiprocessing.get_context(start).Pool(1) as pool:
            assert pool.apply(_read_in_child, (ds, "labels.txt")) == (source_tree / "labels.txt").read_bytes()
    other = FallbackChunkSource(LocalChunkSource(dest, ds.index.chunks["size"]),
                                LocalChunkSource(dest, ds.index.chunks["size"]))
    with open_dataset(dest, source=other) as ds:
        with pytest.raises(TypeError, match="a dataset read through FallbackChunkSource cannot be pickled: open it"):
            pickle.dumps(ds)


def test_a_dataset_pickled_before_dest_was_packed_again_is_refused_where_it_lands(source_tree, tmp_path):
    """A pickled dataset opened whatever DEST held where it landed: a spawned worker read the new pack's files while
    the process that pickled it read the old one's. It is refused in one line naming DEST; one packed again before
    it was opened pickles and lands as before."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds:
        pickled = pickle.dumps(ds)
        (source_tree / "labels.txt").write_text("packed again\n" * 3)
        pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1, force=True))
        with pytest.raises(UsageError, match=rf"^{re.escape(str(dest))}: packed again since this dataset was "
                                             r"pickled \(its index file is another now\): open the dataset again"):
            pickle.loads(pickled)
    with open_dataset(dest) as again, pickle.loads(pickle.dumps(again)) as landed:
        assert landed.read("labels.txt") == b"packed again\n" * 3


def test_an_open_file_takes_what_a_python_file_takes(source_tree, tmp_path):
    """read(None) reads to the end, as a file's does (it raised TypeError); seek(1.5) is refused at the seek (it was
    taken, and the next read failed with an unrelated TypeError); a bytes path names the same file."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    original = (source_tree / "labels.txt").read_bytes()
    with open_dataset(dest) as ds, ds.open(b"labels.txt") as opened:
        assert opened.read(None) == original
        opened.seek(0)
        assert opened.read(3) + opened.read(-1) == original
        with pytest.raises(TypeError):
            opened.seek(1.5)
        assert opened.tell() == len(original)


def test_no_dataset_given_is_one_error_that_says_where_the_served_one_is_read():
    """open_dataset(None), as FileDataset(None) is written under serve, failed deep in the index loader with
    'expected str, bytes or os.PathLike object, not NoneType'; it says what to pass, and how a node's dataset is read
    under serve."""
    with pytest.raises(UsageError, match=r"^open_dataset: no dataset given: pass a packed dataset directory .*"
                                         r"fanstore\.torch\.FileDataset\(None\)"):
        open_dataset(None)


def test_a_seek_before_the_start_is_refused_as_a_file_and_as_bytes_io_refuse_it(source_tree, tmp_path):
    """zipfile.is_zipfile of a file shorter than a zip's end record said False for the real file and raised
    ValueError for the dataset's: zipfile seeks 22 bytes back from the end and catches OSError, which a real file's
    seek raises (EINVAL) and the dataset's did not. The refusal is now both an OSError with EINVAL, as a file's, and
    a ValueError, as io.BytesIO's, for a position before the start and for an unknown whence alike."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds, ds.open("empty.txt") as opened:
        assert zipfile.is_zipfile(opened) is False
        for args in ((-1,), (-1, 1), (-1, 2), (0, 7)):
            with pytest.raises(OSError) as refused:
                opened.seek(*args)
            assert isinstance(refused.value, ValueError) and refused.value.errno == errno.EINVAL
            assert str(refused.value).startswith("empty.txt: ")
        assert opened.tell() == 0


def test_a_closed_file_answers_as_a_closed_file_does(source_tree, tmp_path):
    """readable() and seekable() said True after close(), where a file's and io.BytesIO's raise ValueError: a
    library that asks before it reads went on to read a closed file."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    plain = open(source_tree / "labels.txt", "rb")
    with open_dataset(dest) as ds:
        opened = ds.open("labels.txt")
        for closing in (opened, plain, io.BytesIO(b"x")):
            closing.close()
            for ask in ("readable", "seekable", "tell", "read", "readline"):
                with pytest.raises(ValueError, match="closed file"):
                    getattr(closing, ask)()


def test_a_dataset_packed_again_while_open_is_named_as_such_not_as_damaged(source_tree, tmp_path):
    """DEST packed again with --force under an open dataset: its chunks not yet open are the new pack's, and a read
    failed with 'chunk 0 is N bytes, the index says M', a ChunkCorrupt that said to pack again while `fanstore
    verify` found nothing wrong. The error (still never the new pack's bytes) now says the dataset was packed again
    since it was opened and to open it again."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds:
        (source_tree / "labels.txt").write_text("packed again\n" * 3)
        pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1, force=True))
        with pytest.raises(ChunkCorrupt, match=r"^labels\.txt: .* \(.*ds was packed again since this dataset was "
                                               r"opened: its index file is another now, or gone; open the dataset "
                                               r"again\)$"):
            ds.read("labels.txt")
    with open_dataset(dest) as again:
        assert again.read("labels.txt") == b"packed again\n" * 3


def _chunk_files_open(dest: Path) -> int:
    """How many of this process's descriptors are open on chunk files of the dataset `dest`."""
    directory = dest / CHUNK_DIR
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{directory}/")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return held


def test_a_dataset_dropped_unclosed_gives_its_chunk_files_back(source_tree, tmp_path):
    """A file object closes when it is collected; a dataset kept its chunk files open for good, so a loader that
    opened the dataset for each item and never closed it (`open_dataset(DEST).read(path)`) ran out of descriptors
    after about as many items as its limit. A forked child that took the chunk files over keeps them open while the
    parent's copy, dropped there, is collected."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    original = (source_tree / "labels.txt").read_bytes()
    for _ in range(50):
        assert open_dataset(dest).read("labels.txt") == original
    assert _chunk_files_open(dest) == 0
    ds = open_dataset(dest)
    ds.read("labels.txt")
    pid = os.fork()
    if pid == 0:  # the child: its own source owns the descriptors; the parent's, dropped, closes none of them
        try:
            child = ds.for_forked_child()
            del ds
            gc.collect()
            os._exit(0 if child.read("labels.txt") == original and _chunk_files_open(dest) == 1 else 1)
        finally:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    del ds
    gc.collect()
    assert _chunk_files_open(dest) == 0


def test_an_open_file_refuses_to_be_pickled_in_words_that_name_it(source_tree, tmp_path):
    """Pickling ds.open(path) (a torch Dataset holding an open file, sent to a spawned worker) failed with "cannot
    pickle memoryview objects", from deep in the index: it is now refused as a real file's pickle is, with one line
    that names the file and says what pickles instead."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    with open_dataset(dest) as ds, ds.open("labels.txt") as opened:
        opened.read(5)
        with pytest.raises(TypeError, match=r"^labels\.txt: an open dataset file cannot be pickled, as an open file "
                                            r"cannot: pickle its Dataset"):
            pickle.dumps(opened)
        assert opened.read(5) == (source_tree / "labels.txt").read_bytes()[5:10]


def test_a_read_larger_than_the_file_gives_what_is_left(source_tree, tmp_path):
    """read(n) allocated n bytes before reading (io.RawIOBase's read): read(10**12) of a small file was a MemoryError,
    with a 'deallocated bytearray object has exported buffers' SystemError printed beside it, where io.BytesIO reads
    to the end. It asks for what is left."""
    dest = tmp_path / "ds"
    pack(source_tree, dest, PackOptions(codec="zstd:3", workers=1))
    original = (source_tree / "labels.txt").read_bytes()
    with open_dataset(dest) as ds, ds.open("labels.txt") as opened:
        assert opened.read(10**12) == original
        assert opened.read(10**12) == b""
        opened.seek(len(original) + 5)
        assert opened.read(3) == b""
    with pytest.raises(ValueError):
        opened.read(10**12)


def test_an_empty_path_given_to_the_api_is_refused_not_taken_for_the_current_directory(source_tree, tmp_path,
                                                                                          monkeypatch):
    """The command line refuses "" ("$DEST" with DEST unset); the API took it for the current directory, as
    Path('') is: pack(src, "") packed into it, open_dataset("") opened whatever dataset it held."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    pack(source_tree, here / "ds", PackOptions(codec="zstd:3", workers=1))
    monkeypatch.chdir(here / "ds")  # a dataset directory: "" opened it
    with pytest.raises(UsageError, match=r"^open_dataset: an empty path \(an unset variable\?\)"):
        open_dataset("")
    monkeypatch.chdir(here)
    with pytest.raises(UsageError, match=r"^DEST: an empty path"):
        pack(source_tree, "", PackOptions(codec="zstd:3", workers=1))
    with pytest.raises(UsageError, match=r"^SRC: an empty path"):
        pack("", here / "other", PackOptions(codec="zstd:3", workers=1))
    assert sorted(os.listdir(here)) == ["ds"]
