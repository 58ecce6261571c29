"""tar_headers.TarHeaders reads what tarfile reads, from archives the tar command writes in each of its formats."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from fanstore.pack.tar_headers import HeaderDamage, TarHeaders


def _awkward_tree(root: Path) -> Path:
    """Names and targets past the 100 bytes of a v7 name, past ustar's 255, not UTF-8, in other scripts."""
    deep = root / ("d" * 90) / ("e" * 90) / ("f" * 90)
    deep.mkdir(parents=True)
    (deep / ("g" * 120 + ".txt")).write_bytes(b"long name\n" * 30)
    (root / "名前 with spaces.txt").write_text("unicode\n")
    (root / os.fsdecode(b"latin1-\xe9.bin")).write_bytes(b"\x00\x01" * 700)
    (root / "empty").write_bytes(b"")
    os.symlink("d" * 90 + "/" + "e" * 90 + "/" + "f" * 90, root / "link")
    os.mkfifo(root / "fifo")
    os.link(root / "empty", root / "hard")
    os.utime(root / "empty", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    return root


@pytest.fixture(scope="module")
def awkward(tmp_path_factory) -> Path:
    return _awkward_tree(tmp_path_factory.mktemp("tarfmt") / "src")


def _tarfile_listing(archive: Path) -> list[tuple]:
    with tarfile.open(archive) as tar:
        return [(info.offset_data, info.name, info.type if info.type != tarfile.AREGTYPE else tarfile.REGTYPE,
                 info.mode, info.size if info.isreg() else 0, int(info.mtime), info.linkname)
                for info in tar]


def _fast_listing(archive: Path) -> list[tuple]:
    with open(archive, "rb") as stream:
        return [(h.offset_data, h.name, h.typeflag if h.typeflag != b"\0" else b"0", h.mode,
                 h.size if h.typeflag in (b"0", b"\0", b"7") else 0, h.mtime_ns // 1_000_000_000, h.linkname)
                for h in TarHeaders(stream, os.path.getsize(archive))]


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar", "v7", "oldgnu"])
def test_the_headers_read_as_tarfile_reads_them(awkward, tmp_path, fmt):
    archive = tmp_path / f"{fmt}.tar"
    proc = subprocess.run(["tar", f"--format={fmt}", "--sort=name", "-C", str(awkward), "-cf", str(archive), "."],
                          capture_output=True)
    if proc.returncode != 0:  # ustar and v7 cannot hold every name: tar skips those and says so
        assert fmt in ("ustar", "v7"), proc.stderr
    expected = [(offset, name, kind.decode("latin1") if isinstance(kind, bytes) else kind, *rest)
                for offset, name, kind, *rest in _tarfile_listing(archive)]
    got = [(offset, name, kind.decode("latin1"), *rest) for offset, name, kind, *rest in _fast_listing(archive)]
    assert got == expected
    assert len(got) >= 5


def test_a_pax_mtime_keeps_its_nanoseconds(awkward, tmp_path):
    archive = tmp_path / "pax.tar"
    subprocess.run(["tar", "--format=posix", "-C", str(awkward), "-cf", str(archive), "empty"], check=True)
    with open(archive, "rb") as stream:
        (header,) = list(TarHeaders(stream, os.path.getsize(archive)))
    assert header.mtime_ns == 1_700_000_000_123_456_789


def test_a_flipped_header_byte_is_damage_at_that_header(awkward, tmp_path):
    archive = tmp_path / "gnu.tar"
    subprocess.run(["tar", "--format=gnu", "--sort=name", "-C", str(awkward), "-cf", str(archive), "."], check=True)
    offsets = [offset - 512 for offset, *_ in _fast_listing(archive)]
    data = bytearray(archive.read_bytes())
    data[offsets[2] + 10] ^= 0x01
    archive.write_bytes(bytes(data))
    with open(archive, "rb") as stream:
        headers = TarHeaders(stream, len(data))
        with pytest.raises(HeaderDamage) as damage:
            list(headers)
    assert damage.value.offset <= offsets[2]
