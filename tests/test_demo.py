"""`fanstore demo`, the main job, runs end to end through the real CLI and checks every file it packed."""

from __future__ import annotations

import re

import pytest

from conftest import run_cli
from fanstore import open_dataset
from fanstore.mount import fuse_unavailable_reason


def test_demo_packs_mounts_reads_back_and_trains(tmp_path):
    proc = run_cli("demo", "--workdir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "demo OK: every file matches its original" in out
    assert "through the API: 0 differ from the original or are missing" in out
    for row in ("plain directory (warm)", "fanstore API (decompress)"):
        assert row in out
    with open_dataset(tmp_path / "dataset") as ds:
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
    assert not (tmp_path / "mnt").is_mount()


def test_demo_without_the_mount(tmp_path):
    proc = run_cli("demo", "--workdir", str(tmp_path), "--no-mount", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo OK" in proc.stdout and "through the mount" not in proc.stdout
