"""What a rank does while its mount is up, and how the ranks end together: agree that every rank mounted, run the
job's COMMAND (or write the ready file and wait for a signal), then agree on the job's status.

An agreement is a collective, and a collective waits for every rank: a node that died or lost its link for good
would hold the others until TCP gives up, about 15 minutes later. So while a rank waits for the last agreement it
watches the ranks that agreement needs (PeerWatch): rank 0 pings every other rank, the others ping rank 0, every
peer deadline. A rank none of whose pings were answered for LOST_DEADLINES deadlines is lost. Rank 0 then names the
lost ranks in one line and sends the ranks it still hears the job's status (a verdict), which end with it; a rank
that loses rank 0 ends alone, naming it. None of them calls MPI_Finalize, which would wait for the lost: the node
process leaves without it (node.run), its mount removed and its watchdog told.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..core.durable import write_atomically
from ..errors import ChunkError, quoted, say_line
from . import node_endpoint
from .early_end import EarlyEnd
from .command_processes import COMMAND_TOKEN, STOP_GRACE, command_environment, end_command_processes, marker_of
from .transport import PeerTransport

log = logging.getLogger("fanstore.serve")

AGREE_TIMEOUT = 600.0  # seconds the final agreement waits after a signal before the rank leaves without it
LOST_DEADLINES = 6  # peer deadlines (--peer-timeout) a rank may leave every ping unanswered before it is lost


class PeerWatch:
    """Pings `peers` every `every` seconds through the transport (never two at once to one peer) and tells which
    have answered none for `lost_after` seconds. The answers come from the MPI thread: `_answered_at` is written
    there and read here, under `_lock`."""

    def __init__(self, transport: PeerTransport, peers: Sequence[int], every: float, lost_after: float) -> None:
        self._transport = transport
        self._every, self._lost_after = every, lost_after
        now = time.monotonic()
        self._answered_at = {peer: now for peer in peers}
        self._asking: set[int] = set()
        self._next = now
        self._lock = threading.Lock()

    def lost(self) -> list[int]:
        """The peers silent for too long; pings the others when their turn has come."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._every
            with self._lock:
                due = [peer for peer in self._answered_at if peer not in self._asking]
                self._asking.update(due)
            for peer in due:
                self._transport.ping(peer, functools.partial(self._answer, peer))
        with self._lock:
            return sorted(peer for peer, at in self._answered_at.items() if now - at > self._lost_after)

    def _answer(self, peer: int, answer: bytes | memoryview | None, _error: ChunkError | None) -> None:
        with self._lock:
            self._asking.discard(peer)
            if answer is not None:
                self._answered_at[peer] = time.monotonic()


class Lifecycle:
    """What runs while the mount is up: agree with every rank that each mounted, run COMMAND (or write the ready file
    and wait for a signal), then agree with every rank on the job's status. A rank that could not mount takes part
    in both agreements all the same (`without_mount`), so the job still ends together, each rank with one line."""

    def __init__(self, transport: PeerTransport, command: Sequence[str], mountpoint: Path, ready_file: Path,
                 endpoint: Path, hosts: Sequence[str], token: str, early: EarlyEnd | None = None) -> None:
        """`token`: what marks the command's processes (command_processes.py; the rank's watchdog has it too).
        `early`: how the ranks end on a signal before every rank agreed that all mounted (closed once they did)."""
        self.transport = transport
        self.token = token
        self.endpoint = endpoint
        self.command = tuple(command)
        self.hosts = list(hosts)  # each rank's host name, to name a lost one
        self.mountpoint = mountpoint
        self.ready_file = ready_file
        self.early = early
        self.started = False  # the agreements have begun on this rank
        self.agreed = False
        self.interrupted = False  # a signal came before every rank agreed that all mounted: EarlyEnd ends the job

    def __call__(self, stop: threading.Event) -> int:
        self.started = True
        lowest = self._agree_mounted(True, stop)
        if lowest is None:
            return 128 + signal.SIGTERM
        if lowest < self.transport.size:
            say_line(f"fanstore serve: error: rank {self.transport.rank}: rank {lowest} could not mount (see its "
                     f"message); stopping")
            status = 1
        else:
            status = self._run_command(stop) if self.command else self._wait_for_signal(stop)
        return self._agree_status(status, stop)

    def without_mount(self, status: int) -> int:
        """This rank could not mount (it said why): it takes part in the agreements the mounted ranks make, so that
        they stop at once and every rank ends MPI properly. The job's status."""
        self.started = True
        stop = threading.Event()
        if self._agree_mounted(False, stop) is None:
            return 128 + signal.SIGTERM
        return self._agree_status(status, stop)

    def _agree_mounted(self, mounted: bool, stop: threading.Event) -> int | None:
        """The lowest rank that could not mount, or the job's size when every rank did (an Iallreduce); None, and
        `interrupted`, when a signal came first, on every rank alike.

        A rank signalled while it waits cannot leave the Iallreduce alone: posted by every rank, it completes on
        the others, which would go on without it. It leaves when told that a rank ended before posting (that one
        never will; `EarlyEnd.told`), or else takes part in a second Iallreduce, of whether any rank was signalled
        by then, which every rank that got here makes. Without a relay (MPI_THREAD_SERIALIZED) a signal is as good
        as told."""
        from mpi4py import MPI

        mine = np.array([self.transport.size if mounted else self.transport.rank], dtype=np.int32)
        lowest = np.zeros(1, dtype=np.int32)
        everyone = self.transport.collective(lambda comm: (
            comm.Iallreduce([mine, MPI.INT32_T], [lowest, MPI.INT32_T], op=MPI.MIN), lambda: int(lowest[0])))
        told = self.early.told if self.early is not None and self.early.relaying else stop.is_set
        if not _wait(everyone, told):
            self.interrupted = True
            return None
        signalled = np.array([stop.is_set()], dtype=np.int8)
        anyone = np.zeros(1, dtype=np.int8)
        any_signalled = self.transport.collective(lambda comm: (
            comm.Iallreduce([signalled, MPI.INT8_T], [anyone, MPI.INT8_T], op=MPI.MAX), lambda: bool(anyone[0])))
        if _wait(any_signalled, lambda: False) and any_signalled.result():
            self.interrupted = True
            return None
        if self.early is not None:
            self.early.close()  # from here a signal is this lifecycle's
        return everyone.result()

    def _agree_status(self, status: int, stop: threading.Event) -> int:
        """The worst status of every rank (an Iallreduce). Without it: rank 0's verdict, when some ranks are lost
        (see the module's docstring), or this rank's own status (at least 1) when it cannot wait for the others."""
        from mpi4py import MPI

        rank, size = self.transport.rank, self.transport.size
        lost_for_good = self.transport.remote.lost_peers()
        if lost_for_good:  # a collective would post to them: end without it
            return self._end_without_lost(lost_for_good, status)
        mine = np.array([status], dtype=np.int32)
        worst = np.zeros(1, dtype=np.int32)
        everyone = self.transport.collective(lambda comm: (
            comm.Iallreduce([mine, MPI.INT32_T], [worst, MPI.INT32_T], op=MPI.MAX), lambda: int(worst[0])))
        timeout = self.transport.options.timeout
        watch = PeerWatch(self.transport, [peer for peer in range(1, size)] if rank == 0 else [0], timeout,
                          LOST_DEADLINES * timeout) if size > 1 else None
        stopped_at = None
        while True:
            try:
                worst_status = everyone.result(timeout=0.25)
                self.agreed = True
                return worst_status
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the transport gone: leave without the others
                return status or 1
            verdict = self.transport.verdict
            if verdict is not None:
                say_line(f"fanstore serve: error: rank {rank} on {self._host(rank)}: {verdict[2]}")
                return max(status, verdict[1]) or 1
            lost_for_good = self.transport.remote.lost_peers()
            if lost_for_good:
                return self._end_without_lost(lost_for_good, status)
            lost = watch.lost() if watch is not None else []
            if lost:
                return self._end_without(lost, status, LOST_DEADLINES * timeout)
            if stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > AGREE_TIMEOUT:
                    return status or 1

    def _end_without(self, lost: list[int], status: int, silent: float) -> int:
        """Some ranks have stopped answering: say which, tell the others (rank 0), and end without agreeing."""
        rank = self.transport.rank
        named = ", ".join(f"rank {peer} ({self._host(peer)})" for peer in lost[:10]) + \
            (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
        reason = f"{named} answered nothing for {silent:g} s after this rank's command ended"
        if rank == 0:
            for peer in sorted(set(range(1, self.transport.size)) - set(lost)):
                self.transport.send_verdict(peer, 1, f"rank 0 ended the job without {named}, which stopped "
                                                     f"answering; its status is unknown")
        say_line(f"fanstore serve: error: rank {rank} on {self._host(rank)}: {reason}; ending the job without "
                 f"{'them' if len(lost) > 1 else 'it'}")
        return status or 1

    def _end_without_lost(self, lost: list[int], status: int) -> int:
        """This rank lost peers for good during the job (remote_blobs.py): it cannot take part in the closing
        agreement, which would post to them, so it tells every rank it still hears the job's status (a verdict,
        which they end with, wherever they wait) and ends, naming them."""
        rank = self.transport.rank
        named = ", ".join(f"rank {peer} ({self._host(peer)})" for peer in lost[:10]) + \
            (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
        reason = f"rank {rank} lost {named} during the job (no answer for too long); its status is unknown"
        for peer in sorted(set(range(self.transport.size)) - set(lost) - {rank}):
            self.transport.send_verdict(peer, 1, reason)
        say_line(f"fanstore serve: error: rank {rank} on {self._host(rank)}: lost {named} during the job (no answer "
                 f"for too long); ending the job without {'them' if len(lost) > 1 else 'it'}")
        return status or 1

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else "an unknown host"

    def _run_command(self, stop: threading.Event) -> int:
        rank, size = self.transport.rank, self.transport.size
        env = command_environment(os.environ, {"FANSTORE_MOUNT": str(self.mountpoint), "FANSTORE_RANK": str(rank),
                                               "FANSTORE_SIZE": str(size), node_endpoint.ENVIRONMENT: str(self.endpoint),
                                               COMMAND_TOKEN: self.token})
        try:
            command = subprocess.Popen(list(self.command), env=env)
        except OSError as exc:
            say_line(f"fanstore serve: rank {rank}: cannot run {quoted(self.command[0])}: {exc.strerror}")
            # As a shell says it, which batch scripts test: 127 not found, 126 found but not runnable.
            return 127 if isinstance(exc, FileNotFoundError) else 126
        marker = marker_of(self.token)
        while True:
            try:
                code = command.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stop.is_set():  # the command and every process it started (command_processes.py)
                    end_command_processes(marker, STOP_GRACE)
                    code = command.wait()
                    break
        left = end_command_processes(marker, STOP_GRACE)  # what it left running would hold the job's output open
        if left:
            log.warning("rank %d: %d process(es) the command left running did not end on SIGTERM within %g s: "
                        "killed", rank, len(left), STOP_GRACE)
        return code if code >= 0 else 128 - code

    def _wait_for_signal(self, stop: threading.Event) -> int:
        # The mount point, the process serving it (to signal it, or to find it in a listing), and the socket of
        # the node's readers (fanstore.torch: FANSTORE_SERVE_SOCKET).
        try:
            write_atomically(self.ready_file, f"{self.mountpoint}\n{os.getpid()}\n{self.endpoint}\n".encode())
        except OSError as exc:  # checked at start; a full disk, say: a batch script would wait for it for good
            say_line(f"fanstore serve: error: rank {self.transport.rank}: cannot write the ready file "
                     f"{self.ready_file}: {exc.strerror}; stopping")
            return 1
        try:
            stop.wait()
        finally:
            try:
                self.ready_file.unlink()
            except FileNotFoundError:
                pass
        return 0


def _wait(future: Any, given_up: Callable[[], bool]) -> bool:
    """Whether `future` completed before `given_up()`."""
    while not given_up():
        try:
            future.result(timeout=0.2)
            return True
        except TimeoutError:
            continue
    return False


