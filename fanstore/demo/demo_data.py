"""A small but realistic training set built from real images that installed packages ship.

The demo and the benchmarks need data that compresses like a real training set does (PNG digits, JPEG photo
crops, smooth float32 simulation fields), with the awkward cases a packer must keep (an empty class directory,
a relative symlink), and identical bytes on every run so that results can be compared between runs and machines
with the same package versions. Nothing is downloaded: scikit-learn ships the digits and the two sample photos.
"""

from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image as PILImage

# Every random choice derives from this seed and a fixed part number, so each part of the tree is reproducible
# on its own and a larger `scale` only appends files: the crops and fields of scale=1 are the first ones of scale=2.
_SEED = 20170524
_PART_DIGITS, _PART_PHOTOS, _PART_FIELDS = 1, 2, 3

_VAL_FRACTION = 0.2
_DIGIT_SIZE = 32
_PHOTOS_PER_SCALE = 60
_VAL_PHOTO_EVERY = 6  # every 6th crop goes to val/photos: 10 of 60
_CROP_MIN, _CROP_MAX = 64, 224
_JPEG_QUALITY = 90
_FIELDS_PER_SCALE = 24
_FIELD_MIN, _FIELD_MAX = 128, 256
_PNG_COMPRESS_LEVEL = 6  # Pillow's default, pinned so a changed default cannot change the bytes

_README_MARKER = "fanstore demo training set"
EMPTY_CLASS = "val/empty_class"
SYMLINK_NAME = "latest_field.npy"
SYMLINK_TARGET = "science/field_000.npy"


@dataclass(frozen=True, slots=True)
class DemoTree:
    """What `build_demo_tree` wrote: `files` and `bytes` count regular files only (not the symlink or dirs)."""

    root: Path
    files: int
    bytes: int


def build_demo_tree(root: Path, scale: int = 1) -> DemoTree:
    """Builds the demo training set under `root` (created if missing) and returns what was written.

    Layout (torchvision ImageFolder): train/<digit>/NNNNN.png and val/<digit>/NNNNN.png (scikit-learn's 1,797
    digits at 32x32, ~80/20 split per class), train/photos/ and val/photos/ (60*scale JPEG crops of the sample
    photos), science/field_NNN.npy (24*scale float32 fields), labels.txt (train image -> class), README.txt,
    an empty val/empty_class/ and the relative symlink latest_field.npy -> science/field_000.npy.

    `root` must be missing, empty, or a tree this function built before (which is replaced): never anything else,
    so a mistyped path cannot delete someone's data. Raises RuntimeError naming scikit-learn or Pillow if missing.
    """
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a positive integer, got {scale!r}")
    load_digits, load_sample_images = _import_sklearn()
    image_module = _import_pillow()

    root = Path(root)
    _prepare_root(root)

    written: dict[str, int] = {}  # relative posix path -> size
    labels: list[tuple[str, str]] = []  # training images only
    _write_digits(root, load_digits, image_module, written, labels)
    _write_photos(root, load_sample_images, image_module, scale, written, labels)
    _write_fields(root, scale, written)

    (root / EMPTY_CLASS).mkdir(parents=True, exist_ok=True)
    os.symlink(SYMLINK_TARGET, root / SYMLINK_NAME)

    labels.sort()
    _write(root, "labels.txt", "".join(f"{path}\t{label}\n" for path, label in labels).encode(), written)
    _write(root, "README.txt", _readme(scale, written, len(labels)).encode(), written)
    return DemoTree(root=root, files=len(written), bytes=sum(written.values()))


def _import_sklearn() -> tuple[Any, Any]:
    """Imported here, not at module level, so `import fanstore.demo.demo_data` works without the demo extras."""
    try:
        from sklearn.datasets import load_digits, load_sample_images
    except ImportError as exc:
        raise RuntimeError(
            "the demo dataset needs scikit-learn, which is not installed: pip install 'fanstore[demo]' "
            f"(or pip install scikit-learn) [{exc}]"
        ) from exc
    return load_digits, load_sample_images


def _import_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise RuntimeError(
            "the demo dataset needs Pillow, which is not installed: pip install 'fanstore[demo]' "
            f"(or pip install pillow) [{exc}]"
        ) from exc
    return Image


def _prepare_root(root: Path) -> None:
    """Replaces an earlier demo tree (so `fanstore demo --workdir W` can run twice) but refuses any other data."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise FileExistsError(f"{root} exists and is not a directory; the demo tree needs a directory")
    if root.is_dir() and any(root.iterdir()):
        readme = root / "README.txt"
        is_ours = readme.is_file() and readme.read_text(encoding="utf-8", errors="replace").startswith(_README_MARKER)
        if not is_ours:
            raise FileExistsError(f"{root} is not empty and is not a fanstore demo tree; refusing to overwrite it")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)


def _rng(part: int) -> np.random.Generator:
    return np.random.default_rng([_SEED, part])


def _write(root: Path, rel: str, data: bytes, written: dict[str, int]) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    written[rel] = len(data)


def _encode(image: PILImage.Image, **save_args: Any) -> bytes:
    """Encodes in memory: Pillow writes no timestamps into PNG or JPEG unless asked, so the bytes are stable."""
    buffer = io.BytesIO()
    image.save(buffer, **save_args)
    return buffer.getvalue()


def _write_digits(
    root: Path, load_digits: Any, image_module: Any, written: dict[str, int], labels: list[tuple[str, str]]
) -> None:
    """All 1,797 digits at every scale: the many-small-files half of a training set. Split 80/20 per class."""
    digits = load_digits()
    pixels = np.clip(np.rint(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    targets = np.asarray(digits.target)
    rng = _rng(_PART_DIGITS)
    in_val = np.zeros(len(targets), dtype=bool)
    for label in range(10):  # stratified, so every class has val images
        members = np.flatnonzero(targets == label)
        chosen = rng.permutation(members)[: int(round(len(members) * _VAL_FRACTION))]
        in_val[chosen] = True
    bilinear = image_module.Resampling.BILINEAR
    for index in range(len(targets)):
        label = str(int(targets[index]))
        image = image_module.fromarray(pixels[index]).resize((_DIGIT_SIZE, _DIGIT_SIZE), bilinear)
        rel = f"{'val' if in_val[index] else 'train'}/{label}/{index:05d}.png"
        _write(root, rel, _encode(image, format="PNG", optimize=False, compress_level=_PNG_COMPRESS_LEVEL), written)
        if not in_val[index]:
            labels.append((rel, label))


def _write_photos(
    root: Path,
    load_sample_images: Any,
    image_module: Any,
    scale: int,
    written: dict[str, int],
    labels: list[tuple[str, str]],
) -> None:
    """Photo crops of 64..224 px re-encoded as JPEG: the already-compressed files that a packer must not bloat."""
    samples = load_sample_images()
    photos = [(Path(name).stem, np.asarray(image, dtype=np.uint8)) for name, image in
              sorted(zip(samples.filenames, samples.images), key=lambda item: Path(item[0]).name)]
    rng = _rng(_PART_PHOTOS)
    counters = {name: 0 for name, _ in photos}
    for crop_index in range(_PHOTOS_PER_SCALE * scale):
        name, photo = photos[crop_index % len(photos)]
        height, width = photo.shape[:2]
        size = int(rng.integers(_CROP_MIN, min(_CROP_MAX, height, width) + 1))
        top = int(rng.integers(0, height - size + 1))
        left = int(rng.integers(0, width - size + 1))
        crop = image_module.fromarray(np.ascontiguousarray(photo[top : top + size, left : left + size]))
        split = "val" if crop_index % _VAL_PHOTO_EVERY == _VAL_PHOTO_EVERY - 1 else "train"
        rel = f"{split}/photos/{name}_{counters[name]:03d}.jpg"
        counters[name] += 1
        data = _encode(crop, format="JPEG", quality=_JPEG_QUALITY, subsampling="4:2:0", optimize=False,
                       progressive=False)
        _write(root, rel, data, written)
        if split == "train":
            labels.append((rel, "photos"))


def _write_fields(root: Path, scale: int, written: dict[str, int]) -> None:
    """Smooth float32 fields (Gaussian bumps + waves + a little noise): what simulation outputs compress like."""
    rng = _rng(_PART_FIELDS)
    for field_index in range(_FIELDS_PER_SCALE * scale):
        height, width = (int(n) for n in rng.integers(_FIELD_MIN // 16, _FIELD_MAX // 16 + 1, size=2) * 16)
        y = np.linspace(0.0, 1.0, height)[:, None]
        x = np.linspace(0.0, 1.0, width)[None, :]
        field = np.zeros((height, width))
        for _ in range(int(rng.integers(3, 7))):
            amplitude, cy, cx = rng.uniform(-1.0, 1.0), rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
            sigma = rng.uniform(0.05, 0.25)
            field += amplitude * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2.0 * sigma**2))
        for _ in range(int(rng.integers(1, 3))):
            amplitude, ky, kx, phase = rng.uniform(0.05, 0.3), rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform(0, 6.3)
            field += amplitude * np.sin(2.0 * np.pi * (ky * y + kx * x) + phase)
        field += rng.normal(0.0, 0.01, size=(height, width))
        buffer = io.BytesIO()
        np.save(buffer, field.astype(np.float32), allow_pickle=False)
        _write(root, f"science/field_{field_index:03d}.npy", buffer.getvalue(), written)


def _readme(scale: int, written: dict[str, int], train_images: int) -> str:
    def count(prefix: str, suffix: str) -> int:
        return sum(1 for rel in written if rel.startswith(prefix) and rel.endswith(suffix))

    return (
        f"{_README_MARKER} (scale={scale}), built by fanstore.demo_data.build_demo_tree; same bytes every run.\n"
        f"train/<digit>/, val/<digit>/: {count('train/', '.png')} + {count('val/', '.png')} scikit-learn digits, "
        f"{_DIGIT_SIZE}x{_DIGIT_SIZE} grayscale PNG.\n"
        f"train/photos/, val/photos/: {count('train/photos/', '.jpg')} + {count('val/photos/', '.jpg')} crops of "
        f"scikit-learn's sample photos, JPEG quality {_JPEG_QUALITY}.\n"
        f"science/: {count('science/', '.npy')} float32 2-D simulation-like fields (numpy .npy).\n"
        f"labels.txt: {train_images} lines, training image path<TAB>class.\n"
        f"{EMPTY_CLASS}/ is empty on purpose; {SYMLINK_NAME} is a relative symlink to {SYMLINK_TARGET}.\n"
    )
