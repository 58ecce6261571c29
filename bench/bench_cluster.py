"""bench_cluster: what fanstore buys a training job on a shared parallel file system under load: how many fewer
requests the job makes of the file system, and how much sooner it ends.

The file system is shared_fs.py's model of Lustre (one model process for the job, one client mount per node, its
figures and rules in its docstring; the defaults: metadata 50,000 RPCs/s with 70% taken by other jobs and a 0.5 ms
floor, 1 MiB read RPCs at 0.5 ms, the job's share of object bandwidth 1 GB/s), serving one directory that holds
the original files and their packed datasets. Each node's page cache is bounded to PAGE_CACHE_SHARE of its share
of the data a way reads.

The job: N ranks under `mpiexec -n N` (default 4), each a PyTorch training process (this script with --train):
DataLoader(batch_size BATCH, num_workers W, otherwise its defaults: persistent_workers off, so every epoch starts
its workers afresh; an item is a digest of its file's bytes, see `digest`), a DistributedSampler with shuffle
(seed SEED), a fixed compute time per image as a sleep (default 0.4 ms, about one A100 on ResNet-50), E epochs
(default 3). The ranks meet at a barrier before each epoch and after the last (a
real job's ranks meet at every step): the model marks its phases there, so each epoch's requests are counted apart.

Ways of reading, each a fresh job over a fresh file system (empty caches):
  direct   the original files through the rank's mount of the file system, with the worker count that gives
           direct its best epoch (swept first over --workers-sweep, one epoch each; every way then uses it);
  packed   fanstore.torch.FileDataset(DEST), DEST on the file system: no serve;
  served   `fanstore serve DEST ...` (DEST through each rank's own mount of the file system: mpiexec's MPMD form
           gives each rank its path) stages the chunks into a local directory, then the training process reads
           with FileDataset(None) + EpochSampler ("served") or through the serve mount, $FANSTORE_MOUNT
           ("served mount").
Per way: staging seconds (from the job's start to the first epoch: starting processes, and for served the
staging), each epoch's seconds and data-wait (the most any rank waited), job seconds for E epochs with staging, the
file system's RPCs and bytes during staging and each epoch, the break-even epoch count against direct (the
epochs after which served's job is the shorter), and the CPU microseconds per file of each process: the training
process with its workers, the rank's serve process, the file system's clients and its model (the baseline: the
same files read direct). Then: direct against served at 50%, 70% and 90% background metadata utilisation; direct
against served at N = 1, 2, 4 with the shared bandwidth fixed; a capacity table (stored/raw with --codec auto,
each node's share at N = 4, 64, 512, as `fanstore plan` places it). Targets are printed last, PASS or FAIL.

Time. Where the model's timer cannot resolve the smallest latency, or --time-scale asks it, every latency and the
compute time are multiplied by one factor (capacities divided by it): the job runs that many times slower, its
requests and their proportions unchanged, and seconds are printed as measured (scaled). On a machine with few
cores the simulated file system's clients need CPU of their own: a run whose machine was over BUSY_WARNING busy
is marked, its times then partly the machine's.

Datasets: a generated image-like set (--files, default 20,000, sizes log-uniform 20-300 KiB, random bytes behind a
JPEG header: incompressible as JPEG is; packed stored as is, `--codec none`, in --chunk-size chunks) and the demo
set (`fanstore demo`'s, packed as the demo packs it). Made once under --cache.

Usage: python bench/bench_cluster.py [--quick] [--parts main,load,scaling,capacity] [--ranks N] [--epochs E]
           [--files N] [--png FILE] [--json FILE] [--time-scale K] [shared_fs.py's options, e.g.
           --mds-background 0.9 --oss-bandwidth 5GB]
       python bench/bench_cluster.py --report-from A.json [B.json ...] [--parts capacity] [--png FILE]
The whole run takes about 10 minutes on 16 cores at --time-scale 2 (6 for main and load, 4 for scaling), and
over an hour on 2 cores, where --time-scale 4 or more keeps the machine from deciding the times. --json saves
every job's figures as it ends; --report-from reports parts run apart (on a host lent for a few minutes) as one,
the capacity table made where it runs (it depends on no machine). --quick: 600 files, N = 2, 1 epoch, 2 workers,
the main part of the generated set only: the suite runs it for the request counters. The bench cleans up its
mounts, jobs and files whatever ends it (bench_serve's reaper).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import xxhash

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore
sys.path.insert(0, str(BENCH_DIR))

import shared_fs  # noqa: E402
from bench_serve import end_job, exit_on_signals, machine_lines, mpiexec_command, process_tree, reap, \
    reaped_workdir, serve_requirements_missing, unmount_all  # noqa: E402
from machine_load import cpu_busy_idle, cpu_ns  # noqa: E402

KIB, MIB = 1024, 1 << 20
FILES, QUICK_FILES = 20_000, 600
CLASSES = 100
SIZE_MIN, SIZE_MAX = 20 * KIB, 300 * KIB
CHUNK_SIZE = 256 * MIB
GENERATED_VERSION = "bench_cluster images v1"
SEED = 20241127
RANKS, QUICK_RANKS = 4, 2
EPOCHS, QUICK_EPOCHS = 3, 1
BATCH = 64
COMPUTE_MS = 0.4  # per image
WORKERS_SWEEP, QUICK_WORKERS = (2, 4, 8), 2
BACKGROUNDS = (0.5, 0.7, 0.9)
PARTS = ("main", "load", "scaling", "capacity")
SCALING_RANKS = (1, 2, 4)
CAPACITY_NODES = (4, 64, 512)
PAGE_CACHE_SHARE = 0.5  # of a node's share of the data
BUSY_WARNING = 0.90
JOB_TIMEOUT = 1800.0
LEFT_OVER_WAIT = 10.0

TARGET_EPOCH_RPCS = 0  # served, during the epochs
TARGET_FEWER_RPCS = 0.90  # served against direct, over E epochs with staging
TARGET_JOB_TIME = 0.6  # served's job time over direct's, at the default background
TARGET_JOB_TIME_LOW = 0.8  # the same at 50% background
TARGET_FEWER_METADATA = 0.99  # packed against direct, per epoch


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {message}", file=sys.stderr, flush=True)


# --- inputs ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataSet:
    """Files on the shared file system and their packed dataset, both below the directory it serves."""

    label: str
    original: str  # directory below the served one
    packed: str  # the packed dataset's directory below it
    paths: tuple[str, ...]  # item i reads original/paths[i]
    raw_bytes: int
    stored_bytes: int  # the packed dataset's chunk files and index


def run(command: Sequence[str | Path]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"bench_cluster: {' '.join(map(str, command))} failed: {done.stderr.strip()[-800:]}")
    return done


def fanstore(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "fanstore", *arguments])


def image_paths(count: int) -> list[tuple[str, int]]:
    """(path, size) of the generated set: sizes log-uniform between SIZE_MIN and SIZE_MAX, seeded."""
    rng = np.random.default_rng(SEED)
    sizes = np.exp(rng.uniform(math.log(SIZE_MIN), math.log(SIZE_MAX), count)).astype(np.int64)
    return [(f"train/n{i % CLASSES:05d}/img_{i:07d}.jpg", int(size)) for i, size in enumerate(sizes)]


def build_images(shared: Path, count: int, chunk_size: int) -> DataSet:
    """The generated set and its dataset, made once (a marker names what was made)."""
    name = f"images-{count}"
    original, packed, marker = shared / name, shared / f"{name}.fanstore", shared / f"{name}.complete"
    files = image_paths(count)
    stamp = f"{GENERATED_VERSION} {chunk_size}\n"
    if not marker.exists() or marker.read_text() != stamp:
        progress(f"generating {count:,} image-like files and packing them (once) ...")
        shutil.rmtree(original, ignore_errors=True)
        shutil.rmtree(packed, ignore_errors=True)
        rng = np.random.default_rng(SEED + 1)
        for path, size in files:
            target = original / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + rng.bytes(size - 11))
        fanstore("pack", original, packed, "--codec", "none", "--chunk-size", str(chunk_size), "--quiet")
        marker.write_text(stamp)
    return DataSet("images", name, packed.name, tuple(path for path, _ in files), sum(s for _, s in files),
                   _tree_bytes(packed))


def build_demo(shared: Path) -> DataSet:
    """The demo training set and its dataset, packed as `fanstore demo` packs it."""
    from fanstore.demo.demo import DEMO_CODEC
    from fanstore.demo.demo_data import build_demo_tree

    original, packed, marker = shared / "demo", shared / "demo.fanstore", shared / "demo.complete"
    if not marker.exists() or marker.read_text() != f"{DEMO_CODEC}\n":
        progress("building the demo set and packing it (once) ...")
        shutil.rmtree(packed, ignore_errors=True)
        build_demo_tree(original)
        fanstore("pack", original, packed, "--codec", DEMO_CODEC, "--quiet")
        marker.write_text(f"{DEMO_CODEC}\n")
    paths = sorted(p.relative_to(original).as_posix() for p in original.rglob("*") if p.is_file()
                   and not p.is_symlink())
    return DataSet("demo", "demo", packed.name, tuple(paths), sum((original / p).stat().st_size for p in paths),
                   _tree_bytes(packed))


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# --- the training process (--train) ------------------------------------------------------------------------------

def digest(data: bytes) -> int:
    """The item: a digest of the file's bytes, every byte read. A real job decodes and augments each image into a
    tensor of one shape; that work is the same whichever way the bytes came, so it is left out (the compute time
    stands for the accelerator only), and the batch the default collate makes is small."""
    return xxhash.xxh3_64_intdigest(data) >> 1


class DirectoryFiles:
    """Files under a directory (the original's on the file system, or the serve mount), read as a worker does:
    open, read all, close."""

    def __init__(self, root: str, paths: Sequence[str]) -> None:
        self.root, self.paths = root, list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: int) -> Any:
        with open(os.path.join(self.root, self.paths[item]), "rb") as f:
            return digest(f.read())


def train(args: argparse.Namespace) -> int:
    """One rank's training loop; its epochs and CPU as JSON in --out ({rank} filled in)."""
    from torch.utils.data import DataLoader, DistributedSampler

    rank = int(os.environ.get("FANSTORE_RANK", os.environ.get("PMI_RANK", "0")))
    size = int(os.environ.get("FANSTORE_SIZE", os.environ.get("PMI_SIZE", "1")))
    paths = Path(args.paths).read_text().split("\n")[:-1]
    root = args.root.format(node=rank)
    if args.reader in ("files", "served-mount"):
        dataset: Any = DirectoryFiles(os.environ["FANSTORE_MOUNT"] if args.reader == "served-mount" else root, paths)
    else:
        from fanstore.torch import FileDataset

        dataset = FileDataset(None if args.reader == "served" else root, paths, transform=digest)
    shuffle = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=SEED)
    sampler: Any = shuffle
    if args.reader == "served":
        from fanstore.torch import EpochSampler

        sampler = EpochSampler(shuffle, dataset)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    compute = args.compute_ms / 1e3
    daemon = os.getppid() if args.reader in ("served", "served-mount") else 0
    epochs = []
    for epoch in range(args.epochs):
        shared_fs.control(Path(args.model), "barrier", timeout=None, name=f"epoch {epoch + 1}", size=size)
        if epoch == 0:  # CPU is counted over the epochs: starting Python and torch is not reading
            own_before, workers_before = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
            daemon_before = cpu_ns(daemon) if daemon else 0
        sampler.set_epoch(epoch)
        started, waited, files = time.perf_counter(), 0.0, 0
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            waited += time.perf_counter() - asked
            files += len(batch)
            time.sleep(compute * len(batch))
        epochs.append({"seconds": time.perf_counter() - started, "wait": waited, "files": files})
        del batches
    shared_fs.control(Path(args.model), "barrier", timeout=None, name="end", size=size)
    Path(args.out.format(rank=rank)).write_text(json.dumps({
        "rank": rank, "epochs": epochs, "main_cpu": _cpu(resource.RUSAGE_SELF) - own_before,
        "workers_cpu": _cpu(resource.RUSAGE_CHILDREN) - workers_before,
        "daemon_cpu": (cpu_ns(daemon) - daemon_before) / 1e9 if daemon else 0.0,
        "read": sorted(set(int(i) for e in range(args.epochs) for i in _order(shuffle, e))) if args.list_items
        else []}))
    return 0


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _order(sampler: Any, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


# --- one job -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Way:
    label: str
    reader: str  # files | packed | served | served-mount


DIRECT, PACKED = Way("direct", "files"), Way("packed", "packed")
SERVED, SERVED_MOUNT = Way("served", "served"), Way("served mount", "served-mount")
WAYS = (DIRECT, PACKED, SERVED, SERVED_MOUNT)


@dataclass(frozen=True)
class Settings:
    """What every job of one bench run shares."""

    workdir: Path
    shared: Path  # the directory the file system serves
    parameters: shared_fs.Parameters  # time_scale included; page_cache set per job
    compute_ms: float  # per image, before scaling
    batch: int
    epochs: int


@dataclass
class Result:
    """One job: each rank's figures and what the file system counted, phase by phase."""

    part: str  # workers | main | load | scaling
    way: str
    data: str
    ranks: int
    background: float
    workers: int
    epochs: int
    rank_figures: list[dict[str, Any]]
    phases: list[dict[str, Any]]  # the model's: start, job (staging), epoch 1 .. E, end
    busy: float  # share of the machine's CPUs busy during the job
    timer: tuple[float, float]  # the model's resolution, p50 and p99 seconds

    def phase(self, name: str) -> dict[str, Any]:
        return next(p for p in self.phases if p["name"] == name)

    def staging_seconds(self) -> float:
        return self.phase("job")["seconds"]

    def epoch_seconds(self) -> list[float]:
        return [self.phase(f"epoch {e + 1}")["seconds"] for e in range(self.epochs)]

    def epoch_waits(self) -> list[float]:
        return [max(r["epochs"][e]["wait"] for r in self.rank_figures) for e in range(self.epochs)]

    def job_seconds(self) -> float:
        return self.staging_seconds() + sum(self.epoch_seconds())

    def rpcs(self, phase: str, kind: str = "all") -> int:
        figures = self.phase(phase)
        return {"all": figures["metadata_rpcs"] + figures["read_rpcs"], "metadata": figures["metadata_rpcs"],
                "read": figures["read_rpcs"]}[kind]

    def job_rpcs(self, kind: str = "all") -> int:
        return self.rpcs("job", kind) + sum(self.rpcs(f"epoch {e + 1}", kind) for e in range(self.epochs))

    def files(self) -> int:
        return sum(e["files"] for r in self.rank_figures for e in r["epochs"])

    def _epoch_phases(self) -> list[dict[str, Any]]:
        return [self.phase(f"epoch {e + 1}") for e in range(self.epochs)]

    def cpu_us_per_file(self) -> dict[str, float]:
        """CPU over the epochs per file read: the training processes with their workers, the serve processes, the
        file system's clients and its model."""
        epochs = self._epoch_phases()
        per = {"training": sum(r["main_cpu"] + r["workers_cpu"] for r in self.rank_figures),
               "serve": sum(r["daemon_cpu"] for r in self.rank_figures),
               "fs clients": sum(sum(p["clients_cpu"].values()) for p in epochs),
               "fs model": sum(p["model_cores"] * p["seconds"] for p in epochs)}
        return {name: 1e6 * seconds / max(1, self.files()) for name, seconds in per.items()}

    def busiest_client(self) -> float:
        """Cores the busiest node's file system client used over the epochs: a client near one core (it is one
        thread) answers late, and the job then waits on the simulator, not on the model."""
        epochs = self._epoch_phases()
        nodes = {node for p in epochs for node in p["clients_cpu"]}
        busiest = max((sum(p["clients_cpu"].get(node, 0.0) for p in epochs) for node in nodes), default=0.0)
        return busiest / max(1e-9, sum(p["seconds"] for p in epochs))

    def model_void(self) -> bool:
        job = [p for p in self.phases if p["name"] not in ("start", "end")]
        cpu = sum(p["model_cores"] * p["seconds"] for p in job)
        return cpu / max(1e-9, sum(p["seconds"] for p in job)) > shared_fs.MODEL_CPU_VOID


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("mpich_shm_")}


def mapped_anywhere(names: set[str]) -> set[str]:
    """Those of `names` (files in /dev/shm) that a live process still maps: another job's."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{pid}/maps").read_text()
            found |= {name for name in names if f"/dev/shm/{name}" in maps}
    return found


class Job:
    """mpiexec with its command, in a session of its own; on exit every process of it is gone, the serve mounts
    removed, and any /dev/shm file MPICH made for it and left is reported (others' files, still mapped by their
    processes, are not counted)."""

    def __init__(self, argv: list[str], log: Path, mountpoints: Sequence[Path]) -> None:
        self.log, self.mountpoints = log, mountpoints
        self.shm_before = shm_files()
        with open(log, "wb") as log_file:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, cwd=REPO,
                                         env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        self.tree: dict[int, int] = {}

    def wait(self) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT
        while self.proc.poll() is None:
            self.tree.update(process_tree(self.proc.pid))
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_cluster: a job took over {JOB_TIMEOUT:g} s; see {self.log}")
            time.sleep(0.2)
        if self.proc.returncode != 0:
            raise SystemExit(f"bench_cluster: a job ended with {self.proc.returncode}: "
                             f"{self.log.read_text(errors='replace')[-2000:]}")

    def close(self) -> list[str]:
        """End what is left; the /dev/shm files this job left behind."""
        end_job(self.proc, self.tree)
        unmount_all(self.mountpoints)
        deadline = time.monotonic() + LEFT_OVER_WAIT
        while True:
            new = shm_files() - self.shm_before
            left = new - mapped_anywhere(new)
            if not left or time.monotonic() > deadline:
                return sorted(left)
            time.sleep(0.2)


def run_job(settings: Settings, part: str, way: Way, data: DataSet, ranks: int, background: float, workers: int,
            epochs: int, list_items: bool = False) -> Result:
    """One job of `ranks` ranks reading `data` the way `way` says, on a fresh file system."""
    name = f"{way.reader}-{data.label}-n{ranks}-bg{background:g}-w{workers}-e{epochs}"
    work = settings.workdir / name
    work.mkdir()
    read_bytes = data.raw_bytes if way is DIRECT else data.stored_bytes
    parameters = replace(settings.parameters, mds_background=background,
                         page_cache=int(PAGE_CACHE_SHARE * read_bytes / ranks) // shared_fs.PAGE * shared_fs.PAGE)
    paths_file = work / "paths.txt"
    paths_file.write_text("".join(f"{path}\n" for path in data.paths))
    scale = parameters.time_scale
    with shared_fs.SharedFileSystem(settings.shared, work / "fs", ranks, parameters) as fs:
        child = [sys.executable, __file__, "--train", "--reader", way.reader, "--paths", str(paths_file),
                 "--out", str(work / "rank{rank}.json"), "--workers", str(workers), "--batch", str(settings.batch),
                 "--compute-ms", repr(settings.compute_ms * scale), "--epochs", str(epochs), "--model",
                 str(fs.socket)] + (["--list-items"] if list_items else [])
        mountpoints: list[Path] = []
        if way.reader in ("files", "packed"):
            folder = data.original if way.reader == "files" else data.packed
            argv = [str(mpiexec_command()), "-n", str(ranks), *child, "--root", f"{fs.root}/node{{node}}/{folder}"]
        else:
            argv = [str(mpiexec_command())]
            for rank in range(ranks):
                mountpoints.append(work / f"serve-mp{rank}")
                mountpoints[-1].mkdir()
                argv += ["-n", "1", sys.executable, "-m", "fanstore", "serve", str(fs.mountpoint(rank) / data.packed),
                         str(mountpoints[-1]), "--local-dir", str(work / f"local{rank}"), "--quiet", "--",
                         *child, "--root", "$FANSTORE_MOUNT" if way.reader == "served-mount" else ""]
                argv.append(":")
            argv.pop()
        fs.mark("job")
        busy_before = cpu_busy_idle()
        job = Job(argv, work / "job.log", mountpoints)
        try:
            job.wait()
        finally:
            left = job.close()
        busy = _busy_since(busy_before)
        if left:
            raise SystemExit(f"bench_cluster: the job left {len(left)} /dev/shm files of its own: {left[:3]}")
        report = fs.report()
    figures = [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return Result(part, way.label, data.label, ranks, background, workers, epochs, figures, report["phases"], busy,
                  (report["timer_resolution_p50"], report["timer_resolution_p99"]))


def _busy_since(before: tuple[int, int]) -> float:
    busy, idle = cpu_busy_idle()
    busy, idle = busy - before[0], idle - before[1]
    return busy / max(1, busy + idle)


# --- what the runs say -------------------------------------------------------------------------------------------

def break_even(served: Result, direct: Result) -> str:
    """Epochs after which served's job (staging included) is the shorter."""
    saved = np.mean(direct.epoch_seconds()) - np.mean(served.epoch_seconds())
    extra = served.staging_seconds() - direct.staging_seconds()
    if extra <= 0:
        return "from the first" if saved >= 0 else "never"
    if saved <= 0:
        return "never"
    return f"{math.ceil(extra / saved)}"


def seconds_list(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(header, widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def time_rows(results: Sequence[Result], direct: Result) -> list[list[str]]:
    rows = []
    for result in results:
        ratio = result.job_seconds() / direct.job_seconds()
        rows.append([result.way, str(result.workers), f"{result.staging_seconds():.1f}",
                     seconds_list(result.epoch_seconds()), seconds_list(result.epoch_waits()),
                     f"{result.job_seconds():.1f}", f"{ratio:.2f}x",
                     "-" if result is direct else break_even(result, direct),
                     f"{result.busy:.0%}" + (" (busy)" if result.busy > BUSY_WARNING else "")])
    return rows


def request_rows(results: Sequence[Result], direct: Result) -> list[list[str]]:
    rows = []
    for result in results:
        per_epoch = [f"{result.rpcs(f'epoch {e + 1}', 'metadata'):,}+{result.rpcs(f'epoch {e + 1}', 'read'):,}"
                     for e in range(result.epochs)]
        epoch_bytes = sum(result.phase(f"epoch {e + 1}")["read_bytes"] for e in range(result.epochs))
        fewer = 1 - result.job_rpcs() / max(1, direct.job_rpcs())
        rows.append([result.way, f"{result.rpcs('job', 'metadata'):,}+{result.rpcs('job', 'read'):,}",
                     f"{result.phase('job')['read_bytes'] / MIB:,.0f}", " / ".join(per_epoch),
                     f"{epoch_bytes / MIB:,.0f}", f"{result.job_rpcs():,}", "-" if result is direct else f"{fewer:.1%}"])
    return rows


def cpu_rows(results: Sequence[Result]) -> list[list[str]]:
    rows = []
    for result in results:
        cpu = result.cpu_us_per_file()
        files_per_second = result.files() / sum(result.epoch_seconds())
        latency = []
        for label in ("metadata", "read"):
            figures = [p[f"{label}_latency"] for p in result.phases if f"{label}_latency" in p
                       and p["name"].startswith("epoch")] or \
                      [p[f"{label}_latency"] for p in result.phases if f"{label}_latency" in p]
            if figures:
                f = max(figures, key=lambda x: x["count"])
                latency.append(f"{label[0]} {f['achieved_p50'] * 1e3:.2f}/{f['configured_p50'] * 1e3:.2f}, "
                               f"{f['achieved_p99'] * 1e3:.2f}/{f['configured_p99'] * 1e3:.2f}")
        rows.append([result.way, f"{files_per_second:,.0f}", f"{cpu['training']:.0f}", f"{cpu['serve']:.0f}",
                     f"{cpu['fs clients']:.0f}", f"{cpu['fs model']:.0f}" + (" VOID" if result.model_void() else ""),
                     f"{result.busiest_client():.2f}", "; ".join(latency) or "-"])
    return rows


def capacity_rows(shared: Path, sets: Sequence[DataSet], compute_ms: float) -> list[list[str]]:
    """stored/raw with --codec auto, at the decode budget one rank needs to keep its compute busy (files at
    1/compute_ms each, of the set's mean size), and the fullest node's share at each of CAPACITY_NODES."""
    from fanstore.core.index import Index
    from fanstore.serve.placement import place

    rows = []
    for data in sets:
        auto = shared / f"{data.original}.auto.fanstore"
        budget = math.ceil(data.raw_bytes / len(data.paths) * 1e3 / compute_ms / 1e6)
        if not (auto / "complete").exists():
            progress(f"packing {data.label} with --codec auto --budget {budget}MB/s (once) ...")
            shutil.rmtree(auto, ignore_errors=True)
            fanstore("pack", shared / data.original, auto, "--codec", "auto", "--budget", f"{budget}MB/s", "--quiet")
            (auto / "complete").write_text("")
        stored = _tree_bytes(auto)
        index = Index.load(auto)
        shares = []
        for nodes in CAPACITY_NODES:
            placement = place(index, nodes)
            shares.append(max(placement.stored_bytes(rank) for rank in range(nodes)))
        rows.append([data.label, f"{len(data.paths):,}", f"{budget:,} MB/s", f"{data.raw_bytes / MIB:,.1f} MiB",
                     f"{stored / MIB:,.1f} MiB", f"{stored / data.raw_bytes:.3f}",
                     *(f"{share / MIB:,.2f} MiB" for share in shares)])
    return rows


def target_lines(main: dict[str, Result], sweep: dict[float, tuple[Result, Result]], default_background: float
                 ) -> list[tuple[bool, str]]:
    direct, packed, served = main["direct"], main.get("packed"), main["served"]
    lines = []
    epoch_rpcs = sum(served.rpcs(f"epoch {e + 1}") for e in range(served.epochs))
    lines.append((epoch_rpcs <= TARGET_EPOCH_RPCS, f"served makes {epoch_rpcs:,} RPCs to the shared file system "
                                                   f"during the epochs (target {TARGET_EPOCH_RPCS})"))
    for label in ("served mount",):
        if label in main:
            rpcs = sum(main[label].rpcs(f"epoch {e + 1}") for e in range(main[label].epochs))
            lines.append((rpcs <= TARGET_EPOCH_RPCS, f"{label} makes {rpcs:,} during the epochs (target 0)"))
    fewer = 1 - served.job_rpcs() / max(1, direct.job_rpcs())
    lines.append((fewer >= TARGET_FEWER_RPCS, f"served makes {fewer:.1%} fewer RPCs than direct over "
                                              f"{served.epochs} epochs with staging (target >= "
                                              f"{TARGET_FEWER_RPCS:.0%})"))
    ratio = served.job_seconds() / direct.job_seconds()
    lines.append((ratio <= TARGET_JOB_TIME, f"served's job time is {ratio:.2f}x direct's at "
                                            f"{default_background:.0%} background (target <= {TARGET_JOB_TIME})"))
    if 0.5 in sweep:
        low_direct, low_served = sweep[0.5]
        low = low_served.job_seconds() / low_direct.job_seconds()
        lines.append((low <= TARGET_JOB_TIME_LOW, f"served's job time is {low:.2f}x direct's at 50% background "
                                                  f"(target <= {TARGET_JOB_TIME_LOW})"))
    if packed is not None:
        per_epoch = [1 - packed.rpcs(f"epoch {e + 1}", "metadata") / max(1, direct.rpcs(f"epoch {e + 1}", "metadata"))
                     for e in range(packed.epochs)]
        lines.append((min(per_epoch) >= TARGET_FEWER_METADATA,
                      f"packed makes {min(per_epoch):.2%} fewer metadata RPCs per epoch than direct (the least of "
                      f"its epochs; target >= {TARGET_FEWER_METADATA:.0%})"))
    return lines


def plot(path: Path, main: dict[str, Result], sweep: dict[float, tuple[Result, Result]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, requests, loads) = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = list(main)
    staging = [main[label].staging_seconds() for label in labels]
    epochs = [sum(main[label].epoch_seconds()) for label in labels]
    times.bar(labels, staging, label="staging")
    times.bar(labels, epochs, bottom=staging, label="epochs")
    times.set_ylabel("seconds (job)")
    times.set_title("job time")
    times.legend()
    metadata = [max(1, main[label].job_rpcs("metadata")) for label in labels]
    reads = [max(1, main[label].job_rpcs("read")) for label in labels]
    positions = np.arange(len(labels))
    requests.bar(positions - 0.2, metadata, 0.4, label="metadata")
    requests.bar(positions + 0.2, reads, 0.4, label="read")
    requests.set_xticks(positions, labels)
    requests.set_yscale("log")
    requests.set_title("RPCs to the shared file system")
    requests.legend()
    backgrounds = sorted(sweep)
    loads.plot([b * 100 for b in backgrounds], [sweep[b][0].job_seconds() for b in backgrounds], "o-",
               label="direct")
    loads.plot([b * 100 for b in backgrounds], [sweep[b][1].job_seconds() for b in backgrounds], "o-",
               label="served")
    loads.set_xlabel("metadata server used by other jobs, %")
    loads.set_ylabel("seconds (job)")
    loads.set_title("under load")
    loads.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# --- the bench ---------------------------------------------------------------------------------------------------

def choose_time_scale(parameters: shared_fs.Parameters, asked: float) -> tuple[float, str]:
    p50, p99 = shared_fs.measure_timer_resolution()
    needed = shared_fs.time_scale_needed(parameters, p50)
    scale = max(asked, needed)
    return scale, (f"time scale {scale:g}: every latency and the compute time x{scale:g}, capacities /{scale:g} "
                   f"(timer resolution p50 {p50 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us: it needs {needed:g}; "
                   f"--time-scale {asked:g})")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments == ["--reap"]:
        return reap("bench-cluster-")
    parser = argparse.ArgumentParser(prog="bench_cluster.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, help=f"N (default {RANKS}; --quick {QUICK_RANKS})")
    parser.add_argument("--epochs", type=int, help=f"E (default {EPOCHS}; --quick {QUICK_EPOCHS})")
    parser.add_argument("--files", type=int, help=f"in the generated set (default {FILES:,}; --quick {QUICK_FILES})")
    parser.add_argument("--chunk-size", type=shared_fs.parse_size, default=CHUNK_SIZE, metavar="SIZE",
                        help="of the generated set's dataset (256MiB)")
    parser.add_argument("--compute-ms", type=float, default=COMPUTE_MS, help="per image (%(default)g)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--workers-sweep", default=",".join(map(str, WORKERS_SWEEP)),
                        help="DataLoader workers tried for direct (2,4,8)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which parts to run: main (the ways, both sets), load (the background sweep), scaling, "
                             "capacity (default: all; --quick: main)")
    parser.add_argument("--png", type=Path, default=Path("bench_cluster.png"))
    parser.add_argument("--json", type=Path, help="write every job's figures here (after each job)")
    parser.add_argument("--report-from", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: report what --json files of earlier runs hold (one run's parts, or "
                             "parts run apart), with the capacity table computed here")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where inputs are made once")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reader", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--list-items", action="store_true", help=argparse.SUPPRESS)
    shared_fs.add_parameter_arguments(parser)
    args = parser.parse_args(arguments)
    if args.train:
        return train(args)
    try:
        parameters = shared_fs.parameters_from(args)
        workers_sweep = [int(w) for w in args.workers_sweep.split(",")]
        for name, value in (("--ranks", args.ranks), ("--epochs", args.epochs), ("--files", args.files),
                            ("--batch", args.batch), *(("--workers-sweep", w) for w in workers_sweep)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value}: must be 1 or more")
        if args.compute_ms < 0:
            raise ValueError(f"--compute-ms {args.compute_ms}: must be 0 or more")
        parts = {"main"} if args.quick else set(args.parts.split(","))
        if parts - set(PARTS):
            raise ValueError(f"--parts {args.parts}: the parts are {', '.join(PARTS)}")
        if args.report_from:
            run = BenchRun.load(args.report_from)
    except ValueError as exc:
        parser.exit(2, f"bench_cluster.py: error: {exc}\n")
    shared = args.cache.resolve() / "cluster"
    if args.report_from:
        capacity = []
        if "capacity" in parts:  # machine-independent: made here from the same generated sets
            shared.mkdir(parents=True, exist_ok=True)
            capacity = capacity_rows(shared, [build_images(shared, len(data.paths), args.chunk_size)
                                              if data.label == "images" else build_demo(shared)
                                              for data in run.sets], args.compute_ms)
        report(run, capacity, args.png)
        return 0
    missing = serve_requirements_missing()
    if missing:
        parser.exit(2, f"bench_cluster.py: error: missing {'; '.join(missing)}\n")
    exit_on_signals("bench_cluster")
    run = measure(args, parameters, parts, workers_sweep, shared)
    report(run, capacity_rows(shared, run.sets, args.compute_ms) if "capacity" in parts else [], args.png)
    return 0


@dataclass
class BenchRun:
    """What one run of the bench measured, and where: the report is made from it, at once or from --json files."""

    header: list[str]  # the run's settings, the machine, the time scale
    ranks: int
    epochs: int
    background: float  # the default
    sets: list[DataSet]
    results: list[Result] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({**self.__dict__, "sets": [d.__dict__ for d in self.sets],
                                    "results": [r.__dict__ for r in self.results]}))

    @classmethod
    def load(cls, paths: Sequence[Path]) -> "BenchRun":
        """Runs saved apart (the same settings, other parts), as one."""
        runs = []
        for path in paths:
            try:
                saved = json.loads(path.read_text())
                runs.append(cls(**{**saved, "sets": [DataSet(**{**d, "paths": tuple(d["paths"])})
                                                     for d in saved["sets"]],
                                   "results": [Result(**r) for r in saved["results"]]}))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"--report-from {path}: not a --json file of this bench ({exc})") from None
        first = runs[0]
        for other, path in zip(runs[1:], paths[1:]):
            if (other.ranks, other.epochs, other.background) != (first.ranks, first.epochs, first.background):
                raise ValueError(f"--report-from {path}: another run's settings than {paths[0]}'s")
            first.results += other.results
            first.header.append(f"and from {path.name}: {other.header[0]}; {other.header[2]}")
        return first


def measure(args: argparse.Namespace, parameters: shared_fs.Parameters, parts: set[str], workers_sweep: list[int],
            shared: Path) -> BenchRun:
    """Every job the parts ask for; saved to --json after each, so a run cut short still leaves its figures."""
    ranks = args.ranks or (QUICK_RANKS if args.quick else RANKS)
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    count = args.files or (QUICK_FILES if args.quick else FILES)
    scale, scale_line = choose_time_scale(parameters, args.time_scale)
    parameters = replace(parameters, time_scale=scale)
    shared.mkdir(parents=True, exist_ok=True)
    sets = [build_images(shared, count, args.chunk_size)]
    header = [f"bench_cluster: {ranks} ranks, {epochs} epochs, batch {args.batch}, compute {args.compute_ms:g} ms per "
              f"image (x{scale:g}); parts {', '.join(p for p in PARTS if p in parts)}", *machine_lines(), scale_line,
              "file system: " + ", ".join(f"{k} {v:g}" for k, v in parameters.__dict__.items()
                                          if k not in ("page_cache", "time_scale", "seed"))
              + f"; page cache {PAGE_CACHE_SHARE:.0%} of a node's share; capacities and latencies as configured, "
                f"before the time scale"]
    if not args.quick and "main" in parts:
        try:
            sets.append(build_demo(shared))
        except RuntimeError as exc:  # the demo set needs scikit-learn and Pillow
            header.append(f"note: the demo set is left out: {exc}")
    run = BenchRun(header, ranks, epochs, parameters.mds_background, sets)
    with reaped_workdir("bench-cluster-", __file__) as workdir:
        settings = Settings(workdir, shared, parameters, args.compute_ms, args.batch, epochs)

        def job(part: str, way: Way, data: DataSet, n: int = ranks, background: float = run.background,
                job_epochs: int = epochs) -> Result:
            progress(f"{way.label}, {data.label}: {n} ranks, {background:.0%} background, {workers} workers, "
                     f"{job_epochs} epochs ...")
            result = run_job(settings, part, way, data, n, background, workers, job_epochs, list_items=args.quick)
            progress(f"  staging {result.staging_seconds():.1f} s, epochs {seconds_list(result.epoch_seconds())} s, "
                     f"{result.job_rpcs():,} RPCs, machine {result.busy:.0%} busy")
            run.results.append(result)
            if args.json:
                run.save(args.json)
            return result

        images = sets[0]
        workers = QUICK_WORKERS if args.quick else workers_sweep[0]
        if not args.quick and len(workers_sweep) > 1 and parts & {"main", "load", "scaling"}:
            tried = []
            for workers in workers_sweep:
                tried.append(job("workers", DIRECT, images, job_epochs=1))
            workers = min(tried, key=lambda r: r.epoch_seconds()[0]).workers
        for data in (sets if "main" in parts else [images]):
            for way in (WAYS if "main" in parts else (DIRECT, SERVED)):
                job("main", way, data)
        if "load" in parts:
            for background in BACKGROUNDS:
                if background != run.background:
                    job("load", DIRECT, images, background=background)
                    job("load", SERVED, images, background=background)
        if "scaling" in parts:
            for n in SCALING_RANKS:
                if n != ranks:
                    job("scaling", DIRECT, images, n=n)
                    job("scaling", SERVED, images, n=n)
    return run


def report(run: BenchRun, capacity: list[list[str]], png: Path) -> None:
    """The run's tables, its targets (PASS or FAIL) last, and its plot."""
    main_runs: dict[str, dict[str, Result]] = {}
    for result in run.results:
        if result.part == "main":  # runs reported together: the first file's main rows
            main_runs.setdefault(result.data, {}).setdefault(result.way, result)
    images = main_runs["images"]
    background_runs = {run.background: (images["direct"], images["served"])}
    scaling = {run.ranks: (images["direct"], images["served"])}
    for result in run.results:
        pair = [r for r in run.results if r.part == result.part and r.way == "served" and r.ranks == result.ranks
                and r.background == result.background]
        if result.way == "direct" and pair and result.part == "load":
            background_runs[result.background] = (result, pair[0])
        elif result.way == "direct" and pair and result.part == "scaling":
            scaling[result.ranks] = (result, pair[0])
    sweep = [[str(r.workers), f"{r.epoch_seconds()[0]:.1f}"] for r in run.results if r.part == "workers"]
    out = list(run.header)
    for data in run.sets:
        out.append(f"\n{data.label}: {len(data.paths):,} files, {data.raw_bytes / MIB:,.1f} MiB; packed "
                   f"{data.stored_bytes / MIB:,.1f} MiB")
    if sweep:
        out.append("\ndirect's DataLoader workers, one epoch (the fastest is every way's):\n"
                   + table(["workers", "epoch s"], sweep))
    for label, runs in main_runs.items():
        direct = runs["direct"]
        results = list(runs.values())
        out.append(f"\n{label}, time (seconds, scaled):")
        out.append(table(["way", "workers", "staging", "epochs", "data-wait", "job", "x direct", "break-even",
                          "machine"], time_rows(results, direct)))
        out.append(f"\n{label}, requests to the shared file system (metadata+read RPCs; MiB read):")
        out.append(table(["way", "staging RPCs", "MiB", "each epoch", "MiB epochs", "all", "fewer"],
                         request_rows(results, direct)))
        out.append(f"\n{label}, CPU us per file (direct is the baseline) and the file system's latency, ms "
                   f"(m = metadata, r = read; achieved/configured, p50 then p99, in the busiest phase):")
        out.append(table(["way", "files/s", "training", "serve", "fs clients", "fs model", "busiest client, cores",
                          "latency"], cpu_rows(results)))
    if len(background_runs) > 1:
        rows = [[f"{b:.0%}", f"{d.job_seconds():.1f}", f"{s.job_seconds():.1f}",
                 f"{s.job_seconds() / d.job_seconds():.2f}x", f"{np.mean(d.epoch_seconds()):.1f}",
                 f"{np.mean(s.epoch_seconds()):.1f}"] for b, (d, s) in sorted(background_runs.items())]
        out.append("\nimages, background metadata load:")
        out.append(table(["background", "direct job s", "served job s", "served/direct", "direct epoch s",
                          "served epoch s"], rows))
    if len(scaling) > 1:
        rows = [[str(n), f"{np.mean(d.epoch_seconds()):.1f}", f"{np.mean(s.epoch_seconds()):.1f}",
                 f"{d.files() / sum(d.epoch_seconds()):,.0f}", f"{s.files() / sum(s.epoch_seconds()):,.0f}"]
                for n, (d, s) in sorted(scaling.items())]
        out.append("\nimages, scaling (shared bandwidth fixed):")
        out.append(table(["ranks", "direct epoch s", "served epoch s", "direct files/s", "served files/s"], rows))
    if capacity:
        out.append("\ncapacity, --codec auto (each node's share: the fullest node, as `fanstore plan` places it):")
        out.append(table(["dataset", "files", "budget", "raw", "stored", "stored/raw",
                          *(f"N = {n}" for n in CAPACITY_NODES)], capacity))
    targets = target_lines(images, background_runs, run.background)
    out.append("\ntargets (images):")
    out += [f"  {'PASS' if ok else 'FAIL'}  {line}" for ok, line in targets]
    print("\n".join(out))
    try:
        title = run.header[0].split("; parts")[0] + " | " + run.header[1].split(",")[0].replace("machine: ", "")
        plot(png, images, background_runs, title)
        print(f"\nplot: {png}")
    except ImportError:
        print("\nplot: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_cluster: interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
