"""bench_serve: under `mpiexec -n 3 fanstore serve` on this one machine, how fast is a dataset staged, how fast does
each rank read files stored on itself, on every rank (replicated) and on another rank, and at what CPU cost to each
process, beside a plain directory and the Python API, and what do the ranks cost when idle?

One run, one table (and a staging table): four datasets, each packed with a chunk size that makes chunks
outnumber the ranks many times over, with val/ replicated (--replicate 'val/**'):

  demo          fanstore's demo training set (fanstore/demo/demo_data.py, scale 1; codec zstd-dict:9, as `fanstore demo`);
  128 KiB       20,000 + 600 generated files of 128 KiB in train/ and val/ (codec lz4, bytes as bench_read makes
                them, stored in about 43%);
  128 KiB JPEG  as many files of random bytes behind a JPEG header, as photos are: incompressible, so stored as is
                (--codec none), and a remote blob is as large as the file;
  4 KiB         3,000 + 300 generated files of 4 KiB (lz4, likewise).

The two 128 KiB sets are the ones judged: every stored file is local to one rank and remote to the two others, so
each job reads each train/ file once as a local file and twice as a remote one, 20,000 local and 40,000 remote reads.

The epoch. Every file with a blob is read once per mount, in one order that every rank follows: the replicated
files, then the files stored on rank 0, on rank 1, on rank 2 (placement.place(index, 3)), each group shuffled
(seeded). For rank r the group of rank r is its local files and the two other groups its remote files; the
order is also the --prefetch-list, so prefetch follows the reader exactly. One rank reads at a time (one reader
process, open + read all + close per file), the other ranks serving it, as they would another node; its
`user.fanstore.stats` counters are read before and after, to check each read came from where the placement says.

CPU. Beside each rank's files/s, the CPU microseconds per file of each process: the reading rank's serving process,
each of the two ranks serving it, and the reader, over its local and over its remote files. Each is read at each
group's start and end from the process's CPU-time clock (machine_load.cpu_ns: nanoseconds, every thread, those that
ended meanwhile too). /proc/PID/stat counts 10 ms ticks, which over a group read in seconds cannot tell 5 us a file
apart; summing /proc/PID/task/*/schedstat counts nanoseconds but loses a thread that ends between two samples, and
getrusage sees only this process and its children once they end (the ranks are mpiexec's). The judged figures sum
every rank's epoch: CPU per remote file less CPU per local file of the reading rank, over the job's 20,000 local and
40,000 remote reads. Where that CPU goes: each thread of the serving processes (fanstore names its threads in the
kernel: the MPI thread 'mpi', the node's fetcher 'node-ahead', the FUSE loop on 'main', ...) is read from
/proc/PID/task/*/schedstat at the same moments, and a table gives each one's CPU per local and per remote file,
for the reading rank and for the ranks serving it.

Ways of reading, each the same epoch, split the same way for each rank:

  plain            the original directory, warm in the page cache: the ceiling of any reader;
  api              fanstore.open_dataset(DEST).read(path), DEST warm: no FUSE, no peers;
  prefetch off     a fresh job, `fanstore serve ... --prefetch 0`;
  prefetch-list    a fresh job, `fanstore serve ... --prefetch-list EPOCH` (its defaults: 16 files ahead, 8 threads);
  off, no bell     prefetch off with `--no-doorbell`: the ranks poll MPI alone, as where UDP between nodes is
                   dropped; the baseline of what the doorbells (fanstore/serve/doorbell.py) bring.

Each job gets fresh mounts, so every read through a mount is a first read (the mounts keep the kernel's page cache).
The first job of each placement stages from scratch, with the page cache dropped first (echo 3 >
/proc/sys/vm/drop_caches, as root) so DEST is read from disk; its --stats give each rank's staging seconds and the
bytes read from DEST, compared with `cp -r DEST/chunks` into a fresh directory on the same file system, then an
fsync of each copy (staging fsyncs each chunk file), also from a dropped cache. The second job finds every chunk
verified in its local directory. Once every rank is mounted, before any read, each rank's CPU time (its CPU-time
clock, as above) is sampled over a few seconds of idling, in the first job and in the one without doorbells.

Placement, chosen by the CPUs this process may use:
  '2 CPUs per rank' (8 CPUs or more): rank r on CPUs 2r and 2r+1 of them, every thread of it, for the whole job,
      and the reader on its rank's two while that rank reads, as each node's CPUs would be its own; the job starts,
      stages and idles on those six, and cp runs on them. The files/s targets are judged here alone.
  'a CPU per node' (fewer, as on the 2-CPU VMs this was written on): each rank stands for a node of its own on a
      machine that has a CPU for each side: the rank that reads and its reader on CPU 0, the two ranks serving it
      on CPU 1 (every thread of each is moved before each rank's epoch); the job starts under `taskset -c 0`, so
      staging, cp and the idle sample run on CPU 0. With every rank on one CPU a remote read would also cost the
      reader's only CPU what the serving rank spends on it, which on a cluster another node pays.
  'unpinned' (besides either, without --quick or --pinned-only): every CPU this process may use, the scheduler's
      choice.

Runs. The judged ways run by turns, a fresh job each: prefetch off, prefetch-list, prefetch off, prefetch-list,
prefetch off, prefetch-list (JUDGED_JOBS of each), so that the machine's drift falls on both alike; each target is
judged on the median of its jobs' figures, every job's printed beside it, and the table shows the job whose
remote/local files/s is the median (one job's ratio of the same code swung from 70% to 97% on the 2-CPU VMs). The
files/s targets need CPUs of their own per rank: elsewhere they print 'not judged here' with their figures. Targets
are printed last, PASS or FAIL. A whole run takes about an hour on a 2-CPU VM (one 128 KiB set under one
placement: 12 minutes). --quick is a smoke test, never a verdict: 1/10 of the generated files, 1/10 of each
group of the demo's epoch, one placement, one job per way, 3 s of idling (two to three minutes); its CPU and files/s
lines give their figures and judge nothing (what does not depend on the files' count, bytes from DEST and idle CPU,
is still judged).

The bench cleans up whatever ends it: the job's processes (by pid), the mounts, the work directory; a helper
started in a session of its own (this script with --reap) does it when the bench is killed outright.

Usage: python bench/bench_serve.py [--quick] [--pinned-only] [--only DATASETS] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import multiprocessing.pool
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from bench_read import back_memory, file_bytes, print_table, warm, write_files  # noqa: E402
from machine_load import OtherLoad, cpu_ns, idle_cpu, machine_lines, thread_cpu_ns, wait_for_quiet  # noqa: E402

from fanstore.core.format import CHUNK_HEADER_LEN, NO_CHUNK  # noqa: E402
from fanstore.mount.mount import fuse_mounted_at, fuse_unavailable_reason  # noqa: E402

KIB, MIB = 1024, 1 << 20
RANKS = 3
MPIEXEC_BESIDE_PYTHON = Path(sys.executable).parent / "mpiexec"
JPEG_HEADER = bytes.fromhex("ffd8ffe000104a46494600010100000100010000")  # SOI, then a JFIF APP0 segment
JPEG_END = bytes.fromhex("ffd9")  # EOI


def jpeg_like_bytes(rng: np.random.Generator, size: int) -> bytes:
    """A photo as a codec sees it: random bytes behind a JPEG header, incompressible."""
    return JPEG_HEADER + rng.bytes(size - len(JPEG_HEADER) - len(JPEG_END)) + JPEG_END


@dataclass(frozen=True, slots=True)
class Generated:
    """A generated dataset: files of one size, `train` in train/ and `val` in val/ (replicated)."""

    size: int
    codec: str
    make: Callable[[np.random.Generator, int], bytes]  # a file's bytes
    train: int
    val: int
    chunk_size: int


JPEG_LABEL = "128 KiB JPEG"
GENERATED = {
    "128 KiB": Generated(128 * KIB, "lz4", file_bytes, 20_000, 600, 1 * MIB),
    JPEG_LABEL: Generated(128 * KIB, "none", jpeg_like_bytes, 20_000, 600, 1 * MIB),
    "4 KiB": Generated(4 * KIB, "lz4", file_bytes, 3000, 300, 64 * KIB),
}
QUICK_DIVISOR = 10
FEW_FILES = 50  # a rank storing fewer of the epoch's files than this gets a note: its local figures are rough
MIN_FILES = 10  # per group of the epoch, when --quick reads only part of the demo's
GENERATED_VERSION = "bench_serve files v1"
DEMO_LABEL, DEMO_SCALE, DEMO_CHUNK_SIZE = "demo", 1, 128 * KIB
REPLICATE = "val/**"
FILES_PER_DIR = 1000
SEED = 20240611
IDLE_SECONDS, QUICK_IDLE_SECONDS = 5.0, 3.0
IDLE_SETTLE = 1.0  # seconds after every rank is mounted before idle CPU is sampled
READY_TIMEOUT = 600.0  # seconds for staging and mounting
STOP_TIMEOUT = 120.0  # seconds for a job to unmount and print its --stats after SIGTERM
QUIET_BUSY, QUIET_MAX_WAIT = 0.10, 5.0  # before each timing: wait until the CPUs are < 10% busy (at most 5 s)
NOISY_OTHERS = 0.10  # other processes' CPU use (cores) above which a row is flagged as disturbed
BACKED_SLACK = 256 * MIB  # memory touched before each timing beyond twice the files' bytes (bench_read.back_memory)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
STATS_XATTR = "user.fanstore.stats"
CLASSES = ("local", "replicated", "remote")

TARGET_DATASETS = ("128 KiB", JPEG_LABEL)
TARGET_REMOTE_OFF = 0.80  # remote files/s as a share of local files/s, --prefetch 0 (2 CPUs per rank)
TARGET_REMOTE_LIST = 0.95  # the same with --prefetch-list
TARGET_CPU_GAP_US = 5.0  # the reading rank's CPU per remote file over its CPU per local file, --prefetch-list
TARGET_IDLE = 0.05  # of a core, per rank
JUDGED_READS = 20_000  # local reads (every rank's summed; remote ones are twice as many) a judged job makes at least

CONFIGS = (("prefetch off", ("--prefetch", "0")), ("prefetch-list", ("--prefetch-list",)),
           ("off, no bell", ("--prefetch", "0", "--no-doorbell")))
JUDGED = {"prefetch off": TARGET_REMOTE_OFF, "prefetch-list": TARGET_REMOTE_LIST}  # the configs with a target
# Jobs run for each judged config, by turns (--quick: 1); each target is judged on the median of its jobs' figures.
# One job's ratio of the same code swung from 70% to 97% on a 2-CPU VM: a local group read while something else
# ran sets the whole ratio.
JUDGED_JOBS = 3
CPUS_PER_RANK = 2
PER_RANK_MIN_CPUS = 8  # CPUs this process may use for '2 CPUs per rank': the ranks' six, and the bench's own
STAGING_LINE = re.compile(r"^  staging: .+? from DEST, .+? from peers, .+? reused, (?P<seconds>[\d.]+) s", re.M)
TOTALS_LINE = re.compile(r"^job \(\d+ ranks\): .*bytes read from DEST: .* staging \((?P<staging>[\d,]+) B\), "
                         r".* during the epochs \((?P<epochs>[\d,]+) B\)", re.M)




@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where the job, each rank and the reader run (see the docstring); None: wherever the scheduler likes."""

    label: str
    job: frozenset[int] | None  # the job starts here (staging, the idle sample); cp runs here
    own: tuple[frozenset[int], ...] = ()  # 2 CPUs per rank: rank r's own CPUs, its reader's too while it reads
    reading: frozenset[int] | None = None  # a CPU per node: the reading rank's and its reader's
    serving: frozenset[int] | None = None  # a CPU per node: the ranks serving it

    def rank_cpus(self, rank: int, reading: int) -> frozenset[int] | None:
        """The CPUs of `rank` while rank `reading` reads (its reader's are those of `reading`)."""
        if self.own:
            return self.own[rank]
        return self.reading if rank == reading else self.serving

    def wrap(self, command: Sequence[str]) -> list[str]:
        if self.job is None:
            return list(command)
        return ["taskset", "-c", ",".join(map(str, sorted(self.job))), *command]


PER_NODE = RankPlacement("a CPU per node", frozenset({0}), reading=frozenset({0}), serving=frozenset({1}))
UNPINNED = RankPlacement("unpinned", None)


def pinned_placement() -> RankPlacement:
    """2 CPUs per rank where this process may use PER_RANK_MIN_CPUS CPUs or more (the first six of them); a CPU per
    node otherwise."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < PER_RANK_MIN_CPUS:
        return PER_NODE
    own = tuple(frozenset(usable[CPUS_PER_RANK * rank:CPUS_PER_RANK * (rank + 1)]) for rank in range(RANKS))
    return RankPlacement(f"{CPUS_PER_RANK} CPUs per rank", frozenset().union(*own), own=own)


_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"{time.monotonic() - _STARTED:6.1f} s  {message}", file=sys.stderr, flush=True)


# --- inputs ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DataSet:
    label: str
    src: Path  # the plain directory
    dest: Path  # the packed dataset
    codec: str
    chunk_size: int
    segments: tuple[tuple[str, tuple[str, ...]], ...]  # the epoch: ("replicated" | "rank R", paths), in order
    raw_bytes: int  # of the files in the epoch
    chunk_bytes: int  # of every chunk file: what staging must read from DEST, once
    chunks: int
    replicated_chunks: int
    split_pieces: int  # pieces that start inside a chunk: staged with that chunk's 32-byte header too
    staging_expected: int  # placement.staging_read_bytes()
    local_dir_bytes: int  # what the ranks' local directories hold together (replicated chunks on each)
    left_out: int  # files not in the epoch: empty (no blob), or stored in blocks on several ranks
    divisor: int  # the epoch reads 1/divisor of each group (1: every file)

    def segment_paths(self) -> list[tuple[str, ...]]:
        return [paths for _, paths in self.segments]

    def files(self) -> int:
        return sum(len(paths) for _, paths in self.segments)


def run(command: Sequence[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"bench_serve: {' '.join(map(str, command))} failed: {done.stderr.strip()[-500:]}")
    return done


def fanstore_pack(src: Path, dest: Path, codec: str, chunk_size: int) -> None:
    run([sys.executable, "-m", "fanstore", "pack", src, dest, "--codec", codec, "--chunk-size", str(chunk_size),
         "--replicate", REPLICATE, "--quiet", "--force"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def build_generated(cache: Path, label: str, spec: Generated, divisor: int) -> tuple[Path, Path]:
    """1/`divisor` of the files of `spec` in train/ and val/, and their dataset: made once, reused while the marker
    matches."""
    train, val = spec.train // divisor, spec.val // divisor
    kind = "" if spec.make is file_bytes else f"-{spec.make.__name__}"
    base = cache / f"serve-{spec.size}{kind}-{spec.codec}-{train}-{val}-{spec.chunk_size}"
    src, dest, marker = base / "files", base / "dataset", base / "complete"
    if not marker.exists() or marker.read_text() != f"{GENERATED_VERSION} {spec.codec}\n":
        progress(f"[{label}] generating {train + val:,} files into {base} (once) ...")
        shutil.rmtree(base, ignore_errors=True)
        rng = np.random.default_rng(spec.size * 7919 + train)
        for group, count in (("train", train), ("val", val)):
            write_files(src / group, (f"d{i // FILES_PER_DIR:03d}/f{i:06d}.bin" for i in range(count)), rng,
                        spec.size, spec.make)
        fanstore_pack(src, dest, spec.codec, spec.chunk_size)
        marker.write_text(f"{GENERATED_VERSION} {spec.codec}\n")
    return src, dest


def build_demo(cache: Path) -> tuple[Path, Path, str]:
    """The demo training set and its dataset, packed as `fanstore demo` packs it but in small chunks."""
    from fanstore.demo.demo import DEMO_CODEC
    from fanstore.demo.demo_data import build_demo_tree

    base = cache / f"serve-demo-{DEMO_SCALE}-{DEMO_CHUNK_SIZE}"
    src, dest, marker = base / "files", base / "dataset", base / "complete"
    if not marker.exists() or marker.read_text() != f"{GENERATED_VERSION} {DEMO_CODEC}\n":
        progress(f"[{DEMO_LABEL}] building the demo training set into {base} (once) ...")
        shutil.rmtree(base, ignore_errors=True)
        build_demo_tree(src, scale=DEMO_SCALE)
        fanstore_pack(src, dest, DEMO_CODEC, DEMO_CHUNK_SIZE)
        marker.write_text(f"{GENERATED_VERSION} {DEMO_CODEC}\n")
    return src, dest, DEMO_CODEC


def describe(label: str, src: Path, dest: Path, codec: str, chunk_size: int, divisor: int = 1) -> DataSet:
    """The epoch and the staging expectations of a packed dataset, from its index and its 3-rank placement; with
    `divisor`, the epoch reads that share of each group (--quick on a dataset it does not generate)."""
    from fanstore.core.format import FLAG_BLOCKED
    from fanstore.core.index import Index
    from fanstore.serve.placement import NO_OWNER, place

    index = Index.load(dest)
    placement = place(index, RANKS)
    entries = index.entries
    replicated = set(placement.replicated_chunks)
    groups: dict[str, list[str]] = {"replicated": [], **{f"rank {r}": [] for r in range(RANKS)}}
    raw_bytes = left_out = 0
    for entry in index.iter_files():
        if int(entries["chunk"][entry]) == NO_CHUNK:
            left_out += 1
            continue
        if entries["flags"][entry] & FLAG_BLOCKED:
            rows = index.block_rows(entry)
            blobs = list(zip(index.blocks["chunk"][rows.start:rows.stop].tolist(),
                             index.blocks["offset"][rows.start:rows.stop].tolist()))
        else:
            blobs = [(int(entries["chunk"][entry]), int(entries["offset"][entry]))]
        owners = {NO_OWNER if chunk in replicated else placement.owner(chunk, offset) for chunk, offset in blobs}
        if len(owners) != 1:
            left_out += 1
            continue
        owner = owners.pop()
        groups["replicated" if owner == NO_OWNER else f"rank {owner}"].append(index.path_of(entry))
    rng = random.Random(SEED)
    for name, paths in groups.items():
        rng.shuffle(paths)
        del paths[max(min(len(paths), MIN_FILES), len(paths) // divisor):]
        raw_bytes += sum(int(entries["size"][index.lookup(rel)]) for rel in paths)
    chunk_files = sorted((dest / "chunks").iterdir())
    pieces = [piece for rank in range(RANKS) for piece in placement.pieces(rank)]
    return DataSet(
        label, src, dest, codec, chunk_size, tuple((name, tuple(paths)) for name, paths in groups.items()),
        raw_bytes, sum(p.stat().st_size for p in chunk_files), len(chunk_files), len(replicated),
        sum(1 for piece in pieces if piece.start > 0), placement.staging_read_bytes(),
        sum(placement.stored_bytes(rank) for rank in range(RANKS)), left_out, divisor)


# --- readers -----------------------------------------------------------------------------------------------------

_api_dataset: Any = None


def _start_reader(dest: str | None) -> None:
    """A reader process ends on SIGTERM as any process does (the pool's terminate); with `dest`, it opens the
    dataset for the API before the clock starts."""
    global _api_dataset  # one per reader process

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    if dest is not None:
        import fanstore

        _api_dataset = fanstore.open_dataset(dest)


def _read_segments(root: str | None, segments: list[tuple[str, ...]], pids: list[int]
                   ) -> list[tuple[float, int, list[int], int, list[dict[str, int]]]]:
    """What a data-loader worker does per sample (open, read it all, close; or the API's read), timed per segment:
    (seconds, bytes, CPU nanoseconds each of `pids` used meanwhile, CPU nanoseconds of this reader, each of `pids`'
    CPU nanoseconds by thread name) of each."""
    timings = []
    for paths in segments:
        total = 0
        threads = [thread_cpu_ns(pid) for pid in pids]
        cpu = [cpu_ns(pid) for pid in pids]
        own = time.process_time_ns()  # this process's CPU-time clock, as cpu_ns reads the others'
        started = time.perf_counter()
        if root is None:
            for rel in paths:
                total += len(_api_dataset.read(rel))
        else:
            for rel in paths:
                with open(os.path.join(root, rel), "rb") as f:
                    total += len(f.read())
        seconds = time.perf_counter() - started
        own = time.process_time_ns() - own
        cpu = [cpu_ns(pid) - before for pid, before in zip(pids, cpu)]
        threads = [{name: ns - before.get(name, 0) for name, ns in thread_cpu_ns(pid).items()}
                   for pid, before in zip(pids, threads)]
        timings.append((seconds, total, cpu, own, threads))
    return timings


@contextlib.contextmanager
def reader_process(cpus: frozenset[int] | None, api_dest: Path | None = None) -> Iterator[multiprocessing.pool.Pool]:
    """One reader process, started before timing, on `cpus` (it inherits this process's affinity; None: this
    process's)."""
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        with multiprocessing.get_context("fork").Pool(1, _start_reader, (api_dest and str(api_dest),)) as pool:
            pool.apply(abs, (0,))  # up, and the API's dataset open
            yield pool
    finally:
        os.sched_setaffinity(0, before)


@dataclass(slots=True)
class Epoch:
    """One pass of one reader over the epoch: seconds and files of each segment, what other processes used, and
    (through a mount) the rank's read counters over the pass."""

    seconds: dict[str, float]
    files: dict[str, int]
    others: float  # cores
    cpu: dict[str, list[float]]  # through a mount: CPU seconds of each rank's serving process, per segment
    reader_cpu: dict[str, float]  # CPU seconds of the reader, per segment
    # through a mount: CPU seconds of each rank's serving process by thread name (machine_load.thread_cpu_ns), per
    # segment
    threads: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)  # local, fetched, fallback: reads during the pass

    def rate(self, segments: list[str]) -> float:
        return sum(self.files[s] for s in segments) / sum(self.seconds[s] for s in segments)

    def cpu_per_file(self, segments: list[str], ranks: list[int]) -> float:
        """Microseconds of CPU the processes of `ranks` used per file of `segments`."""
        return 1e6 * sum(self.cpu[s][r] for s in segments for r in ranks) / sum(self.files[s] for s in segments)

    def reader_cpu_per_file(self, segments: list[str]) -> float:
        """Microseconds of CPU the reader used per file of `segments`."""
        return 1e6 * sum(self.reader_cpu[s] for s in segments) / sum(self.files[s] for s in segments)


def timed_epoch(pool: multiprocessing.pool.Pool, root: Path | None, data: DataSet, pids: Sequence[int] = ()) -> Epoch:
    """The reader's pass over the epoch, once the machine is quiet and memory backed (bench_read.back_memory);
    `pids`: the ranks' serving processes, whose CPU is sampled at each segment's start and end."""
    wait_for_quiet(QUIET_BUSY, QUIET_MAX_WAIT)
    back_memory(2 * data.raw_bytes + BACKED_SLACK)
    with OtherLoad() as others:
        started = time.perf_counter()
        timings = pool.apply(_read_segments, (None if root is None else str(root), data.segment_paths(), list(pids)))
        wall = time.perf_counter() - started
    names = [name for name, _ in data.segments]
    expected = [sum((data.src / rel).stat().st_size for rel in paths) for _, paths in data.segments]
    if [timing[1] for timing in timings] != expected:
        raise SystemExit(f"bench_serve: [{data.label}] read {[timing[1] for timing in timings]} bytes by segment "
                         f"from {root or 'the API'}, expected {expected}")
    return Epoch({name: seconds for name, (seconds, _, _, _, _) in zip(names, timings)},
                 {name: len(paths) for name, paths in data.segments}, others.cpu_seconds / wall,
                 {name: [ns / 1e9 for ns in cpu] for name, (_, _, cpu, _, _) in zip(names, timings)},
                 {name: own / 1e9 for name, (_, _, _, own, _) in zip(names, timings)},
                 {name: [{thread: ns / 1e9 for thread, ns in used.items()} for used in threads]
                  for name, (_, _, _, _, threads) in zip(names, timings)})


def class_segments(rank: int) -> dict[str, list[str]]:
    """The epoch's segments that are, for `rank`, its local, replicated and remote files."""
    return {"local": [f"rank {rank}"], "replicated": ["replicated"],
            "remote": [f"rank {r}" for r in range(RANKS) if r != rank]}


# --- the job -----------------------------------------------------------------------------------------------------

def mpiexec_command() -> str | None:
    return str(MPIEXEC_BESIDE_PYTHON) if MPIEXEC_BESIDE_PYTHON.exists() else shutil.which("mpiexec")


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, every thread of it, in clock ticks (10 ms here: machine_load.cpu_ns reads
    nanoseconds)."""
    with open(f"/proc/{pid}/stat") as stat_file:
        text = stat_file.read()
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def command_line(pid: int) -> bytes:
    """A process's arguments, NUL-separated; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def processes_mentioning(text: str) -> list[int]:
    """Pids of processes whose command line holds `text` (this bench's work directory: mpiexec, the ranks, their
    watchdogs)."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))
            if text.encode() in command_line(int(pid)) and int(pid) != os.getpid()]


@dataclass(slots=True)
class JobReport:
    """What one job's --stats said: each rank's staging seconds, and the job's bytes from DEST."""

    staging_seconds: list[float]
    staging_bytes: int  # read from DEST while staging, the whole job
    epoch_bytes: int  # read from DEST after staging (fallback reads), the whole job
    idle_cpu: list[float] = field(default_factory=list)  # share of a core, per rank


class ServeJob:
    """`mpiexec -n 3 fanstore serve DEST MP{rank} --local-dir LOCAL{rank} --stats` without a command, in a session
    of its own; whatever happens, on exit every process of the job is gone, and so are the mounts and the ranks'
    watchdogs."""

    def __init__(self, data: DataSet, workdir: Path, placement: RankPlacement, options: Sequence[str],
                 name: str) -> None:
        self.workdir = workdir
        self.mountpoints = [workdir / f"mp{rank}" for rank in range(RANKS)]
        for mountpoint in self.mountpoints:
            mountpoint.mkdir(exist_ok=True)
        self.log = workdir / f"{name}.log"
        self.out = workdir / f"{name}.out"
        argv = [str(mpiexec_command()), "-n", str(RANKS), sys.executable, "-m", "fanstore", "serve", str(data.dest),
                str(workdir / "mp{rank}"), "--local-dir", str(workdir / "local{rank}"), "--stats", "--quiet",
                *options]
        with open(self.out, "wb") as out, open(self.log, "wb") as log:
            self.proc = subprocess.Popen(placement.wrap(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=log,
                                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                         start_new_session=True)
        self.tree: dict[int, int] = {}  # the job's processes once every rank is up: pid -> start time

    def __enter__(self) -> "ServeJob":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def ready_files(self) -> list[Path]:
        return [mountpoint.with_name(mountpoint.name + ".ready") for mountpoint in self.mountpoints]

    def wait_ready(self) -> list[int]:
        """Wait until every rank is mounted; the pid of each rank's serving process (line 2 of its ready file)."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(f.exists() for f in self.ready_files()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench_serve: the job did not mount on every rank (exit {self.proc.poll()}): "
                                 f"{self.log.read_text()[-1500:]}")
            time.sleep(0.05)
        self.tree = process_tree(self.proc.pid)
        return [int(f.read_text().split()[1]) for f in self.ready_files()]

    def stop(self) -> JobReport:
        """SIGTERM to the job's session, as a batch system ends a job; the --stats it prints as it ends."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"bench_serve: the job did not end within {STOP_TIMEOUT:g} s of SIGTERM") from None
        out = self.out.read_text()
        totals = TOTALS_LINE.search(out)
        blocks = [block for block in re.split(r"^(?=rank \d+ )", out, flags=re.M) if block.startswith("rank ")]
        staging = {int(block.split()[1]): STAGING_LINE.search(block) for block in blocks}
        if self.proc.returncode != 0 or totals is None or sorted(staging) != list(range(RANKS)) \
                or not all(staging.values()):
            raise SystemExit(f"bench_serve: the job ended with {self.proc.returncode} and no --stats totals:\n{out}"
                             f"\n{self.log.read_text()[-1500:]}")
        return JobReport([float(staging[r]["seconds"]) for r in range(RANKS)], int(totals["staging"].replace(",", "")),
                         int(totals["epochs"].replace(",", "")))

    def close(self) -> None:
        """End whatever is left of the job: mpiexec gets SIGTERM (it passes it on to the ranks), then every process
        it started (hydra's proxy and each rank run in sessions of their own) is killed by pid; the mounts are
        removed, and the ranks' watchdogs, which end once their rank is gone, are waited for."""
        end_job(self.proc, self.tree)
        unmount_all(self.mountpoints)
        deadline = time.monotonic() + 10
        while (left := processes_mentioning(str(self.workdir))) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:  # would be watchdogs stuck on something: ours, started by this job's ranks
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for ready in self.ready_files():
            ready.unlink(missing_ok=True)


def end_job(proc: subprocess.Popen[bytes], seen: dict[int, int]) -> None:
    """End an mpiexec started in a session of its own: the session gets SIGTERM (mpiexec passes it on to the ranks),
    then every process of the job (`seen` while it ran, pid -> start time, and those below it now; hydra's proxy
    and each rank run in sessions of their own) is killed by pid, the ranks' watchdogs excepted: they unmount once
    their rank is gone."""
    seen = dict(seen)
    if proc.poll() is None:  # not reaped yet, so the pid is still mpiexec's
        seen.update(process_tree(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    for pid, start in seen.items():
        if process_start(pid) == start and b"watchdog.py" not in command_line(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def process_start(pid: int) -> int | None:
    """A process's start time (clock ticks after boot), which tells it from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            text = stat_file.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])


def process_tree(root: int) -> dict[int, int]:
    """`root` and every process below it, pid -> start time."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as stat_file:
                text = stat_file.read()
        except OSError:
            continue
        children.setdefault(int(text[text.rindex(")") + 2 :].split()[1]), []).append(int(name))
    tree, pending = [root], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            tree.append(child)
            pending.append(child)
    return {pid: start for pid in tree if (start := process_start(pid)) is not None}


def unmount_all(mountpoints: Sequence[Path]) -> None:
    for mountpoint in mountpoints:
        if fuse_mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def mounted_under(directory: Path) -> list[Path]:
    """FUSE mounts at or below `directory`, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            where = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            fs_type = fields[fields.index("-") + 1]
            if fs_type.startswith("fuse") and (where == str(directory) or where.startswith(f"{directory}/")):
                found.append(Path(where))
    return found


def source_counts(mountpoint: Path) -> dict[str, int]:
    """The rank's reads so far by where their blobs came from: its local directory, its peers, DEST."""
    source = json.loads(os.getxattr(mountpoint, STATS_XATTR))["source"]
    return {"local": source["local"], "fetched": sum(peer["fetched"] for peer in source["peers"].values()),
            "fallback": source["fallback"]}


def drop_caches() -> bool:
    """Empty the page cache (root only); False when it could not be done."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


# --- measuring ---------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """Everything measured for one dataset under one placement."""

    data: DataSet
    placement: RankPlacement
    epochs: dict[str, list[Epoch]] = field(default_factory=dict)  # way of reading -> one Epoch per rank
    jobs: dict[str, JobReport] = field(default_factory=dict)  # config -> its (first) job's report
    # config -> every job's epochs and report, in the order run; `epochs` holds the median job's (judged configs)
    rounds: dict[str, list[tuple[list[Epoch], JobReport]]] = field(default_factory=dict)
    copy_seconds: tuple[float, float] = (0.0, 0.0)  # cp alone, cp then fsync of each copy
    cold: bool = False  # the page cache was dropped before staging and before cp


def copy_chunks(data: DataSet, workdir: Path, placement: RankPlacement) -> tuple[float, float, bool]:
    """Seconds to `cp -r DEST/chunks` into a fresh directory on this file system, and to fsync every copy after."""
    target = workdir / "cp-chunks"
    shutil.rmtree(target, ignore_errors=True)
    cold = drop_caches()
    started = time.perf_counter()
    run(placement.wrap(["cp", "-r", str(data.dest / "chunks"), str(target)]))
    copied = time.perf_counter() - started
    for path in sorted(target.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    synced = time.perf_counter() - started
    shutil.rmtree(target)
    return copied, synced, cold


def serve_epochs(data: DataSet, workdir: Path, placement: RankPlacement, config: str, options: Sequence[str],
                 idle_seconds: float | None) -> tuple[list[Epoch], JobReport]:
    """One fresh job: (idle CPU,) each rank's epoch through its own mount, one rank at a time; its --stats."""
    with ServeJob(data, workdir, placement, options, f"{data.label.replace(' ', '')}-{config}") as job:
        progress(f"[{data.label}, {placement.label}] {config}: starting the job ...")
        pids = job.wait_ready()
        if idle_seconds:
            progress(f"[{data.label}, {placement.label}] {config}: every rank mounted; idle CPU ...")
        idle = idle_cpu(pids, idle_seconds, IDLE_SETTLE) if idle_seconds else []
        epochs = []
        for rank, mountpoint in enumerate(job.mountpoints):
            progress(f"[{data.label}, {placement.label}] {config}: rank {rank} reads ...")
            place_ranks(placement, pids, rank)
            with reader_process(placement.rank_cpus(rank, rank)) as pool:
                before = source_counts(mountpoint)
                epoch = timed_epoch(pool, mountpoint, data, pids)
                after = source_counts(mountpoint)
            epoch.sources = {key: after[key] - before[key] for key in after}
            epochs.append(epoch)
        progress(f"[{data.label}, {placement.label}] {config}: stopping the job ...")
        report = job.stop()
    report.idle_cpu = idle
    return epochs, report


def place_ranks(placement: RankPlacement, pids: Sequence[int], reading: int) -> None:
    """Each rank to its CPUs while rank `reading` reads (RankPlacement.rank_cpus): every thread of each (threads
    started later inherit their starter's CPUs); unpinned, none is moved."""
    for rank, pid in enumerate(pids):
        cpus = placement.rank_cpus(rank, reading)
        if cpus is None:
            continue
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                os.sched_setaffinity(int(tid), cpus)


def measure(data: DataSet, workdir: Path, placement: RankPlacement, idle_seconds: float, epoch_list: Path,
            judged_jobs: int = JUDGED_JOBS) -> Run:
    """Plain and api, then the serve jobs: the judged ways by turns (off, list, off, list, ...), the first staging
    from scratch, then the way without doorbells."""
    result = Run(data, placement)
    progress(f"[{data.label}, {placement.label}] cp of the chunk files ...")
    copied, synced, cold = copy_chunks(data, workdir, placement)
    result.copy_seconds = (copied, synced)
    progress(f"[{data.label}, {placement.label}] plain and api ...")
    warm(data.src)
    with reader_process(placement.rank_cpus(0, 0)) as pool:
        result.epochs["plain"] = [timed_epoch(pool, data.src, data)]
    warm(data.dest)
    with reader_process(placement.rank_cpus(0, 0), api_dest=data.dest) as pool:
        result.epochs["api"] = [timed_epoch(pool, None, data)]
    for rank in range(RANKS):
        shutil.rmtree(workdir / f"local{rank}", ignore_errors=True)
    turns = [(config, options) for _ in range(judged_jobs) for config, options in CONFIGS if config in JUDGED]
    turns += [(config, options) for config, options in CONFIGS if config not in JUDGED]
    for number, (config, options) in enumerate(turns):
        if number == 0:
            result.cold = drop_caches() and cold  # staging reads DEST from disk, as it would a shared file system
        if config == "prefetch-list":
            options = (*options, str(epoch_list))
        measure_idle = number == 0 or "--no-doorbell" in options
        result.rounds.setdefault(config, []).append(
            serve_epochs(data, workdir, placement, config, options, idle_seconds if measure_idle else None))
    for config, rounds in result.rounds.items():
        result.jobs[config] = rounds[0][1]  # the first job: staging from scratch (first config), idle CPU
        ratios = [aggregate_ratio(epochs) for epochs, _ in rounds]
        result.epochs[config] = rounds[sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]][0]
    return result


# --- report ------------------------------------------------------------------------------------------------------

def sources_as_placed(epoch: Epoch, data: DataSet, rank: int) -> str:
    """Whether the rank's reads came from where the placement says: local and replicated files from its directory,
    remote ones from peers, none from DEST; and how many blobs were read twice."""
    files = {name: len(paths) for name, paths in data.segments}
    classes = class_segments(rank)
    local = sum(files[s] for s in classes["local"] + classes["replicated"])
    remote = sum(files[s] for s in classes["remote"])
    got = epoch.sources
    twice = got["local"] - local + got["fetched"] - remote
    if got["fallback"] or got["local"] < local or got["fetched"] < remote:
        return f"NO: {got['local']} local/{local}, {got['fetched']} fetched/{remote}, {got['fallback']} from DEST"
    return "yes" if not twice else f"yes, {twice} twice"


def epoch_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for result in runs:
        for way, epochs in result.epochs.items():
            for rank in range(RANKS):
                epoch = epochs[rank] if len(epochs) == RANKS else epochs[0]
                classes = class_segments(rank)
                local, replicated, remote = (epoch.rate(classes[c]) for c in CLASSES)
                megabytes = result.data.raw_bytes / 1e6 / sum(epoch.seconds.values())
                checked = sources_as_placed(epoch, result.data, rank) if epoch.sources else ""
                flag = " !" if epoch.others > NOISY_OTHERS else ""
                cpu = {name: ["", ""] for name in ("local", "remote")}  # the reading rank's, each serving rank's
                if epoch.sources:
                    peers = [r for r in range(RANKS) if r != rank]
                    for name in cpu:
                        cpu[name] = [f"{epoch.cpu_per_file(classes[name], [rank]):.1f}",
                                     " ".join(f"{epoch.cpu_per_file(classes[name], [peer]):.1f}" for peer in peers)]
                rows.append([result.data.label, result.placement.label, way, str(rank), f"{local:,.0f}",
                             *cpu["local"], f"{epoch.reader_cpu_per_file(classes['local']):.1f}", f"{remote:,.0f}",
                             *cpu["remote"], f"{epoch.reader_cpu_per_file(classes['remote']):.1f}",
                             f"{remote / local:.0%}", f"{replicated:,.0f}", f"{megabytes:,.0f}",
                             f"{epoch.others:.2f}{flag}", checked])
    return rows


THREAD_FLOOR_US = 0.5  # a thread under this per file, local and remote, is counted in 'other threads'


def thread_cpu(epochs: list[Epoch], name: str, side: str) -> tuple[int, dict[str, float]]:
    """Files of class `name` (local, remote) of a job, every rank's epoch summed, and the CPU seconds each thread
    (by name) of the reading rank's serving process (`side` 'reading') or of the ranks that stored those files
    (`side` 'serving': for local files, the other ranks, which serve nothing then) used over them."""
    files, used = 0, {}
    for rank, epoch in enumerate(epochs):
        for segment in class_segments(rank)[name]:
            files += epoch.files[segment]
            if side == "reading":
                ranks = [rank]
            else:
                ranks = [int(segment.split()[1])] if name == "remote" else [r for r in range(RANKS) if r != rank]
            for r in ranks:
                for thread, seconds in epoch.threads[segment][r].items():
                    used[thread] = used.get(thread, 0.0) + seconds
    return files, used


def thread_rows(runs: list[Run]) -> list[list[str]]:
    """Per thread, CPU microseconds per local and per remote file: where a remote file's extra cost goes."""
    rows = []
    for result in runs:
        for way, epochs in result.epochs.items():
            if len(epochs) != RANKS or not epochs[0].threads:
                continue  # plain, api: no rank
            for side in ("reading", "serving"):
                (local_files, local), (remote_files, remote) = (thread_cpu(epochs, name, side)
                                                                for name in ("local", "remote"))
                per_file = {thread: (1e6 * local.get(thread, 0.0) / local_files,
                                     1e6 * remote.get(thread, 0.0) / remote_files)
                            for thread in {**local, **remote}}
                shown = sorted((t for t, us in per_file.items() if max(us) >= THREAD_FLOOR_US),
                               key=lambda t: -per_file[t][1])
                rest = [per_file[t] for t in per_file if t not in shown]
                lines = [(t, per_file[t]) for t in shown]
                if rest:
                    lines.append(("other threads", (sum(l for l, _ in rest), sum(r for _, r in rest))))
                lines.append(("all", (sum(l for _, (l, _) in lines), sum(r for _, (_, r) in lines))))
                for thread, (local_us, remote_us) in lines:
                    rows.append([result.data.label, result.placement.label, way, f"{side} rank", thread,
                                 f"{local_us:.1f}", f"{remote_us:.1f}", f"{remote_us - local_us:+.1f}"])
    return rows


def staging_ok(result: Run) -> tuple[bool, str]:
    data, report = result.data, result.jobs[CONFIGS[0][0]]
    ceiling = data.chunk_bytes + CHUNK_HEADER_LEN * data.split_pieces
    ok = report.staging_bytes == data.staging_expected and data.chunk_bytes <= report.staging_bytes <= ceiling
    return ok, (f"{report.staging_bytes:,} B read for {data.chunk_bytes:,} B of chunk files + "
                f"{data.split_pieces} split-piece headers (at most {ceiling:,} B; placement expects "
                f"{data.staging_expected:,} B)")


def staging_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for result in runs:
        data = result.data
        first, second = result.jobs[CONFIGS[0][0]], result.jobs[CONFIGS[1][0]]
        seconds = max(first.staging_seconds)
        rate = f"{data.chunk_bytes / 1e6 / seconds:,.0f}" if seconds > 0 else "> " + \
            f"{data.chunk_bytes / 1e6 / 0.05:,.0f} (< 0.05 s)"
        copied, synced = result.copy_seconds
        ok, _ = staging_ok(result)
        epoch_bytes = "/".join(f"{sum(report.epoch_bytes for _, report in result.rounds[config]):,}"
                               for config, _ in CONFIGS)
        rows.append([data.label, result.placement.label, f"{data.files():,}",
                     f"{data.chunks} ({data.replicated_chunks} r)", f"{data.chunk_bytes / 1e6:,.1f}",
                     f"{data.local_dir_bytes / 1e6:,.1f}",
                     " ".join(f"{s:.1f}" for s in first.staging_seconds), rate,
                     f"{data.chunk_bytes / 1e6 / copied:,.0f}", f"{data.chunk_bytes / 1e6 / synced:,.0f}",
                     f"{first.staging_bytes:,}" + (" ok" if ok else " FAIL"), f"{second.staging_bytes:,}",
                     epoch_bytes, " ".join(f"{c:.1%}" for c in first.idle_cpu),
                     " ".join(f"{c:.1%}" for c in result.jobs["off, no bell"].idle_cpu)])
    return rows


def class_totals(epochs: list[Epoch], name: str) -> tuple[int, float, float]:
    """Files, seconds and the reading rank's CPU seconds of a job's files of class `name` (local, remote), every
    rank's epoch summed."""
    pairs = [(epochs[r], s, r) for r in range(RANKS) for s in class_segments(r)[name]]
    return (sum(epoch.files[s] for epoch, s, _ in pairs), sum(epoch.seconds[s] for epoch, s, _ in pairs),
            sum(epoch.cpu[s][r] for epoch, s, r in pairs))


def aggregate_ratio(epochs: list[Epoch]) -> float:
    """Remote files/s over local files/s of a job's epochs, every rank's files and seconds summed."""
    (local_files, local_seconds, _), (remote_files, remote_seconds, _) = (class_totals(epochs, name)
                                                                          for name in ("local", "remote"))
    return (remote_files / remote_seconds) / (local_files / local_seconds)


def rank_cpu_per_file(epochs: list[Epoch]) -> tuple[float, float]:
    """Microseconds of CPU the reading rank used per local and per remote file of a job, every rank's epoch
    summed."""
    local_files, _, local_cpu = class_totals(epochs, "local")
    remote_files, _, remote_cpu = class_totals(epochs, "remote")
    return 1e6 * local_cpu / local_files, 1e6 * remote_cpu / remote_files


def median_of(values: list[float]) -> float:
    """The median of an odd count (the jobs by turns); of an even one, the lower middle (a figure measured)."""
    return sorted(values)[(len(values) - 1) // 2]


def target_lines(runs: list[Run], quick: bool) -> list[str]:
    """PASS or FAIL for what this run can judge; '----' with the figures for what it cannot (and for the figures
    beside a target)."""
    lines = []

    def line(status: bool | None, what: str, result: Run, detail: str) -> None:
        word = "----" if status is None else "PASS" if status else "FAIL"
        lines.append(f"{word}  {what:<58}  {result.data.label:<12}  {result.placement.label:<15}  {detail}")

    usable = len(os.sched_getaffinity(0))
    for result in runs:
        if result.data.label in TARGET_DATASETS:
            local_reads = min(class_totals(epochs, "local")[0] for config in JUDGED
                              for epochs, _ in result.rounds[config])
            smoke = (f"smoke test (--quick), not a verdict: {local_reads:,} local reads a job, judged over "
                     f">= {JUDGED_READS:,}; " if quick or local_reads < JUDGED_READS else "")
            for config in JUDGED:
                figures = [rank_cpu_per_file(epochs) for epochs, _ in result.rounds[config]]
                gaps = [remote - local for local, remote in figures]
                gap = median_of(gaps)
                local, remote = figures[gaps.index(gap)]
                each = (f"; median of {len(gaps)} jobs by turns: " + " ".join(f"{g:+.1f}" for g in gaps)
                        if len(gaps) > 1 else "")
                detail = f"{remote:.1f} vs {local:.1f} us: {gap:+.1f} us{each}"
                if config == "prefetch-list":
                    line(None if smoke else gap <= TARGET_CPU_GAP_US,
                         f"rank CPU per remote file <= local + {TARGET_CPU_GAP_US:g} us, {config}", result,
                         smoke + detail)
                else:
                    line(None, f"(no target) rank CPU per remote file - local, {config}", result, detail)
            for config, target in JUDGED.items():
                ratios = [aggregate_ratio(epochs) for epochs, _ in result.rounds[config]]
                ratio = median_of(ratios)
                each = (f"median of {len(ratios)} jobs by turns: " + " ".join(f"{r:.1%}" for r in ratios) + ", "
                        if len(ratios) > 1 else "")
                detail = f"{ratio:.1%} ({each}every rank's files and seconds summed)"
                if not result.placement.own:
                    why = (f"not judged here: needs {PER_RANK_MIN_CPUS} CPUs ({CPUS_PER_RANK} per rank), this "
                           f"process may use {usable}; " if usable < PER_RANK_MIN_CPUS else
                           f"not judged {result.placement.label}: judged with {CPUS_PER_RANK} CPUs per rank; ")
                    line(None, f"remote >= {target:.0%} of local files/s, {config}", result, why + detail)
                else:  # 89.6% is no pass
                    line(None if smoke else ratio >= target, f"remote >= {target:.0%} of local files/s, {config}",
                         result, smoke + detail)
            line(None, "(no target) the same, off, no bell", result,
                 f"{aggregate_ratio(result.epochs['off, no bell']):.1%}")
        epoch_bytes = [report.epoch_bytes for config, _ in CONFIGS for _, report in result.rounds[config]]
        line(not any(epoch_bytes), "0 B from DEST during the epochs", result,
             f"{' and '.join(f'{b:,} B' for b in epoch_bytes)} (every job)")
        ok, detail = staging_ok(result)
        line(ok, "each stored byte read from DEST once", result, detail)
        idle = result.jobs[CONFIGS[0][0]].idle_cpu
        line(max(idle) <= TARGET_IDLE, f"idle CPU per rank <= {TARGET_IDLE:.0%} of a core", result,
             ", ".join(f"{c:.1%}" for c in idle))
    return lines


def dataset_line(data: DataSet) -> str:
    stored = "/".join(str(len(paths)) for name, paths in data.segments if name != "replicated")
    replicated = sum(len(paths) for name, paths in data.segments if name == "replicated")
    return (f"{data.label}: {data.files():,} files in the epoch ({replicated:,} replicated; ranks 0/1/2 store "
            f"{stored}), {data.raw_bytes / 1e6:,.1f} MB; codec {data.codec}, --chunk-size {data.chunk_size // KIB} "
            f"KiB: {data.chunks} chunks ({data.replicated_chunks} replicated, {data.split_pieces} split), "
            f"{data.chunk_bytes / 1e6:,.1f} MB"
            + (f"; {data.left_out} file(s) left out (empty)" if data.left_out else "")
            + (f"; --quick: the epoch reads 1/{data.divisor} of each group" if data.divisor > 1 else ""))


def placement_line(placements: list[RankPlacement]) -> str:
    """What each placement of this run put where."""
    said = []
    for placement in placements:
        if placement.own:
            cpus = "; ".join(f"rank {rank} on {sorted(cpus)}" for rank, cpus in enumerate(placement.own))
            said.append(f"'{placement.label}' = {cpus}, every thread of each for the whole job, and the reader on "
                        f"its rank's CPUs while that rank reads (the job started, staged and idled on "
                        f"{sorted(placement.job or ())}; cp on them too)")
        elif placement.reading is not None:
            said.append(f"'{placement.label}' = the reading rank and the reader on CPU {min(placement.reading)}, the "
                        f"ranks serving it on CPU {min(placement.serving or ())} (the job started, staged and idled "
                        f"on CPU {min(placement.job or ())}; cp on it too)")
        else:
            said.append(f"'{placement.label}' = every CPU this process may use, the scheduler's choice")
    return "placement: " + "; ".join(said)


def print_report(sets: list[DataSet], runs: list[Run], idle_seconds: float, notes: list[str], quick: bool) -> None:
    import mpi4py
    from mpi4py import MPI

    print()
    print("bench_serve: `mpiexec -n 3 fanstore serve DEST MP{rank} --local-dir LOCAL{rank} --stats` on one machine, "
          "each rank with its own mount; one rank reads the whole epoch at a time while the others serve it")
    for line in machine_lines():
        print(line)
    print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, mpi4py {mpi4py.__version__}, "
          f"mpiexec {mpiexec_command()}")
    print(placement_line(list(dict.fromkeys(result.placement for result in runs))))
    if quick:
        print("--quick: a smoke test, never a verdict: 1/10 of the files, one job per way; the CPU and files/s "
              "targets below give their figures and judge nothing")
    for data in sets:
        print(dataset_line(data))
    for note in notes:
        print(f"note: {note}")
    print()
    print("epochs: files/s of open + read all + close per file (api: Dataset.read), one reader process; local = "
          "files stored on this rank, replicated = val/ (on every rank), remote = stored on the other two ranks; "
          f"every read through a mount is its first (a fresh job per way; {JUDGED_JOBS} jobs for each judged "
          "way, prefetch off and prefetch-list, by turns, without --quick, and the table shows the job whose "
          "remote/local is the median); CPU us = microseconds of CPU per file of each process, read from its "
          "CPU-time clock (nanoseconds, every thread, ended ones too) at each group's start and end: rank = the "
          "reading rank's serving process, peers = each of the two ranks serving it (in rank order), reader = the "
          "reader process; MB/s = whole epoch; others = cores other "
          f"processes used meanwhile ('!' above {NOISY_OTHERS}); as placed = the rank's counters say local and "
          "replicated files came from its directory, remote ones from peers, none from DEST ('N twice': N blobs "
          "read a second time, by a prefetch that started while the reader was loading the file itself). plain and "
          "api: one pass, split for each rank as its mount's passes are")
    print_table(["dataset", "placement", "reader", "rank", "local files/s", "CPU us: rank", "peers", "reader",
                 "remote files/s", "CPU us: rank", "peers", "reader", "remote/local", "replicated files/s", "MB/s",
                 "others", "as placed"], epoch_rows(runs), left=4)
    print()
    print("threads: CPU us per file of each thread of the serving processes, by the kernel name fanstore gives it "
          "(/proc/PID/task/*/schedstat at each group's start and end; 'main' runs the FUSE loop), the jobs of the "
          "table above, every rank's epoch summed: reading rank = the rank whose mount is read, over its local and "
          "its remote files; serving rank = the ranks storing the remote files over them (over the local files: the "
          "other ranks, which then serve nothing); a thread that ended between two samples is missing (the "
          "process's clock above counts it)")
    print_table(["dataset", "placement", "reader", "process", "thread", "us/local file", "us/remote file",
                 "remote - local"], thread_rows(runs), left=5)
    print()
    print("staging (the first job, page cache dropped first" + ("" if all(r.cold for r in runs) else
          ": NOT dropped (not root), DEST was warm") + "): seconds per rank from --stats (0.1 s resolution); MB/s = "
          "chunk files' bytes / the slowest rank's seconds; cp = `cp -r DEST/chunks` to a fresh directory on the "
          "same file system, +fsync = then fsync each copy; DEST B = bytes read from DEST while staging "
          "(job totals), restart = the same in the second job (chunks verified in place); epochs B = bytes from "
          f"DEST during each job's epochs; idle = each rank's CPU over {idle_seconds:g} s once mounted, before any "
          "read; no bell = the same in the job with --no-doorbell")
    print_table(["dataset", "placement", "files", "chunks", "stored MB", "local dirs MB", "staging s", "MB/s",
                 "cp MB/s", "+fsync", "DEST B staging", "restart", "epochs B", "idle CPU/rank", "no bell"],
                staging_rows(runs), left=2)
    print()
    print("targets")
    for line in target_lines(runs, quick):
        print(f"  {line}")


# --- main --------------------------------------------------------------------------------------------------------

def serve_requirements_missing() -> list[str]:
    """What a bench that runs `mpiexec fanstore serve` needs and this machine lacks (bench_train's too)."""
    missing = []
    if importlib.util.find_spec("mpi4py") is None:
        missing.append("mpi4py (scripts/setup installs it with the mpich wheel)")
    if mpiexec_command() is None:
        missing.append("mpiexec (scripts/setup installs the mpich wheel)")
    reason = fuse_unavailable_reason()
    if reason is not None:
        missing.append(f"FUSE: {reason}")
    return missing


def missing_requirements() -> list[str]:
    missing = serve_requirements_missing()
    missing += [f"{tool} (util-linux, coreutils)" for tool in ("taskset", "cp") if shutil.which(tool) is None]
    if pinned_placement() is PER_NODE and not {0, 1} <= os.sched_getaffinity(0):
        missing.append(f"CPUs 0 and 1 to place the ranks on, or any {PER_RANK_MIN_CPUS} CPUs (this process may use "
                       f"{sorted(os.sched_getaffinity(0))})")
    return missing


def clean_up(workdir: Path) -> None:
    """Leave nothing of the work directory: the jobs that name it (mpiexec is asked first, so the ranks unmount
    and print as they end), the ranks' watchdogs, any mount under it, then the directory itself."""
    def ours() -> list[int]:  # the watchdogs are left to end on their own once their rank is gone
        return [pid for pid in processes_mentioning(str(workdir)) if b"watchdog.py" not in command_line(pid)]

    def is_launcher(pid: int) -> bool:
        return command_line(pid).split(b"\0")[0].endswith(b"mpiexec")

    for pid in filter(is_launcher, ours()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    # The rest (a simulated file system's servers, bench_cluster's) are asked once the job has ended, as a bench's
    # own end asks them: they serve the job's ranks until then. Waiting for them to end by themselves took 30 s.
    deadline, others_asked = time.monotonic() + 30, False
    while (left := ours()) and time.monotonic() < deadline:
        if not others_asked and not any(map(is_launcher, left)):
            others_asked = True
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        time.sleep(0.1)
    for pid in ours():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    unmount_all(mounted_under(workdir))
    deadline = time.monotonic() + 10
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in processes_mentioning(str(workdir)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if mounted_under(workdir):
        print(f"bench_serve: mounts left under {workdir}; not removing it", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def start_reaper(workdir: Path, script: str = __file__) -> subprocess.Popen[bytes]:
    """`script --reap` (this bench, or another that cleans up the same way), in a session of its own, told the work
    directory on a pipe: when the pipe closes, whatever ended this process (SIGKILL included), it cleans up. Its
    command line does not name the directory, so clean_up never takes it for one of the job's processes."""
    reaper = subprocess.Popen([sys.executable, script, "--reap"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=None, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    reaper.stdin.write(f"{workdir}\n".encode())  # type: ignore[union-attr]
    reaper.stdin.flush()  # type: ignore[union-attr]
    return reaper


@contextlib.contextmanager
def reaped_workdir(prefix: str, script: str = __file__) -> Iterator[Path]:
    """A fresh work directory whose job processes, mounts and files are cleaned up however the bench ends: by this
    block's own end, or, after a SIGKILL, by the reaper (`script --reap`, which must reap the same `prefix`)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    reaper = start_reaper(workdir, script)
    try:
        yield workdir
    finally:
        clean_up(workdir)
        reaper.stdin.close()  # type: ignore[union-attr] - it finds nothing left to do, and ends
        reaper.wait()


def reap(prefix: str = "bench-serve-") -> int:
    """--reap: read the work directory, wait for end-of-file on stdin, clean up (only a work directory whose name
    starts with `prefix`: a stray line must not remove anything else)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    workdir = Path(sys.stdin.buffer.readline().decode().strip())
    while sys.stdin.buffer.read(4096):
        pass
    if workdir.is_absolute() and workdir.name.startswith(prefix) and workdir.exists():
        clean_up(workdir)
    return 0


def exit_on_signals(bench: str) -> None:
    """SIGTERM and SIGHUP end the bench through SystemExit, so that its finally blocks clean up (after a SIGKILL,
    the reaper does)."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(f"{bench}: signal {signum}: cleaning up")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--reap"]:
        return reap()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: 1/{QUICK_DIVISOR} of the generated "
                        "files, the pinned placement only, one job per way, a shorter idle sample")
    parser.add_argument("--pinned-only", action="store_true", help="only the pinned placement ('2 CPUs per rank' "
                        f"on {PER_RANK_MIN_CPUS} CPUs or more, else 'a CPU per node')")
    parser.add_argument("--only", help=f"comma-separated datasets to run: {','.join([DEMO_LABEL, *GENERATED])}")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where inputs are made once")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    if missing:
        print(f"bench_serve: missing {'; '.join(missing)}", file=sys.stderr)
        return 2
    exit_on_signals("bench_serve")
    notes = []
    if os.geteuid() != 0:
        notes.append("not root: the page cache cannot be dropped; staging and cp read DEST warm")
    placements = [pinned_placement()] + ([] if args.quick or args.pinned_only else [UNPINNED])
    idle_seconds = QUICK_IDLE_SECONDS if args.quick else IDLE_SECONDS
    divisor = QUICK_DIVISOR if args.quick else 1
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    sets = []
    if only is None or DEMO_LABEL in only:
        src, dest, codec = build_demo(cache)
        sets.append(describe(DEMO_LABEL, src, dest, codec, DEMO_CHUNK_SIZE, divisor))
    for label, spec in GENERATED.items():
        if only is None or label in only:
            src, dest = build_generated(cache, label, spec, divisor)
            sets.append(describe(label, src, dest, spec.codec, spec.chunk_size))
    for data in sets:
        few = [name for name, paths in data.segments if name != "replicated" and len(paths) < FEW_FILES]
        if few:
            notes.append(f"{data.label}: {' and '.join(few)} each store fewer than {FEW_FILES} of the epoch's files "
                         "(the placement balances bytes, not files): their 'local' figures are over those few files")
    runs = []
    with reaped_workdir("bench-serve-") as workdir:
        for data in sets:
            epoch_list = workdir / f"epoch-{data.label.replace(' ', '')}.txt"
            epoch_list.write_text("".join(f"{rel}\n" for paths in data.segment_paths() for rel in paths))
            for placement in placements:
                runs.append(measure(data, workdir, placement, idle_seconds, epoch_list,
                                    1 if args.quick else JUDGED_JOBS))
    print_report(sets, runs, idle_seconds, notes, args.quick)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_serve: interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
