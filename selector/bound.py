"""How far a kind's stored bytes in SRC may be from what its sample predicts: the variance behind a one-sided
confidence bound, from the design sample.py drew the sample with.

A kind's stored bytes are estimated cell by cell, (group, extension, kind): the cell's bytes (estimated from the
files sniffed) times its stored fraction (from the files measured, each weighted 1 / its chance of being measured,
and a large file's stored bytes from the pieces read of it). Each estimate's variance is Hajek's approximation for
a draw of a fixed number of files with unequal chances π, Σ (1 - π) (e / π - A)² over its linearised residuals e
(A their mean): zero for a cell measured whole. Where few files (or pieces) stand behind an estimate, the normal quantile
gives way to Student's t; where one stands alone, the bound assumes that the bytes it stands for do not compress at
all: stored as they are, the most the packer stores (it keeps a file raw when a codec does not shrink it).

Cells are added as if independent. The kinds of one stratum share its bytes, so their errors partly cancel: the
bound errs high for that.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from .sample import SampleFile

BOUND_Z = 2.326  # one-sided 99%: a pack planned on the bound stores more than it about once in a hundred
# One-sided 99% quantiles of Student's t by degrees of freedom; between two rows, the row of fewer (the larger
# quantile), and beyond the last, the last.
_T99 = ((1, 31.821), (2, 6.965), (3, 4.541), (4, 3.747), (5, 3.365), (6, 3.143), (7, 2.998), (8, 2.896), (9, 2.821),
        (10, 2.764), (12, 2.681), (15, 2.602), (20, 2.528), (30, 2.457), (60, 2.390), (120, 2.358))


@dataclass(frozen=True, slots=True)
class StoredEstimate:
    """A kind's estimated bytes in SRC (of the cells its sample reached) and what they store, and the variance that
    puts the bound BOUND_Z deviations above the stored bytes (already widened where few files stand behind it)."""

    raw: float
    bytes: float
    variance: float

    @property
    def fraction(self) -> float:
        """Stored / raw bytes (1 for an estimate of nothing)."""
        return self.bytes / self.raw if self.raw > 0 else 1.0

    @property
    def relative_error(self) -> float:
        """The deviation as a share of the stored bytes (0 for an estimate of nothing)."""
        return math.sqrt(self.variance) / self.bytes if self.bytes > 0 else 0.0


def widening(degrees: int) -> float:
    """The factor on a variance estimated with `degrees` degrees of freedom that makes BOUND_Z of its deviations
    reach Student's quantile: (t / z)² (infinite for none)."""
    quantile = math.inf
    for row_degrees, row_quantile in _T99:
        if row_degrees > degrees:
            break
        quantile = row_quantile
    return (quantile / BOUND_Z) ** 2


def stored_estimate(files: Sequence[SampleFile], stored: Sequence[int]) -> StoredEstimate:
    """What the kind that `files` sample (a kind's whole sample, or a sub-sample of it) stores in SRC, `stored[i]`
    being what files[i] stores, and the variance of that estimate."""
    cells: dict[object, dict[str, list[tuple[SampleFile, int]]]] = defaultdict(lambda: defaultdict(list))
    for sample_file, stored_len in zip(files, stored):
        cell_key: object = id(sample_file.cell) if sample_file.cell is not None else ("alone", sample_file.path)
        cells[cell_key][sample_file.path].append((sample_file, stored_len))
    raw = total = variance = 0.0
    for by_path in cells.values():
        cell_raw, cell_stored, cell_variance = _cell(by_path)
        raw += cell_raw
        total += cell_stored
        variance += cell_variance
    return StoredEstimate(raw, total, variance)


def fixed_size_variance(chances: Sequence[float], residuals: Sequence[float]) -> float:
    """The variance of a Horvitz-Thompson total over a draw of a fixed number of units with unequal chances, from
    the sampled units' chances π and expanded residuals e / π (Hajek's approximation: the residuals centred on
    their (1 - π)-weighted mean, n / (n - 1) for the mean taken out). Certain units add nothing."""
    spare = [1.0 - chance for chance in chances]
    if sum(spare) <= 0 or len(chances) < 2:
        return 0.0
    centre = sum(s * r for s, r in zip(spare, residuals)) / sum(spare)
    return len(chances) / (len(chances) - 1) * sum(s * (r - centre) ** 2 for s, r in zip(spare, residuals))


@dataclass(frozen=True, slots=True)
class _File:
    """A measured file as the estimate sees it."""

    size: float
    chance: float  # of being measured (1: it stands for itself alone)
    stored: float  # estimated, of the whole file
    piece_fractions: list[float]  # stored / raw of each piece read
    blocks: int  # the file's blocks (1: read whole)

    @property
    def fraction(self) -> float:
        return self.stored / self.size if self.size else 1.0


def _cell(by_path: dict[str, list[tuple[SampleFile, int]]]) -> tuple[float, float, float]:
    """One cell's estimated bytes in SRC, what they store, and the variance of the latter, from the files of it that
    are present (by path).

    The files drawn for certain store what they store; the rest of the cell's bytes, the measured fraction of the
    others. Where `by_path` is a sub-sample of the cell's measured files (a slow setting is measured on a part of
    the sample), the certain ones still stand for themselves if all are present, and the others are a sub-sample of
    theirs; if some certain one is missing, every file present is a sub-sample of all."""
    first = next(iter(by_path.values()))[0][0]
    cell = first.cell
    files = [_file(pieces) for pieces in by_path.values()]
    if cell is None:  # a file standing alone: for what its weight says
        represented = sum(f.weight * len(f.data) for pieces in by_path.values() for f, _ in pieces)
        only = files[0]
        return represented, represented * only.fraction, represented**2 * _within_files(files, [1.0])
    certain = [f for f in files if f.chance >= 1.0]
    others = [f for f in files if f.chance < 1.0]
    if len(certain) < cell.certain_files:
        others = [_scaled(f, len(files) / max(cell.files, len(files))) for f in files]
        certain = []
    elif cell.files - cell.certain_files > len(others) > 0:
        others = [_scaled(f, len(others) / (cell.files - cell.certain_files)) for f in others]
    known_size = sum(f.size for f in certain)
    known_stored = sum(f.stored for f in certain)
    rest = max(0.0, cell.bytes - known_size)
    variance = sum(f.size**2 * _piece_variance(f) for f in certain)
    if others:
        counted = sum(f.size / f.chance for f in others)
        fraction = sum(f.stored / f.chance for f in others) / counted
        shares = [f.size / f.chance / counted for f in others]
        fraction_variance = _between_files(others, fraction, counted) + _within_files(others, shares)
    else:  # nothing measured stands for the rest: what the certain ones store, and it may all be stored raw
        fraction = known_stored / known_size if known_size else 1.0
        fraction_variance = ((1.0 - fraction) / BOUND_Z) ** 2 if rest > 0 else 0.0
    variance += rest**2 * fraction_variance + fraction**2 * cell.bytes_var
    return cell.bytes, known_stored + rest * fraction, variance


def _file(pieces: list[tuple[SampleFile, int]]) -> _File:
    first = pieces[0][0]
    size = float(first.file_size if first.file_size is not None else len(first.data))
    read = sum(len(sample_file.data) for sample_file, _ in pieces)
    stored = sum(stored_len for _, stored_len in pieces)
    fractions = [stored_len / len(sample_file.data) for sample_file, stored_len in pieces if sample_file.data]
    return _File(size, first.inclusion, stored * size / read if read else size, fractions,
                 max(first.file_pieces, len(pieces)))


def _scaled(f: _File, share: float) -> _File:
    """A file of a sub-sample that kept `share` of the files it was drawn from."""
    return _File(f.size, min(f.chance * share, 1.0 - 1e-9), f.stored, f.piece_fractions, f.blocks)


def _between_files(measured: list[_File], fraction: float, counted: float) -> float:
    """Variance of a stored fraction from which files were measured (those not drawn for certain)."""
    if len(measured) == 1:  # no spread to go by: the bytes it stands for may all be stored as they are
        return ((1.0 - measured[0].fraction) / BOUND_Z) ** 2
    residuals = [(f.stored - fraction * f.size) / f.chance for f in measured]
    return (fixed_size_variance([f.chance for f in measured], residuals) / counted**2
            * widening(len(measured) - 1))


def _within_files(measured: list[_File], shares: list[float]) -> float:
    """Variance of a stored fraction from which pieces of its large files were read, each file counting by its
    share of the bytes."""
    return sum(share**2 * _piece_variance(f) for f, share in zip(measured, shares))


def _piece_variance(f: _File) -> float:
    """Variance of a file's stored fraction from the pieces read of it (0 when read whole)."""
    pieces = len(f.piece_fractions)
    if pieces >= f.blocks:
        return 0.0
    if pieces < 2:  # no spread to go by: the rest of the file may be stored as it is
        return ((1.0 - f.fraction) / BOUND_Z) ** 2
    mean = sum(f.piece_fractions) / pieces
    spread = sum((r - mean) ** 2 for r in f.piece_fractions) / (pieces - 1)
    return (1.0 - pieces / f.blocks) * spread / pieces * widening(pieces - 1)
