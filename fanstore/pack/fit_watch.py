"""The running total of a `--fit` pack: after each batch, what DEST surely takes already, against --fit.

The selection plans --fit against the bound of its prediction, so a pack it accepts fits 99 times in 100; this
catches the hundredth, or a tree its sample was blind to, while packing rather than after. The total watched is a
floor of the final one, never an estimate (the files still to pack may store next to nothing), so the pack stops
as soon as DEST can no longer fit, and never a pack that would have fitted:

  without --nodes (what DEST takes): the chunk files so far, headers included, and the least the index takes: its
  header, INDEX_BYTES_PER_ENTRY for each of SRC's entries (its record, path hash, place in the lookup order and
  first_child row) plus its path, INDEX_BYTES_PER_FILE for each file (its place in file_order), known from the walk,
  and the dictionaries it will hold. The table of contents (options, the
  selection record) is not counted: only the check of the finished DEST sees it.
  with --nodes N (what the fullest node stores): at least the mean of the nodes, the replicated chunk files so far
  (every node stores them; their group is packed last) plus the spread ones / N. Which node gets which bytes is
  known only from the finished index (serve/placement.py), and the placement leaves the fullest node a few
  percent above the mean: that, like the table of contents, only the final check sees. The index is not staged on
  the nodes, and not counted, as `fanstore plan` does not count it.

The CLI checks the finished DEST against --fit all the same: that check is the last word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import DoesNotFit
from ..core.format import INDEX_HEADER_LEN

if TYPE_CHECKING:
    from selector.fit import Need


@dataclass(frozen=True, slots=True)
class FitWatch:
    """What a --fit pack checks after each batch (see the module docstring); `predicted` is the selection's Need,
    quoted when the pack stops."""

    fit: int
    nodes: int  # 0: --fit is what DEST takes
    replicated_groups: frozenset[int]
    index_floor: int  # the least the index takes, dictionaries included
    raw_total: int
    predicted: Need

    @classmethod
    def for_pack(cls, fit: int, nodes: int, replicated_groups: frozenset[int], index_entries_bytes: int,
                 dictionary_bytes: int, raw_total: int, predicted: Need) -> FitWatch:
        """`index_entries_bytes`: the index's entries and paths (index_size.index_bytes_estimate of the walk)."""
        return cls(fit, nodes, replicated_groups, INDEX_HEADER_LEN + index_entries_bytes + dictionary_bytes,
                   raw_total, predicted)

    def check(self, chunk_bytes: dict[int, int], raw_done: int) -> None:
        """DoesNotFit, in one line, once the chunk files written so far (bytes per group) and the index's floor can
        no longer fit; `raw_done` of the source's bytes were packed into them."""
        from selector.units import decimal_bytes

        replicated = sum(size for group, size in chunk_bytes.items() if group in self.replicated_groups)
        spread = sum(chunk_bytes.values()) - replicated
        if self.nodes:
            least = replicated + math.ceil(spread / self.nodes)
            what = (f"each node would store {decimal_bytes(least)} or more ({decimal_bytes(replicated)} replicated "
                    f"+ {decimal_bytes(spread)} spread / {self.nodes:,})")
        else:
            least = replicated + spread + self.index_floor
            what = f"{decimal_bytes(least)} stored already (chunk files and the index)"
        if least <= self.fit:
            return
        where = f" --nodes {self.nodes:,}" if self.nodes else ""
        raise DoesNotFit(f"--fit {decimal_bytes(self.fit)}{where}: the pack stopped, it can no longer fit: {what} "
                         f"after {decimal_bytes(raw_done)} of {decimal_bytes(self.raw_total)} raw, where the selection "
                         f"predicted {self.predicted.describe()}")
