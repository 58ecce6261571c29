"""Real file formats, read by their own libraries through the mount and through the API: clients that do not read
a file from start to end (tests/client_files.py). Each dataset is packed twice: every file stored whole, and the
large ones stored in small blocks, so reads start and end inside blocks and across their edges."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from client_files import BLOCK, ROWS, hdf5_contents, mapped_array_contents, pack_client_tree, sqlite_contents, \
    tar_contents, zip_contents
from conftest import run_cli
from fanstore import open_dataset
from fanstore.mount.mount import fuse_mounted_at


@pytest.fixture(scope="module", params=["whole", "blocks"])
def packed(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"clients-{request.param}")
    pack_client_tree(root, request.param)
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


def test_sqlite_queries_through_the_mount(mounted):
    src, mountpoint = mounted
    expected = sqlite_contents(src / "table.sqlite")
    assert expected[0] == "ok" and expected[1][0] == ROWS
    assert sqlite_contents(mountpoint / "table.sqlite") == expected


def test_zip_members_through_the_mount_and_the_api(mounted, packed):
    src, mountpoint = mounted
    expected = zip_contents(src / "archive.zip")
    assert zip_contents(mountpoint / "archive.zip") == expected
    with open_dataset(packed[1]) as ds, ds.open("archive.zip") as blob:
        assert zip_contents(io.BufferedReader(blob)) == expected


def test_tar_members_through_the_mount_and_the_api(mounted, packed):
    src, mountpoint = mounted
    with open(src / "bundle.tar", "rb") as original:
        expected = tar_contents(original)
    with open(mountpoint / "bundle.tar", "rb") as through_mount:
        assert tar_contents(through_mount) == expected
    with open_dataset(packed[1]) as ds, ds.open("bundle.tar") as blob:
        assert tar_contents(io.BufferedReader(blob)) == expected


def test_a_mapped_array_through_the_mount(mounted):
    src, mountpoint = mounted
    expected = mapped_array_contents(src / "array.npy")
    assert np.frombuffer(expected[1], np.float32).size == 512 * 700
    assert mapped_array_contents(mountpoint / "array.npy") == expected


def test_hdf5_through_the_mount_and_the_api(mounted, packed):
    pytest.importorskip("h5py", reason="h5py is not installed (scripts/setup installs it with the test extra)")
    src, mountpoint = mounted
    expected = hdf5_contents(src / "data.h5")
    assert hdf5_contents(mountpoint / "data.h5") == expected
    with open_dataset(packed[1]) as ds, ds.open("data.h5") as blob:
        assert hdf5_contents(io.BufferedReader(blob)) == expected
