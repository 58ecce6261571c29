"""`fanstore demo`: the whole job on a built-in dataset: build it, pack it, read every file back and check it,
through the Python API and through a real mount, run an unchanged training loop on the mount, train a small CNN
with PyTorch (when it is installed) from the original directory, through fanstore.torch and through the mount, and
show what the pack saved and how fast each way reads beside the plain directory."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from ..core.api import Dataset, open_dataset
from .demo_data import build_demo_tree
from .demo_training import train_and_evaluate
from ..pack.options import PackOptions
from ..pack.packer import pack
from ..core.units import format_bytes, plural
from ..errors import UsageError, quoted

DEMO_CODEC = "zstd-dict:9"
DEMO_REPLICATE = ("val/**",)
_READ_ROUNDS = 3
# Where torch is missing, the demo says how to get it: the CPU build, which scripts/setup installs (torch==2.13.0+cpu).
TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def run_demo(workdir: str | os.PathLike[str] | None = None, scale: int = 1, mount: bool = True) -> int:
    """Returns the exit status: 0 when every file read back equals its original."""
    if workdir is not None:
        try:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there or on the way, no room, no permission
            raise UsageError(f"--workdir {quoted(os.fspath(workdir))}: cannot be made a directory: {exc.strerror}") \
                from None
        return _demo_in(Path(workdir), scale, mount)
    with tempfile.TemporaryDirectory(prefix="fanstore-demo-") as tmp:
        return _demo_in(Path(tmp), scale, mount)


def _demo_in(workdir: Path, scale: int, mount: bool) -> int:
    source, dataset = workdir / "source", workdir / "dataset"
    print(f"building the demo training set in {source} ...")
    tree = build_demo_tree(source, scale=scale)
    parts = _TreeParts.of(source)
    print(f"  {plural(tree.files, 'file')}, {format_bytes(tree.bytes)}: {parts.describe()}")
    print(f"packing with --codec {DEMO_CODEC} --replicate {' '.join(DEMO_REPLICATE)} ...")
    summary = pack(source, dataset, PackOptions(codec=DEMO_CODEC, replicate=DEMO_REPLICATE, force=True))
    print(f"  {plural(summary.files, 'file')}, {format_bytes(summary.raw_bytes)} -> "
          f"{format_bytes(summary.stored_bytes)} (ratio {summary.ratio:.2f}x) in {plural(summary.chunks, 'chunk')}, "
          f"{summary.seconds:.1f} s")

    with open_dataset(dataset) as ds:
        paths = sorted(ds.files())
        expected = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file() and not p.is_symlink())
        bad = _compare(paths, expected, ds.read, source)
        print(f"read back {len(paths):,} files through the API: {len(bad)} differ from the original or are missing")
        api_seconds = _best_time(lambda: [ds.read(p) for p in paths])
    plain_seconds = _best_time(lambda: [(source / p).read_bytes() for p in paths])
    rows = [("plain directory (warm)", plain_seconds), ("fanstore API (decompress)", api_seconds)]

    train_with_torch = partial(_demo_torch, source, dataset, parts)
    if mount:
        mount_rows, mount_bad = _demo_mount(dataset, workdir / "mnt", source, paths, expected, parts,
                                            train_with_torch)
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
    dataset: Path, mountpoint: Path, source: Path, paths: list[str], expected: list[str], parts: _TreeParts,
    while_mounted: Callable[[Path | None], list[str]],
) -> tuple[list[tuple[str, float]], list[str]]:
    """Mount the dataset, check every file through it, time two epochs, and train on it as on the original;
    `while_mounted(mountpoint)` runs before the unmount, or `while_mounted(None)` if there is no mount."""
    from ..mount.mount import fuse_unavailable_reason, mount_background, resolve_mountpoint, unmount, wait_for_exit

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

        print("\nthe same training loop (open and read under a path; see fanstore/demo/demo_training.py), from two "
              f"directories: it classifies the digit PNGs only, {parts.digits_train:,} in train/ and "
              f"{parts.digits_val:,} in val/")
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


def _demo_torch(source: Path, dataset: Path, parts: _TreeParts, mountpoint: Path | None) -> list[str]:
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
    print(f"\nPyTorch: a 2-layer CNN, seed {settings.seed}, {plural(settings.epochs, 'epoch')} of batches of "
          f"{settings.batch_size}, num_workers={settings.num_workers}, {plural(len(os.sched_getaffinity(0)), 'core')}; "
          "the same run from each reader (fanstore/demo/demo_torch.py).\n"
          f"train+val: the images of every class folder, the 10 digits and photos/ ({parts.digits_train:,} + "
          f"{parts.photos_train:,} in train/, {parts.digits_val:,} + {parts.photos_val:,} in val/),\nso more than "
          "the digits-only loop above. s (wait): an epoch's seconds, and those the loop spent waiting in "
          "next(loader).\nThe original and the mount are read from the page cache; fanstore.torch decodes every "
          "file in every epoch.")
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


# What each rank of the demo job runs on its mount: every file compared with its original, walked as the mount
# lists them (the order its prefetch fetches ahead in), then this rank's counters of where the blobs came from.
_RANK_CHECK = """
import json, os, sys
source, mount, rank = sys.argv[1], os.environ["FANSTORE_MOUNT"], os.environ["FANSTORE_RANK"]
files = links = 0
differ = []
for top, _, names in os.walk(mount):
    for name in names:
        served = os.path.join(top, name)
        path = os.path.relpath(served, mount)
        links += os.path.islink(served)
        files += not os.path.islink(served)
        with open(os.path.join(source, path), "rb") as original, open(served, "rb") as read:
            if original.read() != read.read():
                differ.append(path)
counters = json.loads(os.getxattr(mount, "user.fanstore.stats"))["source"]
print(json.dumps({"rank": int(rank), "files": files, "links": links, "differ": differ, "local": counters["local"],
                  "fallback": counters["fallback"],
                  "peers": {peer: c["fetched"] for peer, c in counters["peers"].items()}}), flush=True)
sys.exit(1 if differ else 0)
"""


def _demo_serve(dataset: Path, workdir: Path, source: Path) -> list[str]:
    """Serve the dataset with two ranks on this machine, as on two nodes: each stages its share, mounts the whole
    dataset and checks every file through it; the job's counters show what came from where, and the demo says how
    they add up."""
    import importlib.util
    import json
    import shutil
    import subprocess
    import sys

    from ..mount.mount import fuse_unavailable_reason

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
    checks = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                    key=lambda check: check["rank"])
    counters = [line for line in done.stdout.splitlines() if not line.startswith("{")]
    with open_dataset(dataset) as ds:
        blobs, blocked = _blob_count(ds)
    print("\n".join([_describe_check(check, blobs) for check in checks] + [f"  {line}" for line in counters]))
    if checks:
        print(_explain_serve_counts(blobs, blocked))
    if done.returncode != 0:
        print(done.stderr.strip())
        return [f"fanstore serve (exit status {done.returncode})"]
    return []


def _blob_count(ds: Dataset) -> tuple[int, int]:
    """What reading every file once fetches: its blobs (a file stored whole is one, a large one one a block; an
    empty file none); and how many files are stored in blocks."""
    import stat

    import numpy as np

    from ..core.format import FLAG_BLOCKED, NO_CHUNK

    entries = ds.index.entries
    blocked = (entries["flags"] & FLAG_BLOCKED) != 0
    whole = (entries["chunk"] != NO_CHUNK) & ~blocked & ((entries["mode"] & 0o170000) == stat.S_IFREG)
    return int(np.count_nonzero(whole)) + len(ds.index.blocks), int(np.count_nonzero(blocked))


def _describe_check(check: dict, blobs: int) -> str:
    """One rank's check, and where its blobs came from, summed."""
    links = f" and {plural(check['links'], 'symlink')}" if check["links"] else ""
    peers = " + ".join(f"{count:,} from rank {peer}" for peer, count in sorted(check["peers"].items()))
    total = check["local"] + check["fallback"] + sum(check["peers"].values())
    more = (f" ({total - blobs:,} more than the files' {blobs:,}: a blob fetched ahead is held for a few dozen "
            "reads, and one whose read came later was fetched again)" if total > blobs else "")
    return (f"  rank {check['rank']}: read {plural(check['files'], 'file')}{links}, {len(check['differ'])} differ; "
            f"blobs: {check['local']:,} from its local chunks + {peers} + {check['fallback']:,} from DEST = "
            f"{total:,}{more}")


def _explain_serve_counts(blobs: int, blocked: int) -> str:
    """What the counters count, in words, so that the sums above read as they should."""
    stored = ("no file here is stored in blocks" if not blocked
              else f"{plural(blocked, 'file')} here {'is' if blocked == 1 else 'are'} stored in blocks")
    return (f"  A blob is what a read fetches: a file stored whole, or one block of a large one ({stored}: "
            f"{plural(blobs, 'blob')}).\n"
            "  Each rank reads every file once, so its blobs add up to the files': the replicated val/ and its share "
            "of the\n  spread files come from its local chunks, the other rank's share from that rank (fetched "
            "ahead, several to a\n  request). The spread files are shared out by bytes, not by count: one rank's "
            "share can be a few large files,\n  the other's many small ones. A symlink and its target share one "
            "blob.")


@dataclass(frozen=True, slots=True)
class _TreeParts:
    """What the demo tree holds, counted from it, so that every count the demo prints can be traced to it."""

    digits_train: int
    digits_val: int
    photos_train: int
    photos_val: int
    fields: int
    other_files: int
    symlinks: int

    @classmethod
    def of(cls, source: Path) -> _TreeParts:
        def count(pattern: str) -> int:
            return sum(1 for path in source.glob(pattern) if path.is_file() and not path.is_symlink())

        files = sum(1 for path in source.rglob("*") if path.is_file() and not path.is_symlink())
        parts = [count("train/[0-9]/*.png"), count("val/[0-9]/*.png"), count("train/photos/*.jpg"),
                 count("val/photos/*.jpg"), count("science/*.npy")]
        return cls(*parts, files - sum(parts), sum(1 for path in source.rglob("*") if path.is_symlink()))

    def describe(self) -> str:
        train, val = self.digits_train + self.photos_train, self.digits_val + self.photos_val
        return (f"{self.digits_train + self.digits_val:,} digit PNGs and {self.photos_train + self.photos_val:,} "
                f"photo crops, {train:,} in train/ and {val:,} in val/; {self.fields:,} float32 fields in science/; "
                f"{plural(self.other_files, 'other file')} (labels.txt, README.txt)"
                + (f"; and {plural(self.symlinks, 'symlink')}" if self.symlinks else ""))


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
