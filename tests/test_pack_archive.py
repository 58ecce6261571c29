"""Packing straight from archives (walk_archive.py, archive_source.py, archive_feed.py), with real archives made by
the tar and unzip commands and by tarfile/zipfile: as the extracted directory packs, hostile names refused, damage
reported, resumable, several archives as one dataset."""

from __future__ import annotations

import gzip
import io
import os
import random
import shutil
import stat
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error, dataset_digest, dir_bytes, make_tree, run_cli, tree_digest
from fanstore import open_dataset

MTIME = 1_700_000_000  # even: a zip's DOS time holds 2-second steps
BIG = 5 << 20  # above --blocks-above's default: stored in blocks


def _tree(root: Path) -> Path:
    """conftest's tree, plus a file stored in blocks, every time set to MTIME (archives hold seconds)."""
    make_tree(root)
    (root / "train" / "big.bin").write_bytes(np.random.default_rng(3).integers(0, 4, BIG, np.uint8).tobytes())
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        os.utime(path, (MTIME, MTIME), follow_symlinks=False)
    return root


def _tar(src: Path, archive: Path, *compress: str) -> Path:
    subprocess.run(["tar", "--sort=name", *compress, "-C", str(src), "-cf", str(archive), "."], check=True)
    return archive


def _extract_tar(archive: Path, into: Path) -> Path:
    into.mkdir()
    subprocess.run(["tar", "-C", str(into), "-xf", str(archive)], check=True)
    return into


def _sorted_zip(src: Path, archive: Path) -> Path:
    """A zip of `src` with its members in path order, as the directory walk sorts them, modes and symlinks kept."""
    entries = sorted(src.rglob("*"), key=lambda p: p.relative_to(src).as_posix().encode())
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in entries:
            rel = path.relative_to(src).as_posix()
            info = os.lstat(path)
            member = zipfile.ZipInfo(rel + "/" if stat.S_ISDIR(info.st_mode) else rel,
                                     time.gmtime(info.st_mtime)[:6])
            member.create_system = 3
            member.external_attr = info.st_mode << 16
            if stat.S_ISLNK(info.st_mode):
                zf.writestr(member, os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                zf.writestr(member, b"")
            else:
                zf.writestr(member, path.read_bytes(), zipfile.ZIP_DEFLATED)
    return archive


def _pack(src, dest: Path, *args: str) -> str:
    sources = [str(s) for s in src] if isinstance(src, list) else [str(src)]
    proc = run_cli("fanstore-pack", *sources, str(dest), "--quiet", *args, check=True)
    return proc.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("archive") / "src")


@pytest.mark.parametrize("compress", [[], ["-z"], ["--zstd"]], ids=["tar", "tar.gz", "tar.zst"])
def test_a_sorted_tar_packs_byte_identical_to_its_extraction(tree, tmp_path, compress):
    archive = _tar(tree, tmp_path / "src.tar", *compress)
    extracted = _extract_tar(archive, tmp_path / "extracted")
    _pack(extracted, tmp_path / "from_dir", "--chunk-size", "1MiB")
    warnings = _pack(archive, tmp_path / "from_tar", "--chunk-size", "1MiB")
    assert warnings == ""
    assert dir_bytes(tmp_path / "from_tar") == dir_bytes(tmp_path / "from_dir")
    with open_dataset(tmp_path / "from_tar") as ds:
        assert dataset_digest(ds) == tree_digest(tree)


@pytest.mark.skipif(shutil.which("unzip") is None, reason="the unzip command is not installed")
def test_a_sorted_zip_packs_byte_identical_to_its_extraction(tree, tmp_path):
    archive = _sorted_zip(tree, tmp_path / "src.zip")
    extracted = tmp_path / "extracted"
    subprocess.run(["unzip", "-q", str(archive), "-d", str(extracted)], check=True, env={**os.environ, "TZ": "UTC"})
    os.utime(extracted, (MTIME, MTIME))  # no member is the root: it takes the newest member's mtime
    for path in extracted.rglob("*"):  # unzip leaves a symlink's own mtime the time it made it
        if path.is_symlink():
            os.utime(path, (MTIME, MTIME), follow_symlinks=False)
    _pack(extracted, tmp_path / "from_dir")
    assert _pack(archive, tmp_path / "from_zip") == ""
    assert dir_bytes(tmp_path / "from_zip") == dir_bytes(tmp_path / "from_dir")


def _shuffled_tar(src: Path, archive: Path, seed: int, mode: str = "w:gz") -> Path:
    """Members in a shuffled order (each directory still before what it holds is not required)."""
    paths = sorted(src.rglob("*"))
    random.Random(seed).shuffle(paths)
    with tarfile.open(archive, mode) as tar:
        for path in paths:
            tar.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
    return archive


@pytest.mark.parametrize("mode", ["w:gz", "w"])
def test_any_other_order_gives_the_same_files_and_the_same_dataset_every_time(tree, tmp_path, mode):
    archive = _shuffled_tar(tree, tmp_path / "shuffled.tar", seed=5, mode=mode)
    _pack(archive, tmp_path / "once", "--chunk-size", "256KiB", "--workers", "2")
    _pack(archive, tmp_path / "again", "--chunk-size", "256KiB", "--workers", "1")
    assert dir_bytes(tmp_path / "once") == dir_bytes(tmp_path / "again")
    with open_dataset(tmp_path / "once") as ds:
        assert dataset_digest(ds) == tree_digest(tree)


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mtime, info.mode = kind, len(data), link, MTIME, 0o644
    return info, data


def _write_tar(archive: Path, members: list[tuple[tarfile.TarInfo, bytes]], mode: str = "w") -> Path:
    with tarfile.open(archive, mode, format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return archive


def test_hostile_member_names_are_refused_with_a_warning_and_nothing_is_written_outside(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    archive = _write_tar(work / "hostile.tar", [
        _member("./fine.txt", data=b"fine"),
        _member("../escape.txt", data=b"evil"),
        _member("/tmp/absolute.txt", data=b"evil"),
        _member("sub/../../climb.txt", data=b"evil"),
        _member("out", tarfile.SYMTYPE, link="/etc"),
        _member("up", tarfile.SYMTYPE, link="../../x"),
        _member("in", tarfile.SYMTYPE, link="sub/../fine.txt"),
        _member("dev", tarfile.CHRTYPE),
        _member("fifo", tarfile.FIFOTYPE),
        _member("hard", tarfile.LNKTYPE, link="fine.txt"),
        _member("file/child.txt", data=b"under"),
    ])
    proc = run_cli("fanstore-pack", str(archive), str(work / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in ("../escape.txt", "/tmp/absolute.txt", "sub/../../climb.txt", "out: symlink to '/etc' leaves SRC",
                   "up: symlink to '../../x' leaves SRC", "dev: is a character device", "fifo: is a fifo"):
        assert any(needle in line and line.startswith("warning:") for line in proc.stderr.splitlines()), needle
    with open_dataset(work / "ds") as ds:
        assert dataset_digest(ds) == {"fine.txt": tree_digest_of(b"fine"), "in": "link:fine.txt",
                                      "hard": tree_digest_of(b"fine"),  # a hard link: a file with its target's bytes
                                      "file": "dir", "file/child.txt": tree_digest_of(b"under")}
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name.endswith(".txt") and "evil" in _text(p)) == []
    assert not Path("/tmp/absolute.txt").exists()
    for where in (work, work / "ds", REPO, REPO.parent):  # DEST, SRC's directory, the packer's cwd: no escape
        assert not (where.parent / "escape.txt").exists() and not (where.parent / "climb.txt").exists()


def _hard_linked_tree(root: Path) -> Path:
    """Files with hard links between them, across directories, one with three names."""
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "one.bin").write_bytes(_content(7) * 40)
    os.link(root / "a" / "one.bin", root / "b" / "two.bin")
    os.link(root / "a" / "one.bin", root / "b" / "three.bin")
    (root / "s.txt").write_bytes(b"small")
    os.link(root / "s.txt", root / "a" / "s2.txt")
    os.chmod(root / "s.txt", 0o600)
    return root


@pytest.mark.parametrize("compress", [[], ["-z"]], ids=["tar", "tar.gz"])
def test_hard_links_in_a_tar_pack_as_the_files_extraction_gives(tmp_path, compress):
    """tar stores a second name of a file as a hard link to the first (no data of its own): each packs as a file of
    its own path with the target's bytes and mode, as `tar -x` makes it, and the data is read from the archive once."""
    src = _hard_linked_tree(tmp_path / "src")
    archive = tmp_path / "linked.tar"
    subprocess.run(["tar", *compress, "-C", str(src), "-cf", str(archive), "."], check=True)
    assert sum(member.islnk() for member in tarfile.open(archive)) == 3  # tar made hard links, not copies
    extracted = _extract_tar(archive, tmp_path / "extracted")
    assert _pack(archive, tmp_path / "from_tar", "--codec", "zstd:3") == ""
    with open_dataset(tmp_path / "from_tar") as ds:
        assert dataset_digest(ds) == tree_digest(extracted)
        assert {path: stat.S_IMODE(ds.stat(path).st_mode) for path in ("s.txt", "a/s2.txt", "b/two.bin")} == \
            {"s.txt": 0o600, "a/s2.txt": 0o600, "b/two.bin": 0o644}
    assert run_cli("verify", str(tmp_path / "from_tar")).returncode == 0


def test_a_compressed_tar_is_read_once_for_a_member_its_hard_links_share(tmp_path, monkeypatch):
    """Reading a hard link's bytes again would start a compressed stream over: the feed keeps the shared member's
    bytes until its last reader has them."""
    from fanstore.pack import archive_feed
    from fanstore.pack.walk_archive import walk_archives

    src = _hard_linked_tree(tmp_path / "src")
    archive = tmp_path / "linked.tar.gz"
    subprocess.run(["tar", "-z", "-C", str(src), "-cf", str(archive), "."], check=True)
    tree = walk_archives([archive])
    assert sorted(tree.linked.values()) == [2, 3]  # s.txt read by 2 files, one.bin by 3
    opened = []
    real_open = archive_feed.open_tar_stream
    monkeypatch.setattr(archive_feed, "open_tar_stream", lambda *args: opened.append(args) or real_open(*args))
    files = tree.files
    order = tree.file_numbers_in_read_order()
    numbers = np.searchsorted(np.flatnonzero(tree.entries.is_file()), order)
    feed = archive_feed.ArchiveFeed(tree.archives, files.paths, files.ino, files.size, tree.linked)
    try:
        for number in numbers.tolist():
            into = memoryview(bytearray(int(files.size[number])))
            assert feed.read_range(number, 0, into) == ""
            assert bytes(into) == (src / files.paths[number]).read_bytes()
    finally:
        feed.close()
    assert len(opened) == 1


def test_a_hard_link_to_no_earlier_file_is_refused_with_a_warning(tmp_path):
    archive = _write_tar(tmp_path / "links.tar", [
        _member("early", tarfile.LNKTYPE, link="later.txt"),  # its target comes after it: extraction fails too
        _member("later.txt", data=b"later"),
        _member("nowhere", tarfile.LNKTYPE, link="missing.txt"),
        _member("out", tarfile.LNKTYPE, link="../outside.txt"),
        _member("dir/", tarfile.DIRTYPE),
        _member("to-dir", tarfile.LNKTYPE, link="dir"),
        _member("good", tarfile.LNKTYPE, link="./later.txt"),
    ])
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    for name, target in (("early", "later.txt"), ("nowhere", "missing.txt"), ("out", "../outside.txt"),
                         ("to-dir", "dir")):
        assert any(f"{name}: is a hard link to '{target}', which is not a file packed before it" in line
                   for line in warned), (name, warned)
    with open_dataset(tmp_path / "ds") as ds:
        assert dataset_digest(ds) == {"later.txt": tree_digest_of(b"later"), "good": tree_digest_of(b"later"),
                                      "dir": "dir"}


def tree_digest_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def test_hostile_zip_names_are_refused(tmp_path):
    archive = tmp_path / "hostile.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ok.txt", b"ok")
        zf.writestr("../escape.txt", b"evil")
        zf.writestr("/abs.txt", b"evil")
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "../escape.txt: has a '..' component" in proc.stderr and "/abs.txt: is an absolute path" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["ok.txt"]


def _zip_of(archive: Path, members: list[tuple[str, int, bytes]]) -> Path:
    """A zip of these (name, create_system, data) members, names stored as given: a name ending in '\\' or '/' is a
    directory (the MS-DOS directory attribute, or a Unix directory mode)."""
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, system, data in members:
            member = zipfile.ZipInfo(name, time.gmtime(MTIME)[:6])
            member.create_system = system
            directory = name.endswith(("/", "\\"))
            if system == 3:
                member.external_attr = ((stat.S_IFDIR | 0o755) if directory else (stat.S_IFREG | 0o644)) << 16
            elif directory:
                member.external_attr = 0x10  # MS-DOS: a directory
            zf.writestr(member, data)
    return archive


def test_a_zip_made_on_windows_with_backslash_separators_packs_the_directories_unzip_makes(tmp_path):
    """Some Windows tools store 'photos\\2023\\a.jpg' where the zip spec asks for '/': unzip reads '\\' as the
    separator there and makes the directories, fanstore packed one file named 'photos\\2023\\a.jpg' at the top.
    Now a name from MS-DOS/Windows (create_system 0) with no '/' reads as unzip reads it; a Unix name keeps its
    '\\', as does an MS-DOS name that already separates with '/'."""
    archive = _zip_of(tmp_path / "windows.zip", [
        ("photos\\", 0, b""),
        ("photos\\2023\\a.jpg", 0, b"jpeg a"),
        ("photos\\2023\\b.jpg", 0, b"jpeg b"),
        ("docs\\notes\\readme.txt", 0, b"implied directories"),
        (".\\top.txt", 0, b"top"),
        ("unix\\name.txt", 3, b"a Unix name holds a backslash"),
        ("mixed/part\\name.txt", 0, b"separated by '/' already"),
    ])
    extracted = tmp_path / "extracted"
    unzipped = subprocess.run(["unzip", "-q", str(archive), "-d", str(extracted)], capture_output=True, text=True)
    assert unzipped.returncode in (0, 1) and "backslashes as path separators" in unzipped.stdout + unzipped.stderr
    stderr = _pack(archive, tmp_path / "ds")
    assert stderr == ""
    with open_dataset(tmp_path / "ds") as ds:
        assert dataset_digest(ds) == tree_digest(extracted)
        assert ds.listdir("") == ["docs", "mixed", "photos", "top.txt", "unix\\name.txt"]
        assert ds.listdir("photos/2023") == ["a.jpg", "b.jpg"]
        assert ds.read("photos/2023/b.jpg") == b"jpeg b" and ds.read("docs/notes/readme.txt") == b"implied directories"
        assert ds.read("mixed/part\\name.txt") == b"separated by '/' already"
        assert stat.S_ISDIR(ds.stat("photos").st_mode) and stat.S_ISDIR(ds.stat("docs/notes").st_mode)


def test_backslash_names_that_leave_the_dataset_or_clash_go_through_the_checks_other_names_do(tmp_path):
    """A Windows name read with '/' for '\\' may become '../x', an absolute path, or a path under a file: each
    is refused as the same name written with '/' is, with a warning naming it and the archive; a name that becomes
    another member's takes the later member, as extraction does."""
    archive = _zip_of(tmp_path / "windows.zip", [
        ("..\\escape.txt", 0, b"evil"),
        ("\\abs.txt", 0, b"evil"),
        ("a\\..\\..\\up.txt", 0, b"evil"),
        ("plain", 0, b"a file"),
        ("plain\\under.txt", 0, b"under a file"),
        ("same/name.txt", 3, b"first"),
        ("same\\name.txt", 0, b"second"),
        ("ok.txt", 0, b"ok"),
    ])
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    for line in ("warning: skipped ../escape.txt: has a '..' component, which could leave the dataset (in "
                 "windows.zip); skipped",
                 "warning: skipped /abs.txt: is an absolute path, which would leave the dataset (in windows.zip); "
                 "skipped",
                 "warning: skipped a/../../up.txt: has a '..' component, which could leave the dataset (in "
                 "windows.zip); skipped",
                 "warning: skipped plain/under.txt: its directory 'plain' is not a directory in the archive (or was "
                 "skipped); skipped"):
        assert line in lines, proc.stderr
    assert len(lines) == 4, proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["ok.txt", "plain", "same"]
        assert ds.read("same/name.txt") == b"second" and ds.read("plain") == b"a file"


def _content(number: int) -> bytes:
    """A member's bytes: random, so that a compressed archive is as long as the tar (and a cut lands in it)."""
    return np.random.default_rng(number).bytes(3000 + number)


def _files_before(tree: Path, limit: int) -> list[tuple[tarfile.TarInfo, bytes]]:
    members = []
    for number in range(limit):
        members.append(_member(f"f{number:03d}.bin", data=_content(number)))
    return members


@pytest.mark.parametrize("mode", ["w", "w:gz", "zstd"])
def test_a_truncated_tar_packs_the_members_before_the_damage(tmp_path, mode):
    whole = _write_tar(tmp_path / "whole.tar", _files_before(tmp_path, 200), "w" if mode == "zstd" else mode)
    if mode == "zstd":
        subprocess.run(["zstd", "-q", "--rm", str(whole), "-o", str(tmp_path / "whole.tar.zst")], check=True)
        whole = tmp_path / "whole.tar.zst"
    data = whole.read_bytes()
    cut = tmp_path / {"w": "cut.tar", "w:gz": "cut.tar.gz", "zstd": "cut.tar.zst"}[mode]
    cut.write_bytes(data[: len(data) // 2])
    proc = run_cli("fanstore-pack", str(cut), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    damage = [line for line in proc.stderr.splitlines() if "damaged at byte" in line]
    assert len(damage) == 1 and damage[0].startswith(f"warning: skipped {cut.name}: damaged at byte"), proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        names = ds.listdir("")
        assert names and len(names) < 200  # a zstd block holds 128 KiB: 200 members span several
        assert names == [f"f{number:03d}.bin" for number in range(len(names))]
        for number, name in enumerate(names):
            assert ds.read(name) == _content(number)
    strict = run_cli("fanstore-pack", str(cut), str(tmp_path / "strict"), "--strict", "--quiet")
    assert_one_line_error(strict, cut.name, "damaged at byte")
    assert not (tmp_path / "strict" / "fanstore.index").exists()


def _flipped_in_the_middle(archive: Path, count: int) -> Path:
    """bad.tar.gz beside `archive`: its bytes with `count` of them, from the middle on, flipped."""
    data = bytearray(archive.read_bytes())
    for at in range(len(data) // 2, len(data) // 2 + count):
        data[at] ^= 0x5A
    bad = archive.with_name("bad.tar.gz")
    bad.write_bytes(bytes(data))
    return bad


def test_bytes_damaged_where_a_compressed_tar_stores_them_as_is_are_caught_by_its_end_check(tmp_path):
    """Random bytes (a photo's) are stored as is inside gzip's blocks, so damage there decodes without an error;
    only the stream's check at its end (gzip's CRC; xz's and zstd's likewise) tells. The listing reads to the end,
    and since the check cannot say which member is damaged, none is packed, with one warning; --strict fails.
    (Damage that lands on a member's header is found there, as any corrupt header: test above.)"""
    bad = _flipped_in_the_middle(_write_tar(tmp_path / "whole.tar", _files_before(tmp_path, 200), "w:gz"), 64)
    proc = run_cli("fanstore-pack", str(bad), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    damage = [line for line in proc.stderr.splitlines() if "damaged at byte" in line]
    assert len(damage) == 1 and "check at its end fails" in damage[0] and bad.name in damage[0], proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == []
    strict = run_cli("fanstore-pack", str(bad), str(tmp_path / "strict"), "--strict", "--quiet")
    assert_one_line_error(strict, bad.name, "check at its end fails")


def _compressed_tar(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]], compression: str) -> Path:
    """whole.tar.gz, .tar.xz or .tar.zst (with its checksum, as the zstd command writes it) of `members`."""
    if compression != "zst":
        return _write_tar(tmp_path / f"whole.tar.{compression}", members, f"w:{compression}")
    whole = _write_tar(tmp_path / "whole.tar", members)
    subprocess.run(["zstd", "-q", "--rm", str(whole), "-o", str(tmp_path / "whole.tar.zst")], check=True)
    return tmp_path / "whole.tar.zst"


@pytest.mark.parametrize("compression", ["gz", "xz", "zst"])
@pytest.mark.parametrize("members", ["text", "random"])
@pytest.mark.parametrize("at", [0.5, 0.97])
def test_a_compressed_tar_damaged_anywhere_packs_no_member_it_cannot_check(tmp_path, compression, members, at):
    """A corrupt block decodes to garbage before anything tells (deflate bytes flipped garbled the member before the
    header that showed it; a zstd block holds 128 KiB of members; gzip's CRC failed while the last headers were
    read, and one garbled member was packed): where a compressed tar fails to decode, whatever the error and
    wherever it shows, its check never passed, so no member is packed, with one warning; --strict fails."""
    if compression == "zst" and shutil.which("zstd") is None:
        pytest.skip("the zstd command is not installed (scripts/setup installs it)")
    bodies = [(f"line {number} of a text file\n" * 100).encode() if members == "text" else _content(number)
              for number in range(120)]
    whole = _compressed_tar(tmp_path, [_member(f"f{number:03d}", data=body) for number, body in enumerate(bodies)],
                            compression)
    data = bytearray(whole.read_bytes())
    data[int(len(data) * at)] ^= 0x5A
    bad = whole.with_name("bad" + whole.name.removeprefix("whole"))
    bad.write_bytes(bytes(data))
    proc = run_cli("fanstore-pack", str(bad), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    damage = [line for line in proc.stderr.splitlines() if "damaged at byte" in line]
    assert len(damage) == 1 and bad.name in damage[0] and "cannot be told" in damage[0], proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == []
    strict = run_cli("fanstore-pack", str(bad), str(tmp_path / "strict"), "--strict", "--quiet")
    assert_one_line_error(strict, bad.name, "cannot be told")


def test_a_tar_damaged_before_it_was_compressed_packs_the_members_before_the_damage(tmp_path):
    """A corrupt header in a tar that was then compressed: the stream's check passes, so the bytes are the tar's
    own and the members before the header are whole."""
    tar = _write_tar(tmp_path / "bad.tar", _files_before(tmp_path, 10))
    data = bytearray(tar.read_bytes())
    header = 5 * (512 + 3072)  # the sixth member's header
    data[header + 148 : header + 156] = b"9999999\0"  # its checksum
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(gzip.compress(bytes(data)))
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert f"damaged at byte {header:,} of its decompressed tar stream (a member header is corrupt)" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == [f"f{number:03d}.bin" for number in range(5)]


def test_a_corrupt_tar_header_ends_the_members_with_a_warning(tmp_path):
    archive = _write_tar(tmp_path / "bad.tar", _files_before(tmp_path, 10))
    data = bytearray(archive.read_bytes())
    header = 5 * (512 + 3072)  # the sixth member's header: each member is a header and 6 data blocks
    assert data[header : header + 5] == b"f005."
    data[header + 148 : header + 156] = b"9999999\0"  # its checksum
    archive.write_bytes(bytes(data))
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert f"damaged at byte {header:,} (a member header is corrupt)" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == [f"f{number:03d}.bin" for number in range(5)]


def test_a_damaged_zip_member_is_skipped_and_the_others_packed(tmp_path):
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        for number in range(5):
            zf.writestr(f"f{number}.bin", bytes([number]) * 1000)
    with zipfile.ZipFile(archive) as zf:
        damaged = zf.getinfo("f2.bin")
    data = bytearray(archive.read_bytes())
    data[damaged.header_offset + 30 + len("f2.bin") + 10] ^= 0xFF  # a byte of its data: its CRC no longer holds
    archive.write_bytes(bytes(data))
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert f"f2.bin: damaged in {archive.name} (the member at byte {damaged.header_offset:,}" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["f0.bin", "f1.bin", "f3.bin", "f4.bin"]
    strict = run_cli("fanstore-pack", str(archive), str(tmp_path / "strict"), "--strict", "--quiet")
    assert_one_line_error(strict, "f2.bin", archive.name)


class _Unseekable(io.RawIOBase):
    """A stream zipfile cannot seek back in: it writes each member's sizes after its data (a data descriptor), as
    a zip written on the fly is."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.data += data
        return len(data)


def _zip_bytes(kind: str, members: int) -> bytes:
    if kind == "streamed":
        stream = _Unseekable()
        with zipfile.ZipFile(stream, "w", zipfile.ZIP_DEFLATED) as zf:
            for number in range(members):
                with zf.open(f"d/f{number}.bin", "w") as member:
                    member.write(_content(number))
        return bytes(stream.data)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED if kind == "stored" else zipfile.ZIP_DEFLATED) as zf:
        for number in range(members):
            zf.writestr(f"d/f{number}.bin", _content(number))
    return buffer.getvalue()


@pytest.mark.parametrize("whole", [1, 5])
def test_a_zip_cut_short_counts_its_whole_members_as_docs_output_md_says(tmp_path, whole):
    """The warning said `1 member(s) before it read from their local headers`; docs/OUTPUT.md has counts take
    their plural."""
    data = _zip_bytes("deflated", 8)
    with zipfile.ZipFile(io.BytesIO(data)) as complete:
        offsets = [info.header_offset for info in complete.infolist()]
    archive = tmp_path / "cut.zip"
    archive.write_bytes(data[: offsets[whole] + 100])
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    said = "; 1 member before it read" if whole == 1 else f"; {whole} members before it read"
    assert said in proc.stderr, proc.stderr


@pytest.mark.parametrize("kind", ["deflated", "stored", "streamed"])
def test_a_zip_cut_short_packs_the_whole_members_before_the_cut(tmp_path, kind):
    """A zip's central directory is at its end: a zip cut short has none, but each member still lies behind its
    local header. Those before the cut are packed, with one warning naming the archive and the byte."""
    data = _zip_bytes(kind, 8)
    with zipfile.ZipFile(io.BytesIO(data)) as whole:
        offsets = [info.header_offset for info in whole.infolist()]
    archive = tmp_path / "cut.zip"
    archive.write_bytes(data[: offsets[5] + 100])  # inside the sixth member
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and f"cut.zip: damaged at byte {offsets[5]:,} (no readable central directory" in \
        warned[0], warned
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("d") == [f"f{number}.bin" for number in range(5)]
        assert [ds.read(f"d/f{number}.bin") for number in range(5)] == [_content(number) for number in range(5)]
    strict = run_cli("fanstore-pack", str(archive), str(tmp_path / "strict"), "--strict", "--quiet")
    assert_one_line_error(strict, archive.name, "no readable central directory")


def test_a_remade_central_directory_takes_zip64_records_where_its_values_need_them(tmp_path, monkeypatch):
    from fanstore.pack import zip_recovery

    monkeypatch.setattr(zip_recovery, "ZIP64_VALUE", 3000)  # every size and most offsets: 8-byte fields
    monkeypatch.setattr(zip_recovery, "ZIP64_COUNT", 2)  # the member count: the zip64 end records
    data = _zip_bytes("deflated", 6)
    with open(tmp_path / "cut.zip", "wb") as file:
        file.write(data[:-10])
    with open(tmp_path / "cut.zip", "rb") as file:
        zip_file, recovered = zip_recovery.open_zip(file)
        assert recovered is not None and recovered.members == 6
        assert [zip_file.read(f"d/f{number}.bin") for number in range(6)] == [_content(number) for number in range(6)]


def test_zip_members_that_need_a_password_or_another_method_are_refused_with_a_warning(tmp_path):
    """zipfile reads stored, deflate, bzip2 and lzma members without a password: an encrypted member, or one of
    another method (deflate64, AES), is one warning at listing, not a traceback when its bytes are read."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        for name in ("locked.bin", "deflate64.bin", "plain.bin"):
            zf.writestr(name, name.encode() * 50)
    data = bytearray(buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        infos = {info.filename: info for info in zf.infolist()}
    central = data.index(b"PK\x01\x02")
    for name, field, value in (("locked.bin", "flags", 0x1), ("deflate64.bin", "method", 9)):
        local = infos[name].header_offset
        record = data.index(name.encode(), central) - 46  # its central record: 46 bytes, then the name
        for header, at in ((local, 6 if field == "flags" else 8), (record, 8 if field == "flags" else 10)):
            data[header + at : header + at + 2] = value.to_bytes(2, "little")
    archive = tmp_path / "odd.zip"
    archive.write_bytes(bytes(data))
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "locked.bin: is encrypted in the zip" in proc.stderr
    assert "deflate64.bin: is compressed with zip method 9, which cannot be read here" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["plain.bin"] and ds.read("plain.bin") == b"plain.bin" * 50


def test_a_zip_with_no_whole_member_is_one_line(tmp_path):
    archive = tmp_path / "cut.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("a.bin", b"a" * 5000)
    archive.write_bytes(archive.read_bytes()[:60])
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--strict", "--quiet")
    assert_one_line_error(proc, archive.name, "not a readable zip")


def test_sources_that_are_not_archives_are_one_line(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not an archive")
    assert_one_line_error(run_cli("fanstore-pack", str(text), str(tmp_path / "ds")), str(text),
                          "not a directory, nor an archive")
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "shards-*.tar"), str(tmp_path / "ds")),
                          "shards-*.tar", "no file matches")
    (tmp_path / "dir").mkdir()
    _write_tar(tmp_path / "a.tar", [_member("a", data=b"a")])
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "a.tar"), str(tmp_path / "dir"), str(tmp_path / "ds")),
                          "several SRC must all be archives")
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "a.tar"), str(tmp_path / "a.tar"),
                                  str(tmp_path / "ds")), f"the archive '{tmp_path / 'a.tar'}' is given twice")
    (tmp_path / "b.tar").symlink_to(tmp_path / "a.tar")
    assert_one_line_error(run_cli("fanstore-pack", str(tmp_path / "a.tar"), str(tmp_path / "b.tar"),
                                  str(tmp_path / "ds")),
                          f"the archive '{tmp_path / 'b.tar'}' is given twice (as '{tmp_path / 'a.tar'}' too)")


def _shards(tree: Path, into: Path, count: int) -> list[Path]:
    """WebDataset-style shards: the tree's files dealt out in path order, each shard a tar of its share."""
    files = sorted((p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()),
                   key=lambda p: p.relative_to(tree).as_posix().encode())
    into.mkdir()
    shards = []
    per_shard = -(-len(files) // count)
    for number in range(count):
        shard = into / f"train-{number:06d}.tar"
        with tarfile.open(shard, "w") as tar:
            for path in files[number * per_shard : (number + 1) * per_shard]:
                tar.add(path, arcname=path.relative_to(tree).as_posix())
        shards.append(shard)
    return shards


def test_several_archives_and_a_glob_of_shards_pack_into_one_dataset(tree, tmp_path):
    shards = _shards(tree, tmp_path / "shards", 3)
    _pack(str(tmp_path / "shards" / "train-*.tar"), tmp_path / "globbed")
    _pack(shards, tmp_path / "listed")
    assert dir_bytes(tmp_path / "globbed") == dir_bytes(tmp_path / "listed")
    with open_dataset(tmp_path / "globbed") as ds:
        files = {path: digest for path, digest in dataset_digest(ds).items() if digest != "dir"}
    expected = {path: digest for path, digest in tree_digest(tree).items()
                if digest != "dir" and not digest.startswith("link:")}
    assert files == expected


RESUME_ARGS = ["--codec", "zstd:1", "--chunk-size", "64KiB", "--replicate", "val/**", "--workers", "2",
               "--blocks-above", "256KiB", "--block-size", "64KiB", "--quiet"]


@pytest.fixture(scope="module")
def shuffled_tgz(tree, tmp_path_factory) -> Path:
    return _shuffled_tar(tree, tmp_path_factory.mktemp("resume") / "src.tar.gz", seed=9)


@pytest.mark.parametrize("event", ["planned", "chunk:3", "chunk:20", "index"])
def test_an_interrupted_pack_of_an_archive_resumes_byte_identical(shuffled_tgz, tmp_path, paused_pack, event):
    run_cli("fanstore-pack", str(shuffled_tgz), str(tmp_path / "reference"), *RESUME_ARGS, check=True)
    paused_pack(shuffled_tgz, tmp_path / "ds", RESUME_ARGS, event).kill_group()
    assert not (tmp_path / "ds" / "fanstore.index").exists()
    resumed = run_cli("fanstore-pack", str(shuffled_tgz), str(tmp_path / "ds"), *RESUME_ARGS, check=True)
    if event.startswith("chunk:"):
        assert f"{event.split(':')[1]} chunks kept from the interrupted run" in resumed.stdout
    assert dir_bytes(tmp_path / "ds") == dir_bytes(tmp_path / "reference")
    again = run_cli("fanstore-pack", str(shuffled_tgz), str(tmp_path / "ds"), *RESUME_ARGS, check=True)
    assert "nothing to do" in again.stdout


def test_an_interrupted_pack_of_a_tar_with_hard_links_resumes_byte_identical(tmp_path, paused_pack):
    src = tmp_path / "src"
    src.mkdir()
    for number in range(30):
        path = src / f"d{number % 3}" / f"f{number:02d}.bin"
        path.parent.mkdir(exist_ok=True)
        if number % 3 == 2:
            os.link(src / f"d{(number - 1) % 3}" / f"f{number - 1:02d}.bin", path)
        else:
            path.write_bytes(_content(number) * 5)
    archive = tmp_path / "linked.tar.gz"
    subprocess.run(["tar", "-z", "-C", str(src), "-cf", str(archive), "."], check=True)
    args = ["--chunk-size", "64KiB", "--workers", "1", "--codec", "zstd:3", "--quiet"]
    run_cli("fanstore-pack", str(archive), str(tmp_path / "reference"), *args, check=True)
    paused_pack(archive, tmp_path / "ds", args, "chunk:2").kill_group()
    resumed = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), *args[:-1], check=True)
    assert "2 chunks kept from the interrupted run" in resumed.stdout
    assert dir_bytes(tmp_path / "ds") == dir_bytes(tmp_path / "reference")
    with open_dataset(tmp_path / "ds") as ds:
        assert dataset_digest(ds) == tree_digest(src)


def test_a_changed_archive_is_not_resumed_over(shuffled_tgz, tmp_path, paused_pack):
    archive = tmp_path / "copy.tar.gz"
    shutil.copy(shuffled_tgz, archive)
    paused_pack(archive, tmp_path / "ds", RESUME_ARGS, "chunk:3").kill_group()
    os.utime(archive, (MTIME, MTIME))  # another archive file now, as far as anyone can tell
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), *RESUME_ARGS)
    assert_one_line_error(proc, "--force")


def _sampled(dest: Path) -> list[tuple]:
    """What the selector measured, without its timings: which bytes it sampled, and how each codec stored them."""
    from fanstore.core.index import Index

    measurements = Index.load(dest).meta["selection"]["measurements"]
    return sorted((m["kind"], m["spec"], m["raw_files"], m["raw_bytes"], m["stored_bytes"]) for m in measurements)


@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "shuffled"])
def test_codec_auto_samples_an_archive_as_its_extracted_directory(tree, tmp_path, shuffled):
    archive = (_shuffled_tar(tree, tmp_path / "src.tar.gz", seed=3) if shuffled
               else _tar(tree, tmp_path / "src.tar.gz", "-z"))
    extracted = _extract_tar(archive, tmp_path / "extracted")
    auto = ["--codec", "auto", "--budget", "50MB/s", "--sample", "0.5", "--seed", "4"]
    _pack(extracted, tmp_path / "from_dir", *auto)
    _pack(archive, tmp_path / "from_tar", *auto)
    assert _sampled(tmp_path / "from_tar") == _sampled(tmp_path / "from_dir")
    assert sum(m[3] for m in _sampled(tmp_path / "from_tar")) > 0
    with open_dataset(tmp_path / "from_tar") as ds:
        assert dataset_digest(ds) == tree_digest(tree)


def test_a_dictionary_codec_trains_on_an_archive_as_on_its_extracted_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(8)
    words = [bytes(rng.integers(97, 123, 6, np.uint8)) for _ in range(200)]
    for number in range(300):
        record = b"{" + b", ".join(b'"%s": %d' % (words[(number * 7 + k) % 200], k) for k in range(40)) + b"}"
        (src / f"r{number:04d}.json").write_bytes(record)
    for path in list(src.iterdir()) + [src]:
        os.utime(path, (MTIME, MTIME))
    archive = _tar(src, tmp_path / "src.tar.zst", "--zstd")
    extracted = _extract_tar(archive, tmp_path / "extracted")
    _pack(extracted, tmp_path / "from_dir", "--codec", "zstd-dict:3")
    _pack(archive, tmp_path / "from_tar", "--codec", "zstd-dict:3")
    assert dir_bytes(tmp_path / "from_tar") == dir_bytes(tmp_path / "from_dir")
    info = run_cli("info", str(tmp_path / "from_tar"), check=True).stdout
    assert "zstd-dict:3" in info


def test_a_sparse_member_is_refused_with_a_warning(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse.bin", "wb") as sparse:
        sparse.truncate(4 << 20)
        sparse.seek(0, os.SEEK_END)
        sparse.write(b"end")
    (src / "ok.txt").write_text("ok")
    archive = _tar(src, tmp_path / "sparse.tar", "--sparse")
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "sparse.bin: is a sparse file in the archive" in proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["ok.txt"]


@pytest.mark.parametrize("root_name", [".", "./", "./.", ""])
@pytest.mark.parametrize("kind", ["file", "symlink", "hard link"])
def test_a_member_at_the_root_that_is_not_a_directory_is_skipped_with_a_warning(tmp_path, root_name, kind):
    """A member named '.' (or './', or nothing) is the dataset's root, which is a directory: one that is a file, a
    link or a hard link is refused with a warning, as tar -x refuses it, not taken for the root (that crashed the
    index with a traceback, and an empty-named file vanished unreported)."""
    members = [_member("ok.txt", data=b"ok")]
    members.append({"file": _member(root_name, data=b"the root as a file"),
                    "symlink": _member(root_name, tarfile.SYMTYPE, link="ok.txt"),
                    "hard link": _member(root_name, tarfile.LNKTYPE, link="ok.txt")}[kind])
    archive = _write_tar(tmp_path / "dotroot.tar", members)
    proc = run_cli("fanstore-pack", str(archive), str(tmp_path / "ds"), "--quiet")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"warning: skipped .: is a {kind} in dotroot.tar, where the dataset's root, a directory, lies" in \
        proc.stderr, proc.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.listdir("") == ["ok.txt"] and ds.read("ok.txt") == b"ok"
    if kind == "file" and root_name == ".":
        zipped = tmp_path / "dotroot.zip"
        with zipfile.ZipFile(zipped, "w") as archive_zip:
            archive_zip.writestr("ok.txt", b"ok")
            archive_zip.writestr(".", b"the root as a file")
        proc = run_cli("fanstore-pack", str(zipped), str(tmp_path / "zds"), "--quiet")
        assert proc.returncode == 0 and "is a file in dotroot.zip" in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["as given", "by a pattern"])
def test_a_fifo_as_src_is_refused_in_one_line_not_waited_on(tmp_path, how):
    """A fifo named like an archive (given, or matched by 'shards/*.tar') blocked the pack's first open forever,
    waiting for a writer; a directory's walk skips fifos, and SRC refuses them by name."""
    shards = tmp_path / "shards"
    shards.mkdir()
    _write_tar(shards / "a.tar", [_member("ok.txt", data=b"ok")])
    os.mkfifo(shards / "b.tar")
    src = str(shards / "b.tar") if how == "as given" else str(shards / "*.tar")
    proc = run_cli("fanstore-pack", src, str(tmp_path / "ds"), "--quiet", timeout=60)
    assert_one_line_error(proc, "b.tar", "is a fifo")
