"""A shared parallel file system under load, simulated: one model process plays Lustre's servers for the whole job,
and each node reads a directory through a FUSE mount of its own that behaves as Lustre's client does.

Why: every other figure of fanstore compares it with a plain directory warm in the local page cache, where plain
files always win. A training job on a cluster reads from a parallel file system whose metadata server is shared
with other jobs; this model lets a bench show what fanstore takes off it, and how much sooner a job ends.

The model (one process, this file with --model), every figure an option, defaults as the issue states them:
  metadata server   a FIFO queue served at --mds-capacity RPCs/s (50,000), of which a share --mds-background
                    (0.7) is taken by other jobs: their RPCs arrive as a Poisson stream, every service time is
                    exponential. An RPC's latency is --mds-floor (0.5 ms: network and processing) + its wait + its
                    service, so it grows as the job and the background load the server. (One server at the whole
                    capacity: a real MDS has many service threads, which queue less at the same load.)
  object servers    --oss-latency per RPC (0.5 ms: flash object servers) + its transfer over --oss-bandwidth
                    (1 GB/s: the job's share, one link shared by every client, FIFO).
The client (this file with --client, one per node):
  - lookup + open + attributes of a file are one intent-open RPC: a lookup the client cannot answer costs one RPC,
    and the first open after it costs nothing more; any other open costs one RPC; close is one RPC, and the close
    call waits for it (FUSE's flush);
  - names and attributes once fetched stay cached (Lustre keeps them under its locks; the data cannot change);
  - data: a page cache of --page-cache bytes per node (LRU over 4 KiB pages; bound it below the node's share of
    the data: switched off, it would be unfair to the direct way at one node). Missing pages travel in RPCs of at
    most --rpc-size (1 MiB, never across a boundary aligned to it, as 1 MiB stripes allow), at most
    --oss-in-flight (8) at once per client; a file of at most --whole-file (2 MiB) is read whole on its first read
    (llite.max_read_ahead_whole_mb), a read that continues the previous one reads --readahead (8 MiB) ahead;
  - at most --mds-in-flight (8) metadata RPCs at once per client (mdc.max_rpcs_in_flight);
  - readdir: one RPC per 1,000 entries listed; statfs and readlink (uncached) one each.
The mount serves the directory read-only with direct_io, so every read reaches the client and its page cache model;
the kernel still caches names and attributes.

Time. The model answers an RPC when its modelled latency has passed, woken by a timerfd (Python's event loops
round their timers to milliseconds). It measures how late its timer wakes at start (p50 and p99 of 500 waits) and
arms it early by the median; the median is the timer's resolution. Where that exceeds a tenth of the smallest
latency configured, --time-scale must be raised (time_scale_needed): every latency is multiplied by it and every
capacity divided by it, so the job runs that many times slower and the timer's error shrinks in proportion (a
bench scales its compute time by the same factor and prints it). What each RPC achieved, as its client saw it,
is reported beside what was configured.

Counters. The model counts every RPC by kind, the bytes read, and the latency each client achieved beside the one
configured, per phase (a phase begins at a mark, or when every rank of a barrier has arrived). A run in which the
model used over half a core (MODEL_CPU_VOID) is marked void: its latencies would be its own.

Usage: python bench/shared_fs.py DIRECTORY MOUNTDIR --nodes N [model and client options]
mounts DIRECTORY at MOUNTDIR/node0 .. node{N-1} until Ctrl-C, then prints what the file system was asked.
bench_cluster.py uses it through SharedFileSystem.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import heapq
import json
import math
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

KIB, MIB = 1024, 1 << 20
PAGE = 4096
MODEL_CPU_VOID = 0.5  # cores: a model this busy answers late
TIMER_ERROR_SHARE = 0.1  # the timer's resolution may be this share of the smallest latency configured
# Replies due within this share of the smallest latency go out in one wake-up: each wake of the model costs it
# 30-40 us of CPU on a virtual machine, the most of what an RPC costs it.
COALESCE_SHARE = 0.05
REPORT_EVERY = 0.25  # seconds between a client's latency reports
START_TIMEOUT = 30.0

# Wire: a message is HEADER (body length, type) and its body. A client's requests are answered by REPLY records.
HEADER = struct.Struct("<IB")
HELLO, REQUEST, SAMPLES, CONTROL, FLUSHED = 1, 2, 3, 4, 5
REQUEST_BODY = struct.Struct("<IBQd")  # request id, kind, bytes, sent at (CLOCK_MONOTONIC, shared by processes)
REPLY = struct.Struct("<Id")  # request id, configured latency
FLUSH = 0xFFFFFFFF  # a reply with this id asks the client for its latencies now; request ids stay below it
LENGTH = struct.Struct("<I")  # before a JSON answer (HELLO, CONTROL)
KINDS = ("open", "lookup", "getattr", "close", "readdir", "statfs", "readlink", "read")
READ = KINDS.index("read")


# --- parameters --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parameters:
    """The file system's figures, as a site would give them; times in seconds, sizes in bytes."""

    mds_capacity: float = 50_000.0
    mds_background: float = 0.7
    mds_floor: float = 0.5e-3
    mds_in_flight: int = 8
    oss_latency: float = 0.5e-3
    oss_bandwidth: float = 1e9
    oss_in_flight: int = 8
    rpc_size: int = 1 * MIB
    whole_file: int = 2 * MIB
    readahead: int = 8 * MIB
    page_cache: int = 1 << 30
    time_scale: float = 1.0
    seed: int = 20241127

    def check(self) -> None:
        """Refuse what no file system can be, in one line naming the option."""
        rules = [
            ("mds_capacity", self.mds_capacity > 0, "must be above 0 (RPCs per second)"),
            ("mds_background", 0 <= self.mds_background < 1,
             "must be at least 0 and below 1 (the share of the metadata server other jobs use)"),
            ("mds_floor", self.mds_floor >= 0, "must be 0 or more (seconds)"),
            ("oss_latency", self.oss_latency >= 0, "must be 0 or more (seconds)"),
            ("oss_bandwidth", self.oss_bandwidth > 0, "must be above 0 (bytes per second)"),
            ("mds_in_flight", self.mds_in_flight >= 1, "must be 1 or more"),
            ("oss_in_flight", self.oss_in_flight >= 1, "must be 1 or more"),
            ("rpc_size", self.rpc_size >= PAGE and self.rpc_size % PAGE == 0, "must be a multiple of 4 KiB"),
            ("whole_file", self.whole_file >= 0, "must be 0 or more (bytes)"),
            ("readahead", self.readahead >= 0, "must be 0 or more (bytes)"),
            ("page_cache", self.page_cache >= 0, "must be 0 or more (bytes)"),
            ("time_scale", math.isfinite(self.time_scale) and self.time_scale >= 1, "must be 1 or more"),
        ]
        for name, holds, rule in rules:
            value = getattr(self, name)
            if not holds or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} {value}: {rule}")

    def smallest_latency(self) -> float:
        return min(latency for latency in (self.mds_floor, self.oss_latency, 1e9) if latency > 0)


def parse_size(text: str) -> int:
    """'8MiB', '1GB', '4096' -> bytes."""
    units = {"": 1, "k": 1000, "kb": 1000, "kib": KIB, "m": 10**6, "mb": 10**6, "mib": MIB, "g": 10**9,
             "gb": 10**9, "gib": 1 << 30}
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number):].lower()
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 8MiB, 1GB)") from None


def parse_ms(text: str) -> float:
    try:
        return float(text) / 1e3
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None


def add_parameter_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's options, shared by this file's command line and the benches that start it."""
    d = Parameters()
    group = parser.add_argument_group("the simulated file system")
    group.add_argument("--mds-capacity", type=float, default=d.mds_capacity, help="metadata RPCs/s (%(default)g)")
    group.add_argument("--mds-background", type=float, default=d.mds_background,
                       help="share of it other jobs use (%(default)g)")
    group.add_argument("--mds-floor", type=parse_ms, default=d.mds_floor, metavar="MS", help="per-RPC floor (0.5)")
    group.add_argument("--mds-in-flight", type=int, default=d.mds_in_flight, help="per client (%(default)d)")
    group.add_argument("--oss-latency", type=parse_ms, default=d.oss_latency, metavar="MS",
                       help="per read RPC (0.5)")
    group.add_argument("--oss-bandwidth", type=parse_size, default=d.oss_bandwidth, metavar="BYTES/S",
                       help="the job's share, all clients together (1GB)")
    group.add_argument("--oss-in-flight", type=int, default=d.oss_in_flight, help="per client (%(default)d)")
    group.add_argument("--rpc-size", type=parse_size, default=d.rpc_size, metavar="SIZE", help="(1MiB)")
    group.add_argument("--whole-file", type=parse_size, default=d.whole_file, metavar="SIZE",
                       help="files up to this are read whole on their first read (2MiB)")
    group.add_argument("--readahead", type=parse_size, default=d.readahead, metavar="SIZE", help="(8MiB)")
    group.add_argument("--page-cache", type=parse_size, default=d.page_cache, metavar="SIZE",
                       help="per node (1GiB; benches set it below a node's share of the data)")
    group.add_argument("--time-scale", type=float, default=d.time_scale,
                       help="every latency times this, every capacity divided by it (1)")
    group.add_argument("--seed", type=int, default=d.seed, help="of the background's random draws")


def parameters_from(args: argparse.Namespace, **overrides: Any) -> Parameters:
    values = {f.name: getattr(args, f.name) for f in fields(Parameters) if hasattr(args, f.name)}
    parameters = Parameters(**{**values, **overrides})
    parameters.check()
    return parameters


def parameter_arguments(parameters: Parameters) -> list[str]:
    """`parameters` as this file's command-line options (times in ms, as the options take them)."""
    arguments = []
    for f in fields(Parameters):
        value = getattr(parameters, f.name)
        if f.name in ("mds_floor", "oss_latency"):
            value *= 1e3
        arguments += [f"--{f.name.replace('_', '-')}", repr(value)]
    return arguments


# --- the timer ---------------------------------------------------------------------------------------------------

class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Timer:
    """A timerfd on CLOCK_MONOTONIC (time.monotonic's clock): epoll wakes on it to the microsecond, where a poll
    timeout is rounded up to a millisecond. Timer slack is set to 1 ns for this process. Arming is the model's
    most frequent call, so its arguments are built once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
        self.fd = libc.timerfd_create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._value = _Itimerspec()
        self._address = ctypes.addressof(self._value)
        self.armed_at = 0.0

    def arm(self, deadline: float) -> None:
        """Wake at `deadline` (time.monotonic seconds); 0 disarms."""
        if deadline == self.armed_at:
            return
        self.armed_at = deadline
        when = self._value.it_value
        if deadline > 0:
            when.tv_sec = int(deadline)
            when.tv_nsec = int((deadline - when.tv_sec) * 1e9)
        else:
            when.tv_sec = when.tv_nsec = 0
        self._settime(self.fd, 1, self._address, None)  # TFD_TIMER_ABSTIME

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)
        self.armed_at = 0.0


def measure_timer_resolution(samples: int = 500, wait: float = 100e-6) -> tuple[float, float]:
    """How late the model's timer wakes (p50, p99 seconds), measured as the model waits: epoll on a timerfd."""
    timer, poller = Timer(), select.epoll()
    poller.register(timer.fd, select.EPOLLIN)
    late = []
    try:
        for _ in range(samples):
            deadline = time.monotonic() + wait
            timer.arm(deadline)
            poller.poll()
            late.append(time.monotonic() - deadline)
            timer.clear()
    finally:
        poller.close()
        os.close(timer.fd)
    late.sort()
    return late[len(late) // 2], late[int(len(late) * 0.99)]


def time_scale_needed(parameters: Parameters, resolution: float) -> float:
    """The smallest --time-scale at which the timer's resolution (its median lateness) is a tenth of the smallest
    latency configured, or less."""
    return max(1.0, math.ceil(resolution / (TIMER_ERROR_SHARE * parameters.smallest_latency())))


# --- the servers -------------------------------------------------------------------------------------------------

class MetadataServer:
    """One FIFO queue at the full capacity; other jobs' RPCs (Poisson) are drawn up to each arrival of the job's."""

    HISTORY = 0.05  # seconds of background drawn at most before an arrival: the queue forgets sooner than that

    def __init__(self, parameters: Parameters, rng: random.Random) -> None:
        self._rate = parameters.mds_capacity / parameters.time_scale
        self._background_rate = parameters.mds_background * self._rate
        self._rng = rng
        self._busy_until = 0.0
        self._next_background = math.inf if self._background_rate == 0 else 0.0

    def complete(self, arrival: float) -> float:
        """When an RPC arriving at `arrival` has been served (its wait and service; not the floor)."""
        expovariate, rate = self._rng.expovariate, self._rate
        if self._next_background < arrival - self.HISTORY and self._busy_until < arrival - self.HISTORY:
            self._next_background = arrival - self.HISTORY + expovariate(self._background_rate)
        while self._next_background <= arrival:
            self._busy_until = max(self._busy_until, self._next_background) + expovariate(rate)
            self._next_background += expovariate(self._background_rate)
        self._busy_until = max(self._busy_until, arrival) + expovariate(rate)
        return self._busy_until


class ObjectServers:
    """Reads share one link of the job's bandwidth, in arrival order."""

    def __init__(self, parameters: Parameters) -> None:
        self._bandwidth = parameters.oss_bandwidth / parameters.time_scale
        self._free_at = 0.0

    def complete(self, arrival: float, nbytes: int) -> float:
        self._free_at = max(self._free_at, arrival) + nbytes / self._bandwidth
        return self._free_at


@dataclass
class Phase:
    """What the file system was asked between two marks, and the CPU it took: the model's, each client's."""

    name: str
    started: float
    cpu_at_start: dict[str, float]  # "model", "node N": seconds used before the phase
    rpcs: Counter[str] = field(default_factory=Counter)
    read_bytes: int = 0
    ended: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # seconds used during it
    latencies: list[array] = field(default_factory=lambda: [array("d"), array("d")])  # metadata, read

    def end(self, now: float, cpu: dict[str, float]) -> None:
        self.ended = now
        self.cpu = {who: seconds - self.cpu_at_start.get(who, 0.0) for who, seconds in cpu.items()}

    def summary(self) -> dict[str, Any]:
        seconds = max(self.ended - self.started, 1e-9)
        result: dict[str, Any] = {"name": self.name, "seconds": seconds, "rpcs": dict(self.rpcs),
                                  "metadata_rpcs": sum(n for kind, n in self.rpcs.items() if kind != "read"),
                                  "read_rpcs": self.rpcs.get("read", 0), "read_bytes": self.read_bytes,
                                  "model_cores": self.cpu.get("model", 0.0) / seconds,
                                  "clients_cpu": {who: cpu for who, cpu in self.cpu.items() if who != "model"}}
        for label, samples in zip(("metadata", "read"), self.latencies or []):
            achieved, configured = sorted(samples[0::2]), sorted(samples[1::2])
            if achieved:
                result[f"{label}_latency"] = {
                    "count": len(achieved), "achieved_p50": _quantile(achieved, 0.5),
                    "achieved_p99": _quantile(achieved, 0.99), "configured_p50": _quantile(configured, 0.5),
                    "configured_p99": _quantile(configured, 0.99)}
        return result


def _quantile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def process_cpu(pid: int) -> float:
    """CPU seconds a process has used (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            fields = stat_file.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Model:
    """The servers, their counters and the barriers, behind one Unix socket and one epoll loop."""

    def __init__(self, parameters: Parameters, socket_path: Path) -> None:
        self.parameters = parameters
        rng = random.Random(parameters.seed)
        self.metadata = MetadataServer(parameters, rng)
        self.objects = ObjectServers(parameters)
        self._mds_floor = parameters.mds_floor * parameters.time_scale
        self._oss_latency = parameters.oss_latency * parameters.time_scale
        self._last_arrival = 0.0
        self.timer_resolution = measure_timer_resolution()
        self._early = self.timer_resolution[0]  # the timer is armed this much early: it wakes about on time
        self._coalesce = COALESCE_SHARE * parameters.smallest_latency() * parameters.time_scale
        self._client_pids: dict[int, tuple[int, int]] = {}  # connection -> (node, pid)
        self.phases = [Phase("start", time.monotonic(), self._cpu())]
        self._barriers: dict[str, list[socket.socket]] = {}
        self._due: list[tuple[float, int, int, bytes]] = []  # (due, sequence, fd, reply)
        self._sequence = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(socket_path))
        self._listener.listen(256)
        self._timer = Timer()
        self._poller = select.epoll()
        self._poller.register(self._listener.fileno(), select.EPOLLIN)
        self._poller.register(self._timer.fd, select.EPOLLIN)
        self._connections: dict[int, socket.socket] = {}
        self._buffers: dict[int, bytearray] = {}
        self._clients: set[int] = set()
        self._flushing: set[int] = set()  # clients asked for their latencies, not answered yet
        self._reports: list[socket.socket] = []  # control connections waiting for them
        self._stopping = False

    def _cpu(self) -> dict[str, float]:
        times = os.times()
        return {"model": times.user + times.system,
                **{f"node {node}": process_cpu(pid) for node, pid in self._client_pids.values()}}

    def mark(self, name: str) -> None:
        """End the current phase and begin `name`."""
        now, cpu = time.monotonic(), self._cpu()
        self.phases[-1].end(now, cpu)
        self.phases.append(Phase(name, now, cpu))

    def report(self) -> dict[str, Any]:
        self.phases[-1].end(time.monotonic(), self._cpu())
        return {"parameters": asdict(self.parameters), "timer_resolution_p50": self.timer_resolution[0],
                "timer_resolution_p99": self.timer_resolution[1], "phases": [p.summary() for p in self.phases]}

    def serve(self) -> None:
        while not self._stopping:
            for fd, _events in self._poller.poll(1.0):
                if fd == self._listener.fileno():
                    connection, _ = self._listener.accept()
                    self._connections[connection.fileno()] = connection
                    self._buffers[connection.fileno()] = bytearray()
                    self._poller.register(connection.fileno(), select.EPOLLIN)
                elif fd == self._timer.fd:
                    self._timer.clear()
                elif fd in self._connections:
                    self._receive(fd)
            self._send_due()

    def _receive(self, fd: int) -> None:
        connection = self._connections[fd]
        try:
            data = connection.recv(1 << 16)
        except ConnectionError:
            data = b""
        if not data:
            self._forget(fd)
            return
        buffer = self._buffers[fd]
        buffer += data
        position = 0
        while len(buffer) - position >= HEADER.size:
            length, kind = HEADER.unpack_from(buffer, position)
            end = position + HEADER.size + length
            if end > len(buffer):
                break
            body = memoryview(buffer)[position + HEADER.size : end]
            if kind == REQUEST:
                self._request(fd, body)
            elif kind == SAMPLES:
                self._samples(body)
            elif kind == FLUSHED:
                self._flushed(fd)
            elif kind == HELLO:
                self._clients.add(fd)
                pid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                self._client_pids[fd] = (int(json.loads(bytes(body))["node"]), pid)
                self._answer(connection, asdict(self.parameters))
            elif kind == CONTROL:
                try:
                    self._control(connection, json.loads(bytes(body)))
                except (ValueError, KeyError, TypeError) as exc:  # a malformed command: said, not fatal
                    self._answer(connection, {"error": f"malformed control message: {exc!r}"})
            else:
                body.release()
                self._forget(fd)  # not a client of this model
                return
            body.release()
            position = end
        del buffer[:position]

    def _request(self, fd: int, body: memoryview) -> None:
        request_id, kind, nbytes, sent = REQUEST_BODY.unpack(body)
        arrival = self._last_arrival = max(sent, self._last_arrival)  # FIFO in the order the clients sent them
        phase = self.phases[-1]
        phase.rpcs[KINDS[kind]] += 1
        if kind == READ:
            phase.read_bytes += nbytes
            latency = self._oss_latency + self.objects.complete(arrival, nbytes) - arrival
        else:
            latency = self._mds_floor + self.metadata.complete(arrival) - arrival
        self._sequence += 1
        heapq.heappush(self._due, (sent + latency, self._sequence, fd, REPLY.pack(request_id, latency)))

    def _samples(self, body: memoryview) -> None:
        """A client's latencies: (done at, metadata 0 or read 1, achieved, configured) each, filed by phase."""
        values = array("d")
        values.frombytes(body)
        starts = [phase.started for phase in self.phases]
        for at, kind, achieved, configured in zip(values[0::4], values[1::4], values[2::4], values[3::4]):
            phase = self.phases[max(0, bisect.bisect_right(starts, at) - 1)]
            phase.latencies[int(kind)].extend((achieved, configured))

    def _send_due(self) -> None:
        due = self._due
        now = time.monotonic() + self._coalesce
        replies: dict[int, list[bytes]] = {}
        while due and due[0][0] <= now:
            _at, _sequence, fd, reply = heapq.heappop(due)
            replies.setdefault(fd, []).append(reply)
        for fd, records in replies.items():
            connection = self._connections.get(fd)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sendall(b"".join(records))
        self._timer.arm(due[0][0] - self._early if due else 0.0)

    def _answer(self, connection: socket.socket, answer: dict[str, Any]) -> None:
        encoded = json.dumps(answer).encode()
        with contextlib.suppress(OSError):
            connection.sendall(LENGTH.pack(len(encoded)) + encoded)

    def _control(self, connection: socket.socket, command: dict[str, Any]) -> None:
        operation = command.get("op")
        if operation == "mark":
            self.mark(str(command["name"]))
            self._answer(connection, {"ok": True})
        elif operation == "barrier":  # every rank of a run waits here; the last one begins the phase
            name, size = str(command["name"]), int(command["size"])
            waiting = self._barriers.setdefault(name, [])
            waiting.append(connection)
            if len(waiting) >= size:
                self.mark(name)
                for waiter in self._barriers.pop(name):
                    self._answer(waiter, {"ok": True})
        elif operation == "report":  # once every client has sent the latencies it holds
            self._reports.append(connection)
            if not self._flushing:
                self._flushing = set(self._clients)
                for fd in self._clients:
                    with contextlib.suppress(OSError):
                        self._connections[fd].sendall(REPLY.pack(FLUSH, 0.0))
            self._flushed(None)
        elif operation == "stop":
            self._answer(connection, {"ok": True})
            self._stopping = True
        else:
            self._answer(connection, {"error": f"unknown operation {operation!r}"})

    def _flushed(self, fd: int | None) -> None:
        self._flushing.discard(fd)  # type: ignore[arg-type]
        if not self._flushing and self._reports:
            report = self.report()
            for waiter in self._reports:
                self._answer(waiter, report)
            self._reports.clear()

    def _forget(self, fd: int) -> None:
        self._clients.discard(fd)
        self._client_pids.pop(fd, None)
        if fd in self._flushing:
            self._flushed(fd)
        self._poller.unregister(fd)
        self._connections.pop(fd).close()
        del self._buffers[fd]


def control(socket_path: Path, operation: str, timeout: float | None = 60.0, **arguments: Any) -> dict[str, Any]:
    """One control operation (mark, barrier, report, stop) on the model; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        connection.connect(str(socket_path))
        body = json.dumps({"op": operation, **arguments}).encode()
        connection.sendall(HEADER.pack(len(body), CONTROL) + body)
        return json.loads(_receive_answer(connection))


def _receive_answer(connection: socket.socket) -> bytes:
    (length,) = LENGTH.unpack(_receive_exactly(connection, LENGTH.size))
    return _receive_exactly(connection, length)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the file system model closed the connection")
        data += chunk
    return bytes(data)


# --- the client --------------------------------------------------------------------------------------------------

def run_client(socket_path: Path, node: int, directory: Path, mountpoint: Path) -> int:
    """Mount `directory` at `mountpoint` as node `node`'s client, until unmounted or signalled."""
    import pyfuse3
    import trio

    from shared_fs_client import LustreClient, ModelLink

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fanstore.mount.daemon_tuning import install_fast_session_loop  # the loop fanstore's mount runs: cheaper requests

    install_fast_session_loop()

    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(socket_path))
    hello = json.dumps({"node": node}).encode()
    connection.sendall(HEADER.pack(len(hello), HELLO) + hello)
    parameters = Parameters(**json.loads(_receive_answer(connection)))
    link = ModelLink(connection, parameters)
    operations = LustreClient(directory, link, parameters)
    options = set(pyfuse3.default_options) | {"ro", f"fsname=shared_fs-node{node}"}
    options.discard("default_permissions")
    pyfuse3.init(operations, str(mountpoint), options)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.receive)
            nursery.start_soon(link.report)
            nursery.start_soon(operations.run_rpcs)
            nursery.start_soon(_stop_on_signals)
            await pyfuse3.main(max_tasks=512)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
        with contextlib.suppress(OSError):
            link.send_samples()
    return 0


async def _stop_on_signals() -> None:
    import pyfuse3
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


# --- starting it all ---------------------------------------------------------------------------------------------

class SharedFileSystem:
    """The model and one client mount per node, started together; on exit every mount is gone and every process
    ended, whatever happened. Mount points: ROOT/node{N}; the model's socket and the logs lie in ROOT too."""

    def __init__(self, directory: Path, root: Path, nodes: int, parameters: Parameters) -> None:
        parameters.check()
        self.directory, self.nodes, self.parameters = directory.resolve(), nodes, parameters
        self.root = root.resolve()
        self.socket = self.root / "model.sock"
        self.mountpoints = [self.root / f"node{node}" for node in range(nodes)]
        self._processes: list[subprocess.Popen[bytes]] = []

    def mountpoint(self, node: int) -> Path:
        return self.mountpoints[node]

    def __enter__(self) -> "SharedFileSystem":
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        try:
            self._start([__file__, "--model", str(self.socket), *parameter_arguments(self.parameters)], "model")
            deadline = time.monotonic() + START_TIMEOUT
            while not self.socket.exists():
                self._check_alive(deadline, "the model")
                time.sleep(0.01)
            for node, mountpoint in enumerate(self.mountpoints):
                mountpoint.mkdir(exist_ok=True)
                self._start([__file__, "--client", str(self.socket), str(node), str(self.directory),
                             str(mountpoint)], f"node{node}")
            for mountpoint in self.mountpoints:
                while not os.path.ismount(mountpoint):
                    self._check_alive(deadline, f"the mount at {mountpoint}")
                    time.sleep(0.01)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.log", "wb")
        with log:
            self._processes.append(subprocess.Popen([sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=log, start_new_session=True))

    def _check_alive(self, deadline: float, what: str) -> None:
        if any(process.poll() is not None for process in self._processes):
            raise RuntimeError(f"shared_fs: {what} did not start: {_tail(self.root)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"shared_fs: {what} did not start within {START_TIMEOUT:g} s: {_tail(self.root)}")

    def mark(self, name: str) -> None:
        control(self.socket, "mark", name=name)

    def report(self) -> dict[str, Any]:
        return control(self.socket, "report")

    def __exit__(self, *exc_info: object) -> None:
        for mountpoint in self.mountpoints:
            if _fuse_mounted(mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        for process in self._processes[1:]:  # the clients end once unmounted
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        if self._processes and self._processes[0].poll() is None:
            with contextlib.suppress(OSError, ValueError):
                control(self.socket, "stop", timeout=5)
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self._processes.clear()
        self.socket.unlink(missing_ok=True)
        for mountpoint in self.mountpoints:
            with contextlib.suppress(OSError):
                mountpoint.rmdir()


def _tail(root: Path) -> str:
    texts = [f"{log.name}: {log.read_text(errors='replace').strip()[-600:]}" for log in sorted(root.glob("*.log"))
             if log.stat().st_size]
    return " | ".join(texts) or "no output"


def _fuse_mounted(mountpoint: Path) -> bool:
    with open("/proc/self/mountinfo") as mountinfo:
        return any(line.split()[4] == str(mountpoint) and " - fuse" in line for line in mountinfo)


# --- the command line --------------------------------------------------------------------------------------------

def _format_report(report: dict[str, Any]) -> str:
    lines = [f"timer resolution p50 {report['timer_resolution_p50'] * 1e6:.0f} us, "
             f"p99 {report['timer_resolution_p99'] * 1e6:.0f} us; time scale {report['parameters']['time_scale']:g}"]
    for phase in report["phases"]:
        rpcs = ", ".join(f"{kind} {count:,}" for kind, count in sorted(phase["rpcs"].items()))
        lines.append(f"{phase['name']}: {phase['seconds']:.1f} s, {rpcs or 'no RPCs'}, "
                     f"{phase['read_bytes'] / MIB:,.1f} MiB read; model {phase['model_cores']:.2f} cores"
                     + (" (VOID: over half a core)" if phase["model_cores"] > MODEL_CPU_VOID else ""))
        for label in ("metadata", "read"):
            figures = phase.get(f"{label}_latency")
            if figures:
                lines.append(f"  {label} latency ms, achieved/configured: p50 {figures['achieved_p50'] * 1e3:.2f}/"
                             f"{figures['configured_p50'] * 1e3:.2f}, p99 {figures['achieved_p99'] * 1e3:.2f}/"
                             f"{figures['configured_p99'] * 1e3:.2f} ({figures['count']:,} RPCs)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--client"]:
        socket_path, node, directory, mountpoint = arguments[1:5]
        return run_client(Path(socket_path), int(node), Path(directory), Path(mountpoint))
    parser = argparse.ArgumentParser(prog="shared_fs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?", help="what the file system serves")
    parser.add_argument("mountdir", type=Path, nargs="?", help="the nodes' mounts go below it")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # internal: run the model on this socket
    add_parameter_arguments(parser)
    args = parser.parse_args(arguments)
    try:
        parameters = parameters_from(args)
    except ValueError as exc:
        parser.exit(2, f"shared_fs.py: error: {exc}\n")
    if args.model is not None:
        Model(parameters, args.model).serve()
        return 0
    if args.directory is None or args.mountdir is None:
        parser.exit(2, "shared_fs.py: error: DIRECTORY and MOUNTDIR are needed\n")
    if not args.directory.is_dir():
        parser.exit(2, f"shared_fs.py: error: {args.directory}: not a directory\n")
    if args.nodes < 1:
        parser.exit(2, f"shared_fs.py: error: --nodes {args.nodes}: must be 1 or more\n")
    with SharedFileSystem(args.directory, args.mountdir, args.nodes, parameters) as shared:
        print("mounted: " + " ".join(map(str, shared.mountpoints)) + "; Ctrl-C ends", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        print(_format_report(shared.report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
