"""A small training tree the selector used to mispredict (issue 33): its kind `other` is mostly one large
incompressible file among many small compressible ones.

Photo crops (JPEG), CSV labels and smooth float32 fields (.npy), as bench/synthetic_tree.py makes them, and in
`shards/` 320 small headerless float32 blobs (`.bin`, kind `other`, compressible) beside one 3 MiB blob of random
bytes with the same extension: about 10 MB, 3 MiB of it that one file. A sample that draws files rather than
bytes measures `other` on a few small blobs, predicts that the kind compresses, and a `--fit` planned on it packs
past its capacity. The same call always writes the same bytes, names and mtimes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from synthetic_tree import FIXED_MTIME_NS, make_field, make_image, make_text

LARGE_RANDOM_BYTES = 3 << 20
_SEED = 33


def _blob(rng: np.random.Generator) -> bytes:
    """A headerless run of float32 samples of a slow signal, 4-12 KiB: compressible, and of no known kind."""
    count = int(rng.integers(1024, 3072))
    signal = np.cumsum(rng.normal(0, 0.01, count)) + rng.uniform(200, 300)
    return signal.astype(np.float32).tobytes()


def write_held_out_tree(root: Path) -> tuple[int, int]:
    """The tree under `root` (which must not exist); its files and bytes."""
    rng = np.random.default_rng(_SEED)
    files: dict[str, bytes] = {}
    for number in range(240):
        files[f"images/img_{number:04d}.jpg"] = make_image(rng, "jpeg")
    for number in range(60):
        files[f"labels/part_{number:03d}.csv"] = make_text(rng, "csv", f"labels/part_{number:03d}.csv")
    for number in range(8):
        files[f"fields/field_{number:02d}.npy"] = make_field(rng)
    for number in range(320):
        files[f"shards/shard_{number:03d}.bin"] = _blob(rng)
    files["shards/shard_big.bin"] = rng.integers(0, 256, LARGE_RANDOM_BYTES, dtype=np.uint8).tobytes()
    root.mkdir(parents=True)
    for path, data in sorted(files.items()):
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.utime(target, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    for directory in sorted({(root / path).parent for path in files}, reverse=True):
        os.utime(directory, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    return len(files), sum(map(len, files.values()))
