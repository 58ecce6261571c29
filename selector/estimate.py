"""What a pack with the chosen settings will store and how long it will take, predicted from the sample.

Stored bytes: each kind's estimated bytes in SRC divided by its chosen setting's ratio on the sample, plus the
dictionaries (one per group the kind is in).

Pack time, for the person who waits for it, follows how the packer works (fanstore/pack/packer.py, compress.py):

  * walking SRC before and writing the index after: the packing process, per file;
  * training dictionaries: the packing process reads up to DICT_TRAIN_TOTAL_BYTES of file heads per group, then
    trains one dictionary per group and zstd-dict kind on that kind's heads, one after another. Which files it
    reads follows from the walk (training_heads); each head counts for the kinds its extension holds in the
    sample. The selector's own trainings are scaled to those bytes as a fixed cost plus n log n (measure.py). Kinds
    the sample lacked are not counted: when `other` got zstd-dict the packer trains their dictionary on their own
    files, which the sample did not see;
  * then two stages that overlap, so the slower one sets the time: the workers read, checksum and compress each
    file (reading per file and per MB, compressing at each kind's measured encode speed, spread over the workers,
    capped at the cores this process may use: more workers than cores only take turns), while the packing process
    writes the stored bytes into chunk files (O_DIRECT, synced per chunk).

The per-file and per-MB costs are constants measured on the 2-core development machine (page cache warm): see them
below. On a shared machine the pack gets the cores other processes leave: the selector measures how much CPU they
used while it ran (Linux: /proc/stat less its own CPU time), and the estimate spreads the workers' stage over at
most the cores left (at least one), and slows the packing process's terms when less than one core is left.

The selection itself is not part of it: `fanstore pack --codec auto` has measured it by the time it prints the
estimate.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from compressors import DICT_TRAIN_FILE_BYTES, training_draw

from .measure import MB, Measurement
from .policy import KindScale
from .units import plural
from .sample import SampleFile, SourceFile, extension_key

# Fitted to `fanstore pack --codec none` (nothing compressed) with 1 and 2 workers on this project's 2-core
# development machine, idle, warm page cache, DEST on the local ext4 disk (O_DIRECT writes at 0.7-1.6 GB/s), three
# trees: 114,001 generated files (1,250 MB) in 4.7-7.5 s with 2 workers, 9.3-10.5 s with 1; 50,000 files of 1 KiB
# in 1.2-1.7 s and 1.9-2.9 s; 6,284 files of site-packages (180 MB) in 0.60-0.95 s and 0.74-0.81 s. Small files
# are bound by the workers' per-file work (open, fstat, read, checksum, hand-back), large ones by the packing
# process's writes, which is why the two stages are a max and not a sum. The same machine runs 30-40% slower in
# some hours than in others (a virtual machine with neighbours): the constants are the middle of that range, so a
# prediction is off by up to about 20% either way for that alone. Rounded.
WALK_SECONDS_PER_FILE = 6.3e-6  # walking, and the file's index row: the packing process
READ_SECONDS_PER_FILE = 41e-6  # worker seconds: open, stat, read, checksum, hand the blob back
READ_SECONDS_PER_MB = 4.2e-3  # worker seconds per MB read, checksummed and handed back
WRITE_SECONDS_PER_MB = 2.5e-3  # packing process: gathering stored bytes into chunk files, writing and syncing them
FIXED_SECONDS = 0.05  # worker start, index write
# The packing process reading file heads to train dictionaries on, before the workers start: open, read, sniff the
# kind. Measured on the same machine, warm: 2,073 heads of site-packages (33.6 MB) in 0.12-0.18 s, 3,376 of the
# generated tree (33.6 MB) in 0.09-0.20 s.
HEAD_READ_SECONDS_PER_FILE = 15e-6
HEAD_READ_SECONDS_PER_MB = 2.0e-3
_MIN_SERIAL_SHARE = 0.25  # a busier machine than this is not worth estimating for


@dataclass(frozen=True, slots=True)
class PackEstimate:
    """The predicted seconds of a pack with the chosen settings (the selection not counted), term by term."""

    workers: int
    walk_seconds: float  # walking SRC and writing the index
    train_seconds: float  # reading the file heads to train on, and training
    read_seconds: float  # the workers' reading, spread over them
    compress_seconds: float  # the workers' compressing, spread over them
    write_seconds: float  # the packing process writing chunk files, while the workers read and compress
    others_cores: float = 0.0  # cores other processes used while the selector measured

    @property
    def seconds(self) -> float:
        return (self.walk_seconds + self.train_seconds
                + max(self.read_seconds + self.compress_seconds, self.write_seconds))

    def describe(self) -> str:
        busy = f"; other processes used {self.others_cores:.1f} cores meanwhile" if self.others_cores >= 0.1 else ""
        return (f"{self.seconds:,.1f} s with {plural(self.workers, 'worker')}: walk and index "
                f"{self.walk_seconds:,.1f} s, "
                f"dictionaries {self.train_seconds:,.1f} s, reading {self.read_seconds:,.1f} s and compressing "
                f"{self.compress_seconds:,.1f} s on the workers while chunk files are written "
                f"({self.write_seconds:,.1f} s){busy}")


@dataclass(frozen=True, slots=True)
class CpuClock:
    """A reading of the CPU time all processes and this one have used: two of them give the cores others used."""

    wall: float
    busy: float  # seconds all CPUs were busy, None-free: 0 where /proc/stat cannot be read
    own: float

    @classmethod
    def now(cls) -> CpuClock:
        times = os.times()
        return cls(time.monotonic(), _busy_seconds(), times.user + times.system)

    def others_since(self, earlier: CpuClock) -> float:
        """Cores other processes used between `earlier` and this reading (0 where it cannot be known)."""
        wall = self.wall - earlier.wall
        if wall <= 0 or not self.busy or not earlier.busy:
            return 0.0
        return max(0.0, (self.busy - earlier.busy - (self.own - earlier.own)) / wall)


def _busy_seconds() -> float:
    """Seconds all CPUs have been busy since boot, from /proc/stat (0.0 where there is none)."""
    try:
        with open("/proc/stat") as stat_file:
            fields = [int(value) for value in stat_file.readline().split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def usable_workers(workers: int) -> int:
    """The workers a pack compresses with (0: every core), at most the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(workers or cores, cores))


def estimate_pack(chosen: Mapping[str, Measurement | None], scales: Mapping[str, KindScale], files: int,
                  raw_bytes: int, workers: int, others_cores: float = 0.0, cores: int = 0,
                  head_reads: tuple[int, int] = (0, 0)) -> PackEstimate:
    """The pack time of SRC (`files` non-empty files, `raw_bytes` in all) with these settings per kind, on
    `workers` workers, with `cores` cores (0: this machine's) of which other processes leave `others_cores` fewer.
    `head_reads`: the files and bytes of the heads the packer reads when it trains any dictionary."""
    left = (cores or usable_workers(0)) - others_cores
    parallel = min(workers, max(1.0, left))
    serial = min(1.0, max(_MIN_SERIAL_SHARE, left))
    compress = train = 0.0
    stored = float(raw_bytes)
    for kind, m in chosen.items():
        if m is None:
            continue
        scale = scales[kind]
        compress += scale.raw_bytes / MB / max(m.encode_mbps, 1e-12) / parallel
        train += m.train_seconds_for(scale.train_bytes, scale.groups) / serial
        stored -= scale.raw_bytes - scale.raw_bytes / m.ratio
    if train:
        train += (head_reads[0] * HEAD_READ_SECONDS_PER_FILE + head_reads[1] / MB * HEAD_READ_SECONDS_PER_MB) / serial
    read = (files * READ_SECONDS_PER_FILE + raw_bytes / MB * READ_SECONDS_PER_MB) / parallel
    walk = (FIXED_SECONDS + files * WALK_SECONDS_PER_FILE) / serial
    write = max(stored, 0.0) / MB * WRITE_SECONDS_PER_MB / serial
    return PackEstimate(workers, walk, train, read, compress, write, others_cores)


def kind_scales(sample: Sequence[SampleFile], kind_bytes: Mapping[str, int], replicated_groups: frozenset[int],
                training: Mapping[int, Sequence[tuple[str, int]]]) -> dict[str, KindScale]:
    """Per kind: its estimated bytes in SRC, those in replicated groups, its groups, and the bytes the packer would
    train its dictionaries on: each file head it would read (`training`, from training_heads) counted for the kinds
    its extension holds in that group, as the sample found them (the group's kind shares for an extension the sample
    lacks). The packer's heads are its own draw of the group's files, not the sample: counted by what they are, a
    draw that happens to hold more of one kind than the whole charges that kind more."""
    strata: dict[tuple[int, str], int] = {}
    cells: dict[tuple[int, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for f in sample:
        if f.stratum_bytes is not None:
            strata[(f.group, f.kind)] = f.stratum_bytes
        cells[(f.group, extension_key(f.path))][f.kind] += f.weight * len(f.data)
    by_group: dict[int, dict[str, float]] = defaultdict(dict)  # a group's kind shares, for extensions not sampled
    replicated: dict[str, int] = defaultdict(int)
    groups: dict[str, int] = defaultdict(int)
    for (group, kind), stratum_bytes in strata.items():
        by_group[group][kind] = stratum_bytes
        groups[kind] += 1
        if group in replicated_groups:
            replicated[kind] += stratum_bytes
    train: dict[str, float] = defaultdict(float)
    for group, heads in training.items():
        shares_of: dict[str, dict[str, float]] = {}
        for path, head in heads:
            extension = extension_key(path)
            shares = shares_of.get(extension)
            if shares is None:
                shares = shares_of[extension] = _shares(cells.get((group, extension)) or by_group.get(group, {}))
            for kind, share in shares.items():
                train[kind] += head * share
    return {kind: KindScale(raw, min(replicated[kind], raw), max(groups[kind], 1), round(train[kind]))
            for kind, raw in kind_bytes.items()}


def _shares(bytes_by_kind: Mapping[str, float]) -> dict[str, float]:
    total = sum(bytes_by_kind.values())
    return {kind: value / total for kind, value in bytes_by_kind.items()} if total > 0 else {}


def files_by_group(files: Sequence[SourceFile], group_of: Callable[[str], int]) -> dict[int, list[SourceFile]]:
    """The non-empty files of each group, in the order given (the walk's: by path). One pass over a million files
    costs about half a second; the estimate needs nothing else of them."""
    by_group: dict[int, list[SourceFile]] = defaultdict(list)
    for entry in files:
        if entry.size > 0:
            by_group[group_of(entry.path)].append(entry)
    return dict(by_group)


def training_heads(by_group: Mapping[int, Sequence[SourceFile]]) -> dict[int, list[tuple[str, int]]]:
    """Per group, the path and head bytes of each file the packer reads to train that group's dictionaries
    (fanstore's codec plan): the files compressors.training_draw draws of the group's non-empty files in path
    order, their first DICT_TRAIN_FILE_BYTES each."""
    result = {}
    for group, members in by_group.items():
        drawn = training_draw([entry.size for entry in members]).tolist()
        result[group] = [(members[number].path, min(members[number].size, DICT_TRAIN_FILE_BYTES)) for number in drawn]
    return result
