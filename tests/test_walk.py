"""The walk: the same tree and the same problems, whether one process walks SRC or worker processes share it."""

from __future__ import annotations

import multiprocessing
import os
import socket
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fanstore.pack.walk import walk_source


def _awkward_tree(root: Path) -> Path:
    """Wide and deep enough that the parallel walk hands subtrees to workers, with every kind of problem in them."""
    for top in range(3):
        for sub in range(40):
            folder = root / f"top{top}" / f"sub{sub:02d}"
            folder.mkdir(parents=True)
            (folder / "a.bin").write_bytes(bytes([top, sub]) * 10)
            (folder / "a.bin.txt").write_text("sorted by bytes: 'a.bin' < 'a.bin.txt' < 'a.bin/...'")
            if sub % 7 == 0:
                (folder / "deeper" / "still").mkdir(parents=True)
                (folder / "deeper" / "still" / "leaf").write_text("leaf")
                (folder / "empty").mkdir()
    odd = root / "top1" / "sub05"
    os.mkfifo(odd / "fifo")
    (odd / "inside").symlink_to("a.bin")
    (odd / "outside").symlink_to("/etc/hostname")
    (root / "top2" / "sub39" / os.fsdecode(b"bad\xffname")).write_text("not UTF-8")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "top0" / "sub11" / "sock"))
    (root / "top0" / "sub00" / "ünïcode ✓.txt").write_text("fine")
    return root


def test_parallel_walk_finds_what_a_serial_walk_finds(tmp_path):
    src = _awkward_tree(tmp_path / "src")
    serial = walk_source(src)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver")) as executor:
        parallel = walk_source(src, executor)
    assert parallel.entries == serial.entries
    assert parallel.problems == serial.problems
    assert [e.path.encode() for e in serial.entries] == sorted(e.path.encode() for e in serial.entries)
    reasons = " | ".join(str(p) for p in serial.problems)
    for needle in ("fifo", "leaves SRC", "not valid UTF-8", "socket"):
        assert needle in reasons
    assert len(serial.files) == 3 * 40 * 2 + 18 + 1  # a.bin and a.bin.txt in each sub, the leaves, the ü file
