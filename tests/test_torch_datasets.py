"""How a FileDataset is indexed: as a list is (negative items from the end), a list of items as a batch (a batch
sampler given as sampler=, batch_size=None), and anything else one error naming the dataset and the item; and what
an item's error says: user code's (a transform, a loader) noted with the item and its path, fanstore's its own."""

from __future__ import annotations

import pickle
import shutil
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from fanstore import ChunkCorrupt, IsADirectory, PackOptions, PathNotFound, open_dataset, pack
from fanstore.core.chunk_source import LocalChunkSource
from fanstore.core.format import chunk_file_name
from torch_packed import pack_sixty_files

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import BatchSampler, DataLoader, RandomSampler  # noqa: E402

from fanstore.torch import EpochSampler, FileDataset, ImageFolder  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, list[bytes]]:
    return pack_sixty_files(tmp_path_factory.mktemp("torch_datasets"))


def test_items_index_as_a_list_does(packed):
    dest, originals = packed
    dataset = FileDataset(dest)
    assert dataset[-1] == originals[-1] and dataset[-60] == originals[0]
    assert dataset[torch.tensor(3)] == dataset[torch.tensor(3).numpy()] == originals[3]
    assert dataset[[5, -2]] == [originals[5], originals[-2]]


@pytest.mark.parametrize("item, error, message", [
    (slice(1, 2), TypeError, r"an item is an int \(or a list of them\), not slice"),
    ("d0/f000.bin", TypeError, "an item .*, not str 'd0/f000.bin'"), (2.0, TypeError, "an item .*, not float 2.0"),
    (60, IndexError, "item 60 out of range: 60 items"), (-61, IndexError, "item -61 out of range: 60 items")])
def test_an_item_that_is_not_one_is_an_error_naming_the_dataset_and_the_item(packed, item, error, message):
    dest, _ = packed
    with pytest.raises(error, match=rf"FileDataset\('{dest}'\): {message}"):
        FileDataset(dest)[item]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_given_as_the_sampler_reads_each_batch_decoded_ahead(packed, num_workers):
    dest, originals = packed
    dataset = FileDataset(dest)
    batches = BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(3)), 6, drop_last=False)
    loader = DataLoader(dataset, sampler=EpochSampler(batches, dataset), batch_size=None, collate_fn=list,
                        num_workers=num_workers)
    got = list(loader)
    batches.sampler.generator.manual_seed(3)
    assert got == [[originals[item] for item in batch] for batch in batches]


def _as_raised(exc: BaseException) -> str:
    """An error as a traceback prints it, its notes included (what a DataLoader worker sends the main process)."""
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transform_that_fails_names_the_item_and_its_path_and_keeps_its_error(packed, num_workers):
    """A transform that raised on one file of a million said nothing of which: its error now carries a note naming
    the item and its path (in the main process too, where a worker's error is re-raised from its traceback text), and
    stays the error it was, of its type, unwrapped."""
    dest, originals = packed

    def transform(data: bytes) -> bytes:
        if len(data) == len(originals[7]):
            raise ValueError("cannot decode this one")
        return data

    dataset = FileDataset(dest, transform=transform)
    loader = DataLoader(dataset, batch_size=4, collate_fn=list, num_workers=num_workers)
    with pytest.raises(ValueError) as raised:
        list(loader)
    assert f"fanstore.torch: while transforming item 7 ({dataset.paths[7]}) of FileDataset('{dest}')" \
        in _as_raised(raised.value)
    if num_workers == 0:
        assert str(raised.value) == "cannot decode this one" and raised.value.__cause__ is None
        assert len(raised.value.__notes__) == 1


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """An ImageFolder tree of two classes whose 'images' are plain bytes, for loaders that read them as such."""
    base = tmp_path_factory.mktemp("torch_images")
    for name in ("cat/1.png", "cat/2.png", "dog/1.png", "dog/ugly\nname.png"):
        (base / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (base / "src" / name).write_bytes(name.encode())
    pack(base / "src", base / "dest", PackOptions(codec="zstd:3", workers=1))
    return base / "dest"


def _fails_on(bad: object, then: Callable[[Any], Any] = lambda value: value) -> Callable[[Any], Any]:
    def step(value: Any) -> Any:
        if value == bad:
            raise KeyError(value)
        return then(value)
    return step


@pytest.mark.parametrize("stage", ["loader", "transform", "target_transform"])
def test_an_image_folder_step_that_fails_names_the_item_and_its_path_quoted_where_it_must_be(images, stage):
    """The loader, transform and target_transform of ImageFolder each run user code on an item: whichever raised, its
    error names the item and its path (as messages show paths: a name with a newline quoted, on one line)."""
    bad = {"loader": b"dog/ugly\nname.png", "transform": b"dog/ugly\nname.png", "target_transform": 1}[stage]
    steps = {stage: _fails_on(bad)}
    dataset = ImageFolder(images, loader=steps.pop("loader", lambda data: data), **steps)
    assert dataset.samples[3] == ("dog/ugly\nname.png", 1)
    with pytest.raises(KeyError) as raised:
        if stage == "target_transform":
            [dataset[item] for item in range(len(dataset))]
        else:
            dataset[[0, 3]]
    item = 2 if stage == "target_transform" else 3
    shown = "dog/1.png" if item == 2 else r"'dog/ugly\nname.png'"
    assert raised.value.__notes__ == [f"fanstore.torch: while transforming item {item} ({shown}) of "
                                      f"ImageFolder('{images}')"]


def test_a_corrupt_file_is_named_once_by_fanstore_s_own_error(packed, tmp_path):
    """A corrupt blob's error names its path already: it gets no note of a transform it never reached, in a worker or
    not."""
    dest, _ = packed
    copy = tmp_path / "dest"
    shutil.copytree(dest, copy)
    with open_dataset(copy) as dataset:
        entry = dataset.resolve("d1/f010.bin")
        chunk, offset = (int(dataset.index.entries[entry][field]) for field in ("chunk", "offset"))
        chunk_file = copy / chunk_file_name(chunk)
    damaged = bytearray(chunk_file.read_bytes())
    damaged[offset + 5] ^= 0xFF
    chunk_file.write_bytes(bytes(damaged))
    for num_workers in (0, 2):
        loader = DataLoader(FileDataset(copy, transform=len), batch_size=4, collate_fn=list, num_workers=num_workers)
        with pytest.raises(ChunkCorrupt) as raised:
            list(loader)
        text = _as_raised(raised.value)
        assert "d1/f010.bin: checksum mismatch" in text and "fanstore.torch" not in text, text


def test_a_dataset_named_by_a_relative_path_reads_the_same_after_the_working_directory_changes(packed, tmp_path,
                                                                                             monkeypatch):
    """DEST given relative, then a chdir (a training script moving into its run's directory): the open dataset failed
    its next chunk file not yet open ('cannot open chunk 1: No such file or directory'), pickled as the relative path
    (a spawned worker opened another place), and forked DataLoader workers failed with 'dest: no such dataset
    directory' while the training process itself read on. Both now keep the directory as it was when given."""
    dest, originals = packed
    monkeypatch.chdir(dest.parent)
    api = open_dataset(dest.name)
    sizes = api.index.chunks["size"]
    given = open_dataset(dest.name, source=LocalChunkSource(dest.name, sizes))  # a source of the caller's, relative
    items = FileDataset(dest.name)
    assert api.read(items.paths[0]) == originals[0]  # the first chunk file opened here, before the change
    monkeypatch.chdir(tmp_path)
    for opened in (api, given):
        assert [opened.read(path) for path in items.paths] == originals
        with pickle.loads(pickle.dumps(opened)) as again:
            assert again.read(items.paths[-1]) == originals[-1]
    loader = DataLoader(items, batch_size=7, num_workers=1, collate_fn=list)
    assert [item for batch in loader for item in batch] == originals
    api.close()
    given.close()


def test_threads_that_read_a_new_dataset_at_once_open_it_once(packed, monkeypatch):
    """Threads of one process reading a FileDataset's first items at once (a thread pool over dataset[i]) each opened
    the dataset, its index and up to every chunk file, and all but one opening were dropped: on a shared file
    system, a burst of opens that read nothing. The process opens it once; the others wait for it."""
    from fanstore.torch import reading

    dest, originals = packed
    opened = []
    real_open = reading.open_source

    def slow_open(source):
        opened.append(source)
        time.sleep(0.2)  # long enough for every thread to ask while the first opens
        return real_open(source)

    monkeypatch.setattr(reading, "open_source", slow_open)
    items = FileDataset(dest)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(items.__getitem__, range(8))) == originals[:8]
    assert len(opened) == 1
    items.close()


def test_paths_that_are_not_files_are_said_as_the_dataset_opens_with_their_place(packed):
    """A directory among `paths` passed len() and the sampler and failed in a worker at its item's first read, an
    epoch in ("'d1' is not a regular file", naming neither the dataset nor the item). Every given path is checked
    as the dataset opens, in the training process: the first that is missing or not a file is named with its place
    in `paths`, and how many more there are; the error keeps its type."""
    dest, originals = packed
    loader = DataLoader(FileDataset(dest, paths=["d0/f000.bin", "d1", "nope", "d0/f030.bin/x", "d0/f030.bin"]),
                        batch_size=2, num_workers=2, collate_fn=list)
    with pytest.raises(IsADirectory, match=rf"^'{dest}': paths\[1\]: 'd1' is a directory, not a file; 2 more of the "
                                           r"5 paths are not files either$"):
        list(loader)
    with pytest.raises(PathNotFound, match=rf"^'{dest}': paths\[0\]: 'nope': no such file or directory"):
        len(FileDataset(dest, paths=["nope", "d0/f000.bin"]))
    assert list(FileDataset(dest, paths=["d0/f030.bin", "./d0//f000.bin"])) == [originals[10], originals[0]]
