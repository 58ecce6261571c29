"""bench_read: how fast does training code read files through the fanstore mount, beside every other way to
read the same files on this machine?

One run, one table: files of 4 KiB, 128 KiB and 2 MiB; 1 and 4 reader processes, each reading a disjoint,
interleaved share of the files with open/read/close as a data-loader worker does; first and second epoch;
files/s and MB/s; every configuration pinned (`taskset -c 0`: the file system's daemon and every reader share
CPU 0) and unpinned. Ways of reading the same files:

  plain       the original directory, warm in the page cache: the ceiling of any reader;
  api         fanstore.open_dataset(DEST).read(path) in each reader, no FUSE;
  fanstore    `fanstore mount DEST MP --foreground`, its defaults, codec lz4;
  ram-fuse    bench/ram_fs.py: pyfuse3 serving the same bytes from RAM, no decoding, fanstore's kernel settings
              and session loop: the ceiling of a Python FUSE mount on this machine;
  squashfuse  over a `mksquashfs -comp zstd` image of the same files (the high-level, multithreaded binary);
  ratarmount  over a tar of them.

Epoch 1 is the first pass after a fresh mount (nothing decoded, nothing in the kernel's cache for that mount);
epoch 2 the next pass on the same mount. The backing files (chunks, image, tar, plain tree) are read just
before every mount, so all start warm in the page cache, and memory is touched just before every timing (see
back_memory). Each cell is the median of --repeats fresh mounts.
Then, one reader pinned: each kernel-cache lever taken away in turn, for fanstore and for the RAM file system,
with the requests the RAM file system answered per file; the ENOSYS-open finding; the targets.

Usage: python bench/bench_read.py [--quick] [--repeats N] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from fanstore.mount.mount import READ_AHEAD_KIB, fuse_mounted_at, read_ahead_setting  # noqa: E402
from machine_load import OtherLoad, machine_lines, wait_for_quiet  # noqa: E402

KIB = 1024
SIZES = {"4 KiB": (4 * KIB, 20_000), "128 KiB": (128 * KIB, 2_000), "2 MiB": (2048 * KIB, 150)}
QUICK_DIVISOR, MIN_FILES = 10, 20
FILES_PER_DIR = 1000
READERS = (1, 4)
CODEC = "lz4"
GENERATED_VERSION = "bench_read files v3"
REPEATS = 5
QUIET_BUSY, QUIET_MAX_WAIT = 0.10, 30.0  # before each timing: wait until the CPUs are < 10% busy (at most 30 s)
NOISY_OTHERS = 0.10  # other processes' CPU use (cores) above which a cell is flagged as disturbed
MOUNT_TIMEOUT = 300.0  # ratarmount indexes the tar on its first mount
BACKED_SLACK = 512 << 20  # memory touched before each timing beyond twice the files' bytes (see back_memory)

TARGET_OF_RAM = 0.70  # epoch 1, 128 KiB and 2 MiB
TARGET_OVER_RATARMOUNT = 1.5  # files/s, every size
TARGET_OVER_SQUASHFUSE = 1.0  # epoch 2, every size


@dataclass(frozen=True, slots=True)
class Placement:
    label: str
    cpus: frozenset[int] | None  # None: wherever the scheduler likes

    def wrap(self, command: Sequence[str]) -> list[str]:
        if self.cpus is None:
            return list(command)
        return ["taskset", "-c", ",".join(map(str, sorted(self.cpus))), *command]


PINNED = Placement("taskset -c 0", frozenset({0}))
UNPINNED = Placement("unpinned", None)


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
class Cell:
    """One row: seconds per epoch of every repeat, and the most other processes used during one of them."""

    label: str
    readers: int
    placement: str
    system: str
    epochs: list[tuple[float, float]] = field(default_factory=list)
    others: float = 0.0  # cores
    requests: list[dict[str, int]] = field(default_factory=list)  # ram-fuse only: per epoch, last repeat

    def median(self, epoch: int) -> float:
        return statistics.median(e[epoch] for e in self.epochs)


# --- inputs ------------------------------------------------------------------------------------------------------

def file_bytes(rng: np.random.Generator, size: int) -> bytes:
    """Moderately compressible bytes: a random sequence drawn from 512 random 8-byte words. lz4 stores them in
    about 43%, zstd:3 in 24%, so decoding is real work, as for arrays, text and uncompressed images."""
    words = rng.integers(0, 256, (512, 8), dtype=np.uint8)
    return words[rng.integers(0, 512, size // 8)].tobytes()


GENERATED_TIME_NS = 1_700_000_000 * 10**9  # every generated file's mtime and atime


def write_files(root: Path, paths: Iterable[str], rng: np.random.Generator, size: int,
                make: Callable[[np.random.Generator, int], bytes] = file_bytes) -> None:
    """Files of `size` bytes (`make`'s, file_bytes by default, in the order of `paths`) under `root`, all with the
    same fixed times, so that the same seed gives the same tree, and the same pack, on every run."""
    for rel in paths:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(make(rng, size))
        os.utime(path, ns=(GENERATED_TIME_NS, GENERATED_TIME_NS))


def build_file_set(cache: Path, label: str, size: int, count: int) -> FileSet:
    """The files, their fanstore dataset, squashfs image and tar: made once, reused while the marker matches."""
    base = cache / f"read-{size}-{count}"
    root, dataset, image, tar = base / "files", base / "dataset", base / "files.sqsh", base / "files.tar"
    paths = [f"d{i // FILES_PER_DIR:03d}/f{i:06d}.bin" for i in range(count)]
    marker = base / "complete"
    if not marker.exists() or marker.read_text() != f"{GENERATED_VERSION} {CODEC}\n":
        print(f"[{label}] generating {count:,} files into {base} (once) ...", file=sys.stderr, flush=True)
        shutil.rmtree(base, ignore_errors=True)
        rng = np.random.default_rng(size * 7919 + count)
        write_files(root, paths, rng, size)
        run([sys.executable, "-m", "fanstore", "pack", str(root), str(dataset), "--codec", CODEC, "--quiet"])
        run(["mksquashfs", str(root), str(image), "-comp", "zstd", "-noappend", "-quiet"])
        run(["tar", "-cf", str(tar), "-C", str(root), "."])
        marker.write_text(f"{GENERATED_VERSION} {CODEC}\n")
    return FileSet(label, root, paths, size * count, dataset, image, tar)


def run(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_read: {' '.join(map(str, command))} failed: {done.stderr.strip()[-500:]}")
    return done


def warm(*paths: Path) -> None:
    """Read backing files so every system starts with them in the page cache (this VM evicts idle pages)."""
    for path in paths:
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            with open(file, "rb") as f:
                while f.read(1 << 20):
                    pass


# --- mounts ------------------------------------------------------------------------------------------------------

def ratarmount_command() -> str | None:
    beside_python = Path(sys.executable).parent / "ratarmount"
    return str(beside_python) if beside_python.exists() else shutil.which("ratarmount")


@dataclass(slots=True)
class Mount:
    mountpoint: Path
    daemon: subprocess.Popen[bytes]
    stats: Path | None  # ram-fuse: where it writes its request counts on SIGUSR1

    def requests(self) -> dict[str, int]:
        """The RAM file system's requests answered so far, per operation."""
        return self.report()["requests"]

    def report(self) -> dict:
        """What ram_fs.py writes on SIGUSR1: requests per operation, file handles its reads came with."""
        assert self.stats is not None
        self.stats.unlink(missing_ok=True)
        self.daemon.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not self.stats.exists():
            if time.monotonic() > deadline:
                raise SystemExit("bench_read: ram_fs.py did not write its request counts")
            time.sleep(0.01)
        return json.loads(self.stats.read_text())


def daemon_command(system: str, files: FileSet, mountpoint: Path, stats: Path, extra: Sequence[str]) -> list[str]:
    """The foreground command serving `system`: a child of this process, so its CPU is not "other load"."""
    if system == "fanstore":
        return [sys.executable, "-m", "fanstore", "mount", str(files.dataset), str(mountpoint), "--foreground",
                *extra]
    if system == "fanstore-options":  # a lever the CLI has no flag for: MountOptions given to the same entry point
        program = ("import sys; from pathlib import Path; from fanstore.mount.mount import MountOptions, "
                   "mount_foreground; sys.exit(mount_foreground(Path(sys.argv[1]), Path(sys.argv[2]), "
                   f"MountOptions({', '.join(extra)})))")
        return [sys.executable, "-c", program, str(files.dataset), str(mountpoint)]
    if system == "ram-fuse":
        return [sys.executable, str(BENCH_DIR / "ram_fs.py"), str(files.root), str(mountpoint), "--stats",
                str(stats), *extra]
    if system == "squashfuse":
        return ["squashfuse", "-f", str(files.image), str(mountpoint)]
    if system == "ratarmount":
        return [str(ratarmount_command()), "-f", str(files.tar), str(mountpoint)]
    raise ValueError(system)


@contextlib.contextmanager
def mounted(system: str, files: FileSet, placement: Placement, workdir: Path,
            extra: Sequence[str] = ()) -> Iterator[Mount]:
    """A fresh mount of `system` over `files`, daemon placed as asked; always unmounted, daemon gone, on exit."""
    warm({"fanstore": files.dataset, "fanstore-options": files.dataset, "squashfuse": files.image,
          "ratarmount": files.tar}.get(system, files.root))
    mountpoint = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=workdir))
    stats = workdir / f"{mountpoint.name}.stats.json"
    with open(workdir / f"{system}.log", "ab") as log:
        daemon = subprocess.Popen(placement.wrap(daemon_command(system, files, mountpoint, stats, extra)),
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO)
    try:
        if not wait_until_mounted(mountpoint, daemon, MOUNT_TIMEOUT):
            raise SystemExit(f"bench_read: {system} did not mount; see {workdir / (system + '.log')}")
        yield Mount(mountpoint, daemon, stats if system == "ram-fuse" else None)
    finally:
        unmount_and_wait(mountpoint, daemon)
        os.rmdir(mountpoint)


def wait_until_mounted(mountpoint: Path, daemon: subprocess.Popen[bytes], timeout: float) -> bool:
    """True once the mount at `mountpoint` answers; False if its daemon exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not fuse_mounted_at(mountpoint):
        if daemon.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    os.stat(mountpoint)  # answered: the kernel's INIT is done
    return True


def unmount_and_wait(mountpoint: Path, daemon: subprocess.Popen[bytes]) -> None:
    """A lazy unmount, then the daemon's exit (killed if it is still there a minute later)."""
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def force_kernel_read_ahead(mount: Mount, kib: int = 128) -> None:
    """Put the mount back on the kernel's default read-ahead, once its daemon has raised it (after INIT)."""
    setting = read_ahead_setting(mount.mountpoint)
    if setting is None:
        raise SystemExit(f"bench_read: no FUSE mount at {mount.mountpoint}")
    deadline = time.monotonic() + 10
    while int(setting.read_text()) != READ_AHEAD_KIB and time.monotonic() < deadline:
        time.sleep(0.01)
    setting.write_text(f"{kib}\n")


# --- readers -----------------------------------------------------------------------------------------------------

def _read_files(root: str, paths: list[str]) -> int:
    """What a data-loader worker does per sample: open, read it all, close."""
    total = 0
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as f:
            total += len(f.read())
    return total


def _open_api(dataset: str) -> None:
    import fanstore

    global _api_dataset  # one per reader process, opened before the clock starts
    _api_dataset = fanstore.open_dataset(dataset)


def _read_api(paths: list[str]) -> int:
    return sum(len(_api_dataset.read(rel)) for rel in paths)


@contextlib.contextmanager
def reader_pool(readers: int, placement: Placement, api_dataset: Path | None = None
                ) -> Iterator[multiprocessing.pool.Pool]:
    """Reader processes, all started before timing; pinned ones inherit the placement from this process."""
    before = os.sched_getaffinity(0)
    if placement.cpus is not None:
        os.sched_setaffinity(0, placement.cpus)
    try:
        initializer, initargs = (_open_api, (str(api_dataset),)) if api_dataset is not None else (None, ())
        with multiprocessing.get_context("fork").Pool(readers, initializer, initargs) as pool:
            pool.map(abs, range(readers), chunksize=1)  # every process up
            yield pool
    finally:
        os.sched_setaffinity(0, before)


def epoch_seconds(pool: multiprocessing.pool.Pool, readers: int, root: Path | None, files: FileSet) -> float:
    """Wall seconds for the readers to read every file once, each its interleaved share, all at once."""
    shares = [files.paths[i::readers] for i in range(readers)]
    started = time.perf_counter()
    if root is None:
        total = sum(pool.map(_read_api, shares, chunksize=1))
    else:
        total = sum(pool.starmap(_read_files, [(str(root), share) for share in shares], chunksize=1))
    seconds = time.perf_counter() - started
    if total != files.total_bytes:
        raise SystemExit(f"bench_read: read {total} bytes, expected {files.total_bytes}")
    return seconds


# --- measuring ---------------------------------------------------------------------------------------------------

def back_memory(nbytes: int) -> None:
    """Touch `nbytes` of fresh memory and free it, just before a timing.

    This VM hands memory the guest has left free for a few seconds back to the host, and touching it again is
    several times slower. Without this, a run that follows a pause allocates its page cache (and the daemon
    its buffers) from such memory: epoch 1 of the RAM file system over the 2 MiB files measured 175 files/s
    after a 6 s pause and 1,000 right after another run. Freed here, the memory is what the timing then gets.
    """
    block = np.empty(nbytes, dtype=np.uint8)
    block[::4096] = 1


def two_epochs(cell: Cell, pool: multiprocessing.pool.Pool, root: Path | None, files: FileSet,
               mount: Mount | None = None) -> None:
    wait_for_quiet(QUIET_BUSY, QUIET_MAX_WAIT)
    back_memory(2 * files.total_bytes + BACKED_SLACK)
    with OtherLoad() as others:
        started = time.perf_counter()
        first = epoch_seconds(pool, cell.readers, root, files)
        counts = [mount.requests()] if mount is not None and mount.stats is not None else []
        second = epoch_seconds(pool, cell.readers, root, files)
        counts += [mount.requests()] if counts else []
        wall = time.perf_counter() - started
    cell.epochs.append((first, second))
    cell.others = max(cell.others, others.cpu_seconds / wall)
    if counts:
        cell.requests = [counts[0], {op: counts[1].get(op, 0) - n for op, n in counts[0].items()}]


def measure(cell: Cell, files: FileSet, placement: Placement, workdir: Path, repeats: int,
            system: str | None = None, extra: Sequence[str] = (), read_ahead_kib: int | None = None) -> Cell:
    """Fill `cell` with `repeats` fresh runs of two epochs each."""
    system = system or cell.system
    for _ in range(repeats):
        if system == "plain":
            warm(files.root)
            with reader_pool(cell.readers, placement) as pool:
                two_epochs(cell, pool, files.root, files)
        elif system == "api":
            warm(files.dataset)
            with reader_pool(cell.readers, placement, api_dataset=files.dataset) as pool:
                two_epochs(cell, pool, None, files)
        else:
            with mounted(system, files, placement, workdir, extra) as mount, \
                    reader_pool(cell.readers, placement) as pool:
                if read_ahead_kib is not None:
                    force_kernel_read_ahead(mount, read_ahead_kib)
                two_epochs(cell, pool, mount.mountpoint, files, mount)
    return cell


LEVERS = (  # (name, how fanstore is mounted, how ram_fs.py is started, read-ahead forced after mount)
    ("none taken away (defaults)", ("fanstore", ()), (), None),
    ("no keep_cache", ("fanstore", ("--no-keep-cache",)), ("--no-keep-cache",), None),
    ("entry/attr timeouts 0", ("fanstore", ("--kernel-timeout", "0")), ("--timeout", "0"), None),
    ("kernel read-ahead (128 KiB)", ("fanstore", ()), (), 128),
    ("pyfuse3's own session loop", ("fanstore-options", ("fast_session_loop=False",)), ("--plain-loop",), None),
    ("open answers ENOSYS (bytes wrong)", None, ("--no-open", "zeros"), None),
)


def measure_levers(files: FileSet, workdir: Path, repeats: int) -> list[tuple[str, Cell]]:
    rows = []
    for name, fanstore_how, ram_args, read_ahead in LEVERS:
        if fanstore_how is not None:
            system, extra = fanstore_how
            print(f"[{files.label}] lever {name}: fanstore ...", file=sys.stderr, flush=True)
            rows.append((name, measure(Cell(files.label, 1, PINNED.label, "fanstore"), files, PINNED, workdir,
                                       repeats, system, extra, read_ahead)))
        print(f"[{files.label}] lever {name}: ram-fuse ...", file=sys.stderr, flush=True)
        rows.append((name, measure(Cell(files.label, 1, PINNED.label, "ram-fuse"), files, PINNED, workdir,
                                   repeats, extra=ram_args, read_ahead_kib=read_ahead)))
    return rows


def enosys_open_finding(files: FileSet, workdir: Path) -> list[str]:
    """Does an open that answers ENOSYS (the kernel then sends no opens at all) work through pyfuse3?"""
    import pyfuse3

    lines = [f"pyfuse3 {pyfuse3.__version__}: Operations.read{inspect.signature(pyfuse3.Operations.read)}: "
             "a file handle, no inode"]
    handlers = Path(pyfuse3.__file__).parent / "handlers.pxi"  # the installed package's Cython source
    text = handlers.read_text().splitlines() if handlers.exists() else []
    start = next((n for n, line in enumerate(text) if line.startswith("cdef void fuse_read ")), None)
    if start is not None:
        quoted = [start] + [next((n for n in range(start, len(text)) if needle in text[n]), start)
                            for needle in ("c.fh = fi.fh", "await operations.read(")]
        lines.append(f"{handlers}: " + " ... ".join(f"{n + 1}: {text[n].strip()}" for n in quoted)
                     + "  (the inode libfuse hands fuse_read goes no further)")
    sample = files.paths[: min(20, len(files.paths))]
    with mounted("ram-fuse", files, UNPINNED, workdir, ("--no-open", "eio")) as mount:
        errors = []
        for rel in sample:
            try:
                (mount.mountpoint / rel).read_bytes()
            except OSError as exc:
                errors.append(exc.strerror)
        report = mount.report()
    counts = report["requests"]
    lines.append(f"--no-open eio: reading {len(sample)} files: {len(errors)} failed ({', '.join(sorted(set(errors)))})"
                 f"; the file system saw {counts.get('open', 0)} open(s) and {counts.get('read', 0)} read(s), with "
                 f"file handles {report['handles_read']}")
    with mounted("ram-fuse", files, UNPINNED, workdir, ("--no-open", "zeros")) as mount:
        wrong = sum((mount.mountpoint / rel).read_bytes() != (files.root / rel).read_bytes() for rel in sample)
        counts = mount.requests()
    lines.append(f"--no-open zeros: {wrong} of {len(sample)} files read back wrong; {counts.get('open', 0)} open(s) "
                 f"for {len(sample)} files: the kernel stops sending opens (and releases), but without the inode "
                 "no pyfuse3 file system can say which file a read is for")
    return lines


# --- report ------------------------------------------------------------------------------------------------------

def rates(files: FileSet, seconds: float) -> tuple[float, float]:
    return len(files.paths) / seconds, files.total_bytes / 1e6 / seconds


def print_table(header: list[str], rows: list[list[str]], left: int) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for n, row in enumerate([header, *rows]):
        print("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main_rows(sets: dict[str, FileSet], cells: list[Cell]) -> list[list[str]]:
    ram = {(c.label, c.readers, c.placement): c for c in cells if c.system == "ram-fuse"}
    rows = []
    for c in cells:
        files = sets[c.label]
        (f1, m1), (f2, m2) = rates(files, c.median(0)), rates(files, c.median(1))
        firsts = [len(files.paths) / e[0] for e in c.epochs]
        spread = f"{(max(firsts) - min(firsts)) / statistics.median(firsts):.0%}" if len(firsts) > 1 else "-"
        ceiling = ram.get((c.label, c.readers, c.placement))
        share = f"{ceiling.median(0) / c.median(0):.0%}" if ceiling and c.system not in ("plain", "ram-fuse") else ""
        flag = " !" if c.others > NOISY_OTHERS else ""
        rows.append([c.label, str(c.readers), c.placement, c.system, f"{f1:,.0f}", f"{m1:,.0f}", spread,
                     f"{f2:,.0f}", f"{m2:,.0f}", share, f"{c.others:.2f}{flag}"])
    return rows


def lever_rows(sets: dict[str, FileSet], levers: dict[str, list[tuple[str, Cell]]]) -> list[list[str]]:
    rows = []
    for label, entries in levers.items():
        files = sets[label]
        for name, c in entries:
            per_file = ["", ""]
            for epoch, counts in enumerate(c.requests):
                total = sum(counts.values()) / len(files.paths)
                shown = ", ".join(f"{op} {n / len(files.paths):.2g}" for op, n in sorted(counts.items())
                                  if n / len(files.paths) >= 0.01)
                per_file[epoch] = f"{total:.1f} ({shown})" if shown else "0"
            rows.append([label, name, c.system, f"{rates(files, c.median(0))[0]:,.0f}",
                         f"{rates(files, c.median(1))[0]:,.0f}", f"{c.others:.2f}", per_file[0], per_file[1]])
    return rows


def target_lines(cells: list[Cell]) -> list[str]:
    by_key = {(c.label, c.readers, c.placement, c.system): c for c in cells}
    lines = []
    for (label, readers, placement, system), c in by_key.items():
        if system != "fanstore":
            continue
        where = f"{label:>7}, {readers} reader{'s' if readers > 1 else ' '}, {placement:<12}"
        ram, tar, sqfs = (by_key.get((label, readers, placement, s)) for s in ("ram-fuse", "ratarmount", "squashfuse"))
        if ram is not None and label != "4 KiB":
            share = ram.median(0) / c.median(0)
            lines.append(f"{'PASS' if share >= TARGET_OF_RAM else 'FAIL'}  epoch 1 >= {TARGET_OF_RAM:.0%} of the RAM "
                         f"ceiling          {where}: {share:.1%}")
        if tar is not None:
            e1, e2 = tar.median(0) / c.median(0), tar.median(1) / c.median(1)
            ok = min(e1, e2) >= TARGET_OVER_RATARMOUNT
            lines.append(f"{'PASS' if ok else 'FAIL'}  files/s >= {TARGET_OVER_RATARMOUNT}x ratarmount, both epochs "
                         f"  {where}: epoch 1 {e1:.2f}x, epoch 2 {e2:.2f}x")
        if sqfs is not None:
            ratio = sqfs.median(1) / c.median(1)
            lines.append(f"{'PASS' if ratio >= TARGET_OVER_SQUASHFUSE else 'FAIL'}  epoch 2 >= squashfuse           "
                         f"         {where}: {ratio:.2f}x")
    return sorted(lines, key=lambda line: line[6:])


def print_report(sets: dict[str, FileSet], cells: list[Cell], levers: dict[str, list[tuple[str, Cell]]],
                 finding: list[str], repeats: int, notes: list[str]) -> None:
    print()
    print("bench_read: files/s and MB/s of open + read all + close per file; reader processes each read an "
          "interleaved, disjoint share; epoch 1 = first pass after a fresh mount, epoch 2 = the next pass")
    for line in machine_lines():
        print(line)
    print(f"placement: 'taskset -c 0' = file system daemon and all readers on CPU 0, 'unpinned' = the "
          f"{len(os.sched_getaffinity(0))} CPUs this process may use, the scheduler's choice")
    print(f"fanstore: `fanstore mount --foreground`, codec {CODEC}, defaults (keep_cache, 1-day entry/attr timeouts, "
          f"read-ahead {READ_AHEAD_KIB} KiB where root may set it, prefetch 8); `squashfuse -f IMAGE` and "
          "`ratarmount -f TAR` with their defaults; every daemon is a child of this process")
    print("files: " + "; ".join(f"{f.label}: {len(f.paths):,} files, {f.total_bytes / 1e6:,.0f} MB"
                                for f in sets.values()))
    print(f"each cell: median of {repeats} fresh mounts (backing files read, {BACKED_SLACK >> 20} MiB + twice the "
          "files' bytes of memory touched just before each: a virtual machine may give idle memory back to its host); "
          "spread = "
          "(max - min) / median of epoch-1 files/s; e1/RAM = epoch-1 files/s as a share of ram-fuse's; "
          f"others = cores other processes used during the timing ('!' above {NOISY_OTHERS})")
    for note in notes:
        print(f"note: {note}")
    print()
    print_table(["files", "readers", "placement", "system", "epoch 1 files/s", "MB/s", "spread", "epoch 2 files/s",
                 "MB/s", "e1/RAM", "others"], main_rows(sets, cells), left=4)
    print()
    print("kernel-cache levers, one taken away at a time: 1 reader, taskset -c 0, files/s (median of "
          f"{repeats}); requests = what ram_fs.py answered per file (libfuse itself answers the ioctl that "
          "Python's open() sends, not counted; nor those under 0.01 per file, made at mount)")
    print_table(["files", "lever taken away", "system", "epoch 1", "epoch 2", "others", "requests/file epoch 1",
                 "requests/file epoch 2"], lever_rows(sets, levers), left=3)
    print()
    print("ENOSYS open:")
    for line in finding:
        print(f"  {line}")
    print()
    print("targets (fanstore; medians)")
    for line in target_lines(cells):
        print(f"  {line}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"1/{QUICK_DIVISOR} of the files, one repeat")
    parser.add_argument("--repeats", type=int, help=f"fresh mounts per cell (default {REPEATS}, --quick 1)")
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache", help="where inputs are made once")
    parser.add_argument("--only", help="comma-separated systems to run (development)")
    parser.add_argument("--no-levers", action="store_true", help="skip the levers table (development)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else REPEATS)
    missing = [t for t in ("mksquashfs", "squashfuse", "fusermount3", "taskset", "tar") if shutil.which(t) is None]
    missing += [] if os.path.exists("/dev/fuse") else ["/dev/fuse"]
    if missing:
        raise SystemExit(f"bench_read: missing {', '.join(missing)}; it installs nothing (Debian: apt-get install -y "
                         "fuse3 squashfs-tools squashfuse util-linux tar)")
    notes = []
    systems = ["plain", "api", "fanstore", "ram-fuse", "squashfuse", "ratarmount"]
    if ratarmount_command() is None:
        systems.remove("ratarmount")
        notes.append("ratarmount not installed (pip install ratarmount): its rows and target are missing")
    if args.only:
        systems = [s for s in systems if s in args.only.split(",")]
    divisor = QUICK_DIVISOR if args.quick else 1
    args.cache.mkdir(parents=True, exist_ok=True)
    sets = {label: build_file_set(args.cache.resolve(), label, size, max(MIN_FILES, count // divisor))
            for label, (size, count) in SIZES.items()}
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="bench-read-") as tmp:
        workdir = Path(tmp)
        for files in sets.values():
            for readers in READERS:
                for placement in (PINNED, UNPINNED):
                    for system in systems:
                        print(f"[{files.label}, {readers} reader(s), {placement.label}] {system} ...",
                              file=sys.stderr, flush=True)
                        cells.append(measure(Cell(files.label, readers, placement.label, system), files, placement,
                                             workdir, repeats))
        levers = {} if args.no_levers else {label: measure_levers(files, workdir, repeats)
                                            for label, files in sets.items()}
        finding = enosys_open_finding(sets["128 KiB"], workdir)
    print_report(sets, cells, levers, finding, repeats, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
