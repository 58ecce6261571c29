"""scripts/serve-mpiexec.sh as a user runs it: from a shell where the venv is not active, and however it ends (done,
failed, Ctrl-C, SIGTERM mid-job) it leaves no temporary directory, mount or process behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, make_tree, wait_until
from fanstore import PackOptions, pack
from fanstore.mount.mount import fuse_unavailable_reason

SCRIPT = REPO / "scripts" / "serve-mpiexec.sh"
VENV_BIN = REPO / ".venv" / "bin"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # no venv on it


def _missing_part() -> str | None:
    for command in ("fanstore", "mpiexec"):
        if not (VENV_BIN / command).exists():
            return f"no {VENV_BIN / command}: this checkout was not set up by scripts/setup"
    if subprocess.run([VENV_BIN / "python", "-c", "import mpi4py"], capture_output=True).returncode != 0:
        return "mpi4py is not importable in .venv"
    return fuse_unavailable_reason()


_MISSING = _missing_part()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"needs the venv's MPI and FUSE: {_MISSING}")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    dest = tmp_path / "dataset"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3", workers=1))
    return dest


def _start(dataset: Path, tmp_path: Path, path: str = SYSTEM_PATH) -> tuple[subprocess.Popen, Path]:
    """The script, in a session of its own, making its temporary directory in a fresh TMPDIR."""
    temporary = tmp_path / "tmp"
    temporary.mkdir(exist_ok=True)
    env = {"PATH": path, "HOME": str(tmp_path), "TMPDIR": str(temporary), "LANG": "C.UTF-8"}
    script = subprocess.Popen([SCRIPT, dataset, "2"], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return script, temporary


def _left_behind(script: subprocess.Popen, temporary: Path) -> list[str]:
    """What the script's run left: files in its TMPDIR, FUSE mounts under it, processes of its session."""
    left = [f"file {name}" for name in os.listdir(temporary)]
    with open("/proc/self/mountinfo") as mountinfo:
        left += [f"mount {line.split()[4]}" for line in mountinfo if str(temporary) in line.split()[4]]
    return left + [f"process {process}" for process in _session_processes(script)]


def _session_processes(script: subprocess.Popen) -> list[str]:
    """Each process of the script's session, with its state and command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == script.pid:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid} {state} {command.strip()[:200]}")
        except OSError:  # ended meanwhile
            pass
    return found


def _cleanup(script: subprocess.Popen, temporary: Path) -> None:
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo if str(temporary) in line.split()[4]]
    for point in points:
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
    try:
        os.killpg(script.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_runs_without_the_venv_on_path_and_cleans_up(dataset: Path, tmp_path: Path) -> None:
    """No .venv/bin on PATH (nor any mpiexec): the script finds the venv's fanstore and mpiexec itself, every rank
    sees every file, and its temporary directory is gone afterwards."""
    script, temporary = _start(dataset, tmp_path)
    try:
        output, _ = script.communicate(timeout=180)
        assert script.returncode == 0, output
        files = sum(1 for path in (tmp_path / "src").rglob("*") if path.is_file() and not path.is_symlink())
        for rank in (0, 1):
            assert f"rank {rank} of 2 sees {files} files" in output, output
        assert _left_behind(script, temporary) == []
    finally:
        _cleanup(script, temporary)


def test_a_failed_job_cleans_up(tmp_path: Path) -> None:
    """A job that fails (no such dataset) passes on its status and still removes its temporary directory."""
    script, temporary = _start(tmp_path / "no-such-dataset", tmp_path)
    try:
        output, _ = script.communicate(timeout=180)
        assert script.returncode != 0, output
        assert "no-such-dataset" in output
        assert _left_behind(script, temporary) == []
    finally:
        _cleanup(script, temporary)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_job_ends_it_and_cleans_up(dataset: Path, tmp_path: Path, signal_number: int) -> None:
    """Ctrl-C or SIGTERM while every rank is mounted and running its command: the job ends, its mounts are gone,
    and so is the temporary directory, within seconds. The ranks' `find` is a stand-in that says it has started
    and then waits, so the signal comes while the job is surely at that point."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    started = tmp_path / "started"
    started.mkdir()
    (stand_ins / "find").write_text(f'#!/bin/sh\ntouch {started}/"$FANSTORE_RANK"\nexec sleep 300\n')
    (stand_ins / "find").chmod(0o755)
    script, temporary = _start(dataset, tmp_path, path=f"{stand_ins}:{SYSTEM_PATH}")
    try:
        wait_until(lambda: len(os.listdir(started)) == 2 or script.poll() is not None, "both ranks running", 120)
        assert script.poll() is None, script.communicate()[0]
        os.kill(script.pid, signal_number)
        try:
            output, _ = script.communicate(timeout=60)
        except subprocess.TimeoutExpired as timed_out:  # say what still ran, and what the job printed, not only that
            pytest.fail(f"the script did not end within 60 s of its signal; still running: "
                        f"{_session_processes(script)}; it printed: {timed_out.output!r}")
        assert script.returncode == 128 + signal_number, output
        wait_until(lambda: _left_behind(script, temporary) == [], "nothing left behind", 10)
    finally:
        _cleanup(script, temporary)
