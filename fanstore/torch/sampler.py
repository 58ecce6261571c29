"""EpochSampler: the order a sampler draws for an epoch, told to the readers before they read it."""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterable, Iterator

import numpy as np
from torch.utils.data import Sampler

from .datasets import FileDataset
from .plan import EpochPlan


class EpochSampler(Sampler[Any]):
    """Wraps any sampler (RandomSampler, DistributedSampler, ...): at the start of each epoch it draws the whole
    order for this rank and publishes it, so each DataLoader worker decodes its next files ahead; under `fanstore
    serve` the node's serve process also fetches the remote ones ahead. Without it everything reads the same,
    unprefetched.

    A sampler that never ends, or yields more than its len() says, is drawn a piece at a time (len() values or the
    dataset's length, whichever is more), each piece published as the loader reaches it.

    Create it before the DataLoader's workers start (as DataLoader(dataset, sampler=EpochSampler(...)) does)."""

    def __init__(self, sampler: Iterable[Any], dataset: FileDataset) -> None:
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

    def __iter__(self) -> Iterator[Any]:
        """Draws nothing until the first value is asked for: a multi-worker DataLoader calls iter() twice and drops
        the first, and a seeded sampler drawn for it would give another order than without EpochSampler."""
        drawn = iter(self.sampler)
        piece = self._piece_length()
        values = list(itertools.islice(drawn, piece))
        while values:
            order = np.fromiter((int(item) for item in values), dtype=np.int64, count=len(values))
            self.plan.publish(order)
            self.dataset.announce(order)
            yield from order.tolist()
            if len(values) < piece:  # the sampler ended within this piece
                return
            values = list(itertools.islice(drawn, piece))

    def _piece_length(self) -> int:
        """How many of the sampler's values are drawn and published at once: its len() or the dataset's, whichever
        is more (a sampler that ends sooner is drawn whole all the same; one whose len() is too small is not cut
        into pieces smaller than an epoch)."""
        try:
            told = len(self.sampler)  # type: ignore[arg-type]
        except TypeError:  # no len(): an endless sampler, say
            told = 0
        return max(1, told, len(self.dataset))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

