"""Real file formats, read by their own libraries through the mount and through the API: clients that do not read
a file from start to end. zip seeks to the end for its central directory, then to each member; sqlite reads pages
where its B-trees lead; numpy maps an array; tar jumps from header to header; HDF5 follows its B-tree to chunks.
Each dataset is packed twice: every file stored whole, and the large ones stored in small blocks, so reads start
and end inside blocks and across their edges."""

from __future__ import annotations

import io
import os
import sqlite3
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from fanstore import PackOptions, open_dataset, pack
from fanstore.mount import fuse_mounted_at

ROWS = 20_000
BLOCK = 64 * 1024


def make_client_tree(src: Path) -> None:
    rng = np.random.default_rng(11)
    src.mkdir(parents=True)
    with sqlite3.connect(src / "table.sqlite") as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, label TEXT, value REAL)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?)",
                       ((i, f"label-{i % 97}-{'x' * (i % 40)}", float(v)) for i, v in enumerate(rng.random(ROWS))))
        db.execute("CREATE INDEX t_label ON t (label)")
    db.close()
    with zipfile.ZipFile(src / "archive.zip", "w") as archive:
        for i in range(40):
            data = rng.integers(0, 16 if i % 2 else 256, 3000 + 2500 * i, dtype=np.uint8).tobytes()
            archive.writestr(f"member{i:02d}.bin", data,
                             compress_type=zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED)
    np.save(src / "array.npy", rng.standard_normal((512, 700)).astype(np.float32))
    with tarfile.open(src / "bundle.tar", "w") as bundle:
        for i in range(30):
            data = rng.integers(0, 256, 1000 + 7919 * i, dtype=np.uint8).tobytes()
            info = tarfile.TarInfo(f"part{i:02d}.bin")
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    try:
        import h5py
    except ImportError:
        return
    with h5py.File(src / "data.h5", "w") as h5:
        h5.create_dataset("images", data=rng.integers(0, 255, (64, 32, 32, 3), dtype=np.uint8), chunks=(4, 32, 32, 3),
                          compression="gzip")
        h5.create_dataset("labels", data=np.arange(64, dtype=np.int64))
        h5["images"].attrs["source"] = "generated"


@pytest.fixture(scope="module", params=["whole", "blocks"])
def packed(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"clients-{request.param}")
    make_client_tree(root / "src")
    blocks_above = BLOCK if request.param == "blocks" else 1 << 30
    pack(root / "src", root / "ds", PackOptions(codec="zstd:3", chunk_size=256 * 1024, workers=1, block_size=BLOCK,
                                                blocks_above=blocks_above))
    with open_dataset(root / "ds") as ds:
        blocked = [path for path in ("table.sqlite", "archive.zip", "array.npy", "bundle.tar")
                   if ds.index.block_count(ds.resolve(path))]
    assert blocked == ([] if request.param == "whole" else ["table.sqlite", "archive.zip", "array.npy", "bundle.tar"])
    return root / "src", root / "ds"


@pytest.fixture(scope="module")
def mounted(packed):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")
    src, ds = packed
    mountpoint = ds.parent / "mnt"
    mountpoint.mkdir()
    run_cli("mount", str(ds), str(mountpoint), "--log", str(ds.parent / "mount.log"), check=True)
    try:
        yield src, mountpoint
    finally:
        if fuse_mounted_at(Path(os.path.realpath(mountpoint))):
            run_cli("umount", str(mountpoint), check=True)


def _rows(db: sqlite3.Connection) -> tuple:
    return (db.execute("PRAGMA integrity_check").fetchone()[0],
            db.execute("SELECT count(*), sum(value) FROM t").fetchone(),
            db.execute("SELECT id, value FROM t WHERE label = 'label-5-' ORDER BY id").fetchall(),
            db.execute("SELECT label FROM t WHERE id BETWEEN 12000 AND 12010").fetchall())


def test_sqlite_queries_through_the_mount(mounted):
    src, mountpoint = mounted
    with sqlite3.connect(src / "table.sqlite") as original:
        expected = _rows(original)
    original.close()
    db = sqlite3.connect(f"file:{mountpoint / 'table.sqlite'}?mode=ro&immutable=1", uri=True)
    try:
        assert _rows(db) == expected
        assert expected[0] == "ok" and expected[1][0] == ROWS
    finally:
        db.close()


def _zip_members(file) -> dict[str, bytes]:
    with zipfile.ZipFile(file) as archive:
        assert archive.testzip() is None
        return {name: archive.read(name) for name in reversed(archive.namelist())}  # back to front: seeks back


def test_zip_members_through_the_mount_and_the_api(mounted, packed):
    src, mountpoint = mounted
    expected = _zip_members(src / "archive.zip")
    assert _zip_members(mountpoint / "archive.zip") == expected
    with open_dataset(packed[1]) as ds, ds.open("archive.zip") as blob:
        assert _zip_members(io.BufferedReader(blob)) == expected


def test_tar_members_through_the_mount_and_the_api(mounted, packed):
    src, mountpoint = mounted

    def members(file) -> dict[str, bytes]:
        with tarfile.open(fileobj=file, mode="r:") as bundle:
            return {m.name: bundle.extractfile(m).read() for m in reversed(bundle.getmembers())}

    with open(src / "bundle.tar", "rb") as original:
        expected = members(original)
    with open(mountpoint / "bundle.tar", "rb") as through_mount:
        assert members(through_mount) == expected
    with open_dataset(packed[1]) as ds, ds.open("bundle.tar") as blob:
        assert members(io.BufferedReader(blob)) == expected


def test_a_mapped_array_through_the_mount(mounted):
    src, mountpoint = mounted
    expected = np.load(src / "array.npy")
    mapped = np.load(mountpoint / "array.npy", mmap_mode="r")
    assert np.array_equal(mapped[::37, 101:613], expected[::37, 101:613])  # scattered pages first
    assert np.array_equal(mapped, expected)
    del mapped


def test_hdf5_through_the_mount_and_the_api(mounted, packed):
    h5py = pytest.importorskip("h5py", reason="h5py is not installed (scripts/setup installs it with the test extra)")
    src, mountpoint = mounted

    def contents(file) -> tuple:
        with h5py.File(file, "r") as h5:
            images = h5["images"]
            return (images[::5, 3:29].tobytes(), images[:].tobytes(), h5["labels"][:].tolist(),
                    images.attrs["source"])

    expected = contents(src / "data.h5")
    assert contents(mountpoint / "data.h5") == expected
    with open_dataset(packed[1]) as ds, ds.open("data.h5") as blob:
        assert contents(io.BufferedReader(blob)) == expected
