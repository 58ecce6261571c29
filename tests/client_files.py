"""Files that real clients read by seeking, not from start to end, and what each client reads of them.

zip seeks to the end for its central directory, then to each member; sqlite reads pages where its B-trees lead;
numpy maps an array; tar jumps from header to header; HDF5 follows its B-tree to chunks. Each `*_contents`
function reads a file (a path, or an open binary file where the library takes one) the way its client does and
returns something to compare with the original's.
"""

from __future__ import annotations

import io
import sqlite3
import tarfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

ROWS = 20_000


def make_client_tree(src: Path) -> None:
    """One file per client (data.h5 only where h5py is installed), each large enough to span several blocks."""
    rng = np.random.default_rng(11)
    src.mkdir(parents=True)
    with sqlite3.connect(src / "table.sqlite") as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, label TEXT, value REAL)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?)",
                       ((i, f"label-{i % 97}-{'x' * (i % 40)}", float(v)) for i, v in enumerate(rng.random(ROWS))))
        db.execute("CREATE INDEX t_label ON t (label)")
    db.close()
    with zipfile.ZipFile(src / "archive.zip", "w") as archive:
        for i in range(40):
            data = rng.integers(0, 16 if i % 2 else 256, 3000 + 2500 * i, dtype=np.uint8).tobytes()
            archive.writestr(f"member{i:02d}.bin", data,
                             compress_type=zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED)
    np.save(src / "array.npy", rng.standard_normal((512, 700)).astype(np.float32))
    with tarfile.open(src / "bundle.tar", "w") as bundle:
        for i in range(30):
            data = rng.integers(0, 256, 1000 + 7919 * i, dtype=np.uint8).tobytes()
            info = tarfile.TarInfo(f"part{i:02d}.bin")
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    try:
        import h5py
    except ImportError:
        return
    with h5py.File(src / "data.h5", "w") as h5:
        h5.create_dataset("images", data=rng.integers(0, 255, (64, 32, 32, 3), dtype=np.uint8), chunks=(4, 32, 32, 3),
                          compression="gzip")
        h5.create_dataset("labels", data=np.arange(64, dtype=np.int64))
        h5["images"].attrs["source"] = "generated"


BLOCK = 64 * 1024  # the block size of the 'blocks' packing: reads start and end inside blocks and across their edges


def pack_client_tree(root: Path, layout: str) -> tuple[Path, Path]:
    """The client tree under root/src, packed to root/ds with every file stored whole (`layout` 'whole') or the large
    ones in BLOCK-sized blocks ('blocks'): (src, ds)."""
    from fanstore import PackOptions, pack

    make_client_tree(root / "src")
    blocks_above = BLOCK if layout == "blocks" else 1 << 30
    pack(root / "src", root / "ds", PackOptions(codec="zstd:3", chunk_size=256 * 1024, workers=1, block_size=BLOCK,
                                                blocks_above=blocks_above))
    return root / "src", root / "ds"


def sqlite_contents(path: Path) -> tuple:
    """An integrity check (every page), an aggregate, an index lookup and a range of rows, read-only."""
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        return (db.execute("PRAGMA integrity_check").fetchone()[0],
                db.execute("SELECT count(*), sum(value) FROM t").fetchone(),
                db.execute("SELECT id, value FROM t WHERE label = 'label-5-' ORDER BY id").fetchall(),
                db.execute("SELECT label FROM t WHERE id BETWEEN 12000 AND 12010").fetchall())
    finally:
        db.close()


def zip_contents(file: Path | BinaryIO) -> dict[str, bytes]:
    with zipfile.ZipFile(file) as archive:
        assert archive.testzip() is None
        return {name: archive.read(name) for name in reversed(archive.namelist())}  # back to front: seeks back


def tar_contents(file: BinaryIO) -> dict[str, bytes]:
    with tarfile.open(fileobj=file, mode="r:") as bundle:
        return {m.name: bundle.extractfile(m).read() for m in reversed(bundle.getmembers())}  # type: ignore[union-attr]


def mapped_array_contents(path: Path) -> tuple[bytes, bytes]:
    """Scattered pages of a memory-mapped array first, then all of it."""
    mapped = np.load(path, mmap_mode="r")
    try:
        return mapped[::37, 101:613].tobytes(), np.asarray(mapped).tobytes()
    finally:
        del mapped


def hdf5_contents(file: Path | BinaryIO) -> tuple:
    import h5py

    with h5py.File(file, "r") as h5:
        images = h5["images"]
        return images[::5, 3:29].tobytes(), images[:].tobytes(), h5["labels"][:].tolist(), images.attrs["source"]


def read_like_clients(root: Path) -> dict[str, Any]:
    """Every client file under `root` read by its client, by name (data.h5 only where it exists)."""
    with open(root / "bundle.tar", "rb") as bundle:
        seen: dict[str, Any] = {"table.sqlite": sqlite_contents(root / "table.sqlite"),
                                "archive.zip": zip_contents(root / "archive.zip"),
                                "array.npy": mapped_array_contents(root / "array.npy"),
                                "bundle.tar": tar_contents(bundle)}
    if (root / "data.h5").exists():
        seen["data.h5"] = hdf5_contents(root / "data.h5")
    return seen
