"""bench_read: how fast does training code read files through the fanstore mount, beside every other way to
read the same files on this machine?

One run, one table. For files of 4 KiB, 128 KiB and 2 MiB, with 1 and 4 concurrent reader processes, first and
second epoch, files/s and MB/s, reading:
  * plain     the original directory, warm in the page cache: the ceiling of any reader;
  * api       fanstore.open_dataset(...).read(path), no FUSE;
  * fanstore  `fanstore mount` (codec lz4), fresh mount for every first epoch;
  * ram-fuse  bench/ram_fs.py: a pyfuse3 file system serving the same bytes from RAM with fanstore's kernel-cache
              settings and no decoding: the ceiling of a Python FUSE mount here;
  * squashfuse over a `mksquashfs -comp zstd` image of the same files;
  * ratarmount over a tar of them.
Each configuration runs pinned (daemon and readers on CPU 0: no cross-core wake-ups) and unpinned. Backing
files (chunks, image, tar) are read once before every mount, so all start warm in the page cache; a first epoch
is the first pass after a fresh mount. A second table measures fanstore's kernel-cache levers one by one.

Usage: python bench/bench_read.py [--quick] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout

from fanstore.mount import fuse_mounted_at  # noqa: E402

KIB = 1024
SIZES = {"4 KiB": (4 * KIB, 10_000), "128 KiB": (128 * KIB, 1_000), "2 MiB": (2048 * KIB, 100)}
QUICK_DIVISOR = 10
FILES_PER_DIR = 500
READERS = (1, 4)
CODEC = "lz4"
SYSTEMS = ("plain", "api", "fanstore", "ram-fuse", "squashfuse", "ratarmount")
FUSE_SYSTEMS = ("fanstore", "ram-fuse", "squashfuse", "ratarmount")
PINNED, UNPINNED = "cpu 0", "cpus 0,1"


@dataclass(frozen=True, slots=True)
class FileSet:
    label: str
    root: Path  # the plain directory
    paths: list[str]
    total_bytes: int
    dataset: Path
    image: Path
    tar: Path


@dataclass(slots=True)
class Result:
    label: str
    readers: int
    placement: str
    system: str
    epochs: list[float]  # seconds per epoch


# --- inputs ------------------------------------------------------------------------------------------------------

def file_bytes(rng: np.random.Generator, size: int) -> bytes:
    """Compressible bytes: a random sequence of 512 random 8-byte words (lz4 stores them in about 43%, zstd:3
    in 24%), so decoding is real work, as it is for arrays and text."""
    words = rng.integers(0, 256, (512, 8), dtype=np.uint8)
    return words[rng.integers(0, 512, size // 8)].tobytes()


def build_file_set(cache: Path, label: str, size: int, count: int) -> FileSet:
    """Files, their fanstore dataset, squashfs image and tar, made once and reused (marker file last)."""
    base = cache / f"read-v2-{size}-{count}"
    root, dataset, image, tar = base / "files", base / "dataset", base / "files.sqsh", base / "files.tar"
    paths = [f"d{i // FILES_PER_DIR:03d}/f{i:06d}.bin" for i in range(count)]
    if not (base / "complete").exists():
        shutil.rmtree(base, ignore_errors=True)
        rng = np.random.default_rng(size + count)
        for rel in paths:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(file_bytes(rng, size))
        run([sys.executable, "-m", "fanstore", "pack", str(root), str(dataset), "--codec", CODEC, "--quiet"])
        run(["mksquashfs", str(root), str(image), "-comp", "zstd", "-noappend", "-quiet"])
        run(["tar", "-cf", str(tar), "-C", str(root), "."])
        (base / "complete").write_text("ok\n")
    return FileSet(label, root, paths, size * count, dataset, image, tar)


def run(command: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess:
    done = subprocess.run(list(command), capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise SystemExit(f"bench_read: {' '.join(map(str, command))} failed: {done.stderr.strip()[-500:]}")
    return done


def warm(*paths: Path) -> None:
    """Read backing files once so every system starts with them in the page cache."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            with open(file, "rb") as f:
                while f.read(1 << 20):
                    pass


# --- mounts ------------------------------------------------------------------------------------------------------

def ratarmount_command() -> str | None:
    beside_python = Path(sys.executable).parent / "ratarmount"
    return str(beside_python) if beside_python.exists() else shutil.which("ratarmount")


def _taskset(placement: str) -> list[str]:
    return ["taskset", "-c", "0"] if placement == PINNED else []


@contextlib.contextmanager
def mounted(system: str, files: FileSet, placement: str, workdir: Path, extra: Sequence[str] = ()) -> Iterator[Path]:
    """A fresh mount of `system` over `files`; always unmounted (and its daemon gone) on the way out."""
    mountpoint = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=workdir))
    daemon: subprocess.Popen | None = None
    pin = _taskset(placement)
    if system == "fanstore":
        warm(files.dataset)
        run([*pin, sys.executable, "-m", "fanstore", "mount", str(files.dataset), str(mountpoint),
             "--log", str(workdir / "fanstore.log"), *extra])
    elif system == "ram-fuse":
        daemon = subprocess.Popen([*pin, sys.executable, str(BENCH_DIR / "ram_fs.py"), str(files.root),
                                   str(mountpoint), *extra], stdout=subprocess.PIPE, text=True)
        if daemon.stdout is None or daemon.stdout.readline().strip() != "ready":
            raise SystemExit("bench_read: ram_fs.py did not mount")
    elif system == "squashfuse":
        warm(files.image)
        run([*pin, "squashfuse", str(files.image), str(mountpoint)])
    elif system == "ratarmount":
        warm(files.tar)
        run([*pin, str(ratarmount_command()), str(files.tar), str(mountpoint)])
    try:
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        if daemon is not None:
            daemon.wait(timeout=60)
        deadline = time.monotonic() + 30
        while fuse_mounted_at(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.rmdir(mountpoint)


# --- readers -----------------------------------------------------------------------------------------------------

def _read_files(root: str, paths: list[str]) -> int:
    """What a data loader worker does per sample: open, read it all, close."""
    total = 0
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as f:
            total += len(f.read())
    return total


_api_dataset = None  # per reader process: the dataset it opened (the API rows)


def _open_api(dataset: str) -> None:
    global _api_dataset
    import fanstore

    _api_dataset = fanstore.open_dataset(dataset)


def _read_api(paths: list[str]) -> int:
    assert _api_dataset is not None
    return sum(len(_api_dataset.read(rel)) for rel in paths)


def time_epochs(pool: multiprocessing.pool.Pool, readers: int, root: str | None, paths: list[str],
                epochs: int = 2) -> list[float]:
    """Seconds per epoch, every reader reading its interleaved share at the same time."""
    shares = [paths[i::readers] for i in range(readers)]
    seconds = []
    for _ in range(epochs):
        started = time.perf_counter()
        if root is None:
            pool.map(_read_api, shares, chunksize=1)
        else:
            pool.starmap(_read_files, [(root, share) for share in shares], chunksize=1)
        seconds.append(time.perf_counter() - started)
    return seconds


@contextlib.contextmanager
def reader_pool(readers: int, placement: str, api_dataset: Path | None = None) -> Iterator[multiprocessing.pool.Pool]:
    """Reader processes, started before timing; pinned ones inherit CPU 0 from us."""
    before = os.sched_getaffinity(0)
    if placement == PINNED:
        os.sched_setaffinity(0, {0})
    try:
        context = multiprocessing.get_context("fork")
        initializer, initargs = (_open_api, (str(api_dataset),)) if api_dataset is not None else (None, ())
        with context.Pool(readers, initializer=initializer, initargs=initargs) as pool:
            pool.map(abs, range(readers))  # every process up before the clock starts
            yield pool
    finally:
        os.sched_setaffinity(0, before)


# --- the runs ----------------------------------------------------------------------------------------------------

def measure(files: FileSet, readers: int, placement: str, system: str, workdir: Path) -> Result:
    if system == "plain":
        warm(files.root)
        with reader_pool(readers, placement) as pool:
            return Result(files.label, readers, placement, system, time_epochs(pool, readers, str(files.root),
                                                                              files.paths))
    if system == "api":
        warm(files.dataset)
        with reader_pool(readers, placement, api_dataset=files.dataset) as pool:
            return Result(files.label, readers, placement, system, time_epochs(pool, readers, None, files.paths))
    with mounted(system, files, placement, workdir) as mountpoint, reader_pool(readers, placement) as pool:
        return Result(files.label, readers, placement, system, time_epochs(pool, readers, str(mountpoint),
                                                                          files.paths))


def measure_levers(files: FileSet, workdir: Path) -> list[tuple[str, str, list[float]]]:
    """fanstore and the RAM ceiling with each kernel-cache lever taken away, one reader, pinned."""
    rows = []
    variants = (("default (1 day timeouts, keep_cache)", (), ()),
                ("no keep_cache", ("--no-keep-cache",), ("--no-keep-cache",)),
                ("timeouts 0", ("--kernel-timeout", "0"), ("--timeout", "0")),
                ("no keep_cache, timeouts 0", ("--no-keep-cache", "--kernel-timeout", "0"),
                 ("--no-keep-cache", "--timeout", "0")))
    for name, fanstore_args, ram_args in variants:
        for system, extra in (("fanstore", fanstore_args), ("ram-fuse", ram_args)):
            with mounted(system, files, PINNED, workdir, extra) as mountpoint, reader_pool(1, PINNED) as pool:
                rows.append((name, system, time_epochs(pool, 1, str(mountpoint), files.paths)))
    return rows


def enosys_open_finding(files: FileSet, workdir: Path) -> str:
    """Does an open that answers ENOSYS (so the kernel stops sending opens) work through pyfuse3?"""
    with mounted("ram-fuse", files, UNPINNED, workdir, ("--enosys-open",)) as mountpoint:
        target = mountpoint / files.paths[0]
        try:
            first = target.read_bytes()
        except OSError as exc:
            return (f"open answering ENOSYS: the kernel accepted it and stopped sending opens, but the read then "
                    f"came with file handle 0 and pyfuse3's read(fh, off, size) gets no inode, so the file system "
                    f"cannot tell which file is read ({exc.strerror}). Not usable through pyfuse3: fanstore "
                    f"answers every open, and keeps pages across opens with keep_cache instead.")
        same = first == (files.root / files.paths[0]).read_bytes()
        return f"open answering ENOSYS: a read returned {len(first)} bytes, {'equal' if same else 'NOT equal'} to the file"


# --- report ------------------------------------------------------------------------------------------------------

def rate(files: FileSet, seconds: float) -> tuple[float, float]:
    return len(files.paths) / seconds, files.total_bytes / 1e6 / seconds


def print_table(sets: dict[str, FileSet], results: list[Result]) -> None:
    ceiling = {(r.label, r.readers, r.placement): r for r in results if r.system == "ram-fuse"}
    header = (f"{'files':<8} {'readers':>7}  {'placement':<9} {'system':<11} {'epoch 1 files/s':>15} {'MB/s':>8} "
              f"{'epoch 2 files/s':>15} {'MB/s':>8} {'epoch 1 / RAM fuse':>18}")
    print(header)
    print("-" * len(header))
    for r in results:
        files = sets[r.label]
        (f1, m1), (f2, m2) = rate(files, r.epochs[0]), rate(files, r.epochs[1])
        ram = ceiling.get((r.label, r.readers, r.placement))
        share = f"{ram.epochs[0] / r.epochs[0]:.0%}" if ram is not None and r.system != "plain" else ""
        print(f"{r.label:<8} {r.readers:>7}  {r.placement:<9} {r.system:<11} {f1:>15,.0f} {m1:>8,.0f} {f2:>15,.0f} "
              f"{m2:>8,.0f} {share:>18}")


def targets(results: list[Result]) -> list[str]:
    by_key = {(r.label, r.readers, r.placement, r.system): r for r in results}
    lines = []
    for (label, readers, placement, system), r in sorted(by_key.items()):
        if system != "fanstore":
            continue
        where = f"{label}, {readers} reader(s), {placement}"
        ram, tar, sqfs = (by_key.get((label, readers, placement, s)) for s in ("ram-fuse", "ratarmount", "squashfuse"))
        if ram is not None and label != "4 KiB":
            share = ram.epochs[0] / r.epochs[0]
            lines.append(f"{'PASS' if share >= 0.7 else 'FAIL'}  {where}: epoch 1 at {share:.0%} of the RAM ceiling "
                         f"(target >= 70%)")
        if tar is not None:
            worst = min(tar.epochs[e] / r.epochs[e] for e in (0, 1))
            lines.append(f"{'PASS' if worst >= 1.5 else 'FAIL'}  {where}: files/s {worst:.2f}x ratarmount's in "
                         f"the worse epoch (target >= 1.5x)")
        if sqfs is not None:
            ratio = sqfs.epochs[1] / r.epochs[1]
            lines.append(f"{'PASS' if ratio >= 1.0 else 'FAIL'}  {where}: epoch 2 at {ratio:.2f}x squashfuse "
                         f"(target >= 1.0x)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read throughput: fanstore mount and API beside the baselines.")
    parser.add_argument("--quick", action="store_true", help=f"1/{QUICK_DIVISOR} of the files, for development")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where inputs are made once")
    args = parser.parse_args(argv)
    if not os.path.exists("/dev/fuse"):
        raise SystemExit("bench_read: /dev/fuse is missing: nothing to mount")
    systems = [s for s in SYSTEMS if s != "ratarmount" or ratarmount_command()]
    missing = [tool for tool in ("mksquashfs", "squashfuse", "fusermount3") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"bench_read: missing {', '.join(missing)}: apt-get install -y squashfs-tools squashfuse "
                         "fuse3")
    divisor = QUICK_DIVISOR if args.quick else 1
    args.cache.mkdir(parents=True, exist_ok=True)
    sets = {label: build_file_set(args.cache, label, size, max(20, count // divisor))
            for label, (size, count) in SIZES.items()}
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-read-") as tmp:
        workdir = Path(tmp)
        for files in sets.values():
            for readers in READERS:
                for placement in (PINNED, UNPINNED):
                    for system in systems:
                        print(f"[{files.label}, {readers} reader(s), {placement}] {system} ...", file=sys.stderr)
                        results.append(measure(files, readers, placement, system, workdir))
        levers = {label: measure_levers(files, workdir) for label, files in sets.items()}
        finding = enosys_open_finding(next(iter(sets.values())), workdir)

    print("\nbench_read: files/s and MB/s of open+read+close per file, reader processes each reading an "
          "interleaved share")
    print(f"machine: {os.cpu_count()} CPUs; pinned = daemon and readers on CPU 0, unpinned = both CPUs; "
          f"fanstore codec {CODEC}; backing files warm in the page cache; epoch 1 = first pass after a fresh mount")
    print("files: " + "; ".join(f"{f.label}: {len(f.paths):,} files, {f.total_bytes / 1e6:,.0f} MB"
                                for f in sets.values()))
    if "ratarmount" not in systems:
        print("ratarmount: not installed (pip install ratarmount): its rows are missing")
    print()
    print_table(sets, results)
    print("\nkernel-cache levers, 1 reader, pinned: files/s (epoch 1 / epoch 2)")
    for label, rows in levers.items():
        files = sets[label]
        for name, system, seconds in rows:
            print(f"  {label:<8} {system:<9} {name:<38} {rate(files, seconds[0])[0]:>9,.0f} / "
                  f"{rate(files, seconds[1])[0]:>9,.0f}")
    print(f"\n{finding}")
    print("\ntargets")
    for line in targets(results):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
