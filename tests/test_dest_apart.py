"""Paths other commands write to never overlap DEST (fanstore/core/dest_apart.py): real directories, links and a bind
mount. The refusals through the real commands run in tests/test_serve.py and tests/test_mount.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fanstore.core.dest_apart import check_apart_from_dest, overlap
from fanstore.errors import UsageError

WHY = "fanstore writes there, and only a pack may write into a dataset; choose a path apart from DEST"


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    (tmp_path / "ds" / "chunks").mkdir(parents=True)
    (tmp_path / "ds" / "fanstore.index").write_bytes(b"index")
    return tmp_path / "ds"


@pytest.mark.parametrize("path", ["ds2", "ds2/local0", "elsewhere/local0", "ready", "ds.ready"])
def test_paths_apart_from_dest_pass(tmp_path, dest, path):
    (tmp_path / "ds2").mkdir()  # a name that starts like DEST's is not inside it
    check_apart_from_dest(dest, {"--local-dir": tmp_path / path})


@pytest.mark.parametrize("path, said", [
    ("ds", "--local-dir {tmp}/ds is DEST {tmp}/ds"),
    ("ds/", "--local-dir {tmp}/ds is DEST {tmp}/ds"),
    ("ds/local0", "--local-dir {tmp}/ds/local0 lies inside DEST {tmp}/ds"),  # not made yet
    ("ds/chunks", "--local-dir {tmp}/ds/chunks lies inside DEST {tmp}/ds"),
    ("ds/not/yet/made", "--local-dir {tmp}/ds/not/yet/made lies inside DEST {tmp}/ds"),
    ("ds/../ds/local0", "--local-dir {tmp}/ds/../ds/local0 lies inside DEST {tmp}/ds"),
    ("link/local0", "--local-dir {tmp}/link/local0 (links followed: {tmp}/ds/local0) lies inside DEST {tmp}/ds"),
    ("", "DEST {tmp}/ds lies inside --local-dir {tmp}"),
])
def test_paths_overlapping_dest_are_one_line_naming_both(tmp_path, dest, path, said):
    (tmp_path / "link").symlink_to(dest)
    given = Path(f"{tmp_path}/{path}") if path else tmp_path
    with pytest.raises(UsageError) as refused:
        check_apart_from_dest(dest, {"--local-dir": given})
    message = str(refused.value)
    assert said.format(tmp=tmp_path) in message and message.endswith(WHY) and "\n" not in message, message


def test_dest_given_through_a_link_is_the_directory_it_names(tmp_path, dest):
    (tmp_path / "link").symlink_to(dest)
    with pytest.raises(UsageError, match=rf"^--ready-file {dest}/fanstore.index lies inside DEST {tmp_path}/link: "):
        check_apart_from_dest(tmp_path / "link", {"--ready-file": dest / "fanstore.index"})


def test_dest_inside_a_directory_held_through_a_link(tmp_path, dest):
    (tmp_path / "outer").mkdir()
    nested = tmp_path / "outer" / "ds"
    dest.rename(nested)
    (tmp_path / "to_outer").symlink_to(tmp_path / "outer")
    with pytest.raises(UsageError, match=rf"^DEST {nested} lies inside --local-dir {tmp_path}/to_outer \(links "
                                         rf"followed: {tmp_path}/outer\): "):
        check_apart_from_dest(nested, {"--local-dir": tmp_path / "to_outer"})


def test_a_bind_mount_of_dest_is_dest(tmp_path, dest):
    """No link to follow: the same directory under another path, told by its device and inode."""
    bind = tmp_path / "bind"
    bind.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(dest), str(bind)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount (needs root): {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(UsageError, match=rf"^--local-dir {bind}/local0 lies inside DEST {dest}: "):
            check_apart_from_dest(dest, {"--local-dir": bind / "local0"})
        with pytest.raises(UsageError, match=rf"^--log {bind}/fanstore.index lies inside DEST {dest}: "):
            check_apart_from_dest(dest, {"--log": bind / "fanstore.index"})
    finally:
        subprocess.run(["umount", str(bind)], check=True)


def test_each_path_is_checked_and_the_first_overlapping_named(tmp_path, dest):
    with pytest.raises(UsageError, match=r"^--ready-file "):
        check_apart_from_dest(dest, {"--local-dir": tmp_path / "local", "--ready-file": dest / "ready"})


def test_a_dest_that_is_no_dataset_is_left_to_the_command(tmp_path):
    """`fanstore mount DIR MP` with DIR not a dataset says so (its own message), whatever the log's path."""
    check_apart_from_dest(tmp_path, {"--log": tmp_path / "mount.log"})
    check_apart_from_dest(tmp_path / "absent", {"--log": tmp_path / "absent" / "mount.log"})


def test_overlap_as_written_counts_the_path_spelled_too(tmp_path):
    """A mount at TOP hides TOP/link/file from a process that opens it so, though the link leads elsewhere; a
    writer that follows the link writes elsewhere. Names tell first; an `other` not looked up is judged by name."""
    (tmp_path / "top").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "top" / "link").symlink_to(tmp_path / "elsewhere")
    through = tmp_path / "top" / "link" / "file"
    assert overlap(through, tmp_path / "top", as_written=True) == "inside"
    assert overlap(through, tmp_path / "top") is None
    assert overlap(through, tmp_path / "elsewhere") == "inside"
    assert overlap(tmp_path / "top" / "link", tmp_path / "elsewhere") == "is"
    assert overlap(tmp_path, tmp_path / "top") == "holds"
    assert overlap(tmp_path / "top", tmp_path / "elsewhere", as_written=True, look_at_other=False) is None
