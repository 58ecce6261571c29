"""A reproducible sample of SRC, drawn by bytes and stratified by group and file kind, small enough to measure every
codec on; each sampled file carries the design it was drawn with, so that what the sample predicts can be bounded.

By bytes, not by files: within a (group, extension) stratum the files are drawn in the order of u / size, u a seeded
uniform number per path (sequential Poisson sampling), so that the first n of them are a sample in which a file's
chance is about n x its size / the stratum's bytes, and a file larger than the stratum's bytes / n is certain. One
large file weighs as much as its bytes: a 3 MiB file of random bytes among many small compressible ones is
measured, where a draw by files measured four small ones and promised a ratio the kind does not have. A file the
packer stores in blocks (over FILE_CAP) is measured by some of its blocks, spread over it, as many as its share of
the stratum's byte budget asks (at least MIN_PIECES).

The sample must predict the whole dataset: every (group, kind) stratum gets a few files and a floor of bytes, and
the rest of the byte budget is shared in proportion to each stratum's bytes. Kinds come from a content sniff of the
files drawn by bytes and of a few more per extension drawn by count, which find kinds the extension hides (text
among extensionless files) even where they hold few bytes: never every file of a large tree.

The estimates are Horvitz-Thompson: a (group, extension, kind) cell's bytes are estimated from the files sniffed,
each counted 1 / the chance it had of being sniffed; of the files measured, one drawn for certain stands for itself
and each of the others, drawn with a chance in proportion to its size, for an equal share of the rest of the cell's
bytes (`SampleFile.weight`, per sampled byte). bound.py turns the same design into a confidence bound on what each
kind stores.

Which files are drawn depends only on the seed and the paths and sizes of the tree (the xxh3 of each path, seeded),
so the same tree gives the same sample on any machine.
"""

from __future__ import annotations

import heapq
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import xxhash

from compressors.kinds import HEAD_BYTES, file_kind

from .errors import SelectionError

DEFAULT_FRACTION = 0.02
DEFAULT_MAX_BYTES = 48 << 20
# The packer stores a file of up to 4 MiB whole and a larger one in blocks of 1 MiB, each compressed on its own
# (fanstore's defaults of --blocks-above and --block-size): a file is measured as it will be stored, whole or by
# some of its blocks.
FILE_CAP = 4 << 20
PIECE_BYTES = 1 << 20
MIN_PIECES = 2  # blocks measured of a file measured in pieces, at least: their spread says how much it varies
MIN_SAMPLE_BYTES = 1 << 20  # below this, timings are noise: a small tree is sampled at least this much (if it has it)
MIN_FILES = 4  # files of every (group, kind) stratum, whatever its share of the bytes
# Files measured, about, however small they are: every sampled file is encoded and decoded with every setting
# (0.3-0.5 ms a file on the 2-core development machine), so a tree of tiny files, which the floor of bytes above
# sampled whole, took longer to select for than to pack (200,000 files of 1-7 bytes: 138 s, every file measured).
# The draw and the allotment share it between strata as they share bytes (and MIN_FILES still hold).
MAX_SAMPLE_FILES = 4096
# Bytes of every (group, kind) stratum, whatever its share (at most an equal split of the target between strata).
# A kind of small files measured on a few hundred KiB decoded 15% faster than the whole kind in the packed dataset
# (too few files, looped over and over, and a dictionary trained on too little); from about 2 MiB on the
# prediction held within a few percent.
MIN_STRATUM_BYTES = 2 << 20
SNIFF_FILES = 32  # heads read per (group, extension) stratum, drawn by count, to find kinds the extension hides
SNIFF_TOTAL = 16384  # bound on that floor over all strata, for trees with very many extensions
_MAX_EXTENSION = 8  # longer "extensions" (or all digits: part.000123) are not a kind hint
_LOW_64 = (1 << 64) - 1
_UNIT = 2.0**-64

_Stratum = tuple[int, str]  # (group, extension), where files are drawn; (group, kind), where bytes are allotted
_Cell = tuple[int, str, str]  # (group, extension, kind), where the estimates are made


@dataclass(frozen=True, slots=True)
class CellEstimate:
    """A (group, extension, kind) cell of SRC as the sample sees it: its bytes, estimated from the files sniffed
    (exact when every file of its stratum was), their variance, and the number of its files measured."""

    bytes: float
    bytes_var: float = 0.0
    files: int = 0
    certain_files: int = 0  # of them, those drawn for certain: each stands for itself alone


@dataclass(frozen=True, slots=True)
class SampleFile:
    """One sampled file, or one piece of a large one: its kind and group as the packer will see them, and the bytes
    to measure codecs on."""

    path: str
    kind: str
    group: int
    data: bytes
    file_size: int | None = None  # the whole file's size, more than len(data) for a piece
    stratum_bytes: int | None = None  # estimated bytes of this file's (group, kind) stratum in the whole tree
    # Bytes of the tree each of its sampled bytes stands for: the file's cell's estimated bytes, shared among the
    # cell's measured files in inverse proportion to the chance each had of being measured, and among a large
    # file's pieces in proportion to their bytes. A kind's ratio is the weighted one (measure.py).
    weight: float = 1.0
    offset: int = 0  # where `data` starts in the file: a block of a large file
    # The design behind `weight`, for bound.py: the chance the file had of being measured (1: certain), the pieces
    # measured of it (1: read whole) and the file's blocks, and its cell (None: a file standing for itself alone).
    inclusion: float = 1.0
    pieces: int = 1
    file_pieces: int = 1
    cell: CellEstimate | None = None
    # The file's first HEAD_BYTES: a piece is encoded with codec.for_file(head), as the packer encodes each block
    head: bytes = b""

    @property
    def truncated(self) -> bool:
        """A piece of a larger file (files stored in blocks are measured by some of their blocks)."""
        return self.file_size is not None and self.file_size > len(self.data)


def check_fraction(fraction: float) -> float:
    """The sample fraction as a float in (0, 1], or SelectionError naming --sample."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise SelectionError(f"--sample: the sample fraction must be more than 0 and at most 1 (100%), got {fraction!r}")
    return float(fraction)


def check_max_bytes(max_bytes: int) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise SelectionError(f"max_bytes: the sample size cap must be a positive number of bytes, got {max_bytes!r}")
    return max_bytes


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise SelectionError(f"--seed: must be an integer from 0 to 2**64-1, got {seed!r}")
    return seed


class SourceFile(Protocol):
    """A file of SRC as the caller walked it: its path relative to SRC, '/'-separated, and its size."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


@dataclass(slots=True)
class _Drawn:
    """A file of a stratum that the draw reached: how it would be measured, and what the sniff found."""

    entry: SourceFile
    digest: int  # seeded xxh3-128 of the path: its high half orders the draw by count, its low half the draw by bytes
    priority: float  # u / size: the draw by bytes takes files in rising order of it
    pieces: int  # blocks measured of it (1: read whole)
    piece_bytes: int
    kind: str = ""
    sniffed: float = 1.0  # the chance it had of being sniffed (by either draw)
    certain: bool = False  # so large that the draw by bytes always takes it: it stands for itself alone
    head: bytes = b""  # its first HEAD_BYTES, as sniffed

    @property
    def sampled_bytes(self) -> int:
        return min(self.entry.size, self.pieces * self.piece_bytes)


def draw_sample(
    root: Path | PieceSource,
    files: Sequence[SourceFile],
    group_of: Callable[[str], int],
    fraction: float = DEFAULT_FRACTION,
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int = 0,
) -> list[SampleFile]:
    """About `fraction` of the bytes of `files` (at least MIN_SAMPLE_BYTES, at most `max_bytes`), drawn by bytes and
    stratified; in about MAX_SAMPLE_FILES files at most.

    Returned in a seeded random order, so any prefix of the list (or of its files of one kind) is itself a random
    sub-sample. Empty files are left out (they store nothing); files that cannot be read are skipped (the packer
    reports them). A file larger than the per-file cap is measured by some of its pieces (`truncated`).
    """
    fraction = check_fraction(fraction)
    max_bytes = check_max_bytes(max_bytes)
    seed = check_seed(seed)
    strata = _strata(files, group_of, seed)
    if not strata:
        return []
    stratum_bytes = {key: sum(entry.size for _, entry in members) for key, members in strata.items()}
    total = sum(stratum_bytes.values())
    target = min(max_bytes, total, max(math.ceil(fraction * total), MIN_SAMPLE_BYTES))
    draw = _draw_strata(root, strata, stratum_bytes, target, max_bytes)
    sample = _measured_sample(root, _allocate(draw.by_kind, draw.kind_bytes, target, max_bytes), draw)
    sample.sort(key=lambda f: xxhash.xxh3_64_intdigest(f"{f.path}\0{f.offset}".encode("utf-8", "surrogateescape"),
                                                       seed=seed))
    return sample


def _strata(files: Sequence[SourceFile], group_of: Callable[[str], int], seed: int
            ) -> dict[_Stratum, list[tuple[int, SourceFile]]]:
    """The non-empty files by (group, extension), each with its seeded digest (the draws' randomness)."""
    strata: dict[_Stratum, list[tuple[int, SourceFile]]] = defaultdict(list)
    for entry in files:
        if entry.size > 0 and entry.is_file:
            path = entry.path
            digest = xxhash.xxh3_128_intdigest(path.encode("utf-8", "surrogateescape"), seed=seed)
            strata[(group_of(path), extension_key(path))].append((digest, entry))
    return strata


@dataclass(slots=True)
class _Draw:
    """Phase one over every stratum: the files drawn by (group, kind), in the order of the draw by bytes, and the
    cell of each (by id); each cell's estimated bytes and their variance; each (group, kind)'s estimated bytes."""

    by_kind: dict[_Stratum, list[_Drawn]]
    cell_of: dict[int, _Cell]
    cells: dict[_Cell, tuple[float, float]]
    kind_bytes: dict[_Stratum, float]


def _draw_strata(root: Path | PieceSource, strata: dict[_Stratum, list[tuple[int, SourceFile]]],
                 stratum_bytes: dict[_Stratum, int], target: int, max_bytes: int) -> _Draw:
    """Each stratum drawn (_draw_stratum) for its share of `target` sampled bytes, at least its floor."""
    total = sum(stratum_bytes.values())
    unit_cap = max(HEAD_BYTES, min(FILE_CAP, max_bytes // 8))
    floor = _stratum_floor(target, len(strata))
    sniff_files = max(MIN_FILES, min(SNIFF_FILES, SNIFF_TOTAL // len(strata)))
    draw = _Draw(defaultdict(list), {}, {}, defaultdict(float))
    quotas = {key: max(target * stratum_bytes[key] // total, floor) for key in strata}
    file_caps = _file_caps(quotas)
    for key in sorted(strata):
        drawn = _draw_stratum(root, strata[key], stratum_bytes[key], quotas[key], file_caps[key], sniff_files,
                              unit_cap)
        group, extension = key
        for found in drawn:
            draw.by_kind[(group, found.kind)].append(found)
            draw.cell_of[id(found)] = (group, extension, found.kind)
        for kind, estimate in _cell_bytes(drawn, stratum_bytes[key]).items():
            draw.cells[(group, extension, kind)] = estimate
    for members in draw.by_kind.values():  # several extension strata: back into one order of the draw by bytes
        members.sort(key=lambda found: found.priority)
    for (group, _, kind), (estimate, _) in draw.cells.items():
        draw.kind_bytes[(group, kind)] += estimate
    return draw


def _measured_sample(root: Path | PieceSource, chosen: list[_Drawn], draw: _Draw) -> list[SampleFile]:
    """The files `chosen` to be measured, read (pieces of the large ones), cell by cell, with their weights."""
    measured_in: dict[_Cell, list[_Drawn]] = defaultdict(list)
    for found in chosen:
        measured_in[draw.cell_of[id(found)]].append(found)
    sample = []
    for cell, measured in sorted(measured_in.items()):
        group, _, kind = cell
        sample += _measured_files(root, cell, measured, draw.cells[cell], round(draw.kind_bytes[(group, kind)]))
    return sample


def _draw_stratum(root: Path | PieceSource, members: list[tuple[int, SourceFile]], stratum_bytes: int, quota: int,
                  file_cap: int, sniff_files: int, unit_cap: int) -> list[_Drawn]:
    """Phase one in a (group, extension) stratum: the files drawn by bytes until they hold `quota` sampled bytes (and
    at least MIN_FILES) or number `file_cap`, and the first `sniff_files` drawn by count; each sniffed for its kind,
    with the chance it had of being sniffed. Files whose head cannot be read are left out."""
    sizes = np.fromiter((entry.size for _, entry in members), dtype=np.float64, count=len(members))
    uniforms = np.fromiter(((digest & _LOW_64) + 1 for digest, _ in members), dtype=np.float64,
                           count=len(members)) * _UNIT
    priorities = uniforms / sizes
    by_bytes = np.argsort(priorities, kind="stable")
    taken = sampled = 0
    for index in by_bytes.tolist():
        if (sampled >= quota or taken >= file_cap) and taken >= MIN_FILES:
            break
        pieces, piece_bytes = _pieces(members[index][1].size, quota, stratum_bytes, unit_cap)
        sampled += min(members[index][1].size, pieces * piece_bytes)
        taken += 1
    by_count = heapq.nsmallest(sniff_files, range(len(members)), key=lambda index: members[index][0] >> 64)
    by_bytes_chance = _inclusion(sizes, taken)
    by_count_chance = min(1.0, sniff_files / len(members))
    drawn = []
    for index in sorted(set(by_bytes[:taken].tolist()) | set(by_count)):
        digest, entry = members[index]
        head = _read(root, entry.path, 0, HEAD_BYTES)
        if not head:
            continue
        pieces, piece_bytes = _pieces(entry.size, quota, stratum_bytes, unit_cap)
        sniffed = 1.0 - (1.0 - float(by_bytes_chance[index])) * (1.0 - by_count_chance)
        drawn.append(_Drawn(entry, digest, float(priorities[index]), pieces, piece_bytes,
                            file_kind(entry.path, head), sniffed, bool(by_bytes_chance[index] >= 1.0), head))
    return drawn


def _pieces(size: int, quota: int, stratum_bytes: int, unit_cap: int) -> tuple[int, int]:
    """How a drawn file is measured: (pieces, bytes each). Whole when the packer stores it whole and it is within the
    per-file cap; else in blocks, as many as the file's share of its stratum's quota asks, at least MIN_PIECES."""
    piece_bytes = min(size if size <= FILE_CAP else PIECE_BYTES, unit_cap)
    if piece_bytes >= size:
        return 1, size
    blocks = -(-size // piece_bytes)
    wanted = math.ceil(quota * size / stratum_bytes / piece_bytes)
    return min(blocks, max(MIN_PIECES, wanted)), piece_bytes


def _inclusion(sizes: np.ndarray, draws: float, counts: np.ndarray | None = None) -> np.ndarray:
    """The chance of each unit to be among `draws` drawn by bytes: min(1, rate x size), the rate such that the chances
    add up to `draws` (a unit that would reach 1 is certain, and the others share what is left). `counts`: how
    many units of the population each size stands for (1 each by default)."""
    counts = np.ones_like(sizes) if counts is None else counts
    if draws >= counts.sum():
        return np.ones_like(sizes)
    order = np.argsort(-sizes, kind="stable")
    rest_bytes = float((sizes * counts).sum())
    certain = 0.0
    rate = draws / rest_bytes
    for index in order.tolist():
        rate = (draws - certain) / rest_bytes
        if sizes[index] * rate < 1.0:
            break
        certain += counts[index]
        rest_bytes -= sizes[index] * counts[index]
    return np.minimum(1.0, rate * sizes)


def _cell_bytes(drawn: list[_Drawn], stratum_bytes: int) -> dict[str, tuple[float, float]]:
    """Per kind found in a stratum, the estimated bytes of its cell and their variance: the stratum's bytes shared
    between kinds as the sniffed files hold them, each counted 1 / its chance of being sniffed (a ratio estimate,
    linearised for the variance, bound.fixed_size_variance)."""
    from .bound import fixed_size_variance  # bound.py reads SampleFile: imported here, not at the top

    weighted: dict[str, float] = defaultdict(float)
    for found in drawn:
        weighted[found.kind] += found.entry.size / found.sniffed
    counted = sum(weighted.values())
    chances = [found.sniffed for found in drawn]
    estimates = {}
    for kind, kind_weighted in weighted.items():
        share = kind_weighted / counted
        residuals = [found.entry.size * ((found.kind == kind) - share) / found.sniffed for found in drawn]
        estimates[kind] = (stratum_bytes * share,
                           (stratum_bytes / counted) ** 2 * fixed_size_variance(chances, residuals))
    return estimates


def _allocate(by_kind: dict[_Stratum, list[_Drawn]], kind_bytes: dict[_Stratum, float], target: int,
              max_bytes: int) -> list[_Drawn]:
    """MIN_FILES of every (group, kind) stratum first (round robin, largest strata first, so a tight cap still
    covers the strata that matter most), then each stratum up to the floor of bytes, then up to its share of the
    target bytes, and never past its share of MAX_SAMPLE_FILES files; in each, in the order of the draw by bytes. A
    file measured whole that the draw takes for certain is taken as it comes but counts towards none: it tells
    nothing about the files it does not stand for."""
    order = sorted(by_kind, key=lambda key: (-kind_bytes[key], key))
    floor = _stratum_floor(target, len(order))
    known_bytes = sum(kind_bytes.values()) or 1.0
    file_caps = _file_caps({key: max(floor, target * kind_bytes[key] / known_bytes) for key in order})
    position = {key: 0 for key in order}
    counted = {key: 0 for key in order}
    counted_bytes = {key: 0 for key in order}
    chosen: list[_Drawn] = []
    used = 0

    def take(key: _Stratum) -> bool:
        nonlocal used
        found = by_kind[key][position[key]]
        if used + found.sampled_bytes > max_bytes:
            return False
        chosen.append(found)
        position[key] += 1
        used += found.sampled_bytes
        if not found.certain or found.pieces > 1:
            counted[key] += 1
            counted_bytes[key] += found.sampled_bytes
        return True

    for round_number in range(MIN_FILES):
        for key in order:
            while counted[key] == round_number and position[key] < len(by_kind[key]) and take(key):
                pass

    def fill(key: _Stratum, quota: float) -> None:
        while (position[key] < len(by_kind[key]) and counted_bytes[key] < quota and counted[key] < file_caps[key]
               and take(key)):
            pass

    for key in order:
        fill(key, floor)
    for key in reversed(order):  # smallest first: under the cap, the largest stratum gives up what floors took
        fill(key, target * kind_bytes[key] / known_bytes)
    return chosen


def _measured_files(root: Path | PieceSource, cell: _Cell, measured: list[_Drawn], estimate: tuple[float, float],
                    kind_bytes: int) -> list[SampleFile]:
    """The measured files of one cell, read (whole, or by pieces), with their weights and design.

    A file the draw by bytes takes for certain stands for itself alone. The others are the first of the cell's other
    files in the order of that draw, so each had a chance of about n x its size / the bytes they stand for (the
    cell's estimated bytes less the certain files'): each stands for an equal share of those bytes."""
    group, _, kind = cell
    read = [(found, pieces) for found in measured if (pieces := _read_pieces(root, found))]
    certain = [(found, pieces) for found, pieces in read if found.certain]
    others = [(found, pieces) for found, pieces in read if not found.certain]
    rest = max(0.0, estimate[0] - sum(found.entry.size for found, _ in certain))
    rate = len(others) / rest if rest > 0 else math.inf
    cell_estimate = CellEstimate(estimate[0], estimate[1], len(read), len(certain))
    sample = []
    for found, pieces in read:
        size = found.entry.size
        read_bytes = sum(len(data) for _, data in pieces)
        chance = 1.0 if found.certain else min(1.0, rate * size)
        stands_for = size if found.certain else (rest / len(others) if others else 0.0)
        blocks = -(-size // found.piece_bytes)
        for offset, data in pieces:
            sample.append(SampleFile(found.entry.path, kind, group, data, size, kind_bytes, stands_for / read_bytes,
                                     offset, chance, len(pieces), blocks, cell_estimate, found.head))
    return sample


def _read_pieces(root: Path | PieceSource, found: _Drawn) -> list[tuple[int, bytes]]:
    """(offset, bytes) of each piece of a drawn file it is measured by: the whole file, or blocks spread over it (a
    systematic draw from a seeded start); [] when it cannot be read now."""
    size, piece_bytes = found.entry.size, found.piece_bytes
    if found.pieces == 1 and piece_bytes >= size:
        data = _read(root, found.entry.path, 0, size)
        return [(0, data)] if data else []
    blocks = -(-size // piece_bytes)
    start = ((found.digest >> 64) & 0xFFFF) / 65536  # a seeded start in [0, 1)
    stride = blocks / found.pieces
    offsets = [int((number + start) * stride) * piece_bytes for number in range(found.pieces)]
    pieces = []
    for offset in offsets:
        data = _read(root, found.entry.path, offset, piece_bytes)
        if not data:
            return []
        pieces.append((offset, data))
    return pieces


def estimated_kind_bytes(sample: Sequence[SampleFile]) -> dict[str, int]:
    """Per kind, its estimated bytes in the whole tree (the sample's own shares are not: small kinds get a floor)."""
    by_stratum = {(f.group, f.kind): f.stratum_bytes for f in sample if f.stratum_bytes is not None}
    totals: dict[str, int] = defaultdict(int)
    for (_, kind), stratum_bytes in sorted(by_stratum.items()):
        totals[kind] += stratum_bytes
    return dict(totals)


def extension_key(path: str) -> str:
    """The extension as a hint of the kind ("" when the name gives none); the content sniff decides."""
    name = path[path.rfind("/") + 1 :]
    dot = name.rfind(".")
    if dot <= 0 or len(name) - dot > _MAX_EXTENSION + 1 or name[dot + 1 :].isdigit():
        return ""
    return name[dot:].lower()


def _file_caps(quotas: dict[_Stratum, float]) -> dict[_Stratum, int]:
    """Per stratum, the files it may have measured: its share of MAX_SAMPLE_FILES as its share of the sampled
    bytes (`quotas`), at least MIN_FILES."""
    total = sum(quotas.values()) or 1.0
    return {key: max(MIN_FILES, math.ceil(MAX_SAMPLE_FILES * quota / total)) for key, quota in quotas.items()}


def _stratum_floor(target: int, strata: int) -> int:
    """MIN_STRATUM_BYTES, unless an equal split of the target between the strata is less."""
    return min(MIN_STRATUM_BYTES, target // max(strata, 1))


class PieceSource(Protocol):
    """Where sampled bytes come from when SRC is no directory (fanstore's reader of archives is one): `size`
    bytes of the file at `path` from `offset`, b"" when it cannot be read."""

    def read(self, path: str, offset: int, size: int) -> bytes: ...


def _read(root: Path | PieceSource, path: str, offset: int, size: int) -> bytes:
    """`size` bytes of a file from `offset`, or b"" when it cannot be read now."""
    if not isinstance(root, (str, os.PathLike)):
        return root.read(path, offset, size)
    try:
        with open(os.path.join(root, path), "rb") as f:
            f.seek(offset)
            return f.read(size)
    except OSError:
        return b""
