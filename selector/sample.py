"""A reproducible sample of SRC, stratified by group and file kind, small enough to measure every codec on.

The sample must predict the whole dataset: every (group, kind) stratum gets a few files and a floor of bytes, and
the rest of the byte budget is shared in proportion to each stratum's bytes. Kinds come from a content sniff, so
heads of files are read, but only of a seeded candidate subset chosen by extension first: never every file of a
large tree.

Which files are drawn depends only on the seed and the paths and sizes of the tree (a file's place in the order
is the xxh3 of its path, seeded), so the same tree gives the same sample on any machine, and adding a file does
not reshuffle the others.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import xxhash

from compressors.kinds import HEAD_BYTES, file_kind

from .errors import SelectionError

DEFAULT_FRACTION = 0.02
DEFAULT_MAX_BYTES = 48 << 20
FILE_CAP = 4 << 20  # at most this much of one file is measured: its first bytes, like a large file's first chunk
MIN_SAMPLE_BYTES = 1 << 20  # below this, timings are noise: a small tree is sampled at least this much (if it has it)
MIN_FILES = 4  # files of every (group, kind) stratum, whatever its share of the bytes
# Bytes of every (group, kind) stratum, whatever its share (at most an equal split of the target between strata).
# A kind of small files measured on a few hundred KiB decoded 15% faster than the whole kind in the packed dataset
# (too few files, looped over and over, and a dictionary trained on too little); from about 2 MiB on the
# prediction held within a few percent.
MIN_STRATUM_BYTES = 2 << 20
SNIFF_FILES = 32  # heads read per (group, extension) stratum at least, to find kinds the extension does not tell
SNIFF_TOTAL = 16384  # bound on that floor over all strata, for trees with very many extensions
_MAX_EXTENSION = 8  # longer "extensions" (or all digits: part.000123) are not a kind hint


@dataclass(frozen=True, slots=True)
class SampleFile:
    """One sampled file: its kind and group as the packer will see them, and the bytes to measure codecs on."""

    path: str
    kind: str
    group: int
    data: bytes
    file_size: int | None = None  # the whole file's size, more than len(data) when only its first bytes were read
    stratum_bytes: int | None = None  # estimated bytes of this file's (group, kind) stratum in the whole tree
    # Bytes of the tree each of its sampled bytes stands for: its (group, extension, kind) cell's estimated bytes
    # over the cell's sampled bytes. A kind mixes extensions in other shares than the tree does (every extension
    # gets a floor of candidates), so its ratio is the weighted one (measure.py).
    weight: float = 1.0

    @property
    def truncated(self) -> bool:
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


# (seeded xxh3 of the path, path, entry), sorted by the hash alone: comparing whole tuples costs twice as much on a
# million files, and two equal 64-bit hashes (odds 1 in 10^7 for a million files) keep the input order, which
# walk_source sorts by path.
_Ranked = tuple[int, str, "SourceFile"]
_BY_HASH = operator.itemgetter(0)
_Stratum = tuple[int, str]  # (group, extension) before the sniff, (group, kind) after it


class SourceFile(Protocol):
    """A file of SRC as the caller walked it: its path relative to SRC, '/'-separated, and its size."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


def draw_sample(
    root: Path,
    files: Sequence[SourceFile],
    group_of: Callable[[str], int],
    fraction: float = DEFAULT_FRACTION,
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int = 0,
) -> list[SampleFile]:
    """About `fraction` of the bytes of `files` (at least MIN_SAMPLE_BYTES, at most `max_bytes`), stratified.

    Returned in the seeded random order, so any prefix of the list (or of its files of one kind) is itself a random
    sub-sample. Empty files are left out (they store nothing); files that cannot be read are skipped (the packer
    reports them). A file larger than the per-file cap contributes its first bytes only (`truncated`).
    """
    fraction = check_fraction(fraction)
    max_bytes = check_max_bytes(max_bytes)
    seed = check_seed(seed)
    by_name: dict[_Stratum, list[_Ranked]] = defaultdict(list)
    name_bytes: dict[_Stratum, int] = defaultdict(int)
    for entry in files:
        if entry.size > 0 and entry.is_file:
            path = entry.path
            key = (group_of(path), extension_key(path))
            by_name[key].append((xxhash.xxh3_64_intdigest(path.encode("utf-8"), seed=seed), path, entry))
            name_bytes[key] += entry.size
    if not by_name:
        return []
    for members in by_name.values():
        members.sort(key=_BY_HASH)
    total = sum(name_bytes.values())
    file_cap = max(HEAD_BYTES, min(FILE_CAP, max_bytes // 8))
    target = min(max_bytes, total, max(math.ceil(fraction * total), MIN_SAMPLE_BYTES))

    candidates = _candidates(by_name, name_bytes, target, total, file_cap)
    by_kind, kind_bytes, cell_bytes = _sniff(root, candidates, name_bytes)
    chosen = _allocate(by_kind, kind_bytes, target, max_bytes, file_cap)

    sample = []
    for ranked, group in sorted(chosen, key=lambda item: item[0][0]):
        entry = ranked[2]
        data = _read(root, entry.path, min(entry.size, file_cap))
        if data:
            kind = file_kind(entry.path, data[:HEAD_BYTES])
            sample.append(SampleFile(entry.path, kind, group, data, entry.size, kind_bytes.get((group, kind))))
    return _weighted(sample, cell_bytes)


def _weighted(sample: list[SampleFile], cell_bytes: dict[tuple[int, str, str], int]) -> list[SampleFile]:
    """The sample with each file's weight: its (group, extension, kind) cell's estimated bytes in the tree over the
    cell's bytes in the sample (1 for a cell the sniff did not see, which keeps its own share)."""
    sampled: dict[tuple[int, str, str], int] = defaultdict(int)
    for f in sample:
        sampled[(f.group, extension_key(f.path), f.kind)] += len(f.data)
    weighted = []
    for f in sample:
        cell = (f.group, extension_key(f.path), f.kind)
        in_tree = cell_bytes.get(cell)
        weight = in_tree / sampled[cell] if in_tree else 1.0
        weighted.append(dataclasses.replace(f, weight=weight))
    return weighted


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


def _candidates(
    by_name: dict[_Stratum, list[_Ranked]], name_bytes: dict[_Stratum, int], target: int, total: int, file_cap: int
) -> dict[_Stratum, list[_Ranked]]:
    """Per (group, extension) stratum, the first files in seeded order: enough to fill its byte share (or the
    floor), and a few more so that kinds the extension hides (text among extensionless files) are found too."""
    sniff_floor = max(MIN_FILES, min(SNIFF_FILES, SNIFF_TOTAL // len(by_name)))
    bytes_floor = _stratum_floor(target, len(by_name))
    candidates = {}
    for key in sorted(by_name):
        members = by_name[key]
        share = max(target * name_bytes[key] // total, bytes_floor)
        needed, filled = 0, 0
        while needed < len(members) and filled < share:
            filled += min(members[needed][2].size, file_cap)
            needed += 1
        candidates[key] = members[: max(needed, sniff_floor)]
    return candidates


def _sniff(
    root: Path, candidates: dict[_Stratum, list[_Ranked]], name_bytes: dict[_Stratum, int]
) -> tuple[dict[_Stratum, list[_Ranked]], dict[_Stratum, int], dict[tuple[int, str, str], int]]:
    """The candidates by (group, kind), in seeded order, each such stratum's estimated bytes in the whole tree (an
    extension stratum's bytes split between kinds as they are split among its sniffed candidates), and the same
    per (group, extension, kind) cell."""
    by_kind: dict[_Stratum, list[_Ranked]] = defaultdict(list)
    kind_bytes: dict[_Stratum, int] = defaultdict(int)
    cell_bytes: dict[tuple[int, str, str], int] = {}
    for (group, name), members in candidates.items():
        seen: dict[str, int] = defaultdict(int)
        for ranked in members:
            head = _read(root, ranked[1], HEAD_BYTES)
            if not head:
                continue
            kind = file_kind(ranked[1], head)
            by_kind[(group, kind)].append(ranked)
            seen[kind] += ranked[2].size
        seen_bytes = sum(seen.values())
        for kind, size in seen.items():
            cell_bytes[(group, name, kind)] = name_bytes[(group, name)] * size // seen_bytes
            kind_bytes[(group, kind)] += cell_bytes[(group, name, kind)]
    for members in by_kind.values():  # candidates from several extension strata: back into the seeded order
        members.sort(key=_BY_HASH)
    return by_kind, kind_bytes, cell_bytes


def _allocate(
    by_kind: dict[_Stratum, list[_Ranked]], kind_bytes: dict[_Stratum, int], target: int, max_bytes: int,
    file_cap: int,
) -> list[tuple[_Ranked, int]]:
    """MIN_FILES of every (group, kind) stratum first (round robin, largest strata first, so a tight cap still
    covers the strata that matter most), then each stratum up to the floor of bytes, then up to its share of the
    target bytes."""
    order = sorted(by_kind, key=lambda key: (-kind_bytes[key], key))
    taken = {key: 0 for key in order}
    taken_bytes = {key: 0 for key in order}
    chosen: list[tuple[_Ranked, int]] = []
    used = 0

    def take(key: _Stratum) -> bool:
        nonlocal used
        ranked = by_kind[key][taken[key]]
        size = min(ranked[2].size, file_cap)
        if used + size > max_bytes:
            return False
        chosen.append((ranked, key[0]))
        taken[key] += 1
        taken_bytes[key] += size
        used += size
        return True

    for round_number in range(MIN_FILES):
        for key in order:
            if taken[key] == round_number < len(by_kind[key]):
                take(key)

    def fill(key: _Stratum, quota: int) -> None:
        while taken[key] < len(by_kind[key]) and taken_bytes[key] < quota and take(key):
            pass

    floor = _stratum_floor(target, len(order))
    for key in order:
        fill(key, floor)
    known_bytes = sum(kind_bytes.values()) or 1
    for key in reversed(order):  # smallest first: under the cap, the largest stratum gives up what floors took
        fill(key, target * kind_bytes[key] // known_bytes)
    return chosen


def _stratum_floor(target: int, strata: int) -> int:
    """MIN_STRATUM_BYTES, unless an equal split of the target between the strata is less."""
    return min(MIN_STRATUM_BYTES, target // max(strata, 1))


def _read(root: Path, path: str, size: int) -> bytes:
    """The first `size` bytes of a file, or b"" when it cannot be read now."""
    try:
        with open(os.path.join(root, path), "rb") as f:
            return f.read(size)
    except OSError:
        return b""
