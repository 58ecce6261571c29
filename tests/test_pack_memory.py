"""The packer's metadata per member stays bounded (issue 35): what the walk and the plan hold of each member of a
tar of tiny files, and what checking the index holds beside the index's bytes at the pack's end, measured with
tracemalloc (bytes, not time). One object a member (a tuple, its path string, its key's int, list slots) held about
250 B; in columns it is the path's bytes and a few words."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

from fanstore.core.index_file import parse_index
from fanstore.pack.options import PackOptions
from fanstore.pack.packer import _walked, pack
from fanstore.pack.walk_archive import source_paths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_scale import write_tar  # noqa: E402

MEMBERS = 20_000
# 107 measured (2 * 10^4 members); with an archive member's ctime (always 0) a column in the walk and in the plan,
# 140; before the columns, about 250.
HELD_BYTES_PER_MEMBER = 120
# 142 measured: the full check's rounds compare paths a slice of entries at a time, beside views of the entries'
# fields; with every field transposed into arrays of its own, 255.
CHECK_PEAK_BYTES_PER_ENTRY = 170


def test_walk_and_plan_hold_at_most_120_bytes_a_member(tmp_path: Path) -> None:
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


def test_checking_the_index_holds_at_most_170_bytes_an_entry(tmp_path: Path) -> None:
    """A pack checks its index's bytes while it writes them (write_packed_index): the check's arrays stand beside
    the whole index, at the pack's last peak of memory."""
    tar, dest = tmp_path / "tiny.tar", tmp_path / "dest"
    write_tar(tar, MEMBERS, big_dir=MEMBERS // 2)
    pack(tar, dest, PackOptions(workers=1))
    index_bytes = (dest / "fanstore.index").read_bytes()
    tracemalloc.start()
    try:
        parse_index(dest / "fanstore.index", index_bytes, full_check=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / MEMBERS < CHECK_PEAK_BYTES_PER_ENTRY, f"{peak / MEMBERS:.0f} B an entry"

