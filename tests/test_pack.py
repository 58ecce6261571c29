"""Pack then read back: the whole tree survives, output is deterministic, chunks and groups follow the rules."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, dataset_digest, dir_bytes, make_tree, run_cli, tree_digest
from fanstore import FanstoreError, PackOptions, open_dataset, pack
from fanstore.core import index_check
from fanstore.errors import PathNotFound
from fanstore.core.format import CHUNK_HEADER_LEN, INDEX_NAME, NO_CHUNK
from fanstore.core.index import write_index_atomically


@pytest.mark.parametrize("codec", ["zstd:3", "zstd-dict:9", "lz4", "blosc:lz4:5:shuffle", "none"])
def test_round_trip_keeps_every_path_byte_and_attribute(source_tree, tmp_path, codec):
    summary = pack(source_tree, tmp_path / "ds", PackOptions(codec=codec, workers=1))
    assert summary.problems == []
    with open_dataset(tmp_path / "ds") as ds:
        assert dataset_digest(ds) == tree_digest(source_tree)
        assert len(ds) == sum(1 for p in source_tree.rglob("*") if p.is_file() and not p.is_symlink())
        for rel in ("field.npy", "empty.txt", "train/cat/img_001.png"):
            st, orig = ds.stat(rel), os.stat(source_tree / rel)
            assert (st.st_mode, st.st_size, st.st_mtime_ns) == (orig.st_mode, orig.st_size, orig.st_mtime_ns)
        assert stat.S_ISDIR(ds.stat("empty_dir/nested_empty").st_mode)
        assert ds.listdir("empty_dir/nested_empty") == []
        assert ds.read("latest.npy") == (source_tree / "field.npy").read_bytes()
        assert ds.listdir("cats") == sorted(os.listdir(source_tree / "train" / "cat"))


def test_walk_and_listdir_match_os(source_tree, tmp_path):
    pack(source_tree, tmp_path / "ds", PackOptions(workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        ours = {(d, tuple(sorted(dn)), tuple(sorted(fn))) for d, dn, fn in ds.walk()}
        theirs = {(Path(d).relative_to(source_tree).as_posix().replace(".", "", 1) if d != str(source_tree) else "",
                   tuple(sorted(dn)), tuple(sorted(fn))) for d, dn, fn in os.walk(source_tree)}
        # os.walk lists symlinks to directories among dirnames; the dataset walk, like os.walk with
        # followlinks=False, does not descend into them, but lists them as non-directories.
        theirs = {(d, tuple(n for n in dn if not (source_tree / d / n).is_symlink()),
                   tuple(sorted(fn + tuple(n for n in dn if (source_tree / d / n).is_symlink()))))
                  for d, dn, fn in theirs}
        assert ours == theirs
        assert ds.listdir("") == sorted(os.listdir(source_tree), key=lambda n: n.encode())
        with pytest.raises(PathNotFound):
            ds.read("train/cat/missing.png")


def test_misuse_of_the_api_raises_fanstore_errors_that_refine_builtins(source_tree, tmp_path):
    """Callers catch FanstoreError for everything, or the builtin they already handle."""
    os.symlink("loop_b", source_tree / "loop_a")
    os.symlink("loop_a", source_tree / "loop_b")
    pack(source_tree, tmp_path / "ds", PackOptions(workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        for call, builtin in ((lambda: ds.read("train"), IsADirectoryError),
                              (lambda: ds.open("train"), IsADirectoryError),
                              (lambda: ds.listdir("labels.txt"), NotADirectoryError),
                              (lambda: ds.readlink("labels.txt"), OSError),
                              (lambda: ds.read("loop_a"), OSError),
                              (lambda: ds.read("nowhere/x"), FileNotFoundError),
                              (lambda: ds.reader.read_block(ds.index.lookup("labels.txt"), 0), ValueError)):
            with pytest.raises(FanstoreError) as caught:
                call()
            assert isinstance(caught.value, builtin)
        with ds.open("labels.txt") as f:
            with pytest.raises(ValueError, match="whence"):
                f.seek(0, 3)
            with pytest.raises(ValueError, match="negative"):
                f.seek(-1)


def test_open_gives_a_seekable_read_only_file(source_tree, tmp_path):
    pack(source_tree, tmp_path / "ds", PackOptions(workers=1))
    original = (source_tree / "field.npy").read_bytes()
    with open_dataset(tmp_path / "ds") as ds, ds.open("field.npy") as f:
        assert f.readable() and f.seekable() and not f.writable()
        assert np.load(f).shape == (64, 256)
        f.seek(100)
        assert f.read(50) == original[100:150]
        f.seek(-10, io.SEEK_END)
        assert f.read() == original[-10:]
        assert f.tell() == len(original)
        with pytest.raises(io.UnsupportedOperation):
            f.write(b"x")


def test_output_is_byte_identical_whatever_the_worker_count(source_tree, tmp_path):
    options = dict(codec="zstd-dict:5", chunk_size=64 * 1024, replicate=("val/**",))
    pack(source_tree, tmp_path / "one", PackOptions(workers=1, **options))
    pack(source_tree, tmp_path / "two", PackOptions(workers=2, **options))
    pack(source_tree, tmp_path / "again", PackOptions(workers=2, **options))
    assert dir_bytes(tmp_path / "one") == dir_bytes(tmp_path / "two") == dir_bytes(tmp_path / "again")


def test_packing_beside_other_threads_gives_the_same_bytes(source_tree, tmp_path):
    """Workers are forked by a process with no other thread (the CLI, a fresh process) and come from the
    forkserver when another thread runs: same output either way."""
    options = dict(codec="zstd:3", chunk_size=64 * 1024, replicate=("val/**",), workers=2)
    run_cli("fanstore-pack", str(source_tree), str(tmp_path / "alone"), "--codec", "zstd:3", "--chunk-size", "64KiB",
            "--replicate", "val/**", "--workers", "2", "--quiet", check=True)
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, name="another thread of the caller's")
    busy.start()
    try:
        pack(source_tree, tmp_path / "beside", PackOptions(**options))
    finally:
        stop.set()
        busy.join()
    assert dir_bytes(tmp_path / "alone") == dir_bytes(tmp_path / "beside")


def test_chunks_respect_size_and_groups(source_tree, tmp_path):
    chunk_size = 16 * 1024
    pack(source_tree, tmp_path / "ds", PackOptions(codec="none", chunk_size=chunk_size, replicate=("val/**",),
                                                   workers=2))
    with open_dataset(tmp_path / "ds") as ds:
        index = ds.index
        sizes = [p.stat().st_size for p in sorted((tmp_path / "ds" / "chunks").iterdir())]
        assert sizes == [int(s) for s in index.chunks["size"]]
        for chunk_id, size in enumerate(sizes):
            in_chunk = index.entries[index.entries["chunk"] == chunk_id]
            # Over the target only when a single blob is larger than a chunk: then it is alone.
            assert size <= chunk_size or len(in_chunk) == 1
            assert size == CHUNK_HEADER_LEN + int(in_chunk["stored_len"].sum())
        big = index.entries[index.lookup("random.bin")]
        assert int(index.chunks["size"][big["chunk"]]) == CHUNK_HEADER_LEN + 200_000
        for entry in index.iter_files():
            path = index.path_of(entry)
            chunk = int(index.entries[entry]["chunk"])
            if chunk == NO_CHUNK:
                continue
            assert int(index.chunks["group"][chunk]) == (1 if path.startswith("val/") else 0), path
        assert [g["name"] for g in index.groups] == ["spread", "replicated"]


def test_incompressible_files_are_stored_raw(source_tree, tmp_path):
    pack(source_tree, tmp_path / "ds", PackOptions(codec="zstd:19", workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        rec = ds.index.entries[ds.index.lookup("random.bin")]
        assert int(rec["codec"]) == 0 and int(rec["stored_len"]) == 200_000
        rec = ds.index.entries[ds.index.lookup("labels.txt")]
        assert int(rec["codec"]) != 0 and int(rec["stored_len"]) < int(rec["size"])


def test_dictionary_beats_plain_zstd_on_small_similar_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    for i in range(600):
        fields = ",".join(f'"{k}": {rng.integers(0, 1000)}' for k in ("epoch", "step", "loss_x1000", "label", "width"))
        (src / f"rec_{i:04d}.json").write_text('{"schema": "fanstore.sample.v1", "source": "camera-7", ' + fields + "}")
    plain = pack(src, tmp_path / "plain", PackOptions(codec="zstd:9", workers=1))
    trained = pack(src, tmp_path / "dict", PackOptions(codec="zstd-dict:9", workers=1))
    assert trained.stored_bytes < plain.stored_bytes * 0.8
    with open_dataset(tmp_path / "dict") as ds:
        assert ds.index.codecs[1]["dictionary"] == "dict.0" and "dict.0" in ds.index.dictionaries
        assert ds.read("rec_0042.json") == (src / "rec_0042.json").read_bytes()


def test_dictionary_falls_back_to_zstd_for_a_tiny_group(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "only.txt").write_text("just one small file " * 10)
    pack(src, tmp_path / "ds", PackOptions(codec="zstd-dict:7", workers=1))
    with open_dataset(tmp_path / "ds") as ds:
        assert [row["spec"] for row in ds.index.codecs] == ["none", "zstd:7"]
        assert ds.read("only.txt") == (src / "only.txt").read_bytes()


def test_info_and_verify_cli(source_tree, tmp_path):
    from conftest import run_cli

    run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), "--replicate", "val/**", "--quiet",
            check=True)
    info = run_cli("info", str(tmp_path / "ds"), check=True).stdout
    for needle in ("format       1.2", "replicated", "val/**", "ratio", "zstd:3"):
        assert needle in info
    verify = run_cli("verify", str(tmp_path / "ds"), check=True)
    assert "0 bad" in verify.stdout


def test_packing_twice_into_a_fresh_tree_of_the_same_files_is_identical(tmp_path):
    make_tree(tmp_path / "a")
    pack(tmp_path / "a", tmp_path / "ds1", PackOptions(workers=2))
    pack(tmp_path / "a", tmp_path / "ds2", PackOptions(workers=1))
    assert dir_bytes(tmp_path / "ds1") == dir_bytes(tmp_path / "ds2")


def _full_checks_at_open(dataset: Path) -> int:
    """How many passes over every entry a fresh process makes to open `dataset` (index_check's own count)."""
    code = ("import sys; from fanstore.core import index_check; from fanstore.core.index import Index; "
            "Index.load(sys.argv[1]); print(index_check.full_checks_run())")
    proc = subprocess.run([sys.executable, "-c", code, str(dataset)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return int(proc.stdout)


def test_the_first_open_after_a_pack_skips_the_full_check_the_pack_made(source_tree, tmp_path):
    """The packer runs the reader's full check on the index bytes it writes and stamps the file for this node, so
    the first open of a fresh pack does not check every entry again; the same index replaced, rewritten in place or
    touched has another identity, and the next open checks it in full."""
    dataset = tmp_path / "ds"
    before = index_check.full_checks_run()
    pack(source_tree, dataset, PackOptions(workers=1))
    assert index_check.full_checks_run() == before + 1  # the pack's own check of what it wrote
    assert _full_checks_at_open(dataset) == 0
    index_file = dataset / INDEX_NAME
    data = index_file.read_bytes()
    write_index_atomically(dataset, data)  # the same bytes, another file
    assert _full_checks_at_open(dataset) == 1
    assert _full_checks_at_open(dataset) == 0  # that open stamped it
    with open(index_file, "r+b") as rewritten:  # the same bytes written over themselves: a new mtime and ctime
        rewritten.write(data[:64])
    assert _full_checks_at_open(dataset) == 1
    os.utime(index_file)  # touched
    assert _full_checks_at_open(dataset) == 1


def test_archive_members_whose_names_no_file_system_holds_are_refused_by_name(tmp_path):
    """A tar member may carry a 300-byte name or a 5,000-byte path, which no dataset path may (NAME_MAX, PATH_MAX:
    the index check refuses them): such members are skipped with a warning naming them, the others packed, and
    the dataset opens (it once packed into an index nobody could open)."""
    archive = tmp_path / "long.tar"
    long_name, long_path = "d/" + "x" * 300, "/".join(["y" * 200] * 25)
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in (long_name, long_path, "ok.txt"):
            member = tarfile.TarInfo(name)
            member.size = 5
            tar.addfile(member, io.BytesIO(b"hello"))
    summary = pack(archive, tmp_path / "ds", PackOptions(workers=1))
    reasons = {problem.path: problem.reason for problem in summary.problems}
    assert reasons[long_name].startswith("has a name of 300 bytes: a name holds at most 255 (NAME_MAX)")
    assert any(reason.startswith("is 5,024 bytes long: a path holds at most 4,096 (PATH_MAX)")
               for reason in reasons.values()), reasons
    with open_dataset(tmp_path / "ds") as ds:
        assert sorted(ds.files()) == ["ok.txt"]
    with pytest.raises(FanstoreError, match="strict"):
        pack(archive, tmp_path / "strict", PackOptions(workers=1, strict=True))

@pytest.mark.parametrize("fifos", [1, 2])
def test_strict_counts_what_cannot_be_packed_as_docs_output_md_says(tmp_path, fifos):
    """--strict's line said `(1 path(s) cannot be packed)`, where docs/OUTPUT.md has counts take their plural."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")
    for number in range(fifos):
        os.mkfifo(src / f"fifo{number}")
    proc = run_cli("fanstore-pack", str(src), str(tmp_path / "ds"), "--strict", "--quiet")
    assert proc.returncode == 1, proc.stderr
    said = "(1 path cannot be packed)" if fifos == 1 else "(2 paths cannot be packed)"
    assert said in proc.stderr, proc.stderr


@pytest.mark.parametrize("member", [False, True], ids=["directory", "tar member"])
def test_a_file_dated_past_what_the_index_holds_is_packed_with_the_nearest_time(tmp_path, member):
    """An mtime in 2300 (or before 1677) does not fit the index's int64 nanoseconds: a pack of such a file ended
    in an OverflowError traceback. Its bytes are packed, its time the nearest the index holds, and the same command
    run again finds the pack finished."""
    src = tmp_path / "src"
    src.mkdir()
    for name, seconds in (("future.txt", 10_413_792_000), ("past.txt", -11_676_096_000), ("now.txt", 1_700_000_000)):
        (src / name).write_text(name)
        os.utime(src / name, ns=(seconds * 10**9, seconds * 10**9))
    given = src
    if member:
        given = tmp_path / "src.tar"
        with tarfile.open(given, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(src, arcname=".")
    done = run_cli("fanstore-pack", str(given), str(tmp_path / "ds"), "--quiet")
    assert done.returncode == 0 and "Traceback" not in done.stderr and "skipped" not in done.stderr, done.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert {name: ds.read(name) for name in ds.listdir("")} == {name: name.encode() for name in
                                                                   ("future.txt", "now.txt", "past.txt")}
        assert ds.stat("future.txt").st_mtime_ns == 2**63 - 1
        # This file system may keep the past one no further back than 1901 (a 32-bit second): as it keeps it.
        assert ds.stat("past.txt").st_mtime_ns == max(os.stat(src / "past.txt").st_mtime_ns, -(2**63))
        assert ds.stat("now.txt").st_mtime_ns == 1_700_000_000 * 10**9
    assert "nothing to do" in run_cli("fanstore-pack", str(given), str(tmp_path / "ds"), check=True).stdout


def test_an_interrupt_while_the_workers_start_leaves_none_waiting(monkeypatch):
    """A Ctrl-C while the pool started its workers (the second of two, here) left the first waiting for work that
    never came, and the pack's exit waiting for it (multiprocessing joins its children) for good: the pack printed
    'interrupted' and hung. The workers started are ended with the interrupt."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from fanstore.pack.compress import WorkerPool

    submitted = []
    real_submit = ProcessPoolExecutor.submit

    def interrupted_submit(self, fn, *args, **kwargs):
        submitted.append(fn)
        if len(submitted) == 2:
            raise KeyboardInterrupt
        return real_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", interrupted_submit)
    # The processes the pool starts, on this thread: in a whole run another test's thread may start its own meanwhile
    # (a set of children before and after judged one such ForkProcess, CI of 47f1ae1), which are not this one's.
    started = []
    real_start = multiprocessing.process.BaseProcess.start
    caller = threading.get_ident()

    def recording_start(process):
        real_start(process)
        if threading.get_ident() == caller:
            started.append(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    try:
        with pytest.raises(KeyboardInterrupt):
            WorkerPool(2)
        assert started and [process for process in started if process.is_alive()] == []
    finally:
        for process in started:  # before the fix: else pytest's exit waits
            if process.is_alive():
                process.kill()
                process.join()
