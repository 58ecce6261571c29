"""bench_records: what does reading an index record cost on the hot paths, here and in another checkout?

Two calls that read one entry of the index each time: Reader.read of a small file (the API's read: the entry, the
blob, its checksum, its decode) and the mount's getattr attribute builder (FanstoreOperations._attributes). Each is
timed as CPU nanoseconds per call (time.process_time_ns) in a fresh process of this tree and, beside it, of
--baseline (another checkout, e.g. the commit before a change to how records are read), by turns, --runs times;
the medians are printed with their ratio. Over 2,000 files of 4 KiB packed with lz4, made once under --cache.

Usage: python bench/bench_records.py --baseline DIR [--runs N] [--cache DIR]
Pin it for steadier figures: taskset -c 1 python bench/bench_records.py --baseline DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES, FILE_BYTES = 2000, 4096
READ_ROUNDS, ATTRIBUTE_ROUNDS = 5, 50

# Run in a fresh interpreter with the checkout first on sys.path: prints {"read": ns, "getattr": ns}.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from fanstore import open_dataset
try:
    from fanstore.core.cache import DecodedCache
    from fanstore.mount.fuse_ops import FanstoreOperations
except ImportError:  # a checkout from before fanstore/ was split by role
    from fanstore.cache import DecodedCache
    from fanstore.fuse_ops import FanstoreOperations
with open_dataset(sys.argv[2]) as ds:
    entries = [ds.index.lookup(path) for path in sorted(ds.files())]
    read = ds.reader.read
    attributes = FanstoreOperations(ds.index, DecodedCache(1 << 20, ds.reader.load), None, decode_threads=1)._attributes
    for entry in entries:  # warm: pages, codecs, caches
        read(entry)
    started = time.process_time_ns()
    for _ in range(int(sys.argv[3])):
        for entry in entries:
            read(entry)
    read_ns = (time.process_time_ns() - started) / (int(sys.argv[3]) * len(entries))
    started = time.process_time_ns()
    for _ in range(int(sys.argv[4])):
        for entry in entries:
            attributes(entry)
    getattr_ns = (time.process_time_ns() - started) / (int(sys.argv[4]) * len(entries))
print(json.dumps({"read": read_ns, "getattr": getattr_ns}))
"""


def make_dataset(cache: Path) -> Path:
    """The packed dataset, made once (by this checkout's packer: both sides read the same bytes)."""
    dest = cache / "records-lz4"
    if (dest / "fanstore.index").exists():
        return dest
    sys.path.insert(0, str(REPO))
    from fanstore import PackOptions, pack

    src = cache / "records-src"
    src.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    for number in range(FILES):
        (src / f"f{number:05d}.bin").write_bytes(bytes(rng.getrandbits(4) for _ in range(FILE_BYTES)))
    pack(src, dest, PackOptions(codec="lz4", workers=1))
    return dest


def measure(checkout: Path, dest: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(checkout), str(dest), str(READ_ROUNDS),
                           str(ATTRIBUTE_ROUNDS)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(checkout)})
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of fanstore")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes of each tree, by turns (default 5)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fanstore-bench-records"))
    args = parser.parse_args()
    dest = make_dataset(args.cache)
    runs: dict[str, list[dict[str, float]]] = {"this tree": [], "baseline": []}
    for _ in range(args.runs):
        runs["this tree"].append(measure(REPO, dest))
        runs["baseline"].append(measure(args.baseline.resolve(), dest))
    cpus = sorted(os.sched_getaffinity(0))
    print(f"machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), this process may use "
          f"{len(cpus)}: {cpus}; Python {platform.python_version()}")
    print(f"{FILES:,} files of {FILE_BYTES:,} B (lz4); CPU ns per call, median of {args.runs} fresh processes "
          f"of each tree by turns; baseline {args.baseline}")
    print(f"{'call':<10}{'baseline':>12}{'this tree':>12}{'change':>10}")
    for call in ("read", "getattr"):
        base = statistics.median(run[call] for run in runs["baseline"])
        this = statistics.median(run[call] for run in runs["this tree"])
        print(f"{call:<10}{base:>12,.0f}{this:>12,.0f}{(this / base - 1) * 100:>+9.1f}%")


if __name__ == "__main__":
    main()
