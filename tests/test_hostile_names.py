"""Names a file system allows and people rarely type (a newline, a terminal's escape, a tab, a space at an end),
through every face that shows or takes one: the pack's warnings, verify, info and the errors that name a file."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import run_cli
from fanstore.core.format import CHUNK_HEADER_LEN, chunk_file_name

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
