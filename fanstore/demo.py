"""`fanstore demo`: the whole job on a built-in dataset: build it, pack it, read every file back and check it,
through the Python API and through a real mount, run an unchanged training loop on the mount, train a small CNN
with PyTorch (when it is installed) from the original directory, through fanstore.torch and through the mount, and
show what the pack saved and how fast each way reads beside the plain directory."""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

from .api import open_dataset
from .demo_data import build_demo_tree
from .demo_training import train_and_evaluate
from .pack import PackOptions, pack
from .units import format_bytes

DEMO_CODEC = "zstd-dict:9"
DEMO_REPLICATE = ("val/**",)
_READ_ROUNDS = 3
# Where torch is missing, the demo says how to get it: the CPU build, which scripts/setup installs (torch==2.13.0+cpu).
TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def run_demo(workdir: str | os.PathLike[str] | None = None, scale: int = 1, mount: bool = True) -> int:
    """Returns the exit status: 0 when every file read back equals its original."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return _demo_in(Path(workdir), scale, mount)
    with tempfile.TemporaryDirectory(prefix="fanstore-demo-") as tmp:
        return _demo_in(Path(tmp), scale, mount)


def _demo_in(workdir: Path, scale: int, mount: bool) -> int:
    source, dataset = workdir / "source", workdir / "dataset"
    print(f"building the demo training set in {source} ...")
    tree = build_demo_tree(source, scale=scale)
    print(f"  {tree.files:,} files, {format_bytes(tree.bytes)}: digit PNGs and photo crops in train/ and val/, "
          "float32 fields in science/, labels.txt")
    print(f"packing with --codec {DEMO_CODEC} --replicate {' '.join(DEMO_REPLICATE)} ...")
    summary = pack(source, dataset, PackOptions(codec=DEMO_CODEC, replicate=DEMO_REPLICATE, force=True))
    print(f"  {summary.files:,} files, {format_bytes(summary.raw_bytes)} -> {format_bytes(summary.stored_bytes)} "
          f"(ratio {summary.ratio:.2f}x) in {summary.chunks} chunks, {summary.seconds:.1f} s")

    with open_dataset(dataset) as ds:
        paths = sorted(ds.files())
        expected = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file() and not p.is_symlink())
        bad = _compare(paths, expected, ds.read, source)
        print(f"read back {len(paths):,} files through the API: {len(bad)} differ from the original or are missing")
        api_seconds = _best_time(lambda: [ds.read(p) for p in paths])
    plain_seconds = _best_time(lambda: [(source / p).read_bytes() for p in paths])
    rows = [("plain directory (warm)", plain_seconds), ("fanstore API (decompress)", api_seconds)]

    train_with_torch = partial(_demo_torch, source, dataset)
    if mount:
        mount_rows, mount_bad = _demo_mount(dataset, workdir / "mnt", source, paths, expected, train_with_torch)
        rows += mount_rows
        bad += mount_bad
        bad += _demo_serve(dataset, workdir / "serve", source)
    else:
        bad += train_with_torch(None)

    total = summary.raw_bytes
    print()
    print(f"{'reader':<42}{'files/s':>12}{'MB/s':>10}")
    for name, seconds in rows:
        print(f"{name:<42}{len(paths) / seconds:>12,.0f}{total / 1e6 / seconds:>10,.1f}")
    print(f"\nstored {format_bytes(summary.stored_bytes)} instead of {format_bytes(total)}: "
          f"{summary.ratio:.2f}x more data fits in the same node-local storage")
    for path in bad[:10]:
        print(f"  MISMATCH {path}")
    print("demo OK: every file matches its original" if not bad else "demo FAILED: see the mismatches above")
    return 0 if not bad else 1


def _demo_mount(
    dataset: Path, mountpoint: Path, source: Path, paths: list[str], expected: list[str],
    while_mounted: Callable[[Path | None], list[str]],
) -> tuple[list[tuple[str, float]], list[str]]:
    """Mount the dataset, check every file through it, time two epochs, and train on it as on the original;
    `while_mounted(mountpoint)` runs before the unmount, or `while_mounted(None)` if there is no mount."""
    from .mount import fuse_unavailable_reason, mount_background, resolve_mountpoint, unmount, wait_for_exit

    reason = fuse_unavailable_reason()
    if reason is not None:
        print(f"skipping the mount: {reason}")
        return [], while_mounted(None)
    mountpoint.mkdir(exist_ok=True)
    mountpoint = resolve_mountpoint(mountpoint)  # as the CLI does: mountinfo, which unmount reads, lists it so
    log = mountpoint.parent / "mount.log"
    print(f"\nmounting: fanstore mount {dataset} {mountpoint}")
    pid = mount_background(dataset, mountpoint, ["mount", str(dataset), str(mountpoint), "--log", str(log)], log)
    try:
        started = time.perf_counter()
        first_reads = {p: (mountpoint / p).read_bytes() for p in paths}
        first_epoch = time.perf_counter() - started
        bad = _compare(paths, expected, first_reads.__getitem__, source)
        print(f"read back {len(paths):,} files through the mount: {len(bad)} differ from the original or are missing")
        second_epoch = _best_time(lambda: [(mountpoint / p).read_bytes() for p in paths])

        print("\nthe same training loop (open and read under a path; see fanstore/demo_training.py), two directories:")
        for name, root in (("original directory", source), ("fanstore mount", mountpoint)):
            started = time.perf_counter()
            result = train_and_evaluate(root)
            print(f"  {name:<20} {result.train_images:,} train + {result.val_images:,} val images, "
                  f"accuracy {result.accuracy:.1%}, model {result.centroid_digest}, "
                  f"{time.perf_counter() - started:.2f} s")
        bad += while_mounted(mountpoint)
    finally:
        unmount(mountpoint)
        wait_for_exit(pid)  # the daemon leaves once the kernel lets go; then the work directory can go
    rows = [("fanstore mount, 1st epoch (decode)", first_epoch),
            ("fanstore mount, 2nd epoch (kernel cache)", second_epoch)]
    return rows, bad


def _demo_torch(source: Path, dataset: Path, mountpoint: Path | None) -> list[str]:
    """Train the same small CNN, same seed, from the original directory, through fanstore.torch and through the
    mount (if any). Every reader must give the same accuracy and weights; returns a mismatch line if not."""
    try:  # the only module of the demo that imports torch
        from .demo_torch import TrainingSettings, table_header, table_row, train_three_ways
    except ModuleNotFoundError as missing:
        if missing.name != "torch":
            raise
        print(f"\nskipping the PyTorch run: torch is not installed; for the CPU build: {TORCH_INSTALL}")
        return []

    settings = TrainingSettings()
    print(f"\nPyTorch: a 2-layer CNN, seed {settings.seed}, {settings.epochs} epochs of batches of "
          f"{settings.batch_size}, num_workers={settings.num_workers}, {len(os.sched_getaffinity(0))} cores; "
          "the same run from each reader "
          "(fanstore/demo_torch.py).\n"
          "s (wait): an epoch's seconds, and those the loop spent waiting in next(loader). The original and the "
          "mount\nare read from the page cache; fanstore.torch decodes every file in every epoch.")
    print(table_header(settings))
    results = []
    for result in train_three_ways(source, dataset, mountpoint, settings):
        print(table_row(result), flush=True)
        results.append(result)
    if len({(result.accuracy, result.weights_digest) for result in results}) > 1:
        print("the readers gave different models")
        return ["PyTorch run: the readers gave different accuracies or weights"]
    print("same accuracy and weights from every reader")
    return []


# What each rank of the demo job runs on its mount: every original file compared with what the mount gives.
_RANK_CHECK = """
import os, sys
source, mount, rank = sys.argv[1], os.environ["FANSTORE_MOUNT"], os.environ["FANSTORE_RANK"]
files = [os.path.relpath(os.path.join(d, f), source) for d, _, fs in os.walk(source) for f in fs]
differ = []
for path in files:
    with open(os.path.join(source, path), "rb") as original, open(os.path.join(mount, path), "rb") as served:
        if original.read() != served.read():
            differ.append(path)
print(f"  rank {rank} of {os.environ['FANSTORE_SIZE']}: read {len(files)} files at {mount}, {len(differ)} differ",
      flush=True)
sys.exit(1 if differ else 0)
"""


def _demo_serve(dataset: Path, workdir: Path, source: Path) -> list[str]:
    """Serve the dataset with two ranks on this machine, as on two nodes: each stages its share, mounts the whole
    dataset and checks every file through it; the job's counters show what came from where."""
    import importlib.util
    import shutil
    import subprocess
    import sys

    from .mount import fuse_unavailable_reason

    mpiexec = Path(sys.executable).with_name("mpiexec")
    mpiexec_path = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if importlib.util.find_spec("mpi4py") is None:  # found, not imported: the ranks import it, this process not
        reason = "mpi4py is not installed (pip install 'fanstore[mpi]' mpich)"
    else:
        reason = fuse_unavailable_reason() or (None if mpiexec_path else "no mpiexec on PATH")
    if reason is not None:
        print(f"\nskipping fanstore serve: {reason}")
        return []
    for rank in range(2):
        (workdir / f"mnt{rank}").mkdir(parents=True, exist_ok=True)
    command = [mpiexec_path, "-n", "2", sys.executable, "-m", "fanstore", "serve", str(dataset),
               str(workdir / "mnt{rank}"), "--local-dir", str(workdir / "local{rank}"), "--stats", "--quiet",
               "--", sys.executable, "-c", _RANK_CHECK, str(source)]
    print(f"\nserving on 2 ranks, as on 2 nodes: mpiexec -n 2 fanstore serve {dataset} {workdir}/mnt{{rank}} "
          f"--local-dir {workdir}/local{{rank}} --stats -- CHECK")
    done = subprocess.run(command, capture_output=True, text=True)
    checks = sorted(line for line in done.stdout.splitlines() if line.startswith("  rank "))
    counters = [line for line in done.stdout.splitlines() if not line.startswith("  rank ")]
    print("\n".join(checks + [f"  {line}" for line in counters]))
    if done.returncode != 0:
        print(done.stderr.strip())
        return [f"fanstore serve (exit status {done.returncode})"]
    return []


def _compare(paths: list[str], expected: list[str], read: Callable[[str], bytes], source: Path) -> list[str]:
    """Paths whose bytes differ from the original, then originals the dataset lacks."""
    differ = [p for p in paths if read(p) != (source / p).read_bytes()]
    return differ + sorted(set(expected) - set(paths))


def _best_time(read_all: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(_READ_ROUNDS):
        started = time.perf_counter()
        read_all()
        best = min(best, time.perf_counter() - started)
    return best
