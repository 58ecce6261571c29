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
from compressors.kinds import HEAD_BYTES, file_kind
from fanstore import open_dataset
from fanstore.core.verify import verify_dataset

GOLDEN = Path(__file__).resolve().parent / "golden" / "v1"
# fixture directory: the format version it was written in
GOLDEN_DATASETS = {"v1": "1.0", "v1.1": "1.1", "v1.1-auto": "1.1", "v1.2": "1.2"}
SPECS = ["none", "zstd:3", "zstd:19", "lz4", "lz4:hc:9", "blosc:lz4:5:shuffle:4", "blosc:zstd:5:bitshuffle:4",
         "zstd-dict:3"]


@pytest.mark.parametrize("fixture, version", sorted(GOLDEN_DATASETS.items()))
def test_golden_dataset_reads_as_packed(fixture, version):
    root = GOLDEN.parent / fixture
    manifest = json.loads((root / "manifest.json").read_text())
    with open_dataset(root / "dataset") as ds:
        assert ds.index.toc["version"] == version
        assert [g["name"] for g in ds.index.groups] == ["spread", "replicated"]
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


@pytest.mark.parametrize("fixture", sorted(GOLDEN_DATASETS))
def test_golden_file_order_and_children_whether_stored_or_derived(fixture):
    """1.2 stores the files in path order and each directory's children (first_child); an older index has them
    derived at open. Either way: every regular file, sorted as Python sorts the paths, and listings by the tree."""
    root = GOLDEN.parent / fixture
    manifest = json.loads((root / "manifest.json").read_text())
    with open_dataset(root / "dataset") as ds:
        index = ds.index
        stored = {"first_child", "file_order"} <= set(index.toc["sections"])
        assert stored == (GOLDEN_DATASETS[fixture] >= "1.2")
        files = sorted(path for path, row in manifest.items() if stat.S_ISREG(row["mode"]))
        assert [index.path_of(int(entry)) for entry in index.files_in_path_order()] == files
        assert len(ds) == len(files)
        parents = index.entries["parent"]
        for entry in range(len(index)):
            assert list(index.children(entry)) == [child for child in range(1, len(index))
                                                   if parents[child] == entry]


@pytest.mark.parametrize("fixture", ["v1", "v1.1", "v1.2"])
def test_golden_dictionary_per_group(fixture):
    """`--codec zstd-dict:3`: group 0's files use dict.0; the replicated group is too small to train one."""
    with open_dataset(GOLDEN.parent / fixture / "dataset") as ds:
        assert ds.index.codecs[1] == {"id": 4, "spec": "zstd-dict:3", "dictionary": "dict.0"}
        assert sorted(ds.index.dictionaries) == ["dict.0"]


def test_golden_auto_pack_has_a_dictionary_per_kind_and_group():
    """The `--codec auto` fixture (1.1): each file's codec row is its kind's choice in its group, a zstd-dict choice
    with the dictionary of that group and kind (dict.N.KIND), or plain zstd where a group had too few files of the
    kind to train one; a text file is stored in blocks of that same row."""
    with open_dataset(GOLDEN.parent / "v1.1-auto" / "dataset") as ds:
        index = ds.index
        assert sorted(index.dictionaries) == ["dict.0.npy", "dict.0.text", "dict.1.npy"]
        choices = {kind: choice["spec"] for kind, choice in index.meta["selection"]["choices"].items()}
        assert choices == {"jpeg": "zstd:19", "npy": "zstd-dict:3", "png": "none", "text": "zstd-dict:19"}
        used = set()
        for path in ds.files():
            entry = index.lookup(path)
            data = ds.read(path)
            if not data:
                continue
            kind, group = file_kind(path, data[:HEAD_BYTES]), int(index.chunks["group"][index.entries["chunk"][entry]])
            rows = {int(index.entries["codec"][entry])}
            if index.block_count(entry):
                rows = {int(row) for row in index.blocks["codec"][index.block_rows(entry).start:
                                                                  index.block_rows(entry).stop]}
            for row in rows - {0}:  # row 0: a file or block that would not shrink, stored as it is
                codec = index.codecs[row]
                if codec["dictionary"] is not None:
                    assert (codec["spec"], codec["dictionary"]) == (choices[kind], f"dict.{group}.{kind}"), path
                else:
                    assert codec["spec"] == choices[kind].replace("zstd-dict", "zstd"), path
                used.add((kind, group, codec["spec"], codec["dictionary"]))
        assert ("text", 1, "zstd:19", None) in used  # val/ holds too few text files to train a dictionary
        log = index.lookup("train/log.txt")
        assert index.block_count(log) == 6 and index.codecs[int(index.blocks["codec"][index.block_rows(log)[2]])][
            "dictionary"] == "dict.0.text"
        whole = ds.read("train/log.txt")
        with ds.open("train/log.txt") as f:
            f.seek(2 * 4096 + 100)
            assert f.read(50) == whole[2 * 4096 + 100 : 2 * 4096 + 150]


def test_golden_blocks_read_one_at_a_time():
    """The 1.1 fixture's large files are stored in 4 KiB blocks, some raw (random bytes), some compressed."""
    with open_dataset(GOLDEN.parent / "v1.1" / "dataset") as ds:
        assert ds.index.block_size == 4096
        blocked = {ds.index.path_of(e) for e in ds.index.iter_files() if ds.index.block_count(e)}
        assert blocked == {"field.npy", "large/field.f32", "large/noise.bin", "large/exact.bin", "large/log.txt",
                           "val/a/big_val.txt"}
        # the replicated group is too small to train a dictionary on: zstd:3 there
        assert {ds.index.codecs[int(c)]["spec"] for c in ds.index.blocks["codec"]} == {"none", "zstd-dict:3", "zstd:3"}
        whole = ds.read("large/field.f32")
        with ds.open("large/field.f32") as f:
            f.seek(3 * 4096 - 10)
            assert f.read(20) == whole[3 * 4096 - 10 : 3 * 4096 + 10]
        assert ds.reader.read_block(ds.index.lookup("large/exact.bin"), 3) == bytes(range(256)) * 16


@pytest.mark.parametrize("spec", SPECS)
def test_golden_codec_blobs_decode(spec):
    raw = (GOLDEN / "codecs" / "raw.bin").read_bytes()
    dictionary = (GOLDEN / "codecs" / "zstd-dict.dict").read_bytes() if spec.startswith("zstd-dict") else None
    codec = codec_from_spec(spec, dictionary=dictionary)
    stored = (GOLDEN / "codecs" / f"{spec.replace(':', '_')}.blob").read_bytes()
    assert codec.decode(stored, len(raw)) == raw
