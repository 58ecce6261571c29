"""command_processes.py on real processes: a rank's command's processes are found by the variable in their
environment, wherever they went (their own session, orphaned), and each ends: by SIGTERM, or SIGKILL after the
grace. (tests/test_serve.py runs the same through `mpiexec fanstore serve`.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import wait_until
from fanstore.serve.command_processes import COMMAND_TOKEN, command_environment, command_processes, \
    end_command_processes

# A process that ignores SIGTERM and writes its pid, then waits.
_STUBBORN = "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
            "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"


def _marker(tmp_path) -> tuple[bytes, dict[str, str]]:
    value = f"{os.getpid()}-{tmp_path.name}"
    return f"{COMMAND_TOKEN}={value}".encode(), {**os.environ, COMMAND_TOKEN: value}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_orphan_in_its_own_session_is_found_and_one_that_ignores_sigterm_is_killed(tmp_path):
    marker, env = _marker(tmp_path)
    pid_file = tmp_path / "pid"
    # The shell starts the process in a session of its own and exits: it is nobody's child here any more.
    subprocess.run(["sh", "-c", f'setsid {sys.executable} -c "{_STUBBORN}" {pid_file} >/dev/null 2>&1 &'],
                   env=env, check=True)
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the orphan started", 30)
    orphan = int(pid_file.read_text())
    assert orphan in command_processes(marker)
    assert os.getsid(orphan) != os.getsid(0)
    started = time.monotonic()
    assert end_command_processes(marker, grace=0.5) == [orphan]  # it outlived SIGTERM: killed
    assert time.monotonic() - started < 10
    wait_until(lambda: not _alive(orphan), "the orphan gone", 5)


def test_processes_without_the_marker_are_left_alone(tmp_path):
    marker, env = _marker(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # this test's environment
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        wait_until(lambda: ours.pid in command_processes(marker), "the marked process seen", 10)
        assert other.pid not in command_processes(marker)
        assert end_command_processes(marker, grace=5) == []  # it ended on SIGTERM
        assert ours.wait(timeout=5) == -15
        assert other.poll() is None
    finally:
        for process in (other, ours):
            process.kill()
            process.wait()


def test_the_command_environment_drops_the_launchers_wire_up_of_the_rank_and_keeps_its_settings():
    launched = {"PMI_FD": "9", "PMI_RANK": "1", "PMI_SIZE": "3", "PMIX_NAMESPACE": "job.1", "PMIX_RANK": "1",
                "MPI_LOCALNRANKS": "3", "MPI_LOCALRANKID": "1", "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_UNIVERSE_SIZE": "3", "OMPI_MCA_ess_base_vpid": "1",
                "PMIX_SERVER_URI41": "prterun@0.0;tcp4://127.0.0.1:1",
                "MPIR_CVAR_NOLOCAL": "1", "I_MPI_DEBUG": "5", "OMPI_MCA_btl": "tcp,self", "SLURM_PROCID": "1",
                "PMIX_MCA_gds": "hash", "PMIX_PREFIX": "/opt/pmix", "PATH": "/bin", "FANSTORE_RANK": "7"}
    env = command_environment(launched, {"FANSTORE_RANK": "1", "FANSTORE_SIZE": "3"})
    assert env == {"MPIR_CVAR_NOLOCAL": "1", "I_MPI_DEBUG": "5", "OMPI_MCA_btl": "tcp,self", "SLURM_PROCID": "1",
                   "PMIX_MCA_gds": "hash", "PMIX_PREFIX": "/opt/pmix", "PATH": "/bin", "FANSTORE_RANK": "1",
                   "FANSTORE_SIZE": "3"}
