"""Decoding ahead (fanstore/torch/reading.py) where the published order is not a permutation read as published: a
sampler with replacement, and an order published again while the loader reads the previous one."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_packed import pack_sixty_files

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

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
