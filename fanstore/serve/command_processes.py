"""Every process a rank's COMMAND started, found and ended with it.

Signalling the command alone is not enough: a shell script's children outlive the shell killed by SIGTERM, and a
process the command left running in the background holds the rank's stdout and stderr open, so mpiexec waits for it
(a job whose command was `sh -c '(sleep 123) & echo hi'` ended after 123 s, SIGTERM to mpiexec or not). So the rank
ends the command's processes itself, as a batch system ends a job step's: on a stop, each gets SIGTERM, then SIGKILL
after the grace; when the command has ended, whatever it left running gets the same. A rank killed outright cannot:
its watchdog (watchdog.py, which imports this module) does it for it.

A process of the command is one whose environment holds the rank's COMMAND_TOKEN, a value the rank makes at its
start and gives its watchdog too (its pid and random bytes: ranks on one host share paths when each has a mount
namespace of its own, so no path would do): inherited through fork and exec, it still marks a child that left the
command's process group or session, or was orphaned. A process that cleared its environment is not found (nor one
of another user, whose environment this rank cannot read).

The command's environment is the rank's, less the launcher's wire-up of this rank (PMI_FD, PMI_RANK, PMIX_*...):
the rank's MPI library took that connection at its start, and a command that imports mpi4py (many training scripts
do, to find their rank) failed in MPI_Init on it ("PMI_Init failed" under MPICH; under Open MPI it joined the job
as the rank a second time, and a rank died of SIGSEGV). Without it, MPI in the command starts alone (a singleton);
the rank and size it runs for are FANSTORE_RANK and FANSTORE_SIZE. The launcher's settings (MPIR_CVAR_*, I_MPI_*,
PMIX_MCA_*, SLURM_*: an srun in the command needs those) stay.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from typing import Mapping

log = logging.getLogger("fanstore.serve")

COMMAND_TOKEN = "FANSTORE_COMMAND_TOKEN"  # the variable, in the command's environment
STOP_GRACE = 10.0  # seconds a process of the command gets between SIGTERM and SIGKILL
_POLL_SECONDS = 0.05


# The launcher's connection to this rank: PMI-1 and PMI-2 (MPICH's Hydra, Slurm, Intel MPI), PMIx (Slurm, Open MPI
# 5), Hydra's and Open MPI's rank layout; PMIx's own settings (PMIX_MCA_*, PMIX_PREFIX) are kept.
_WIRE_UP_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "OMPI_MCA_orte_", "OMPI_MCA_ess_", "OMPI_MCA_pmix_")
_SETTINGS_PREFIXES = ("PMIX_MCA_", "PMIX_PREFIX")
_WIRE_UP_NAMES = frozenset({"MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_UNIVERSE_SIZE"})


def command_environment(environ: Mapping[str, str], added: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: `environ` less the launcher's wire-up of this rank, with `added` (FANSTORE_*)."""
    kept = {name: value for name, value in environ.items()
            if not (name.startswith(_WIRE_UP_PREFIXES) and not name.startswith(_SETTINGS_PREFIXES))
            and name not in _WIRE_UP_NAMES}
    return {**kept, **added}


def new_token() -> str:
    """A value for COMMAND_TOKEN: this process's pid and random bytes."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def marker_of(token: str) -> bytes:
    """The environment entry that marks a process of the command given `token`."""
    return f"{COMMAND_TOKEN}={token}".encode()


def command_processes(marker: bytes) -> list[int]:
    """The processes (other than this one) whose environment holds `marker`, a NAME=VALUE entry."""
    own = os.getpid()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError as exc:  # out of descriptors, say: the rank goes on ending, without this sweep
        log.warning("cannot look for the command's processes in /proc: %s; any still running are left", exc)
        return []
    for name in names:
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                entries = environ.read().split(b"\0")
        except OSError:  # ended meanwhile, a kernel thread, or another user's
            continue
        if marker in entries:
            found.append(int(name))
    return found


def end_command_processes(marker: bytes, grace: float) -> list[int]:
    """SIGTERM to every process of the command still running, then SIGKILL to those left after `grace` seconds.
    Returns those that had to be killed."""
    _signal_each(command_processes(marker), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (left := command_processes(marker)) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    _signal_each(left, signal.SIGKILL)
    return left


def _signal_each(pids: list[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass
