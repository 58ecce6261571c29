"""Is anything else using the CPUs while a benchmark times a command? On a shared two-core machine one busy
neighbour halves the cores, so each timing reports how much CPU other processes took meanwhile.

`wait_for_quiet` waits (bounded) until the machine is idle before a timing starts; `OtherLoad` samples /proc
while the command runs and sums the CPU time of user processes that are not this process or its descendants.
Processes that start and end between two samples are missed, so the figure is a lower bound.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path
from types import TracebackType

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_KTHREADD = 2


def cpu_busy_idle() -> tuple[int, int]:
    """Busy and idle jiffies of all CPUs together, from the first line of /proc/stat."""
    with open("/proc/stat") as stat_file:
        fields = [int(value) for value in stat_file.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, idle


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPUs' time spent busy over the next `seconds`."""
    busy_before, idle_before = cpu_busy_idle()
    time.sleep(seconds)
    busy_after, idle_after = cpu_busy_idle()
    busy, idle = busy_after - busy_before, idle_after - idle_before
    return busy / (busy + idle) if busy + idle else 0.0


def wait_for_quiet(threshold: float = 0.10, max_wait: float = 60.0) -> float:
    """Wait until the CPUs are less than `threshold` busy over a one-second sample, at most `max_wait` seconds;
    returns the last busy fraction seen (above the threshold when the wait gave up)."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_fraction(0.5)
        if busy < threshold or time.monotonic() >= deadline:
            return busy


def _process_table() -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, start time) -> (parent pid, CPU ticks used) for every process that can be read right now."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat_file:
                text = stat_file.read()
        except OSError:
            continue  # exited meanwhile
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        ppid, utime, stime, start = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[19])
        table[(int(name), start)] = (ppid, utime + stime)
    return table


def _descendants_of(root_pid: int, table: dict[tuple[int, int], tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for (pid, _start), (ppid, _ticks) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, pending = {root_pid}, [root_pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


class OtherLoad:
    """Context manager: CPU seconds used by other user processes while the block runs (`cpu_seconds`)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.cpu_seconds = 0.0
        self._baseline: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._ours: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "OtherLoad":
        first = self._sample()
        self._baseline = {key: ticks for key, (_ppid, ticks) in first.items()}
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        others = [key for key in self._last if key not in self._ours]
        ticks = sum(self._last[key] - self._baseline.get(key, 0) for key in others)
        self.cpu_seconds = ticks / _TICKS_PER_SECOND

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> dict[tuple[int, int], tuple[int, int]]:
        table = _process_table()
        ours = _descendants_of(os.getpid(), table) | {_KTHREADD}
        kernel = {pid for (pid, _start), (ppid, _ticks) in table.items() if ppid == _KTHREADD}
        for key, (_ppid, ticks) in table.items():
            if key[0] in ours or key[0] in kernel:
                self._ours.add(key)  # kernel threads do our I/O as much as anyone's: not counted
            self._last[key] = ticks
        return table


def cpu_ns(pid: int) -> int:
    """CPU time a process has used so far, every thread of it (those that have ended too), in nanoseconds: its
    CPU-time clock, which Linux lets any process read for any other in its pid namespace. The alternatives judge
    less: /proc/PID/stat counts 10 ms ticks; /proc/PID/task/*/schedstat counts nanoseconds but loses the time of
    a thread that ends between two samples; getrusage reads only this process, or its children once they end.
    OSError once the process is gone."""
    return time.clock_gettime_ns(_process_cpu_clock(pid))


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU nanoseconds each of a process's live threads has used so far, by kernel name (fanstore names its
    threads: fanstore/core/thread_names.py), threads of one name summed; the main thread is 'main'. From
    /proc/PID/task/*/schedstat, so a thread that ends between two samples loses its time: cpu_ns gives the
    process's total."""
    used: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm, open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                name, nanoseconds = comm.read().strip(), int(stat.read().split()[0])
        except OSError:  # ended meanwhile
            continue
        name = "main" if tid == str(pid) else name
        used[name] = used.get(name, 0) + nanoseconds
    return used


def idle_cpu(pids: list[int] | tuple[int, ...], seconds: float, settle: float) -> list[float]:
    """Each process's CPU use over `seconds` of wall time, as a share of one core, sampled `settle` seconds from
    now (after the last read, so that what it started has ended)."""
    time.sleep(settle)
    before = [cpu_ns(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(seconds)
    after = [cpu_ns(pid) for pid in pids]
    wall = time.monotonic() - started
    return [(b - a) / 1e9 / wall for a, b in zip(before, after)]


def _process_cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU-time clock: glibc's clock_getcpuclockid, which Python does not offer
    (MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED): the pid, inverted, above 3 bits saying 'a process, scheduler
    time')."""
    return (~pid << 3) | 2


def machine_lines() -> list[str]:
    """The machine a benchmark measured, for its header: its CPUs (and those this process may use), its memory,
    kernel and Python. Read from the machine, never assumed: results from another machine read differently."""
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    usable = sorted(os.sched_getaffinity(0))
    return [f"machine: {os.cpu_count()} CPUs ({model}), this process may use {len(usable)}: {usable}; "
            f"{meminfo_bytes('MemTotal') / 2**30:.1f} GiB memory, {meminfo_bytes('MemAvailable') / 2**30:.1f} GiB "
            f"available at the start; Linux {platform.release()}, Python {platform.python_version()}",
            f"cores: {hardware_threads(usable)}"]


def hardware_threads(cpus: list[int]) -> str:
    """Which usable CPUs share a core (hardware threads, SMT), from /sys: two workers pinned to a core's two threads
    each run slower than on cores of their own, which a scaling figure must be read with."""
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            return "unknown (no /sys CPU topology)"
        groups.setdefault(siblings, []).append(cpu)
    shared = [group for group in groups.values() if len(group) > 1]
    if not shared:
        return f"each of the {len(cpus)} usable CPUs a core of its own (no hardware threads share one)"
    return (f"{len(groups)} cores for {len(cpus)} usable CPUs; CPUs sharing a core: "
            + ", ".join("+".join(map(str, group)) for group in shared))


def meminfo_bytes(name: str) -> int:
    """A figure of /proc/meminfo (MemTotal, ...) in bytes."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith(name + ":"))
