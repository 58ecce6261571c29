"""A plain-Python training loop over an ImageFolder tree, written the way user code reads files: `os.scandir`
and `open` on a path, nothing fanstore-specific. The demo runs it on the original directory and on the mount and
shows that both give the same model, which is the point of the mount: training code does not change.

The model is a nearest-centroid classifier of the digit images (train/<digit>/*.png, val/<digit>/*.png), small
enough to train in a second, real enough that every byte read matters to the result.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CLASSES = tuple(str(digit) for digit in range(10))


@dataclass(frozen=True, slots=True)
class TrainingResult:
    train_images: int
    val_images: int
    accuracy: float
    centroid_digest: str  # equal digests: equal models, whatever directory the images came from


def _images(split_dir: Path) -> list[tuple[Path, int]]:
    """(path, label) for every PNG of every digit class, as torchvision's ImageFolder lists them."""
    samples = []
    for label, name in enumerate(CLASSES):
        with os.scandir(split_dir / name) as listing:
            samples += [(Path(item.path), label) for item in listing if item.name.endswith(".png")]
    return sorted(samples)


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with open(path, "rb") as f:  # what a DataLoader worker does: open, read, decode
        image = Image.open(io.BytesIO(f.read()))
        return np.asarray(image.convert("L"), dtype=np.float32).ravel() / 255.0


def train_and_evaluate(root: Path) -> TrainingResult:
    """One epoch over train/ to fit the centroids, one over val/ to score them."""
    train = _images(root / "train")
    sums: dict[int, np.ndarray] = {}
    counts = np.zeros(len(CLASSES), dtype=np.int64)
    for path, label in train:
        pixels = _pixels(path)
        sums[label] = sums.get(label, 0) + pixels
        counts[label] += 1
    centroids = np.stack([sums[label] / counts[label] for label in range(len(CLASSES))])
    val = _images(root / "val")
    correct = 0
    for path, label in val:
        distances = ((centroids - _pixels(path)) ** 2).sum(axis=1)
        correct += int(distances.argmin() == label)
    digest = hashlib.sha256(centroids.tobytes()).hexdigest()[:16]
    return TrainingResult(len(train), len(val), correct / len(val) if val else 0.0, digest)
