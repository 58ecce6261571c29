"""watchdog.py on real processes: a rank killed outright (SIGKILL, a signal it does not handle) has its readers' socket
removed by its watchdog, and a socket of a job that holds the local directory is never removed. (tests/test_serve.py
runs the same through `mpiexec fanstore serve`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, listened_on, wait_until
from fanstore.serve import watchdog
from fanstore.serve.local_dir import LOCK_NAME, WATCHDOG_LOG
from fanstore.serve.node_endpoint import SOCKET_NAME

# A rank as far as its socket goes: it holds its local directory, listens on the readers' socket there and, with
# `watched`, starts its watchdog as a rank does; then says so and waits.
_RANK = """
import socket, sys, time
from pathlib import Path
from fanstore.serve.local_dir import claim_local_dir
from fanstore.serve.node import RankWatchdog
from fanstore.serve.node_endpoint import SOCKET_NAME
local_dir, watched = Path(sys.argv[1]), sys.argv[2] == "watched"
lock = claim_local_dir(local_dir)
listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listening.bind(str(local_dir / SOCKET_NAME))
listening.listen()
if watched:
    guard = RankWatchdog(0, local_dir / "mp", local_dir / "mp.ready", local_dir, "token-" + sys.argv[1])
print("serving", flush=True)
time.sleep(120)
"""


def _start_rank(local_dir: Path, watched: bool) -> subprocess.Popen:
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(local_dir), "watched" if watched else "alone"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rank.stdout.readline().strip() == "serving"
    return rank


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_a_rank_killed_outright_has_its_socket_removed_by_its_watchdog(tmp_path, signal_number):
    """No handler of the rank runs: the socket stayed in --local-dir until the next job there."""
    rank = _start_rank(tmp_path, watched=True)
    try:
        assert listened_on(tmp_path / SOCKET_NAME)
        rank.send_signal(signal_number)
        rank.wait(timeout=10)
    finally:
        rank.kill()
        rank.wait()
    wait_until(lambda: not os.path.lexists(tmp_path / SOCKET_NAME), "the socket removed", 10)
    wait_until(lambda: "removed" in (tmp_path / WATCHDOG_LOG).read_text(), "the watchdog's word", 10)
    assert f"rank gone: removed {tmp_path / SOCKET_NAME}\n" in (tmp_path / WATCHDOG_LOG).read_text()


def test_the_socket_of_a_job_that_holds_the_directory_is_left_alone(tmp_path, monkeypatch):
    """A watchdog whose rank is gone may wake after the next job there has taken the directory and bound its own
    socket: that one serves, and stays; once its job is killed in turn, the socket is no live process's."""
    monkeypatch.setattr(watchdog, "LOCK_WAIT", 0.2)
    socket_path, lock_path = str(tmp_path / SOCKET_NAME), str(tmp_path / LOCK_NAME)
    live = _start_rank(tmp_path, watched=False)
    try:
        watchdog.remove_socket(socket_path, lock_path)
        assert listened_on(tmp_path / SOCKET_NAME)
        live.kill()
        live.wait(timeout=10)
        assert not listened_on(tmp_path / SOCKET_NAME)  # stale: a reader is refused, never served
        watchdog.remove_socket(socket_path, lock_path)
        assert not os.path.lexists(socket_path)
    finally:
        live.kill()
        live.wait()


def test_a_watchdog_whose_log_cannot_take_a_line_still_cleans_up_everything(tmp_path):
    """The log is in --local-dir, which the job's own output may have filled by the time the rank is killed (its
    checkpoints on the node's disk; /dev/full here): the first line it could not write ended the watchdog with an
    OSError, leaving the rank's ready file, its MPI files, its readers' socket and its command's processes (which
    hold the job's output open: mpiexec waits for them)."""
    ready, left, socket_path = tmp_path / "mp.ready", tmp_path / "mpich_shm_left", tmp_path / SOCKET_NAME
    for path in (ready, left, socket_path, tmp_path / LOCK_NAME):  # the lock no process holds: the rank's gone
        path.write_text("")
    token = f"test-{os.getpid()}-{tmp_path.name}"
    command = subprocess.Popen(["sleep", "60"], env={**os.environ, "FANSTORE_COMMAND_TOKEN": token})
    read_end, write_end = os.pipe()
    try:
        with open("/dev/full", "w") as full:
            guard = subprocess.Popen([sys.executable, "-I", "-S", watchdog.__file__, str(read_end),
                                      str(tmp_path / "mp"), str(ready), str(socket_path), str(tmp_path / LOCK_NAME),
                                      token, str(left)],
                                     pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=full, stderr=full)
        os.close(read_end)
        os.close(write_end)  # the rank gone, without a word
        guard.wait(timeout=20)
        assert command.wait(timeout=5) == -signal.SIGTERM
    finally:
        command.kill()
        command.wait()
    assert [path.name for path in (ready, left, socket_path) if os.path.lexists(path)] == []
