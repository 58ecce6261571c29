"""Symlinks stay inside the dataset, whatever their text said in SRC; and the pack reads only the files the walk
saw: one swapped for a symlink, a fifo or another file, or rewritten at the same size, is skipped with a reason."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import run_cli
from fanstore import PackOptions, open_dataset, pack
from fanstore.core.api import EntryStat
from fanstore.errors import NotADirectory, PathNotFound, SymlinkLoop
from fanstore.pack.walk import walk_source


@pytest.fixture
def linked_tree(tmp_path) -> Path:
    """Links whose text leaves SRC and comes back, climbs through a symlinked directory, or has inner '..'."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "data").mkdir()
    (src / "data" / "labels.txt").write_text("labels\n")
    (src / "a" / "b" / "deep.txt").write_text("deep\n")
    os.symlink("../../../src/data/labels.txt", src / "a" / "b" / "out_and_back")   # leaves SRC, comes back
    os.symlink("../../a/../data/labels.txt", src / "a" / "b" / "inner_dotdot")     # an inner '..'
    os.symlink(str(src / "a" / "b" / "deep.txt"), src / "data" / "absolute")       # absolute, inside
    os.symlink("../data/labels.txt", src / "a" / "plain")                          # already safe: kept
    os.symlink("a/b", src / "to_b")                                                # a symlinked directory
    os.symlink("../../data", src / "a" / "b" / "data_dir")
    os.symlink("../..", src / "a" / "b" / "root")                                  # the root itself
    os.symlink("../../../elsewhere", src / "a" / "b" / "leaves")                   # leaves: skipped
    (tmp_path / "elsewhere").write_text("outside\n")
    return src


def test_links_are_stored_in_a_form_that_stays_inside(linked_tree, tmp_path):
    summary = pack(linked_tree, tmp_path / "ds", PackOptions(workers=1))
    assert [p.path for p in summary.problems] == ["a/b/leaves"]
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.readlink("a/b/out_and_back") == "../../data/labels.txt"
        assert ds.readlink("a/b/inner_dotdot") == "../../data/labels.txt"
        assert ds.readlink("data/absolute") == "../a/b/deep.txt"
        assert ds.readlink("a/plain") == "../data/labels.txt"  # already in the safe form: kept as written
        assert ds.readlink("a/b/root") == "../.."
        for link in ("a/b/out_and_back", "a/b/inner_dotdot", "a/plain", "to_b/data_dir/labels.txt"):
            assert ds.read(link) == b"labels\n", link
        assert ds.read("data/absolute") == b"deep\n"
        assert ds.listdir("to_b/root/a") == ["b", "plain"]


def test_resolving_many_paths_at_once_gives_what_resolving_each_gives(linked_tree, tmp_path):
    pack(linked_tree, tmp_path / "ds", PackOptions(workers=1))
    paths = ["data/labels.txt", "a/b/deep.txt", "a/b/out_and_back", "data/absolute", "to_b/data_dir/labels.txt",
             "to_b/root/a/b/deep.txt", "./a//b/deep.txt", "a/b/root/", "to_b"]
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.resolve_many(paths).tolist() == [ds.resolve(path) for path in paths]
        assert ds.resolve_many([]).tolist() == []
        with pytest.raises(PathNotFound, match="a/b/missing"):
            ds.resolve_many(["data/labels.txt", "a/b/missing"])
        with pytest.raises(PathNotFound, match="leaves"):
            ds.resolve_many(["a/b/leaves"])
        with pytest.raises(NotADirectory, match="'a/b/deep.txt' is not a directory"):
            ds.resolve_many(["./a//b/deep.txt/"])  # a file named as a directory, as the kernel refuses it


def _outcome(look: Callable[[], os.stat_result | EntryStat]) -> tuple:
    """What a lookup gave, comparably for the kernel and the API: the kind of error, or the entry's type and size."""
    try:
        found = look()
    except OSError as exc:
        if isinstance(exc, SymlinkLoop) or exc.errno == errno.ELOOP:
            return ("ELOOP",)
        return (next(kind for kind in (FileNotFoundError, NotADirectoryError, OSError) if isinstance(exc, kind)),)
    return stat.S_IFMT(found.st_mode), found.st_size if stat.S_ISREG(found.st_mode) else None


def test_the_api_resolves_a_path_as_the_kernel_does_in_src(tmp_path):
    """Loops, chains of links at and past the kernel's 40, links to the root on the way, a file taken for a
    directory, a path far deeper than any link, '..' anywhere, a trailing '/' or '.': the API gives what os.stat and
    os.lstat give in SRC, never a RecursionError (one budget of hops for a whole lookup, however links lead to
    links). '..' was looked up as a name, and 'file.txt/' read the file; walk of a file gave it as a directory."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "file.txt").write_text("file\n")
    os.symlink("l/l", src / "l")                       # through itself, as a directory
    os.symlink("m2", src / "m1")
    os.symlink("m1", src / "m2")
    os.symlink("../..", src / "a" / "b" / "top")         # the root, on the way
    for number in range(45):                             # chain0 -> chain1 -> ... -> chain45 = a file
        os.symlink(f"chain{number + 1}", src / f"chain{number}")
    os.symlink("a/b/file.txt", src / "chain45")
    pack(src, tmp_path / "ds", PackOptions(workers=1))
    paths = ["l", "l/x", "l/l/l", "m1", "m1/x", "a/b/top/a/b/file.txt", "a/b/file.txt/x", "a/b/file.txt/",
             "x/" * 600 + "y", "a/" * 600 + "y", "chain45", "chain6", "chain5", "chain4", "chain5/x",
             "a/b/top" + "/a/b/top" * 38 + "/a/b/file.txt", "a/b/top" + "/a/b/top" * 40 + "/a/b/file.txt",
             "a/b/top" + "/a/b/top" * 38 + "/chain44", "a/b/top" + "/a/b/top" * 38 + "/chain43",
             # '..' as the kernel takes it (after a link, from where the link led), and what must be a directory
             "a/../a/b/file.txt", "a/b/top/a/../a/b/./file.txt", "x/..",
             "a/b/file.txt/", "a/b/file.txt/.", "a/b/file.txt/..", "a/b/", "a/b/.", "a/b/..", "a/b/top/", "chain6/",
             "chain6/..", "l/..", "/a/b/file.txt", "./a//b/file.txt"]
    with open_dataset(tmp_path / "ds") as ds:
        for path in paths:
            for follow in (True, False):
                kernel = _outcome(lambda: os.stat(f"{src}/{path}", follow_symlinks=follow))  # as spelled: "x/" too
                assert _outcome(lambda: ds.stat(path, follow_symlinks=follow)) == kernel, (path[:80], follow)
        assert _outcome(lambda: ds.stat("chain5")) == ("ELOOP",)  # the chain is 41 links from there
        assert ds.read("chain6") == b"file\n" and ds.readlink("a/b/top/a/b/top/chain0") == "chain1"
        assert list(ds.walk("a/b/file.txt")) == [] and ds.read(os.fsencode("a/b/file.txt")) == b"file\n"
        # The dataset's root is a root, as '/' is: '..' there stays there (in SRC it would climb out of SRC).
        for path, same in (("..", ""), ("../a/b/file.txt", "a/b/file.txt"),
                           ("a/b/top/../a/b/file.txt", "a/b/file.txt")):
            assert ds.stat(path) == ds.stat(same), path
        for path in ("l", "l/x", "m1/x"):
            with pytest.raises(SymlinkLoop, match="too many levels of symbolic links"):
                ds.read(path)
        with pytest.raises(PathNotFound):
            ds.listdir("x/" * 600 + "y")


def test_the_mount_resolves_every_link_inside_it(linked_tree, tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")
    pack(linked_tree, tmp_path / "ds", PackOptions(workers=1))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run_cli("mount", str(tmp_path / "ds"), str(mnt), "--log", str(tmp_path / "log"), check=True)
    try:
        links = [p for p in mnt.rglob("*") if p.is_symlink()]
        assert len(links) == 7
        for link in links:
            assert os.path.realpath(link).startswith(str(mnt) + os.sep) or os.path.realpath(link) == str(mnt), link
        assert (mnt / "a" / "b" / "out_and_back").read_text() == "labels\n"
        assert (mnt / "to_b" / "data_dir" / "labels.txt").read_text() == "labels\n"
    finally:
        run_cli("umount", str(mnt), check=True)


@pytest.fixture
def walked(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("swap_link", "swap_fifo", "swap_file", "same_size", "untouched"):
        (src / name).write_bytes(name.encode() * 100)
    return src, walk_source(src)


@pytest.mark.parametrize("workers", [1, 2])
def test_files_swapped_or_rewritten_after_the_walk_are_skipped(walked, tmp_path, workers):
    src, tree = walked
    (src / "swap_link").unlink()
    os.symlink("untouched", src / "swap_link")
    (src / "swap_fifo").unlink()
    os.mkfifo(src / "swap_fifo")  # opened without blocking, then refused: no reader waits for a writer
    replacement = src / "replacement"
    replacement.write_bytes(b"swap_file" * 100)
    os.replace(replacement, src / "swap_file")  # same name, same size, another inode
    time.sleep(0.01)
    (src / "same_size").write_bytes(b"SAME_SIZE" * 100)  # rewritten in place: same size, new mtime and ctime
    started = time.monotonic()
    summary = pack(src, tmp_path / f"ds{workers}", PackOptions(workers=workers), tree=tree)
    assert time.monotonic() - started < 30
    reasons = {p.path: p.reason for p in summary.problems}
    assert reasons == {"swap_link": "became a symlink during the pack",
                       "swap_fifo": "is no longer a regular file",
                       "swap_file": "was replaced by another file during the pack",
                       "same_size": "changed during the pack (modified since the walk)"}
    with open_dataset(tmp_path / f"ds{workers}") as ds:
        assert ds.listdir("") == ["untouched"]
        assert ds.read("untouched") == b"untouched" * 100


def test_a_source_that_numbers_its_files_afresh_is_packed_whole(tmp_path):
    """A FUSE file system without inode numbers of its own (libfuse's high-level API, as sshfs) gives a file another
    number once the kernel forgot it: every file read after the walk was skipped as 'replaced by another file'.
    One whose size, mtime and ctime are still the walk's is the same file, and is packed."""
    import subprocess
    import sys

    from conftest import wait_until
    from fanstore.mount.mountinfo import fuse_mounted_at

    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")
    from renumbering_fs import FILES

    mountpoint = tmp_path / "src"
    mountpoint.mkdir()
    daemon = subprocess.Popen([sys.executable, str(Path(__file__).with_name("renumbering_fs.py")), str(mountpoint)])
    try:
        wait_until(lambda: fuse_mounted_at(mountpoint) or daemon.poll() is not None, "the renumbering mount", 30)
        if daemon.poll() is not None:
            pytest.skip("cannot mount a FUSE file system here (needs root or fusermount3)")
        assert os.stat(mountpoint / "f0.txt").st_ino != os.stat(mountpoint / "f0.txt").st_ino
        summary = pack(mountpoint, tmp_path / "ds", PackOptions(workers=1))
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        daemon.wait(timeout=30)
    assert summary.problems == []
    with open_dataset(tmp_path / "ds") as ds:
        assert {name: ds.read(name) for name in ds.listdir("")} == {name.decode(): content
                                                                    for name, content in FILES.items()}
