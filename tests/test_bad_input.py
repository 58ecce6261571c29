"""Every bad input gets one clear line naming the path or option, never a traceback, and loses nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_one_line_error, dir_bytes, make_tree, mounted, run_cli
from fanstore import PackError, PackOptions, UsageError, open_dataset, pack
from fanstore.errors import quoted
from fanstore.pack.walk import walk_source

IS_ROOT = os.geteuid() == 0


def test_missing_src(tmp_path):
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "nope"), str(tmp_path / "ds")), "nope",
                          "does not exist")


def test_src_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "file"), str(tmp_path / "ds")), "not a directory")


def test_dest_inside_src(source_tree):
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(source_tree / "ds")), "inside SRC")


def test_dest_inside_src_through_a_bind_mount_or_a_link(source_tree, tmp_path):
    """SRC reached by another path: DEST under a bind mount of SRC was written into SRC (and the next run saw its
    own chunks as changed source files); a link to SRC alike. Both are refused, and nothing is written."""
    linked = tmp_path / "linked"
    linked.symlink_to(source_tree)
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(linked / "ds")), "inside SRC")
    bound = tmp_path / "bound"
    bound.mkdir()
    with mounted(bound, "--bind", str(source_tree), purpose="bind-mount SRC"):
        assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(bound / "ds")), "inside SRC")
        assert_one_line_error(run_cli("fanstore-pack", str(bound / "train"), str(source_tree)), "inside DEST")
        assert not (source_tree / "ds").exists()


def test_dest_holding_another_dataset_needs_force(source_tree, tmp_path):
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    before = dir_bytes(dest)
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("another dataset")
    assert_one_line_error(run_cli("fanstore-pack", str(other), str(dest)), str(dest), "--force")
    assert dir_bytes(dest) == before, "a refused pack must not touch DEST"
    run_cli("fanstore-pack", str(other), str(dest), "--force", "--quiet", check=True)
    with open_dataset(dest) as ds:
        assert ds.listdir("") == ["a.txt"]


def _files_as_they_are(root: Path) -> dict[str, tuple[bytes, int]]:
    """Each file's bytes and mtime: what a run that does nothing leaves exactly as it was."""
    return {name: (data, (root / name).stat().st_mtime_ns) for name, data in dir_bytes(root).items()}


def test_a_finished_pack_run_again_has_nothing_to_do(source_tree, tmp_path):
    """README: run the same command again. Once the pack has finished, with SRC as it was, that is exit 0 and one
    line saying so, DEST untouched; options that do not change the output (--workers) make no difference."""
    dest = tmp_path / "ds"
    arguments = [str(source_tree), str(dest), "--codec", "lz4", "--replicate", "val/**", "--quiet"]
    first = run_cli("fanstore-pack", *arguments, "--workers", "2", check=True)
    assert "packed" in first.stdout
    before = _files_as_they_are(dest)
    for workers in ("2", "1"):
        again = run_cli("fanstore-pack", *arguments, "--workers", workers, check=True)
        assert again.stdout.startswith(f"nothing to do: {dest} already holds this pack of {source_tree}"), again.stdout
        assert len(again.stdout.splitlines()) == 1 and "error" not in again.stderr, again.stderr
        assert _files_as_they_are(dest) == before
    summary = pack(source_tree, dest, PackOptions(codec="lz4", replicate=("val/**",), workers=1))
    assert summary.up_to_date
    with open_dataset(dest) as ds:
        assert (summary.files, summary.chunks) == (ds.index.file_count, len(ds.index.chunks))
    assert _files_as_they_are(dest) == before


@pytest.mark.parametrize("change", ["other options", "a file rewritten", "a file added"])
def test_a_finished_pack_of_other_files_or_options_is_still_refused(source_tree, tmp_path, change):
    dest = tmp_path / "ds"
    arguments = [str(source_tree), str(dest), "--codec", "lz4", "--workers", "1", "--quiet"]
    run_cli("fanstore-pack", *arguments, check=True)
    before = _files_as_they_are(dest)
    if change == "other options":
        arguments[3] = "zstd:3"
    elif change == "a file rewritten":
        (source_tree / "labels.txt").write_text("other labels\n")
    else:
        (source_tree / "new.txt").write_text("new\n")
    refused = run_cli("fanstore-pack", *arguments)
    assert_one_line_error(refused, f"DEST {quoted(str(dest))} already holds a fanstore dataset", "--force")
    assert _files_as_they_are(dest) == before, "a refused pack must not touch DEST"
    forced = run_cli("fanstore-pack", *arguments, "--force", check=True)
    assert "packed" in forced.stdout


def test_a_finished_pack_missing_a_chunk_file_is_refused_naming_it(source_tree, tmp_path):
    dest = tmp_path / "ds"
    arguments = [str(source_tree), str(dest), "--chunk-size", "64KiB", "--workers", "1", "--quiet"]
    run_cli("fanstore-pack", *arguments, check=True)
    (dest / "chunks" / "00000001.fsc").unlink()
    refused = run_cli("fanstore-pack", *arguments)
    assert_one_line_error(refused, "holds this pack, but a chunk file is missing or damaged", "00000001.fsc",
                          "--force")
    run_cli("fanstore-pack", *arguments, "--force", check=True)
    assert run_cli("fanstore-pack", *arguments, check=True).stdout.startswith("nothing to do")


def test_packs_of_a_copy_of_src_are_byte_identical(source_tree, tmp_path):
    """The index records the listing's digest without ctimes (a copy's are new), so a copy that keeps mtimes and
    modes packs to the same bytes, and a run over the copy's DEST with the original finds it finished."""
    copy = tmp_path / "copy"
    shutil.copytree(source_tree, copy, symlinks=True)
    pack(source_tree, tmp_path / "ds1", PackOptions(workers=1))
    pack(copy, tmp_path / "ds2", PackOptions(workers=1))
    assert dir_bytes(tmp_path / "ds1") == dir_bytes(tmp_path / "ds2")
    assert pack(source_tree, tmp_path / "ds2", PackOptions(workers=1)).up_to_date


def test_dest_with_unrelated_files_is_refused_even_with_force(source_tree, tmp_path):
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "thesis.tex").write_text("precious")
    for extra in ([], ["--force"]):
        assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(dest), *extra), "thesis.tex",
                              "did not write")
    assert (dest / "thesis.tex").read_text() == "precious"


def _user_files_under_fanstore_names(dest: Path, elsewhere: Path) -> None:
    """Things a user might keep under the names fanstore uses, none of them written by fanstore."""
    if "chunks_link" in dest.name:
        elsewhere.mkdir()
        (elsewhere / "00000000.fsc").write_bytes(b"FANSTCHK" + b"\0" * 40)  # looks like ours, lies elsewhere
        os.symlink(elsewhere, dest / "chunks")
    elif "chunks_dir" in dest.name:
        (dest / "chunks").mkdir()
        (dest / "chunks" / "notes.txt").write_text("my notes")
    elif "index_text" in dest.name:
        (dest / "fanstore.index").write_text("my own index of papers")
    elif "chunk_named" in dest.name:
        (dest / "chunks").mkdir()
        (dest / "chunks" / "00000000.fsc").write_text("not a chunk at all")
    elif "journal" in dest.name:
        (dest / ".fanstore-pack").mkdir()
        (dest / ".fanstore-pack" / "state.json").write_text('{"mine": true}')


@pytest.mark.parametrize("case", ["chunks_link", "chunks_dir", "index_text", "chunk_named", "journal"])
def test_user_files_under_fanstore_names_are_never_deleted(source_tree, tmp_path, case):
    """A name fanstore never writes is 'not written by fanstore'; a file under one of its names but not in its
    format may be a pack's damaged file, and is called so (nothing is deleted either way)."""
    dest = tmp_path / case
    dest.mkdir()
    _user_files_under_fanstore_names(dest, tmp_path / "elsewhere")
    before = {p: p.read_bytes() for p in [*dest.rglob("*"), *(tmp_path / "elsewhere").rglob("*")] if p.is_file()}
    said = "not in their format" if case in ("index_text", "chunk_named", "journal") else "did not write"
    for extra in ([], ["--force"]):
        assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", *extra), said)
    assert {p: p.read_bytes() for p in before} == before


def test_a_damaged_chunk_file_is_not_called_foreign(source_tree, tmp_path):
    """A pack's own chunk file whose start was overwritten: --force refuses to delete it (fanstore cannot tell it is
    its own), and says it may be a damaged file of a pack, naming it, rather than that fanstore never wrote it."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--workers", "1", check=True)
    chunk = sorted((dest / "chunks").iterdir())[0]
    with open(chunk, "r+b") as file:
        file.write(b"\0garbage")
    before = dir_bytes(dest)
    refused = run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--force")
    assert_one_line_error(refused, chunk.name, "a damaged file of a pack", "remove or move it yourself")
    assert "did not write" not in refused.stderr
    assert dir_bytes(dest) == before


def test_src_inside_dest_is_refused_even_with_force(tmp_path):
    """`fanstore-pack t/chunks t`: writing t/chunks would destroy the source."""
    top = tmp_path / "t"
    make_tree(top / "chunks")
    before = dir_bytes(top)
    for extra in ([], ["--force"]):
        assert_one_line_error(run_cli("fanstore-pack", str(top / "chunks"), str(top), *extra), "SRC",
                              "inside DEST")
    assert dir_bytes(top) == before


def test_a_src_that_is_a_mount_of_the_dataset_in_dest_is_refused(source_tree, tmp_path):
    """`fanstore-pack MP DEST --force`, MP a mount of DEST (to repack it with another codec): the pack removed the
    chunks the mount was reading, and files past the chunks the daemon held open were lost with the dataset. It is
    refused in one line, with or without --force, from the mount's root or a directory in it; DEST is untouched."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    pytest.importorskip("pyfuse3", reason="pyfuse3 is not installed (needs libfuse3-dev to build)")
    dest, mountpoint = tmp_path / "ds", tmp_path / "mnt"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    before = dir_bytes(dest)
    mountpoint.mkdir()
    run_cli("mount", str(dest), str(mountpoint), "--log", str(tmp_path / "mount.log"), check=True)
    try:
        for src, extra in ((mountpoint, ["--force", "--codec", "lz4"]), (mountpoint / "train", []),
                           (mountpoint, [])):
            assert_one_line_error(run_cli("fanstore-pack", str(src), str(dest), "--quiet", *extra),
                                  f"SRC {quoted(str(src))} is a fanstore mount of the dataset in DEST")
        run_cli("fanstore-pack", str(mountpoint), str(tmp_path / "copy"), "--quiet", check=True)
    finally:
        run_cli("umount", str(mountpoint), check=True)
    assert dir_bytes(dest) == before
    with open_dataset(tmp_path / "copy") as ds:
        assert ds.read("labels.txt") == (source_tree / "labels.txt").read_bytes()


def test_leftovers_of_a_pack_killed_at_its_start_are_cleared(source_tree, tmp_path):
    """An empty chunks/ and the journal's dictionaries, all fanstore's own: cleared without --force."""
    dest = tmp_path / "ds"
    (dest / "chunks").mkdir(parents=True)
    (dest / ".fanstore-pack").mkdir()
    (dest / ".fanstore-pack" / "dict.0.zdict").write_bytes(b"\x37\xa4\x30\xec" + b"x" * 100)
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    with open_dataset(dest) as ds:
        assert ds.read("labels.txt") == (source_tree / "labels.txt").read_bytes()


def test_chunk_files_without_index_or_journal_are_replaced_only_with_force(source_tree, tmp_path):
    run_cli("fanstore-pack", str(source_tree), str(tmp_path / "first"), "--quiet", check=True)
    dest = tmp_path / "copy"
    (dest / "chunks").mkdir(parents=True)
    for chunk in (tmp_path / "first" / "chunks").iterdir():
        shutil.copy(chunk, dest / "chunks" / chunk.name)  # fanstore's chunks, copied without their index
    before = dir_bytes(dest)
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(dest)), "chunk files", "--force")
    assert dir_bytes(dest) == before
    run_cli("fanstore-pack", str(source_tree), str(dest), "--force", "--quiet", check=True)
    assert dir_bytes(dest) == dir_bytes(tmp_path / "first")


def test_a_journal_of_another_version_is_refused_then_replaced_with_force(source_tree, tmp_path):
    dest = tmp_path / "ds"
    (dest / "chunks").mkdir(parents=True)
    (dest / ".fanstore-pack").mkdir()
    (dest / ".fanstore-pack" / "state.json").write_text('{"journal_version": 1, "fingerprint": "x"}')
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(dest)), "journal version 1", "--force")
    run_cli("fanstore-pack", str(source_tree), str(dest), "--force", "--quiet", check=True)


@pytest.mark.parametrize(
    "option, value, needle",
    [("--chunk-size", "lots", "--chunk-size"), ("--chunk-size", "1K", "--chunk-size"),
     # 0 said it "must be at least 1 byte" where 1K said at least 4 KiB: each size names its own bound
     ("--chunk-size", "0", "--chunk-size: 0 bytes is too small (at least 4 KiB)"),
     ("--block-size", "0", "--block-size: 0 bytes is not from 4096 to"),
     ("--codec", "zstd:99", "--codec"), ("--codec", "gzip", "--codec"), ("--workers", "-2", "--workers"),
     ("--workers", "1025", "--workers"), ("--workers", "99999999999", "0 (every core) to 1024"),
     ("--replicate", "val/[abc", "--replicate")],
)
def test_bad_options(source_tree, tmp_path, option, value, needle):
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), option, value), needle)
    assert not (tmp_path / "ds" / "fanstore.index").exists()


def _special_files(src: Path) -> None:
    os.mkfifo(src / "a_fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "a_socket"))
    sock.close()
    if IS_ROOT:
        os.mknod(src / "a_device", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    outside = src.parent / "outside.txt"
    outside.write_text("not in SRC")
    os.symlink(outside, src / "escapes")
    os.symlink("../outside.txt", src / "escapes_relative")
    os.symlink(str(src / "labels.txt"), src / "absolute_inside")
    bad_name = os.fsencode(src) + b"/bad_\xff_name.txt"
    with open(bad_name, "wb") as f:
        f.write(b"latin-1 name")


def test_special_files_and_escaping_links_are_skipped_with_warnings(source_tree, tmp_path):
    _special_files(source_tree)
    proc = run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: skipped")]
    expected = {"a_fifo": "fifo", "a_socket": "socket", "escapes": "leaves SRC", "escapes_relative": "leaves SRC",
                "bad_\\xff_name.txt": "UTF-8"}
    if IS_ROOT:
        expected["a_device"] = "device"
    assert len(warnings) == len(expected), proc.stderr
    for name, reason in expected.items():
        assert any(f" {name}: " in w and reason in w for w in warnings), (name, warnings)
    assert f"{len(expected)} skipped" in proc.stdout
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.readlink("absolute_inside") == "labels.txt"
        assert ds.read("absolute_inside") == (source_tree / "labels.txt").read_bytes()
        assert len(ds.index.meta["pack"]["skipped"]) == len(expected)
    strict = run_cli("fanstore-pack", str(source_tree), str(tmp_path / "strict"), "--strict")
    assert_one_line_error(strict, "--strict")
    assert not (tmp_path / "strict" / "fanstore.index").exists()


def _unprivileged(cmd: list[str]) -> list[str]:
    """Root reads any file; drop the capabilities that let it, so a mode-000 file is really unreadable."""
    if not IS_ROOT:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): cannot make a file unreadable to the pack")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]


def test_unreadable_file_is_skipped_and_counted(source_tree, tmp_path):
    secret = source_tree / "train" / "cat" / "img_001.png"
    secret.chmod(0)
    locked_dir = source_tree / "locked"
    locked_dir.mkdir()
    (locked_dir / "inside.txt").write_text("cannot be listed")
    locked_dir.chmod(0)
    try:
        import sys
        from conftest import REPO

        code = "import sys; from fanstore.cli import pack_main; sys.exit(pack_main())"
        proc = subprocess.run(_unprivileged([sys.executable, "-c", code, str(source_tree), str(tmp_path / "ds"),
                                             "--quiet"]),
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        secret.chmod(0o644)
        locked_dir.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipped train/cat/img_001.png: cannot read: Permission denied" in proc.stderr
    assert "warning: skipped locked: cannot list directory: Permission denied" in proc.stderr
    assert "2 skipped" in proc.stdout
    with open_dataset(tmp_path / "ds") as ds:
        assert "img_001.png" not in ds.listdir("train/cat")
        assert ds.read("train/cat/img_003.png") == (source_tree / "train/cat/img_003.png").read_bytes()


def test_files_that_vanish_or_change_size_during_the_pack(source_tree, tmp_path):
    tree = walk_source(source_tree)
    (source_tree / "labels.txt").unlink()
    with open(source_tree / "field.npy", "ab") as f:
        f.write(b"grown")
    summary = pack(source_tree, tmp_path / "ds", PackOptions(workers=2), tree=tree)
    reasons = {p.path: p.reason for p in summary.problems}
    assert reasons == {"labels.txt": "vanished during the pack",
                       "field.npy": reasons["field.npy"]}
    assert "changed size during the pack" in reasons["field.npy"]
    with open_dataset(tmp_path / "ds") as ds:
        assert "labels.txt" not in ds.listdir("") and "field.npy" not in ds.listdir("")
        assert ds.read("random.bin") == (source_tree / "random.bin").read_bytes()
    with pytest.raises(PackError, match="--strict: field.npy: changed size"):
        pack(source_tree, tmp_path / "strict", PackOptions(workers=1, strict=True), tree=tree)


def test_files_whose_size_is_not_what_they_read_are_skipped_by_name(tmp_path):
    """A /proc file says 0 bytes and reads more; a /sys file says 4096 and reads fewer. Bound into SRC, the first
    was packed empty without a word, the second skipped as 'changed size during the pack'. Both are skipped now,
    each named with what it says and what it reads; the rest packs."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "kept.txt").write_text("kept")
    (src / "empty").touch()
    proc_file, sys_file = src / "proc_version", src / "cpus_online"
    proc_file.touch()
    sys_file.touch()
    if not os.path.exists("/sys/devices/system/cpu/online"):
        pytest.skip("/sys/devices/system/cpu/online is missing: no /sys file to bind into SRC")
    with mounted(proc_file, "--bind", "/proc/version", purpose="bind a /proc file into SRC"), \
            mounted(sys_file, "--bind", "/sys/devices/system/cpu/online", purpose="bind a /sys file into SRC"):
        assert os.stat(proc_file).st_size == 0 and os.stat(sys_file).st_size == 4096
        done = run_cli("fanstore-pack", str(src), str(tmp_path / "ds"), "--quiet")
        strict = run_cli("fanstore-pack", str(src), str(tmp_path / "strict"), "--quiet", "--strict")
    assert done.returncode == 0, done.stderr
    assert "warning: skipped proc_version: reads past the 0 bytes its size says (a /proc or /sys file?)" \
        in done.stderr
    assert "warning: skipped cpus_online: reads " in done.stderr
    assert "bytes where its size says 4096 (a /proc or /sys file?)" in done.stderr
    assert "2 skipped" in done.stdout and "Traceback" not in done.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert sorted(ds.listdir("")) == ["empty", "kept.txt"]
        assert ds.read("kept.txt") == b"kept" and ds.read("empty") == b""
    assert_one_line_error(strict, "--strict: proc_version: reads past the 0 bytes its size says")


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path` that fills up, unmounted afterwards whatever happens."""
    if not IS_ROOT:
        pytest.skip("needs root to mount a small tmpfs that can fill up")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)  # -l: even if a failed test left it busy


SMALL_PACK = ["--codec", "lz4", "--chunk-size", "64KiB", "--workers", "1", "--quiet"]


def test_disk_full_stops_cleanly_and_resumes(tmp_path):
    src = make_tree(tmp_path / "src")
    (src / "more.bin").write_bytes(os.urandom(600_000))
    run_cli("fanstore-pack", str(src), str(tmp_path / "reference"), *SMALL_PACK, check=True)
    with small_disk(tmp_path / "small", "400k") as small:
        full = run_cli("fanstore-pack", str(src), str(small / "ds"), *SMALL_PACK)
        assert_one_line_error(full, "disk full", "resume")
        assert not (small / "ds" / "fanstore.index").exists()
        assert not list((small / "ds" / "chunks").glob("*.partial"))
        subprocess.run(["mount", "-o", "remount,size=8m", str(small)], check=True)
        resumed = run_cli("fanstore-pack", str(src), str(small / "ds"), *SMALL_PACK, check=True)
        assert "chunks kept from the interrupted run" in resumed.stdout
        assert dir_bytes(small / "ds") == dir_bytes(tmp_path / "reference")


def fill(filler: Path) -> None:
    """Write `filler` until its file system is full."""
    with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\1" * 4096)


def test_disk_full_while_writing_the_index_names_the_index(tmp_path, paused_pack):
    """The pack pauses once every chunk is written; the disk is then filled, so only the index can hit ENOSPC."""
    src = make_tree(tmp_path / "src")
    run_cli("fanstore-pack", str(src), str(tmp_path / "reference"), *SMALL_PACK, check=True)
    with small_disk(tmp_path / "small", "2m") as small:
        paused = paused_pack(src, small / "ds", SMALL_PACK, "index")
        fill(small / "filler")
        full = paused.resume()
        assert_one_line_error(full, "disk full", "fanstore.index.partial", "resume")
        assert not (small / "ds" / "fanstore.index").exists()
        (small / "filler").unlink()
        resumed = run_cli("fanstore-pack", str(src), str(small / "ds"), *SMALL_PACK, check=True)
        assert "chunks kept from the interrupted run" in resumed.stdout
        assert dir_bytes(small / "ds") == dir_bytes(tmp_path / "reference")


@pytest.mark.parametrize("codec", ["zstd-dict:3", "lz4"])
def test_disk_full_while_starting_the_journal_is_one_line_and_resumes(tmp_path, paused_pack, codec):
    """The journal's state and a zstd-dict pack's dictionaries are written before any chunk, outside the chunk
    step's error handling: a full disk there ended in a traceback of OSError."""
    src = make_tree(tmp_path / "src")
    args = [*SMALL_PACK[:1], codec, *SMALL_PACK[2:]]
    run_cli("fanstore-pack", str(src), str(tmp_path / "reference"), *args, check=True)
    with small_disk(tmp_path / "small", "2m") as small:
        paused = paused_pack(src, small / "ds", args, "walked")
        fill(small / "filler")
        assert_one_line_error(paused.resume(), "disk full", f"{small}/ds/.fanstore-pack/", "resume")
        (small / "filler").unlink()
        run_cli("fanstore-pack", str(src), str(small / "ds"), *args, check=True)
        assert dir_bytes(small / "ds") == dir_bytes(tmp_path / "reference")


def test_missing_dataset_for_verify_and_info(tmp_path):
    (tmp_path / "plain.txt").write_text("not a dataset")
    (tmp_path / "index_is_dir" / "fanstore.index").mkdir(parents=True)
    (tmp_path / "index_is_fifo").mkdir()
    os.mkfifo(tmp_path / "index_is_fifo" / "fanstore.index")
    for command in ("verify", "info"):
        assert_one_line_error(run_cli(command, str(tmp_path / "absent")), "absent")
        assert_one_line_error(run_cli(command, str(tmp_path)), "not a fanstore dataset")
        assert_one_line_error(run_cli(command, str(tmp_path / "plain.txt")), "plain.txt", "is a file")
        assert_one_line_error(run_cli(command, str(tmp_path / "index_is_dir")), "fanstore.index", "not a regular")
        # a fifo must be refused, not read: the read would block until a writer came
        assert_one_line_error(run_cli(command, str(tmp_path / "index_is_fifo"), timeout=30), "not a regular")


@pytest.mark.parametrize("pattern", ["[z-a]", "val/[b-a]/**", "[!z-a]", "[a-\\]", "[", "[]", "**[", "[!]", "a[b"])
def test_bad_replicate_patterns_are_one_line(source_tree, tmp_path, pattern):
    """A glob that cannot be translated, or whose translation does not compile, names --replicate and itself."""
    packed = run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), "--quiet", "--replicate", pattern)
    assert_one_line_error(packed, "--replicate", repr(pattern))
    assert not (tmp_path / "ds").exists()
    selected = run_cli("select", str(source_tree), "--budget", "100MB/s", "--replicate", pattern)
    assert_one_line_error(selected, "--replicate", repr(pattern))


def test_replicate_sets_read_as_globs():
    """`]` first in a set is a member, `!` negates, and regex-only set syntax (`^`, `[`, `&&`) is literal."""
    import warnings

    from fanstore.pack.groups import glob_to_regex

    cases = {"[]]": ("]", "a"), "[!]]": ("a", "]"), "[^]": ("^", "a"), "[a&&b]": ("&", "c"),
             "[[:x]": ("[", "y"), "val/[!c]at/*": ("val/bat/1.png", "val/cat/1.png")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a nested-set FutureWarning from re would be a second stderr line
        for pattern, (matching, other) in cases.items():
            regex = glob_to_regex(pattern)
            assert regex.match(matching) and not regex.match(other), pattern


def test_an_error_line_leaves_in_one_write(monkeypatch):
    """Under mpiexec the stderr of every rank is merged: a line and its newline written apart can be split by
    another rank's line, so each error goes out whole in one write."""
    import io
    import sys

    from fanstore.errors import say_line

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    say_line("fanstore: error: rank 1 on host: MOUNTPOINT '/x' does not exist")
    assert writes == ["fanstore: error: rank 1 on host: MOUNTPOINT '/x' does not exist\n"]


# A command that meets a closed pipe that is not its stdout (a child's, a socket's), as `fanstore serve` did when a
# rank's watchdog was killed.
_BROKEN_PIPE_COMMAND = """
import argparse, sys
from fanstore import cli
def run(args):
    raise BrokenPipeError(32, "Broken pipe")
parser = argparse.ArgumentParser(prog="fanstore")
parser.set_defaults(run=run)
sys.exit(cli._run("fanstore", parser, []))
"""


def test_a_closed_pipe_other_than_stdout_is_one_line_and_a_closed_stdout_is_quiet():
    """A closed stdout (`fanstore select SRC | head`) is no error worth a word; any other closed pipe is one line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    other = subprocess.run([sys.executable, "-c", _BROKEN_PIPE_COMMAND], capture_output=True, text=True, env=env)
    assert_one_line_error(other, "fanstore: error: Broken pipe: a pipe or socket it wrote to was closed by its other "
                                 "end")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        quiet = subprocess.run([sys.executable, "-c", _BROKEN_PIPE_COMMAND], stdout=write_end,
                               stderr=subprocess.PIPE, text=True, env=env)
    finally:
        os.close(write_end)
    assert quiet.returncode == 1 and quiet.stderr == "", quiet.stderr


def test_quoted_user_text_is_cut_to_a_readable_length():
    """One helper shows user text in every error: repr'd, and past 200 characters cut with its full length."""
    assert quoted("train/a.png") == "'train/a.png'" and quoted(Path("/x/y")) == "'/x/y'"
    assert quoted("x" * 200) == repr("x" * 200)
    assert quoted("x" * 50_000_000) == "'" + "x" * 200 + "...' (50,000,000 characters)"
    assert quoted(b"\xff" * 300) == repr(b"\xff" * 200)[:-1] + "...' (300 bytes)"  # escapes stay whole
    assert quoted(list(range(1000))).endswith("... (4,890 characters)") and len(quoted(list(range(1000)))) < 240


LONG = "9" * 100_000 + "Q"  # an option's value no size parser takes, as long as a command line allows


@pytest.mark.parametrize("command, needle, length", [
    (["mount", "{ds}", "{tmp}", "--cache-size", LONG], "--cache-size: cannot read '9999", len(LONG)),
    (["fanstore-pack", "{src}", "{tmp}/out", "--replicate", "[" + LONG], "--replicate: unclosed '[' in pattern '[999",
     len(LONG) + 1),
    (["plan", "{ds}", "--nodes", LONG], "--nodes: cannot read '9999", len(LONG)),
    (["fanstore-pack", "{src}", "{tmp}/out", "--codec", "auto", "--budget", LONG + "/s"], "--budget: cannot read '999",
     len(LONG) + 2),
], ids=["mount --cache-size", "pack --replicate", "plan --nodes", "pack --budget"])
def test_a_long_value_is_echoed_cut_in_its_error(source_tree, tmp_path, command, needle, length):
    """User text in an error is cut to a readable length, whatever command quotes it."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    args = [arg.format(ds=dest, src=source_tree, tmp=tmp_path) for arg in command]
    failed = run_cli(*args, timeout=60)
    assert_one_line_error(failed, needle, f"...' ({length:,} characters)")
    assert len(failed.stderr) < 600, failed.stderr[:2000]


def test_option_values_a_person_gets_wrong_are_said_so(source_tree, tmp_path):
    """A byte count with a fraction and no unit was cut down without a word (--chunk-size 1.5: '1 bytes is too
    small'); --budget 0MB/s was refused where 0 was taken; --tolerance -1% said it must be more than 0%, which
    0 is not and is accepted; --seed with a fixed codec was taken silently where --sample is refused; a
    --replicate pattern that matches nothing (a typo) replicated nothing without a word."""
    def pack_with(*options: str):
        return run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), "--quiet", *options)

    assert_one_line_error(pack_with("--chunk-size", "1.5"), "--chunk-size", "'1.5' is not a whole number of bytes")
    assert_one_line_error(pack_with("--codec", "auto", "--budget", "1GB/s", "--tolerance=-1%"),
                          "--tolerance", "must be from 0% up to, not including, 100%")
    assert_one_line_error(pack_with("--codec", "lz4", "--seed", "3"), "--seed only applies with --codec auto")
    typo = pack_with("--codec", "lz4", "--replicate", "vla/**", "--replicate", "val/**")
    assert typo.returncode == 0, typo.stderr
    assert "warning: --replicate 'vla/**' matches no file of SRC: it replicates nothing" in typo.stderr
    assert "'val/**'" not in typo.stderr
    zero = run_cli("select", str(source_tree), "--budget", "0MB/s", "--fit", "1GB")
    assert zero.returncode == 0, zero.stderr


def test_a_dest_on_a_read_only_file_system_is_one_line_saying_what_it_is(source_tree, tmp_path):
    """An existing DEST that cannot be written was said to be one that 'cannot be created'."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    with mounted(read_only, "-t", "tmpfs", "-o", "ro", "tmpfs", purpose="mount a read-only tmpfs"):
        assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(read_only)),
                              f"DEST '{read_only}' cannot be written ('{read_only}/chunks' cannot be made): Read-only")
        assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(read_only / "new")),
                              f"DEST '{read_only}/new' cannot be created: Read-only")


def test_an_empty_path_is_refused_not_taken_for_the_current_directory(source_tree, tmp_path):
    """An empty argument ("$DEST" with DEST unset) was Path(''), the current directory: a pack wrote its chunks there,
    a mount covered it, a demo filled it. Every path a command takes is refused empty, by its name, and nothing is
    written."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    here = tmp_path / "here"
    here.mkdir()
    src, ds, mnt = str(source_tree), str(dest), str(tmp_path / "mnt")
    (tmp_path / "mnt").mkdir()
    cases = {"SRC": [("fanstore-pack", "", ds), ("select", "", "--budget", "1MB/s")],
             "DEST": [("fanstore-pack", src, ""), ("pack", src, ""), ("info", ""), ("verify", ""),
                      ("plan", "", "--nodes", "2"), ("mount", "", mnt)],
             "MOUNTPOINT": [("mount", ds, ""), ("umount", "")],
             "--log": [("mount", ds, mnt, "--log", "")],
             "--plot": [("select", src, "--budget", "1MB/s", "--plot", "")],
             "--workdir": [("demo", "--no-mount", "--workdir", "")],
             "--local-dir": [("serve", ds, mnt, "--local-dir", "")],
             "--ready-file": [("serve", ds, mnt, "--local-dir", str(tmp_path / "local"), "--ready-file", "")]}
    try:
        for name, commands in cases.items():
            for command in commands:
                refused = run_cli(*command, cwd=here, timeout=120)
                assert refused.returncode == 2, (command, refused.stdout, refused.stderr)
                assert_one_line_error(refused, f"argument {name}: an empty path")
                assert os.listdir(here) == [] and not os.path.ismount(here), command
    finally:
        if os.path.ismount(here):
            subprocess.run(["fusermount3", "-u", "-z", str(here)])


def test_a_removed_current_directory_is_said_and_absolute_paths_still_work(source_tree, tmp_path):
    """Run from a directory removed since (a job's scratch cleaned under its shell): pack, mount and umount failed in
    a traceback out of os.getcwd, given relative paths or not."""
    def in_a_removed_directory(*args: str) -> subprocess.CompletedProcess:
        gone = tmp_path / f"gone{len(list(tmp_path.glob('gone*')))}"
        gone.mkdir()
        return run_cli(*args, cwd=gone, preexec_fn=lambda: os.rmdir(gone), timeout=120)

    dest, mnt = tmp_path / "ds", tmp_path / "mnt"
    mnt.mkdir()
    for args, name in [(("fanstore-pack", str(source_tree), "out"), "DEST 'out'"), (("select", "src", "--budget",
                        "1MB/s"), "SRC 'src'"), (("mount", "ds", str(mnt)), "DEST 'ds'"), (("umount", "mnt"),
                        "MOUNTPOINT 'mnt'"), (("info", "ds"), "DEST 'ds'")]:
        assert_one_line_error(in_a_removed_directory(*args), name, "relative to the current directory, which was "
                                                                   "removed")
    packed = in_a_removed_directory("fanstore-pack", str(source_tree), str(dest), "--quiet")
    assert packed.returncode == 0, packed.stderr
    mounted_here = in_a_removed_directory("mount", str(dest), str(mnt))
    try:
        assert mounted_here.returncode == 0, mounted_here.stderr
        assert (mnt / "labels.txt").read_bytes() == (source_tree / "labels.txt").read_bytes()
    finally:
        unmounted = in_a_removed_directory("umount", str(mnt))
    assert unmounted.returncode == 0 and not os.path.ismount(mnt), unmounted.stderr


def test_an_error_naming_a_path_with_a_newline_stays_one_line(source_tree, tmp_path):
    """A DEST whose name holds a newline split the error in two (`ds` on one line, the rest on the next), and a
    background mount, whose daemon hands its error up as one line, lost all but `fanstore: error: ds`."""
    missing, plain = tmp_path / "ds\nmissing", tmp_path / "ds\nplain"
    plain.mkdir()
    (tmp_path / "mnt").mkdir()
    for args, needle in [(("info", str(missing)), "no such dataset directory"),
                         (("verify", str(plain)), "no fanstore.index here"),
                         (("plan", str(plain), "--nodes", "2"), "no fanstore.index here"),
                         (("mount", str(plain), str(tmp_path / "mnt")), "no fanstore.index here")]:
        failed = run_cli(*args, timeout=60)
        assert_one_line_error(failed, "ds\\n", needle)
        assert failed.stderr.count("\n") == 1, failed.stderr


def test_a_number_too_large_for_a_float_is_refused_as_too_large(source_tree, tmp_path):
    """A size of 400 digits and a unit ended in an OverflowError traceback (float infinity to int); without a unit it
    was said to be 'not a whole number of bytes'; a rate or a --kernel-timeout of 1e400 alike."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", check=True)
    huge = "9" * 400
    plan = ("plan", str(dest), "--nodes", "2", "--local-capacity")
    for args, needle in [((*plan, huge + "K"), "--local-capacity: '999"), ((*plan, huge), "--local-capacity: '999"),
                         (("select", str(source_tree), "--budget", huge + "MB/s"), "--budget: '999"),
                         (("fanstore-pack", str(source_tree), str(tmp_path / "out"), "--chunk-size", huge + "GiB"),
                          "--chunk-size: '999")]:
        assert_one_line_error(run_cli(*args, timeout=60), needle, "is too large")
    assert not (tmp_path / "out").exists()
    (tmp_path / "mnt").mkdir()
    assert_one_line_error(run_cli("mount", str(dest), str(tmp_path / "mnt"), "--kernel-timeout", "1e400"),
                          "--kernel-timeout: must be a finite number of seconds, 0 or more, got inf")


def test_a_command_run_with_its_output_streams_closed_does_its_work(source_tree, tmp_path):
    """Started with stderr closed (`2>&-`), a pack failed on its progress bar's first write, with status 1 and no
    word (Python's sys.stderr was None), its dataset left unfinished. A closed stream is now the null device: the
    command works, and its status still says how it went."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def with_closed(fds: tuple[int, ...], *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fanstore", *args], env=env, timeout=120,
                              preexec_fn=lambda: [os.close(fd) for fd in fds])

    dest = tmp_path / "ds"
    assert with_closed((2,), "pack", str(source_tree), str(dest)).returncode == 0
    assert run_cli("verify", str(dest)).returncode == 0
    assert with_closed((1, 2), "pack", str(source_tree), str(tmp_path / "ds2")).returncode == 0
    assert dir_bytes(tmp_path / "ds2") == dir_bytes(dest)
    assert with_closed((2,), "info", str(tmp_path / "absent")).returncode == 1
    assert with_closed((1,), "verify", str(dest)).returncode == 0


def test_a_demo_workdir_that_cannot_be_made_is_one_line(tmp_path):
    """`fanstore demo --workdir` on a file, under a file or where nothing may be made ended in a mkdir traceback."""
    (tmp_path / "a_file").write_text("x")
    for workdir, reason in [("a_file", "File exists"), ("a_file/sub", "Not a directory"), ("/proc/demo", "No such")]:
        path = workdir if workdir.startswith("/") else str(tmp_path / workdir)
        assert_one_line_error(run_cli("demo", "--no-mount", "--workdir", path), f"--workdir '{path}'", reason)


def test_a_report_on_a_dest_whose_name_holds_a_newline_keeps_one_line_an_item(source_tree, tmp_path):
    """verify's BAD lines and info's and plan's lines named DEST bare: a newline in its name split each in two, so
    that a script counting BAD lines counted wrong."""
    dest = tmp_path / "ds\nnew"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--chunk-size", "64KiB", check=True)
    (dest / "chunks" / "00000000.fsc").unlink()
    verified = run_cli("verify", str(dest))
    assert verified.returncode == 1
    lines = verified.stdout.splitlines()
    assert all(line.startswith(("BAD ", "checked ")) for line in lines), verified.stdout
    assert "ds\\nnew/chunks/00000000.fsc" in lines[0]
    info = run_cli("info", str(dest), check=True).stdout.splitlines()
    assert info[0] == f"dataset      {str(dest)!r}", info[0]
    unreadable = info.index(next(line for line in info if line.startswith("chunk files")))
    assert "ds\\nnew/chunks/00000000.fsc" in info[unreadable + 1], info
    assert not any(line.startswith("new") for line in info), info
    plan = run_cli("plan", str(dest), "--nodes", "2", check=True).stdout.splitlines()
    assert plan[0] == f"dataset      {str(dest)!r}" and plan[1].startswith("nodes"), plan
    again = run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--chunk-size", "64KiB", "--force")
    nothing = run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--chunk-size", "64KiB", check=True)
    assert again.returncode == 0 and nothing.stdout.startswith("nothing to do: "), nothing.stdout
    assert nothing.stdout.count("\n") == 1 and "ds\\nnew" in nothing.stdout, nothing.stdout


def test_a_name_the_output_encoding_cannot_write_is_escaped_not_a_traceback(source_tree, tmp_path):
    """Where stdout's encoding cannot write a file's name (a Latin-1 or ASCII locale; PYTHONIOENCODING=ascii), verify
    ended in a UnicodeEncodeError traceback at the first BAD line naming it, as stderr, which escapes, did not."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(source_tree), str(dest), "--quiet", "--chunk-size", "4KiB", check=True)
    with open_dataset(dest) as ds:
        chunk = int(ds.index.entries["chunk"][ds.index.lookup("名前 with spaces.txt")])
    (dest / "chunks" / f"{chunk:08d}.fsc").unlink()
    verified = run_cli("verify", str(dest), env={"PYTHONIOENCODING": "ascii"})
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert "BAD \\u540d\\u524d with spaces.txt: " in verified.stdout, verified.stdout


def test_a_replicate_pattern_written_from_inside_src_matches_as_its_path(source_tree, tmp_path):
    """`--replicate ./val` (or `./val/**`, `val//cat`) matched nothing, with a warning, and replicated nothing, where
    `/val` and `val/` matched: a path in the dataset has no `.` or empty component, so the pattern's are dropped."""
    from fanstore.pack.groups import glob_to_regex

    for pattern in ("./val", "./val/**", "val//cat", "val/./cat/*.png", "/./val/"):
        assert glob_to_regex(pattern).match("val/cat/img_001.png"), pattern
        assert not glob_to_regex(pattern).match("train/cat/img_001.png"), pattern
    for pattern in (".", "./", "/./"):
        with pytest.raises(UsageError, match="--replicate: empty pattern"):
            glob_to_regex(pattern)
    packed = run_cli("fanstore-pack", str(source_tree), str(tmp_path / "ds"), "--quiet", "--replicate", "./val")
    assert packed.returncode == 0 and "warning" not in packed.stderr, packed.stderr


def test_a_dest_that_is_a_dangling_symlink_is_said_to_lead_nowhere(source_tree, tmp_path):
    """DEST a symlink to a directory not made yet (`ln -s /scratch/me/ds ds`) was said to lead to 'something that is
    not a directory', where nothing is."""
    dangling = tmp_path / "ds"
    dangling.symlink_to(tmp_path / "not_made")
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(dangling)),
                          f"DEST '{dangling}' is a symlink to '{tmp_path}/not_made', which does not exist")
    assert not (tmp_path / "not_made").exists()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "to_file").symlink_to(tmp_path / "a_file")
    assert_one_line_error(run_cli("fanstore-pack", str(source_tree), str(tmp_path / "to_file")),
                          "is a symlink to something that is not a directory")


def test_a_warning_naming_a_dest_with_a_newline_is_one_line(source_tree, tmp_path, paused_pack):
    """A resume's warning that a chunk was damaged since names its file in DEST: a newline in DEST's name split it
    in two, as it did the errors (the warnings went out by print, not by the one-line say_line)."""
    dest = tmp_path / "ds\nnew"
    args = ["--chunk-size", "4KiB", "--workers", "1", "--quiet"]
    paused_pack(source_tree, dest, args, "chunk:3").kill_group()
    (dest / "chunks" / "00000001.fsc").unlink()
    resumed = run_cli("fanstore-pack", str(source_tree), str(dest), *args, check=True)
    assert "are packed again" in resumed.stderr, resumed.stderr
    assert all(line.startswith("warning: ") for line in resumed.stderr.splitlines()), resumed.stderr


def test_a_path_too_long_to_look_up_is_one_line_naming_it(source_tree, tmp_path):
    """A SRC or DEST with a name past the file system's 255 bytes (a pasted line, a variable holding a list) ended
    pack and select in an OSError traceback: pathlib's is_dir raises ENAMETOOLONG where it answers False for a path
    that is absent."""
    long_name = str(tmp_path / ("x" * 300))
    for args, name in [(("fanstore-pack", str(source_tree), long_name), "DEST"),
                       (("fanstore-pack", long_name, str(tmp_path / "ds")), "SRC"),
                       (("select", long_name, "--budget", "1MB/s"), "SRC")]:
        assert_one_line_error(run_cli(*args), f"{name} '{tmp_path}/xxx", "File name too long")
    assert not (tmp_path / "ds").exists()
