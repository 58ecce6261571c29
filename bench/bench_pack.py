"""bench_pack: how fast does `fanstore-pack` pack, how small is what it stores, and how cheaply does a big index open?

One run measures, and prints as one table beside baselines measured in the same run on the same input:

  * pack throughput (MB/s of raw input) of the real CLI, codec zstd:3, with --workers 1 pinned to one core and
    --workers 2 on two cores, and the speedup between them;
  * stored size per codec (dataset directory: chunks + index) against `tar -c SRC | zstd -3 -T0` and
    `mksquashfs SRC out.sqsh -comp zstd`, as ratio (raw / stored) and relative to the squashfs image;
  * `Index.load` wall time and RSS growth per file for a synthetic one-million-file index, in fresh processes.

Datasets: the demo tree (`fanstore.demo.demo_data.build_demo_tree`, scale 1) and a generated ImageNet-like tree of
>= 1 GiB in >= 100,000 files (bench/synthetic_tree.py), generated once into --cache and reused. A final section
checks the project's targets. The page cache is not dropped (that needs root and is unreliable); every source
tree is read once before timing instead, so all timings are warm-cache.

Usage: python bench/bench_pack.py [--cache DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from fanstore.core.format import CHUNK_DTYPE, CHUNK_HEADER_LEN  # noqa: E402
from fanstore.core.index import EntryRecord, build_index_bytes, write_index_atomically  # noqa: E402
from machine_load import OtherLoad, machine_lines, wait_for_quiet  # noqa: E402
from synthetic_tree import TreeShape, class_names, write_tree  # noqa: E402

GENERATED_VERSION = "bench_pack synthetic tree v1"
FULL_SHAPE = TreeShape(classes=100, train_images=1000, val_images=100, train_fields=4, val_fields=1,
                       train_texts=30, val_texts=5)
MIN_FILES, MIN_BYTES = 100_000, 1 << 30  # what the full generated tree must reach
QUICK_SHAPE = TreeShape(classes=10, train_images=200, val_images=20, train_fields=2, val_fields=1,
                        train_texts=6, val_texts=3)
SPEED_CODEC = "zstd:3"
CODECS = ("none", "lz4", "lz4:hc", "zstd:1", "zstd:3", "zstd:9", "zstd:19", "zstd-dict:3", "zstd-dict:19",
          "blosc:lz4:5:shuffle", "blosc:zstd:5:bitshuffle")
DICT_CODEC = "zstd-dict:19"
SPEED_REPEATS = 3  # --workers 1 and --workers 2 runs alternate, so drift (disk, neighbours) hits both alike
SMALL_DATASET = 256 << 20  # below this, interpreter and worker-pool startup dominate a pack's time
INDEX_FILES, INDEX_DIRS = 1_000_000, 1000
INDEX_RUNS = 3
FILES_PER_CHUNK = 600  # ~64 MiB chunks of ~110 kB files

QUIET_BUSY, QUIET_MAX_WAIT = 0.10, 30.0  # before each timing, wait until the CPUs are < 10% busy (at most 30 s)
NOISY_OTHERS = 0.10  # other processes' CPU use (cores) above which a timing is flagged as disturbed

TARGET_SPEEDUP = 1.7
TARGET_DICT_VS_SQUASHFS = 1.10
TARGET_OPEN_SECONDS = 1.5
TARGET_BYTES_PER_FILE = 150

PACK_COMMAND = [sys.executable, "-m", "fanstore", "pack"]


class BenchError(Exception):
    """A measured command failed; the row says so instead of the run crashing."""


# --- tools and CPU placement --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tools:
    taskset: str | None
    tar: str | None
    zstd: str | None
    mksquashfs: str | None

    @classmethod
    def find(cls) -> "Tools":
        return cls(*(shutil.which(name) for name in ("taskset", "tar", "zstd", "mksquashfs")))

    def skip_notes(self) -> list[str]:
        """One line per baseline or placement that cannot be measured on this machine, naming what is missing."""
        notes = []
        if self.taskset is None:
            notes.append("taskset not found (util-linux): every command runs unpinned, placement not controlled")
        missing_tar = [name for name in ("tar", "zstd") if getattr(self, name) is None]
        if missing_tar:
            notes.append(f"baseline `tar -c SRC | zstd -3 -T0` skipped: {' and '.join(missing_tar)} not found")
        if self.mksquashfs is None:
            notes.append("baseline `mksquashfs -comp zstd` skipped: mksquashfs not found (Debian: squashfs-tools); "
                         "the '/ sqsh' column and the zstd-dict target cannot be computed")
        return notes


@dataclass(frozen=True, slots=True)
class Placement:
    """The CPUs a command is pinned to (with taskset), or none when taskset is missing."""

    cpus: tuple[int, ...]
    pinned: bool

    def wrap(self, command: Sequence[str]) -> list[str]:
        if not self.pinned:
            return list(command)
        return ["taskset", "-c", ",".join(map(str, self.cpus)), *command]

    @property
    def label(self) -> str:
        if not self.pinned:
            return "unpinned"
        return f"cpu {self.cpus[0]}" if len(self.cpus) == 1 else "cpus " + ",".join(map(str, self.cpus))


def placements(tools: Tools) -> tuple[Placement, Placement]:
    """One core for --workers 1, the first two of this process's cores for --workers 2."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = tools.taskset is not None
    return Placement((cpus[0],), pinned), Placement(tuple(cpus[:2]), pinned)


# --- datasets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dataset:
    name: str
    root: Path
    files: int
    raw_bytes: int


def tree_totals(root: Path) -> tuple[int, int]:
    """(regular files, bytes) below root, reading every file once so later timings start from a warm cache."""
    files = total = 0
    for directory, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            with open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    total += len(chunk)
            files += 1
    return files, total


def ensure_generated(cache: Path, quick: bool, processes: int) -> Path:
    """The generated tree in the cache, written once: a marker with the version string says it is complete."""
    name = "quick-tree" if quick else "tree"
    root, marker = cache / name, cache / f"{name}.complete"
    if marker.is_file() and marker.read_text().strip() == GENERATED_VERSION and root.is_dir():
        print(f"reusing generated tree {root}")
        return root
    marker.unlink(missing_ok=True)
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    print(f"generating {root} with {processes} processes (once; reused on later runs) ...", flush=True)
    started = time.monotonic()
    files, total = write_tree(root, shape, processes)
    marker.write_text(GENERATED_VERSION + "\n")
    print(f"  {files:,} files, {total / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s")
    return root


def build_demo(workdir: Path) -> tuple[Path | None, str]:
    """The demo tree at scale 1, built fresh in workdir, or None and a line saying why it cannot be built."""
    try:
        from fanstore.demo.demo_data import build_demo_tree
    except ImportError as exc:
        return None, f"demo dataset skipped: cannot import fanstore.demo.demo_data ({exc})"
    root = workdir / "demo-source"
    build_demo_tree(root, scale=1)
    return root, "demo dataset: built fresh in a temporary directory by fanstore.demo.demo_data.build_demo_tree(scale=1)"


def size_warning(dataset: Dataset) -> str | None:
    """The full generated tree must have at least MIN_FILES files and MIN_BYTES bytes to answer the question."""
    if dataset.files >= MIN_FILES and dataset.raw_bytes >= MIN_BYTES:
        return None
    return (f"WARNING: {dataset.name} has {dataset.files:,} files and {mib(dataset.raw_bytes)}, "
            f"below the intended {MIN_FILES:,} files and {mib(MIN_BYTES)}")


def rewarm(dataset: Dataset) -> None:
    """Read the tree again just before a timing (someone may have evicted it), and check it did not change."""
    if tree_totals(dataset.root) != (dataset.files, dataset.raw_bytes):
        raise SystemExit(f"bench_pack: {dataset.root} changed during the benchmark; run it again")


def describe(name: str, root: Path) -> Dataset:
    files, raw_bytes = tree_totals(root)
    return Dataset(name, root, files, raw_bytes)


# --- measurements -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    dataset: str
    what: str
    cpus: str
    seconds: float | None = None
    raw_bytes: int | None = None  # input bytes the MB/s figure is computed on
    stored_bytes: int | None = None
    others: float | None = None  # cores used by other processes meanwhile (CPU seconds / wall seconds)
    note: str = ""


def directory_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@dataclass(frozen=True, slots=True)
class Timed:
    seconds: float
    others: float  # cores other processes used meanwhile
    stdout: str = ""


def timed(run: Callable[[], str]) -> Timed:
    """Time `run` once the machine is quiet, measuring what other processes use meanwhile."""
    wait_for_quiet(QUIET_BUSY, QUIET_MAX_WAIT)
    with OtherLoad() as others:
        started = time.perf_counter()
        stdout = run()
        seconds = time.perf_counter() - started
    return Timed(seconds, others.cpu_seconds / seconds, stdout)


def run_timed(command: list[str], **kwargs: object) -> Timed:
    """Time a command that must succeed; BenchError with its last stderr line otherwise."""

    def run() -> str:
        proc = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise BenchError(f"{Path(command[0]).name} exited {proc.returncode}: {last}")
        return proc.stdout

    return timed(run)


@dataclass(frozen=True, slots=True)
class PackRun:
    seconds: float
    others: float
    stored_bytes: int  # the whole dataset directory: chunk files + index
    skipped: int  # files the packer reported as skipped (sizes are only comparable when 0)


def pack_once(src: Path, dest: Path, codec: str, workers: int, placement: Placement) -> PackRun:
    """One `fanstore pack` into a fresh DEST, which is measured and removed afterwards."""
    shutil.rmtree(dest, ignore_errors=True)
    command = placement.wrap([*PACK_COMMAND, str(src), str(dest), "--codec", codec, "--workers", str(workers),
                              "--quiet"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = run_timed(command, env=env, cwd=REPO)
    skipped = re.search(r"([\d,]+) skipped", run.stdout)
    stored = directory_bytes(dest)
    shutil.rmtree(dest)
    return PackRun(run.seconds, run.others, stored, int(skipped.group(1).replace(",", "")) if skipped else -1)


def skipped_note(runs: Sequence[PackRun]) -> str:
    worst = max(run.skipped for run in runs)
    if worst > 0:
        return f"{worst} file(s) SKIPPED by the packer"
    return "" if worst == 0 else "skip count not found in CLI output"


def speed_row(dataset: Dataset, workers: int, placement: Placement, runs: list[PackRun]) -> Row:
    """The median of alternating runs; `others` is the worst disturbance any run saw."""
    row = Row(dataset.name, f"pack {SPEED_CODEC} --workers {workers}", placement.label, raw_bytes=dataset.raw_bytes)
    row.seconds = statistics.median(run.seconds for run in runs)
    row.others = max(run.others for run in runs)
    row.stored_bytes = runs[-1].stored_bytes
    spread = ", ".join(f"{run.seconds:.2f}" for run in runs)
    notes = [f"median of {len(runs)} ({spread} s)", skipped_note(runs)]
    row.note = "; ".join(note for note in notes if note)
    return row


def pack_speeds(dataset: Dataset, workdir: Path, one: Placement, both: Placement) -> tuple[Row, Row]:
    """--workers 1 on one core and --workers 2 on two, alternating, SPEED_REPEATS times each."""
    runs: dict[int, list[PackRun]] = {1: [], 2: []}
    try:
        for _ in range(SPEED_REPEATS):
            for workers, placement in ((1, one), (2, both)):
                rewarm(dataset)
                runs[workers].append(pack_once(dataset.root, workdir / "speed", SPEED_CODEC, workers, placement))
    except BenchError as exc:
        failed = [Row(dataset.name, f"pack {SPEED_CODEC} --workers {w}", p.label, raw_bytes=dataset.raw_bytes,
                      note=f"FAILED: {exc}") for w, p in ((1, one), (2, both))]
        return failed[0], failed[1]
    return speed_row(dataset, 1, one, runs[1]), speed_row(dataset, 2, both, runs[2])


def pack_codec(dataset: Dataset, workdir: Path, codec: str, placement: Placement) -> Row:
    row = Row(dataset.name, f"pack {codec}", placement.label, raw_bytes=dataset.raw_bytes)
    try:
        run = pack_once(dataset.root, workdir / "codec", codec, 2, placement)
    except BenchError as exc:
        row.note = f"FAILED: {exc}"
        return row
    row.seconds, row.others, row.stored_bytes = run.seconds, run.others, run.stored_bytes
    row.note = skipped_note([run])
    return row


def tar_zstd(dataset: Dataset, workdir: Path, placement: Placement) -> Row:
    """Baseline: the whole tree as one zstd -3 stream (best case for ratio, no random access)."""
    row = Row(dataset.name, "baseline tar -c | zstd -3 -T0", placement.label, raw_bytes=dataset.raw_bytes)
    out_path = workdir / "tree.tar.zst"

    def run() -> str:
        with open(out_path, "wb") as out:
            tar = subprocess.Popen(placement.wrap(["tar", "-cf", "-", "-C", str(dataset.root), "."]),
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            zstd = subprocess.Popen(placement.wrap(["zstd", "-3", "-T0", "-q", "-c"]), stdin=tar.stdout,
                                    stdout=out, stderr=subprocess.DEVNULL)
            if tar.stdout is not None:
                tar.stdout.close()  # zstd holds the pipe now; tar gets SIGPIPE if zstd dies
            codes = (tar.wait(), zstd.wait())
        if codes != (0, 0):
            raise BenchError(f"tar exited {codes[0]}, zstd exited {codes[1]}")
        return ""

    try:
        result = timed(run)
        row.seconds, row.others, row.stored_bytes = result.seconds, result.others, out_path.stat().st_size
        row.note = "one stream, no random access"
    except BenchError as exc:
        row.note = f"FAILED: {exc}"
    out_path.unlink(missing_ok=True)
    return row


def squashfs(dataset: Dataset, workdir: Path, placement: Placement) -> Row:
    """Baseline: a squashfs image with zstd (its default level 15, 128 KiB blocks, tail packing)."""
    row = Row(dataset.name, "baseline mksquashfs -comp zstd", placement.label, raw_bytes=dataset.raw_bytes)
    image = workdir / "tree.sqsh"
    try:
        result = run_timed(placement.wrap(["mksquashfs", str(dataset.root), str(image), "-comp", "zstd",
                                           "-noappend", "-quiet"]))
        row.seconds, row.others, row.stored_bytes = result.seconds, result.others, image.stat().st_size
        row.note = "image size"
    except BenchError as exc:
        row.note = f"FAILED: {exc}"
    image.unlink(missing_ok=True)
    return row


@dataclass(slots=True)
class DatasetResult:
    dataset: Dataset
    rows: list[Row] = field(default_factory=list)
    speed_one: Row | None = None
    speed_all: Row | None = None
    squashfs: Row | None = None

    def codec_row(self, codec: str) -> Row | None:
        return next((r for r in self.rows if r.what == f"pack {codec}"), None)

    @property
    def speedup(self) -> float | None:
        one = self.speed_one.seconds if self.speed_one else None
        both = self.speed_all.seconds if self.speed_all else None
        return one / both if one and both else None


def measure_dataset(dataset: Dataset, workdir: Path, tools: Tools, one: Placement, both: Placement) -> DatasetResult:
    result = DatasetResult(dataset)
    print(f"[{dataset.name}] pack speed, {SPEED_CODEC} ...", flush=True)
    result.speed_one, result.speed_all = pack_speeds(dataset, workdir, one, both)
    if result.speedup is not None:
        result.speed_all.note += f"; speedup {result.speedup:.2f}x over --workers 1"
    result.rows += [result.speed_one, result.speed_all]
    for codec in CODECS:
        if codec == SPEED_CODEC and result.speed_all.stored_bytes is not None:
            continue  # the --workers 2 speed run above already gives this size
        print(f"[{dataset.name}] pack --codec {codec} ...", flush=True)
        rewarm(dataset)
        result.rows.append(pack_codec(dataset, workdir, codec, both))
    if tools.tar and tools.zstd:
        print(f"[{dataset.name}] tar | zstd ...", flush=True)
        rewarm(dataset)
        result.rows.append(tar_zstd(dataset, workdir, both))
    if tools.mksquashfs:
        print(f"[{dataset.name}] mksquashfs ...", flush=True)
        rewarm(dataset)
        result.squashfs = squashfs(dataset, workdir, both)
        result.rows.append(result.squashfs)
    return result


# --- the one-million-file index -----------------------------------------------------------------------------

_INDEX_PROBE = r"""
import json, sys, time
from fanstore.core.index import Index

def rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")

before = rss_bytes()
started = time.perf_counter()
index = Index.load(sys.argv[1])
seconds = time.perf_counter() - started
index.lookup(sys.argv[2])
after = rss_bytes()
print(json.dumps({"seconds": seconds, "rss_growth": after - before, "files": index.file_count}))
"""


@dataclass(frozen=True, slots=True)
class IndexResult:
    files: int
    index_bytes: int
    build_seconds: float
    open_seconds: float
    rss_growth: int

    @property
    def bytes_per_file(self) -> float:
        return self.rss_growth / self.files


@dataclass(frozen=True, slots=True)
class SyntheticBlobs:
    """Where each file of a synthetic pack would sit: sizes, chunk ids, offsets and checksums, as arrays."""

    sizes: np.ndarray
    chunks: np.ndarray
    offsets: np.ndarray
    checksums: np.ndarray

    @classmethod
    def imagenet_like(cls, files: int) -> "SyntheticBlobs":
        rng = np.random.default_rng(7)
        sizes = rng.integers(20_000, 200_000, size=files, dtype=np.int64)  # ImageNet JPEGs average ~110 kB
        chunks = np.arange(files) // FILES_PER_CHUNK
        starts = np.concatenate(([0], np.cumsum(sizes)))
        offsets = CHUNK_HEADER_LEN + starts[:-1] - starts[chunks * FILES_PER_CHUNK]
        checksums = rng.integers(0, 2**63, size=files, dtype=np.int64)
        return cls(sizes, chunks, offsets, checksums)

    def chunk_table(self) -> np.ndarray:
        """The `chunks` section: each chunk's size (header + blobs, i.e. its last blob's end) and file count."""
        table = np.zeros(int(self.chunks[-1]) + 1, dtype=CHUNK_DTYPE)
        np.maximum.at(table["size"], self.chunks, (self.offsets + self.sizes).astype(np.uint64))
        table["files"] = np.bincount(self.chunks, minlength=len(table))
        return table


def imagenet_like_records(blobs: SyntheticBlobs, dirs: int) -> list[EntryRecord]:
    """Root, train/, `dirs` class directories and one JPEG entry per blob, spread evenly over the classes."""
    directory, regular, mtime = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, 1_700_000_000 * 10**9
    records = [EntryRecord("", directory, mtime), EntryRecord("train", directory, mtime)]
    per_dir = len(blobs.sizes) // dirs
    sizes, chunks, offsets, checksums = (a.tolist() for a in (blobs.sizes, blobs.chunks, blobs.offsets,
                                                              blobs.checksums))
    for d, wnid in enumerate(class_names(dirs)):
        records.append(EntryRecord(f"train/{wnid}", directory, mtime))
        for k in range(d * per_dir, (d + 1) * per_dir):
            number = 10000 + (k - d * per_dir) * 7  # ImageNet-style numbers, sorted within a class
            records.append(EntryRecord(f"train/{wnid}/{wnid}_{number:05d}.JPEG", regular, mtime, sizes[k],
                                       chunks[k], offsets[k], sizes[k], 0, checksums[k]))
    return records


def build_million_index(directory: Path) -> tuple[int, float, str]:
    """Write the synthetic index into `directory`; returns (index bytes, build seconds, a path to look up)."""
    started = time.perf_counter()
    blobs = SyntheticBlobs.imagenet_like(INDEX_FILES)
    records = imagenet_like_records(blobs, INDEX_DIRS)
    probe = records[len(records) // 2].path
    groups = [{"name": "spread", "replicated": False, "patterns": []}]
    codecs = [{"id": 0, "spec": "none", "dictionary": None}]
    data = build_index_bytes(records, blobs.chunk_table(), groups, codecs, {}, {"pack": {"files": INDEX_FILES}})
    write_index_atomically(directory, data)
    return len(data), time.perf_counter() - started, probe


def measure_index(workdir: Path, placement: Placement) -> IndexResult:
    """Median open time and RSS growth of Index.load over INDEX_RUNS fresh processes."""
    directory = workdir / "million-index"
    directory.mkdir()
    index_bytes, build_seconds, probe = build_million_index(directory)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for _ in range(INDEX_RUNS):
        wait_for_quiet(QUIET_BUSY, QUIET_MAX_WAIT)
        proc = subprocess.run(placement.wrap([sys.executable, "-c", _INDEX_PROBE, str(directory), probe]),
                              capture_output=True, text=True, env=env, check=True)
        runs.append(json.loads(proc.stdout))
    files = runs[0]["files"]
    shutil.rmtree(directory)
    return IndexResult(files, index_bytes, build_seconds, statistics.median(r["seconds"] for r in runs),
                       int(statistics.median(r["rss_growth"] for r in runs)))


def index_row(result: IndexResult, placement: Placement) -> Row:
    return Row(f"index {result.files / 1e6:.0f}M files", "Index.load + 1 lookup", placement.label,
               seconds=result.open_seconds, stored_bytes=result.index_bytes,
               note=f"RSS +{result.bytes_per_file:.0f} B/file; median of {INDEX_RUNS} fresh processes; "
                    "stored = index file, warm in page cache")


# --- output -------------------------------------------------------------------------------------------------


def mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def format_rows(rows: list[Row], squashfs_bytes: Callable[[str], int | None]) -> list[list[str]]:
    table = [["dataset", "measurement", "placement", "seconds", "MB/s", "others", "stored", "ratio", "/ sqsh",
              "note"]]
    for row in rows:
        ok = row.seconds is not None
        rate = f"{row.raw_bytes / 1e6 / row.seconds:,.1f}" if ok and row.raw_bytes else "-"
        stored = mib(row.stored_bytes) if row.stored_bytes is not None else "-"
        ratio = f"{row.raw_bytes / row.stored_bytes:.3f}" if row.raw_bytes and row.stored_bytes else "-"
        sqsh = squashfs_bytes(row.dataset)
        versus = f"{row.stored_bytes / sqsh:.3f}" if row.raw_bytes and row.stored_bytes and sqsh else "-"
        others = f"{row.others:.2f}" if row.others is not None else "-"
        table.append([row.dataset, row.what, row.cpus, f"{row.seconds:.2f}" if ok else "-", rate, others, stored,
                      ratio, versus, row.note])
    return table


def print_table(table: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    numeric = {3, 4, 5, 6, 7, 8}
    for n, line in enumerate(table):
        cells = [cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def disturbance(result: DatasetResult) -> str:
    """A warning to append to the speedup when other processes used the CPUs during its timings."""
    others = [row.others for row in (result.speed_one, result.speed_all) if row and row.others is not None]
    if not others or max(others) <= NOISY_OTHERS:
        return ""
    return f" (disturbed: other processes used up to {max(others):.2f} cores meanwhile)"


def target_lines(results: list[DatasetResult], index: IndexResult | None) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for every target this run could measure."""
    lines = []
    for result in results:
        name = result.dataset.name
        speedup = result.speedup
        # Scaling is a throughput question: on a tree that packs in a fraction of a second, process start-up is
        # most of the time, so only a tree of the intended size (>= MIN_BYTES) is held to the target.
        held = result.dataset.raw_bytes >= MIN_BYTES
        if speedup is None:
            verdict = "SKIP"
        elif not held:
            verdict = "INFO"
        else:
            verdict = "PASS" if speedup >= TARGET_SPEEDUP else "FAIL"
        lines.append((f"{name}: pack --workers 2 >= {TARGET_SPEEDUP}x --workers 1 ({SPEED_CODEC})"
                      + ("" if held else f" [no target below {mib(MIN_BYTES)}: start-up bound]"),
                      f"{speedup:.2f}x{disturbance(result)}" if speedup else "not measured", verdict))
        dict_row, sqsh = result.codec_row(DICT_CODEC), result.squashfs
        if dict_row and dict_row.stored_bytes and sqsh and sqsh.stored_bytes:
            relative = dict_row.stored_bytes / sqsh.stored_bytes
            lines.append((f"{name}: {DICT_CODEC} stored <= {TARGET_DICT_VS_SQUASHFS:.2f} x mksquashfs image",
                          f"{relative:.3f}x ({mib(dict_row.stored_bytes)} vs {mib(sqsh.stored_bytes)})",
                          "PASS" if relative <= TARGET_DICT_VS_SQUASHFS else "FAIL"))
        else:
            lines.append((f"{name}: {DICT_CODEC} stored <= {TARGET_DICT_VS_SQUASHFS:.2f} x mksquashfs image",
                          "not measured", "SKIP"))
    if index is not None:
        lines.append((f"index of {index.files:,} files opens in < {TARGET_OPEN_SECONDS} s",
                      f"{index.open_seconds:.3f} s", "PASS" if index.open_seconds < TARGET_OPEN_SECONDS else "FAIL"))
        lines.append((f"index RSS < {TARGET_BYTES_PER_FILE} B/file", f"{index.bytes_per_file:.1f} B/file",
                      "PASS" if index.bytes_per_file < TARGET_BYTES_PER_FILE else "FAIL"))
    return lines


def print_report(datasets: list[Dataset], results: list[DatasetResult], index: IndexResult | None,
                 index_placement: Placement, notes: list[str]) -> None:
    print()
    print("bench_pack: pack speed, stored size per codec vs tar|zstd and mksquashfs, 1M-file index open cost")
    print("packer: python -m fanstore pack SRC DEST --codec C --workers N --quiet (the real CLI of this checkout); "
          "seconds are wall time of the whole command, startup included")
    for line in machine_lines():
        print(line)
    print("placement: codec and baseline rows run on the CPUs of the --workers 2 row, the first two this process "
          "may use (--workers 2, zstd -T0, mksquashfs all processors)")
    print("cache: warm; page cache not dropped, every source tree was read once before timing")
    for dataset in datasets:
        print(f"dataset {dataset.name}: {dataset.root}: {dataset.files:,} files, {mib(dataset.raw_bytes)} "
              f"({dataset.raw_bytes:,} B)")
    for note in notes:
        print(f"note: {note}")
    print("MB/s = raw input MB (10^6 B) / wall seconds; stored = dataset directory (chunks + index), tar.zst "
          "file or squashfs image; ratio = raw / stored; / sqsh = stored / mksquashfs image of the same dataset")
    print(f"others = CPU seconds used by other processes on this machine during the timed command / its wall "
          f"seconds (0 = quiet; > {NOISY_OTHERS} = timing disturbed); each timing waits up to {QUIET_MAX_WAIT:.0f} s "
          f"for the CPUs to be < {QUIET_BUSY:.0%} busy and re-reads the source tree first")
    print(f"pack rows: --workers 2 unless stated; datasets under {SMALL_DATASET >> 20} MiB are so small that "
          "interpreter and worker-pool startup dominate their times")
    print()
    rows = [row for result in results for row in result.rows]
    if index is not None:
        rows.append(index_row(index, index_placement))
    sqsh_by_name = {r.dataset.name: r.squashfs.stored_bytes for r in results if r.squashfs is not None}
    print_table(format_rows(rows, sqsh_by_name.get))
    print()
    print("targets")
    for target, measured, verdict in target_lines(results, index):
        print(f"  {verdict:<4}  {target}: {measured}")


# --- main ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache",
                        help="where the generated dataset is kept between runs (default bench/.cache)")
    parser.add_argument("--quick", action="store_true",
                        help="a much smaller generated dataset (about a minute on a quiet machine); same table")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tools = Tools.find()
    notes = tools.skip_notes()
    for note in notes:
        print(f"note: {note}")
    one, both = placements(tools)
    if len(both.cpus) < 2:
        notes.append(f"only {len(both.cpus)} CPU available: --workers 2 shares it, no speedup is possible")
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    generated = ensure_generated(cache, args.quick, processes=len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="bench-pack-", dir=cache) as tmp:
        workdir = Path(tmp)
        datasets = []
        demo_root, demo_note = build_demo(workdir)
        notes.append(demo_note)
        if demo_root is not None:
            datasets.append(describe("demo", demo_root))
        datasets.append(describe("generated-quick" if args.quick else "generated", generated))
        warning = None if args.quick else size_warning(datasets[-1])
        if warning:
            notes.append(warning)
        results = [measure_dataset(dataset, workdir, tools, one, both) for dataset in datasets]
        print(f"[index] building a {INDEX_FILES:,}-file index and loading it {INDEX_RUNS} times ...", flush=True)
        index = measure_index(workdir, one)
        notes.append(f"1M-file index built in {index.build_seconds:.1f} s with build_index_bytes "
                     f"({INDEX_DIRS} dirs of ImageNet-like paths), written with write_index_atomically")
    print_report(datasets, results, index, one, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
