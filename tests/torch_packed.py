"""A small packed dataset for the fanstore.torch tests: 60 files of distinct sizes, packed into several chunks, and
each file's original bytes, to compare every item read against."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fanstore import PackOptions, pack


def pack_sixty_files(base: Path) -> tuple[Path, list[bytes]]:
    """DEST, and the original bytes of its files in the order FileDataset(DEST) lists them (sorted paths)."""
    src = base / "src"
    rng = np.random.default_rng(3)
    for i in range(60):
        path = src / f"d{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 8, 1000 + 97 * i, np.uint8).tobytes())
    pack(src, base / "dest", PackOptions(codec="zstd:3", chunk_size=16 * 1024, workers=1))
    return base / "dest", [path.read_bytes() for path in sorted(src.rglob("*.bin"))]
