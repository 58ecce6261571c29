"""bench_large: what does reading one large file cost, through the mount and through the API, stored in blocks
(format 1.1) and stored whole (as format 1.0 stored every file)?

One generated .npy file of float32 training data (64 channels of a digitised random walk; 256 MiB by default),
packed twice with the same codec: in blocks (`fanstore-pack --block-size 1MiB --blocks-above 4MiB`, the defaults)
and whole (`--blocks-above` set to the file's size, so the file is not above it). It is read three ways:

  plain   the original file on this machine's disk: the baseline;
  api     fanstore.open_dataset(DEST).open(path), then read, or seek and read;
  mount   `fanstore mount DEST MP --cache-size 16MiB --log FILE` (the CLI, its other options at their defaults),
          then open and read or pread;

each in two phases, timed in one reader process:

  sequential  the whole file in 1 MiB reads, into one buffer (compared with the original after the clock stops);
  random      N preads of 4 KiB at seeded, uniformly random (unaligned) offsets (compared likewise).

Every phase starts with the page cache dropped (`echo 1 > /proc/sys/vm/drop_caches`, which needs root; without it
the files are read warm and the header says so), so the plain file and the chunk files come from the disk alike.
Every mount phase runs on a fresh mount: nothing of the file is decoded, nothing is in the kernel's cache of that
mount, and the reader posix_fadvise(DONTNEED)s the mounted file too before the clock starts. For each mount
phase: the daemon's RSS at the start and its peak (VmHWM, reset at the start through /proc/PID/clear_refs), and
its decoded-cache misses from the line it logs at unmount, i.e. the blocks (or whole files) it decoded. The API's
decodes are counted by wrapping its Reader in the reader process. A phase stops after --phase-limit seconds (the
file stored whole decodes whole for every request through the mount: that would take many minutes); its figures
are then over the reads it made, marked '*'.

Placement: the reader on CPU 0 and the mount daemon on CPU 1 (`taskset`), then both unpinned (--pinned-only skips
those rows).

Each cell is the median of --repeats runs (3; --quick 1), a phase stopped by the limit being run once.

Usage: python bench/bench_large.py [--quick] [--size SIZE] [--codec SPEC] [--preads N] [--phase-limit SECONDS]
                                   [--repeats N] [--pinned-only] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import multiprocessing.pool
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import xxhash

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from bench_read import GENERATED_TIME_NS, UNPINNED, Placement, back_memory, print_table, reader_pool  # noqa: E402
from machine_load import OtherLoad, machine_lines, wait_for_quiet  # noqa: E402

from fanstore.mount.mount import wait_for_exit  # noqa: E402
from fanstore.core.units import parse_size  # noqa: E402

MIB = 1 << 20
DEFAULT_SIZE, QUICK_SIZE = 256 * MIB, 32 * MIB
CHANNELS = 64
ADC_STEP = 1 / 1024  # the signal's resolution: sensor and simulation arrays are digitised, not random mantissas
WALK_STEP = 0.05  # standard deviation of one step of the walk, in signal units (about 50 ADC steps)
SLAB_ROWS = 1 << 16  # rows generated at a time, so generating 256 MiB needs tens of MiB
BLOCK_SIZE, BLOCKS_ABOVE = MIB, 4 * MIB  # fanstore-pack's defaults, given explicitly
CODEC = "zstd:3"
READ_SIZE = MIB
PREAD_SIZE = 4096
PREADS, QUICK_PREADS = 2000, 1000
SEED = 1729
MOUNT_CACHE = 16 * MIB
PHASE_LIMIT, QUICK_PHASE_LIMIT = 60.0, 20.0
PHASES = ("sequential", "random")
REPEATS = 3
QUIET_BUSY, QUIET_MAX_WAIT = 0.10, 30.0  # before each phase: wait until the CPUs are < 10% busy (at most 30 s)
NOISY_OTHERS = 0.10  # other processes' CPU use (cores) above which a row is flagged as disturbed
BACKED_SLACK = 512 * MIB  # memory touched before each phase beyond twice the file (see bench_read.back_memory)
GENERATED_VERSION = "bench_large array v1"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CACHE_LINE = re.compile(r"cache: (\d+) hits, (\d+) misses\b")  # with or without the "W waits" field main added

TARGET_SEQ_OF_API = 0.50  # blocked mount, sequential MB/s as a share of the blocked API's
RSS_SLACK = 32 * MIB  # blocked mount: daemon RSS growth at most the cache size plus this
TARGET_BLOCKS_PER_PREAD = 1.5  # blocked mount: blocks decoded per random 4 KiB pread

READER_PINNED = Placement("taskset -c 0", frozenset({0}))
DAEMON_PINNED = Placement("taskset -c 1", frozenset({1}))


# --- inputs ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Inputs:
    plain: Path  # the original file, in a plain directory
    rel: str  # its path inside both datasets
    size: int
    shape: tuple[int, ...]
    datasets: dict[str, Path]  # "blocks" | "whole" -> dataset directory
    stored: dict[str, int]  # stored bytes of the file in each dataset


def write_array(path: Path, size: int, seed: int) -> None:
    """A .npy file of at most `size` bytes shaped like a training array: float32, 64 channels of a random walk
    digitised to ADC_STEP. It compresses as such data does (zstd:3 about 1.5x), so decoding is real work."""
    rows = (size - 128) // (4 * CHANNELS)  # 128: the .npy header for this shape
    rng = np.random.default_rng(seed)
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, CHANNELS))
    level = rng.normal(0.0, 1.0, CHANNELS)
    for start in range(0, rows, SLAB_ROWS):
        walk = level + np.cumsum(rng.normal(0.0, WALK_STEP, (min(SLAB_ROWS, rows - start), CHANNELS)), axis=0)
        array[start : start + len(walk)] = np.round(walk / ADC_STEP) * ADC_STEP
        level = walk[-1]
    array.flush()


def run_fanstore(*args: str | Path, placement: Placement = UNPINNED) -> subprocess.CompletedProcess[str]:
    """`python -m fanstore ARGS` of this checkout (cwd and PYTHONPATH), placed as asked."""
    command = placement.wrap([sys.executable, "-m", "fanstore", *map(str, args)])
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def fanstore_cli(*args: str | Path, placement: Placement = UNPINNED) -> subprocess.CompletedProcess[str]:
    """run_fanstore, where a failure ends the bench with the command and its error."""
    done = run_fanstore(*args, placement=placement)
    if done.returncode != 0:
        command = done.args
        raise SystemExit(f"bench_large: {' '.join(command)} failed: {done.stderr.strip()[-500:]}")
    return done


def stored_bytes(dataset: Path, rel: str, blocked: bool) -> int:
    """The file's stored bytes in `dataset`, once it is checked to be stored as this bench says (blocks or whole)."""
    import fanstore

    with fanstore.open_dataset(dataset) as ds:
        entry = ds.resolve(rel)
        if bool(ds.index.block_count(entry)) != blocked or (blocked and ds.reader.block_size != BLOCK_SIZE):
            raise SystemExit(f"bench_large: {dataset}: {rel} is not stored {'in blocks' if blocked else 'whole'}")
        return int(ds.index.entries[entry]["stored_len"])


def build_inputs(cache: Path, size: int, codec: str) -> Inputs:
    """The file and its two packs, made once per size and codec and reused while the marker matches."""
    base = cache / f"large-{size}-{re.sub(r'[^A-Za-z0-9]+', '_', codec)}"
    plain, rel = base / "files" / "array.npy", "array.npy"
    datasets = {"blocks": base / "blocks", "whole": base / "whole"}
    marker, expected = base / "complete", f"{GENERATED_VERSION} {size} {codec}\n"
    if not marker.exists() or marker.read_text() != expected:
        print(f"generating {size / MIB:g} MiB into {base} (once) ...", file=sys.stderr, flush=True)
        shutil.rmtree(base, ignore_errors=True)
        plain.parent.mkdir(parents=True)
        write_array(plain, size, SEED)
        os.utime(plain, ns=(GENERATED_TIME_NS, GENERATED_TIME_NS))
        common = ("--codec", codec, "--block-size", str(BLOCK_SIZE), "--quiet")
        fanstore_cli("pack", plain.parent, datasets["blocks"], "--blocks-above", str(BLOCKS_ABOVE), *common)
        fanstore_cli("pack", plain.parent, datasets["whole"], "--blocks-above", str(size), *common)
        os.sync()  # nothing dirty left for the page-cache drops to wait on
        marker.write_text(expected)
    shape = tuple(np.load(plain, mmap_mode="r").shape)
    stored = {name: stored_bytes(path, rel, name == "blocks") for name, path in datasets.items()}
    return Inputs(plain, rel, plain.stat().st_size, shape, datasets, stored)


def prefix_digest(path: Path, nbytes: int) -> int:
    """xxh3 of the first `nbytes` of the original: what a phase that read that much must have read."""
    with open(path, "rb") as f:
        return xxhash.xxh3_64_intdigest(f.read(nbytes))


def pread_digests(path: Path, offsets: Sequence[int]) -> list[int]:
    """xxh3 of each 4 KiB the random phase reads, from the original."""
    with open(path, "rb", buffering=0) as f:
        return [xxhash.xxh3_64_intdigest(os.pread(f.fileno(), PREAD_SIZE, off)) for off in offsets]


# --- processes and memory ----------------------------------------------------------------------------------------

def adopt_orphans() -> bool:
    """Become the subreaper of this process's descendants. The mount CLI leaves its daemon behind in a session of
    its own; adopted, the daemon stays our descendant, so OtherLoad counts its CPU as ours, not as a disturbance,
    and wait_for_exit reaps it."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    return libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def status_bytes(pid: int | str, name: str) -> int:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM) in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"bench_large: /proc/{pid}/status has no {name}")


def status_text(pid: int, name: str) -> str:
    """A text field of /proc/PID/status (Cpus_allowed_list: where the daemon may run)."""
    with open(f"/proc/{pid}/status") as status:
        return next((line.split(":", 1)[1].strip() for line in status if line.startswith(name + ":")), "?")


def reset_peak_rss(pid: int | str) -> bool:
    """Start VmHWM again from the current RSS (Linux >= 4.0), so it gives one phase's peak; False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5\n")
        return True
    except OSError:
        return False


def drop_page_cache() -> bool:
    """Drop the clean page cache of every file system (root only), so a phase reads its files from the disk."""
    try:
        DROP_CACHES.write_text("1\n")
        return True
    except OSError:
        return False


# --- the reader process ------------------------------------------------------------------------------------------

_datasets: dict[str, object] = {}  # in the reader process: datasets opened before any clock, by path
_decoded_bytes = [0]  # in the reader process: bytes the API's readers decoded so far


def open_api(dataset: str) -> None:
    """In the reader process, before any clock: open the dataset once, and count what its reader decodes (the
    mount's decodes are its cache misses; the API has no counter of its own)."""
    import fanstore

    ds = fanstore.open_dataset(dataset)
    reader = ds.reader
    read_block, read_whole = reader.read_block, reader.read

    def counted_block(entry: int, block: int) -> bytes:
        data = read_block(entry, block)
        _decoded_bytes[0] += len(data)
        return data

    def counted_whole(entry: int) -> bytes:
        data = read_whole(entry)  # a file stored in blocks is counted block by block, through counted_block
        _decoded_bytes[0] += 0 if reader.index.block_count(entry) else len(data)
        return data

    reader.read_block, reader.read = counted_block, counted_whole  # type: ignore[method-assign]
    _datasets[dataset] = ds


@dataclass(frozen=True, slots=True)
class Target:
    """What the reader reads: a file by path (plain, mount) or a dataset's file through the API."""

    way: str  # plain | api | mount
    path: str  # the file, or for the API the dataset
    rel: str  # for the API: the file's path in the dataset


@dataclass(frozen=True, slots=True)
class ReaderReport:
    reads: int
    nbytes: int
    seconds: float
    rss_start: int
    rss_peak: int
    decoded_bytes: int | None  # API only
    digests: tuple[int, ...]  # sequential: xxh3 of the bytes read; random: xxh3 of each pread


@contextlib.contextmanager
def opened(target: Target) -> Iterator[io.RawIOBase]:
    """The file to read, opened outside the clock: the API's file, or an unbuffered file whose cached pages are
    dropped (a no-op for a fresh mount or after drop_caches; it matters when neither happened)."""
    if target.way == "api":
        with _datasets[target.path].open(target.rel) as api_file:  # type: ignore[attr-defined]
            yield api_file
        return
    with open(target.path, "rb", buffering=0) as plain_file:
        os.posix_fadvise(plain_file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        yield plain_file


def read_sequential(file: io.RawIOBase, buffer: memoryview, deadline: float) -> tuple[int, int]:
    """1 MiB reads from the start into consecutive slices of `buffer`, to the end or the deadline: (reads, bytes)."""
    position = reads = 0
    while position < len(buffer):
        count = file.readinto(buffer[position : position + READ_SIZE])
        if not count:
            break
        position += count
        reads += 1
        if time.perf_counter() > deadline:
            break
    return reads, position


def pread_function(file: io.RawIOBase) -> Callable[[memoryview, int], int]:
    """A read into a buffer at an offset: one preadv(2) on a real file; seek and readinto on the API's file, which
    has no pread."""
    if isinstance(file, io.FileIO):
        descriptor = file.fileno()
        return lambda into, offset: os.preadv(descriptor, [into], offset)

    def seek_and_read(into: memoryview, offset: int) -> int:
        file.seek(offset)
        return file.readinto(into)  # type: ignore[return-value]

    return seek_and_read


def read_random(file: io.RawIOBase, offsets: Sequence[int], buffer: memoryview, deadline: float) -> int:
    """One 4 KiB read at each offset, in order, into consecutive slices of `buffer`, until the deadline: the reads
    made. No allocation per read, so the reader's RSS shows only what the way of reading costs."""
    pread_into = pread_function(file)
    reads = 0
    for reads, offset in enumerate(offsets, start=1):
        pread_into(buffer[(reads - 1) * PREAD_SIZE : reads * PREAD_SIZE], offset)
        if time.perf_counter() > deadline:
            break
    return reads


def reader_phase(target: Target, phase: str, size: int, offsets: Sequence[int], limit: float) -> ReaderReport:
    """One timed phase, run in the reader process. Its own peak RSS is reset as the clock starts (after the
    sequential phase's destination buffer is touched), and the bytes are hashed after the clock stops."""
    with opened(target) as file:
        buffer = bytearray(size if phase == "sequential" else len(offsets) * PREAD_SIZE)
        buffer[::4096] = b"\1" * len(buffer[::4096])  # faulted in now, not during the reads
        view = memoryview(buffer)
        decoded_before = _decoded_bytes[0]
        reset_peak_rss("self")
        rss_start = status_bytes("self", "VmRSS")
        started = time.perf_counter()
        if phase == "sequential":
            reads, nbytes = read_sequential(file, view, started + limit)
        else:
            reads = read_random(file, offsets, view, started + limit)
            nbytes = reads * PREAD_SIZE
        seconds = time.perf_counter() - started
        rss_peak = status_bytes("self", "VmHWM")
    digests = ((xxhash.xxh3_64_intdigest(view[:nbytes]),) if phase == "sequential"
               else tuple(xxhash.xxh3_64_intdigest(view[at : at + PREAD_SIZE]) for at in range(0, nbytes, PREAD_SIZE)))
    decoded = _decoded_bytes[0] - decoded_before if target.way == "api" else None
    return ReaderReport(reads, nbytes, seconds, rss_start, rss_peak, decoded, digests)


# --- the mount ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Daemon:
    mountpoint: Path
    pid: int
    log: Path


@contextlib.contextmanager
def mounted(dataset: Path, placement: Placement, workdir: Path) -> Iterator[Daemon]:
    """A fresh background mount through the CLI, its daemon placed as asked; always unmounted, and the daemon waited
    for, so that its log then holds the cache line it writes on the way out."""
    mountpoint = Path(tempfile.mkdtemp(prefix="mount-", dir=workdir))
    log = mountpoint.with_suffix(".log")
    try:
        done = fanstore_cli("mount", dataset, mountpoint, "--cache-size", f"{MOUNT_CACHE // MIB}MiB", "--log", log,
                            placement=placement)
        found = re.search(r"daemon pid (\d+)", done.stdout)
        if found is None:
            unmount(mountpoint, None)
            raise SystemExit(f"bench_large: no daemon pid in the mount's output: {done.stdout.strip()}")
        daemon = Daemon(mountpoint, int(found[1]), log)
        try:
            yield daemon
        finally:
            unmount(mountpoint, daemon.pid)
    finally:
        os.rmdir(mountpoint)


def unmount(mountpoint: Path, pid: int | None) -> None:
    """`fanstore umount MP`, falling back to a lazy fusermount3 -u -z if it fails; then wait for the daemon."""
    done = run_fanstore("umount", mountpoint)
    if done.returncode != 0:
        print(f"bench_large: {' '.join(done.args)}: {done.stderr.strip()}; trying fusermount3 -u -z", file=sys.stderr)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    if pid is not None and not wait_for_exit(pid, timeout=60):
        print(f"bench_large: mount daemon {pid} still running 60 s after unmount: killed", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)
        wait_for_exit(pid, timeout=10)


def decoded_cache_misses(log: Path) -> int:
    """Misses in the daemon's unmount line `cache: H hits, M misses, ...`: the blocks (or whole files) it decoded."""
    found = CACHE_LINE.findall(log.read_text())
    if not found:
        raise SystemExit(f"bench_large: no cache line in the mount's log {log}")
    return int(found[-1][1])


# --- measuring ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Repeat:
    """One timed run of a phase."""

    reader: ReaderReport
    complete: bool  # False: stopped at the limit
    others: float  # cores other processes used meanwhile
    daemon_rss_start: int | None = None
    daemon_rss_peak: int | None = None
    decoded_bytes: int | None = None  # api: counted in its Reader; mount: its cache misses x block or file size

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.reader.nbytes / self.reader.seconds


@dataclass(slots=True)
class Phase:
    """A phase's repeats: speeds are the median repeat's, memory the worst repeat's, decodes summed over all."""

    repeats: list[Repeat] = field(default_factory=list)

    def median(self) -> Repeat:
        return sorted(self.repeats, key=lambda r: r.rate)[(len(self.repeats) - 1) // 2]

    def spread(self) -> float:
        rates = [r.rate for r in self.repeats]
        return (max(rates) - min(rates)) / self.median().rate

    def complete(self) -> bool:
        return all(r.complete for r in self.repeats)

    def decoded_per_read(self) -> float | None:
        if self.repeats[0].decoded_bytes is None:
            return None
        return sum(r.decoded_bytes or 0 for r in self.repeats) / sum(r.reader.reads for r in self.repeats)

    def decoded_per_repeat(self) -> float | None:
        if self.repeats[0].decoded_bytes is None:
            return None
        return sum(r.decoded_bytes or 0 for r in self.repeats) / len(self.repeats)

    def daemon_rss_peak(self) -> int | None:
        peaks = [r.daemon_rss_peak for r in self.repeats if r.daemon_rss_peak is not None]
        return max(peaks) if peaks else None

    def daemon_growth(self) -> int | None:
        growths = [r.daemon_rss_peak - r.daemon_rss_start for r in self.repeats
                   if r.daemon_rss_peak is not None and r.daemon_rss_start is not None]
        return max(growths) if growths else None

    def reader_growth(self) -> int:
        return max(r.reader.rss_peak - r.reader.rss_start for r in self.repeats)

    def others(self) -> float:
        return max(r.others for r in self.repeats)


@dataclass(slots=True)
class Row:
    placement: str
    way: str
    stored_as: str  # "blocks", "whole", or "-" for the plain file
    phases: dict[str, Phase] = field(default_factory=lambda: {name: Phase() for name in PHASES})
    daemon_cpus: str = ""  # the daemon's Cpus_allowed_list, as the kernel saw it


@dataclass(frozen=True, slots=True)
class Run:
    """What every phase needs to know: the inputs, the random offsets and their expected bytes, the limits."""

    inputs: Inputs
    offsets: list[int]
    expected_preads: list[int]
    limit: float
    repeats: int
    workdir: Path


def check_bytes(run: Run, phase: str, report: ReaderReport, what: str) -> None:
    """A phase that read wrong bytes measured nothing: end the bench, naming it."""
    if phase == "sequential":
        right = report.digests == (prefix_digest(run.inputs.plain, report.nbytes),)
    else:
        right = list(report.digests) == run.expected_preads[: report.reads]
    if not right:
        raise SystemExit(f"bench_large: {what} {phase}: the bytes read differ from the original file")


def timed_phase(pool: multiprocessing.pool.Pool, run: Run, target: Target, phase: str, what: str,
                daemon: Daemon | None = None) -> Repeat:
    """Prepare the machine (page cache dropped, memory backed, quiet), then run one phase in the reader process,
    with the daemon's peak RSS taken over exactly that phase."""
    drop_page_cache()
    back_memory(2 * run.inputs.size + BACKED_SLACK)
    wait_for_quiet(QUIET_BUSY, QUIET_MAX_WAIT)
    daemon_rss_start = None
    if daemon is not None:
        reset_peak_rss(daemon.pid)
        daemon_rss_start = status_bytes(daemon.pid, "VmRSS")
    with OtherLoad() as others:
        started = time.perf_counter()
        report = pool.apply(reader_phase, (target, phase, run.inputs.size, run.offsets, run.limit))
        wall = time.perf_counter() - started
    daemon_rss_peak = status_bytes(daemon.pid, "VmHWM") if daemon is not None else None
    check_bytes(run, phase, report, what)
    complete = report.nbytes == run.inputs.size if phase == "sequential" else report.reads == len(run.offsets)
    return Repeat(report, complete, others.cpu_seconds / wall, daemon_rss_start, daemon_rss_peak,
                  report.decoded_bytes)


def repeat_counts(run: Run, phase: Phase) -> Iterator[int]:
    """Repeat numbers for a phase: --repeats of them, but none after one that the limit stopped (a minute of
    reading is figure enough, and each more would cost another)."""
    for number in range(run.repeats):
        if number and not phase.complete():
            return
        yield number


def measure_direct(run: Run, reader: Placement, way: str, stored_as: str, label: str) -> Row:
    """The plain file, or the API over one of the packs: every repeat of both phases in one reader process."""
    row = Row(label, way, stored_as)
    with reader_pool(1, reader) as pool:
        if way == "api":
            dataset = str(run.inputs.datasets[stored_as])
            pool.apply(open_api, (dataset,))
            target = Target("api", dataset, run.inputs.rel)
        else:
            target = Target("plain", str(run.inputs.plain), "")
        for name, phase in row.phases.items():
            for number in repeat_counts(run, phase):
                print(f"[{label}] {way} {stored_as} {name} {number + 1}/{run.repeats} ...", file=sys.stderr,
                      flush=True)
                phase.repeats.append(timed_phase(pool, run, target, name, f"{way} {stored_as}"))
    return row


def measure_mount(run: Run, reader: Placement, daemon_placement: Placement, stored_as: str, label: str) -> Row:
    """The mount over one of the packs: each repeat of each phase on a fresh mount, its decodes read from that
    mount's log."""
    row = Row(label, "mount", stored_as)
    dataset = run.inputs.datasets[stored_as]
    decoded_unit = BLOCK_SIZE if stored_as == "blocks" else run.inputs.size
    with reader_pool(1, reader) as pool:
        for name, phase in row.phases.items():
            for number in repeat_counts(run, phase):
                print(f"[{label}] mount {stored_as} {name} {number + 1}/{run.repeats} ...", file=sys.stderr,
                      flush=True)
                with mounted(dataset, daemon_placement, run.workdir) as daemon:
                    row.daemon_cpus = status_text(daemon.pid, "Cpus_allowed_list")
                    target = Target("mount", str(daemon.mountpoint / run.inputs.rel), "")
                    measured = timed_phase(pool, run, target, name, f"mount {stored_as}", daemon)
                misses = decoded_cache_misses(daemon.log)
                phase.repeats.append(replace(measured, decoded_bytes=misses * decoded_unit))
    return row


def measure_placement(run: Run, reader: Placement, daemon: Placement, label: str) -> list[Row]:
    """Every row, with the reader (and the daemon) placed one way."""
    rows = [measure_direct(run, reader, "plain", "-", label)]
    rows += [measure_direct(run, reader, "api", stored_as, label) for stored_as in ("blocks", "whole")]
    return rows + [measure_mount(run, reader, daemon, stored_as, label) for stored_as in ("blocks", "whole")]


# --- report ------------------------------------------------------------------------------------------------------

def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f}"


def sequential_mbps(row: Row) -> float:
    return row.phases["sequential"].median().rate / 1e6


def daemon_growth(row: Row) -> int | None:
    """The most the daemon's RSS rose above its start in any phase (each on a fresh mount)."""
    growths = [g for g in (p.daemon_growth() for p in row.phases.values()) if g is not None]
    return max(growths) if growths else None


def decodes_per_pread(row: Row, run: Run) -> float | None:
    """Blocks (or whole files, when stored whole) decoded per random pread, over every repeat."""
    per_read = row.phases["random"].decoded_per_read()
    if per_read is None:
        return None
    return per_read / (BLOCK_SIZE if row.stored_as == "blocks" else run.inputs.size)


def table_rows(rows: list[Row], run: Run) -> list[list[str]]:
    api_mbps = {(r.placement, r.stored_as): sequential_mbps(r) for r in rows if r.way == "api"}
    table = []
    for row in rows:
        seq, rand = row.phases["sequential"], row.phases["random"]
        seq_mark, rand_mark = ("" if seq.complete() else "*"), ("" if rand.complete() else "*")
        of_api = api_mbps.get((row.placement, row.stored_as)) if row.way == "mount" else None
        per_pread, growth = decodes_per_pread(row, run), daemon_growth(row)
        decoded_seq, decoded_rand = seq.decoded_per_repeat(), rand.decoded_per_read()
        spreads = "/".join(f"{p.spread():.0%}" if len(p.repeats) > 1 else "-" for p in (seq, rand))
        rand_median = rand.median()
        daemon_figures = ([mib(seq.median().daemon_rss_start or 0), mib(seq.daemon_rss_peak() or 0),
                           mib(rand.daemon_rss_peak() or 0), mib(growth or 0)] if row.way == "mount" else [""] * 4)
        others = max(seq.others(), rand.others())
        table.append([
            row.placement, row.way, row.stored_as,
            f"{sequential_mbps(row):,.0f}{seq_mark}", f"{sequential_mbps(row) / of_api:.0%}" if of_api else "",
            mib(decoded_seq) if decoded_seq is not None else "",
            f"{rand_median.reader.reads / rand_median.reader.seconds:,.0f}{rand_mark}",
            f"{rand_median.rate / 1e6:,.2f}",
            f"{per_pread:.2f}" if per_pread is not None else "",
            mib(decoded_rand) if decoded_rand is not None else "",
            spreads, *daemon_figures,
            mib(max(seq.reader_growth(), rand.reader_growth())),
            f"{others:.2f}{' !' if others > NOISY_OTHERS else ''}",
        ])
    return table


def partial_notes(rows: list[Row], run: Run) -> list[str]:
    """Which phases the limit stopped, and how far they got."""
    notes = []
    for row in rows:
        for name, phase in row.phases.items():
            for stopped in (r.reader for r in phase.repeats if not r.complete):
                done = (f"{mib(stopped.nbytes)} of {mib(run.inputs.size)} MiB" if name == "sequential"
                        else f"{stopped.reads:,} of {len(run.offsets):,} preads")
                notes.append(f"* {row.placement}, {row.way} {row.stored_as}, {name}: stopped at the {run.limit:g} s "
                             f"limit after {done} ({stopped.seconds:.1f} s); not repeated")
    return notes


def target_lines(rows: list[Row], run: Run) -> list[str]:
    """The three claims for the file stored in blocks, per placement."""
    lines = []
    for placement in dict.fromkeys(r.placement for r in rows):
        by_way = {(r.way, r.stored_as): r for r in rows if r.placement == placement}
        mount, api = by_way[("mount", "blocks")], by_way[("api", "blocks")]
        share = sequential_mbps(mount) / sequential_mbps(api)
        growth = daemon_growth(mount) or 0
        per_pread = decodes_per_pread(mount, run) or 0.0
        checks = [
            (share >= TARGET_SEQ_OF_API, f"mount sequential >= {TARGET_SEQ_OF_API:.0%} of the API's (blocks)",
             f"{sequential_mbps(mount):,.0f} of {sequential_mbps(api):,.0f} MB/s = {share:.0%}"),
            (growth <= MOUNT_CACHE + RSS_SLACK,
             f"daemon RSS growth <= cache {MOUNT_CACHE // MIB} MiB + {RSS_SLACK // MIB} MiB (blocks)",
             f"{mib(growth)} MiB"),
            (per_pread <= TARGET_BLOCKS_PER_PREAD,
             f"blocks decoded per random 4 KiB pread <= {TARGET_BLOCKS_PER_PREAD} (mount, blocks)",
             f"{per_pread:.2f}"),
        ]
        lines += [f"{'PASS' if ok else 'FAIL'}  {claim:<66} {placement:<20} {figure}" for ok, claim, figure in checks]
    return lines


def print_report(rows: list[Row], run: Run, codec: str, notes: list[str]) -> None:
    inputs = run.inputs
    print()
    print("bench_large: reading one large file, sequentially in 1 MiB reads and by random 4 KiB preads, from the "
          "plain directory, through the API and through the mount, stored in blocks (format 1.1) and whole (1.0)")
    for line in machine_lines():
        print(line)
    print(f"file: {inputs.rel}, {inputs.size:,} bytes ({inputs.size / MIB:.1f} MiB), float32 {inputs.shape}, "
          f"a digitised random walk per channel; codec {codec}: stored in {inputs.stored['blocks'] / MIB:.1f} MiB as "
          f"{-(-inputs.size // BLOCK_SIZE)} blocks of {BLOCK_SIZE // MIB} MiB "
          f"({inputs.size / inputs.stored['blocks']:.2f}x), {inputs.stored['whole'] / MIB:.1f} MiB whole "
          f"({inputs.size / inputs.stored['whole']:.2f}x)")
    print(f"mount: `fanstore mount DEST MP --cache-size {MOUNT_CACHE // MIB}MiB --log FILE`, other options default "
          "(prefetch 8, kernel read-ahead 1 MiB as root, keep_cache)")
    print(f"random: {len(run.offsets):,} preads of {PREAD_SIZE} bytes at uniformly random offsets (seed {SEED}); "
          f"each phase stops at {run.limit:g} s ('*'); each cell: the median of {run.repeats} "
          f"repeat{'s' if run.repeats > 1 else ''} (speeds), the worst (memory); spread = (max - min) / median MB/s, "
          "sequential/random")
    print("cache: before every repeat the page cache is dropped (echo 1 > /proc/sys/vm/drop_caches), "
          f"{mib(2 * inputs.size + BACKED_SLACK)} MiB of memory touched (a virtual machine may hand idle memory "
          "back to its host) "
          f"and the CPUs left < {QUIET_BUSY:.0%} busy; a mount repeat runs on a fresh mount, its file fadvise(DONTNEED)"
          "-ed by the reader before the clock starts")
    print("placement 'reader 0, daemon 1': the reader process on CPU 0 (sched_setaffinity, as taskset -c 0), the "
          "daemon started under `taskset -c 1`; 'unpinned': the scheduler's choice. daemon CPUs as the kernel "
          "reports them: " + ", ".join(sorted({f"{r.placement}: {r.daemon_cpus}" for r in rows if r.daemon_cpus})))
    print("columns: of API = mount MB/s as a share of the API's, same storage; decoded = MiB decoded in the phase "
          "(mount: decoded-cache misses from its unmount log line x block or file size; api: counted in its Reader); "
          "decodes/pread = blocks (whole files, when stored whole) decoded per random pread, MiB/pread the MiB they "
          "hold; daemon RSS in MiB: at the start of the (median) sequential phase, peak (VmHWM) in each phase; "
          "growth = the most peak - start in any phase; reader growth = the reader process's peak RSS - its RSS at "
          f"the clock's start (MiB); others = cores other processes used ('!' above {NOISY_OTHERS})")
    for note in notes:
        print(f"note: {note}")
    print()
    print_table(["placement", "read by", "stored", "seq MB/s", "of API", "decoded", "preads/s", "MB/s",
                 "decodes/pread", "MiB/pread", "spread", "daemon start", "peak seq", "peak rand", "growth",
                 "reader growth", "others"], table_rows(rows, run), left=3)
    for line in partial_notes(rows, run):
        print(line)
    print()
    print("targets (the file stored in blocks)")
    for line in target_lines(rows, run):
        print(f"  {line}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a {QUICK_SIZE // MIB} MiB file, {QUICK_PREADS} preads, {QUICK_PHASE_LIMIT:g} s limit")
    parser.add_argument("--size", help=f"the file's size (default {DEFAULT_SIZE // MIB}MiB)")
    parser.add_argument("--codec", default=CODEC, help=f"codec of both packs (default {CODEC})")
    parser.add_argument("--preads", type=int, help=f"random preads per phase (default {PREADS})")
    parser.add_argument("--phase-limit", type=float, help=f"seconds before a phase stops (default {PHASE_LIMIT:g})")
    parser.add_argument("--repeats", type=int, help=f"runs of each phase (default {REPEATS}, --quick 1)")
    parser.add_argument("--pinned-only", action="store_true", help="skip the unpinned rows")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where inputs are made once")
    args = parser.parse_args(argv)
    size = parse_size(args.size, "--size", minimum=8 * MIB) if args.size else (
        QUICK_SIZE if args.quick else DEFAULT_SIZE)
    preads = args.preads or (QUICK_PREADS if args.quick else PREADS)
    limit = args.phase_limit or (QUICK_PHASE_LIMIT if args.quick else PHASE_LIMIT)
    repeats = args.repeats or (1 if args.quick else REPEATS)
    missing = [f"{tool} (Debian: {package})" for tool, package in (("taskset", "util-linux"), ("fusermount3", "fuse3"))
               if shutil.which(tool) is None]
    missing += [] if os.path.exists("/dev/fuse") else ["/dev/fuse"]
    missing += [] if len(os.sched_getaffinity(0)) >= 2 else ["a second CPU (it pins the reader and the daemon apart)"]
    if missing:
        raise SystemExit(f"bench_large: missing {', '.join(missing)}; it installs nothing")
    notes = []
    if not drop_page_cache():
        notes.append("cannot write /proc/sys/vm/drop_caches (not root): every phase reads its files WARM from the "
                     "page cache")
    if not reset_peak_rss("self"):
        notes.append("cannot reset VmHWM (/proc/PID/clear_refs): peaks are since each process started")
    if not adopt_orphans():
        notes.append("not a subreaper: the mount daemon's CPU counts as other load")
    args.cache.mkdir(parents=True, exist_ok=True)
    inputs = build_inputs(args.cache.resolve(), size, args.codec)
    offsets = np.random.default_rng(SEED).integers(0, inputs.size - PREAD_SIZE + 1, preads).tolist()
    with tempfile.TemporaryDirectory(prefix="bench-large-") as tmp:
        run = Run(inputs, offsets, pread_digests(inputs.plain, offsets), limit, repeats, Path(tmp))
        rows = measure_placement(run, READER_PINNED, DAEMON_PINNED, "reader 0, daemon 1")
        if not args.pinned_only:
            rows += measure_placement(run, UNPINNED, UNPINNED, "unpinned")
    print_report(rows, run, args.codec, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
