"""How a FileDataset is indexed: as a list is (negative items from the end), a list of items as a batch (a batch
sampler given as sampler=, batch_size=None), and anything else one error naming the dataset and the item."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_packed import pack_sixty_files

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import BatchSampler, DataLoader, RandomSampler  # noqa: E402

from fanstore.torch import EpochSampler, FileDataset  # noqa: E402


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
