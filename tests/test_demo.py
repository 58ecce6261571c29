"""`fanstore demo`, the main job, runs end to end through the real CLI and checks every file it packed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from fanstore import open_dataset
from fanstore.mount.mount import fuse_unavailable_reason

TORCH_MISSING = "torch is not installed (scripts/setup installs torch==2.13.0+cpu)"
# A row of the PyTorch table: reader, train+val images, per-epoch "seconds (wait)", accuracy, weights digest.
TORCH_ROW = re.compile(r"^(original directory|fanstore\.torch \(API\)|fanstore mount)\s+([\d,]+)\+([\d,]+)"
                       r"((?:\s+[\d.]+ \([\d.]+\))+)\s+([\d.]+)%\s+([0-9a-f]{16})$", re.MULTILINE)

# `fanstore ARGS` as where torch is not installed: `import torch` fails as it would there.
WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from fanstore.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One full demo (mount, serve and PyTorch run included), shared by the tests that read its output."""
    workdir = tmp_path_factory.mktemp("demo")
    return workdir, run_cli("demo", "--workdir", str(workdir), timeout=600)


def test_demo_packs_mounts_reads_back_and_trains(demo_run):
    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "demo OK: every file matches its original" in out
    assert "through the API: 0 differ from the original or are missing" in out
    for row in ("plain directory (warm)", "fanstore API (decompress)"):
        assert row in out
    with open_dataset(workdir / "dataset") as ds:
        assert [g["name"] for g in ds.index.groups] == ["spread", "replicated"]
        replicated = ds.index.chunks["group"] == 1
        assert replicated.any() and (~replicated).any()
        assert len(ds) > 1000
        assert ds.listdir("val/empty_class") == []
    if fuse_unavailable_reason() is not None:
        pytest.skip(f"the demo's mount part needs FUSE: {fuse_unavailable_reason()}")
    assert "through the mount: 0 differ from the original or are missing" in out
    for row in ("fanstore mount, 1st epoch (decode)", "fanstore mount, 2nd epoch (kernel cache)"):
        assert row in out
    models = re.findall(r"accuracy ([\d.]+)%, model ([0-9a-f]{16})", out)
    assert len(models) == 2 and models[0] == models[1], out  # the same model from the original and the mount
    assert float(models[0][0]) > 80  # nearest centroids on digits: a real model, not noise
    assert not (workdir / "mnt").is_mount()


def test_demo_trains_the_same_cnn_from_every_reader(demo_run):
    """The PyTorch run: the same seed gives the same accuracy and weights from the original directory, through
    fanstore.torch and through the mount, with every epoch timed."""
    pytest.importorskip("torch", reason=TORCH_MISSING)
    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = TORCH_ROW.findall(proc.stdout)
    expected = ["original directory", "fanstore.torch (API)"]
    if fuse_unavailable_reason() is None:
        expected.append("fanstore mount")
    assert [row[0] for row in rows] == expected, proc.stdout
    assert len({(train_images, val_images) for _, train_images, val_images, *_ in rows}) == 1, proc.stdout
    assert int(rows[0][1].replace(",", "")) > 1000 and int(rows[0][2].replace(",", "")) > 300, proc.stdout
    assert all(len(re.findall(r"\(", epochs)) == 3 for _, _, _, epochs, *_ in rows), proc.stdout
    assert len({(accuracy, digest) for *_, accuracy, digest in rows}) == 1, proc.stdout
    assert float(rows[0][4]) > 80, proc.stdout  # a real model, not noise
    assert "same accuracy and weights from every reader" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_demo_without_the_mount_or_torch(tmp_path):
    """Without torch the demo still runs: one line says how to install it, and the PyTorch run is skipped."""
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "demo", "--workdir", str(tmp_path), "--no-mount"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo OK" in proc.stdout and "through the mount" not in proc.stdout
    skipped = [line for line in proc.stdout.splitlines() if "PyTorch" in line]
    assert skipped == ["skipping the PyTorch run: torch is not installed; for the CPU build: "
                       "pip install torch --index-url https://download.pytorch.org/whl/cpu"], proc.stdout
    assert not TORCH_ROW.search(proc.stdout)


def _count(text: str) -> int:
    return int(text.replace(",", ""))


def test_demo_explains_its_counts_in_its_own_words(demo_run):
    """Was: 1,438+359 images in one table, 1,488+369 in the next, 1,884 files read on each rank beside 1,883
    packed, and more blobs read than files, each unexplained. Now the tree's line splits its files into the parts
    each later count is made of, the two training tables say which images they read, and each rank sums where its
    blobs came from."""
    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    tree = re.search(r"^  ([\d,]+) files, \S+ [kMG]?B: ([\d,]+) digit PNGs and ([\d,]+) photo crops, ([\d,]+) in "
                     r"train/ and ([\d,]+) in val/; ([\d,]+) float32 fields in science/; ([\d,]+) other files "
                     r"\(labels\.txt, README\.txt\); and 1 symlink$", out, re.M)
    assert tree, out
    files, digits, photos, train, val, fields, other = map(_count, tree.groups())
    assert files == digits + photos + fields + other and digits + photos == train + val, tree[0]
    assert re.search(rf"^  {tree[1]} files, \S+ [kMG]?B -> \S+ [kMG]?B \(ratio [\d.]+x\) in 2 chunks, ", out, re.M)
    if fuse_unavailable_reason() is not None:
        pytest.skip(f"the demo's mount part needs FUSE: {fuse_unavailable_reason()}")
    digits_only = re.search(r"it classifies the digit PNGs only, ([\d,]+) in train/ and ([\d,]+) in val/$", out, re.M)
    assert digits_only and _count(digits_only[1]) + _count(digits_only[2]) == digits, out
    assert len(re.findall(rf" {digits_only[1]} train \+ {digits_only[2]} val images, ", out)) == 2, out
    if TORCH_ROW.search(out):  # every class folder: digits and photos, the tree's train/ and val/ images
        assert {(_count(t), _count(v)) for _, t, v, *_ in TORCH_ROW.findall(out)} == {(train, val)}, out
        assert "the images of every class folder, the 10 digits and photos/" in out
    ranks = re.findall(r"^  rank (\d): read ([\d,]+) files and 1 symlink, 0 differ; blobs: ([\d,]+) from its local "
                       r"chunks \+ ([\d,]+) from rank \d \+ ([\d,]+) from DEST = ([\d,]+)(.*)$", out, re.M)
    if "skipping fanstore serve" in out:
        return
    assert [rank for rank, *_ in ranks] == ["0", "1"], out
    for _, read, local, peer, dest, total, more in ranks:
        assert _count(read) == files and _count(local) + _count(peer) + _count(dest) == _count(total), out
        assert _count(total) == files or more.startswith(f" ({_count(total) - files:,} more than the files'"), out
    assert f"A blob is what a read fetches: a file stored whole, or one block of a large one (no file here is " \
           f"stored in blocks: {files:,} blobs)." in out, out
