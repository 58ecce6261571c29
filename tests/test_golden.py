"""Datasets written by format v1 must read forever: a committed v1 dataset and v1 codec blobs, read every run.

If this fails, the change broke old datasets. Do not regenerate the fixture; fix the code (or bump the major
version, keep a reader for v1, and add a v2 fixture beside this one).
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from compressors import codec_from_spec
from fanstore import open_dataset
from fanstore.verify import verify_dataset

GOLDEN = Path(__file__).resolve().parent / "golden" / "v1"
SPECS = ["none", "zstd:3", "zstd:19", "lz4", "lz4:hc:9", "blosc:lz4:5:shuffle:4", "blosc:zstd:5:bitshuffle:4",
         "zstd-dict:3"]


def test_golden_dataset_reads_as_packed():
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    with open_dataset(GOLDEN / "dataset") as ds:
        assert ds.index.toc["version"] == "1.0"
        assert [g["name"] for g in ds.index.groups] == ["spread", "replicated"]
        assert ds.index.codecs[1]["spec"] == "zstd-dict:3"
        seen = set()
        for dirpath, dirnames, filenames in ds.walk():
            for name in dirnames + filenames:
                seen.add(f"{dirpath}/{name}" if dirpath else name)
        assert seen == set(manifest)
        for path, row in manifest.items():
            st = ds.stat(path, follow_symlinks=False)
            assert (st.st_mode, st.st_mtime_ns) == (row["mode"], row["mtime_ns"]), path
            if stat.S_ISLNK(row["mode"]):
                assert ds.readlink(path) == row["link"]
            elif stat.S_ISREG(row["mode"]):
                data = ds.read(path)
                assert len(data) == row["size"] and hashlib.sha256(data).hexdigest() == row["sha256"], path
        assert verify_dataset(ds).ok


@pytest.mark.parametrize("spec", SPECS)
def test_golden_codec_blobs_decode(spec):
    raw = (GOLDEN / "codecs" / "raw.bin").read_bytes()
    dictionary = (GOLDEN / "codecs" / "zstd-dict.dict").read_bytes() if spec.startswith("zstd-dict") else None
    codec = codec_from_spec(spec, dictionary=dictionary)
    stored = (GOLDEN / "codecs" / f"{spec.replace(':', '_')}.blob").read_bytes()
    assert codec.decode(stored, len(raw)) == raw
