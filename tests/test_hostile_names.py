"""Names a file system allows and people rarely type (a newline, a terminal's escape, a tab, a space at an end),
through every face that shows or takes one: the pack's warnings, verify, info and the errors that name a file."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from pathlib import Path

from conftest import run_cli
from fanstore import open_dataset
from fanstore.core.format import CHUNK_HEADER_LEN, chunk_file_name
from fanstore.errors import shown_path

# Each would split a line, recolour the terminal, or hide at a line's end if printed bare.
HOSTILE = ["new\nline.txt", "esc\x1b[31mred.txt", "tab\there.txt", "trail.txt ", "cr\rname.txt"]


def test_messages_naming_a_hostile_path_stay_one_readable_line(tmp_path: Path) -> None:
    """verify's BAD lines, the pack's and info's skipped paths printed names bare: a newline in a name broke the
    one-line report in two and an escape sequence went to the terminal. Such a name is now quoted; a plain one
    stays bare."""
    src = tmp_path / "src"
    src.mkdir()
    for name in [*HOSTILE, "plain.txt"]:
        (src / name).write_bytes(name.encode() * 50)
    os.mkfifo(src / "fi\nfo")
    dest = tmp_path / "ds"
    packed = run_cli("pack", str(src), str(dest), "--workers", "1", "--codec", "none", check=True)
    assert "warning: skipped 'fi\\nfo': is a fifo" in packed.stderr.splitlines()[0], packed.stderr
    info = run_cli("info", str(dest), check=True)
    assert "  'fi\\nfo': is a fifo; only files, directories and symlinks are packed" in info.stdout.splitlines()
    chunk = dest / chunk_file_name(0)
    damaged = bytearray(chunk.read_bytes())
    damaged[CHUNK_HEADER_LEN:] = bytes(byte ^ 0xFF for byte in damaged[CHUNK_HEADER_LEN:])
    chunk.write_bytes(bytes(damaged))
    verify = run_cli("verify", str(dest))
    lines = verify.stdout.splitlines()
    assert verify.returncode == 1 and len(lines) == len(HOSTILE) + 2, verify.stdout  # one per file, the summary
    for name in HOSTILE:
        assert sum(line.startswith(f"BAD {name!r}: checksum mismatch") for line in lines) == 1, (name, lines)
    assert any(line.startswith("BAD plain.txt: checksum mismatch") for line in lines)
    assert not any(char in verify.stdout + packed.stderr + info.stdout for char in "\x1b\r\t")


def test_a_path_too_long_to_pack_is_named_by_its_ends_in_one_short_line(tmp_path: Path) -> None:
    """An archive member's path past PATH_MAX is skipped with a warning, which printed the whole path: a line of
    5,000 characters. The warning and info's list now show its first and last 60 characters and its length in
    bytes; a path that needs quoting is still quoted."""
    long_path = "/".join(["y" * 200] * 24) + "/" + "z" * 100 + "/last.jpg"
    hostile = "new\nline/" + "w" * 4200 + "/last.jpg"
    archive = tmp_path / "long.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in (long_path, hostile, "ok.txt"):
            member = tarfile.TarInfo(name)
            member.size = 5
            tar.addfile(member, io.BytesIO(b"hello"))
    packed = run_cli("pack", str(archive), str(tmp_path / "ds"), "--workers", "1", check=True)
    length = len(long_path.encode())
    shown = f"{long_path[:60]}...{long_path[-60:]} ({length:,} bytes)"
    warning = f"warning: skipped {shown}: is {length:,} bytes long: a path holds at most 4,096 (PATH_MAX) (in " \
        "long.tar); skipped"
    assert warning in packed.stderr.splitlines(), packed.stderr
    quoted_ends = f"{hostile[:60]!r}...{hostile[-60:]!r} ({len(hostile.encode()):,} bytes)"
    assert f"warning: skipped {quoted_ends}: is {len(hostile.encode()):,} bytes long" in packed.stderr, packed.stderr
    assert max(len(line) for line in packed.stderr.splitlines()) < 300, packed.stderr
    info = run_cli("info", str(tmp_path / "ds"), check=True)
    assert any(line.startswith(f"  {shown}: is {length:,} bytes long") for line in info.stdout.splitlines())
    assert max(len(line) for line in info.stdout.splitlines()) < 300, info.stdout
    with open_dataset(tmp_path / "ds") as ds:
        assert list(ds.files()) == ["ok.txt"]
    assert shown_path("x" * 1024) == "x" * 1024
    assert shown_path("x" * 1025) == f"{'x' * 60}...{'x' * 60} (1,025 bytes)"
    assert shown_path("\u00e9" * 1025) == f"{chr(0xe9) * 60}...{chr(0xe9) * 60} (2,050 bytes)"
    assert shown_path("\udce9" * 1025).endswith("(1,025 bytes)")  # undecodable bytes (surrogateescape), one each


def _zip_with_stored_names(path: Path, names: list[bytes]) -> None:
    """A zip whose members are named by these bytes, without the UTF-8 flag, as Linux's zip writes them: written
    under stand-in names of the same lengths, which are then replaced in the local and the central headers."""
    stand_ins = [f"{number}".rjust(len(name), "_").encode() for number, name in enumerate(names)]
    with zipfile.ZipFile(path, "w") as archive:
        for number, stand_in in enumerate(stand_ins):
            archive.writestr(stand_in.decode(), f"member {number}")
    data = path.read_bytes()
    for stand_in, name in zip(stand_ins, names):
        assert data.count(stand_in) == 2  # the local header and the central one
        data = data.replace(stand_in, name)
    path.write_bytes(data)


def test_zip_names_without_the_utf8_flag_are_read_as_unzip_gives_them(tmp_path: Path) -> None:
    """Linux's zip stores UTF-8 names without the zip's UTF-8 flag, which zipfile then reads as CP437: café.txt was
    packed as 'caf├⌐.txt'. And zipfile cuts a name at a NUL: 'nul\\0b.txt' was packed as 'nul'. Names that are UTF-8
    are now read so, others as CP437 (as the zip spec says), and a NUL is refused by name."""
    archive = tmp_path / "linux.zip"
    _zip_with_stored_names(archive, ["caf\u00e9.txt".encode(), "d/\u65e5\u672c.txt".encode(), b"cp437\x82.txt",
                                     b"nul\0b.txt", b"plain.txt"])
    packed = run_cli("pack", str(archive), str(tmp_path / "ds"), "--workers", "1", check=True)
    assert "warning: skipped 'nul\\x00b.txt': contains a NUL byte" in packed.stderr, packed.stderr
    with open_dataset(tmp_path / "ds") as ds:
        assert sorted(path for _, _, files in ds.walk() for path in files) == \
            sorted(["caf\u00e9.txt", "\u65e5\u672c.txt", "cp437\u00e9.txt", "plain.txt"])
        assert ds.read("caf\u00e9.txt") == b"member 0" and ds.read("cp437\u00e9.txt") == b"member 2"
