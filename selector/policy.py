"""From measurements to a choice per file kind, in one of two modes: the default, here, and --fit (fit.py).

Default (no --fit): the most capacity whose decode still keeps up with the training job. Synchronous reads decode
on the read path, so one decoder must reach the budget; with K prefetch threads decoding ahead, K decoders share
it, so each needs only budget / K and a stronger codec can pass. Pack time counts too: among the settings that meet
the budget and store within --tolerance (default 1%) of the smallest, the one that packs the kind fastest wins
(zstd at level 19 stores 1% less than at level 9 for ten times the pack time; a person waits for that pack). Pack
times within 25% of each other count as equal, and then the smaller size wins: timing noise must not decide.

Floors apply in both modes: --budget (each decoder must reach budget / K) and --pack-speed (each kind must pack
at that rate with the pack's workers, its dictionaries' training included, so the whole tree's compression does
too). `none` always meets both; it is stored when nothing else does. A decode speed within DECODE_NOISE of what is
required is named as such and does not count as reaching it: the faster-decoding setting is taken, so that the
same command makes the same choice on a quiet machine and a loaded one (measured speeds vary by that much).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from compressors import DEFAULT_DICT_SIZE, dictionary_size

from .errors import SelectionError
from .measure import DECODE_NOISE, MB, Measurement
from .units import decimal_bytes, format_seconds, plural

NONE_SPEC = "none"
# A codec must save at least this share of a kind's bytes to be worth decoding on every read: 1-3% on JPEGs buys
# almost no capacity for CPU time the training job would rather spend on augmentation.
MIN_SAVING = 0.05
# Stored sizes within this share of the smallest count as equal, so that the faster pack wins (--tolerance).
DEFAULT_TOLERANCE = 0.01
# Equal stored sizes (zstd levels that set the same parameters produce the same bytes) are told apart by decode
# speed only when one is clearly faster; otherwise by the grid order (the cheaper encoder), so that timing noise
# cannot flip the choice between two codecs that do the same work.
_CLEARLY_FASTER = 1.25
# Pack times within this factor of the fastest count as equal, as decode speeds do: among them the smaller stored
# size wins, so that timing noise between two encoders doing about the same work (blosc with byte or bit shuffle,
# zstd at neighbouring levels) rarely flips the choice.
_SAME_PACK_TIME = _CLEARLY_FASTER
MAX_NODES = 4096  # as fanstore's placement


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class Budget:
    """What the training job needs: `bytes_per_s` of decoded data, read synchronously or by K prefetch threads."""

    bytes_per_s: float  # the trainer's consumption rate; 0 means no speed requirement
    prefetch_threads: int = 0  # 0: synchronous decode on the read path; K>0: K threads decode ahead

    def __post_init__(self) -> None:
        rate = self.bytes_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise SelectionError(f"--budget: must be a finite throughput of 0 or more bytes/s, got {rate!r}")
        threads = self.prefetch_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise SelectionError(f"--prefetch-threads: must be an integer of 0 or more, got {threads!r}")

    @property
    def required_decode_mbps(self) -> float:
        """What one decoder must reach, in MB/s: the budget (sync), or the budget / K (K prefetch threads)."""
        return self.bytes_per_s / MB / max(self.prefetch_threads, 1)

    def describe(self) -> str:
        if self.bytes_per_s == 0:
            return "no speed requirement (budget 0): best ratio"
        rate = f"{self.bytes_per_s / MB:,.0f} MB/s"
        if self.prefetch_threads == 0:
            return f"budget {rate}, synchronous decode: each decode must reach {rate}"
        return (f"budget {rate}, {self.prefetch_threads} prefetch threads: each must reach "
                f"{self.required_decode_mbps:,.0f} MB/s")


@dataclass(frozen=True, slots=True)
class Goal:
    """What the selection aims at besides the decode budget: a capacity to fit (--fit, per node with --nodes), the
    capacity tolerance of the default mode, a floor on pack speed, and the workers the pack will compress with."""

    fit_bytes: int = 0  # 0: no --fit (the default mode)
    nodes: int = 0  # 0: --fit is the whole dataset; N: what one of N nodes stores
    tolerance: float = DEFAULT_TOLERANCE
    pack_mbps: float = 0.0  # --pack-speed; 0: no floor
    workers: int = 1  # compression processes of the pack, at most the cores

    def __post_init__(self) -> None:
        if not _is_int(self.fit_bytes) or self.fit_bytes < 0:
            raise SelectionError(f"--fit: must be a size of 1 byte or more, got {self.fit_bytes!r}")
        if not _is_int(self.nodes) or not 0 <= self.nodes <= MAX_NODES:
            raise SelectionError(f"--nodes: must be a whole number from 1 to {MAX_NODES}, got {self.nodes!r}")
        if self.nodes and not self.fit_bytes:
            raise SelectionError("--nodes: only applies with --fit (the capacity each node has for the dataset)")
        if not _is_number(self.tolerance) or not 0 <= self.tolerance < 1:
            raise SelectionError(f"--tolerance: must be a fraction from 0 up to 100% (e.g. 1%), got "
                                 f"{self.tolerance!r}")
        if not _is_number(self.pack_mbps) or self.pack_mbps < 0:
            raise SelectionError(f"--pack-speed: must be a finite throughput of 0 or more, got {self.pack_mbps!r}")
        if not _is_int(self.workers) or self.workers < 1:
            raise SelectionError(f"--workers: must be 1 or more, got {self.workers!r}")

    def describe(self) -> str:
        """One line: the mode, the floors besides the budget, and the workers the estimates assume."""
        if self.fit_bytes:
            where = f" on each of {plural(self.nodes, 'node')}" if self.nodes else ""
            mode = f"--fit {decimal_bytes(self.fit_bytes)}{where}: the fastest decode that fits"
        else:
            mode = (f"--tolerance {self.tolerance:.1%}: the fastest pack among settings storing within "
                    f"{self.tolerance:.1%} of the smallest")
        floor = f"; --pack-speed {self.pack_mbps:,.0f} MB/s per kind" if self.pack_mbps else ""
        return f"{mode}{floor}; pack estimated with {plural(self.workers, 'worker')}"



@dataclass(frozen=True, slots=True)
class KindScale:
    """How one kind of SRC scales a sample's measurement: its estimated bytes in SRC (of them, those in replicated
    groups), the groups it is in, and the bytes the packer would train its dictionaries on."""

    raw_bytes: int
    replicated_bytes: int = 0
    groups: int = 1
    train_bytes: int = 0  # per zstd-dict choice, over its groups

    def stored(self, m: Measurement | None) -> float:
        """Predicted stored bytes of the kind, its dictionaries included."""
        if m is None:
            return float(self.raw_bytes)
        return self.raw_bytes / m.ratio + self.dictionary_bytes(m)

    def dictionary_bytes(self, m: Measurement) -> int:
        """The dictionaries the packer trains for this setting, one a group: their size follows the bytes it
        trains on (train_bytes, over the groups), not the sample the selector trained on, which is smaller (a pack
        of the held-out bench tree stored a 112,640-byte dictionary where the sample's was 16,416). At most, as the
        groups' shares of train_bytes are not known apart."""
        if not m.dict_bytes:
            return 0
        if not self.train_bytes:  # a record from before train_bytes: the sample's dictionary size
            return m.dict_bytes * self.groups
        # Each group's is dictionary_size(its share); over the groups, at most the rule applied to their sum.
        most = dictionary_size(self.train_bytes, self.groups * DEFAULT_DICT_SIZE)
        return max(most, m.dict_bytes)

    def stored_error(self, m: Measurement | None) -> float:
        """The deviation of the kind's predicted stored bytes from sampling (its dictionaries' are exact)."""
        if m is None:
            return 0.0
        return self.raw_bytes / m.ratio * m.stored_rse

    def stored_replicated(self, m: Measurement | None) -> float:
        return self.replicated_bytes / (m.ratio if m is not None else 1.0)

    def stored_spread(self, m: Measurement | None) -> float:
        return (self.raw_bytes - self.replicated_bytes) / (m.ratio if m is not None else 1.0)

    def decode_seconds(self, m: Measurement | None) -> float:
        """One thread decoding the whole kind once; 0 for `none` (nothing is decoded)."""
        if m is None or m.spec == NONE_SPEC:
            return 0.0
        return self.raw_bytes / MB / max(m.decode_mbps, 1e-12)

    def pack_seconds(self, m: Measurement | None, workers: int) -> float:
        """Compressing the kind on `workers` processes at the measured encode speed, plus training its
        dictionaries (in the packing process, one after another)."""
        if m is None:
            return 0.0
        return (self.raw_bytes / MB / max(m.encode_mbps, 1e-12) / max(workers, 1)
                + m.train_seconds_for(self.train_bytes, self.groups))

    def pack_mbps(self, m: Measurement | None, workers: int) -> float:
        seconds = self.pack_seconds(m, workers)
        return self.raw_bytes / MB / seconds if seconds > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Choice:
    """The codec chosen for a kind, the measurement behind it (None when `none` was not measured), and why."""

    kind: str
    spec: str
    measurement: Measurement | None
    meets_budget: bool
    reason: str


def stores_as_is(measurement: Measurement) -> bool:
    """Whether the setting stores the kind's files as they are (`none`, or a codec that made no file smaller): a
    read then decodes nothing, and its measured decode speed is a copy's, which says nothing of the codec."""
    return measurement.spec == NONE_SPEC or measurement.stored_bytes >= measurement.raw_bytes


def meets(measurement: Measurement, budget: Budget) -> bool:
    """Whether one decoder of this setting keeps up with the budget, beyond the noise of the measurement: a speed
    within DECODE_NOISE of the budget does not count (see near_budget)."""
    return budget.bytes_per_s == 0 or measurement.decode_mbps >= budget.required_decode_mbps * (1 + DECODE_NOISE)


def near_budget(measurement: Measurement, budget: Budget) -> bool:
    """Whether the setting's decode speed is within the noise of the budget (DECODE_NOISE either side): measured
    again, it could fall on either side, so it does not count as reaching it, and the choice repeats."""
    required = budget.required_decode_mbps
    return budget.bytes_per_s > 0 and abs(measurement.decode_mbps / required - 1) < DECODE_NOISE


def meets_pack_speed(measurement: Measurement, scale: KindScale, goal: Goal) -> bool:
    """Whether the kind packs at --pack-speed or more with this setting (always, without a floor)."""
    return goal.pack_mbps == 0 or scale.pack_mbps(measurement, goal.workers) >= goal.pack_mbps


def choose(
    kind: str,
    measurements: Sequence[Measurement],
    budget: Budget,
    min_saving: float = MIN_SAVING,
    goal: Goal = Goal(),
    scale: KindScale | None = None,
) -> Choice:
    """The default mode for one kind: among the settings that meet the floors and save at least `min_saving`, those
    storing within the tolerance of the smallest, and of them the fastest to pack; `none` (store as is) when there is
    none, with a reason saying what was missed and by how much. `scale` says what the kind costs to pack (without it,
    the sample's own bytes: the fastest encoder wins).

    `none` is always allowed, even when its measured copy is slower than required: nothing decodes faster.
    """
    candidates = [m for m in measurements if m.kind == kind]
    if scale is None:
        scale = KindScale(max((m.raw_bytes for m in candidates), default=0))
    order = {m.spec: number for number, m in enumerate(candidates)}
    none_measurement = next((m for m in candidates if m.spec == NONE_SPEC), None)
    codecs = [m for m in candidates if m.spec != NONE_SPEC]
    fast_enough = [m for m in codecs if meets(m, budget)]
    packs_fast = [m for m in fast_enough if meets_pack_speed(m, scale, goal)]
    worthwhile = [m for m in packs_fast if _net_saving(m, scale) >= min_saving]
    if worthwhile:
        best, smallest, near = _within_tolerance(worthwhile, order, goal, scale)
        return Choice(kind, best.spec, best, True,
                      _chosen_reason(best, smallest, near, budget, goal, scale, len(fast_enough))
                      + _noise_note(codecs, best.saving, budget))
    none_meets = none_measurement is None or meets(none_measurement, budget)
    reason = _fallback_reason(codecs, fast_enough, none_measurement, budget, min_saving)
    if fast_enough and not packs_fast:
        quickest = max(fast_enough, key=lambda m: scale.pack_mbps(m, goal.workers))
        reason = (f"--pack-speed not met: no codec that reaches the budget packs this kind at "
                  f"{goal.pack_mbps:,.0f} MB/s; the fastest, {quickest.spec}, packs at "
                  f"{scale.pack_mbps(quickest, goal.workers):,.0f} MB/s with {plural(goal.workers, 'worker')}; "
                  "files are stored as they are")
    return Choice(kind, NONE_SPEC, none_measurement, none_meets, reason + _noise_note(codecs, 0.0, budget))


def _noise_note(codecs: list[Measurement], chosen_saving: float, budget: Budget) -> str:
    """The settings left out for reaching the budget by less than the noise, where they would have saved more: the
    rule named, so that a person reading two runs sees why they agree."""
    required = budget.required_decode_mbps
    left_out = [m for m in codecs if required <= m.decode_mbps and not meets(m, budget) and m.saving > chosen_saving]
    if not left_out:
        return ""
    best = max(left_out, key=lambda m: (m.saving, m.decode_mbps))
    others = f" and {len(left_out) - 1} more" if len(left_out) > 1 else ""
    return (f"; {best.spec} (saves {best.saving:.1%}, decodes at {best.decode_mbps:,.0f} MB/s){others} reach "
            f"{required:,.0f} MB/s by less than the noise ({DECODE_NOISE:.0%}): not counted as reaching it, so that "
            "the same command chooses the same on a loaded machine")


def _net_saving(m: Measurement, scale: KindScale) -> float:
    """The share of the kind's bytes the setting saves once its dictionaries are stored too."""
    return 1.0 - scale.stored(m) / scale.raw_bytes if scale.raw_bytes else m.saving


def _within_tolerance(measurements: list[Measurement], order: dict[str, int], goal: Goal, scale: KindScale
                      ) -> tuple[Measurement, Measurement, list[Measurement]]:
    """(the choice, the smallest stored setting, the settings within tolerance of it). Among those within tolerance,
    the fastest to pack; pack times within _SAME_PACK_TIME of it count as equal, and then the smaller stored size
    wins, then `_best`'s rule (so two settings that do the same work are told apart without timing noise)."""
    smallest = _best(measurements, order, scale)
    limit = scale.stored(smallest) * (1 + goal.tolerance)
    near = [m for m in measurements if m is smallest or scale.stored(m) <= limit]
    fastest = min(scale.pack_seconds(m, goal.workers) for m in near)
    quick = [m for m in near if scale.pack_seconds(m, goal.workers) <= fastest * _SAME_PACK_TIME]
    if smallest in quick:
        return smallest, smallest, near
    least = min(scale.stored(m) for m in quick)
    return _best([m for m in quick if scale.stored(m) == least], order, scale), smallest, near


def _best(measurements: list[Measurement], order: dict[str, int], scale: KindScale) -> Measurement:
    """The least stored, its dictionaries included (a dictionary of 24 kB for 20 files that zstd stores in 380 B
    was chosen for its better ratio); on equal stored size, a clearly faster decoder, else the earlier setting of
    the grid."""
    least = min(scale.stored(m) for m in measurements)
    tied = sorted((m for m in measurements if scale.stored(m) == least), key=lambda m: order[m.spec])
    best = tied[0]
    for other in tied[1:]:
        if other.decode_mbps > best.decode_mbps * _CLEARLY_FASTER:
            best = other
    return best


def _chosen_reason(best: Measurement, smallest: Measurement, near: list[Measurement], budget: Budget, goal: Goal,
                   scale: KindScale, fast_enough: int) -> str:
    """Why `best` was chosen, in the terms of the table beside it (ratio, decode MB/s, pack s): every claim it makes
    ('the fastest to pack') holds for the figures printed there."""
    def pack(m: Measurement) -> float:
        return scale.pack_seconds(m, goal.workers)

    what = (f"saves {best.saving:.1%} (ratio {best.ratio:.2f}), decodes at {best.decode_mbps:,.0f} MB/s, packs in "
            f"{format_seconds(pack(best))} s")
    if budget.bytes_per_s == 0:
        pool = "the least stored (dictionaries included), as there is no speed requirement"
    else:
        pool = (f"the least stored (dictionaries included) of the {plural(fast_enough, 'codec setting')} that "
                f"{'reaches' if fast_enough == 1 else 'reach'} {budget.required_decode_mbps:,.0f} MB/s")
    fastest = min(near, key=lambda m: (pack(m), m is not best))
    among = f"the {len(near)} within {goal.tolerance:.1%} of {'it' if best is smallest else 'the best'}"
    if fastest is best:
        quickest = f"the fastest to pack of {among}"
    else:  # within _SAME_PACK_TIME of the fastest: timing noise must not decide, so the smaller stored size wins
        quickest = (f"of {among}, {fastest.spec} packs faster ({format_seconds(pack(fastest))} s), but this takes "
                    f"at most {_SAME_PACK_TIME - 1:.0%} longer, which counts as a tie, and stores "
                    f"{'less' if scale.stored(best) < scale.stored(fastest) else 'as little'}")
    if best is smallest:
        return f"{what}: {pool}" + (f", and {quickest}" if len(near) > 1 else "")
    return (f"{what}: within {goal.tolerance:.1%} of {pool} ({smallest.spec}, ratio {smallest.ratio:.2f}, "
            f"{format_seconds(pack(smallest))} s to pack), and {quickest}")


def _fallback_reason(
    codecs: list[Measurement],
    fast_enough: list[Measurement],
    none_measurement: Measurement | None,
    budget: Budget,
    min_saving: float,
) -> str:
    required = budget.required_decode_mbps
    tail = "; files are stored as they are"
    if none_measurement is not None and not meets(none_measurement, budget):
        tail += (f" (even uncompressed reads decode at only {none_measurement.decode_mbps:,.0f} MB/s, "
                 f"{required / max(none_measurement.decode_mbps, 1e-12):,.1f}x short of the budget)")
    if not codecs:
        return "no codec was measured" + tail
    if not fast_enough:
        fastest = max(codecs, key=lambda m: m.decode_mbps)
        if fastest.decode_mbps >= required:  # _noise_note names it
            return f"budget not met: no codec reaches {required:,.0f} MB/s by more than the noise" + tail
        short = ("within the noise of it" if near_budget(fastest, budget)
                 else f"{required / fastest.decode_mbps:,.1f}x too slow")
        return (f"budget not met: no codec reaches {required:,.0f} MB/s; the fastest, {fastest.spec}, decodes at "
                f"{fastest.decode_mbps:,.0f} MB/s, {short}" + tail)
    saving_enough = [m for m in codecs if m.saving >= min_saving]
    best_fast = max(fast_enough, key=lambda m: m.saving)
    if saving_enough:
        fastest = max(saving_enough, key=lambda m: m.decode_mbps)
        return (f"budget not met by any codec saving {min_saving:.0%} or more: the fastest of them, {fastest.spec} "
                f"(saves {fastest.saving:.1%}), decodes at {fastest.decode_mbps:,.0f} MB/s, "
                f"{required / fastest.decode_mbps:,.1f}x too slow for {required:,.0f} MB/s; the best that is fast "
                f"enough, {best_fast.spec}, saves only {best_fast.saving:.1%}" + tail)
    return (f"not worth decoding: no codec saves {min_saving:.0%} or more of this kind (best: {best_fast.spec} "
            f"saves {best_fast.saving:.1%})" + tail)
