"""Codec selection: measure every candidate codec on a sample of SRC and choose, per file kind, the one that saves
the most space while decoding fast enough for the training job.

    sample.py   a reproducible sample, stratified by group and file kind
    measure.py  ratio, encode speed and decode throughput of each candidate, measured as the packer and reader work
    policy.py   budget (sync, or K prefetch threads) -> choice per kind
    report.py   the table `fanstore select` prints, and the ratio/throughput plot

`select_codecs` runs the three steps; its `Selection` is what `fanstore-pack --codec auto` packs with and records
in the dataset's metadata. The selector knows nothing of fanstore: its caller walks SRC and says which group each
file is in, and reports a SelectionError as its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import SelectionError
from .measure import Measurement, candidate_specs, measure_kind
from .policy import MIN_SAVING, Budget, Choice, choose
from .sample import (
    DEFAULT_FRACTION,
    DEFAULT_MAX_BYTES,
    check_fraction,
    check_max_bytes,
    check_seed,
    SourceFile,
    draw_sample,
    estimated_kind_bytes,
)

__all__ = ["Budget", "Choice", "Measurement", "Selection", "SelectionError", "SourceFile", "select_codecs"]

SELECTION_VERSION = 1


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

    def codec_by_kind(self) -> dict[str, str]:
        return {kind: self.choices[kind].spec for kind in sorted(self.choices)}

    def predicted_ratio(self) -> float | None:
        """Raw / stored of the whole of SRC with these choices: each kind's predicted ratio, weighted by its
        estimated bytes (None when no kind was estimated)."""
        raw = stored = 0.0
        for kind, choice in self.choices.items():
            kind_raw = self.kind_bytes.get(kind, 0)
            raw += kind_raw
            stored += kind_raw / choice.measurement.ratio if choice.measurement is not None else kind_raw
        return raw / stored if stored else None

    def to_json(self) -> dict[str, Any]:
        """JSON-able and in a fixed key order (kinds sorted, measurements in measuring order)."""
        return {
            "version": SELECTION_VERSION,
            "budget": {"bytes_per_s": self.budget.bytes_per_s, "prefetch_threads": self.budget.prefetch_threads,
                       "required_decode_mbps": round(self.budget.required_decode_mbps, 3)},
            "sample": {"fraction": self.fraction, "seed": self.seed, "max_bytes": self.max_bytes,
                       "files": self.sample_files, "bytes": self.sample_bytes, "replicate": list(self.replicate),
                       "kind_bytes": dict(sorted(self.kind_bytes.items()))},
            "min_saving": self.min_saving,
            "seconds": round(self.seconds, 3),
            "choices": {kind: {"spec": choice.spec, "meets_budget": choice.meets_budget, "reason": choice.reason}
                        for kind, choice in sorted(self.choices.items())},
            "measurements": [m.to_json() for m in self.measurements],
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Selection:
        """The Selection `to_json` recorded (a resumed pack reuses it rather than measure again)."""
        if record.get("version") != SELECTION_VERSION:
            raise SelectionError(f"selection record has version {record.get('version')!r}, expected {SELECTION_VERSION}")
        measurements = [Measurement.from_json(m) for m in record["measurements"]]
        by_key = {(m.kind, m.spec): m for m in measurements}
        choices = {
            kind: Choice(kind, c["spec"], by_key.get((kind, c["spec"])), c["meets_budget"], c["reason"])
            for kind, c in record["choices"].items()
        }
        sample = record["sample"]
        budget = record["budget"]
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
            kind_bytes=dict(sample.get("kind_bytes", {})),  # absent from records written before it was kept
        )


def _one_group(path: str) -> int:
    return 0


def select_codecs(
    src: Path,
    budget: Budget,
    files: Sequence[SourceFile],
    group_of: Callable[[str], int] = _one_group,
    fraction: float = DEFAULT_FRACTION,
    seed: int = 0,
    replicate: tuple[str, ...] = (),
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Selection:
    """Sample `files` (SRC's regular files, as the caller walked them), measure every candidate per kind, and
    choose per kind for `budget`. `group_of` gives a file's group, so the sample is stratified by group too;
    `replicate`, the patterns behind it, is recorded. Bad arguments raise SelectionError naming the option."""
    started = time.perf_counter()
    if not isinstance(budget, Budget):
        raise SelectionError(f"--budget: expected a selector.Budget, got {budget!r}")
    fraction = check_fraction(fraction)
    seed = check_seed(seed)
    max_bytes = check_max_bytes(max_bytes)
    sample = draw_sample(Path(src), files, group_of, fraction=fraction, max_bytes=max_bytes, seed=seed)
    measurements: list[Measurement] = []
    choices: dict[str, Choice] = {}
    for kind in sorted({sample_file.kind for sample_file in sample}):
        kind_measurements = measure_kind(kind, [f for f in sample if f.kind == kind], candidate_specs(kind))
        measurements.extend(kind_measurements)
        choices[kind] = choose(kind, kind_measurements, budget)
    return Selection(
        budget=budget,
        fraction=fraction,
        seed=seed,
        sample_files=len(sample),
        sample_bytes=sum(len(f.data) for f in sample),
        choices=choices,
        measurements=measurements,
        seconds=time.perf_counter() - started,
        max_bytes=max_bytes,
        replicate=tuple(replicate),
        kind_bytes=estimated_kind_bytes(sample),
    )
