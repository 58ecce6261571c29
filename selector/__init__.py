"""Codec selection: measure every candidate codec on a sample of SRC and choose, per file kind, the one that saves
the most space while decoding fast enough for the training job.

    sample.py    a reproducible sample, stratified by group and file kind
    measure.py   ratio, encode speed and decode throughput of each candidate, measured as the packer and reader work
    policy.py    budget (sync, or K prefetch threads), tolerance, --pack-speed -> choice per kind
    fit.py       --fit (and --nodes) -> the fastest-decoding choice per kind that still fits
    estimate.py  what the pack will store and how long it will take, from the sample and the walk
    report.py    the table `fanstore select` prints, and the decode and pack-time trade-off plots

`select_codecs` runs the steps; its `Selection` is what `fanstore-pack --codec auto` packs with and records in the
dataset's metadata. The selector knows nothing of fanstore: its caller walks SRC, says which group each file is in
and which groups are replicated, and reports a SelectionError as its own.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import SelectionError
from .estimate import (
    CpuClock,
    PackEstimate,
    estimate_pack,
    files_by_group,
    kind_scales,
    training_heads,
    usable_workers,
)
from .measure import DECODE_NOISE, Measurement, candidate_specs, measure_kind
from .fit import DoesNotFit, Need, choose_to_fit, need_of
from .policy import MIN_SAVING, Budget, Choice, Goal, KindScale, choose
from .sample import (
    DEFAULT_FRACTION,
    DEFAULT_MAX_BYTES,
    PieceSource,
    SampleFile,
    check_fraction,
    check_max_bytes,
    check_seed,
    SourceFile,
    draw_sample,
    estimated_kind_bytes,
)

__all__ = ["Budget", "Choice", "DoesNotFit", "Goal", "Measurement", "PackEstimate", "Selection", "SelectionError",
           "SourceFile", "select_codecs"]

SELECTION_VERSION = 1
# A selection's record in the index besides its measurements: per kind its choice and reason, and once its budget,
# goal, sample, tree and predictions. 0.5-1.5 KB a kind on the suite's and the benches' packs; this leaves room.
RECORD_BYTES_PER_KIND = 2048


@dataclass(slots=True)
class Selection:
    """The choice per kind, with everything it rests on: the budget, the sample, and every measurement."""

    budget: Budget
    fraction: float
    seed: int
    sample_files: int
    sample_bytes: int
    choices: dict[str, Choice]  # per kind present in the sample
    measurements: list[Measurement]
    seconds: float
    max_bytes: int = DEFAULT_MAX_BYTES
    min_saving: float = MIN_SAVING
    replicate: tuple[str, ...] = field(default_factory=tuple)
    # Per kind, its estimated bytes in SRC: the sample's own kind shares are not estimates (small kinds get a floor)
    kind_bytes: dict[str, int] = field(default_factory=dict)
    goal: Goal = field(default_factory=Goal)
    # Per kind, what scales its sample to SRC beyond kind_bytes: replicated bytes, groups, dictionary training bytes
    scales: dict[str, KindScale] = field(default_factory=dict)
    tree_files: int = 0  # SRC's non-empty files and their bytes, as walked (the estimate's I/O terms)
    tree_bytes: int = 0
    head_reads: tuple[int, int] = (0, 0)  # files and bytes of the heads the packer reads to train dictionaries on
    fixed_bytes: int = 0  # stored whatever the codecs (the index), counted against a total --fit
    others_cores: float = 0.0  # cores other processes used while the selector measured (the estimate leaves them)
    cores: int = 0  # cores the selector could use (0: unknown, this machine's): a record estimates the same anywhere
    # With --nodes: what the placement may give one node beyond its share of the spread bytes (the largest spread
    # blob, which it never cuts, and chunk headers); the caller knows the blob layout (0: none, as records before it)
    node_slack: int = 0
    failed: tuple[str, ...] = ()  # settings left out because their codec failed on the sample, and why (not recorded)

    def codec_by_kind(self) -> dict[str, str]:
        return {kind: self.choices[kind].spec for kind in sorted(self.choices)}

    def chosen(self) -> dict[str, Measurement | None]:
        return {kind: choice.measurement for kind, choice in sorted(self.choices.items())}

    def scales_by_kind(self) -> dict[str, KindScale]:
        """Per chosen kind, its scale (a record without scales: its estimated bytes alone)."""
        return {kind: self.scales.get(kind) or KindScale(self.kind_bytes.get(kind, 0)) for kind in self.choices}

    def predicted_ratio(self) -> float | None:
        """Raw / stored of the whole of SRC with these choices: each kind's predicted ratio, weighted by its
        estimated bytes (None when no kind was estimated)."""
        raw = stored = 0.0
        for kind, choice in self.choices.items():
            kind_raw = self.kind_bytes.get(kind, 0)
            raw += kind_raw
            stored += kind_raw / choice.measurement.ratio if choice.measurement is not None else kind_raw
        return raw / stored if stored else None

    def predicted_blob_bytes(self) -> float:
        """The stored bytes of SRC's files (what a pack reports as stored: no dictionaries, no index)."""
        scales = self.scales_by_kind()
        return sum(scales[kind].raw_bytes / (choice.measurement.ratio if choice.measurement is not None else 1.0)
                   for kind, choice in self.choices.items())

    def need(self, chosen: dict[str, Measurement | None] | None = None) -> Need:
        """Predicted stored bytes: the whole dataset's (blobs, dictionaries, the index) and, with --nodes, the
        replicated and spread parts one node stores."""
        return need_of(chosen or self.chosen(), self.scales_by_kind(), self.goal, self.fixed_bytes, self.node_slack)

    def estimate(self, chosen: dict[str, Measurement | None] | None = None) -> PackEstimate:
        """Predicted seconds of the pack with these choices (the selection itself not counted)."""
        return estimate_pack(chosen or self.chosen(), self.scales_by_kind(), self.tree_files, self.tree_bytes,
                             self.goal.workers, self.others_cores, self.cores, self.head_reads)

    def to_json(self) -> dict[str, Any]:
        """JSON-able and in a fixed key order (kinds sorted, measurements in measuring order). The predictions are
        made from the measurements as recorded (rounded), so a record read back predicts exactly the same."""
        recorded = {kind: Measurement.from_json(m.to_json()) if m is not None else None
                    for kind, m in self.chosen().items()}
        need, estimate = self.need(recorded), self.estimate(recorded)
        return {
            "version": SELECTION_VERSION,
            "budget": {"bytes_per_s": self.budget.bytes_per_s, "prefetch_threads": self.budget.prefetch_threads,
                       "required_decode_mbps": round(self.budget.required_decode_mbps, 3),
                       "decode_noise": DECODE_NOISE},
            "goal": {"fit_bytes": self.goal.fit_bytes, "nodes": self.goal.nodes, "tolerance": self.goal.tolerance,
                     "pack_mbps": self.goal.pack_mbps, "workers": self.goal.workers},
            "sample": {"fraction": self.fraction, "seed": self.seed, "max_bytes": self.max_bytes,
                       "files": self.sample_files, "bytes": self.sample_bytes, "replicate": list(self.replicate),
                       "kind_bytes": dict(sorted(self.kind_bytes.items()))},
            "tree": {"files": self.tree_files, "bytes": self.tree_bytes, "fixed_bytes": self.fixed_bytes,
                     "node_slack": self.node_slack,
                     "others_cores": self.others_cores, "cores": self.cores,
                     "head_reads": {"files": self.head_reads[0], "bytes": self.head_reads[1]},
                     "kinds": {kind: {"replicated_bytes": scale.replicated_bytes, "groups": scale.groups,
                                      "train_bytes": scale.train_bytes}
                               for kind, scale in sorted(self.scales.items())}},
            "min_saving": self.min_saving,
            "seconds": round(self.seconds, 3),
            "choices": {kind: {"spec": choice.spec, "meets_budget": choice.meets_budget, "reason": choice.reason}
                        for kind, choice in sorted(self.choices.items())},
            "predicted": {"stored_bytes": round(need.total), "need_bytes": round(need.bytes),
                          "stored_bound_bytes": round(need.total_bound), "need_bound_bytes": round(need.bound),
                          "pack_seconds": round(estimate.seconds, 3),
                          "walk_seconds": round(estimate.walk_seconds, 3),
                          "train_seconds": round(estimate.train_seconds, 3),
                          "read_seconds": round(estimate.read_seconds, 3),
                          "compress_seconds": round(estimate.compress_seconds, 3),
                          "write_seconds": round(estimate.write_seconds, 3)},
            "measurements": [m.to_json() for m in self.measurements],
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Selection:
        """The Selection `to_json` recorded (a resumed pack reuses it rather than measure again). A record written
        before goals were kept reads as what it was: no --fit, no tolerance."""
        if record.get("version") != SELECTION_VERSION:
            raise SelectionError(f"selection record has version {record.get('version')!r}, expected "
                                 f"{SELECTION_VERSION}")
        measurements = [Measurement.from_json(m) for m in record["measurements"]]
        by_key = {(m.kind, m.spec): m for m in measurements}
        choices = {
            kind: Choice(kind, c["spec"], by_key.get((kind, c["spec"])), c["meets_budget"], c["reason"])
            for kind, c in record["choices"].items()
        }
        sample = record["sample"]
        budget = record["budget"]
        goal = record.get("goal", {"tolerance": 0.0})
        tree = record.get("tree", {})
        kind_bytes = dict(sample.get("kind_bytes", {}))  # absent from records written before it was kept
        scales = {kind: KindScale(kind_bytes.get(kind, 0), scale["replicated_bytes"], scale["groups"],
                                  scale["train_bytes"])
                  for kind, scale in tree.get("kinds", {}).items()}
        return cls(
            budget=Budget(budget["bytes_per_s"], budget["prefetch_threads"]),
            fraction=sample["fraction"],
            seed=sample["seed"],
            sample_files=sample["files"],
            sample_bytes=sample["bytes"],
            choices=choices,
            measurements=measurements,
            seconds=record["seconds"],
            max_bytes=sample["max_bytes"],
            min_saving=record["min_saving"],
            replicate=tuple(sample["replicate"]),
            kind_bytes=kind_bytes,
            goal=Goal(**goal),
            scales=scales,
            tree_files=tree.get("files", 0),
            tree_bytes=tree.get("bytes", 0),
            fixed_bytes=tree.get("fixed_bytes", 0),
            node_slack=tree.get("node_slack", 0),
            others_cores=tree.get("others_cores", 0.0),
            cores=tree.get("cores", 0),
            head_reads=(tree.get("head_reads", {}).get("files", 0), tree.get("head_reads", {}).get("bytes", 0)),
        )


def _one_group(path: str) -> int:
    return 0


def record_bytes(measurements: Sequence[Measurement], kinds: int) -> int:
    """The most the record of a selection takes in the index's table of contents (Selection.to_json): its
    measurements, exactly as written there, and RECORD_BYTES_PER_KIND for each kind's choice, reason and figures
    and for the rest (budget, goal, sample, tree, predictions)."""
    written = json.dumps([m.to_json() for m in measurements], sort_keys=True, separators=(",", ":"))
    return len(written.encode()) + RECORD_BYTES_PER_KIND * (kinds + 1)


def select_codecs(
    src: Path | PieceSource,
    budget: Budget,
    files: Sequence[SourceFile],
    group_of: Callable[[str], int] = _one_group,
    fraction: float = DEFAULT_FRACTION,
    seed: int = 0,
    replicate: tuple[str, ...] = (),
    max_bytes: int = DEFAULT_MAX_BYTES,
    goal: Goal = Goal(),
    replicated_groups: frozenset[int] = frozenset(),
    fixed_bytes: int = 0,
    node_slack: int = 0,
) -> Selection:
    """Sample `files` (SRC's regular files, as the caller walked them), measure every candidate per kind, and
    choose per kind for `budget` and `goal` (policy.py says how). `group_of` gives a file's group, so the sample is
    stratified by group too; `replicated_groups` are the groups every node stores (for --nodes); `replicate`, the
    patterns behind them, is recorded; `fixed_bytes` (the index) count against a total --fit, and `node_slack` (what
    the placement may give a node beyond its share: the largest spread blob, chunk headers) against a per-node one.
    Bad arguments raise
    SelectionError naming the option; a --fit that cannot be met raises DoesNotFit."""
    started, clock = time.perf_counter(), CpuClock.now()
    fraction, seed, max_bytes = _checked_arguments(budget, goal, fraction, seed, max_bytes)
    sample = draw_sample(Path(src) if isinstance(src, (str, os.PathLike)) else src, files, group_of,
                         fraction=fraction, max_bytes=max_bytes, seed=seed)
    kind_bytes = estimated_kind_bytes(sample)
    by_group = files_by_group(files, group_of)
    heads = training_heads(by_group)
    scales = kind_scales(sample, kind_bytes, frozenset(replicated_groups), heads)
    measurements, failed, choices = _measured_and_chosen(sample, budget, goal, scales)
    kinds = sorted({m.kind for m in measurements})
    fixed_bytes += record_bytes(measurements, len(kinds))  # the record of this selection, in the index
    if goal.fit_bytes:
        choices = choose_to_fit(measurements, {kind: scales[kind] for kind in kinds}, budget, goal, fixed_bytes,
                                node_slack)
    return Selection(
        budget=budget,
        fraction=fraction,
        seed=seed,
        sample_files=len({f.path for f in sample}),
        sample_bytes=sum(len(f.data) for f in sample),
        choices=choices,
        measurements=measurements,
        seconds=time.perf_counter() - started,
        max_bytes=max_bytes,
        replicate=tuple(replicate),
        kind_bytes=kind_bytes,
        goal=goal,
        scales=scales,
        tree_files=sum(map(len, by_group.values())),
        tree_bytes=sum(f.size for members in by_group.values() for f in members),
        head_reads=(sum(map(len, heads.values())), sum(head for group in heads.values() for _, head in group)),
        fixed_bytes=fixed_bytes,
        node_slack=node_slack,
        others_cores=CpuClock.now().others_since(clock),
        cores=usable_workers(0),
        failed=tuple(failed),
    )


def _checked_arguments(budget: Budget, goal: Goal, fraction: float, seed: int, max_bytes: int
                       ) -> tuple[float, int, int]:
    """select_codecs's arguments checked, each SelectionError naming its option; the sample's as they are used."""
    if not isinstance(budget, Budget):
        raise SelectionError(f"--budget: expected a selector.Budget, got {budget!r}")
    if not isinstance(goal, Goal):
        raise SelectionError(f"--fit: expected a selector.Goal, got {goal!r}")
    return check_fraction(fraction), check_seed(seed), check_max_bytes(max_bytes)


def _measured_and_chosen(sample: list[SampleFile], budget: Budget, goal: Goal, scales: dict[str, KindScale]
                         ) -> tuple[list[Measurement], list[str], dict[str, Choice]]:
    """Every candidate measured on each kind's sample files, the specs that failed, and (without --fit, which
    chooses over all kinds at once) each kind's choice."""
    measurements: list[Measurement] = []
    failed: list[str] = []
    choices: dict[str, Choice] = {}
    for kind in sorted({sample_file.kind for sample_file in sample}):
        kind_measurements = measure_kind(kind, [f for f in sample if f.kind == kind], candidate_specs(kind),
                                         on_failed=failed.append)
        measurements.extend(kind_measurements)
        if not goal.fit_bytes:
            choices[kind] = choose(kind, kind_measurements, budget, goal=goal, scale=scales.get(kind))
    return measurements, failed, choices
