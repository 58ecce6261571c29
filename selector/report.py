"""What `fanstore select` shows: a table of candidates per kind with the choice marked, the predicted stored size
and pack time of SRC, and the trade-off plots.

Per kind, two plots side by side: ratio against decode throughput, with the budget line and the Pareto front (the
settings no other setting beats on both), so the cost in capacity of a faster budget can be read off directly; and
the kind's stored size in SRC against its estimated pack time, so the cost in waiting of the last percent of
capacity can be too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bound import BOUND_Z
from .errors import SelectionError
from .measure import DECODE_NOISE, MB, Measurement
from .policy import NONE_SPEC, KindScale, meets, meets_pack_speed, near_budget, stores_as_is
from .sample import FILE_CAP, MAX_SAMPLE_FILES, MIN_FILES, MIN_SAMPLE_BYTES, MIN_STRATUM_BYTES, PIECE_BYTES
from .units import decimal_bytes, format_seconds, plural, size_option

if TYPE_CHECKING:
    from . import Selection

_COLUMNS = ("", "spec", "ratio", "saving", "decode MB/s", "encode MB/s", "stored", "at most", "pack s",
            "meets budget", "sample")
NOTHING = "-"  # a cell whose figure would mean nothing: a copy's speed, a budget that was not given


def format_selection(selection: Selection) -> str:
    """A header (budget, K, sample, time), then per kind a table of every measured setting and the choice."""
    kind_bytes = {kind: max(m.raw_bytes for m in selection.measurements if m.kind == kind)
                  for kind in {m.kind for m in selection.measurements}}
    lines = _header_lines(selection, any(m.raw_bytes < kind_bytes[m.kind] for m in selection.measurements))
    for kind in sorted(selection.choices):
        lines.append("")
        lines.extend(_kind_lines(selection, kind, kind_bytes))
    if not selection.choices:
        lines.append("")
        lines.append("the sample is empty: SRC has no non-empty files to measure")
    lines.extend(_prediction_lines(selection))
    return "\n".join(lines)


def _header_lines(selection: Selection, partial: bool) -> list[str]:
    """The budget, K, how the sample was drawn, the goal, and what the tables' marks and columns mean (`partial`:
    some setting was measured on part of its kind's sample)."""
    budget = selection.budget
    return [
        f"codec selection: {_budget_line(selection)}",
        f"prefetch threads K={budget.prefetch_threads}; sample: {plural(selection.sample_files, 'file')} drawn by "
        f"bytes (a file's chance grows with its size; one over {decimal_bytes(FILE_CAP)} is read in "
        f"{decimal_bytes(PIECE_BYTES)} pieces), "
        f"{decimal_bytes(selection.sample_bytes)} (--sample {selection.fraction:.1%} of SRC, but at least "
        f"{decimal_bytes(MIN_SAMPLE_BYTES)}, and per kind {plural(MIN_FILES, 'file')} and up to "
        f"{decimal_bytes(MIN_STRATUM_BYTES)} if it has them; at most {decimal_bytes(selection.max_bytes)} and "
        f"about {MAX_SAMPLE_FILES:,} files)"
        f", seed {selection.seed}; measured in {selection.seconds:.1f} s",
        selection.goal.describe(),
        ("a codec must save at least " f"{selection.min_saving:.0%} to be chosen; " if not selection.goal.fit_bytes
         else "") + "'*' marks the choice; stored: predicted for the kind in SRC, dictionaries included; at most: "
        "its one-sided 99% confidence bound from the sample; pack s: its compression on the workers plus its "
        "dictionaries' training; '-': stored as is (decoding is a copy), or no floor to meet"
        + ("; sample: what a slow setting was measured on, where it is part of the kind's sample" if partial else "")
        + (f"; 'noise' = within {DECODE_NOISE:.0%} of the budget, either side: does not count as reaching it"
           if budget.bytes_per_s else "")
        + ("; 'no: pack' = meets the budget, not --pack-speed" if selection.goal.pack_mbps else ""),
    ]


def _kind_lines(selection: Selection, kind: str, kind_bytes: dict[str, int]) -> list[str]:
    """One kind: its files and bytes, the table of its measured settings, and its choice with the reason."""
    choice = selection.choices[kind]
    rows = [m for m in selection.measurements if m.kind == kind]
    kind_files = max((m.files for m in rows), default=0)
    in_src = selection.kind_bytes.get(kind)
    lines = [f"{kind}: {plural(kind_files, 'file')}, {decimal_bytes(kind_bytes.get(kind, 0))} sampled"
             + (f" of about {decimal_bytes(in_src)} in SRC" if in_src else "")]
    scale = selection.scales_by_kind()[kind]
    table = [_COLUMNS]
    # Settings that store the kind as it is decode at a copy's speed, which only noise orders: by name then.
    for m in sorted(rows, key=lambda m: (-m.ratio, 0 if stores_as_is(m) else -m.decode_mbps, m.spec)):
        table.append(_setting_row(selection, m, scale, kind_bytes[kind]))
    shown = [column for column in range(len(_COLUMNS))  # the sample column only where a setting has one
             if _COLUMNS[column] != "sample" or any(row[column] for row in table[1:])]
    widths = {column: max(len(row[column]) for row in table) for column in shown}
    for row in table:
        cells = [row[column].ljust(widths[column]) if column < 2 else row[column].rjust(widths[column])
                 for column in shown]
        lines.append("  " + "  ".join(cells).rstrip())
    lines.append(f"  choice for {kind}: {choice.spec} - {choice.reason}")
    return lines


def _setting_row(selection: Selection, m: Measurement, scale: KindScale, sampled_bytes: int) -> tuple[str, ...]:
    """One setting's row of its kind's table, in _COLUMNS' order (`sampled_bytes`: the kind's whole sample)."""
    workers = selection.goal.workers
    floors = bool(selection.budget.bytes_per_s or selection.goal.pack_mbps)
    copies = stores_as_is(m) and meets(m, selection.budget)
    packs_fast = meets_pack_speed(m, scale, selection.goal) or m.spec == NONE_SPEC
    return (
        "*" if m.spec == selection.choices[m.kind].spec else "",
        m.spec + (f" (dict {decimal_bytes(m.dict_bytes)})" if m.dict_bytes else ""),
        f"{m.ratio:.2f}",
        f"{m.saving:.1%}",
        NOTHING if copies else f"{m.decode_mbps:,.0f}",
        NOTHING if m.spec == NONE_SPEC else f"{m.encode_mbps:,.0f}",
        decimal_bytes(scale.stored(m)),
        decimal_bytes(scale.stored(m) + BOUND_Z * scale.stored_error(m)),
        NOTHING if m.spec == NONE_SPEC else format_seconds(scale.pack_seconds(m, workers)),
        _meets_column(m, selection, packs_fast) if floors else NOTHING,
        "" if m.raw_bytes >= sampled_bytes else f"{plural(m.files, 'file')}, {decimal_bytes(m.raw_bytes)}",
    )


def _prediction_lines(selection: Selection) -> list[str]:
    """What the choices predict for SRC: ratio, stored bytes and their bound, pack time, and --fit's lines."""
    predicted = selection.predicted_ratio()
    if predicted is None:
        return []
    need, estimate = selection.need(), selection.estimate()
    return [
        "",
        f"predicted for SRC with these choices: ratio {predicted:.2f} (saves {1 - 1 / predicted:.1%}), "
        "each kind's ratio weighted by its estimated bytes; stored "
        f"{decimal_bytes(need.total - need.fixed)}, {decimal_bytes(need.total)} with the index, at most "
        f"{decimal_bytes(need.total_bound)} (the sample's one-sided 99% confidence bound)",
        f"estimated pack time of SRC ({plural(selection.tree_files, 'file')}, "
        f"{decimal_bytes(selection.tree_bytes)}): {estimate.describe()}",
        *_fit_lines(selection),
    ]


def _meets_column(m: Measurement, selection: Selection, packs_fast: bool) -> str:
    """Whether the setting reaches the budget: yes, no, or within the noise of it (which does not count)."""
    if meets(m, selection.budget):
        return "yes" if packs_fast else "no: pack"
    return "noise" if near_budget(m, selection.budget) else "no"


def _budget_line(selection: Selection) -> str:
    """The budget, as the selection used it: under --fit without --budget there is no floor, not 'best ratio'."""
    if selection.goal.fit_bytes and selection.budget.bytes_per_s == 0:
        return "no decode floor (no --budget)"
    return selection.budget.describe()


def _fit_lines(selection: Selection) -> list[str]:
    goal = selection.goal
    if not goal.fit_bytes:
        return []
    need = selection.need()
    lines = [f"fits --fit {decimal_bytes(goal.fit_bytes)}: {need.describe()} ({need.bound / goal.fit_bytes:.0%} at "
             "the bound, which --fit is planned against)"]
    if goal.nodes:
        lines.append(f"  per node: replicated bytes + spread bytes / {goal.nodes:,}, rounded up, + slack (the "
                     "placement never cuts a file or block, so a node may get up to the largest of them more, and a "
                     "chunk header or two); it balances spread bytes to within a few percent: `fanstore plan "
                     f"DEST --nodes {goal.nodes} --local-capacity {size_option(goal.fit_bytes)}` checks the packed "
                     "dataset")
    return lines


def check_plot_path(path: Path) -> None:
    """SelectionError naming --plot, before the measuring (a minute on a large sample), when the plot could not be
    drawn: no matplotlib, or a file name whose extension names no format it writes (savefig takes the format from
    it, and failed only once everything had been measured and printed), or a directory."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SelectionError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    if path.is_dir():
        raise SelectionError(f"--plot {str(path)!r} is a directory; name the image file to write")
    formats = Figure().canvas.get_supported_filetypes()
    extension = path.suffix[1:].lower()
    if not extension:
        raise SelectionError(f"--plot {str(path)!r}: the file name needs an extension naming its format, e.g. "
                             f"{path.name}.png")
    if extension not in formats:
        raise SelectionError(f"--plot {str(path)!r}: .{extension} is not an image format matplotlib writes "
                             f"({', '.join(sorted(formats))}): try tradeoff.png")


def plot_selection(selection: Selection, path: Path) -> None:
    """Per kind, side by side: ratio against decode throughput (log x) with the Pareto front and the required decode
    throughput; and the kind's predicted stored size in SRC against its estimated pack time (log x), with the
    tolerance band or the --pack-speed floor. The choice is starred in both. Needs matplotlib (SelectionError
    naming --plot if it is missing)."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend switch
    except ImportError:
        raise SelectionError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    kinds = sorted(selection.choices)
    if not kinds:
        raise SelectionError("--plot: nothing to plot, the sample is empty")
    figure = Figure(figsize=(11, 4.5 * len(kinds)), layout="constrained")
    axes_grid = figure.subplots(len(kinds), 2, squeeze=False)
    for number, kind in enumerate(kinds):
        _plot_decode(axes_grid[number][0], selection, kind)
        _plot_pack_time(axes_grid[number][1], selection, kind)
    estimate, need = selection.estimate(), selection.need()
    figure.suptitle(f"{_budget_line(selection)}\n{selection.goal.describe()}\npredicted: "
                    f"{decimal_bytes(need.total)} stored, pack about {estimate.seconds:,.1f} s with "
                    f"{plural(estimate.workers, 'worker')}", fontsize=9)
    try:
        figure.savefig(path, dpi=100)
    except (OSError, ValueError) as exc:  # an OSError's own text repeats the path: its strerror says why
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise SelectionError(f"--plot: cannot write {str(path)!r}: {reason}") from None


def _plot_decode(axes: Any, selection: Selection, kind: str) -> None:
    measurements = [m for m in selection.measurements if m.kind == kind]
    choice = selection.choices[kind]
    required = selection.budget.required_decode_mbps
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
    axes.set_title(f"{kind}: ratio vs decode speed")
    axes.legend(fontsize=7, loc="best")


def _plot_pack_time(axes: Any, selection: Selection, kind: str) -> None:
    """Capacity against waiting: the kind's stored MB in SRC against its pack seconds (compression on the workers,
    dictionaries' training included); walking, reading and writing, about the same for every setting, are left out."""
    measurements = [m for m in selection.measurements if m.kind == kind]
    choice = selection.choices[kind]
    scale = selection.scales_by_kind()[kind]
    workers = selection.goal.workers
    floor = 1e-3  # log scale: `none` packs in about no time

    def point(m: Measurement) -> tuple[float, float]:
        return max(scale.pack_seconds(m, workers), floor), scale.stored(m) / MB

    points = [point(m) for m in measurements]
    axes.scatter([x for x, _ in points], [y for _, y in points], s=18, color="tab:blue", label="settings")
    for m, (x, y) in zip(measurements, points):
        axes.annotate(m.spec, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    codecs = [m for m in measurements if m.spec != NONE_SPEC]
    goal = selection.goal
    if codecs and not goal.fit_bytes:
        smallest = min(scale.stored(m) for m in codecs) / MB
        axes.axhspan(smallest, smallest * (1 + goal.tolerance), color="tab:orange", alpha=0.25,
                     label=f"within --tolerance {goal.tolerance:.1%} of the smallest")
    if goal.pack_mbps and scale.raw_bytes:
        axes.axvline(scale.raw_bytes / MB / goal.pack_mbps, color="tab:red", linestyle="--",
                     label=f"--pack-speed {goal.pack_mbps:,.0f} MB/s")
    if choice.measurement is not None:
        x, y = point(choice.measurement)
        axes.scatter([x], [y], s=160, marker="*", color="tab:green", zorder=3, label=f"choice: {choice.spec}")
    axes.set_xscale("log")
    axes.set_xlabel(f"estimated pack time of the kind, s ({plural(workers, 'worker')}, dictionaries included; log "
                    "scale)")
    axes.set_ylabel(f"stored in SRC, MB (of {scale.raw_bytes / MB:,.1f} MB raw)")
    axes.set_title(f"{kind}: capacity vs pack time")
    axes.legend(fontsize=7, loc="best")


def pareto_front(measurements: list[Measurement]) -> list[Measurement]:
    """The settings no other beats on both ratio and decode throughput, from fastest to strongest."""
    front: list[Measurement] = []
    for m in sorted(measurements, key=lambda m: (-m.decode_mbps, -m.ratio)):
        if not front or m.ratio > front[-1].ratio:
            front.append(m)
    return front
