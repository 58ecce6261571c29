"""From measurements to a choice: the most capacity whose decode still keeps up with the training job.

Synchronous reads decode on the read path, so one decoder must reach the budget; with K prefetch threads decoding
ahead, K decoders share it, so each needs only budget / K and a stronger codec can pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .errors import SelectionError
from .measure import MB, Measurement

NONE_SPEC = "none"
# A codec must save at least this share of a kind's bytes to be worth decoding on every read: 1-3% on JPEGs buys
# almost no capacity for CPU time the training job would rather spend on augmentation.
MIN_SAVING = 0.05
# Equal stored sizes (zstd levels that set the same parameters produce the same bytes) are told apart by decode
# speed only when one is clearly faster; otherwise by the grid order (the cheaper encoder), so that timing noise
# cannot flip the choice between two codecs that do the same work.
_CLEARLY_FASTER = 1.25


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
class Choice:
    """The codec chosen for a kind, the measurement behind it (None when `none` was not measured), and why."""

    kind: str
    spec: str
    measurement: Measurement | None
    meets_budget: bool
    reason: str


def meets(measurement: Measurement, budget: Budget) -> bool:
    """Whether one decoder of this setting keeps up with the budget."""
    return budget.bytes_per_s == 0 or measurement.decode_mbps >= budget.required_decode_mbps


def choose(kind: str, measurements: Sequence[Measurement], budget: Budget, min_saving: float = MIN_SAVING) -> Choice:
    """The setting with the largest saving among those that meet the budget and save at least `min_saving`;
    `none` (store as is) when there is none, with a reason saying what was missed and by how much.

    `none` is always allowed, even when its measured copy is slower than required: nothing decodes faster.
    """
    candidates = [m for m in measurements if m.kind == kind]
    order = {m.spec: number for number, m in enumerate(candidates)}
    none_measurement = next((m for m in candidates if m.spec == NONE_SPEC), None)
    codecs = [m for m in candidates if m.spec != NONE_SPEC]
    fast_enough = [m for m in codecs if meets(m, budget)]
    worthwhile = [m for m in fast_enough if m.saving >= min_saving]
    if worthwhile:
        best = _best(worthwhile, order)
        return Choice(kind, best.spec, best, True, _chosen_reason(best, budget, len(fast_enough)))
    none_meets = none_measurement is None or meets(none_measurement, budget)
    return Choice(kind, NONE_SPEC, none_measurement, none_meets,
                  _fallback_reason(codecs, fast_enough, none_measurement, budget, min_saving))


def _best(measurements: list[Measurement], order: dict[str, int]) -> Measurement:
    """Largest saving; on equal stored size, a clearly faster decoder, else the earlier setting of the grid."""
    top_ratio = max(m.ratio for m in measurements)
    tied = sorted((m for m in measurements if m.ratio == top_ratio), key=lambda m: order[m.spec])
    best = tied[0]
    for other in tied[1:]:
        if other.decode_mbps > best.decode_mbps * _CLEARLY_FASTER:
            best = other
    return best


def _chosen_reason(best: Measurement, budget: Budget, fast_enough: int) -> str:
    what = f"saves {best.saving:.1%} (ratio {best.ratio:.2f}), decodes at {best.decode_mbps:,.0f} MB/s"
    if budget.bytes_per_s == 0:
        return f"{what}: the best ratio, as there is no speed requirement"
    return (f"{what}: the best ratio of the {fast_enough} codec setting(s) that reach "
            f"{budget.required_decode_mbps:,.0f} MB/s")


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
        return (f"budget not met: no codec reaches {required:,.0f} MB/s; the fastest, {fastest.spec}, decodes at "
                f"{fastest.decode_mbps:,.0f} MB/s, {required / fastest.decode_mbps:,.1f}x too slow" + tail)
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
