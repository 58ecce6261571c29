"""Whether a packed dataset fits the capacity its `--fit` asked for, measured rather than predicted: the whole of
DEST (chunk files and index), or with `--nodes N` the fullest node of the placement `fanstore plan` and
`fanstore serve` use (its spread pieces and every replicated chunk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path



@dataclass(frozen=True, slots=True)
class FitCheck:
    """The bytes that had to fit (DEST's, or the fullest node's), the capacity, and what they were predicted to be."""

    stored: int
    capacity: int
    nodes: int
    predicted: int

    @property
    def fits(self) -> bool:
        return self.stored <= self.capacity

    def describe(self) -> str:
        """One line, in the decimal units the selector reports --fit in."""
        from selector.policy import decimal_bytes as format_bytes

        where = f"the fullest of {self.nodes:,} nodes stores" if self.nodes else "DEST takes"
        off = f"predicted {format_bytes(self.predicted)}, {self.stored / self.predicted - 1:+.1%}" \
            if self.predicted else "not predicted"
        if self.fits:
            return (f"fit: {where} {format_bytes(self.stored)} of --fit {format_bytes(self.capacity)} "
                    f"({self.stored / self.capacity:.0%}; {off})")
        return (f"does not fit: {where} {format_bytes(self.stored)}, {format_bytes(self.stored - self.capacity)} over "
                f"--fit {format_bytes(self.capacity)} ({off})")


def check_fit(dest: Path, capacity: int, nodes: int, predicted: int = 0) -> FitCheck:
    """Measure a packed DEST against `capacity` (per node with `nodes`); `predicted` is what the selection said."""
    if nodes:
        from .index import Index
        from .serve.placement import place

        placement = place(Index.load(dest), nodes)
        stored = max(placement.stored_bytes(rank) for rank in range(nodes))
    else:
        stored = sum(path.stat().st_size for path in Path(dest).rglob("*") if path.is_file())
    return FitCheck(stored, capacity, nodes, predicted)
