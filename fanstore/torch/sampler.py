"""EpochSampler: the order a sampler draws for an epoch, told to the readers before they read it."""

from __future__ import annotations

import itertools
import operator
import warnings
from typing import Any, Iterable, Iterator

import numpy as np
from torch.utils.data import Sampler

from ..errors import UsageError, quoted
from .datasets import FileDataset
from .plan import EpochPlan


class EpochSampler(Sampler[Any]):
    """Wraps any sampler (RandomSampler, DistributedSampler, a list of item numbers, ...): at the start of each
    epoch it draws the whole order for this rank and publishes it, so each DataLoader worker decodes its next files
    ahead; under `fanstore serve` the node's serve process also fetches the remote ones ahead. Without it everything
    reads the same, unprefetched.

    A batch sampler (one that yields lists of item numbers, as BatchSampler does) is wrapped the same way and given
    as DataLoader(batch_sampler=...); its batches may differ in size. A sampler that never ends, or yields more than
    its len() says, is drawn a piece at a time (len() values or the dataset's length, whichever is more), each
    published as the loader reaches it.

    Create it before the DataLoader's workers start (as DataLoader(dataset, sampler=EpochSampler(...)) does)."""

    def __init__(self, sampler: Iterable[Any], dataset: FileDataset) -> None:
        if not isinstance(dataset, FileDataset):
            raise UsageError(f"EpochSampler: the dataset must be the fanstore.torch FileDataset or ImageFolder "
                             f"that the DataLoader reads, not a {type(dataset).__name__}: it publishes that "
                             f"dataset's item numbers (for a Subset, sample the full dataset's numbers instead, as "
                             f"SubsetRandomSampler(indices) does)")
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
            order, batches = drawn_order(values)
            self.plan.publish(order, None if batches is None else batch_bounds(batches))
            self.dataset.announce(order)
            yield from (batches if batches is not None else order.tolist())
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


def drawn_order(values: list[Any]) -> tuple[np.ndarray, list[list[int]] | None]:
    """What a sampler yielded, as the order of item numbers to publish, and the batches themselves when it yields
    batches (lists of item numbers, as BatchSampler does). Anything else (a path, a float) is one error naming it:
    int() took "3.7" as item 3 and a path as a ValueError that did not say where it came from."""
    if _is_batch(values[0]):
        batches = []
        for value in values:
            if not _is_batch(value):
                raise UsageError(f"EpochSampler: the sampler yielded a batch, then {_named(value)}: a sampler yields "
                                 f"item numbers or lists of them, not both")
            batches.append([_item_number(item) for item in value])
        return np.fromiter(itertools.chain.from_iterable(batches), np.int64), batches
    return np.fromiter(map(_item_number, values), np.int64, len(values)), None


def batch_bounds(batches: list[list[int]]) -> np.ndarray:
    """0, then where each batch ends in the order: published with it, so a worker finds its next batches whatever
    their sizes (bucketed by length, a last short one)."""
    bounds = np.zeros(len(batches) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, batches), np.int64, len(batches)), out=bounds[1:])
    return bounds


def _is_batch(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (getattr(value, "ndim", 0) == 1 and not isinstance(value, (str, bytes)))


def _item_number(value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UsageError(f"EpochSampler: the sampler yielded {_named(value)}, not an item number: a sampler yields "
                         f"the dataset's item numbers (ints; for a path, its place in the dataset's `paths`)") from None


def _named(value: Any) -> str:
    return f"{quoted(value) if isinstance(value, (str, bytes)) else repr(value)[:80]} (a {type(value).__name__})"
