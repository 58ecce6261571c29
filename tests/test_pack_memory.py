"""The packer's metadata per member stays bounded (issue 35): what the walk and the plan hold of each member of a
tar of tiny files, measured with tracemalloc (bytes, not time). One object a member (a tuple, its path string, its
key's int, list slots) held about 250 B; in columns it is the path's bytes and a few words."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

from fanstore.pack.options import PackOptions
from fanstore.pack.packer import _walked
from fanstore.pack.walk_archive import source_paths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_scale import write_tar  # noqa: E402

MEMBERS = 20_000
HELD_BYTES_PER_MEMBER = 200  # 140 measured (10^5 members); before the columns, about 250


def test_walk_and_plan_hold_at_most_200_bytes_a_member(tmp_path: Path) -> None:
    tar = tmp_path / "tiny.tar"
    write_tar(tar, MEMBERS, big_dir=MEMBERS // 2)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run = _walked(source_paths(tar), tmp_path / "dest", PackOptions(workers=1), None, None)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(run.files) == MEMBERS
    assert held / MEMBERS < HELD_BYTES_PER_MEMBER, f"{held / MEMBERS:.0f} B a member"
