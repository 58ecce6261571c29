"""bench_select: does what the codec selector predicts from its sample hold for the packed dataset, what does each
decode budget buy, and is selection quick?

One run measures, and prints as tables:

  * predicted beside measured, per file kind (images, float32 arrays, text): `fanstore pack SRC DEST --codec auto
    --budget B` (the real CLI; B is this bench's --budget, default 800MB/s) packs the generated ImageNet-like tree
    of bench/synthetic_tree.py, and its index records what the selector predicted from its sample: the chosen
    codec's ratio and decode throughput. Measured on the packed dataset: the ratio of every file of the kind (raw /
    stored, from the index), and the throughput of decoding every file of the kind as the read path decodes it (file
    by file, one thread, median of repeats, pinned to one CPU with taskset). Baselines from the same run: the whole
    read path (chunk read, checksum, decode) and reading the same files from the plain directory.
  * the trade-off: per kind and for the whole dataset, the saving and capacity that each budget (4000 ... 0 MB/s)
    and each number of prefetch threads K (0 ... 8) buys. `selector.policy.choose` is applied to the one set of
    measurements the pack recorded; nothing is measured again per budget.
  * selection time at 10 GiB: `fanstore select SRC --budget B --prefetch-threads K` (the real CLI, default sample,
    the same --budget and --prefetch-threads as the pack) on a tree of hard links to the generated tree's files
    under distinct directory names: a million paths whose sizes sum to over 10 GiB, so the walk and the sample cost
    what they would on 10 GiB of data, without the disk.

  * whole-pack predictions (issue 14): the pack time and stored size the selection predicts, beside a real
    `--codec auto` pack (fanstore.pack.packer.pack, the function the CLI runs, in a child pinned like the CLI pack), on
    the generated tree and on a real one: a copy of this environment's installed packages (its site-packages,
    whole top-level entries in name order up to about 150 MB; 30 MB with --quick): Python source and bytecode,
    shared libraries, fonts and data. Pack time is the pack's own, after the selection (which the user has
    already waited for when the estimate is printed); stored size is the files' stored bytes and the whole of DEST.
  * the held-out tree (issue 33, bench/held_out_tree.py): a small training tree whose kind `other` is mostly one
    3 MiB file of random bytes among 320 small compressible ones, which a sample drawn by files missed. A `--codec
    auto --budget B` selection gives the bound of its prediction; a real pack (fanstore.pack.packer.pack, pinned like the
    CLI pack) with the same budget and `--fit` 2% above that bound then stores what it stores: its stored bytes
    beside the prediction and its bound, and whether DEST fits. Only bytes are compared, so this section does not
    wait for a quiet machine.

A final section checks the project's targets. Timings are warm-cache (the page cache is not dropped; the source
tree is read once first); each waits for a quiet machine and reports what other processes used meanwhile.

Usage: python bench/bench_select.py [--cache DIR] [--quick] [--budget 800MB/s] [--prefetch-threads K]
                                    [--whole-pack-only | --held-out-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from held_out_tree import write_held_out_tree  # noqa: E402
from machine_load import machine_lines  # noqa: E402
from bench_pack import (  # noqa: E402  (bench_pack puts this checkout first on sys.path)
    NOISY_OTHERS,
    REPO,
    BenchError,
    Placement,
    Tools,
    ensure_generated,
    mib,
    run_timed,
    tree_totals,
)

from fanstore.core.api import Dataset  # noqa: E402
from fanstore.core.index import Index  # noqa: E402
from compressors.kinds import HEAD_BYTES, JPEG, NPY, PNG, TEXT, file_kind  # noqa: E402
from fanstore.core.units import parse_rate  # noqa: E402
from selector import Selection  # noqa: E402
from selector.measure import MB, READ_PATH_BATCH_FILES, read_path_batches  # noqa: E402
from selector.policy import NONE_SPEC, Budget, choose  # noqa: E402
from selector.units import decimal_bytes  # noqa: E402

PACK_BUDGET, PACK_THREADS = "800MB/s", 0  # the example; --budget / --prefetch-threads change them
TRADEOFF_BUDGETS_MBPS = (4000, 2000, 1000, 500, 200, 100, 0)
TRADEOFF_THREADS = (0, 1, 2, 4, 8)
K_TABLE_BUDGET_MBPS = 4000  # the budget of the "as K grows" table: tight enough that K changes the choices
KIND_LABELS = {JPEG: "images (JPEG)", PNG: "images (PNG)", NPY: "float32 arrays (.npy)", TEXT: "text"}

DECODE_REPEATS = 5
MIN_PASS_SECONDS = 0.2  # a pass over a kind's files is repeated within the pass until it lasts this long
LINKED_BYTES = {False: 10 << 30, True: 1 << 30}  # hard-linked tree for the selection timing (quick: 1 GiB)
LINKED_VERSION = "bench_select linked tree v1"
SELECT_RUNS = {False: 3, True: 1}

TARGET_TOLERANCE = 0.15
TARGET_SELECT_SECONDS = 60.0
TARGET_PACK_TIME = 0.25  # predicted pack time within 25% of the real pack's (issue 14)
TARGET_STORED = 0.05  # predicted stored size within 5%

REAL_TREE_BYTES = {False: 150_000_000, True: 30_000_000}
REAL_TREE_VERSION = "bench_select site-packages copy v1"

HELD_OUT_VERSION = "bench_select held-out tree v1"
HELD_OUT_FIT_MARGIN = 0.02  # --fit of the held-out pack: the bound of a --budget selection's prediction, plus this

CLI = [sys.executable, "-m", "fanstore"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# --- pack and classify --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackResult:
    seconds: float
    others: float
    index: Index
    selection: Selection


def pack_auto(src: Path, dest: Path, budget: str, threads: int, placement: Placement) -> PackResult:
    """`fanstore pack --codec auto` for real; the selection it ran is read back from the index it wrote."""
    command = placement.wrap([*CLI, "pack", str(src), str(dest), "--codec", "auto", "--budget", budget,
                              "--prefetch-threads", str(threads), "--workers", str(len(placement.cpus)), "--quiet"])
    run = run_timed(command, env=ENV, cwd=REPO)
    index = Index.load(dest)
    return PackResult(run.seconds, run.others, index, Selection.from_json(index.meta["selection"]))


@dataclass(frozen=True, slots=True)
class KindFiles:
    """The packed dataset's non-empty files of one kind: entry numbers, and their raw and stored bytes."""

    kind: str
    entries: list[int]
    raw_bytes: int
    stored_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes


def files_by_kind(index: Index, src: Path) -> dict[str, KindFiles]:
    """Every non-empty file of the index, by the kind the packer gave it (sniffed from the source's first bytes)."""
    entries = index.entries
    is_file = (entries["mode"] & 0o170000) == 0o100000
    chosen = np.flatnonzero(is_file & (entries["size"] > 0))
    grouped: dict[str, list[int]] = {}
    for entry in chosen.tolist():
        path = index.path_of(entry)
        with open(src / path, "rb") as f:
            kind = file_kind(path, f.read(HEAD_BYTES))
        grouped.setdefault(kind, []).append(entry)
    result = {}
    for kind, members in sorted(grouped.items()):
        rows = entries[members]
        result[kind] = KindFiles(kind, members, int(rows["size"].sum()), int(rows["stored_len"].sum()))
    return result


# --- decoding, pinned, in a child process -------------------------------------------------------------------


def decode_worker(dest: Path, src: Path, plan_path: Path) -> None:
    """Child process: per kind, the seconds of each pass of decoding (as the read path does), the whole read path
    and plain-directory reads, and the selector's own figure measured again between them, in the same rounds."""
    import blosc

    from fanstore.core.api import open_dataset
    from fanstore.pack.groups import GroupPlan
    from fanstore.pack.walk import walk_source
    from selector.measure import measure_kind
    from selector.sample import draw_sample

    blosc.set_nthreads(1)  # one decoder on one thread, as the selector measures (blosc would start its own pool)
    plan = json.loads(plan_path.read_text())
    results = {}
    with open_dataset(dest) as ds:
        selection = Selection.from_json(ds.index.meta["selection"])
        sample = draw_sample(src, walk_source(src).files, GroupPlan(selection.replicate).group_of,
                             fraction=selection.fraction, max_bytes=selection.max_bytes, seed=selection.seed)
        if len(sample) != selection.sample_files:
            raise SystemExit(f"bench_select: the sample drawn again has {len(sample)} files, the pack's had "
                             f"{selection.sample_files}")
        for kind, entries in plan.items():
            passes = _passes(ds, src, entries)
            loops = {name: max(1, math.ceil(MIN_PASS_SECONDS / max(run(), 1e-9))) for name, run in passes.items()}
            seconds: dict[str, list[float]] = {name: [] for name in passes}
            selector_now: list[float] = []
            choice = selection.choices.get(kind)
            kind_sample = [f for f in sample if f.kind == kind]
            for _ in range(DECODE_REPEATS):  # interleaved, so a change of machine speed hits all alike
                for name, run in passes.items():
                    seconds[name].append(sum(run() for _ in range(loops[name])) / loops[name])
                if choice is not None and kind_sample:
                    selector_now.append(measure_kind(kind, kind_sample, [choice.spec])[0].decode_mbps)
            raw_bytes = sum(int(ds.index.entries[e]["size"]) for e in entries)
            results[kind] = {"raw_bytes": raw_bytes, "files": len(entries), "loops": loops, "seconds": seconds,
                             "selector_now_mbps": selector_now}
    print(json.dumps(results))


def _passes(ds: Dataset, src: Path, entries: list[int]) -> dict[str, Callable[[], float]]:
    """Three ways to read these files once, each returning the seconds it timed; checks every file decodes."""
    import xxhash

    index, reader = ds.index, ds.reader
    work = [(reader.codecs[int(index.entries[e]["codec"])].decode, reader.read_stored(e), int(index.entries[e]["size"]))
            for e in entries]
    plain_paths = [os.path.join(src, index.path_of(e)) for e in entries]
    for (decode, stored, size), path in zip(work, plain_paths):  # untimed: intact, and decoders warm
        with open(path, "rb") as f:
            if decode(stored, size) != f.read():
                raise SystemExit(f"bench_select: {path} does not decode to its source bytes")
    batches = read_path_batches(work)  # as the selector times them

    def decode_pass() -> float:
        """Each blob checksummed, then decoded, as Reader.read does: the decoder reads bytes in cache. Only the
        decoding is timed, a batch at a time (a timer call costs as much as decoding a small file)."""
        seconds = 0.0
        for batch in batches:
            for _, stored, _ in batch:
                xxhash.xxh3_64_intdigest(stored)
            started = time.perf_counter()
            for decode, stored, size in batch:
                decode(stored, size)
            seconds += time.perf_counter() - started
        return seconds

    def read_path_pass() -> float:
        started = time.perf_counter()
        for entry in entries:
            reader.read(entry)
        return time.perf_counter() - started

    def plain_pass() -> float:
        started = time.perf_counter()
        for path in plain_paths:
            with open(path, "rb") as f:
                f.read()
        return time.perf_counter() - started

    return {"decode": decode_pass, "read_path": read_path_pass, "plain": plain_pass}


@dataclass(frozen=True, slots=True)
class ReadSpeeds:
    """MB/s (raw bytes) of one kind's files, median pass of DECODE_REPEATS."""

    decode_mbps: float
    read_path_mbps: float
    plain_mbps: float
    spread: str  # min-max of the decode passes, in MB/s
    selector_now_mbps: float  # the selector's figure for the chosen setting, measured again in the same rounds


def measure_reads(dest: Path, src: Path, kinds: dict[str, KindFiles], placement: Placement,
                  workdir: Path) -> tuple[dict[str, ReadSpeeds], float]:
    """Run decode_worker pinned to `placement`; (speeds per kind, cores other processes used meanwhile)."""
    plan_path = workdir / "decode-plan.json"
    plan_path.write_text(json.dumps({kind: files.entries for kind, files in kinds.items()}))
    command = placement.wrap([sys.executable, str(Path(__file__).resolve()), "--decode-worker", str(dest),
                              str(src), str(plan_path)])
    run = run_timed(command, env=ENV, cwd=REPO)
    speeds = {}
    for kind, record in json.loads(run.stdout).items():
        mbps = {name: record["raw_bytes"] / MB / statistics.median(values)
                for name, values in record["seconds"].items()}
        decode_all = [record["raw_bytes"] / MB / s for s in record["seconds"]["decode"]]
        now = record["selector_now_mbps"]
        speeds[kind] = ReadSpeeds(mbps["decode"], mbps["read_path"], mbps["plain"],
                                  f"{min(decode_all):,.0f}-{max(decode_all):,.0f}",
                                  statistics.median(now) if now else math.nan)
    return speeds, run.others


# --- predicted vs measured ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prediction:
    kind: str
    spec: str
    ratio: float
    decode_mbps: float
    sample_files: int
    sample_bytes: int  # of the chosen setting's measurement (slow settings: a prefix of the kind's sample)
    estimated_bytes: int  # the selector's estimate of the kind's bytes in SRC


def predictions(selection: Selection) -> dict[str, Prediction]:
    result = {}
    for kind, choice in selection.choices.items():
        m, estimate = choice.measurement, selection.kind_bytes.get(kind, 0)
        if m is None:
            result[kind] = Prediction(kind, choice.spec, 1.0, math.nan, 0, 0, estimate)
        else:
            result[kind] = Prediction(kind, choice.spec, m.ratio, m.decode_mbps, m.files, m.raw_bytes, estimate)
    return result


def deviation(measured: float, predicted: float) -> float:
    """How far a measurement is from its prediction, as a share of the prediction ("measured within X% of
    predicted")."""
    return measured / predicted - 1.0


def prediction_error(predicted: float, real: float) -> float:
    """How far a prediction is from what really happened, as a share of the real figure ("predicted within X% of
    the real pack")."""
    return predicted / real - 1.0


def within(measured: float, predicted: float) -> bool:
    return math.isfinite(predicted) and abs(deviation(measured, predicted)) <= TARGET_TOLERANCE


def decodes_nothing(prediction: Prediction) -> bool:
    """Stored as they are: "decoding" is a length check, and both figures measure Python call overhead only."""
    return prediction.spec == NONE_SPEC


def comparison_table(predicted: dict[str, Prediction], kinds: dict[str, KindFiles],
                     speeds: dict[str, ReadSpeeds]) -> list[list[str]]:
    table = [["kind", "codec chosen", "files", "raw", "sample", "ratio pred", "ratio meas", "diff",
              "decode pred", "selector now", "decode meas", "diff", "(passes)", "read path", "plain dir"]]
    for kind, files in kinds.items():
        p, s = predicted.get(kind), speeds[kind]
        now = f"{s.selector_now_mbps:,.0f}" if math.isfinite(s.selector_now_mbps) else "-"
        if p is None:
            table.append([KIND_LABELS.get(kind, kind), "(not in the sample)", f"{len(files.entries):,}",
                          mib(files.raw_bytes), "-", "-", f"{files.ratio:.3f}", "-", "-", now,
                          f"{s.decode_mbps:,.0f}", "-", s.spread, f"{s.read_path_mbps:,.0f}", f"{s.plain_mbps:,.0f}"])
            continue
        decode_diff = "n/a" if decodes_nothing(p) else f"{deviation(s.decode_mbps, p.decode_mbps):+.1%}"
        table.append([
            KIND_LABELS.get(kind, kind), p.spec, f"{len(files.entries):,}", mib(files.raw_bytes),
            f"{p.sample_files:,} / {mib(p.sample_bytes)}",
            f"{p.ratio:.3f}", f"{files.ratio:.3f}", f"{deviation(files.ratio, p.ratio):+.1%}",
            f"{p.decode_mbps:,.0f}", now, f"{s.decode_mbps:,.0f}", decode_diff,
            s.spread, f"{s.read_path_mbps:,.0f}", f"{s.plain_mbps:,.0f}",
        ])
    whole_pred, whole_meas = whole_ratios(predicted, kinds)
    raw = sum(f.raw_bytes for f in kinds.values())
    table.append(["whole dataset", "", f"{sum(len(f.entries) for f in kinds.values()):,}", mib(raw), "",
                  f"{whole_pred:.3f}", f"{whole_meas:.3f}", f"{deviation(whole_meas, whole_pred):+.1%}",
                  "", "", "", "", "", "", ""])
    return table


def whole_ratios(predicted: dict[str, Prediction], kinds: dict[str, KindFiles]) -> tuple[float, float]:
    """Predicted: each kind's predicted ratio weighted by the selector's estimate of its bytes in SRC (what the
    selector alone knows, as `fanstore select` prints it); measured: raw / stored of every file, from the index."""
    estimated_raw = sum(p.estimated_bytes for p in predicted.values())
    estimated_stored = sum(p.estimated_bytes / p.ratio for p in predicted.values())
    raw = sum(f.raw_bytes for f in kinds.values())
    stored = sum(f.stored_bytes for f in kinds.values())
    return (estimated_raw / estimated_stored if estimated_stored else math.nan), raw / stored


# --- the trade-off ------------------------------------------------------------------------------------------


def tradeoff(selection: Selection, raw_by_kind: dict[str, int], budget_mbps: float,
             threads: int) -> tuple[dict[str, tuple[str, float]], float]:
    """Per kind (spec, saving) that `choose` gives for this budget, and the whole-dataset ratio it would reach."""
    budget = Budget(budget_mbps * MB, threads)
    per_kind = {}
    stored = 0.0
    for kind, raw in raw_by_kind.items():
        measurements = [m for m in selection.measurements if m.kind == kind]
        if not measurements:
            per_kind[kind] = ("(unmeasured)", 0.0)
            stored += raw
            continue
        choice = choose(kind, measurements, budget, selection.min_saving, selection.goal,
                        selection.scales_by_kind().get(kind))
        saving = choice.measurement.saving if choice.measurement is not None else 0.0
        per_kind[kind] = (choice.spec + ("" if choice.meets_budget else " (!)"), saving)
        stored += raw * (1.0 - saving)
    return per_kind, sum(raw_by_kind.values()) / stored


def tradeoff_table(selection: Selection, raw_by_kind: dict[str, int],
                   rows: Sequence[tuple[float, int]]) -> list[list[str]]:
    kinds = list(raw_by_kind)
    table = [["budget MB/s", "K", "each decoder", *[KIND_LABELS.get(k, k) for k in kinds], "saving",
              "capacity x"]]
    for budget_mbps, threads in rows:
        per_kind, ratio = tradeoff(selection, raw_by_kind, budget_mbps, threads)
        each = Budget(budget_mbps * MB, threads).required_decode_mbps
        table.append([f"{budget_mbps:,.0f}" if budget_mbps else "0 (none)", str(threads),
                      f">= {each:,.0f}" if budget_mbps else "any",
                      *[f"{per_kind[k][0]} {per_kind[k][1]:.1%}" for k in kinds],
                      f"{1 - 1 / ratio:.1%}", f"{ratio:.3f}"])
    return table


def capacity_grid(selection: Selection, raw_by_kind: dict[str, int]) -> list[list[str]]:
    table = [["budget MB/s", *[f"K={k}" for k in TRADEOFF_THREADS]]]
    for budget_mbps in TRADEOFF_BUDGETS_MBPS:
        table.append([f"{budget_mbps:,.0f}" if budget_mbps else "0 (none)",
                      *[f"{tradeoff(selection, raw_by_kind, budget_mbps, k)[1]:.3f}" for k in TRADEOFF_THREADS]])
    return table


# --- selection time on a 10 GiB tree of hard links ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkedTree:
    root: Path
    copies: int
    files: int
    raw_bytes: int  # sum of st_size over all paths


def ensure_linked(cache: Path, source: Path, files: int, raw_bytes: int, min_bytes: int, quick: bool) -> LinkedTree:
    """`copies` hard-linked copies of `source` under copy_NN/, built once; a marker says it is complete."""
    copies = max(1, math.ceil(min_bytes / raw_bytes))
    name = "linked-quick" if quick else "linked-10g"
    root, marker = cache / name, cache / f"{name}.complete"
    stamp = f"{LINKED_VERSION} source={source} copies={copies} files={files} bytes={raw_bytes}"
    tree = LinkedTree(root, copies, copies * files, copies * raw_bytes)
    if marker.is_file() and marker.read_text().strip() == stamp and root.is_dir():
        print(f"reusing hard-linked tree {root}")
        return tree
    marker.unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    print(f"linking {copies} copies of {source} into {root} (once; reused on later runs) ...", flush=True)
    started = time.monotonic()
    relative = [os.path.relpath(os.path.join(d, n), source) for d, _, names in os.walk(source) for n in names]
    directories = sorted({os.path.dirname(p) for p in relative})
    for copy in range(copies):
        base = root / f"copy_{copy:02d}"
        for directory in directories:
            (base / directory).mkdir(parents=True, exist_ok=True)
        for path in relative:
            os.link(source / path, base / path)
    marker.write_text(stamp + "\n")
    print(f"  {tree.files:,} paths, {tree.raw_bytes / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s")
    return tree


@dataclass(frozen=True, slots=True)
class SelectRun:
    seconds: float
    others: float
    selector_seconds: float  # what `fanstore select` reports: sampling and measuring, without the walk
    sample: str


def select_command(src: str, budget: str, threads: int) -> list[str]:
    """`fanstore select` with the bench's --budget and --prefetch-threads (those of the auto pack too)."""
    return ["select", src, "--budget", budget, "--prefetch-threads", str(threads)]


def time_select(tree: LinkedTree, placement: Placement, runs: int, budget: str, threads: int) -> list[SelectRun]:
    results = []
    for _ in range(runs):
        run = run_timed(placement.wrap([*CLI, *select_command(str(tree.root), budget, threads)]), env=ENV, cwd=REPO)
        # "sample: 1,555 files drawn by bytes (...), 48.2 MB (--sample ...), seed 0; measured in 9.1 s"
        found = re.search(r"sample: ([\d,]+ files?)\b.*?, ([\d.]+ [kMGT]?i?B) \(.*; measured in ([\d.]+) s",
                          run.stdout)
        if found is None:
            raise BenchError(f"cannot find the sample line in the output of fanstore select: {run.stdout[:200]!r}")
        results.append(SelectRun(run.seconds, run.others, float(found.group(3)),
                                 f"{found.group(1)}, {found.group(2)}"))
    return results


# --- whole-pack predictions (issue 14) ----------------------------------------------------------------------


def ensure_real_tree(cache: Path, limit: int, quick: bool) -> Path:
    """A copy of this environment's site-packages: whole top-level entries, in name order, until `limit` bytes are
    copied (built once; a marker says it is complete). Symbolic links are copied as links."""
    source = Path(sysconfig.get_paths()["purelib"])
    name = "site-packages-quick" if quick else "site-packages"
    root, marker = cache / name, cache / f"{name}.complete"
    stamp = f"{REAL_TREE_VERSION} source={source} limit={limit}"
    if marker.is_file() and marker.read_text().strip() == stamp and root.is_dir():
        print(f"reusing {root}")
        return root
    marker.unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"copying {source} into {root}, up to {limit / 1e6:,.0f} MB (once; reused on later runs) ...", flush=True)
    copied = 0
    for entry in sorted(os.scandir(source), key=lambda e: os.fsencode(e.name)):
        if copied >= limit:
            break
        target = root / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            shutil.copytree(entry.path, target, symlinks=True)
            copied += sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(target) for n in names)
        elif entry.is_file():
            shutil.copy2(entry.path, target)
            copied += entry.stat().st_size
    marker.write_text(stamp + "\n")
    return root


def pack_worker(src: Path, dest: Path, budget: str, threads: int, workers: int) -> None:
    """Child process: one `--codec auto` pack through fanstore.pack.packer.pack; its figures as JSON on stdout. Run
    through the function rather than the CLI so that nothing needs the index read back (see the note printed
    when an index cannot be opened)."""
    from fanstore.pack.options import PackOptions
    from fanstore.pack.packer import pack

    options = PackOptions(codec="auto", budget=parse_rate(budget, "--budget"), prefetch_threads=threads,
                          workers=workers)
    summary = pack(src, dest, options)
    dest_bytes = sum(path.stat().st_size for path in dest.rglob("*") if path.is_file())
    assert summary.selection is not None
    print(json.dumps({"seconds": summary.seconds, "selection_seconds": summary.selection_seconds,
                      "files": summary.files, "raw_bytes": summary.raw_bytes, "stored_bytes": summary.stored_bytes,
                      "dest_bytes": dest_bytes, "skipped": len(summary.problems),
                      "selection": summary.selection.to_json()}))


@dataclass(frozen=True, slots=True)
class WholePack:
    """A real pack beside what its selection predicted."""

    label: str
    src: Path
    files: int
    raw_bytes: int
    workers: int
    others: float  # cores other processes used during the pack (the child: selection and pack)
    selection: Selection
    selection_seconds: float
    pack_seconds: float  # the pack's own, after the selection
    stored_bytes: int  # the files' stored bytes, as the pack reports them
    dest_bytes: int  # chunk files + index

    @property
    def predicted_seconds(self) -> float:
        return self.selection.estimate().seconds

    @property
    def predicted_stored(self) -> float:
        return self.selection.predicted_blob_bytes()

    @property
    def predicted_dest(self) -> float:
        return self.selection.need().total


def whole_pack(label: str, src: Path, workdir: Path, budget: str, threads: int, placement: Placement) -> WholePack:
    dest = workdir / f"whole-{label.replace(' ', '-')}"
    command = placement.wrap([sys.executable, str(Path(__file__).resolve()), "--pack-worker", str(src), str(dest),
                              budget, str(threads), str(len(placement.cpus))])
    run = run_timed(command, env=ENV, cwd=REPO)
    record = json.loads(run.stdout)
    shutil.rmtree(dest, ignore_errors=True)
    return WholePack(label, src, record["files"], record["raw_bytes"], len(placement.cpus), run.others,
                     Selection.from_json(record["selection"]), record["selection_seconds"],
                     record["seconds"] - record["selection_seconds"], record["stored_bytes"], record["dest_bytes"])


def index_opens(dest_probe: Path, src: Path) -> str | None:
    """None when a plain pack of `src` gives an index that opens; else why not (the whole-pack figures do not need
    it, but the report says so: it is a bug of its own)."""
    from fanstore.errors import FanstoreError
    from fanstore.pack.options import PackOptions
    from fanstore.pack.packer import pack

    try:
        pack(src, dest_probe, PackOptions(codec="none", workers=1))
        Index.load(dest_probe)
    except FanstoreError as exc:
        return str(exc)
    finally:
        shutil.rmtree(dest_probe, ignore_errors=True)
    return None


def whole_pack_table(runs: list[WholePack]) -> list[list[str]]:
    table = [["tree", "files", "raw", "pack s pred", "pack s real", "off", "stored pred", "stored real", "off",
              "DEST pred", "DEST real", "off", "others"]]
    for r in runs:
        table.append([r.label, f"{r.files:,}", mib(r.raw_bytes), f"{r.predicted_seconds:,.1f}",
                      f"{r.pack_seconds:,.1f}", f"{prediction_error(r.predicted_seconds, r.pack_seconds):+.0%}",
                      mib(round(r.predicted_stored)), mib(r.stored_bytes),
                      f"{prediction_error(r.predicted_stored, r.stored_bytes):+.1%}", mib(round(r.predicted_dest)),
                      mib(r.dest_bytes), f"{prediction_error(r.predicted_dest, r.dest_bytes):+.1%}",
                      f"{r.others:.2f}" + (" DISTURBED" if r.others > NOISY_OTHERS else "")])
    return table


def whole_pack_targets(runs: list[WholePack]) -> list[tuple[str, str, str]]:
    lines = []
    for r in runs:
        disturbed_note = f" (DISTURBED: others used {r.others:.2f} cores)" if r.others > NOISY_OTHERS else ""
        off = prediction_error(r.predicted_seconds, r.pack_seconds)
        lines.append((f"{r.label}: predicted pack time within {TARGET_PACK_TIME:.0%} of the real pack",
                      f"predicted {r.predicted_seconds:.1f} s, real {r.pack_seconds:.1f} s ({off:+.0%})"
                      f"{disturbed_note}", "PASS" if abs(off) <= TARGET_PACK_TIME else "FAIL"))
        off = prediction_error(r.predicted_stored, r.stored_bytes)
        lines.append((f"{r.label}: predicted stored size within {TARGET_STORED:.0%} of the real pack",
                      f"predicted {mib(round(r.predicted_stored))}, real {mib(r.stored_bytes)} ({off:+.1%}); DEST "
                      f"{prediction_error(r.predicted_dest, r.dest_bytes):+.1%}",
                      "PASS" if abs(off) <= TARGET_STORED else "FAIL"))
    return lines


def print_whole_packs(runs: list[WholePack], placement: Placement, budget: str, threads: int,
                      notes: list[str]) -> None:
    print(f"4. whole-pack predictions: `fanstore pack SRC DEST --codec auto --budget {budget} --prefetch-threads "
          f"{threads} --workers {len(placement.cpus)}` (as fanstore.pack.packer.pack, on {placement.label}), beside what "
          "its selection predicted")
    print("   pack s: the pack's own seconds after the selection (walk, dictionaries, compression, index), predicted "
          "as walk and index + dictionary training + the slower of the workers' reading and compressing and the "
          "chunk writes (selector/estimate.py); stored: the files' stored bytes; DEST: chunk files + index, predicted "
          "with the dictionaries and an index estimate; off: (predicted - real) / real")
    for r in runs:
        print(f"   {r.label}: {r.src}; selection {r.selection_seconds:.1f} s; "
              f"{', '.join(f'{k} {v}' for k, v in r.selection.codec_by_kind().items())}")
        print(f"     predicted {r.selection.estimate().describe()}")
    for note in notes:
        print(f"   note: {note}")
    print_table(whole_pack_table(runs), left=1)


# --- the held-out tree (issue 33) ---------------------------------------------------------------------------


def ensure_held_out(cache: Path) -> Path:
    """bench/held_out_tree.py's tree under `cache`, written once (a marker says it is complete)."""
    root, marker = cache / "held-out", cache / "held-out.complete"
    if marker.is_file() and marker.read_text().strip().startswith(HELD_OUT_VERSION) and root.is_dir():
        print(f"reusing {root}")
        return root
    marker.unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    files, raw_bytes = write_held_out_tree(root)
    marker.write_text(f"{HELD_OUT_VERSION} files={files} bytes={raw_bytes}\n")
    return root


def held_out_worker(src: Path, dest: Path, budget: str, threads: int, workers: int) -> None:
    """Child process: the selection that plans the --fit (--budget alone: its prediction's bound), then the --fit
    pack through fanstore.pack.packer.pack; the figures as JSON on stdout. A pack refused or stopped by its --fit is a
    figure too (its message), not a failure of the bench."""
    from fanstore.errors import DoesNotFit
    from fanstore.pack.groups import GroupPlan
    from fanstore.pack.auto_codec import make_goal, select_for
    from fanstore.pack.options import PackOptions
    from fanstore.pack.packer import pack
    from fanstore.pack.walk import walk_source
    from selector.sample import DEFAULT_FRACTION

    rate = parse_rate(budget, "--budget")
    tree = walk_source(src)
    planning = select_for(src, tree, GroupPlan(()), rate, threads, DEFAULT_FRACTION, 0, make_goal(workers=workers))
    fit = math.ceil(planning.need().total_bound * (1 + HELD_OUT_FIT_MARGIN))
    options = PackOptions(codec="auto", budget=rate, prefetch_threads=threads, workers=workers, fit=fit)
    record = {"fit": fit, "planning": planning.to_json(), "stopped": ""}
    try:
        summary = pack(src, dest, options, tree=tree)
    except DoesNotFit as exc:
        record["stopped"] = str(exc)
    else:
        assert summary.selection is not None
        record.update(files=summary.files, raw_bytes=summary.raw_bytes, stored_bytes=summary.stored_bytes,
                      dest_bytes=sum(path.stat().st_size for path in dest.rglob("*") if path.is_file()),
                      selection=summary.selection.to_json())
    print(json.dumps(record))


@dataclass(frozen=True, slots=True)
class HeldOut:
    """The held-out tree's --fit pack beside what its selection predicted and bounded."""

    src: Path
    files: int
    raw_bytes: int
    fit: int
    planning: Selection  # the --budget selection whose bound (+ HELD_OUT_FIT_MARGIN) is --fit
    selection: Selection | None  # the pack's own (with --fit); None when the pack did not finish
    stored_bytes: int  # the files' stored bytes, as the pack reports them
    dest_bytes: int  # chunk files + index
    stopped: str  # why the pack did not finish (--fit refused or broken while packing), else ""

    @property
    def predicted_stored(self) -> float:
        return self.selection.predicted_blob_bytes() if self.selection is not None else math.nan

    @property
    def stored_bound(self) -> float:
        """The files' stored bytes at the bound: the prediction plus the bound's margin on the whole."""
        if self.selection is None:
            return math.nan
        need = self.selection.need()
        return self.predicted_stored + need.total_bound - need.total

    @property
    def fits(self) -> bool:
        return not self.stopped and self.dest_bytes <= self.fit

    def to_json(self) -> dict[str, object]:
        return {"src": str(self.src), "files": self.files, "raw_bytes": self.raw_bytes, "fit": self.fit,
                "stored_bytes": self.stored_bytes, "predicted_stored": self.predicted_stored,
                "stored_bound": self.stored_bound, "dest_bytes": self.dest_bytes,
                "predicted_dest": self.selection.need().total if self.selection is not None else None,
                "dest_bound": self.selection.need().total_bound if self.selection is not None else None,
                "choices": self.selection.codec_by_kind() if self.selection is not None else None,
                "planning_choices": self.planning.codec_by_kind(), "stopped": self.stopped}


def held_out_pack(src: Path, workdir: Path, budget: str, threads: int, placement: Placement) -> HeldOut:
    """Run held_out_worker pinned to `placement`, without waiting for a quiet machine (bytes only)."""
    import subprocess

    dest = workdir / "held-out-ds"
    command = placement.wrap([sys.executable, str(Path(__file__).resolve()), "--held-out-worker", str(src),
                              str(dest), budget, str(threads), str(len(placement.cpus))])
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise BenchError(f"the held-out pack exited {proc.returncode}: {last}")
    record = json.loads(proc.stdout)
    shutil.rmtree(dest, ignore_errors=True)
    files, raw_bytes = tree_totals(src)
    selection = Selection.from_json(record["selection"]) if "selection" in record else None
    return HeldOut(src, files, raw_bytes, record["fit"], Selection.from_json(record["planning"]), selection,
                   record.get("stored_bytes", 0), record.get("dest_bytes", 0), record["stopped"])


def held_out_table(run: HeldOut) -> list[list[str]]:
    def size(count: float) -> str:
        return decimal_bytes(count) if math.isfinite(count) else "-"

    dest_predicted = run.selection.need() if run.selection is not None else None
    off = prediction_error(run.predicted_stored, run.stored_bytes) if run.stored_bytes else math.nan
    return [["tree", "files", "raw", "--fit", "stored pred", "stored real", "off", "stored bound", "DEST pred",
             "DEST real", "DEST bound", "fits"],
            ["held-out tree", f"{run.files:,}", size(run.raw_bytes), size(run.fit), size(run.predicted_stored),
             size(run.stored_bytes) if run.stored_bytes else "-", f"{off:+.1%}" if math.isfinite(off) else "-",
             size(run.stored_bound), size(dest_predicted.total) if dest_predicted else "-",
             size(run.dest_bytes) if run.dest_bytes else "-",
             size(dest_predicted.total_bound) if dest_predicted else "-", "yes" if run.fits else "NO"]]


def print_held_out(run: HeldOut, placement: Placement, budget: str, threads: int) -> None:
    print(f"5. the held-out tree: `fanstore pack SRC DEST --codec auto --budget {budget} --prefetch-threads {threads} "
          f"--workers {len(placement.cpus)} --fit F` (as fanstore.pack.packer.pack, on {placement.label}), F the bound of a "
          f"--budget selection's prediction + {HELD_OUT_FIT_MARGIN:.0%}")
    print(f"   SRC: {run.src} (bench/held_out_tree.py): kind `other` is mostly one 3 MiB file of random bytes")
    print(f"   planning selection: {', '.join(f'{k} {v}' for k, v in run.planning.codec_by_kind().items())}; "
          f"{run.planning.need().describe()}")
    if run.selection is not None:
        print(f"   the pack's selection: "
              f"{', '.join(f'{k} {v}' for k, v in run.selection.codec_by_kind().items())}")
    print("   stored: the files' stored bytes; its bound: the prediction plus the one-sided 99% margin of the sample "
          "(what --fit plans against); DEST: chunk files + index, predicted with the dictionaries the pack trains "
          "and the most the rest of the index takes (index_size.index_bytes_bound, selector.record_bytes); off: "
          "(predicted - real) / real; fits: DEST within --fit")
    if run.stopped:
        print(f"   the pack did not finish: {run.stopped}")
    print_table(held_out_table(run), left=1)


def held_out_targets(run: HeldOut) -> list[tuple[str, str, str]]:
    if run.selection is None:
        return [("held-out tree: the --fit pack finishes", run.stopped, "FAIL")]
    off = prediction_error(run.predicted_stored, run.stored_bytes)
    return [
        (f"held-out tree: predicted stored size within {TARGET_STORED:.0%} of the real pack",
         f"predicted {decimal_bytes(run.predicted_stored)}, real {decimal_bytes(run.stored_bytes)} ({off:+.1%})",
         "PASS" if abs(off) <= TARGET_STORED else "FAIL"),
        ("held-out tree: stored size within the bound of its prediction",
         f"real {decimal_bytes(run.stored_bytes)}, bound {decimal_bytes(run.stored_bound)}",
         "PASS" if run.stored_bytes <= run.stored_bound else "FAIL"),
        ("held-out tree: DEST within the --fit that the selection accepted",
         f"{decimal_bytes(run.dest_bytes)} of --fit {decimal_bytes(run.fit)}", "PASS" if run.fits else "FAIL"),
    ]


def run_held_out(cache: Path, budget: str, threads: int, placement: Placement) -> HeldOut:
    src = ensure_held_out(cache)
    tree_totals(src)  # warms the page cache
    with tempfile.TemporaryDirectory(prefix="bench-select-held-out-", dir=cache) as tmp:
        print(f"[held-out] --codec auto --budget {budget} --fit (its bound + {HELD_OUT_FIT_MARGIN:.0%}) ...",
              flush=True)
        return held_out_pack(src, Path(tmp), budget, threads, placement)


# --- output -------------------------------------------------------------------------------------------------


def print_table(table: list[list[str]], left: int = 2) -> None:
    """The first `left` columns left-aligned, the rest right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for number, row in enumerate(table):
        cells = [cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  " + "  ".join(cells).rstrip())
        if number == 0:
            print("  " + "  ".join("-" * w for w in widths))


def disturbed(others: float) -> str:
    return f" (DISTURBED: other processes used {others:.2f} cores)" if others > NOISY_OTHERS else ""


def target_lines(predicted: dict[str, Prediction], kinds: dict[str, KindFiles], speeds: dict[str, ReadSpeeds],
                 selects: list[SelectRun] | None, tree: LinkedTree | None,
                 quick: bool, select_cpus: int = 2) -> list[tuple[str, str, str]]:
    lines = []
    for kind, files in kinds.items():
        p = predicted.get(kind)
        label = KIND_LABELS.get(kind, kind)
        if p is None:
            lines.append((f"{label}: predicted from the sample", "kind not in the sample", "FAIL"))
            continue
        ratio_line = f"{files.ratio:.3f} vs {p.ratio:.3f} ({deviation(files.ratio, p.ratio):+.1%})"
        lines.append((f"{label} ({p.spec}): measured ratio within {TARGET_TOLERANCE:.0%} of predicted", ratio_line,
                      "PASS" if within(files.ratio, p.ratio) else "FAIL"))
        measured, expected = speeds[kind].decode_mbps, p.decode_mbps
        decode_line = f"{measured:,.0f} vs {expected:,.0f} MB/s ({deviation(measured, expected):+.1%})"
        if decodes_nothing(p):
            verdict, decode_line = "N/A", decode_line + "; stored raw, nothing is decoded (a length check)"
        else:
            verdict = "PASS" if within(measured, expected) else "FAIL"
        lines.append((f"{label} ({p.spec}): measured decode within {TARGET_TOLERANCE:.0%} of predicted",
                      decode_line, verdict))
    whole_pred, whole_meas = whole_ratios(predicted, kinds)
    lines.append((f"whole dataset: measured ratio within {TARGET_TOLERANCE:.0%} of predicted",
                  f"{whole_meas:.3f} vs {whole_pred:.3f} ({deviation(whole_meas, whole_pred):+.1%})",
                  "PASS" if within(whole_meas, whole_pred) else "FAIL"))
    goal = f"`fanstore select`, default sample, {select_cpus} cores, 10 GiB: < {TARGET_SELECT_SECONDS:.0f} s"
    if selects is None or tree is None:
        lines.append((goal, "not measured", "SKIP"))
    else:
        worst = max(run.seconds for run in selects)
        size = f"{tree.raw_bytes / 2**30:.1f} GiB, {tree.files:,} paths"
        verdict = "SKIP" if quick else ("PASS" if worst < TARGET_SELECT_SECONDS else "FAIL")
        note = " (quick run: not 10 GiB)" if quick else ""
        lines.append((goal, f"worst of {len(selects)}: {worst:.1f} s on {size}{note}", verdict))
    return lines


@dataclass(frozen=True, slots=True)
class Results:
    """Everything one run measured, for the report."""

    quick: bool
    budget: str
    threads: int
    src: Path
    src_files: int
    src_bytes: int
    one: Placement  # where decoding is timed
    both: Placement  # where the pack and `fanstore select` run
    packed: PackResult
    kinds: dict[str, KindFiles]
    speeds: dict[str, ReadSpeeds]
    decode_others: float
    linked: LinkedTree
    selects: list[SelectRun]
    whole: list[WholePack]
    whole_notes: list[str]
    held_out: HeldOut


def print_predictions(r: Results) -> None:
    selection = r.packed.selection
    pack_command = r.both.wrap(["fanstore", "pack", "SRC", "DEST", "--codec", "auto", "--budget", r.budget,
                                "--prefetch-threads", str(r.threads), "--workers", str(len(r.both.cpus))])
    print(f"1. predicted (selector, from its sample) vs measured (the packed dataset), budget {r.budget}, "
          f"K={r.threads}")
    print(f"   pack: {' '.join(pack_command)}: {r.packed.seconds:.1f} s including the selection "
          f"({selection.seconds:.1f} s, sample {selection.sample_files:,} files, {mib(selection.sample_bytes)})"
          f"{disturbed(r.packed.others)}")
    print("   decode pred: the chosen setting's measurement in the index's meta['selection'] (the selector decodes its "
          f"sample on one thread, blosc on one thread, each file right after its checksum, in the pack process on "
          f"{r.both.label})")
    print("   ratio meas: raw / stored over every non-empty file of the kind in the index (chunk headers, index "
          "and dictionaries not counted, as the selector does not count them)")
    print(f"   decode meas: every file of the kind, decoded one by one with the dataset's codec table right after its "
          f"checksum, as Reader.read does (so the decoder reads bytes in cache); only decoding timed, "
          f"{READ_PATH_BATCH_FILES} files at a time; one thread ({r.one.label}, blosc 1 thread); median of "
          f"{DECODE_REPEATS} passes (min-max in '(passes)'){disturbed(r.decode_others)}")
    print("   selector now: the selector's measurement of the chosen setting on its own sample (drawn again: the "
          "same files), median of the same rounds as 'decode meas': it separates drift of this machine's speed "
          "since the pack from the sample's error (the targets compare with 'decode pred', what the pack recorded)")
    print("   read path: Reader.read per file (pread from the chunk, checksum, decode); plain dir: open/read/close "
          "of the same files in SRC (the baseline); all MB/s of raw bytes (10^6 B/s), same process and CPU")
    print("   sample: files / bytes the chosen setting was measured on (slow settings use a prefix of the kind's "
          "sample); the whole-dataset prediction weights each kind's ratio by the selector's estimate of its "
          "bytes in SRC (meta['selection']['sample']['kind_bytes'])")
    print_table(comparison_table(predictions(selection), r.kinds, r.speeds))


def print_tradeoff(r: Results) -> None:
    selection = r.packed.selection
    raw_by_kind = {kind: files.raw_bytes for kind, files in r.kinds.items()}
    print("2. the trade-off: what each budget and each K buy, from the pack's one set of measurements "
          "(selector.policy.choose per budget and K; nothing measured again)")
    print("   per kind: the setting chosen and the share of that kind's bytes it saves (predicted from the sample); "
          "'(!)' = nothing met the budget, stored raw")
    print("   whole dataset: kinds weighted by their raw bytes in this dataset; capacity x = raw bytes held per "
          "byte of storage (chunk and index overhead not counted)")
    print()
    print("   a) as the budget loosens, decoding on the read path (K=0)")
    print_table(tradeoff_table(selection, raw_by_kind, [(b, 0) for b in TRADEOFF_BUDGETS_MBPS]), left=0)
    print()
    print(f"   b) as K grows, budget {K_TABLE_BUDGET_MBPS:,} MB/s (K threads decode ahead, each needs budget / K)")
    print_table(tradeoff_table(selection, raw_by_kind, [(K_TABLE_BUDGET_MBPS, k) for k in TRADEOFF_THREADS]),
                left=0)
    print()
    print("   c) capacity x of the whole dataset, budget by K")
    print_table(capacity_grid(selection, raw_by_kind), left=1)


def print_selection_time(r: Results) -> None:
    linked = r.linked
    print(f"3. selection time: {' '.join(r.both.wrap(['fanstore', *select_command('SRC', r.budget, r.threads)]))} "
          "(default sample: 2%, at most 48 MiB)")
    print(f"   SRC: {linked.root}: {linked.copies} copies of the generated tree as hard links under copy_NN/ "
          f"({linked.files:,} paths, st_size summing to {linked.raw_bytes:,} B = {linked.raw_bytes / 2**30:.2f} "
          "GiB): the walk and the sample cost what they would on that much data; the data is in the page cache")
    print("   wall s: the whole command (interpreter start, walk, sample, measure, print); selector s: what it "
          "reports (sample and measure)")
    table = [["run", "wall s", "selector s", "others", "sample", ""]]
    for number, run in enumerate(r.selects, 1):
        table.append([str(number), f"{run.seconds:.1f}", f"{run.selector_seconds:.1f}", f"{run.others:.2f}",
                      run.sample, "DISTURBED" if run.others > NOISY_OTHERS else ""])
    print_table(table, left=1)


def print_report(r: Results, notes: list[str]) -> None:
    print()
    print("bench_select: selector predictions vs the packed dataset, the budget trade-off, selection time")
    for line in machine_lines():
        print(line)
    print("cache: warm (not dropped; the source tree is read once before timing)")
    print(f"dataset: {r.src}: {r.src_files:,} files, {mib(r.src_bytes)} (bench/synthetic_tree.py"
          f"{', quick shape' if r.quick else ''})")
    print(f"others = CPU seconds other processes of this machine used during a timing / its wall seconds "
          f"(> {NOISY_OTHERS}: DISTURBED); every timing first waits (at most 30 s) for the CPUs to be quiet")
    for note in notes:
        print(f"note: {note}")
    print()
    print_predictions(r)
    print()
    print_tradeoff(r)
    print()
    print_selection_time(r)
    print()
    print_whole_packs(r.whole, r.both, r.budget, r.threads, r.whole_notes)
    print()
    print_held_out(r.held_out, r.both, r.budget, r.threads)
    print()
    print("targets")
    for target, measured, verdict in (target_lines(predictions(r.packed.selection), r.kinds, r.speeds, r.selects,
                                                   r.linked, r.quick, len(r.both.cpus))
                                      + whole_pack_targets(r.whole) + held_out_targets(r.held_out)):
        print(f"  {verdict:<4}  {target}: {measured}")


# --- main ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=BENCH_DIR / ".cache",
                        help="where generated datasets are kept between runs (default bench/.cache)")
    parser.add_argument("--quick", action="store_true",
                        help="the small generated tree and a 1 GiB linked tree (a minute or two); same tables")
    parser.add_argument("--budget", default=PACK_BUDGET,
                        help=f"budget of the auto pack and of the timed `fanstore select` (default {PACK_BUDGET})")
    parser.add_argument("--prefetch-threads", type=int, default=PACK_THREADS,
                        help=f"K of the auto pack and of the timed `fanstore select` (default {PACK_THREADS})")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--whole-pack-only", action="store_true",
                        help="only the whole-pack predictions (section 4) and their targets: a few minutes")
    choice.add_argument("--held-out-only", action="store_true",
                        help="only the held-out tree (section 5) and its targets: under a minute")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="also write the held-out tree's figures (section 5) to FILE as JSON")
    parser.add_argument("--decode-worker", nargs=3, metavar=("DEST", "SRC", "PLAN"), help=argparse.SUPPRESS)
    parser.add_argument("--pack-worker", nargs=5, metavar=("SRC", "DEST", "BUDGET", "K", "WORKERS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--held-out-worker", nargs=5, metavar=("SRC", "DEST", "BUDGET", "K", "WORKERS"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.decode_worker:
        dest, src, plan = args.decode_worker
        decode_worker(Path(dest), Path(src), Path(plan))
        return 0
    if args.pack_worker:
        src, dest, budget, threads, workers = args.pack_worker
        pack_worker(Path(src), Path(dest), budget, int(threads), int(workers))
        return 0
    if args.held_out_worker:
        src, dest, budget, threads, workers = args.held_out_worker
        held_out_worker(Path(src), Path(dest), budget, int(threads), int(workers))
        return 0
    parse_rate(args.budget, "--budget")  # fail now, not after generating
    cpus = sorted(os.sched_getaffinity(0))
    pinned = Tools.find().taskset is not None
    one, both = Placement((cpus[0],), pinned), Placement(tuple(cpus[:2]), pinned)
    notes = [] if pinned else ["taskset not found (util-linux): nothing is pinned, placement not controlled"]
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if args.held_out_only:  # the held-out tree is one size, quick or not
        held_out = run_held_out(cache, args.budget, args.prefetch_threads, both)
        write_json(args.json, held_out)
        print_held_out_report(held_out, both, args, notes)
        return 0
    if args.quick:
        notes.append("quick run: the tree is so small that each kind's sample is a few files or a few hundred KiB, "
                     "so the predictions are rough; the full run answers the question")
    src = ensure_generated(cache, args.quick, processes=len(cpus))
    src_files, src_bytes = tree_totals(src)  # also warms the page cache
    real = ensure_real_tree(cache, REAL_TREE_BYTES[args.quick], args.quick)
    tree_totals(real)
    whole, whole_notes = whole_packs(cache, src, real, args.budget, args.prefetch_threads, both)
    if args.whole_pack_only:
        print_whole_pack_report(whole, whole_notes, both, args, notes)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-select-", dir=cache) as tmp:
        workdir = Path(tmp)
        print(f"[pack] fanstore pack --codec auto --budget {args.budget} --prefetch-threads {args.prefetch_threads}"
              " ...", flush=True)
        packed = pack_auto(src, workdir / "ds", args.budget, args.prefetch_threads, both)
        kinds = files_by_kind(packed.index, src)
        print("[decode] every file of every kind, pinned to one CPU ...", flush=True)
        speeds, decode_others = measure_reads(workdir / "ds", src, kinds, one, workdir)
    linked = ensure_linked(cache, src, src_files, src_bytes, LINKED_BYTES[args.quick], args.quick)
    print(f"[select] fanstore select on {linked.raw_bytes / 2**30:.1f} GiB of hard links, "
          f"{SELECT_RUNS[args.quick]} run(s) ...", flush=True)
    selects = time_select(linked, both, SELECT_RUNS[args.quick], args.budget, args.prefetch_threads)
    held_out = run_held_out(cache, args.budget, args.prefetch_threads, both)
    write_json(args.json, held_out)
    print_report(Results(args.quick, args.budget, args.prefetch_threads, src, src_files, src_bytes, one, both,
                         packed, kinds, speeds, decode_others, linked, selects, whole, whole_notes, held_out), notes)
    return 0


def write_json(path: Path | None, held_out: HeldOut) -> None:
    if path is not None:
        path.write_text(json.dumps({"held_out": held_out.to_json()}, indent=1) + "\n")


def print_held_out_report(held_out: HeldOut, placement: Placement, args: argparse.Namespace,
                          run_notes: list[str]) -> None:
    print()
    print("bench_select --held-out-only: what a --fit pack of the held-out tree stores, beside its prediction")
    for line in machine_lines():
        print(line)
    for note in run_notes:
        print(f"note: {note}")
    print()
    print_held_out(held_out, placement, args.budget, args.prefetch_threads)
    print()
    print("targets")
    for target, measured, verdict in held_out_targets(held_out):
        print(f"  {verdict:<4}  {target}: {measured}")


def whole_packs(cache: Path, generated: Path, real: Path, budget: str, threads: int,
                placement: Placement) -> tuple[list[WholePack], list[str]]:
    """Section 4's two packs, and notes on them."""
    notes = []
    with tempfile.TemporaryDirectory(prefix="bench-select-whole-", dir=cache) as tmp:
        workdir = Path(tmp)
        broken = index_opens(workdir / "probe", real)
        if broken is not None:
            notes.append(f"the real tree's index does not open once packed ({broken}); the figures here come from "
                         "the pack itself and do not need it")
        runs = []
        for label, src in (("generated tree", generated), ("site-packages copy", real)):
            print(f"[whole pack] {label}: --codec auto --budget {budget} ...", flush=True)
            runs.append(whole_pack(label, src, workdir, budget, threads, placement))
    return runs, notes


def print_whole_pack_report(whole: list[WholePack], notes: list[str], placement: Placement,
                            args: argparse.Namespace, run_notes: list[str]) -> None:
    print()
    print("bench_select --whole-pack-only: the pack time and stored size a selection predicts, beside the pack")
    for line in machine_lines():
        print(line)
    print("cache: warm (not dropped; each source tree is read once before timing)")
    print(f"others = CPU seconds other processes used during a timing / its wall seconds (> {NOISY_OTHERS}: "
          "DISTURBED); every timing first waits (at most 30 s) for the CPUs to be quiet")
    for note in run_notes:
        print(f"note: {note}")
    print()
    print_whole_packs(whole, placement, args.budget, args.prefetch_threads, notes)
    print()
    print("targets")
    for target, measured, verdict in whole_pack_targets(whole):
        print(f"  {verdict:<4}  {target}: {measured}")


if __name__ == "__main__":
    sys.exit(main())
