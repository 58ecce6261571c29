"""bench/bench_scale.py at two tiny sizes, for real: the tar it writes is tarfile's, its figures exist and agree
with the generated dataset (counts that `ls` and `find` print through the mount and on the plain directory), and it
leaves nothing mounted, running or in the temporary directory. It checks no figure of speed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO, wait_until

sys.path.insert(0, str(REPO / "bench"))
from bench_scale import member_path, write_tar  # noqa: E402
from bench_serve import serve_requirements_missing  # noqa: E402

SIZES, BIG_DIR = (2000, 20000), 1000


def test_the_tar_is_what_tarfile_writes_and_reads(tmp_path: Path) -> None:
    """Members in path order, the big directory first: byte for byte tarfile's ustar headers and data."""
    files, big_dir = 2500, 1200
    write_tar(tmp_path / "fast.tar", files, big_dir, batch=1000)
    with tarfile.open(tmp_path / "slow.tar", "w", format=tarfile.USTAR_FORMAT) as slow:
        for number in range(files):
            info = tarfile.TarInfo(member_path(number, big_dir))
            info.size, info.mtime, info.mode = 10, 1_700_000_000, 0o644
            slow.addfile(info, io.BytesIO(b"0123456789"))
    fast = (tmp_path / "fast.tar").read_bytes()
    assert fast == (tmp_path / "slow.tar").read_bytes()[: len(fast)]
    with tarfile.open(tmp_path / "fast.tar") as archive:
        names = archive.getnames()
    assert names == sorted(names) and len(names) == files
    assert names[big_dir - 1] == f"d00000/f{big_dir - 1:08d}.bin"
    assert names[big_dir] == f"d00001/f{big_dir:08d}.bin" and names[-1] == f"d00002/f{files - 1:08d}.bin"


def _ours(text: str) -> list[str]:
    """Lines of /proc/self/mountinfo and command lines of processes that mention `text`."""
    found = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if text in line]
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command and entry.name != str(os.getpid()):
            found.append(command)
    return found


_MISSING = serve_requirements_missing()
needs_fuse_and_mpi = pytest.mark.skipif(bool(_MISSING), reason=f"needs FUSE and MPI: missing {'; '.join(_MISSING)}")


def _bench(tmp_path: Path, *options: str) -> tuple[list[str], dict[str, str]]:
    """The command line of a tiny run, its cache in tmp_path, and an environment that puts its temporary
    directories (its mount points among them) in tmp_path/tmp."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    return ([sys.executable, str(REPO / "bench" / "bench_scale.py"), "--big-dir", str(BIG_DIR), "--contexts", "fork",
             "--repeats", "1", "--cache", str(tmp_path / "cache"), *options],
            {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temporary)})


@needs_fuse_and_mpi
def test_tiny_sizes_give_real_consistent_figures_and_leave_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
    argv, env = _bench(tmp_path, "--sizes", ",".join(map(str, SIZES)), "--loader-workers", "2", "--plain-max",
                       str(SIZES[0]), "--json", str(tmp_path / "figures.json"))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "figures.json").read_text())
    assert run["sizes"] == list(SIZES) and run["machine"][0].startswith("machine: ")
    for size in SIZES:
        figures = run["results"][str(size)]
        assert [name for name in figures if name.endswith("failed")] == []
        assert figures["files"] == size and figures["pack cached"] is False
        assert figures["mount find count"] == size and figures["mount ls count"] == BIG_DIR
        if size <= SIZES[0]:  # the plain directory only up to --plain-max
            assert figures["plain find count"] == size and figures["plain ls count"] == BIG_DIR
            assert figures["plain find s"] > 0
        else:
            assert not [name for name in figures if name.startswith("plain")]
        index_bytes = (tmp_path / "cache" / f"files-{size}-big-{BIG_DIR}.fanstore" / "fanstore.index").stat().st_size
        assert figures["index B/file"] == pytest.approx(index_bytes / size) and 20 < figures["index B/file"] < 1000
        for name in ("pack s", "pack CPU us/file", "pack max RSS MiB", "open 1st s", "open s", "lookup us",
                     "fork worker floor MiB", "2 fork workers: largest MiB",
                     "serve ready s", "serve rank MiB", "serve rank anon MiB", "plan 4096 s", "plan 4096 CPU s", "mount ls s",
                     "mount find s", "mount find CPU us/entry", "mount find daemon CPU us/entry"):
            assert isinstance(figures[name], float) and figures[name] > 0, (size, name, figures[name])
        assert figures["2 fork workers: all MiB"] >= figures["2 fork workers: largest MiB"]
    # The last table (one is printed as each size ends): the larger size beside the smaller, as a ratio.
    find_row = [line for line in proc.stdout.splitlines() if line.startswith("mount find count")][-1]
    assert find_row.split()[-2:] == ["20,000", "(10.0x)"]
    assert "machine: " in proc.stdout
    # Nothing left: no mount or process of the run, no temporary directory; the cache kept as asked.
    assert _ours(str(tmp_path)) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    assert (tmp_path / "cache" / f"files-{SIZES[0]}-big-{BIG_DIR}.tar").exists()


@needs_fuse_and_mpi
def test_a_run_stopped_while_a_dataset_is_mounted_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM (as Ctrl-C) once serve or the mount is up: the mount is gone, its processes and directories too."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
    argv, env = _bench(tmp_path, "--sizes", "2000", "--loader-workers", "1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        wait_until(lambda: str(tmp_path / "tmp") in Path("/proc/self/mountinfo").read_text() or proc.poll() is not None,
                   "a mount of the run", 120)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and err.strip().splitlines()[-1] == \
        "bench_scale: interrupted; nothing is left mounted or running"
    assert _ours(str(tmp_path)) == []
    assert list((tmp_path / "tmp").iterdir()) == []
