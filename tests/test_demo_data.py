"""The demo training set: same bytes every build, the ImageFolder layout torchvision expects, and the awkward
cases (empty class directory, relative symlink) that packing must keep."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import tree_digest
from fanstore.demo.demo_data import DemoTree, build_demo_tree

PIL_Image = pytest.importorskip("PIL.Image")
pytest.importorskip("sklearn.datasets")

DIGIT_CLASSES = {str(d) for d in range(10)}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> DemoTree:
    return build_demo_tree(tmp_path_factory.mktemp("demo") / "tree")


def test_two_builds_are_byte_identical(built, tmp_path):
    again = build_demo_tree(tmp_path / "again")
    first, second = tree_digest(built.root), tree_digest(again.root)
    assert first == second
    assert (again.files, again.bytes) == (built.files, built.bytes)
    assert first["latest_field.npy"] == "link:science/field_000.npy"


def test_counts_match_what_is_on_disk(built):
    regular = [p for p in built.root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert built.files == len(regular)
    assert built.bytes == sum(p.stat().st_size for p in regular)
    assert 1800 <= built.files <= 2500
    assert 5_000_000 <= built.bytes <= 20_000_000


def test_image_folder_layout(built):
    root = built.root
    train_classes = {p.name for p in (root / "train").iterdir() if p.is_dir()}
    val_classes = {p.name for p in (root / "val").iterdir() if p.is_dir()}
    assert train_classes == DIGIT_CLASSES | {"photos"}
    assert val_classes == DIGIT_CLASSES | {"photos", "empty_class"}

    pngs = sorted(root.glob("*/*/*.png"))
    assert len(pngs) == 1797
    train_pngs = [p for p in pngs if p.parts[-3] == "train"]
    assert 0.75 <= len(train_pngs) / len(pngs) <= 0.85
    for cls in DIGIT_CLASSES:  # every class has images on both sides of the split
        assert any((root / "train" / cls).iterdir()) and any((root / "val" / cls).iterdir())
    for path in pngs[::60]:
        with PIL_Image.open(path) as image:
            assert image.format == "PNG" and image.size == (32, 32) and image.mode == "L"
            assert image.getextrema()[1] > 128  # scaled to 0..255, not left at sklearn's 0..16

    jpgs = sorted(root.glob("*/photos/*.jpg"))
    assert 50 <= len(jpgs) <= 70
    assert 0 < len(list((root / "val" / "photos").iterdir())) < len(list((root / "train" / "photos").iterdir()))
    assert {p.name.rsplit("_", 1)[0] for p in jpgs} == {"china", "flower"}
    for path in jpgs:
        with PIL_Image.open(path) as image:
            image.load()
            assert image.format == "JPEG" and image.mode == "RGB"
            assert 64 <= image.size[0] == image.size[1] <= 224


def test_science_fields_are_smooth_float32_2d(built):
    fields = sorted((built.root / "science").glob("field_*.npy"))
    assert 20 <= len(fields) <= 30
    for path in fields:
        array = np.load(path, allow_pickle=False)
        assert array.dtype == np.float32 and array.ndim == 2
        assert all(128 <= n <= 256 for n in array.shape)
        assert np.isfinite(array).all()
        # Smooth: neighbouring values differ far less than the field varies overall (white noise gives ~1.13).
        assert np.abs(np.diff(array, axis=1)).mean() < 0.3 * array.std()


def test_labels_point_at_existing_training_images(built):
    root = built.root
    lines = (root / "labels.txt").read_text(encoding="utf-8").splitlines()
    train_images = {p.relative_to(root).as_posix() for p in (root / "train").rglob("*") if p.is_file()}
    listed = {}
    for line in lines:
        path, label = line.split("\t")
        assert (root / path).is_file()
        assert path.split("/")[1] == label
        listed[path] = label
    assert len(listed) == len(lines)
    assert set(listed) == train_images
    assert (root / "README.txt").read_text(encoding="utf-8").strip()


def test_empty_dir_and_relative_symlink(built):
    root = built.root
    empty = root / "val" / "empty_class"
    assert empty.is_dir() and not any(empty.iterdir())
    link = root / "latest_field.npy"
    assert link.is_symlink()
    target = os.readlink(link)
    assert not os.path.isabs(target)
    resolved = link.resolve()
    assert resolved.is_file() and resolved.is_relative_to(root.resolve())
    assert resolved == (root / "science" / "field_000.npy").resolve()


def test_scale_adds_photos_and_fields_but_not_digits(built, tmp_path):
    bigger = build_demo_tree(tmp_path / "x2", scale=2)
    root = bigger.root
    assert len(list(root.glob("*/*/*.png"))) == 1797
    assert len(list(root.glob("*/photos/*.jpg"))) == 2 * len(list(built.root.glob("*/photos/*.jpg")))
    assert len(list(root.glob("science/*.npy"))) == 2 * len(list(built.root.glob("science/*.npy")))
    # The scale=1 files are a prefix of the scale=2 ones, so benchmarks at different scales share data.
    assert (root / "science" / "field_000.npy").read_bytes() == (built.root / "science" / "field_000.npy").read_bytes()


def test_rebuilds_over_its_own_tree_but_refuses_other_data(built, tmp_path):
    target = tmp_path / "tree"
    build_demo_tree(target)
    (target / "stale.bin").write_bytes(b"left over")
    rebuilt = build_demo_tree(target)
    assert not (target / "stale.bin").exists()
    assert tree_digest(target) == tree_digest(built.root)
    assert rebuilt.files == built.files

    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_demo_tree(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(("module", "package"), [("sklearn", "scikit-learn"), ("PIL", "Pillow")])
def test_missing_package_is_named(module, package, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(RuntimeError, match=package):
        build_demo_tree(tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_bad_scale(tmp_path):
    with pytest.raises(ValueError):
        build_demo_tree(tmp_path / "t", scale=0)
