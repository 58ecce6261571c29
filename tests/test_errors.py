"""The errors a caller catches: every one the README and docs name is importable from `fanstore`, and it is the
very class fanstore raises, also a subclass of the builtin it refines where it refines one."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

import fanstore
import fanstore.errors
from fanstore import (
    ChunkCorrupt,
    ChunkUnavailable,
    DatasetNotFound,
    FanstoreError,
    FormatError,
    PathNotFound,
    UsageError,
)
from conftest import REPO, flip_byte, run_cli
from fanstore.mount.options import MountOptions
from fanstore.pack.options import PackOptions
from fanstore.serve.options import SERVE_MOUNT, PeerOptions, ServeOptions
from fanstore.core.format import INDEX_NAME, chunk_file_name

# What the README names, and what a caller needs to tell the cases apart.
DOCUMENTED = ("FanstoreError", "ChunkUnavailable", "ChunkCorrupt", "PathNotFound", "DatasetNotFound", "FormatError",
              "UsageError")


def _names_in_the_docs() -> set[str]:
    """Every `Name` in backquotes in README.md and docs/*.md that fanstore.errors defines."""
    texts = [(REPO / "README.md").read_text()] + [path.read_text() for path in sorted((REPO / "docs").glob("*.md"))]
    quoted = {name for text in texts for name in re.findall(r"`([A-Z][A-Za-z]+)`", text)}
    return {name for name in quoted if isinstance(getattr(fanstore.errors, name, None), type)}


def test_every_error_the_docs_name_is_importable_from_fanstore():
    names = _names_in_the_docs() | set(DOCUMENTED) | set(fanstore.errors.__all__)
    assert {"ChunkCorrupt", "ChunkUnavailable"} <= _names_in_the_docs()
    for name in sorted(names):
        exported = getattr(fanstore, name)
        assert exported is getattr(fanstore.errors, name), name
        assert name in fanstore.__all__, name
        assert issubclass(exported, fanstore.FanstoreError), name
    written = (ChunkCorrupt, ChunkUnavailable, DatasetNotFound, FanstoreError, FormatError, PathNotFound, UsageError)
    assert [error.__name__ for error in written] == sorted(DOCUMENTED)  # imported as a user writes it, above
    assert all(error is getattr(fanstore.errors, error.__name__) for error in written)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small dataset with a directory, a file, and two symlinks that point at each other."""
    root = tmp_path_factory.mktemp("errors")
    src = root / "src"
    (src / "dir").mkdir(parents=True)
    (src / "file.txt").write_text("a file\n" * 100)
    os.symlink("loop_b", src / "loop_a")
    os.symlink("loop_a", src / "loop_b")
    fanstore.pack(src, root / "ds", fanstore.PackOptions(codec="zstd:3", workers=1))
    return root / "ds"


def _read(dataset: Path, call: Callable[[fanstore.Dataset], object]) -> None:
    with fanstore.open_dataset(dataset) as ds:
        call(ds)


@pytest.mark.parametrize("error, builtin, call", [
    ("PathNotFound", FileNotFoundError, lambda ds: ds.read("missing.txt")),
    ("PathNotFound", FileNotFoundError, lambda ds: ds.stat("dir/missing")),
    ("IsADirectory", IsADirectoryError, lambda ds: ds.read("dir")),
    ("NotADirectory", NotADirectoryError, lambda ds: ds.listdir("file.txt")),
    ("NotASymlink", OSError, lambda ds: ds.readlink("file.txt")),
    ("SymlinkLoop", OSError, lambda ds: ds.read("loop_a")),
], ids=lambda value: value if isinstance(value, str) else "")
def test_reading_raises_the_exported_error(dataset, error, builtin, call):
    with pytest.raises(getattr(fanstore, error)) as raised:
        _read(dataset, call)
    assert type(raised.value) is getattr(fanstore, error)
    assert isinstance(raised.value, builtin) and isinstance(raised.value, fanstore.FanstoreError)


def test_a_missing_dataset_and_a_damaged_index(tmp_path):
    with pytest.raises(fanstore.DatasetNotFound) as missing:
        fanstore.open_dataset(tmp_path / "nowhere")
    assert isinstance(missing.value, FileNotFoundError)
    damaged = tmp_path / "damaged"
    (damaged / "chunks").mkdir(parents=True)
    (damaged / INDEX_NAME).write_bytes(b"not an index" * 100)
    with pytest.raises(fanstore.FormatError) as bad:
        fanstore.open_dataset(damaged)
    assert isinstance(bad.value, OSError)


def test_damaged_and_missing_chunks_raise_the_exported_errors(dataset, tmp_path):
    copy = tmp_path / "copy"
    (copy / "chunks").mkdir(parents=True)
    (copy / INDEX_NAME).write_bytes((dataset / INDEX_NAME).read_bytes())
    chunk = chunk_file_name(0)
    (copy / chunk).write_bytes((dataset / chunk).read_bytes())
    with fanstore.open_dataset(copy) as ds:
        entry = ds.index.lookup("file.txt")
        flip_byte(copy / chunk, int(ds.index.entries["offset"][entry]))
        with pytest.raises(fanstore.ChunkCorrupt) as corrupt:
            ds.read("file.txt")
    (copy / chunk).unlink()
    with fanstore.open_dataset(copy) as ds, pytest.raises(fanstore.ChunkUnavailable) as unavailable:
        ds.read("file.txt")
    for raised in (corrupt.value, unavailable.value):
        assert isinstance(raised, fanstore.ChunkError) and isinstance(raised, OSError)
        assert raised.path == "file.txt" and raised.chunk_id == 0


def test_packing_raises_the_exported_errors(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("data\n" * 1000)
    os.mkfifo(src / "pipe")
    with pytest.raises(fanstore.UsageError) as usage:
        fanstore.pack(src, tmp_path / "a", fanstore.PackOptions(codec="zstd:99"))
    assert isinstance(usage.value, ValueError)
    with pytest.raises(fanstore.PackError):
        fanstore.pack(src, tmp_path / "b", fanstore.PackOptions(strict=True, workers=1))
    with pytest.raises(fanstore.DoesNotFit) as does_not_fit:
        fanstore.pack(src, tmp_path / "c", fanstore.PackOptions(codec="auto", fit=1, workers=1))
    assert isinstance(does_not_fit.value, fanstore.UsageError)
    assert not any((tmp_path / name).exists() for name in "abc"), "a refused pack writes nothing"


@pytest.mark.parametrize("build, message", [
    (lambda: MountOptions(prefetch=-1), "--prefetch: must be 0 or more files, got -1"),
    (lambda: MountOptions(kernel_timeout=float("nan")), "--kernel-timeout: must be a finite number of seconds, 0 or "
                                                        "more, got nan"),
    (lambda: MountOptions(kernel_timeout=float("inf")), "--kernel-timeout: must be a finite number of seconds"),
    (lambda: MountOptions(cache_size=0), "--cache-size: must be 1 byte or more, got 0"),
    (lambda: MountOptions(decode_threads=-2), "MountOptions.decode_threads: must be 0 or more, got -2"),
    (lambda: MountOptions(prefetch_threads=-1), "--prefetch-threads: must be 0 or more, got -1"),
    (lambda: MountOptions(read_ahead_kib=-1), "MountOptions.read_ahead_kib: must be 0 or more, got -1"),
    (lambda: MountOptions(prefetch_min_size=-1), "--prefetch-min-size: must be 0 bytes or more, got -1"),
    (lambda: PeerOptions(retry_after=float("inf")), "--peer-retry: must be a number of seconds more than 0"),
    (lambda: PeerOptions(max_reply_bytes=0), "PeerOptions.max_reply_bytes: must be 1 or more bytes, got 0"),
    (lambda: PeerOptions(timeout=0), "--peer-timeout: must be a number of seconds more than 0 (and finite), got 0"),
    (lambda: PeerOptions(max_in_flight=0), "--max-in-flight: must be 1 or more requests, got 0"),
    (lambda: PeerOptions(lost_after=-1), "--peer-lost-after: must be 0 (half of TCP's give-up time) or more"),
    (lambda: PeerOptions(lost_after=float("inf")), "--peer-lost-after: must be 0 (half of TCP's give-up time) or more "
                                                   "seconds (and finite), got inf"),
    (lambda: _serve_options(mount=MountOptions(prefetch_threads=0)),
     "--prefetch-threads: must be 1 or more threads, got 0"),
    (lambda: PackOptions(chunk_size=100), "--chunk-size: 100 bytes is too small (at least 4 KiB)"),
    (lambda: PackOptions(workers=-1), "--workers: must be 0 (every core) to 1024, got -1"),
    (lambda: PackOptions(block_size=1), "--block-size: 1 bytes is not from"),
    (lambda: PackOptions(blocks_above=-1), "--blocks-above: must be 0 or more bytes, got -1"),
    (lambda: PackOptions(prefetch_threads=-1), "--prefetch-threads: must be 0 or more, got -1"),
    (lambda: PackOptions(budget=-1.0), "--budget: must be 0 or more bytes/s, got -1.0"),
])
def test_options_built_from_python_are_checked_as_the_command_lines_are(build, message):
    """Each options class checks its values where it is defined: one check, the CLI's and Python's."""
    with pytest.raises(UsageError) as caught:
        build()
    assert str(caught.value).startswith(message)


def _serve_options(**given) -> ServeOptions:
    return ServeOptions(dest=Path("ds"), mountpoint="mnt", local_dir="local", **given)


@pytest.mark.parametrize("build, command", [
    (lambda: MountOptions(prefetch=-1), ["mount", "ds", "mnt", "--prefetch", "-1"]),
    (lambda: PeerOptions(timeout=0.0), ["serve", "ds", "mnt", "--local-dir", "local", "--peer-timeout", "0"]),
    (lambda: _serve_options(mount=replace(SERVE_MOUNT, prefetch_threads=0)),
     ["serve", "ds", "mnt", "--local-dir", "local", "--prefetch-threads", "0"]),
    (lambda: PackOptions(chunk_size=100), ["fanstore-pack", "src", "ds", "--chunk-size", "100"]),
], ids=["MountOptions", "PeerOptions", "ServeOptions", "PackOptions"])
def test_a_bad_option_from_python_raises_the_line_the_command_line_prints(build, command):
    """One options class, one check: the CLI's error line is `PROG: error: ` and the very message Python gets."""
    with pytest.raises(UsageError) as caught:
        build()
    prog = "fanstore-pack" if command[0] == "fanstore-pack" else "fanstore"
    proc = run_cli(*command)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"{prog}: error: {caught.value}"]
