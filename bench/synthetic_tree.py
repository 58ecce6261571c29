"""A deterministic, ImageNet-like training tree for benchmarks: what a real small-file dataset looks like.

Most files are small photo crops (JPEG, some PNG) cut from the images scikit-learn ships; a few are float32
fields saved as .npy; some are CSV, JSON-lines and label files. Layout: `train/<wnid>/...`, `val/<wnid>/...`.
The same `TreeShape` always gives the same bytes (content, names, mtimes), whatever the number of processes.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

KIB = 1024
IMAGE_MIN, IMAGE_MAX = 2 * KIB, 30 * KIB
FIELD_MIN, FIELD_MAX = 64 * KIB, 1024 * KIB
TEXT_MIN, TEXT_MAX = 1 * KIB, 20 * KIB
PNG_SHARE = 0.15
FIXED_MTIME_NS = 1_700_000_000 * 10**9  # every file and directory gets this mtime: identical trees, identical packs
_SEED = 20240601
_TASKS_PER_BATCH = 500


@dataclass(frozen=True, slots=True)
class TreeShape:
    """How many files of each kind per class and split."""

    classes: int
    train_images: int
    val_images: int
    train_fields: int
    val_fields: int
    train_texts: int
    val_texts: int


@dataclass(frozen=True, slots=True)
class FileTask:
    path: str  # relative, '/'-separated
    kind: str  # "jpeg", "png", "field", "csv", "jsonl", "labels"
    seed: int


def class_names(count: int) -> list[str]:
    """WordNet-id-like directory names (n01440764 style), distinct and sorted."""
    return [f"n{1440764 + 104729 * k:08d}" for k in range(count)]


def plan_files(shape: TreeShape) -> list[FileTask]:
    """Every file of the tree, with the seed that makes its bytes; the plan alone fixes the content."""
    rng = np.random.default_rng(_SEED)
    tasks: list[FileTask] = []
    text_kinds = ("csv", "jsonl", "labels")
    for split, images, fields, texts in (
        ("train", shape.train_images, shape.train_fields, shape.train_texts),
        ("val", shape.val_images, shape.val_fields, shape.val_texts),
    ):
        for wnid in class_names(shape.classes):
            folder = f"{split}/{wnid}"
            for i in range(images):
                kind = "png" if rng.random() < PNG_SHARE else "jpeg"
                suffix = "png" if kind == "png" else "JPEG"
                tasks.append(FileTask(f"{folder}/{wnid}_{i:05d}.{suffix}", kind, len(tasks)))
            for i in range(fields):
                tasks.append(FileTask(f"{folder}/{wnid}_field_{i:03d}.npy", "field", len(tasks)))
            for i in range(texts):
                kind = text_kinds[i % len(text_kinds)]
                suffix = {"csv": "csv", "jsonl": "jsonl", "labels": "txt"}[kind]
                tasks.append(FileTask(f"{folder}/{wnid}_{kind}_{i:03d}.{suffix}", kind, len(tasks)))
    tasks.append(FileTask("labels.txt", "labels", len(tasks)))
    return tasks


# --- file contents ------------------------------------------------------------------------------------------

_photos: list[np.ndarray] = []


def _load_photos() -> list[np.ndarray]:
    if not _photos:
        from sklearn.datasets import load_sample_images

        _photos.extend(load_sample_images().images)
    return _photos


def _encode_crop(photo: np.ndarray, rng: np.random.Generator, side: int, kind: str) -> bytes:
    """A crop of `photo` scaled down to about `side` pixels wide, encoded as JPEG or PNG."""
    from PIL import Image

    height, width = photo.shape[:2]
    out_w = side
    out_h = max(8, int(side * rng.uniform(0.75, 1.33)))
    zoom = rng.uniform(1.0, 2.5)
    crop_w = min(width, int(out_w * zoom))
    crop_h = min(height, int(out_h * zoom))
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    image = Image.fromarray(photo[top : top + crop_h, left : left + crop_w]).resize((out_w, out_h), Image.BILINEAR)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    buffer = io.BytesIO()
    if kind == "png":
        image.save(buffer, "PNG")
    else:
        image.save(buffer, "JPEG", quality=int(rng.integers(80, 96)))
    return buffer.getvalue()


def make_image(rng: np.random.Generator, kind: str) -> bytes:
    """A photo crop of 2-30 KiB: the side is shrunk or grown until the encoded size fits."""
    photos = _load_photos()
    photo = photos[int(rng.integers(len(photos)))]
    side = int(rng.integers(96, 256)) if kind == "jpeg" else int(rng.integers(32, 80))
    for _ in range(20):
        data = _encode_crop(photo, rng, side, kind)
        if len(data) > IMAGE_MAX:
            side = max(8, int(side * 0.8))
        elif len(data) < IMAGE_MIN:
            side = int(side * 1.25) + 1
        else:
            break
    return data


def make_field(rng: np.random.Generator) -> bytes:
    """A smooth 2-D float32 field (a few Fourier modes) saved as .npy, 64 KiB-1 MiB."""
    target = int(np.exp(rng.uniform(np.log(FIELD_MIN), np.log(FIELD_MAX - 4 * KIB))))
    width = 256
    height = max(1, (target - 128) // (4 * width))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) / np.float32(width)
    field = np.zeros((height, width), dtype=np.float32)
    for _ in range(6):
        kx, ky = rng.uniform(-8, 8, size=2)
        field += np.float32(rng.uniform(0.2, 2.0)) * np.sin(np.float32(2 * np.pi) * (kx * x + ky * y)
                                                            + np.float32(rng.uniform(0, 2 * np.pi)))
    field += np.float32(rng.uniform(250, 300))  # like a temperature in kelvin
    buffer = io.BytesIO()
    np.save(buffer, field, allow_pickle=False)
    return buffer.getvalue()


def make_text(rng: np.random.Generator, kind: str, path: str) -> bytes:
    """A CSV, JSON-lines or label file of 1-20 KiB about images in the same folder."""
    target = int(np.exp(rng.uniform(np.log(TEXT_MIN), np.log(TEXT_MAX))))
    stem = path.rsplit("/", 1)[-1].split("_")[0]
    lines = ["image,x0,y0,x1,y1,label,score"] if kind == "csv" else []
    size = 0
    row = 0
    while size < target:
        x0, y0 = rng.integers(0, 300, size=2)
        w, h = rng.integers(16, 200, size=2)
        label = int(rng.integers(0, 1000))
        score = float(rng.uniform(0, 1))
        image = f"{stem}_{row:05d}.JPEG"
        if kind == "csv":
            line = f"{image},{x0},{y0},{x0 + w},{y0 + h},{label},{score:.4f}"
        elif kind == "jsonl":
            line = json.dumps({"image": image, "bbox": [int(x0), int(y0), int(w), int(h)], "label": label,
                               "score": round(score, 4), "split": path.split("/")[0]}, sort_keys=True)
        else:
            line = f"{image} {label}"
        lines.append(line)
        size += len(line) + 1
        row += 1
    return ("\n".join(lines) + "\n").encode()


def make_file(task: FileTask) -> bytes:
    rng = np.random.default_rng([_SEED, task.seed])
    if task.kind in ("jpeg", "png"):
        return make_image(rng, task.kind)
    if task.kind == "field":
        return make_field(rng)
    return make_text(rng, task.kind, task.path)


# --- writing the tree ---------------------------------------------------------------------------------------


def _write_batch(args: tuple[str, list[FileTask]]) -> tuple[int, int]:
    root, batch = args
    written = 0
    for task in batch:
        target = os.path.join(root, task.path)
        data = make_file(task)
        with open(target, "wb") as out:
            out.write(data)
        os.utime(target, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        written += len(data)
    return len(batch), written


def _batches(root: Path, tasks: list[FileTask]) -> Iterator[tuple[str, list[FileTask]]]:
    for start in range(0, len(tasks), _TASKS_PER_BATCH):
        yield str(root), tasks[start : start + _TASKS_PER_BATCH]


def write_tree(root: Path, shape: TreeShape, processes: int) -> tuple[int, int]:
    """Write the tree into `root` (replaced if present) with `processes` workers; returns (files, bytes)."""
    if root.exists():
        shutil.rmtree(root)
    tasks = plan_files(shape)
    directories = sorted({str(Path(task.path).parent) for task in tasks} - {"."})
    for directory in directories:
        (root / directory).mkdir(parents=True, exist_ok=True)
    files = total = 0
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for count, written in pool.imap_unordered(_write_batch, _batches(root, tasks)):
            files += count
            total += written
    for directory in [*directories, "train", "val", "."]:
        if (root / directory).is_dir():
            os.utime(root / directory, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    return files, total
