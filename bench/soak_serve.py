"""soak_serve: does a `fanstore serve` job hold steady over many epochs, or does it leak memory, descriptors,
threads or idle CPU, or start failing reads, as a long training job would find out after hours?

The job. `mpiexec -n 3 fanstore serve DEST MP{rank} --local-dir LOCAL{rank} --cache-size SIZE --stats -- READER`
on this machine (or, with --separate-nodes, on three nodes made by tests/separate_nodes.py: each rank its own
network, hostname, /tmp and /dev/shm, MPI over TCP), every other option serve's default. READER is this script with
--reader, each rank's COMMAND: every epoch it reads every file of the dataset through its rank's mount (open, read
all, check the size and CRC-32 against the original, close), in an order shuffled anew each epoch (seeded by the
seed, the rank and the epoch), all three ranks at once. The epochs run in lock step: a rank that ends its epoch
reports and waits, and the next epoch starts once every rank has been sampled.

Reads reach the daemon. The mounts keep the kernel's page cache (keep_cache), so a file read once would be served by
the kernel ever after, and the daemon would idle through every later epoch. The reader drops each file's pages
after reading it: posix_fadvise(POSIX_FADV_DONTNEED) on the open descriptor, which does evict a FUSE file's pages
(mincore on a mapping of a file read through `fanstore mount` showed every page resident after a read, none after
DONTNEED, on Linux 6.18). Each rank checks at start, with its daemon's read counters (the user.fanstore.stats
xattr: blobs read from its directory, its peers and DEST, each counted once the decoding ahead a read starts has
settled), that a first read of a small file reaches the daemon, a second is the kernel's (0 blob reads), and one
after DONTNEED reaches it again; and each epoch's blob reads are counted.

The dataset. Files of several sizes in train/ (spread over the ranks) and val/ (replicated, --replicate 'val/**'):
8 KiB to 1 MiB, packed with lz4 in chunks small enough that each rank stores many; a few 5 MiB files are stored in
1 MiB blocks (read block by block through the mount's block cache, and from peers by threads). --cache-size is a
small fraction of the dataset, so the decoded cache churns (its evictions per epoch are shown).

What is sampled, for each rank's serving process (the reader's parent): after every epoch, its RSS (VmRSS, and of
it RssAnon, the process's own memory; the rest is mapped files and MPICH's shared memory), open files (entries of
/proc/PID/fd) and threads (Threads of /proc/PID/status, and of them those idle in trio's thread cache, which trio
names 'Trio thread N' while they wait: each ends after 10 s without a job and starts again when reads need it, so
they come and go with the reads and are not counted by the threads target); before the first epoch and after the
last, its idle CPU: its CPU-time clock (machine_load.cpu_ns) over a few seconds with no reads, once every rank is
mounted and again once the last epoch is over. The readers count every read that failed (an error, a short read,
a wrong size or CRC-32).

Targets, printed last, PASS or FAIL: after epoch 2, RSS grows by less than 1 MiB an epoch (the slope of a
least-squares fit over epochs 3..N, on every rank), open files and threads (trio's idle workers aside) stay what
they were after epoch 2; no read failed; every epoch's reads reached the daemons; idle CPU at the end within
IDLE_MARGIN of a core of the start's. Nothing is timed: the s and files/s columns only show the epochs' pace.

Placement: unpinned (every CPU this process may use); the soak judges counts, not speed. --serve-options passes
more options to every rank (`--serve-options '--prefetch 0'`, say). The soak cleans up whatever ends it
(bench_serve's reaped_workdir: the job's processes, the mounts, the work directory, and a reaper after a SIGKILL).
--json writes every figure, for tests/test_soak.py, which runs the small set for 4 epochs.

Usage: python bench/soak_serve.py [--epochs N] [--small] [--separate-nodes] [--serve-options OPTIONS]
                                  [--idle-seconds S] [--cache DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

KIB, MIB = 1024, 1 << 20
RANKS = 3
WORKDIR_PREFIX = "soak-serve-"
STATS_XATTR = "user.fanstore.stats"
SEED = 20240917
EPOCHS = 20
STEADY_AFTER = 2  # epochs of warm-up: RSS, open files and threads are judged from the next one on
RSS_SLOPE_TARGET = 1 * MIB  # bytes an epoch, the least-squares slope over epochs STEADY_AFTER+1..N
IDLE_SECONDS, IDLE_SETTLE = 5.0, 2.0  # idle CPU: sampled over IDLE_SECONDS, IDLE_SETTLE after the last read
IDLE_MARGIN = 0.01  # of a core: idle CPU at the end may exceed the start's by this much
DAEMON_READS_SHARE = 0.9  # an epoch's blob reads, at least this share of its files (a few may hit the cache)
READY_TIMEOUT = 600.0  # seconds for staging, mounting and the readers' start
EPOCH_TIMEOUT = 1200.0  # seconds for one epoch of every rank
STOP_TIMEOUT = 120.0  # seconds for the job to end once the readers are told to
READER_WAIT = 3600.0  # seconds a reader waits for the next epoch before it gives up (the soak is gone)
FAILURES_KEPT = 5  # messages of failed reads each rank reports per epoch
# Separate nodes: the same paths on every node, as a job script gives them; each node's /tmp is its own.
NODE_MOUNTPOINT, NODE_LOCAL_DIR = "/tmp/fanstore-soak-mnt", "/tmp/fanstore-soak-local"


@dataclass(frozen=True, slots=True)
class SoakSet:
    """A generated dataset and the cache size it is soaked with."""

    label: str
    train: int  # files in train/ (spread over the ranks)
    val: int  # files in val/ (replicated)
    sizes: tuple[int, ...]  # bytes of each file, in turn
    blocked: int  # files of BLOCKED_SIZE in train/, stored in blocks
    chunk_size: int
    cache_size: int  # --cache-size of each rank's mount


BLOCKED_SIZE = 5 * MIB  # over fanstore pack's --blocks-above default (4 MiB): stored in 1 MiB blocks
SETS = {
    "full": SoakSet("full", 1200, 80, (8 * KIB, 48 * KIB, 200 * KIB, 1 * MIB), 3, 1 * MIB, 4 * MIB),
    # tests/test_soak.py's: every other file is one the mount decodes ahead (stored in >= 256 KiB), so that the
    # first reads start the prefetch threads (a pool that starts its threads as work queues up, 8 by default), and
    # the few epochs of a test judge a thread count that has stopped rising.
    "small": SoakSet("small", 120, 12, (8 * KIB, 1 * MIB, 48 * KIB, 1 * MIB, 200 * KIB, 1 * MIB), 1, 512 * KIB,
                     2 * MIB),
}
CODEC = "lz4"
FILES_PER_DIR = 100
DATASET_VERSION = "soak_serve files v1"

_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"{time.monotonic() - _STARTED:6.1f} s  {message}", file=sys.stderr, flush=True)


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a reader of `path` never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


# --- the reader (each rank's COMMAND) -----------------------------------------------------------------------------

def blob_reads(mountpoint: str) -> int:
    """Blobs the rank's daemon has read so far, from its directory, its peers and DEST: each read the kernel passed
    to the daemon and the decoded cache did not answer."""
    source = json.loads(os.getxattr(mountpoint, STATS_XATTR))["source"]
    return source["local"] + sum(peer["fetched"] for peer in source["peers"].values()) + source["fallback"]


def cache_counters(mountpoint: str) -> dict[str, int]:
    return json.loads(os.getxattr(mountpoint, STATS_XATTR))["cache"]


def read_whole(path: str, drop: bool) -> bytes:
    """The file's bytes; with `drop`, its pages are then dropped from the kernel's page cache, so that the next
    read reaches the daemon again."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while part := os.read(fd, 4 * MIB):
            parts.append(part)
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return b"".join(parts)
    finally:
        os.close(fd)


def settled_blob_reads(mountpoint: str) -> int:
    """blob_reads once it has stopped changing for a tenth of a second (the decoding ahead that a read starts is
    done), or after 5 s."""
    deadline, last = time.monotonic() + 5, blob_reads(mountpoint)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = blob_reads(mountpoint)
        if now == last:
            break
        last = now
    return last


def probe_eviction(mountpoint: str, rel: str) -> list[int]:
    """Blob reads of the daemon for three reads of one small file (read whole in one reply, so the decoded cache
    does not keep it), each counted once the decoding ahead it started is done: the first (>= 1, with what it
    decoded ahead), a second with its pages kept (0: the kernel's), a third after POSIX_FADV_DONTNEED (>= 1:
    DONTNEED evicted them)."""
    path = os.path.join(mountpoint, rel)
    counts = []
    for drop in (False, True, True):
        before = settled_blob_reads(mountpoint)
        read_whole(path, drop)
        counts.append(settled_blob_reads(mountpoint) - before)
    return counts


def wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def reader(sync: Path) -> int:
    """--reader SYNC: one rank's COMMAND (see the docstring). Reports to SYNC/rank{R}.start.json, then
    SYNC/rank{R}.epoch{E}.json after each epoch; starts epoch E once SYNC/go.{E} exists, ends once SYNC/end does."""
    rank, mountpoint = int(os.environ["FANSTORE_RANK"]), os.environ["FANSTORE_MOUNT"]
    manifest = json.loads((sync / "manifest.json").read_text())
    files: list[tuple[str, int, int]] = [tuple(item) for item in manifest["files"]]  # type: ignore[misc]
    write_json(sync / f"rank{rank}.start.json", {
        "serve_pid": os.getppid(), "probe": probe_eviction(mountpoint, manifest["probe"])})
    failed_any = False
    for epoch in range(1, manifest["epochs"] + 1):
        if not wait_for(sync / f"go.{epoch}", READER_WAIT):
            print(f"soak_serve reader, rank {rank}: no go for epoch {epoch} in {READER_WAIT:g} s", file=sys.stderr)
            return 1
        order = list(files)
        random.Random(f"{manifest['seed']}-{rank}-{epoch}").shuffle(order)
        reads_before, cache_before = blob_reads(mountpoint), cache_counters(mountpoint)
        failures, messages, total = 0, [], 0
        started = time.perf_counter()
        for rel, size, crc in order:
            try:
                data = read_whole(os.path.join(mountpoint, rel), drop=True)
            except OSError as exc:
                failures += 1
                messages.append(f"{rel}: {exc}")
                continue
            total += len(data)
            if len(data) != size or zlib.crc32(data) != crc:
                failures += 1
                messages.append(f"{rel}: {len(data)} bytes, CRC-32 {zlib.crc32(data):08x}; expected {size}, {crc:08x}")
        seconds = time.perf_counter() - started
        cache_after = cache_counters(mountpoint)
        write_json(sync / f"rank{rank}.epoch{epoch}.json", {
            "seconds": seconds, "bytes": total, "files": len(order), "failures": failures,
            "messages": messages[:FAILURES_KEPT], "blob_reads": blob_reads(mountpoint) - reads_before,
            "cache_misses": cache_after["misses"] - cache_before["misses"],
            "cache_evictions": cache_after["evictions"] - cache_before["evictions"]})
        failed_any = failed_any or failures > 0
    if not wait_for(sync / "end", READER_WAIT):
        return 1
    return 1 if failed_any else 0


# --- the dataset --------------------------------------------------------------------------------------------------

def build_dataset(cache: Path, spec: SoakSet) -> tuple[Path, Path, list[tuple[str, int, int]]]:
    """The files of `spec`, their dataset and their manifest ((path, size, CRC-32) of each file): made once under
    `cache`, reused while the marker matches."""
    import numpy as np
    from bench_read import write_files
    from bench_serve import fanstore_pack

    sizes = "_".join(str(size // KIB) for size in spec.sizes)
    base = cache / f"soak-{spec.label}-{spec.train}-{spec.val}-{sizes}-{spec.blocked}-{spec.chunk_size}"
    src, dest, manifest, marker = base / "files", base / "dataset", base / "manifest.json", base / "complete"
    if not marker.exists() or marker.read_text() != f"{DATASET_VERSION}\n":
        progress(f"generating the {spec.label} dataset into {base} (once) ...")
        shutil.rmtree(base, ignore_errors=True)
        rng = np.random.default_rng(SEED)
        for group, count in (("train", spec.train), ("val", spec.val)):
            for i in range(count):
                write_files(src / group, [f"d{i // FILES_PER_DIR:02d}/f{i:05d}.bin"], rng,
                            spec.sizes[i % len(spec.sizes)])
        write_files(src / "train" / "large", [f"b{i:02d}.bin" for i in range(spec.blocked)], rng, BLOCKED_SIZE)
        fanstore_pack(src, dest, CODEC, spec.chunk_size)
        files = []
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            data = path.read_bytes()
            files.append((str(path.relative_to(src)), len(data), zlib.crc32(data)))
        manifest.write_text(json.dumps(files))
        marker.write_text(f"{DATASET_VERSION}\n")
    files = [tuple(item) for item in json.loads(manifest.read_text())]
    return src, dest, files  # type: ignore[return-value]


# --- the harness --------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One look at a rank's serving process."""

    rss: int  # bytes (VmRSS): anon + file + shmem below
    rss_anon: int  # the process's own memory (RssAnon): heap, thread arenas, stacks
    rss_file: int  # file pages it has mapped (RssFile): libraries, mapped chunk files
    rss_shmem: int  # shared memory it has touched (RssShmem): MPICH's /dev/shm segments
    fds: int  # entries of /proc/PID/fd
    threads: int
    idle_workers: int  # of the threads, those idle in trio's thread cache (named "Trio thread N")

    @property
    def lasting_threads(self) -> int:
        """The threads that do not end by themselves: trio's idle workers end after 10 s with no job."""
        return self.threads - self.idle_workers


IDLE_TRIO_WORKER = re.compile(r"Trio thread \d+")  # the OS name trio gives a thread of its cache while it waits


def process_sample(pid: int) -> ProcessSample:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss = {name: int(fields[name].split()[0]) * KIB for name in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    idle_workers = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that has just ended
            idle_workers += bool(IDLE_TRIO_WORKER.fullmatch(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()))
    return ProcessSample(rss["VmRSS"], rss["RssAnon"], rss["RssFile"], rss["RssShmem"],
                         len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"]), idle_workers)


def rss_slope(points: Sequence[tuple[int, int]]) -> float | None:
    """The least-squares slope of (epoch, bytes): bytes an epoch; None with fewer than two points."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def wait_for_reports(paths: Sequence[Path], proc: subprocess.Popen[bytes], timeout: float, what: str,
                     log: Path) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if proc.poll() is not None:
            raise SystemExit(f"soak_serve: the job ended (exit {proc.returncode}) before {what}:\n"
                             f"{log.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"soak_serve: no {what} within {timeout:g} s:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return [json.loads(path.read_text()) for path in paths]


@dataclass(slots=True)
class Soak:
    """Everything one soak measured."""

    spec: SoakSet
    files: int
    epochs: int
    separate_nodes: bool
    probe: list[list[int]]  # per rank: blob reads of the eviction probe's three reads
    samples: list[list[ProcessSample]]  # [0]: before the first epoch; [e]: after epoch e; per rank
    after_idle: list[ProcessSample]  # per rank, once the idle CPU at the end is sampled
    reports: list[list[dict[str, Any]]]  # [e - 1]: the readers' reports of epoch e, per rank
    idle_start: list[float]
    idle_end: list[float]
    idle_seconds: float
    returncode: int
    totals: str  # the job's --stats totals line


def serve_argv(dest: Path, workdir: Path, spec: SoakSet, extra: Sequence[str], reader_argv: list[str],
               separate: Any) -> list[str]:
    from bench_serve import mpiexec_command

    options = ["--cache-size", str(spec.cache_size), "--stats", "--quiet", *extra, "--", *reader_argv]
    if separate is None:
        return [str(mpiexec_command()), "-n", str(RANKS), sys.executable, "-m", "fanstore", "serve", str(dest),
                str(workdir / "mp{rank}"), "--local-dir", str(workdir / "local{rank}"), *options]
    serve = [sys.executable, "-m", "fanstore", "serve", str(dest), NODE_MOUNTPOINT, "--local-dir", NODE_LOCAL_DIR,
             *options]
    return [str(mpiexec_command()), *separate.mpmd([serve] * RANKS, make_dirs=[NODE_MOUNTPOINT])]


def soak(spec: SoakSet, epochs: int, cache: Path, idle_seconds: float, separate_nodes: bool,
         extra: Sequence[str] = ()) -> Soak:
    from bench_serve import end_job, process_tree, reaped_workdir
    from machine_load import idle_cpu

    _src, dest, files = build_dataset(cache, spec)
    probe = next(rel for rel, size, _ in files if size <= 64 * KIB)
    with reaped_workdir(WORKDIR_PREFIX, __file__) as workdir, contextlib.ExitStack() as stack:
        sync = workdir / "sync"
        sync.mkdir()
        write_json(sync / "manifest.json", {"files": files, "epochs": epochs, "seed": SEED, "probe": probe})
        separate = None
        # This checkout first; a PYTHONPATH given stays after it (a sitecustomize that traces the ranks, say).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if separate_nodes:
            sys.path.insert(0, str(REPO / "tests"))
            from separate_nodes import SeparateNodes

            separate = stack.enter_context(SeparateNodes(RANKS, workdir, keep_visible=[dest.parent]))
            env.update(separate.environment())
        argv = serve_argv(dest, workdir, spec, extra, [sys.executable, __file__, "--reader", str(sync)], separate)
        for rank in range(RANKS):
            (workdir / f"mp{rank}").mkdir()
        out, log = workdir / "job.out", workdir / "job.log"
        progress(f"starting the job: {RANKS} ranks, {len(files):,} files, {epochs} epochs ...")
        with open(out, "wb") as out_file, open(log, "wb") as log_file:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_file, stderr=log_file, cwd=REPO,
                                    env=env, start_new_session=True)
        tree: dict[int, int] = {}
        try:
            starts = wait_for_reports([sync / f"rank{r}.start.json" for r in range(RANKS)], proc, READY_TIMEOUT,
                                      "every rank's reader started", log)
            tree = process_tree(proc.pid)
            pids = [start["serve_pid"] for start in starts]
            samples = [[process_sample(pid) for pid in pids]]
            progress(f"every rank mounted (serving processes {pids}); idle CPU for {idle_seconds:g} s ...")
            idle_start = idle_cpu(pids, idle_seconds, IDLE_SETTLE)
            reports = []
            for epoch in range(1, epochs + 1):
                (sync / f"go.{epoch}").touch()
                reports.append(wait_for_reports([sync / f"rank{r}.epoch{epoch}.json" for r in range(RANKS)], proc,
                                                EPOCH_TIMEOUT, f"epoch {epoch} of every rank", log))
                samples.append([process_sample(pid) for pid in pids])
                progress(f"epoch {epoch}: " + ", ".join(
                    f"rank {r} {report['seconds']:.1f} s, {report['failures']} failed, "
                    f"{samples[-1][r].rss / MIB:.1f} MiB" for r, report in enumerate(reports[-1])))
            progress(f"idle CPU for {idle_seconds:g} s ...")
            idle_end = idle_cpu(pids, idle_seconds, IDLE_SETTLE)
            after_idle = [process_sample(pid) for pid in pids]
            (sync / "end").touch()
            try:
                returncode = proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"soak_serve: the job did not end within {STOP_TIMEOUT:g} s of its readers") from None
        finally:
            end_job(proc, tree)
        text = out.read_text(errors="replace")
        totals = next((line for line in text.splitlines() if line.startswith("job (")), "(no --stats totals)")
    return Soak(spec, len(files), epochs, separate_nodes, [start["probe"] for start in starts], samples, after_idle,
                reports, idle_start, idle_end, idle_seconds, returncode, totals)


# --- the report ---------------------------------------------------------------------------------------------------

def steady(result: Soak) -> list[list[ProcessSample]]:
    """The samples after epochs STEADY_AFTER..N (the first is the reference)."""
    return result.samples[STEADY_AFTER:]


def slopes(result: Soak) -> list[float | None]:
    """Per rank: RSS bytes an epoch, fitted over epochs STEADY_AFTER+1..N."""
    return [rss_slope([(epoch, result.samples[epoch][rank].rss)
                       for epoch in range(STEADY_AFTER + 1, result.epochs + 1)]) for rank in range(RANKS)]


def targets(result: Soak) -> list[tuple[bool, str, str]]:
    """(passed, what, figures) of each target."""
    found = []
    fitted = slopes(result)
    found.append((all(s is not None and s < RSS_SLOPE_TARGET for s in fitted),
                  f"RSS grows < {RSS_SLOPE_TARGET / MIB:g} MiB/epoch after epoch {STEADY_AFTER} (least-squares slope, "
                  f"epochs {STEADY_AFTER + 1}..{result.epochs})",
                  ", ".join(f"rank {r}: " + ("n/a" if s is None else f"{s / KIB:+.1f} KiB/epoch")
                            for r, s in enumerate(fitted))))
    for name, what in (("fds", "open files"), ("lasting_threads", "threads (not counting trio's idle workers)")):
        series = [[getattr(sample[rank], name) for sample in steady(result)] for rank in range(RANKS)]
        found.append((all(len(set(values)) == 1 for values in series),
                      f"{what} constant after epoch {STEADY_AFTER}",
                      ", ".join(f"rank {r}: " + (f"{values[0]}" if len(set(values)) == 1 else
                                                 f"{values[0]} -> {min(values)}..{max(values)}")
                                for r, values in enumerate(series))))
    failed = sum(report["failures"] for reports in result.reports for report in reports)
    reads = sum(report["files"] for reports in result.reports for report in reports)
    found.append((failed == 0, "no read failed", f"{failed:,} of {reads:,} reads failed (size, CRC-32 checked)"))
    fewest = min(report["blob_reads"] / report["files"] for reports in result.reports for report in reports)
    probes_ok = all(counts[0] >= 1 and counts[1] == 0 and counts[2] >= 1 for counts in result.probe)
    found.append((probes_ok and fewest >= DAEMON_READS_SHARE,
                  f"every epoch's reads reach the daemons (blob reads >= {DAEMON_READS_SHARE:.0%} of files)",
                  f"fewest: {fewest:.0%} of an epoch's files (a rank, an epoch); DONTNEED probe, blob reads of a "
                  f"first read / a second / one after DONTNEED: "
                  + ", ".join("/".join(map(str, counts)) for counts in result.probe)))
    found.append((all(end <= start + IDLE_MARGIN for start, end in zip(result.idle_start, result.idle_end)),
                  f"idle CPU at the end <= the start's + {IDLE_MARGIN:.0%} of a core",
                  ", ".join(f"rank {r}: {start:.2%} -> {end:.2%}"
                            for r, (start, end) in enumerate(zip(result.idle_start, result.idle_end)))))
    return found


def table_rows(result: Soak) -> list[list[str]]:
    rows = []

    def sample_cells(sample: ProcessSample, previous: ProcessSample | None) -> list[str]:
        grown = "" if previous is None else f"{(sample.rss - previous.rss) / MIB:+.2f}"
        return [f"{sample.rss / MIB:.1f}", grown, f"{sample.rss_anon / MIB:.1f}", str(sample.fds),
                str(sample.threads), str(sample.idle_workers)]

    for rank in range(RANKS):
        rows.append(["start", str(rank), "", "", "", "", "", "", *sample_cells(result.samples[0][rank], None)])
    for epoch in range(1, result.epochs + 1):
        for rank in range(RANKS):
            report = result.reports[epoch - 1][rank]
            rows.append([str(epoch), str(rank), f"{report['seconds']:.1f}",
                         f"{report['files'] / report['seconds']:,.0f}", str(report["failures"]),
                         f"{report['blob_reads']:,}", f"{report['cache_misses']:,}",
                         f"{report['cache_evictions']:,}",
                         *sample_cells(result.samples[epoch][rank], result.samples[epoch - 1][rank])])
    for rank in range(RANKS):
        rows.append(["idle", str(rank), "", "", "", "", "", "",
                     *sample_cells(result.after_idle[rank], result.samples[-1][rank])])
    return rows


def print_report(result: Soak) -> None:
    import mpi4py
    from bench_read import print_table
    from bench_serve import mpiexec_command
    from machine_load import machine_lines
    from mpi4py import MPI

    spec = result.spec
    print()
    where = ("three separate nodes made on this machine (tests/separate_nodes.py: a network, UTS and mount "
             "namespace each, MPI over TCP)" if result.separate_nodes else "this machine")
    print(f"soak_serve: `mpiexec -n {RANKS} fanstore serve DEST MP --local-dir LOCAL --cache-size "
          f"{spec.cache_size // MIB} MiB --stats -- READER` on {where}; each rank's READER reads every file every "
          f"epoch (open, read all, CRC-32, POSIX_FADV_DONTNEED, close), shuffled anew each epoch, the three ranks at "
          f"once, epochs in lock step")
    for line in machine_lines():
        print(line)
    print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, mpi4py {mpi4py.__version__}, mpiexec "
          f"{mpiexec_command()}; unpinned: every CPU this process may use, the scheduler's choice")
    size_text = "/".join(f"{s // KIB}" for s in spec.sizes)
    print(f"dataset ({spec.label}): {result.files:,} files: {spec.train:,} in train/ of {size_text} KiB in turn, "
          f"{spec.blocked} of {BLOCKED_SIZE // MIB} MiB stored in 1 MiB blocks, {spec.val} in val/ (replicated); "
          f"codec {CODEC}, --chunk-size {spec.chunk_size // KIB} KiB; --cache-size {spec.cache_size // MIB} MiB "
          f"per rank")
    print()
    print("epoch by epoch, per rank: s and files/s of the rank's reader; failed = reads that failed; blob reads = "
          "blobs the rank's daemon read (its directory, peers, DEST; a file stored in blocks counts each block); "
          "misses and evictions of its decoded cache; then its serving process after the epoch: RSS MiB (VmRSS), "
          "its change since the row before, anon = RssAnon (its own memory; the rest is mapped files and MPICH's "
          "shared memory), open files (/proc/PID/fd), threads, of which idle trio = idle in trio's thread cache "
          "(named 'Trio thread N'; each ends after 10 s with no job, so they come and go with the reads: the "
          "threads target does not count them). start = once every rank is mounted, "
          f"before any read; idle = after the last epoch and {IDLE_SETTLE + result.idle_seconds:g} s with no reads")
    print_table(["epoch", "rank", "s", "files/s", "failed", "blob reads", "misses", "evictions", "RSS MiB", "+MiB",
                 "anon MiB", "open files", "threads", "idle trio"], table_rows(result), left=2)
    print()
    print(f"idle CPU per rank (its CPU-time clock over {result.idle_seconds:g} s with no reads, {IDLE_SETTLE:g} s "
          f"after the last): start " + " ".join(f"{c:.2%}" for c in result.idle_start) + "; end "
          + " ".join(f"{c:.2%}" for c in result.idle_end))
    print(f"the job: exit {result.returncode}; {result.totals}")
    print()
    print("targets")
    for passed, what, figures in targets(result):
        print(f"  {'PASS' if passed else 'FAIL'}  {what}: {figures}")


def sample_json(sample: ProcessSample) -> dict[str, int]:
    return {**asdict(sample), "lasting_threads": sample.lasting_threads}


def write_result_json(result: Soak, path: Path) -> None:
    write_json(path, {
        "ranks": RANKS, "epochs": result.epochs, "files": result.files, "steady_after": STEADY_AFTER,
        "probe": result.probe, "samples": [[sample_json(s) for s in epoch] for epoch in result.samples],
        "after_idle": [sample_json(s) for s in result.after_idle], "reports": result.reports,
        "idle_start": result.idle_start, "idle_end": result.idle_end, "rss_slopes": slopes(result),
        "returncode": result.returncode,
        "targets": [{"passed": passed, "what": what, "figures": figures}
                    for passed, what, figures in targets(result)]})


# --- main ---------------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments == ["--reap"]:
        from bench_serve import reap

        return reap(WORKDIR_PREFIX)
    if arguments[:1] == ["--reader"] and len(arguments) == 2:
        return reader(Path(arguments[1]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs to read (default {EPOCHS}; at least "
                        f"{STEADY_AFTER + 2}, so that a slope is fitted after the warm-up)")
    parser.add_argument("--small", action="store_true", help="the small dataset (tests/test_soak.py's)")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS,
                        help=f"idle CPU sampled over this long, at the start and the end (default {IDLE_SECONDS:g})")
    parser.add_argument("--separate-nodes", action="store_true", help="each rank a node of its own "
                        "(tests/separate_nodes.py; needs root)")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where the dataset is made once")
    parser.add_argument("--json", type=Path, help="write every figure here too")
    parser.add_argument("--serve-options", default="", help="more options for every rank's `fanstore serve`, "
                        "one string (e.g. '--prefetch 0')")
    args = parser.parse_args(arguments)
    if args.epochs < STEADY_AFTER + 2:
        parser.error(f"--epochs: at least {STEADY_AFTER + 2}")
    from bench_serve import exit_on_signals, serve_requirements_missing

    missing = serve_requirements_missing()
    if args.separate_nodes:
        sys.path.insert(0, str(REPO / "tests"))
        from separate_nodes import unavailable_reason

        reason = unavailable_reason()
        missing += [reason] if reason else []
    if missing:
        print(f"soak_serve: missing {'; '.join(missing)}", file=sys.stderr)
        return 2
    exit_on_signals("soak_serve")
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    result = soak(SETS["small" if args.small else "full"], args.epochs, cache, args.idle_seconds,
                  args.separate_nodes, shlex.split(args.serve_options))
    print_report(result)
    if args.json:
        write_result_json(result, args.json)
    return 0 if all(passed for passed, _, _ in targets(result)) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("soak_serve: interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
