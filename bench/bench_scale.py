"""bench_scale: what does each part of fanstore cost at 10^5, 10^6 and 10^7 files, packed from a tar?

For each size, a generated tar of tiny files (written as a tar so that no file system holds ten million inodes),
packed by the real CLI (`fanstore pack TAR DEST`), then, each in fresh processes:

  pack s, CPU us/file  `fanstore pack TAR DEST` (codec zstd:3, default workers): wall, and CPU of the pack and
                       its workers per file; max RSS of its largest process
  index B/file         size of DEST/fanstore.index / files
  open s               open_dataset in a fresh process: the first on this node (full check), a later one (median)
  lookup us            CPU per Index.lookup of a random path (bench_index's, median of --repeats rounds)
  N workers MiB        private memory (Private_Clean + Private_Dirty) of each worker of a DataLoader of N workers
                       over FileDataset after its first item (bench_index's): the largest worker and all together;
                       the floor: the largest of 2 workers of a Dataset of N ints (Python and torch alone)
  serve rank MiB       private memory of the rank of `mpiexec -n 1 fanstore serve DEST` once it is ready; anon:
                       the part no file backs (its map of the index, which the node's readers share, left out)
  plan s               `fanstore plan DEST --nodes 4096`: wall and CPU
  ls, find             through `fanstore mount DEST MNT` (mounted afresh): `ls -1` of the 100,000-entry directory
                       and `find MNT -type f`, wall and CPU us per entry of the command and of the mount's daemon;
                       beside them the same commands on the tar extracted into a plain directory, at the sizes up
                       to --plain-max only (more files than that make an extraction no cheap baseline)

Each figure is printed beside the same figure at the smallest size, as a ratio: the growth is the baseline.
Layout of the tar: d00000/ holds the first --big-dir files (the `ls` directory), the rest are 1,000 a directory,
`dNNNNN/fNNNNNNNN.bin`, each file the same 10 bytes, members in path order.

Usage: python bench/bench_scale.py [--quick] [--sizes 100000,1000000] [--cache DIR] [--json FILE]
CPU placement: every process runs on the CPUs this one may use (printed), unpinned.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))  # measure this checkout, not some installed fanstore

from bench_index import _measure, private_bytes  # noqa: E402
from bench_serve import mpiexec_command, serve_requirements_missing  # noqa: E402
from machine_load import OtherLoad, cpu_ns, machine_lines  # noqa: E402

from fanstore.core.format import INDEX_NAME  # noqa: E402
from fanstore.mount.mount import MountError, fuse_mounted_at, unmount  # noqa: E402

MIB = 1 << 20
CONTENT = b"0123456789"
MTIME = 1_700_000_000
FILES_PER_DIR = 1000
FULL_SIZES, QUICK_SIZES = (10**5, 10**6, 10**7), (10**5, 10**6)
TAR_VERSION = "bench_scale tar v1"  # written beside a finished tar; a tar without it is written again
FANSTORE = [sys.executable, "-m", "fanstore"]
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO)}
READY_TIMEOUT = 1800.0


class BenchError(Exception):
    """A measured command failed: its figures say so instead of the run ending."""


# --- the tar ------------------------------------------------------------------------------------------------


def directory_of(numbers: np.ndarray, big_dir: int) -> np.ndarray:
    """The directory number of each file: 0 for the first `big_dir` files, then FILES_PER_DIR a directory."""
    return np.where(numbers < big_dir, 0, 1 + (numbers - big_dir) // FILES_PER_DIR)


def member_path(number: int, big_dir: int) -> str:
    return f"d{int(directory_of(np.array([number]), big_dir)[0]):05d}/f{number:08d}.bin"


def _digits(numbers: np.ndarray, width: int, base: int = 10) -> np.ndarray:
    """Each number as `width` ASCII digits in `base`, one row per number."""
    powers = base ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((numbers[:, None] // powers) % base + ord("0")).astype(np.uint8)


def _header_template() -> np.ndarray:
    """A member's 512-byte ustar header and its data block, the parts that vary (name, checksum) blank."""
    block = bytearray(1024)
    for offset, field in ((100, b"0000644\0"), (108, b"0000000\0"), (116, b"0000000\0"),
                          (124, b"%011o\0" % len(CONTENT)), (136, b"%011o\0" % MTIME), (148, b" " * 8),
                          (156, b"0"), (257, b"ustar\x0000"), (512, CONTENT)):
        block[offset:offset + len(field)] = field
    block[0:20] = b"d00000/f00000000.bin"
    return np.frombuffer(bytes(block), np.uint8)


def write_tar(path: Path, files: int, big_dir: int, batch: int = 1 << 16) -> None:
    """A ustar archive of `files` members, byte for byte what tarfile writes (but the end's padding), written by
    rows of numpy arrays: 100,000 members in 0.56 s where tarfile takes 2.4 s (24 us a member, 4 minutes at 10^7).
    Each member is a header, its name and checksum filled in, and one data block."""
    template = _header_template()
    fixed_sum = int(template[:512].sum()) - int(template[1:6].sum()) - int(template[8:16].sum())
    with open(path, "wb") as tar:
        for start in range(0, files, batch):
            numbers = np.arange(start, min(start + batch, files), dtype=np.int64)
            rows = np.tile(template, (len(numbers), 1))
            rows[:, 1:6] = _digits(directory_of(numbers, big_dir), 5)
            rows[:, 8:16] = _digits(numbers, 8)
            checksum = fixed_sum + rows[:, 1:6].sum(1, dtype=np.int64) + rows[:, 8:16].sum(1, dtype=np.int64)
            rows[:, 148:154] = _digits(checksum, 6, 8)
            rows[:, 154] = 0
            tar.write(rows.tobytes())
        tar.write(bytes(1024))  # the end: two zero blocks


def ensure_tar(cache: Path, files: int, big_dir: int) -> tuple[Path, str]:
    """The tar of `files` members in the cache, written once; and a note of how long it took (or 'cached')."""
    tar, marker = cache / f"files-{files}-big-{big_dir}.tar", cache / f"files-{files}-big-{big_dir}.tar.done"
    version = f"{TAR_VERSION} {files} {big_dir}"
    if tar.exists() and marker.exists() and marker.read_text().strip() == version:
        return tar, "cached"
    marker.unlink(missing_ok=True)
    started = time.perf_counter()
    write_tar(tar, files, big_dir)
    marker.write_text(version + "\n")
    return tar, f"written in {time.perf_counter() - started:.1f} s ({tar.stat().st_size / 2**30:.2f} GiB)"


# --- running and measuring commands -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_seconds: float  # the command and every descendant it waited for
    max_rss: int  # of its largest process
    lines: int  # of its standard output


def run_command(argv: list[str | Path], watched: int | None = None) -> tuple[Run, float]:
    """Run a command that must succeed, counting its output's lines as they stream (never held: `find` of 10^7
    files prints 300 MB); its own resource use from wait4, and the CPU seconds process `watched` used meanwhile.
    Interrupted, the command is killed before this returns."""
    watched_before = cpu_ns(watched) if watched else 0
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([str(part) for part in argv], stdout=subprocess.PIPE, stderr=errors, env=CHILD_ENV)
        try:
            lines = sum(block.count(b"\n") for block in iter(lambda: proc.stdout.read(1 << 20), b""))  # type: ignore
            _pid, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.stdout.close()  # type: ignore[union-attr]
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        watched_cpu = (cpu_ns(watched) - watched_before) / 1e9 if watched else 0.0
        if proc.returncode:
            errors.seek(0)
            last = (errors.read().decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            raise BenchError(f"{' '.join(map(str, argv[:3]))} exited {proc.returncode}: {last}")
    return Run(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, lines), watched_cpu


def wait_for(condition: Callable[[], bool], what: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise BenchError(f"{what}: the process ended first (status {proc.returncode})")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


@contextmanager
def in_session(argv: list[str | Path], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session (a Ctrl-C meant for the bench never reaches it half-way), its output into
    `log_path`; killed at the end with everything it started, if still running."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(part) for part in argv], stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV,
                                start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def unmount_if_mounted(mountpoint: Path) -> None:
    """Clean-up's unmount: a serve rank (or its watchdog) ending at the same moment may unmount it first, and then
    fusermount fails on a mount that is gone, which is no failure here."""
    if fuse_mounted_at(mountpoint):
        try:
            unmount(mountpoint)
        except MountError:
            if fuse_mounted_at(mountpoint):
                raise


# --- the figures --------------------------------------------------------------------------------------------

Figures = dict[str, object]  # name -> number, or a string saying why there is none


def pack_figures(cache: Path, tar: Path, files: int, big_dir: int) -> tuple[Path, Figures]:
    """Pack the tar into the cache (once: a later run takes the dataset and the figures measured then)."""
    dest = cache / f"files-{files}-big-{big_dir}.fanstore"
    record = cache / f"files-{files}-big-{big_dir}.pack.json"
    if record.exists() and (dest / INDEX_NAME).exists():
        return dest, {**json.loads(record.read_text()), "pack cached": True}
    record.unlink(missing_ok=True)
    run, _ = run_command([*FANSTORE, "pack", tar, dest, "--quiet", "--force"])
    figures: Figures = {"pack s": run.seconds, "pack CPU us/file": run.cpu_seconds / files * 1e6,
                        "pack max RSS MiB": run.max_rss / MIB}
    record.write_text(json.dumps(figures))
    return dest, {**figures, "pack cached": False}


def index_figures(dest: Path, files: int, repeats: int) -> Figures:
    """Open and lookup, each in fresh processes, by bench_index's children."""
    forget_check(dest)
    first = _measure(REPO, "open", dest, 1)
    later = [_measure(REPO, "open", dest, 1) for _ in range(repeats)]
    lookup = _measure(REPO, "lookup", dest, repeats)
    return {"open 1st s": first,
            "open s": _median(later),
            "lookup us": lookup if isinstance(lookup, str) else statistics.median(lookup),  # type: ignore[arg-type]
            "index B/file": (dest / INDEX_NAME).stat().st_size / files}


def forget_check(dest: Path) -> None:
    """Remove the stamp that says this node checked DEST's index in full (index_trust.py names it after the
    file's identity), so that the next open is a first one; other datasets' stamps stay."""
    info = (dest / INDEX_NAME).stat()
    identity = f"-{info.st_dev:x}-{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}-{info.st_ctime_ns:x}"
    for folder in {Path("/dev/shm"), Path(tempfile.gettempdir())}:
        for stamp in folder.glob(f"fanstore-checked-{os.getuid()}/*{identity}"):
            stamp.unlink(missing_ok=True)


def _median(values: list[object]) -> object:
    failed = [value for value in values if isinstance(value, str)]
    return failed[0] if failed else statistics.median(values)  # type: ignore[type-var]


def worker_figures(dest: Path, contexts: list[str], loader_workers: list[int]) -> Figures:
    """Private memory of each worker of a DataLoader (bench_index's), the largest and their sum; and the floor:
    a worker of a Dataset of N ints (bench_index's `trivial`: its Python and torch, no fanstore)."""
    figures: Figures = {}
    for context in contexts:
        floor = _measure(REPO, f"worker:{context}:trivial", dest, 1)
        figures[f"{context} worker floor MiB"] = floor if isinstance(floor, str) else floor / MIB  # type: ignore
        for workers in loader_workers:
            each = _measure(REPO, f"workers:{context}:{workers}", dest, 1)
            name = f"{workers} {context} worker{'s' if workers > 1 else ''}"
            if isinstance(each, str):
                figures[f"{name}: largest MiB"] = figures[f"{name}: all MiB"] = each
                continue
            figures[f"{name}: largest MiB"] = max(each) / MIB  # type: ignore[arg-type]
            if workers > 1:
                figures[f"{name}: all MiB"] = sum(each) / MIB  # type: ignore[arg-type]
    return figures


def serve_figures(dest: Path, work: Path) -> Figures:
    """`mpiexec -n 1 fanstore serve DEST` until it is ready: the time that took (staging, the mount) and the
    rank's private memory then; SIGTERM ends it, and whatever is left is killed and unmounted."""
    mountpoint, local, ready = work / "serve-mnt", work / "serve-local", work / "serve.ready"
    mountpoint.mkdir()
    try:
        started = time.perf_counter()
        with in_session([mpiexec_command(), "-n", "1", *FANSTORE, "serve", dest, mountpoint, "--local-dir", local,
                         "--quiet", "--ready-file", ready], work / "serve.log") as proc:
            wait_for(ready.exists, "fanstore serve ready", READY_TIMEOUT, proc)
            ready_s = time.perf_counter() - started
            rank = int(ready.read_text().split()[1])  # written whole (atomically): the mount point, the pid
            private, anonymous = private_bytes(rank), private_bytes(rank, ("Anonymous",))
            os.kill(rank, signal.SIGTERM)
            proc.wait(timeout=120)
        if proc.returncode:
            raise BenchError(f"fanstore serve exited {proc.returncode}: {_last_line(work / 'serve.log')}")
        return {"serve ready s": ready_s, "serve rank MiB": private / MIB, "serve rank anon MiB": anonymous / MIB}
    finally:
        unmount_if_mounted(mountpoint)
        shutil.rmtree(local, ignore_errors=True)
        mountpoint.rmdir()


def _last_line(path: Path) -> str:
    return (path.read_text(errors="replace").strip().splitlines() or ["no message"])[-1]


def plan_figures(dest: Path) -> Figures:
    run, _ = run_command([*FANSTORE, "plan", dest, "--nodes", "4096"])
    return {"plan 4096 s": run.seconds, "plan 4096 CPU s": run.cpu_seconds}


def listing_figures(root: Path, files: int, big_dir: int, daemon: int | None, prefix: str) -> Figures:
    """`ls -1` of the big directory and `find -type f` of everything under root: wall, CPU us per entry of the
    command and (through a mount) of its daemon, and the counts they printed."""
    figures: Figures = {}
    for name, argv, entries in (("ls", ["ls", "-1", root / "d00000"], min(files, big_dir)),
                                ("find", ["find", root, "-type", "f"], files)):
        run, daemon_cpu = run_command(argv, daemon)  # type: ignore[arg-type]
        figures[f"{prefix} {name} s"] = run.seconds
        figures[f"{prefix} {name} CPU us/entry"] = run.cpu_seconds / entries * 1e6
        if daemon:
            figures[f"{prefix} {name} daemon CPU us/entry"] = daemon_cpu / entries * 1e6
        figures[f"{prefix} {name} count"] = run.lines
    return figures


def mount_figures(dest: Path, files: int, big_dir: int, work: Path) -> Figures:
    """ls and find through a fresh `fanstore mount --foreground` (so this process knows the daemon's pid),
    always unmounted at the end."""
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    try:
        started = time.perf_counter()
        with in_session([*FANSTORE, "mount", dest, mountpoint, "--foreground", "--log", work / "daemon.log"],
                        work / "mount.log") as proc:
            wait_for(lambda: fuse_mounted_at(mountpoint), "fanstore mount", READY_TIMEOUT, proc)
            figures: Figures = {"mount s": time.perf_counter() - started}
            figures |= listing_figures(mountpoint, files, big_dir, proc.pid, "mount")
            unmount(mountpoint)
            proc.wait(timeout=60)
        return figures
    finally:
        unmount_if_mounted(mountpoint)
        mountpoint.rmdir()


def plain_figures(cache: Path, tar: Path, files: int, big_dir: int) -> Figures:
    """The same ls and find on the tar extracted into a plain directory (once, into the cache; warm: the page
    and dentry caches are not dropped, which would disturb the machine's other work)."""
    root, marker = cache / f"{tar.stem}.plain", cache / f"{tar.stem}.plain.done"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        run_command(["tar", "-xf", tar, "-C", root])
        marker.write_text("extracted\n")
    return listing_figures(root, files, big_dir, None, "plain")


# --- the table ----------------------------------------------------------------------------------------------

# (figure, digits): the order of the table's rows
ROWS = (("pack s", 1), ("pack CPU us/file", 1), ("pack max RSS MiB", 0), ("index B/file", 1), ("open 1st s", 3),
        ("open s", 3), ("lookup us", 2))
LATE_ROWS = (("serve ready s", 1), ("serve rank MiB", 1), ("serve rank anon MiB", 1), ("plan 4096 s", 2),
             ("plan 4096 CPU s", 2), ("mount s", 2))
LISTING = ("s", "CPU us/entry", "daemon CPU us/entry", "count")


def table_rows(contexts: list[str], loader_workers: list[int]) -> list[tuple[str, int]]:
    rows = list(ROWS)
    for context in contexts:
        rows.append((f"{context} worker floor MiB", 1))
        for workers in loader_workers:
            name = f"{workers} {context} worker{'s' if workers > 1 else ''}"
            rows.append((f"{name}: largest MiB", 1))
            if workers > 1:
                rows.append((f"{name}: all MiB", 1))
    rows += LATE_ROWS
    for where in ("mount", "plain"):
        for command in ("ls", "find"):
            for what in LISTING:
                if where == "plain" and what.startswith("daemon"):
                    continue
                rows.append((f"{where} {command} {what}", 0 if what == "count" else 2))
    return rows + [("others' cores: pack", 2), ("others' cores: the rest", 2)]


def cell(value: object, base: object, digits: int) -> str:
    """A figure, and beside it its ratio to the same figure at the smallest size."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    text = f"{value:,.{digits}f}"
    if isinstance(base, (int, float)) and base is not value and base:
        text += f" ({value / base:.1f}x)"
    return text


def print_table(sizes: list[int], results: dict[int, Figures], rows: list[tuple[str, int]]) -> None:
    width = max(len(name) for name, _ in rows) + 2
    columns = [max(24, len(f"{size:,} files")) for size in sizes]
    print("".ljust(width) + "".join(f"{size:,} files".rjust(column) for size, column in zip(sizes, columns)))
    first = results.get(sizes[0], {})
    for name, digits in rows:
        if not any(name in results.get(size, {}) for size in sizes):
            continue
        print(name.ljust(width) + "".join(
            cell(results.get(size, {}).get(name), first.get(name), digits).rjust(column)
            for size, column in zip(sizes, columns)))


# --- the run ------------------------------------------------------------------------------------------------


def measure_size(files: int, args: argparse.Namespace, cache: Path, work: Path) -> Figures:
    """Every figure of one size; a step that fails leaves its figures out and says why."""
    tar, tar_note = ensure_tar(cache, files, args.big_dir)
    print(f"  {files:,} files: tar {tar} {tar_note}", flush=True)
    figures: Figures = {"files": files}
    with OtherLoad(interval=1.0) as others:
        started = time.perf_counter()
        try:
            dest, packed = pack_figures(cache, tar, files, args.big_dir)
        except BenchError as error:
            print(f"  {files:,} files: pack failed: {error}", flush=True)
            return {**figures, "pack failed": str(error)}
    figures |= packed
    if not packed["pack cached"]:
        figures["others' cores: pack"] = others.cpu_seconds / (time.perf_counter() - started)
    print(f"  {files:,} files: packed {dest}" + (" (cached: its pack figures are the packing run's)"
                                                 if packed["pack cached"] else ""), flush=True)
    steps: list[tuple[str, Callable[[], Figures]]] = [
        ("index", lambda: index_figures(dest, files, args.repeats)),
        ("workers", lambda: worker_figures(dest, args.contexts, args.loader_workers)),
        ("serve", lambda: serve_figures(dest, work)),
        ("plan", lambda: plan_figures(dest)),
        ("mount", lambda: mount_figures(dest, files, args.big_dir, work)),
    ]
    if files <= args.plain_max:
        steps.append(("plain", lambda: plain_figures(cache, tar, files, args.big_dir)))
    with OtherLoad(interval=1.0) as others:
        started = time.perf_counter()
        for step, measure in steps:
            step_started = time.perf_counter()
            try:
                figures |= measure()
            except BenchError as error:
                print(f"  {files:,} files: {step} failed: {error}", flush=True)
                figures[f"{step} failed"] = str(error)
            print(f"  {files:,} files: {step} measured in {time.perf_counter() - step_started:.1f} s", flush=True)
    figures["others' cores: the rest"] = others.cpu_seconds / (time.perf_counter() - started)
    return figures


def missing_requirements() -> list[str]:
    """What this machine lacks for the bench (FUSE, mpiexec, the tools it times), by name."""
    return serve_requirements_missing() + [f"{tool} (coreutils, findutils, tar)" for tool in ("ls", "find", "tar")
                                           if shutil.which(tool) is None]


def parse_sizes(text: str) -> list[int]:
    sizes = [int(part.replace("_", "")) for part in text.split(",") if part]
    if not sizes or min(sizes) < 1 or max(sizes) >= 10**8:
        raise argparse.ArgumentTypeError(f"--sizes {text}: give file counts from 1 to 99,999,999 (the names' "
                                         "digits), separated by commas")
    return sorted(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10^5 and 10^6 files only")
    parser.add_argument("--sizes", type=parse_sizes, help="file counts, e.g. 100000,1000000 (default 10^5..10^7)")
    parser.add_argument("--big-dir", type=int, default=100_000, help="files in d00000/, the ls directory")
    parser.add_argument("--loader-workers", type=lambda text: [int(n) for n in text.split(",")], default=[1, 8],
                        help="DataLoader worker counts whose private memory is measured (default 1,8)")
    parser.add_argument("--contexts", type=lambda text: text.split(","), default=["spawn", "fork"],
                        help="DataLoader multiprocessing contexts (default spawn,fork)")
    parser.add_argument("--plain-max", type=int, default=100_000,
                        help="extract the tar for the plain-directory ls/find at sizes up to this (default 100000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, help="keep the tars, packs and extractions here (default: a "
                                                   "temporary directory, removed at the end)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sizes = args.sizes or list(QUICK_SIZES if args.quick else FULL_SIZES)
    if missing := missing_requirements():
        raise SystemExit("bench_scale: cannot run: " + "; ".join(missing))

    # SIGTERM ends the run as Ctrl-C does, through every finally: nothing stays mounted, running or written
    # (SIGINT too when a shell started the bench in the background, which ignores it).
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        run(args, sizes)
    except KeyboardInterrupt:
        raise SystemExit("bench_scale: interrupted; nothing is left mounted or running") from None


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace, sizes: list[int]) -> None:
    cache = args.cache.resolve() if args.cache else Path(tempfile.mkdtemp(prefix="bench_scale-cache-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        for line in machine_lines():
            print(line)
        print(f"bench_scale: sizes {', '.join(f'{size:,}' for size in sizes)}; ls directory of "
              f"{args.big_dir:,} entries; every process unpinned on CPUs {sorted(os.sched_getaffinity(0))}; "
              f"cache {cache}", flush=True)
        results: dict[int, Figures] = {}
        for files in sizes:
            work = Path(tempfile.mkdtemp(prefix=f"bench_scale-{files}-"))
            try:
                results[files] = measure_size(files, args, cache, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print_table(sizes, results, table_rows(args.contexts, args.loader_workers))
        print(notes(sizes, results, args))
        if args.json:
            args.json.write_text(json.dumps({"machine": machine_lines(), "sizes": sizes, "big_dir": args.big_dir,
                                             "results": {str(size): figures for size, figures in results.items()}},
                                            indent=1))
    finally:
        if not args.cache:
            shutil.rmtree(cache, ignore_errors=True)


def notes(sizes: list[int], results: dict[int, Figures], args: argparse.Namespace) -> str:
    lines = ["(Nx): the figure over the same figure at the smallest size.",
             (f"plain ls/find: the tar extracted into a directory, only up to {args.plain_max:,} files (beyond, an "
              "extraction is no cheap baseline: one inode per file); its caches warm, the mount's kernel caches "
              "cold."),
             "others' cores: CPU other processes of this machine used meanwhile, in cores (a lower bound)."]
    if any(results[size].get("pack cached") for size in results):
        lines.append("pack figures of a cached dataset are those measured by the run that packed it.")
    for size in sizes:
        for name, value in results.get(size, {}).items():
            if name.endswith("failed"):
                lines.append(f"{size:,} files: {name}: {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
