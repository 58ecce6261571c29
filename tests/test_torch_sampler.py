"""EpochSampler over samplers other than DistributedSampler: endless ones, ones whose len() is wrong, batch samplers,
and what it says of values that are not item numbers or of a dataset it cannot publish for."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_packed import pack_sixty_files

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, Subset  # noqa: E402

from fanstore.errors import UsageError  # noqa: E402
from fanstore.torch import EpochSampler, FileDataset  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, list[bytes]]:
    return pack_sixty_files(tmp_path_factory.mktemp("torch_sampler"))


class Endless(Sampler[int]):
    """A training-iterations sampler (detectron2's TrainingSampler): permutations one after another, for good, and
    no len(). Drawing far more than the loader takes is the hang it would be, made an error."""

    def __init__(self, items: int, limit: int) -> None:
        self.items, self.limit, self.drawn = items, limit, []

    def __iter__(self):
        generator = torch.Generator().manual_seed(4)
        while True:
            for item in torch.randperm(self.items, generator=generator).tolist():
                if len(self.drawn) >= self.limit:
                    raise AssertionError(f"drawn {self.limit} values: an endless sampler is drawn to its end")
                self.drawn.append(item)
                yield item


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_endless_sampler_is_drawn_a_piece_at_a_time_and_every_item_read_is_right(packed, num_workers):
    dest, originals = packed
    dataset = FileDataset(dest)
    sampler = Endless(len(originals), limit=20 * len(originals))
    loader = DataLoader(dataset, sampler=EpochSampler(sampler, dataset), batch_size=6, collate_fn=list,
                        num_workers=num_workers)
    got = [data for _, batch in zip(range(25), loader) for data in batch]  # 150 items: 2.5 permutations
    assert got == [originals[item] for item in sampler.drawn[:150]]
    assert len(sampler.drawn) <= 4 * len(originals)  # pieces of an epoch, each drawn as the loader reaches it


def test_a_sampler_yielding_more_than_its_len_gives_every_item_in_its_order(packed):
    dest, originals = packed
    order = [item % len(originals) for item in reversed(range(2 * len(originals)))]

    class TooShortLen(Sampler[int]):
        def __len__(self) -> int:
            return 10

        def __iter__(self):
            yield from order

    dataset = FileDataset(dest)
    loader = DataLoader(dataset, sampler=EpochSampler(TooShortLen(), dataset), batch_size=7, collate_fn=list)
    assert [data for batch in loader for data in batch] == [originals[item] for item in order]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_is_wrapped_and_given_as_batch_sampler(packed, num_workers):
    dest, originals = packed
    dataset = FileDataset(dest)
    batches = BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(1)), 6, drop_last=False)
    sampler = EpochSampler(batches, dataset)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=list, num_workers=num_workers)
    assert len(loader) == 10
    generator_state = batches.sampler.generator.get_state()
    got = [batch for batch in loader]
    batches.sampler.generator.set_state(generator_state)
    assert got == [[originals[item] for item in batch] for batch in batches]
    if num_workers == 0:  # every batch after the first was decoded ahead
        stats = dataset.prefetch_stats()
        assert (stats["ahead"], stats["used"], stats["missed"]) == (54, 54, 6), stats


@pytest.mark.parametrize("value, named", [("d0/f000.bin", r"'d0/f000.bin' \(a str\)"), (3.0, r"3.0 \(a float\)"),
                                          (torch.tensor(2.5), r"tensor\(2.5000\) \(a Tensor\)")])
def test_a_value_that_is_not_an_item_number_is_one_error_naming_it(packed, value, named):
    dest, _ = packed
    dataset = FileDataset(dest)
    with pytest.raises(UsageError, match=f"EpochSampler: the sampler yielded {named}, not an item number"):
        list(EpochSampler([0, 1, value], dataset))


def test_a_dataset_other_than_a_fanstore_one_is_refused_saying_what_to_sample(packed):
    dest, _ = packed
    subset = Subset(FileDataset(dest), [1, 2, 3])
    with pytest.raises(UsageError, match="not a Subset.*SubsetRandomSampler"):
        EpochSampler(RandomSampler(subset), subset)


def test_a_seeded_sampler_gives_the_same_order_wrapped_or_not_however_the_loader_asks(packed):
    """A multi-worker loader without batching asks the EpochSampler itself for an iterator twice, dropping the first:
    a sampler drawn for it moved its generator on, and the epoch read another order than the unwrapped sampler's."""
    dest, originals = packed
    dataset = FileDataset(dest)

    def seeded() -> RandomSampler:
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(9))

    plain = DataLoader(dataset, sampler=seeded(), batch_size=None, num_workers=2)
    wrapped = DataLoader(dataset, sampler=EpochSampler(seeded(), dataset), batch_size=None, num_workers=2)
    expected = list(plain)
    assert sorted(expected) == sorted(originals)
    assert list(wrapped) == expected
