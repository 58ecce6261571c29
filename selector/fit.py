"""The --fit mode of the policy: the fastest decode that still fits (policy.py holds the default mode, and the
floors both modes apply).

--fit SIZE: the fastest decode that still fits. It is a multiple-choice problem (one setting per kind, the sum of
stored bytes bounded), solved greedily: every kind starts at its fastest-decoding setting (`none`: nothing
decodes faster) and, while the predicted total exceeds SIZE, the kind whose next stronger setting saves the most
bytes per second of decode time it adds (decode time = the kind's bytes in SRC / decode speed, one epoch, one
thread) moves to it. Stronger settings are taken along each kind's front (the settings no faster one beats in
stored size); once it fits, a kind that can step back to a faster decoder and still fit does so. When even the
strongest setting of every kind does not fit, it fails in one line saying by how much. With --nodes N the size
that must fit is one node's: its replicated bytes plus its share of the spread bytes (spread / N, rounded up; the
placement balances spread bytes to within a few percent, which `fanstore plan` checks on the packed dataset), plus
the node's slack: the placement cuts only between blobs, so a node may get up to one blob more than its share
(with more nodes than blobs, a node that gets any gets a whole one), and the header of each chunk it stores part of.
The 5% minimum saving of the default mode does not apply: a saving of 2% may be what makes the dataset fit.

--fit plans against the bound of each prediction, not the prediction: the predicted stored bytes plus BOUND_Z
deviations of their sampling error (bound.py), so that a pack --fit accepts fits (99 times in 100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .bound import BOUND_Z
from .errors import SelectionError
from .measure import MB, Measurement
from .policy import NONE_SPEC, Budget, Choice, Goal, KindScale, meets, meets_pack_speed
from .units import decimal_bytes


@dataclass(frozen=True, slots=True)
class Need:
    """The bytes that must fit: the whole dataset's, or with --nodes one node's (replicated + spread / N); and the
    deviation of each from sampling, which puts their bound BOUND_Z deviations above."""

    total: float  # the whole dataset, dictionaries and `fixed` bytes included
    replicated: float
    spread: float
    nodes: int
    fixed: float = 0.0  # bytes stored whatever the codecs (index, chunk headers), counted in `total` only
    total_error: float = 0.0
    node_error: float = 0.0
    node_slack: float = 0.0  # with nodes > 1: what the placement may give a node beyond spread / N (Selection)

    @property
    def slack(self) -> float:
        """The node's slack, where there is one: a single node stores the spread bytes uncut."""
        return self.node_slack if self.nodes > 1 else 0.0

    @property
    def bytes(self) -> float:
        """What is compared with --fit: the total, or one node's replicated bytes plus its spread share."""
        if self.nodes:
            return self.replicated + math.ceil(self.spread / self.nodes) + self.slack
        return self.total

    @property
    def bound(self) -> float:
        """`bytes` at the one-sided 99% confidence bound of the sample: what --fit plans against."""
        return self.bytes + BOUND_Z * (self.node_error if self.nodes else self.total_error)

    @property
    def total_bound(self) -> float:
        return self.total + BOUND_Z * self.total_error

    def describe(self) -> str:
        at_most = f", at most {decimal_bytes(self.bound)}" if self.bound - self.bytes >= 0.5 else ""
        if not self.nodes:
            return decimal_bytes(self.bytes) + at_most
        slack = f" + {decimal_bytes(self.slack)} slack" if self.slack >= 0.5 else ""
        return (f"{decimal_bytes(self.bytes)} per node ({decimal_bytes(self.replicated)} replicated + "
                f"{decimal_bytes(self.spread)} spread / {self.nodes:,}{slack}){at_most}")


class DoesNotFit(SelectionError):
    """--fit cannot be met even with the strongest settings; the message says by how much."""


@dataclass(slots=True)
class _Front:
    """One kind's settings that meet the floors, fastest decoder first, each storing less than every faster one;
    `at` is the one currently chosen."""

    kind: str
    scale: KindScale
    options: list[Measurement | None]  # None: `none` when it was not measured (stored as is, decodes nothing)
    at: int = 0
    moved: list[int] = field(default_factory=list)

    @property
    def current(self) -> Measurement | None:
        return self.options[self.at]


def need_of(chosen: dict[str, Measurement | None], scales: dict[str, KindScale], goal: Goal,
            fixed_bytes: float = 0.0, node_slack: float = 0.0) -> Need:
    """The bytes these settings store: the whole dataset's and, for --nodes, its replicated and spread parts (and
    the node's slack, what the placement may add to its share); and their deviations from sampling (kinds as
    independent: their samples are)."""
    total = replicated = spread = total_variance = node_variance = 0.0
    for kind, m in chosen.items():
        scale = scales[kind]
        total += scale.stored(m)
        replicated += scale.stored_replicated(m)
        spread += scale.stored_spread(m)
        error = scale.stored_error(m)
        total_variance += error**2
        if goal.nodes and scale.raw_bytes:
            replicated_share = scale.replicated_bytes / scale.raw_bytes
            node_variance += (error * (replicated_share + (1 - replicated_share) / goal.nodes)) ** 2
    return Need(total + fixed_bytes, replicated, spread, goal.nodes, fixed_bytes, math.sqrt(total_variance),
                math.sqrt(node_variance), node_slack if goal.nodes else 0.0)


def choose_to_fit(
    measurements: Sequence[Measurement],
    scales: dict[str, KindScale],
    budget: Budget,
    goal: Goal,
    fixed_bytes: float = 0.0,
    node_slack: float = 0.0,
) -> dict[str, Choice]:
    """The --fit mode (see the module docstring) over every kind in `scales`: per kind, the setting that decodes
    fastest while the whole dataset (or one node's share) still fits in goal.fit_bytes, its prediction taken at its
    bound. `fixed_bytes` (the index, chunk headers) count against a total --fit, `node_slack` against a per-node
    one. Raises DoesNotFit, one line saying
    by how much, when it cannot."""
    if not goal.fit_bytes:
        raise SelectionError("--fit: choose_to_fit needs a capacity to fit")
    fronts = [_front(kind, [m for m in measurements if m.kind == kind], scales[kind], budget, goal)
              for kind in sorted(scales)]

    def need() -> Need:
        return need_of({front.kind: front.current for front in fronts}, scales, goal, fixed_bytes, node_slack)

    strongest = need_of({front.kind: front.options[-1] for front in fronts}, scales, goal, fixed_bytes,
                        node_slack)
    if strongest.bound > goal.fit_bytes:
        raise DoesNotFit(_shortfall(strongest, budget, goal))
    moves = 0
    while need().bound > goal.fit_bytes:
        front = max((f for f in fronts if f.at + 1 < len(f.options)), key=lambda f: _gain(f, goal))
        front.at += 1
        front.moved.append(moves)
        moves += 1
    # The last move may have saved more than was missing: step back any kind whose faster setting still fits,
    # the most recently moved first.
    stepped_back = True
    while stepped_back:
        stepped_back = False
        for front in sorted((f for f in fronts if f.at), key=lambda f: -f.moved[-1]):
            front.at -= 1
            if need().bound <= goal.fit_bytes:
                front.moved.pop()
                stepped_back = True
                break
            front.at += 1
    final = need()
    return {front.kind: _fit_choice(front, final, budget, goal) for front in fronts}


def _front(kind: str, measurements: list[Measurement], scale: KindScale, budget: Budget, goal: Goal) -> _Front:
    none_measurement = next((m for m in measurements if m.spec == NONE_SPEC), None)
    allowed = [m for m in measurements
               if m.spec != NONE_SPEC and meets(m, budget) and meets_pack_speed(m, scale, goal)]
    order = {m.spec: number for number, m in enumerate(measurements)}
    allowed.sort(key=lambda m: (scale.decode_seconds(m), scale.stored(m), scale.pack_seconds(m, goal.workers),
                                order[m.spec]))
    options: list[Measurement | None] = [none_measurement]
    for m in allowed:
        if scale.stored(m) < scale.stored(options[-1]):
            options.append(m)
    return _Front(kind, scale, options)


def _gain(front: _Front, goal: Goal) -> tuple[float, float, str]:
    """Bytes the next stronger setting saves (per node with --nodes) per second of decode time it adds; ties go to
    the larger saving, then to the kind first in name order."""
    current, stronger = front.current, front.options[front.at + 1]
    scale = front.scale
    if goal.nodes:
        saved = (scale.stored_replicated(current) - scale.stored_replicated(stronger)
                 + (scale.stored_spread(current) - scale.stored_spread(stronger)) / goal.nodes)
    else:
        saved = scale.stored(current) - scale.stored(stronger)
    slower = scale.decode_seconds(stronger) - scale.decode_seconds(current)
    rate = saved / slower if slower > 0 else math.inf
    return rate, saved, _reverse(front.kind)


def _reverse(text: str) -> str:
    """A key that sorts names in reverse, so that max() prefers the first name on a tie."""
    return "".join(chr(0x10FFFF - ord(c)) for c in text)


def _fit_choice(front: _Front, final: Need, budget: Budget, goal: Goal) -> Choice:
    m = front.current
    spec = m.spec if m is not None else NONE_SPEC
    meets_budget = m is None or m.spec != NONE_SPEC or meets(m, budget)
    fits = f"{final.describe()} of --fit {decimal_bytes(goal.fit_bytes)}"
    if front.at == 0:
        what = "decodes fastest" if spec == NONE_SPEC else "decodes fastest of the settings that meet the floors"
        reason = f"{what}, and the dataset fits ({fits})"
    else:
        faster = front.options[front.at - 1]
        faster_spec = faster.spec if faster is not None else NONE_SPEC
        saved = front.scale.stored(faster) - front.scale.stored(m)
        reason = (f"saves {m.saving:.1%} (ratio {m.ratio:.2f}), decodes at {m.decode_mbps:,.0f} MB/s: needed to fit "
                  f"({fits}); the faster {faster_spec} would store {decimal_bytes(saved)} more")
    return Choice(front.kind, spec, m, meets_budget, reason)


def _shortfall(strongest: Need, budget: Budget, goal: Goal) -> str:
    where = f" --nodes {goal.nodes:,}" if goal.nodes else ""
    over = strongest.bound - goal.fit_bytes
    floors = [text for text, given in ((f"--budget {budget.bytes_per_s / MB:,.0f} MB/s", budget.bytes_per_s),
                                       (f"--pack-speed {goal.pack_mbps:,.0f} MB/s", goal.pack_mbps)) if given]
    settings = "the strongest settings" + (f" that meet {' and '.join(floors)}" if floors else "")
    return (f"--fit {decimal_bytes(goal.fit_bytes)}{where}: {settings} store {strongest.describe()}, "
            f"{decimal_bytes(over)} ({over / goal.fit_bytes:.0%}) over")
