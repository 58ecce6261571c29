"""Generated trees (odd names, empty files and directories, deep paths, sizes around the chunk size) survive a
pack and read back byte for byte."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import dataset_digest, tree_digest
from fanstore import PackOptions, open_dataset, pack

CHUNK = 4096

names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\\x00"),
    min_size=1,
    max_size=24,
).filter(lambda n: n not in (".", "..") and len(n.encode("utf-8")) <= 255)

sizes = st.one_of(
    st.sampled_from([0, 1, CHUNK - 33, CHUNK - 32, CHUNK - 31, CHUNK, CHUNK + 1, 3 * CHUNK]),
    st.integers(min_value=0, max_value=3 * CHUNK),
)
file_spec = st.tuples(sizes, st.integers(0, 2**32 - 1), st.booleans())  # size, seed, compressible

tree_spec = st.recursive(
    st.dictionaries(names, file_spec, max_size=4),
    lambda children: st.dictionaries(names, st.one_of(file_spec, children), max_size=4),
    max_leaves=24,
)


def _materialise(root: Path, spec: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, value in spec.items():
        path = root / name
        if isinstance(value, dict):
            _materialise(path, value)
        else:
            size, seed, compressible = value
            rng = np.random.default_rng(seed)
            if compressible:
                data = (np.arange(size) // 7 % 13).astype(np.uint8).tobytes()
            else:
                data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            path.write_bytes(data)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tree_spec, codec=st.sampled_from(["zstd:1", "lz4", "zstd-dict:3", "blosc:lz4:5:shuffle"]),
       deep=st.integers(0, 12))
def test_generated_trees_round_trip(spec, codec, deep):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        # A deep chain of directories above part of the tree.
        _materialise(src / os.path.join(*[f"d{i}" for i in range(deep)]) if deep else src, spec)
        src.mkdir(exist_ok=True)
        summary = pack(src, Path(tmp) / "ds", PackOptions(codec=codec, chunk_size=CHUNK, workers=1))
        assert summary.problems == []
        with open_dataset(Path(tmp) / "ds") as ds:
            assert dataset_digest(ds) == tree_digest(src)
            for path in ds.files():
                assert ds.stat(path).st_size == (src / path).stat().st_size
