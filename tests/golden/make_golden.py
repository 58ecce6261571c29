"""Writes the golden fixtures of one format version, once, when that version was made; NEVER re-run to "fix" a
failing golden test: a failing golden test means the code no longer reads datasets that exist in the wild. It
refuses to overwrite a version that exists.

    python tests/golden/make_golden.py v1      # format 1.0: a dataset and one blob per codec
    python tests/golden/make_golden.py v1.1    # format 1.1: a dataset with large files stored in blocks
    python tests/golden/make_golden.py v1.1-auto   # format 1.1: a --codec auto pack, per-kind dictionaries
    python tests/golden/make_golden.py v1.2    # format 1.2: v1.1's tree, with the stored first_child and file_order
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from compressors import codec_from_spec, train_dictionary  # noqa: E402
from fanstore import PackOptions, pack  # noqa: E402

FIXED_MTIME_NS = 1_700_000_000_123_456_789
CODEC_SPECS = ["none", "zstd:3", "zstd:19", "lz4", "lz4:hc:9", "blosc:lz4:5:shuffle:4", "blosc:zstd:5:bitshuffle:4",
               "zstd-dict:3"]


def _source_tree(root: Path) -> None:
    rng = np.random.default_rng(2024)
    (root / "train" / "a").mkdir(parents=True)
    (root / "train" / "b").mkdir(parents=True)
    (root / "val" / "a").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    for i in range(12):
        text = f"sample {i}: label={i % 2} " + "features " * (i + 3)
        (root / "train" / ("a" if i % 2 else "b") / f"s{i:02d}.txt").write_text(text)
    for i in range(3):
        (root / "val" / "a" / f"v{i}.txt").write_text(f"validation sample {i} " * 5)
    np.save(root / "field.npy", np.sin(np.linspace(0, 8, 2048, dtype=np.float32)))
    (root / "noise.bin").write_bytes(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
    (root / "empty.txt").write_bytes(b"")
    (root / "ünïcode naïve.txt").write_text("non-ascii name\n")
    os.symlink("field.npy", root / "link_to_field")
    for path in sorted(root.rglob("*"), reverse=True):
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))


def _manifest(root: Path) -> dict[str, dict]:
    result = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = path.relative_to(root).as_posix()
        row = {"mode": st.st_mode, "mtime_ns": st.st_mtime_ns}
        if stat.S_ISLNK(st.st_mode):
            row["link"] = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            row["size"] = st.st_size
            row["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        result[rel] = row
    return result


def _write_v1(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        _source_tree(src)
        pack(src, out / "dataset", PackOptions(codec="zstd-dict:3", chunk_size=4096, replicate=("val/**",),
                                              workers=1))
        (out / "manifest.json").write_text(json.dumps(_manifest(src), indent=1, sort_keys=True) + "\n")
    # One stored blob per codec spec, decoded in every test run (as numcodecs does with its fixtures).
    raw = np.cumsum(np.random.default_rng(1).standard_normal(4096)).astype(np.float32).tobytes()
    samples = [f'{{"id": {i}, "kind": "golden", "value": {i * 7 % 13}}}'.encode() for i in range(400)]
    dictionary = train_dictionary(samples, dict_size=4096, level=3)
    (out / "codecs").mkdir()
    (out / "codecs" / "raw.bin").write_bytes(raw)
    (out / "codecs" / "zstd-dict.dict").write_bytes(dictionary)
    for spec in CODEC_SPECS:
        codec = codec_from_spec(spec, dictionary=dictionary if spec.startswith("zstd-dict") else None)
        (out / "codecs" / f"{spec.replace(':', '_')}.blob").write_bytes(codec.encode(raw))


def _blocks_tree(root: Path) -> None:
    """v1's tree plus files stored in blocks of 4 KiB (above 8 KiB): compressible, random (blocks stored raw),
    text, one exactly on a block boundary, and one in the replicated group."""
    _source_tree(root)
    rng = np.random.default_rng(2025)
    (root / "large").mkdir()
    (root / "large" / "field.f32").write_bytes(np.cumsum(rng.standard_normal(9000)).astype(np.float32).tobytes())
    (root / "large" / "noise.bin").write_bytes(rng.integers(0, 256, 3 * 4096 + 100, dtype=np.uint8).tobytes())
    (root / "large" / "exact.bin").write_bytes(bytes(range(256)) * 64)  # 4 blocks exactly
    (root / "large" / "log.txt").write_text("".join(f"step {i} loss {1 / (i + 1):.6f}\n" for i in range(700)))
    (root / "val" / "a" / "big_val.txt").write_text("validation " * 1500)
    for path in sorted(root.rglob("*"), reverse=True):
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))


def _write_v1_1(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        _blocks_tree(src)
        pack(src, out / "dataset", PackOptions(codec="zstd-dict:3", chunk_size=8192, replicate=("val/**",),
                                              block_size=4096, blocks_above=8192, workers=1))
        (out / "manifest.json").write_text(json.dumps(_manifest(src), indent=1, sort_keys=True) + "\n")


def _auto_tree(root: Path) -> None:
    """Several kinds in two groups, many small similar files of each, so that a --codec auto pack trains a
    dictionary per kind (dict.N.KIND); a text file large enough to be stored in blocks."""
    import io

    from PIL import Image

    rng = np.random.default_rng(2026)
    for split, count in (("train", 20), ("val", 4)):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                record = {"id": i, "split": split, "class": label, "label": int(rng.integers(0, 10)),
                          "weight": round(float(rng.random()), 4), "tags": ["golden", "fixture", label],
                          "caption": f"sample {i} of class {label} in {split}"}
                (folder / f"s{i:03d}.json").write_text(json.dumps(record, indent=1) + "\n")
                wave = np.sin(np.linspace(0, rng.uniform(1, 6), 96)) * 50 + 300
                np.save(folder / f"f{i:03d}.npy", wave.astype(np.float32))
            y, x = np.mgrid[0:24, 0:24]
            pixels = ((np.sin(x / 3 + rng.uniform()) + np.cos(y / 4)) * 60 + 128).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / "mean.png")
            jpeg = io.BytesIO()
            Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(jpeg, format="JPEG", quality=85)
            (folder / "mean.jpg").write_bytes(jpeg.getvalue())
    (root / "train" / "log.txt").write_text("".join(f"step {i} loss {1 / (i + 1):.6f}\n" for i in range(900)))
    (root / "empty.txt").write_bytes(b"")
    os.symlink("train/log.txt", root / "latest_log")
    for path in sorted(root.rglob("*"), reverse=True):
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))


def _write_v1_1_auto(out: Path) -> None:
    """Budget 0: the best ratio per kind, whatever this machine's speeds (they are recorded, not used)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        _auto_tree(src)
        pack(src, out / "dataset", PackOptions(codec="auto", budget=0.0, sample=1.0, chunk_size=8192,
                                              replicate=("val/**",), block_size=4096, blocks_above=8192, workers=1))
        (out / "manifest.json").write_text(json.dumps(_manifest(src), indent=1, sort_keys=True) + "\n")


def _write_v1_2(out: Path) -> None:
    """v1.1's tree and options: what 1.2 adds (first_child, file_order) is stored whatever the tree."""
    _write_v1_1(out)


def main() -> None:
    writers = {"v1": _write_v1, "v1.1": _write_v1_1, "v1.1-auto": _write_v1_1_auto, "v1.2": _write_v1_2}
    if len(sys.argv) != 2 or sys.argv[1] not in writers:
        sys.exit(f"usage: make_golden.py {{{'|'.join(writers)}}}")
    out = HERE / sys.argv[1]
    if out.exists():
        sys.exit(f"{out} exists: golden fixtures are written once and never regenerated")
    out.mkdir()
    writers[sys.argv[1]](out)


if __name__ == "__main__":
    main()
