"""Decoding ahead (fanstore/torch/reading.py) where the published order is not a permutation read as published: a
sampler with replacement, and an order published again while the loader reads the previous one."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from torch_packed import pack_sixty_files

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import DataLoader, RandomSampler, Sampler  # noqa: E402

from fanstore.torch import EpochSampler, FileDataset  # noqa: E402
from fanstore.torch.plan import EpochPlan  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, list[bytes]]:
    return pack_sixty_files(tmp_path_factory.mktemp("torch_reading"))


class WithCounters(FileDataset):
    """Each item is (its bytes, the reading process's prefetch counters once its batch was read)."""

    def _item(self, data: bytes, item: int):
        return data, self.prefetch_stats()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_with_replacement_has_its_own_next_batches_decoded_ahead_and_nothing_left_held(packed, num_workers):
    dest, originals = packed
    dataset = WithCounters(dest)
    sampler = RandomSampler(dataset, replacement=True, num_samples=180, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(dataset, sampler=EpochSampler(sampler, dataset), batch_size=6, collate_fn=list,
                        num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)
    got = [item for batch in loader for item in batch]
    sampler.generator.manual_seed(1)  # the same draws again
    assert [data for data, _ in got] == [originals[item] for item in sampler]
    last = {}
    for position, (_, counters) in enumerate(got):  # per worker: batch k went to worker k mod num_workers
        last[position // 6 % max(1, num_workers)] = counters
    for counters in last.values():  # only each worker's first batch was not known ahead; all decoded was read
        assert counters["ahead"] == counters["used"] == 180 // max(1, num_workers) - 6, counters
        assert counters["missed"] == 6 and counters["held_bytes"] == 0, counters


def test_an_order_published_again_mid_epoch_decodes_nothing_the_loader_does_not_read(packed):
    """The sampler iterated once more while the loader reads (to log it, say): the plan no longer says what comes
    next, so nothing more is decoded ahead by it, where it decoded batches never read and held them to the epoch's
    end."""
    dest, originals = packed
    dataset = WithCounters(dest)
    sampler = EpochSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(0)), dataset)
    batches = iter(DataLoader(dataset, sampler=sampler, batch_size=5, collate_fn=list))
    got = [item for _ in range(3) for item in next(batches)]
    list(sampler)
    got += [item for batch in batches for item in batch]
    assert sorted(data for data, _ in got) == sorted(originals)
    counters = got[-1][1]  # decoded ahead, not read: only the two batches queued before the order changed
    assert counters["ahead"] - counters["used"] <= 10 and counters["held_bytes"] == 0, counters


class CyclingBatches(Sampler[list[int]]):
    """A batch sampler whose batches differ in size (as bucketing by length does): the items `sampler` draws, cut
    into batches of 3, 17, 8, 1, 30, 3, ... items, the last one short unless dropped."""

    SIZES = (3, 17, 8, 1, 30)

    def __init__(self, sampler: Sampler[int], drop_last: bool) -> None:
        self.sampler, self.drop_last = sampler, drop_last

    def __iter__(self):
        drawn = list(self.sampler)
        yield from (drawn[start:end] for start, end in self._bounds(len(drawn)))

    def __len__(self) -> int:  # without drawing: a seeded sampler drawn for it would give another order
        return len(self._bounds(len(self.sampler)))

    def _bounds(self, items: int) -> list[tuple[int, int]]:
        bounds, start = [], 0
        for size in itertools.cycle(self.SIZES):
            end = min(start + size, items)
            if end == start or (self.drop_last and end - start < size):
                return bounds
            bounds.append((start, end))
            start = end


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("draws", ["permutation", "replacement", "drop_last"])
def test_batches_of_varied_sizes_have_each_workers_next_ones_decoded_ahead_and_nothing_left_held(packed, draws,
                                                                                                 num_workers):
    """A worker's next batch starts where the batches the other workers take in between end, whatever their sizes:
    taken to start num_workers times this batch's length on, it was found nowhere in the order, and nothing was
    decoded ahead (or the wrong files, held to the epoch's end)."""
    dest, originals = packed
    dataset = WithCounters(dest)

    def batches() -> CyclingBatches:
        drawn = RandomSampler(dataset, replacement=draws == "replacement", num_samples=180 if draws == "replacement"
                              else None, generator=torch.Generator().manual_seed(5))
        return CyclingBatches(drawn, drop_last=draws == "drop_last")

    loader = DataLoader(dataset, batch_sampler=EpochSampler(batches(), dataset), collate_fn=list,
                        num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)
    assert_each_worker_read_what_it_decoded_ahead(list(loader), list(batches()), originals, num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_that_all_start_with_one_item_are_each_found_by_their_start(packed, num_workers):
    """Every batch starts with item 7 (drawn again and again): a worker's batch is the one after its last that holds
    it, not the first place of its first item, which lay in the epoch's first batch."""
    dest, originals = packed
    dataset = WithCounters(dest)
    others = [item for item in torch.randperm(len(originals), generator=torch.Generator().manual_seed(2)).tolist()
              if item != 7]
    batches, start = [], 0
    for size in itertools.cycle((3, 9, 1, 5)):
        if start >= len(others):
            break
        batches.append([7] + others[start : start + size])
        start += size
    loader = DataLoader(dataset, batch_sampler=EpochSampler(batches, dataset), collate_fn=list,
                        num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)
    assert_each_worker_read_what_it_decoded_ahead(list(loader), batches, originals, num_workers)


def assert_each_worker_read_what_it_decoded_ahead(got: list, expected: list[list[int]], originals: list[bytes],
                                                  num_workers: int) -> None:
    """Every item's bytes right; each worker decoded ahead all its batches but its first, and exactly those files
    (every file decoded ahead was then read); nothing held once its last batch was read."""
    assert [[data for data, _ in batch] for batch in got] == [[originals[item] for item in batch] for batch in expected]
    workers = max(1, num_workers)
    for worker in range(workers):  # batch k went to worker k mod num_workers
        own = expected[worker::workers]
        counters = got[worker::workers][-1][-1][1]  # once its last batch was read
        assert counters["missed"] == len(own[0]), (worker, counters)
        assert counters["ahead"] == counters["used"] == sum(map(len, own[1:])), (worker, counters)
        assert counters["held_bytes"] == 0, (worker, counters)


def test_a_reader_of_the_plan_sees_each_publications_order_and_bounds_together():
    """The bounds travel in the same sealed memfd as the order: a worker never pairs one epoch's order with another's
    batches, and an order published without batches has none."""
    owner = EpochPlan.create()
    reader = EpochPlan(owner.path)  # as a worker opens it: /proc/PID/fd/N, one stat per look
    owner.publish([4, 2, 9, 9, 1], [0, 3, 3, 5])
    seen = reader.current()
    assert (seen.serial, seen.order.tolist(), seen.bounds.tolist()) == (1, [4, 2, 9, 9, 1], [0, 3, 3, 5])
    owner.publish([2**40, 3], [0, 1, 2])  # a number past int32: 8 bytes each, bounds too
    seen = reader.current()
    assert (seen.serial, seen.order.tolist(), seen.bounds.tolist()) == (2, [2**40, 3], [0, 1, 2])
    owner.publish([5, 6])
    seen = reader.current()
    assert (seen.serial, seen.order.tolist(), seen.bounds.tolist()) == (3, [5, 6], [])
