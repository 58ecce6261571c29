"""bench_serve: under `mpiexec -n 3 fanstore serve` on this one machine, how fast is a dataset staged, and how fast
does each rank read files stored on itself, on every rank (replicated) and on another rank, beside a plain
directory and the Python API, and what do the ranks cost when idle?

One run, one table (and a staging table): three datasets, each packed with a chunk size that makes chunks
outnumber the ranks many times over, with val/ replicated (--replicate 'val/**'):

  demo      fanstore's demo training set (fanstore/demo_data.py, scale 1; codec zstd-dict:9, as `fanstore demo`);
  128 KiB   generated files of 128 KiB in train/ and val/ (codec lz4, bytes as bench_read makes them);
  4 KiB     generated files of 4 KiB, likewise.

The epoch. Every file with a blob is read once per mount, in one order that every rank follows: the replicated
files, then the files stored on rank 0, on rank 1, on rank 2 (placement.place(index, 3)), each group shuffled
(seeded). For rank r the group of rank r is its local files and the two other groups its remote files; the
order is also the --prefetch-list, so prefetch follows the reader exactly. One rank reads at a time (one reader
process, open + read all + close per file), the other ranks serving it, as they would another node; its
`user.fanstore.stats` counters are read before and after, to check each read came from where the placement says.

Beside each rank's files/s: wall milliseconds per file, and the CPU milliseconds per file that the reading rank's
process used (local files) and that it and the two serving ranks used (remote files), sampled from /proc at each
group's start and end: where a remote read's time goes, waiting or working.

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
verified in its local directory. Once every rank is mounted, before any read, each rank's CPU time
(/proc/PID/stat utime + stime, all its threads) is sampled over a few seconds of idling, in the first job and in
the one without doorbells.

Placement: 'a CPU per node' = each rank stands for a node of its own: the rank that reads and its reader on CPU 0,
the two ranks serving it on CPU 1 (every thread of each is moved before each rank's epoch), as another node's CPUs
would be theirs; the job starts under `taskset -c 0`, so staging, cp and the idle sample run on CPU 0. With every
rank on one CPU a remote read would also cost the reader's only CPU what the serving rank spends on it, which on a
cluster another node pays (the CPU+peers column shows it). 'unpinned' = every CPU this process may use, the
scheduler's choice. Every figure is one run: on the 2-CPU virtual machines this was written on, runs
vary by up to 30%. So the judged ways (prefetch off, prefetch-list) each run three fresh jobs, and their targets
are judged on the median job's ratio, every job's printed beside it; the table shows that median job. Targets are
printed last, PASS or FAIL. --quick: 1/5 of the generated files, 1/5 of each group of the demo's epoch, a CPU
per node only, one job per way, 3 s of idling (about a minute).

The bench cleans up whatever ends it: the job's processes (by pid), the mounts, the work directory; a helper
started in a session of its own (this script with --reap) does it when the bench is killed outright.

Usage: python bench/bench_serve.py [--quick] [--pinned-only] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import multiprocessing.pool
import os
import platform
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
from typing import Any, Iterator, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from bench_read import UNPINNED, Placement, back_memory, print_table, warm, write_files  # noqa: E402
from machine_load import OtherLoad, wait_for_quiet  # noqa: E402

from fanstore.format import CHUNK_HEADER_LEN, NO_CHUNK  # noqa: E402
from fanstore.mount import fuse_mounted_at, fuse_unavailable_reason  # noqa: E402

KIB, MIB = 1024, 1 << 20
RANKS = 3
PER_NODE = Placement("a CPU per node", frozenset({0}))  # the reading rank and its reader; see the docstring
SERVING_CPUS = frozenset({1})  # the ranks serving it, under PER_NODE
MPIEXEC_BESIDE_PYTHON = Path(sys.executable).parent / "mpiexec"
GENERATED = {  # label: (file size, train files, val files, chunk size)
    "128 KiB": (128 * KIB, 1500, 150, 1 * MIB),
    "4 KiB": (4 * KIB, 3000, 300, 64 * KIB),
}
QUICK_DIVISOR = 5
FEW_FILES = 50  # a rank storing fewer of the epoch's files than this gets a note: its local figures are rough
MIN_FILES = 10  # per group of the epoch, when --quick reads only part of the demo's
GENERATED_CODEC = "lz4"
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

TARGET_DATASET = "128 KiB"
TARGET_REMOTE_OFF = 0.70  # remote files/s as a share of local files/s, --prefetch 0
TARGET_REMOTE_LIST = 0.90  # the same with --prefetch-list
TARGET_IDLE = 0.05  # of a core, per rank

CONFIGS = (("prefetch off", ("--prefetch", "0")), ("prefetch-list", ("--prefetch-list",)),
           ("off, no bell", ("--prefetch", "0", "--no-doorbell")))
JUDGED = {"prefetch off": TARGET_REMOTE_OFF, "prefetch-list": TARGET_REMOTE_LIST}  # the configs with a target
# Jobs run for each judged config (--quick: 1); the target is judged on the median job's ratio. One job's ratio of
# the same code swung from 70% to 97% here: a local group read while something else ran sets the whole ratio.
JUDGED_JOBS = 3
STAGING_LINE = re.compile(r"^  staging: .+? from DEST, .+? from peers, .+? reused, (?P<seconds>[\d.]+) s", re.M)
TOTALS_LINE = re.compile(r"^job \(\d+ ranks\): .*bytes read from DEST: .* staging \((?P<staging>\d+) B\), "
                         r".* during the epochs \((?P<epochs>\d+) B\)", re.M)


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


def build_generated(cache: Path, label: str, size: int, train: int, val: int, chunk_size: int) -> tuple[Path, Path]:
    """Files of one size in train/ and val/, and their dataset: made once, reused while the marker matches."""
    base = cache / f"serve-{size}-{train}-{val}-{chunk_size}"
    src, dest, marker = base / "files", base / "dataset", base / "complete"
    if not marker.exists() or marker.read_text() != f"{GENERATED_VERSION} {GENERATED_CODEC}\n":
        progress(f"[{label}] generating {train + val:,} files into {base} (once) ...")
        shutil.rmtree(base, ignore_errors=True)
        rng = np.random.default_rng(size * 7919 + train)
        for group, count in (("train", train), ("val", val)):
            write_files(src / group, (f"d{i // FILES_PER_DIR:03d}/f{i:06d}.bin" for i in range(count)), rng, size)
        fanstore_pack(src, dest, GENERATED_CODEC, chunk_size)
        marker.write_text(f"{GENERATED_VERSION} {GENERATED_CODEC}\n")
    return src, dest


def build_demo(cache: Path) -> tuple[Path, Path, str]:
    """The demo training set and its dataset, packed as `fanstore demo` packs it but in small chunks."""
    from fanstore.demo import DEMO_CODEC
    from fanstore.demo_data import build_demo_tree

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
    from fanstore.format import FLAG_BLOCKED
    from fanstore.index import Index
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
                   ) -> list[tuple[float, int, list[int]]]:
    """What a data-loader worker does per sample (open, read it all, close; or the API's read), timed per segment:
    (seconds, bytes, CPU ticks each of `pids` used meanwhile) of each."""
    timings = []
    for paths in segments:
        total = 0
        ticks = [cpu_ticks(pid) for pid in pids]
        started = time.perf_counter()
        if root is None:
            for rel in paths:
                total += len(_api_dataset.read(rel))
        else:
            for rel in paths:
                with open(os.path.join(root, rel), "rb") as f:
                    total += len(f.read())
        seconds = time.perf_counter() - started
        timings.append((seconds, total, [cpu_ticks(pid) - before for pid, before in zip(pids, ticks)]))
    return timings


@contextlib.contextmanager
def reader_process(placement: Placement, api_dest: Path | None = None) -> Iterator[multiprocessing.pool.Pool]:
    """One reader process, started before timing, placed as asked (it inherits this process's affinity)."""
    before = os.sched_getaffinity(0)
    if placement.cpus is not None:
        os.sched_setaffinity(0, placement.cpus)
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
    sources: dict[str, int] = field(default_factory=dict)  # local, fetched, fallback: reads during the pass

    def rate(self, segments: list[str]) -> float:
        return sum(self.files[s] for s in segments) / sum(self.seconds[s] for s in segments)

    def cpu_per_file(self, segments: list[str], ranks: list[int]) -> float:
        """Milliseconds of CPU the processes of `ranks` used per file of `segments`."""
        return 1e3 * sum(self.cpu[s][r] for s in segments for r in ranks) / sum(self.files[s] for s in segments)


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
    if [total for _, total, _ in timings] != expected:
        raise SystemExit(f"bench_serve: [{data.label}] read {[t for _, t, _ in timings]} bytes by segment "
                         f"from {root or 'the API'}, expected {expected}")
    tick = os.sysconf("SC_CLK_TCK")
    return Epoch({name: seconds for name, (seconds, _, _) in zip(names, timings)},
                 {name: len(paths) for name, paths in data.segments}, others.cpu_seconds / wall,
                 {name: [t / tick for t in ticks] for name, (_, _, ticks) in zip(names, timings)})


def class_segments(rank: int) -> dict[str, list[str]]:
    """The epoch's segments that are, for `rank`, its local, replicated and remote files."""
    return {"local": [f"rank {rank}"], "replicated": ["replicated"],
            "remote": [f"rank {r}" for r in range(RANKS) if r != rank]}


# --- the job -----------------------------------------------------------------------------------------------------

def mpiexec_command() -> str | None:
    return str(MPIEXEC_BESIDE_PYTHON) if MPIEXEC_BESIDE_PYTHON.exists() else shutil.which("mpiexec")


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, every thread of it, in clock ticks."""
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

    def __init__(self, data: DataSet, workdir: Path, placement: Placement, options: Sequence[str], name: str) -> None:
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
        return JobReport([float(staging[r]["seconds"]) for r in range(RANKS)], int(totals["staging"]),
                         int(totals["epochs"]))

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


def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU use over `seconds` of wall time, as a share of one core."""
    time.sleep(IDLE_SETTLE)
    before = [cpu_ticks(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(seconds)
    after = [cpu_ticks(pid) for pid in pids]
    wall = time.monotonic() - started
    return [(b - a) / os.sysconf("SC_CLK_TCK") / wall for a, b in zip(before, after)]


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
    placement: str
    epochs: dict[str, list[Epoch]] = field(default_factory=dict)  # way of reading -> one Epoch per rank
    jobs: dict[str, JobReport] = field(default_factory=dict)  # config -> its (first) job's report
    # config -> every job's epochs and report, in the order run; `epochs` holds the median job's (judged configs)
    rounds: dict[str, list[tuple[list[Epoch], JobReport]]] = field(default_factory=dict)
    copy_seconds: tuple[float, float] = (0.0, 0.0)  # cp alone, cp then fsync of each copy
    cold: bool = False  # the page cache was dropped before staging and before cp


def copy_chunks(data: DataSet, workdir: Path, placement: Placement) -> tuple[float, float, bool]:
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


def serve_epochs(data: DataSet, workdir: Path, placement: Placement, config: str, options: Sequence[str],
                 idle_seconds: float | None) -> tuple[list[Epoch], JobReport]:
    """One fresh job: (idle CPU,) each rank's epoch through its own mount, one rank at a time; its --stats."""
    with ServeJob(data, workdir, placement, options, f"{data.label.replace(' ', '')}-{config}") as job:
        progress(f"[{data.label}, {placement.label}] {config}: starting the job ...")
        pids = job.wait_ready()
        if idle_seconds:
            progress(f"[{data.label}, {placement.label}] {config}: every rank mounted; idle CPU ...")
        idle = idle_cpu(pids, idle_seconds) if idle_seconds else []
        epochs = []
        for rank, mountpoint in enumerate(job.mountpoints):
            progress(f"[{data.label}, {placement.label}] {config}: rank {rank} reads ...")
            place_ranks(placement, pids, rank)
            with reader_process(placement) as pool:
                before = source_counts(mountpoint)
                epoch = timed_epoch(pool, mountpoint, data, pids)
                after = source_counts(mountpoint)
            epoch.sources = {key: after[key] - before[key] for key in after}
            epochs.append(epoch)
        progress(f"[{data.label}, {placement.label}] {config}: stopping the job ...")
        report = job.stop()
    report.idle_cpu = idle
    return epochs, report


def place_ranks(placement: Placement, pids: Sequence[int], reading: int) -> None:
    """Under PER_NODE, rank `reading` goes to the reader's CPU and the others to SERVING_CPUS: every thread of each
    (threads started later inherit their starter's CPUs)."""
    if placement is not PER_NODE:
        return
    for rank, pid in enumerate(pids):
        cpus = placement.cpus if rank == reading else SERVING_CPUS
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                os.sched_setaffinity(int(tid), cpus)


def measure(data: DataSet, workdir: Path, placement: Placement, idle_seconds: float, epoch_list: Path,
            judged_jobs: int = JUDGED_JOBS) -> Run:
    result = Run(data, placement.label)
    progress(f"[{data.label}, {placement.label}] cp of the chunk files ...")
    copied, synced, cold = copy_chunks(data, workdir, placement)
    result.copy_seconds = (copied, synced)
    progress(f"[{data.label}, {placement.label}] plain and api ...")
    warm(data.src)
    with reader_process(placement) as pool:
        result.epochs["plain"] = [timed_epoch(pool, data.src, data)]
    warm(data.dest)
    with reader_process(placement, api_dest=data.dest) as pool:
        result.epochs["api"] = [timed_epoch(pool, None, data)]
    for rank in range(RANKS):
        shutil.rmtree(workdir / f"local{rank}", ignore_errors=True)
    for number, (config, options) in enumerate(CONFIGS):
        if number == 0:
            result.cold = drop_caches() and cold  # staging reads DEST from disk, as it would a shared file system
        if config == "prefetch-list":
            options = (*options, str(epoch_list))
        measure_idle = number == 0 or "--no-doorbell" in options
        rounds = []
        for job in range(judged_jobs if config in JUDGED else 1):
            rounds.append(serve_epochs(data, workdir, placement, config, options,
                                       idle_seconds if measure_idle and job == 0 else None))
        result.rounds[config] = rounds
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
                cpu_local = cpu_remote = ""
                if epoch.sources:
                    peers = [r for r in range(RANKS) if r != rank]
                    cpu_local = f"{epoch.cpu_per_file(classes['local'], [rank]):.2f}"
                    cpu_remote = (f"{epoch.cpu_per_file(classes['remote'], [rank]):.2f}"
                                  f"+{epoch.cpu_per_file(classes['remote'], peers):.2f}")
                rows.append([result.data.label, result.placement, way, str(rank), f"{local:,.0f}",
                             f"{replicated:,.0f}", f"{remote:,.0f}", f"{remote / local:.0%}", f"{megabytes:,.0f}",
                             f"{1e3 / local:.2f}", cpu_local, f"{1e3 / remote:.2f}", cpu_remote,
                             f"{epoch.others:.2f}{flag}", checked])
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
        rows.append([data.label, result.placement, f"{data.files():,}", f"{data.chunks} ({data.replicated_chunks} r)",
                     f"{data.chunk_bytes / 1e6:,.1f}", f"{data.local_dir_bytes / 1e6:,.1f}",
                     " ".join(f"{s:.1f}" for s in first.staging_seconds), rate,
                     f"{data.chunk_bytes / 1e6 / copied:,.0f}", f"{data.chunk_bytes / 1e6 / synced:,.0f}",
                     f"{first.staging_bytes:,}" + (" ok" if ok else " FAIL"), f"{second.staging_bytes:,}",
                     epoch_bytes, " ".join(f"{c:.1%}" for c in first.idle_cpu),
                     " ".join(f"{c:.1%}" for c in result.jobs["off, no bell"].idle_cpu)])
    return rows


def aggregate_ratio(epochs: list[Epoch]) -> float:
    """Remote files/s over local files/s of a job's epochs, every rank's files and seconds summed."""
    totals = {}
    for name in ("local", "remote"):
        files = sum(epochs[r].files[s] for r in range(RANKS) for s in class_segments(r)[name])
        seconds = sum(epochs[r].seconds[s] for r in range(RANKS) for s in class_segments(r)[name])
        totals[name] = files / seconds
    return totals["remote"] / totals["local"]


def target_lines(runs: list[Run]) -> list[str]:
    lines = []

    def line(ok: bool, what: str, result: Run, detail: str) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what:<47}  {result.data.label:>7}, {result.placement:<14}  "
                     f"{detail}")

    for result in runs:
        if result.data.label == TARGET_DATASET:
            for config, target in JUDGED.items():
                ratios = [aggregate_ratio(epochs) for epochs, _ in result.rounds[config]]
                ratio = aggregate_ratio(result.epochs[config])  # the median job's (measure)
                each = f"median of {len(ratios)} jobs: " + " ".join(f"{r:.0%}" for r in ratios) + ", " \
                    if len(ratios) > 1 else ""
                line(ratio >= target, f"remote >= {target:.0%} of local files/s, {config}", result,
                     f"{ratio:.1%} ({each}every rank's files and seconds summed)")  # 89.6% is no pass
            lines.append(f"----  {'(no target) the same, off, no bell':<47}  {result.data.label:>7}, "
                         f"{result.placement:<14}  {aggregate_ratio(result.epochs['off, no bell']):.0%}")
        epoch_bytes = [report.epoch_bytes for config, _ in CONFIGS for _, report in result.rounds[config]]
        line(not any(epoch_bytes), "0 B from DEST during the epochs", result,
             f"{' and '.join(f'{b:,} B' for b in epoch_bytes)} (every job)")
        ok, detail = staging_ok(result)
        line(ok, "each stored byte read from DEST once", result, detail)
        idle = result.jobs[CONFIGS[0][0]].idle_cpu
        line(max(idle) <= TARGET_IDLE, f"idle CPU per rank <= {TARGET_IDLE:.0%} of a core", result,
             ", ".join(f"{c:.1%}" for c in idle))
    return lines


def machine_lines() -> list[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    with open("/proc/meminfo") as meminfo:
        memory = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    return [f"machine: {os.cpu_count()} CPUs ({model}), this process may use {sorted(os.sched_getaffinity(0))}; "
            f"{memory / 2**30:.1f} GiB memory; Linux {platform.release()}, Python {platform.python_version()}"]


def dataset_line(data: DataSet) -> str:
    stored = "/".join(str(len(paths)) for name, paths in data.segments if name != "replicated")
    replicated = sum(len(paths) for name, paths in data.segments if name == "replicated")
    return (f"{data.label}: {data.files():,} files in the epoch ({replicated:,} replicated; ranks 0/1/2 store "
            f"{stored}), {data.raw_bytes / 1e6:,.1f} MB; codec {data.codec}, --chunk-size {data.chunk_size // KIB} "
            f"KiB: {data.chunks} chunks ({data.replicated_chunks} replicated, {data.split_pieces} split), "
            f"{data.chunk_bytes / 1e6:,.1f} MB"
            + (f"; {data.left_out} file(s) left out (empty)" if data.left_out else "")
            + (f"; --quick: the epoch reads 1/{data.divisor} of each group" if data.divisor > 1 else ""))


def print_report(sets: list[DataSet], runs: list[Run], idle_seconds: float, notes: list[str]) -> None:
    import mpi4py
    from mpi4py import MPI

    print()
    print("bench_serve: `mpiexec -n 3 fanstore serve DEST MP{rank} --local-dir LOCAL{rank} --stats` on one machine, "
          "each rank with its own mount; one rank reads the whole epoch at a time while the others serve it")
    for line in machine_lines():
        print(line)
    print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, mpi4py {mpi4py.__version__}, "
          f"mpiexec {mpiexec_command()}")
    print("placement: 'a CPU per node' = the reading rank and the reader on CPU 0, the ranks serving it on CPU 1 (the "
          "job started, staged and idled on CPU 0; cp on CPU 0); 'unpinned' = the CPUs above, the scheduler's choice. "
          "One run per figure: runs of small-file reads vary by up to 30% on 2-CPU VMs")
    for data in sets:
        print(dataset_line(data))
    for note in notes:
        print(f"note: {note}")
    print()
    print("epochs: files/s of open + read all + close per file (api: Dataset.read), one reader process; local = "
          "files stored on this rank, replicated = val/ (on every rank), remote = stored on the other two ranks; "
          f"every read through a mount is its first (a fresh job per way; {JUDGED_JOBS} jobs for the judged "
          "ways, prefetch off and prefetch-list, without --quick, and the table shows the job whose ratio is the "
          "median); MB/s = whole epoch; others = cores other "
          f"processes used meanwhile ('!' above {NOISY_OTHERS}); as placed = the rank's counters say local and "
          "replicated files came from its directory, remote ones from peers, none from DEST ('N twice': N blobs "
          "read a second time, by a prefetch that started while the reader was loading the file itself). plain and "
          "api: one pass, split for each rank as its mount's passes are. local ms, remote ms = wall milliseconds per "
          "file; "
          "CPU = milliseconds of CPU the reading rank's serving process used per local file; CPU+peers = the same "
          "per remote file, and what the two serving ranks used (utime + stime, 10 ms ticks, sampled at each "
          "group's start and end)")
    print_table(["dataset", "placement", "reader", "rank", "local files/s", "replicated", "remote", "remote/local",
                 "MB/s", "local ms", "CPU", "remote ms", "CPU+peers", "others", "as placed"], epoch_rows(runs), left=4)
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
    for line in target_lines(runs):
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
    if not PER_NODE.cpus | SERVING_CPUS <= os.sched_getaffinity(0):
        missing.append(f"CPUs {sorted(PER_NODE.cpus | SERVING_CPUS)} to place the ranks on (this process may use "
                       f"{sorted(os.sched_getaffinity(0))})")
    return missing


def clean_up(workdir: Path) -> None:
    """Leave nothing of the work directory: the jobs that name it (mpiexec is asked first, so the ranks unmount
    and print as they end), the ranks' watchdogs, any mount under it, then the directory itself."""
    def ours() -> list[int]:  # the watchdogs are left to end on their own once their rank is gone
        return [pid for pid in processes_mentioning(str(workdir)) if b"watchdog.py" not in command_line(pid)]

    for pid in ours():
        if command_line(pid).split(b"\0")[0].endswith(b"mpiexec"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:
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
    parser.add_argument("--quick", action="store_true", help=f"1/{QUICK_DIVISOR} of the generated files, "
                                                             "a CPU per node only, a shorter idle sample")
    parser.add_argument("--pinned-only", action="store_true", help="only the 'a CPU per node' placement")
    parser.add_argument("--only", help="comma-separated datasets to run: demo,128 KiB,4 KiB (development)")
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
    placements = [PER_NODE] if args.quick or args.pinned_only else [PER_NODE, UNPINNED]
    idle_seconds = QUICK_IDLE_SECONDS if args.quick else IDLE_SECONDS
    divisor = QUICK_DIVISOR if args.quick else 1
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    sets = []
    if only is None or DEMO_LABEL in only:
        src, dest, codec = build_demo(cache)
        sets.append(describe(DEMO_LABEL, src, dest, codec, DEMO_CHUNK_SIZE, divisor))
    for label, (size, train, val, chunk_size) in GENERATED.items():
        if only is None or label in only:
            src, dest = build_generated(cache, label, size, train // divisor, val // divisor, chunk_size)
            sets.append(describe(label, src, dest, GENERATED_CODEC, chunk_size))
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
    print_report(sets, runs, idle_seconds, notes)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_serve: interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
