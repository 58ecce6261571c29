"""Map-style torch Datasets over a packed dataset, read through the API: each DataLoader worker decodes its own
files, in parallel, with no FUSE daemon between it and the chunks."""

from __future__ import annotations

import io
import operator
import os
import stat
import weakref
from typing import Any, Callable, Sequence

from torch.utils.data import Dataset as TorchDataset

from ..core.api import Dataset
from ..errors import quoted, shown_path
from .plan import EpochPlan
from .reading import PREFETCH_BYTES, PREFETCH_THREADS, ProcessReading, ShippedItems, open_source

# The extensions torchvision's ImageFolder accepts (torchvision.datasets.folder.IMG_EXTENSIONS).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class FileDataset(TorchDataset):
    """Item i is `transform(bytes of paths[i])`, or the bytes without a transform.

    `source`: a packed dataset directory, or None under `fanstore serve` (the node's dataset: chunks on this node
    read from its local directory, the others through the node's serve process). `paths`: dataset-relative paths;
    every regular file, sorted, by default. Nothing is opened until the first item is read, in each process.
    """

    def __init__(self, source: str | os.PathLike[str] | None = None, paths: Sequence[str] | None = None,
                 transform: Callable[[bytes], Any] | None = None, prefetch_bytes: int = PREFETCH_BYTES,
                 prefetch_threads: int = PREFETCH_THREADS) -> None:
        # Absolute: each worker opens it, maybe after the training process changed its working directory.
        self.source = None if source is None else os.path.abspath(source)
        self._paths = None if paths is None else [str(path) for path in paths]
        self.transform = transform
        self.prefetch_bytes = prefetch_bytes
        self.prefetch_threads = prefetch_threads
        self.plan: EpochPlan | None = None  # set by an EpochSampler, before the loader's workers start
        self.plan_owners = 0  # EpochSamplers that publish into `plan` (one, unless two loaders share this object)

    # --- what travels to workers: the recipe, never the open dataset ------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        reading = state.pop("_process_reading", None)
        if state.get("_paths_listed"):  # listed from the index: each worker lists them again, pickles stay small
            state["_paths"] = None
        elif state["_paths"] is not None and reading is not None and reading.pid == os.getpid():
            # Paths given and looked up here (the sampler asked len() in the training process): a spawned worker
            # gets the entry numbers instead, and lists the paths from its index only if it is asked for them.
            shipped = ShippedItems.of(reading)
            if shipped is not None:
                state.update(_paths=None, _paths_listed=True, _shipped=shipped)
        return state

    def _reading(self) -> ProcessReading:
        holder = weakref.ref(self)  # the reading looks the plan up each batch, without keeping the dataset alive

        def plan() -> EpochPlan | None:
            dataset = holder()
            return None if dataset is None else dataset.plan

        return ProcessReading.of(self, lambda inherited: ProcessReading(self.source, self._paths, plan,
                                                                       self.prefetch_bytes, self.prefetch_threads,
                                                                       inherited, self.__dict__.get("_shipped")))

    @property
    def paths(self) -> list[str]:
        if self._paths is None:
            self._paths = self._reading().paths()
            self.__dict__["_paths_listed"] = True
        return self._paths

    @property
    def dataset(self) -> Dataset:
        """This process's open fanstore Dataset (listing, stat, open of any path)."""
        return self._reading().dataset

    def __len__(self) -> int:
        return len(self._reading().entries)

    def __getitem__(self, item: int | list[int]) -> Any:
        """Item `item` (negative counts from the end, as in a list); a list of item numbers is a batch, as a
        batch sampler given as DataLoader(sampler=..., batch_size=None) asks for one."""
        if isinstance(item, list):
            return self.__getitems__(item)
        numbers = self._item_numbers([item])
        data = self._reading().read_items(numbers)[0]
        try:
            return self._item(data, numbers[0])
        except Exception as exc:
            self._note_item(exc, numbers[0])
            raise

    def __getitems__(self, items: list[int]) -> list[Any]:
        """A whole batch (the DataLoader asks for it in one call): the worker sees where it is in the epoch."""
        numbers = self._item_numbers(items)
        batch = self._reading().read_items(numbers)  # a read that fails raises fanstore's error, naming the path
        made: list[Any] = []
        try:  # around the loop, not each item: costs nothing until user code raises
            for data, item in zip(batch, numbers):
                made.append(self._item(data, item))
        except Exception as exc:
            self._note_item(exc, item)
            raise
        return made

    def _item_numbers(self, items: list[Any]) -> list[int]:
        """Items as numbers in 0..len-1, or one error naming the item and the dataset: a slice or a path failed in
        numpy with "only 0-dimensional arrays can be converted", and a negative item read the right file but was
        never found in the epoch's order, so it was not decoded ahead."""
        count = len(self)
        numbers = []
        for item in items:
            try:
                number = operator.index(item)
            except TypeError:
                raise TypeError(f"{type(self).__name__}({quoted(self.source)}): an item is an int (or a list of "
                                f"them), not {type(item).__name__} {repr(item)[:80]}") from None
            if not -count <= number < count:
                raise IndexError(f"{type(self).__name__}({quoted(self.source)}): item {number} out of range: "
                                 f"{count} items")
            numbers.append(number + count if number < 0 else number)
        return numbers

    def _item(self, data: bytes, item: int) -> Any:
        return data if self.transform is None else self.transform(data)

    def _note_item(self, exc: Exception, item: int) -> None:
        """Name the item and its path on an error that user code (a transform, a loader) raised making it: of a
        million files, the error alone did not say which broke the epoch. A note (PEP 678), not a wrapper: the error
        keeps its type for whoever catches it, and a DataLoader worker's traceback text, which the main process
        re-raises, prints it."""
        try:
            reading = self._reading()
            path = reading.dataset.index.path_of(int(reading.entries[item]))
        except Exception:  # the user's error is the one to see: no note rather than another error
            return
        exc.add_note(f"fanstore.torch: while transforming item {item} ({shown_path(path)}) of "
                     f"{type(self).__name__}({quoted(self.source)})")

    def announce(self, order: Any) -> None:
        """This rank's order for the coming epoch (item numbers): under `fanstore serve`, the node's serve process
        fetches the files stored on other nodes ahead of the workers. Called by EpochSampler."""
        if self.source is None:
            self._reading().announce(order)

    def prefetch_stats(self) -> dict[str, Any]:
        """This process's counters of decoding ahead (see reading.PrefetchCounters)."""
        return self._reading().stats()

    def close(self) -> None:
        """Close what this process opened (reopened on the next read); workers close theirs when they exit."""
        reading = self.__dict__.pop("_process_reading", None)
        if reading is not None and reading.pid == os.getpid():
            reading.close()

    def __enter__(self) -> "FileDataset":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pil_loader(data: bytes) -> Any:
    """An image as torchvision's default loader gives it: a Pillow image, converted to RGB."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageFolder(FileDataset):
    """torchvision's ImageFolder over a directory of the packed dataset: the same `classes`, `class_to_idx`,
    `samples` (with dataset-relative paths) and `targets`; item i is (image, class index).

    Classes are the directories right below `root`, sorted; a class holds every file with an image extension
    below its directory, nested directories and links to directories included, in the order torchvision lists
    them (directories sorted by path, then file names sorted). A class without images is an error unless
    `allow_empty` (as in torchvision). torchvision itself is not needed.
    """

    def __init__(self, source: str | os.PathLike[str] | None, root: str = "", transform: Callable | None = None,
                 target_transform: Callable | None = None, loader: Callable[[bytes], Any] = pil_loader,
                 allow_empty: bool = False, prefetch_bytes: int = PREFETCH_BYTES,
                 prefetch_threads: int = PREFETCH_THREADS) -> None:
        self.root = root.strip("/")
        with open_source(None if source is None else os.fspath(source)) as dataset:
            self.classes, self.class_to_idx = find_classes(dataset, self.root)
            self.samples = make_samples(dataset, self.root, self.class_to_idx, allow_empty)
        super().__init__(source, [path for path, _ in self.samples], transform, prefetch_bytes, prefetch_threads)
        self.targets = [target for _, target in self.samples]
        self.imgs = self.samples
        self.loader = loader
        self.target_transform = target_transform

    def _item(self, data: bytes, item: int) -> Any:
        image = self.loader(data)
        if self.transform is not None:
            image = self.transform(image)
        target = self.targets[item]
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def _is_dir(dataset: Dataset, path: str) -> bool:
    try:
        return stat.S_ISDIR(dataset.stat(path).st_mode)
    except (OSError, ValueError):  # a dangling link, a link loop
        return False


def find_classes(dataset: Dataset, root: str) -> tuple[list[str], dict[str, int]]:
    classes = sorted(name for name in dataset.listdir(root) if _is_dir(dataset, _join(root, name)))
    if not classes:
        raise FileNotFoundError(f"ImageFolder: no class directories in {quoted(root or '/')} of the dataset")
    return classes, {name: i for i, name in enumerate(classes)}


def make_samples(dataset: Dataset, root: str, class_to_idx: dict[str, int],
                 allow_empty: bool = False) -> list[tuple[str, int]]:
    samples = []
    for name in sorted(class_to_idx):
        found = []
        for folder, files in sorted(_walk_following_links(dataset, _join(root, name))):
            found.extend((_join(folder, file), class_to_idx[name]) for file in sorted(files)
                         if file.lower().endswith(IMG_EXTENSIONS))
        if not found and not allow_empty:
            raise FileNotFoundError(f"ImageFolder: no image files for class {quoted(name)} in {quoted(root or '/')} "
                                    f"(extensions: {', '.join(IMG_EXTENSIONS)})")
        samples.extend(found)
    return samples


def _walk_following_links(dataset: Dataset, top: str) -> list[tuple[str, list[str]]]:
    """(directory, file names) below `top`, entering links to directories as os.walk(followlinks=True) does, but
    never the same directory twice along one path (a link loop)."""
    index = dataset.index
    result = []
    pending = [(top, frozenset())]
    while pending:
        folder, ancestors = pending.pop()
        here = dataset.resolve(folder)
        if here in ancestors:
            continue
        children = index.children(here)
        # Each child's kind from the index, where it lies: resolving every file's path (to learn it is not a
        # directory) was 85% of listing a million files. Only a link is resolved.
        kinds = (index.entries["mode"][children.start : children.stop] & 0o170000).tolist()
        files = []
        for child, kind in zip(children, kinds):
            name = index.path_of(child).rpartition("/")[2]
            path = _join(folder, name)
            if kind == stat.S_IFDIR or (kind == stat.S_IFLNK and _is_dir(dataset, path)):
                pending.append((path, ancestors | {here}))
            else:
                files.append(name)
        result.append((folder, files))
    return result


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name
