"""EpochSampler: the order a sampler draws for an epoch, told to the readers before they read it."""

from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

from .datasets import FileDataset
from .plan import EpochPlan


class EpochSampler(Sampler[int]):
    """Wraps any sampler (RandomSampler, DistributedSampler, ...): at the start of each epoch it draws the whole
    order for this rank and publishes it, so each DataLoader worker decodes its next files ahead; under
    `fanstore serve` the node's serve process also fetches the remote ones ahead. Without it everything reads the
    same, unprefetched.

    Create it before the DataLoader's workers start (as DataLoader(dataset, sampler=EpochSampler(...)) does)."""

    def __init__(self, sampler: Sampler[int], dataset: FileDataset) -> None:
        self.sampler = sampler
        self.dataset = dataset
        if dataset.plan is None:
            dataset.plan = EpochPlan.create()
        elif dataset.plan_owners:
            warnings.warn("this dataset already has an EpochSampler: the orders of two loaders over one dataset "
                          "object take turns in its plan, and each decodes ahead for the other's; give each loader "
                          "a dataset of its own (FileDataset(...) again)", stacklevel=2)
        dataset.plan_owners += 1
        self.plan = dataset.plan

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped sampler (DistributedSampler reshuffles by it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = np.fromiter((int(item) for item in self.sampler), dtype=np.int64)
        self.plan.publish(order)
        self.dataset.announce(order)
        return iter(order.tolist())

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]
