"""bench_index: what does the index cost each process of a node as datasets grow to 10^6 and 10^7 files?

For each size (10^5 and 10^6 files; --full adds 10^7), a dataset made by synthetic_index (tiny files, the index
built from arrays), and in fresh processes of this tree and, beside it, of --baseline (another checkout, e.g. main
before issue 35; its figures in the same run, on the same datasets):

  open 1st   open_dataset in a fresh process, the first on this node (the full check runs; 1.2 leaves a stamp)
  open       open_dataset in a fresh process, a later one (the median of --repeats)
  1st item   open plus FileDataset's first item in a fresh process (the file list taken, one file read)
  lookup us  CPU per Index.lookup of a random path (median of --repeats rounds of 20,000, by turns)
  read us    CPU per Dataset.read of a random path (median of --repeats rounds of 5,000, by turns)
  worker     private memory (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of a DataLoader worker
             after its first item: FileDataset over every file, EpochSampler(RandomSampler), 2 workers, spawned
             and forked; `paths=` the same, spawned, with every path given as a list (FileDataset(DEST, paths));
             `trivial` is a worker of a Dataset of N ints under the same loader, the floor

and the slope of each worker figure between the two smallest sizes, in bytes per file.

Usage: python bench/bench_index.py [--full] [--baseline DIR] [--repeats N] [--cache DIR]
CPU placement: the processes run on the CPUs this one may use (printed), unpinned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1 << 20


def private_bytes(pid: int | str = "self", fields: tuple[str, ...] = ("Private_Clean", "Private_Dirty")) -> int:
    """Private_Clean + Private_Dirty of a process (this one by default): what it holds that no other process maps.
    Other `fields` of /proc/PID/smaps_rollup, summed: ("Anonymous",) is its memory that no file backs."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            name, _, value = line.partition(":")
            if name in fields:
                found[name] = int(value.split()[0]) * 1024
    return sum(found.values())


def _memory_item(data: bytes) -> int:
    """A FileDataset transform: the worker's private memory once it has read an item."""
    return private_bytes()


class _Trivial:
    """The floor: a worker of a Dataset that holds nothing but its length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: int) -> int:
        return private_bytes()


def _first(batch: list[int]) -> int:
    return batch[0]


def worker_private_memory(dest: str, context: str, floor: str = "fanstore") -> int:
    """The largest private memory of the two workers after their first items."""
    return max(workers_private_memory(dest, context, 2, floor))


def workers_private_memory(dest: str, context: str, workers: int, floor: str = "fanstore") -> list[int]:
    """The private memory of each of a DataLoader's `workers` workers after its first item; `floor` 'paths': the
    dataset given every path as a list, 'trivial': a Dataset of ints."""
    from torch.utils.data import DataLoader, RandomSampler

    from fanstore.torch import EpochSampler, FileDataset

    paths = FileDataset(dest).paths if floor == "paths" else None
    dataset = FileDataset(dest, paths=paths, transform=_memory_item)
    del paths  # the list stays the dataset's; a user's own list would be theirs too
    sampler = EpochSampler(RandomSampler(dataset), dataset)
    if floor == "trivial":
        dataset, sampler = _Trivial(len(dataset)), RandomSampler(range(len(dataset)))
    loader = DataLoader(dataset, batch_size=1, num_workers=workers, sampler=sampler,
                        multiprocessing_context=context, collate_fn=_first, prefetch_factor=1)
    items = iter(loader)
    figures = [next(items) for _ in range(workers)]  # one item from each worker: the loader takes them by turns
    del items
    return figures


def _child(kind: str, dest: str, repeats: int) -> object:
    """One figure, measured in this fresh process."""
    import random

    from fanstore import open_dataset

    if kind == "open":
        start = time.perf_counter()
        open_dataset(dest)
        return time.perf_counter() - start
    if kind == "first_item":
        from fanstore.torch import FileDataset

        start = time.perf_counter()
        FileDataset(dest)[0]
        return time.perf_counter() - start
    if kind in ("lookup", "read"):
        dataset = open_dataset(dest)
        files = dataset.index.files_in_path_order()
        rng = random.Random(7)
        calls = 20_000 if kind == "lookup" else 5_000
        # Taken from the index, so any dataset's paths serve (bench_scale's layout is not synthetic_index's).
        paths = [dataset.index.path_of(int(files[rng.randrange(len(files))])) for _ in range(calls)]
        call = dataset.index.lookup if kind == "lookup" else dataset.read
        rounds = []
        for _ in range(repeats):
            start = time.process_time()
            for path in paths:
                call(path)
            rounds.append((time.process_time() - start) / calls * 1e6)
        return rounds
    if kind.startswith("workers:"):
        _, context, workers = kind.split(":")
        return workers_private_memory(dest, context, int(workers))
    if kind.startswith("worker"):
        _, context, floor = kind.split(":")
        return worker_private_memory(dest, context, floor)
    raise SystemExit(f"unknown figure {kind}")


def _measure(tree: Path, kind: str, dest: Path, repeats: int) -> object:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind, str(dest),
                           "--repeats", str(repeats)], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(value: object, scale: float, digits: int) -> str:
    if isinstance(value, str):
        return value
    return f"{value * scale:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="add 10^7 files")
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with (its fanstore package's parent)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", type=Path, help="keep the generated datasets here")
    parser.add_argument("--child", nargs=2, metavar=("FIGURE", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.repeats)))
        return
    sys.path.insert(0, str(HERE))
    from synthetic_index import make_dataset

    sizes = [10**5, 10**6] + ([10**7] if args.full else [])
    trees = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    root = args.cache or Path(tempfile.mkdtemp(prefix="bench_index-"))
    print(f"bench_index: CPUs {sorted(os.sched_getaffinity(0))}, unpinned; {args.repeats} repeats; trees "
          + ", ".join(f"{name} {path}" for name, path in trees.items()))
    header = (f"{'files':>10} {'tree':>8} {'open 1st s':>10} {'open s':>7} {'1st item s':>10} {'lookup us':>9} "
              f"{'read us':>8} {'spawn MiB':>9} {'fork MiB':>8} {'paths= MiB':>10} {'trivial MiB':>11}")
    print(header)
    workers: dict[tuple[str, int], list[object]] = {}
    for files in sizes:
        dest = root / f"files-{files}"
        if not (dest / "fanstore.index").exists():
            start = time.perf_counter()
            make_dataset(dest, files)
            print(f"  (made {dest}: {time.perf_counter() - start:.1f} s)")
        for name, tree in trees.items():
            for stamp in Path("/dev/shm").glob(f"fanstore-checked-{os.getuid()}/*"):
                stamp.unlink()  # this tree's first open does the full check
            first_open = _measure(tree, "open", dest, 1)
            opens = [_measure(tree, "open", dest, 1) for _ in range(args.repeats)]
            first_item = statistics.median(_measure(tree, "first_item", dest, 1) for _ in range(3))
            lookup = _measure(tree, "lookup", dest, args.repeats)
            read = _measure(tree, "read", dest, args.repeats)
            memory = [_measure(tree, f"worker:{context}:{floor}", dest, 1)
                      for context, floor in (("spawn", "fanstore"), ("fork", "fanstore"), ("spawn", "paths"),
                                             ("spawn", "trivial"))]
            workers[(name, files)] = memory
            open_median = statistics.median(o for o in opens if not isinstance(o, str)) if all(
                not isinstance(o, str) for o in opens) else opens[0]
            print(f"{files:>10,} {name:>8} {_cell(first_open, 1, 3):>10} {_cell(open_median, 1, 3):>7} "
                  f"{_cell(first_item, 1, 3):>10} "
                  f"{_cell(lookup if isinstance(lookup, str) else statistics.median(lookup), 1, 2):>9} "
                  f"{_cell(read if isinstance(read, str) else statistics.median(read), 1, 2):>8} "
                  + " ".join(f"{_cell(m, 1 / MIB, 1):>{w}}" for m, w in zip(memory, (9, 8, 10, 11))), flush=True)
    low, high = sizes[0], sizes[1]
    for name in trees:
        slopes = []
        for column in range(4):
            a, b = workers[(name, low)][column], workers[(name, high)][column]
            slopes.append("-" if isinstance(a, str) or isinstance(b, str) else f"{(b - a) / (high - low):.1f}")
        print(f"worker private memory per file, {low:,} -> {high:,} files, {name}: spawn {slopes[0]} B, "
              f"fork {slopes[1]} B, paths= {slopes[2]} B, trivial {slopes[3]} B (target <= 24 B)")


if __name__ == "__main__":
    main()
