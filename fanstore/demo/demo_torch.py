"""`fanstore demo`'s PyTorch run: one small CNN trained the same way, with the same seed, on images read three
ways: from the original directory, through fanstore.torch (the packed dataset, no FUSE) and through the mount.
Equal accuracies and equal weights show that each way gives the model the same images in the same order; the time
of each epoch, and how much of it the loop spent waiting for data, show what each way costs.

This module imports torch; `fanstore demo` imports it only when torch is installed, and nothing else in fanstore
but fanstore.torch imports torch.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from ..core.api import open_dataset
from ..torch import EpochSampler, FileDataset, ImageFolder
from ..torch.datasets import IMG_EXTENSIONS, make_samples, pil_loader

IMAGE_SIZE = 32  # the demo's digits are 32x32; photo crops are shrunk to it
Samples = list[tuple[str, int]]  # (path relative to the top of the tree, class index), as ImageFolder.samples


@dataclass(frozen=True, slots=True)
class TrainingSettings:
    """What every run shares; equal settings and equal images must give equal weights."""

    epochs: int = 3
    batch_size: int = 32
    num_workers: int = 2
    seed: int = 0
    learning_rate: float = 0.05
    momentum: float = 0.9
    torch_threads: int = 1  # fixed, so that the sums inside each layer add up in the same order every run


@dataclass(frozen=True, slots=True)
class RunResult:
    reader: str
    train_images: int
    val_images: int
    epoch_seconds: tuple[float, ...]
    wait_seconds: tuple[float, ...]  # per epoch, the time the loop was blocked in next(loader) (and iter(loader))
    accuracy: float  # on the validation split, after the last epoch
    weights_digest: str


@dataclass(frozen=True, slots=True)
class Reading:
    """One way of reading the images: the datasets and the samplers the DataLoaders get."""

    reader: str
    classes: int
    train: Dataset
    val: Dataset
    train_sampler: Sampler[int]
    val_sampler: Sampler[int]


def train_three_ways(source: Path, dataset: Path, mountpoint: Path | None,
                     settings: TrainingSettings = TrainingSettings()) -> Iterator[RunResult]:
    """Trains on the original directory, through fanstore.torch, then (if given) through the mount, yielding each
    run's result as it ends so the caller can print it."""
    warm_up(settings)
    yield train(directory_reading("original directory", source, settings), settings)
    yield train(packed_reading("fanstore.torch (API)", dataset, settings), settings)
    if mountpoint is not None:
        yield train(directory_reading("fanstore mount", mountpoint, settings), settings)


def train(reading: Reading, settings: TrainingSettings) -> RunResult:
    """The training loop any user would write, timed; its state is seeded and restored, so runs are repeatable."""
    with _reproducible(settings):
        model = small_cnn(reading.classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=settings.learning_rate, momentum=settings.momentum)
        loader = DataLoader(reading.train, batch_size=settings.batch_size, sampler=reading.train_sampler,
                            num_workers=settings.num_workers, persistent_workers=settings.num_workers > 0,
                            generator=torch.Generator().manual_seed(settings.seed))
        epoch_seconds, wait_seconds = [], []
        for _ in range(settings.epochs):
            started = time.perf_counter()
            model.train()
            waited = 0.0
            for images, targets, wait in _timed(loader):
                waited += wait
                optimizer.zero_grad()
                functional.cross_entropy(model(images), targets).backward()
                optimizer.step()
            epoch_seconds.append(time.perf_counter() - started)
            wait_seconds.append(waited)
        accuracy = evaluate(model, DataLoader(reading.val, batch_size=256, sampler=reading.val_sampler,
                                              num_workers=settings.num_workers))
    return RunResult(reading.reader, len(reading.train), len(reading.val), tuple(epoch_seconds),
                     tuple(wait_seconds), accuracy, weights_digest(model))


def warm_up(settings: TrainingSettings) -> None:
    """A few steps on a throwaway model: torch's one-time start-up (about a second) is paid before the first
    timed run, not by it."""
    with _reproducible(settings):
        model = small_cnn(classes=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=settings.learning_rate, momentum=settings.momentum)
        images = torch.zeros(settings.batch_size, 1, IMAGE_SIZE, IMAGE_SIZE)
        targets = torch.zeros(settings.batch_size, dtype=torch.long)
        for _ in range(2):
            optimizer.zero_grad()
            functional.cross_entropy(model(images), targets).backward()
            optimizer.step()
        evaluate(model, [(images, targets)])


def small_cnn(classes: int) -> nn.Module:
    """Two convolutions and a linear layer: enough for 32x32 digits, a few seconds an epoch on one core."""
    return nn.Sequential(
        nn.Conv2d(1, 8, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * (IMAGE_SIZE // 4) ** 2, classes),
    )


def evaluate(model: nn.Module, loader: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The fraction of the loader's images the model classifies right."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, targets in loader:
            correct += int((model(images).argmax(dim=1) == targets).sum())
            total += len(targets)
    return correct / total if total else 0.0


def weights_digest(model: nn.Module) -> str:
    """Equal digests: bit-for-bit equal weights."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _timed(loader: DataLoader) -> Iterator[tuple[Any, Any, float]]:
    """The loader's batches, each with the time spent getting it: the time the training loop waited for data."""
    asked = time.perf_counter()
    batches = iter(loader)  # starts the workers (the first epoch) and sends them their first batches
    while True:
        try:
            images, targets = next(batches)
        except StopIteration:
            return
        yield images, targets, time.perf_counter() - asked
        asked = time.perf_counter()


@contextmanager
def _reproducible(settings: TrainingSettings) -> Iterator[None]:
    """Seeded, deterministic, with a fixed thread count; the caller's random state and settings come back after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        torch.set_num_threads(settings.torch_threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(deterministic)
            torch.set_num_threads(threads)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """A (1, 32, 32) float tensor in [0, 1]: gray, and shrunk to 32x32 if larger (the photo crops)."""
    gray = image.convert("L")
    if gray.size != (IMAGE_SIZE, IMAGE_SIZE):
        gray = gray.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(gray, dtype=np.float32) / 255.0).unsqueeze(0)


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    """What ImageFolder does to a file's bytes (its loader, then the transform), for FileDataset."""
    return to_tensor(pil_loader(data))


# --- the original directory and the mount: plain Python, os.scandir and open, as user code reads a tree ----------

def list_samples(top: Path, split: str, classes: Sequence[str] | None = None) -> tuple[list[str], Samples]:
    """torchvision ImageFolder's listing of top/split, for class folders without subfolders: the classes are the
    folders, sorted, unless given (validation takes the training classes, so val/empty_class is left out); the
    samples are sorted by class, then file name."""
    if classes is None:
        with os.scandir(top / split) as listing:
            classes = sorted(entry.name for entry in listing if entry.is_dir())
    samples: Samples = []
    for index, name in enumerate(classes):
        with os.scandir(top / split / name) as listing:
            files = sorted(entry.name for entry in listing
                           if entry.is_file() and entry.name.lower().endswith(IMG_EXTENSIONS))
        samples += [(f"{split}/{name}/{file}", index) for file in files]
    return list(classes), samples


class FolderImages(Dataset):
    """Item i is (image tensor, class) of samples[i], read with open() and decoded with Pillow: no fanstore."""

    def __init__(self, top: Path, samples: Samples) -> None:
        self.top = top
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[item]
        with open(self.top / path, "rb") as file:
            image = Image.open(file).convert("RGB")  # as torchvision's default loader
        return to_tensor(image), target


def directory_reading(reader: str, top: Path, settings: TrainingSettings) -> Reading:
    """The original directory, or the mount: listed with os.scandir, read with open()."""
    classes, train_samples = list_samples(top, "train")
    _, val_samples = list_samples(top, "val", classes)
    train_set, val_set = FolderImages(top, train_samples), FolderImages(top, val_samples)
    return Reading(reader, len(classes), train_set, val_set, _shuffled(train_set, settings),
                    SequentialSampler(val_set))


# --- the packed dataset: fanstore.torch, each DataLoader worker decoding its next files ahead ----------------------

class LabelledFiles(Dataset):
    """A FileDataset's items with their classes. Validation needs it: ImageFolder, like torchvision's, refuses a
    split with an empty class folder, and the demo's val/ has one (val/empty_class)."""

    def __init__(self, files: FileDataset, targets: Sequence[int]) -> None:
        self.files = files
        self.targets = list(targets)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item: int) -> tuple[Any, int]:
        return self.files[item], self.targets[item]

    def __getitems__(self, items: list[int]) -> list[tuple[Any, int]]:
        """A whole batch in one call, as FileDataset reads it, so its workers see where they are in the epoch."""
        return list(zip(self.files.__getitems__(items), (self.targets[item] for item in items)))


def packed_reading(reader: str, dataset: Path, settings: TrainingSettings) -> Reading:
    """The packed dataset through fanstore.torch, each epoch's order published so the workers decode ahead."""
    train_set = ImageFolder(dataset, root="train", transform=to_tensor)
    with open_dataset(dataset) as opened:
        val_samples = make_samples(opened, "val", train_set.class_to_idx)
    val_files = FileDataset(dataset, [path for path, _ in val_samples], transform=bytes_to_tensor)
    val_set = LabelledFiles(val_files, [target for _, target in val_samples])
    return Reading(reader, len(train_set.classes), train_set, val_set,
                    EpochSampler(_shuffled(train_set, settings), train_set),
                    EpochSampler(SequentialSampler(val_set), val_files))


def _shuffled(dataset: Dataset, settings: TrainingSettings) -> RandomSampler:
    """A new order each epoch, the same sequence of orders in every run."""
    return RandomSampler(dataset, generator=torch.Generator().manual_seed(settings.seed))


# --- the table `fanstore demo` prints ---------------------------------------------------------------------------

def table_header(settings: TrainingSettings) -> str:
    epochs = "".join(f"{f'epoch {n + 1} s (wait)':>20}" for n in range(settings.epochs))
    return f"{'reader':<24}{'train+val':>11}{epochs}{'accuracy':>10}  weights"


def table_row(result: RunResult) -> str:
    epochs = "".join(f"{f'{seconds:.2f} ({wait:.2f})':>20}"
                     for seconds, wait in zip(result.epoch_seconds, result.wait_seconds))
    images = f"{result.train_images:,}+{result.val_images:,}"
    return f"{result.reader:<24}{images:>11}{epochs}{result.accuracy:>10.1%}  {result.weights_digest}"
