"""A packed dataset of N tiny files made in seconds at any N: the index is built from arrays, not by packing files
(no file system holds ten million inodes, and a pack of them takes minutes), with every field a pack would write.

Layout: `dNNNNN/fNNNNNNNN.bin`, `files_per_dir` files a directory, each file the same 10 bytes stored as they are
(`none`) in one chunk. Names are fixed-width, so entry order is path order and the path blob is a reshaped array.
The dataset is an ordinary one: it opens, passes the checks and reads like any pack of the same tree.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fanstore.core.format import (CHUNK_DTYPE, CHUNK_HEADER_LEN, DERIVED_DTYPE, ENTRY_DTYPE, HASH_DTYPE,  # noqa: E402
                             ORDER_DTYPE, chunk_file_name, pack_chunk_header)
from fanstore.core.index import _serialise, derive_first_child, write_index_atomically  # noqa: E402

CONTENT = b"0123456789"
MTIME_NS = 1_700_000_000 * 10**9
_DIR_DIGITS, _FILE_DIGITS = 5, 8


def _digits(numbers: np.ndarray, width: int) -> np.ndarray:
    """Each number as `width` ASCII decimal digits, one row per number."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((numbers[:, None] // powers) % 10 + ord("0")).astype(np.uint8)


def make_dataset(dest: Path, files: int, files_per_dir: int = 1000) -> Path:
    """Write an N-file dataset at `dest` (created) and return it."""
    dirs = -(-files // files_per_dir)
    count = 1 + dirs + files
    dir_names = np.concatenate((np.full((dirs, 1), ord("d"), np.uint8), _digits(np.arange(dirs), _DIR_DIGITS)), 1)
    numbers = np.arange(files, dtype=np.int64)
    file_paths = np.concatenate((dir_names[numbers // files_per_dir],
                                 np.full((files, 2), [ord("/"), ord("f")], np.uint8), _digits(numbers, _FILE_DIGITS),
                                 np.frombuffer(b".bin", np.uint8)[None, :].repeat(files, 0)), 1)
    dir_len, file_len = dir_names.shape[1], file_paths.shape[1]
    paths = np.concatenate((dir_names.ravel(), file_paths.ravel()))
    entries = np.zeros(count, dtype=ENTRY_DTYPE)
    lengths = np.concatenate(([0], np.full(dirs, dir_len), np.full(files, file_len))).astype(np.uint64)
    entries["path_len"] = lengths
    entries["path_off"] = np.cumsum(lengths) - lengths
    entries["parent"][1 + dirs:] = 1 + numbers // files_per_dir
    entries["mode"] = stat.S_IFREG | 0o644
    entries["mode"][: 1 + dirs] = stat.S_IFDIR | 0o755
    entries["mtime_ns"] = MTIME_NS
    entries["chunk"][: 1 + dirs] = 0xFFFFFFFF
    files_view = entries[1 + dirs:]
    files_view["size"] = files_view["stored_len"] = len(CONTENT)
    files_view["offset"] = CHUNK_HEADER_LEN + numbers * len(CONTENT)
    files_view["checksum"] = xxhash.xxh3_64_intdigest(CONTENT)
    keys = [b""] + list(dir_names.view(f"S{dir_len}").ravel()) + list(file_paths.view(f"S{file_len}").ravel())
    hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=HASH_DTYPE, count=count)
    del keys
    order = np.lexsort((np.arange(count), hashes)).astype(ORDER_DTYPE)
    arrays = {
        "entries": entries,
        "paths": paths,
        "path_hash": hashes[order],
        "hash_order": order,
        "chunks": np.array([(CHUNK_HEADER_LEN + files * len(CONTENT), 0, files)], dtype=CHUNK_DTYPE),
        "first_child": derive_first_child(entries["parent"]).view(np.uint8),
        "file_order": np.arange(1 + dirs, count, dtype=DERIVED_DTYPE).view(np.uint8),
    }
    (dest / "chunks").mkdir(parents=True)
    with open(dest / chunk_file_name(0), "wb") as chunk:
        chunk.write(pack_chunk_header(0, 0))
        chunk.write(CONTENT * files)
    write_index_atomically(dest, _serialise(arrays, [{"name": "spread", "replicated": False, "patterns": []}],
                                            [{"id": 0, "spec": "none", "dictionary": None}], {}))
    return dest
