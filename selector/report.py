"""What `fanstore select` shows: a table of candidates per kind with the choice marked, and a trade-off plot.

The plot puts ratio against decode throughput per kind, with the budget line and the Pareto front (the settings no
other setting beats on both), so the cost in capacity of a faster budget can be read off directly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import SelectionError
from .measure import Measurement
from .policy import meets
from .sample import MIN_FILES, MIN_SAMPLE_BYTES, MIN_STRATUM_BYTES

if TYPE_CHECKING:
    from . import Selection

_COLUMNS = ("", "spec", "ratio", "saving", "decode MB/s", "encode MB/s", "meets budget", "sample")


def _size(count: float) -> str:
    """A byte count at a glance, in the units `fanstore select` prints (KiB below one MiB)."""
    return f"{count / 2**20:,.1f} MiB" if count >= 2**20 else f"{count / 2**10:,.1f} KiB"


def format_selection(selection: Selection) -> str:
    """A header (budget, K, sample, time), then per kind a table of every measured setting and the choice."""
    budget = selection.budget
    lines = [
        f"codec selection: {budget.describe()}",
        f"prefetch threads K={budget.prefetch_threads}; sample: {selection.sample_files} files, "
        f"{_size(selection.sample_bytes)} (--sample {selection.fraction:.1%} of SRC, but at least "
        f"{_size(MIN_SAMPLE_BYTES)}, and per kind {MIN_FILES} files and up to "
        f"{_size(MIN_STRATUM_BYTES)} if it has them; at most {_size(selection.max_bytes)})"
        f", seed {selection.seed}; measured in {selection.seconds:.1f} s",
        f"a codec must save at least {selection.min_saving:.0%} to be chosen; '*' marks the choice",
    ]
    for kind in sorted(selection.choices):
        choice = selection.choices[kind]
        rows = [m for m in selection.measurements if m.kind == kind]
        kind_files = max((m.files for m in rows), default=0)
        kind_bytes = max((m.raw_bytes for m in rows), default=0)
        in_src = selection.kind_bytes.get(kind)
        lines.append("")
        lines.append(f"{kind}: {kind_files} files, {_size(kind_bytes)} sampled"
                     + (f" of about {_size(in_src)} in SRC" if in_src else ""))
        table = [_COLUMNS]
        for m in sorted(rows, key=lambda m: (-m.ratio, -m.decode_mbps, m.spec)):
            partial = "" if m.raw_bytes >= kind_bytes else f"{m.files} files"
            table.append((
                "*" if m.spec == choice.spec else "",
                m.spec + (f" (dict {_size(m.dict_bytes)})" if m.dict_bytes else ""),
                f"{m.ratio:.2f}",
                f"{m.saving:.1%}",
                f"{m.decode_mbps:,.0f}",
                f"{m.encode_mbps:,.0f}",
                "yes" if meets(m, budget) else "no",
                partial,
            ))
        widths = [max(len(row[column]) for row in table) for column in range(len(_COLUMNS))]
        for row in table:
            cells = [cell.ljust(width) if column < 2 else cell.rjust(width)
                     for column, (cell, width) in enumerate(zip(row, widths))]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.append(f"  choice for {kind}: {choice.spec} - {choice.reason}")
    if not selection.choices:
        lines.append("")
        lines.append("the sample is empty: SRC has no non-empty files to measure")
    predicted = selection.predicted_ratio()
    if predicted is not None:
        lines.append("")
        lines.append(f"predicted for SRC with these choices: ratio {predicted:.2f} (saves {1 - 1 / predicted:.1%}), "
                     "each kind's ratio weighted by its estimated bytes")
    return "\n".join(lines)


def plot_selection(selection: Selection, path: Path) -> None:
    """Ratio against decode throughput (log x) per kind: every setting, the Pareto front, the required decode
    throughput and the choice. Needs matplotlib (SelectionError naming --plot if it is missing)."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend switch
    except ImportError:
        raise SelectionError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    kinds = sorted(selection.choices)
    if not kinds:
        raise SelectionError("--plot: nothing to plot, the sample is empty")
    columns = min(len(kinds), 3)
    rows = math.ceil(len(kinds) / columns)
    figure = Figure(figsize=(5.5 * columns, 4.5 * rows), layout="constrained")
    axes_grid = figure.subplots(rows, columns, squeeze=False)
    required = selection.budget.required_decode_mbps
    for number, kind in enumerate(kinds):
        axes = axes_grid[number // columns][number % columns]
        measurements = [m for m in selection.measurements if m.kind == kind]
        choice = selection.choices[kind]
        axes.scatter([m.decode_mbps for m in measurements], [m.ratio for m in measurements], s=18, color="tab:blue",
                     label="settings")
        for m in measurements:
            axes.annotate(m.spec, (m.decode_mbps, m.ratio), fontsize=6, xytext=(3, 2), textcoords="offset points")
        front = pareto_front(measurements)[::-1]  # by rising throughput: the best ratio at least this fast
        axes.plot([m.decode_mbps for m in front], [m.ratio for m in front], color="tab:orange", drawstyle="steps-pre",
                  label="Pareto front")
        if required > 0:
            axes.axvline(required, color="tab:red", linestyle="--", label=f"required {required:,.0f} MB/s")
        if choice.measurement is not None:
            axes.scatter([choice.measurement.decode_mbps], [choice.measurement.ratio], s=160, marker="*",
                         color="tab:green", zorder=3, label=f"choice: {choice.spec}")
        axes.set_xscale("log")
        axes.set_xlabel("decode throughput, MB/s (one thread, log scale)")
        axes.set_ylabel("compression ratio")
        axes.set_title(kind)
        axes.legend(fontsize=7, loc="best")
    for number in range(len(kinds), rows * columns):
        axes_grid[number // columns][number % columns].set_visible(False)
    figure.suptitle(selection.budget.describe())
    try:
        figure.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise SelectionError(f"--plot: cannot write {str(path)!r}: {exc}") from None


def pareto_front(measurements: list[Measurement]) -> list[Measurement]:
    """The settings no other beats on both ratio and decode throughput, from fastest to strongest."""
    front: list[Measurement] = []
    for m in sorted(measurements, key=lambda m: (-m.decode_mbps, -m.ratio)):
        if not front or m.ratio > front[-1].ratio:
            front.append(m)
    return front
