"""The COMMAND of tests/test_serve_clients.py, run by every rank of `mpiexec -n 3 fanstore serve DEST ... -- python
serve_clients_remote.py SRC DEST`: each client of tests/client_files.py reads, through this rank's mount and
through the API (the node's dataset, as fanstore.torch.FileDataset(None) opens it), those files of which this rank
stores no byte, so that every blob comes from a peer. Through the mount, each file is also read at random offsets
and across block edges, past its end, mapped, and by two processes at once, in an order that differs from file to
file, so that each way of reading is the first to reach the mount for some file. Prints one JSON line: the rank, the
files it read from peers, the blobs its mount fetched from peers and what differed.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from client_files import (hdf5_contents, mapped_array_contents, sqlite_contents, tar_contents,  # noqa: E402
                          zip_contents)
from fanstore import Dataset, open_dataset  # noqa: E402
from fanstore.errors import say_line  # noqa: E402
from fanstore.serve.node_client import open_served_dataset  # noqa: E402
from fanstore.serve.placement import place  # noqa: E402

READS = 120  # random reads of each file, through each face
LENGTHS = (1, 17, 4096, 65_536, 65_537, 200_000)  # the mount's requests are at most 128 KiB: larger ones are split
# The same SHA-256 of a file, computed by a process of its own that reads it through the mount.
SHA_OF = "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())"


def stored_elsewhere(dest: Path, names: list[str], rank: int, ranks: int) -> list[str]:
    """Those of `names` whose blobs (the file's, or every block's) this rank stores none of."""
    with open_dataset(dest) as dataset:
        placement, index = place(dataset.index, ranks), dataset.index
        found = []
        for name in names:
            entry = dataset.resolve(name)
            rows = index.block_rows(entry)
            blobs = (index.blocks[rows.start : rows.stop] if len(rows) else index.entries[entry : entry + 1])
            if not placement.owners.owners_of(blobs["chunk"], blobs["offset"]).tolist().count(rank):
                found.append(name)
        return found


def offsets(size: int, block: int, seed: int) -> list[tuple[int, int]]:
    """(offset, length) reads: random ones, then some that straddle each block edge, then some at and past the end."""
    rng = random.Random(seed)
    reads = [(rng.randrange(size), rng.choice(LENGTHS)) for _ in range(READS)]
    reads += [(max(0, edge - 3), 7) for edge in range(block, size, block)]
    reads += [(max(0, edge - 5), block + 10) for edge in range(block, size, 3 * block)]
    return reads + [(size - 3, 100), (size, 100), (size + 12_345, 100), (0, size + 1)]


def mount_checks(mount: Path, src: Path, name: str, block: int, rank: int) -> dict[str, Callable[[], bool]]:
    """Each way of reading `name` through the mount, by what it is, each True when it saw the original."""
    original = (src / name).read_bytes()
    readers: dict[str, Callable[[Path], Any]] = {
        "table.sqlite": lambda root: sqlite_contents(root / name),
        "archive.zip": lambda root: zip_contents(root / name),
        "array.npy": lambda root: mapped_array_contents(root / name),
        "bundle.tar": lambda root: _tar_through(root / name),
        "data.h5": lambda root: hdf5_contents(root / name)}

    def by_client() -> bool:
        return readers[name](mount) == readers[name](src)

    def at_offsets() -> bool:
        descriptor = os.open(mount / name, os.O_RDONLY)
        try:
            return all(os.pread(descriptor, length, offset) == original[offset : offset + length]
                       for offset, length in offsets(len(original), block, rank))
        finally:
            os.close(descriptor)

    def mapped() -> bool:
        with open(mount / name, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as pages:
            rng = random.Random(rank)
            scattered = all(pages[at : at + 5000] == original[at : at + 5000]
                            for at in (rng.randrange(len(original)) for _ in range(READS)))
            return scattered and pages[:] == original

    def two_at_once() -> bool:
        readers_at_once = [subprocess.Popen([sys.executable, "-c", SHA_OF, str(mount / name)], stdout=subprocess.PIPE,
                                            text=True) for _ in range(2)]
        seen = [reader.communicate(timeout=60)[0].strip() for reader in readers_at_once]
        return seen == [hashlib.sha256(original).hexdigest()] * 2

    return {"client": by_client, "offsets": at_offsets, "mmap": mapped, "two processes": two_at_once}


def _tar_through(path: Path) -> dict[str, bytes]:
    with open(path, "rb") as bundle:
        return tar_contents(bundle)


def api_checks(served: Dataset, src: Path, name: str, block: int, rank: int) -> dict[str, Callable[[], bool]]:
    """Each way of reading `name` through the node's dataset (no FUSE), each True when it saw the original."""
    original = (src / name).read_bytes()
    clients: dict[str, Callable[[Any], Any]] = {
        "archive.zip": zip_contents, "bundle.tar": tar_contents, "data.h5": hdf5_contents,
        "array.npy": lambda file: np.load(file).tobytes(), "table.sqlite": sqlite_of}

    def by_client() -> bool:
        with served.open(name) as blob, open(src / name, "rb") as file:
            return clients[name](io.BufferedReader(blob)) == clients[name](file)

    def at_offsets() -> bool:
        with served.open(name) as blob:
            for offset, length in offsets(len(original), block, rank + 100):
                blob.seek(offset)
                if blob.read(length) != original[offset : offset + length]:
                    return False
            return True

    return {"api client": by_client, "api offsets": at_offsets, "api read": lambda: served.read(name) == original}


def sqlite_of(file: Any) -> tuple:
    """What sqlite_contents asks, of a database given as a file: sqlite reads only paths, so it is loaded whole."""
    database = sqlite3.connect(":memory:")
    try:
        database.deserialize(file.read())
        return (database.execute("PRAGMA integrity_check").fetchone()[0],
                database.execute("SELECT count(*), sum(value) FROM t").fetchone(),
                database.execute("SELECT label FROM t WHERE id BETWEEN 12000 AND 12010").fetchall())
    finally:
        database.close()


def _file_dataset_problems(src: Path, remote: list[str]) -> list[str]:
    """fanstore.torch.FileDataset(None) gives each file whole, as in the original (nothing to do without torch)."""
    try:
        from fanstore.torch import FileDataset
    except ImportError:
        return []
    with FileDataset(None, paths=remote) as dataset:
        return [f"{name}: FileDataset(None) differs" for item, name in enumerate(remote)
                if dataset[item] != (src / name).read_bytes()]


def main() -> int:
    src, dest, block = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    mount, rank, ranks = (Path(os.environ["FANSTORE_MOUNT"]), int(os.environ["FANSTORE_RANK"]),
                          int(os.environ["FANSTORE_SIZE"]))
    remote = stored_elsewhere(dest, sorted(os.listdir(src)), rank, ranks)
    problems = []
    with open_served_dataset() as served:
        for number, name in enumerate(remote):
            through_mount = list(mount_checks(mount, src, name, block, rank).items())
            first = (number + rank) % len(through_mount)  # each way of reading is the first for some file
            for what, check in [*through_mount[first:], *through_mount[:first],
                                *api_checks(served, src, name, block, rank).items()]:
                try:
                    if not check():
                        problems.append(f"{name}: {what} differs")
                except Exception as exc:  # noqa: BLE001 - reported, and the other checks still run
                    problems.append(f"{name}: {what}: {type(exc).__name__}: {exc}")
    problems += _file_dataset_problems(src, remote)
    source = json.loads(os.getxattr(mount, "user.fanstore.stats"))["source"]
    from_peers = sum(peer["fetched"] for peer in source["peers"].values())
    say_line(json.dumps({"rank": rank, "remote": remote, "from_peers": from_peers, "problems": problems}),
             sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
