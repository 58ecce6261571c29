"""Command line: `fanstore-pack` and `fanstore {pack,select,verify,info,plan,mount,umount,demo}`.

Every expected failure is a FanstoreError and ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import DoesNotFit, FanstoreError, UsageError, quoted, say_line
from .core.units import format_bytes, parse_size, plural

if TYPE_CHECKING:
    from selector import Selection

    from .pack.packer import PackOptions, PackSummary
    from .serve.placement import Placement

EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's, for a command line it cannot parse
EXIT_DOES_NOT_FIT = 3  # `fanstore plan` and --fit: distinct from an error, so a batch script can try more nodes
EXIT_INTERRUPTED = 130
_WARNINGS_SHOWN = 20
# Under serve, files from other nodes are fetched ahead in batches, each peer's in one request: a deeper window
# makes the batches larger. Measured with 3 ranks, 128 KiB files, --prefetch-list, a CPU per node: remote files/s at
# 89.3-90.0% of local with 16, against 83.0-85.5% with 8 (mount's default) and 83.2-89.5% with 32.
SERVE_PREFETCH = 16


EPILOG_WIDTH = 78  # columns of the exit statuses, as argparse wraps the rest of --help for an 80-column terminal
_ERROR = (EXIT_FAILURE, "an error, said in one line on stderr")
_USAGE = (EXIT_USAGE, "the command line is wrong (a usage message says how)")
_INTERRUPTED = (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM)")


def package_version() -> str:
    """fanstore's version: the installed distribution's, else (run from a checkout) pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("fanstore")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as pyproject:
            return str(tomllib.load(pyproject)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


class _HelpFormatter(argparse.HelpFormatter):
    """A description (one paragraph) wrapped to the terminal, as argparse wraps the rest; an epilog (exit statuses,
    an example, the codec grammar: several lines) kept as laid out, its columns and the example's line whole."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


class _VersionAction(argparse.Action):
    """--version: the version is looked up only when asked (importlib.metadata is no light import for every run)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="print fanstore's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def _command_help(description: str, exits: Sequence[tuple[int | str, str]], example: str,
                  more: str = "") -> dict[str, Any]:
    """A command's --help beyond its options, as keywords for its parser: the description (one paragraph), then
    `more`, the exit statuses and an example, laid out here."""
    import textwrap

    width = max(len(str(status)) for status, _ in exits) + 2
    statuses = "\n".join(textwrap.fill(meaning, EPILOG_WIDTH, initial_indent=f"  {status!s:<{width}}",
                                        subsequent_indent=" " * (width + 2)) for status, meaning in exits)
    epilog = f"{more}\n\n" if more else ""
    epilog += f"exit status:\n{statuses}\n\nexample:\n  {example}"
    return {"description": description, "epilog": epilog, "formatter_class": _HelpFormatter}


def _pack_help(prog: str) -> dict[str, Any]:
    """fanstore-pack's and `fanstore pack`'s --help, the codec grammar included (compressors.registry's)."""
    from compressors.registry import codec_grammar

    from .pack.packer import AUTO_CODEC

    grammar = "\n".join(f"  {line}" for line in codec_grammar().splitlines())
    return _command_help(
        "Pack the directory tree SRC into the dataset directory DEST: each file compressed on its own, so that any "
        "file reads without its neighbours, into chunk files and an index written last. SRC may instead be one or "
        "more archives (tar, tar.gz, tar.zst, tar.bz2, tar.xz, zip) or a quoted glob of them ('shards/*.tar'): "
        "their members are packed as the files of an extraction, read as a stream, nothing extracted; a damaged "
        "archive gives its members before the damage and a warning naming the offset. DEST is new or empty; or "
        "an interrupted pack of the same SRC with the same options, which this resumes from its last finished chunk "
        "to the bytes an uninterrupted pack gives; or this very pack, finished, and there is nothing to do. "
        "Another dataset is replaced only with --force, and what fanstore did not write never. Files that cannot be "
        "packed (unreadable, fifos, links that leave SRC, member names such as ../x, ...) are skipped with a "
        "warning, and `fanstore info DEST` lists them.",
        [(0, "packed; or DEST already held this very pack, finished (nothing to do)"),
         (EXIT_FAILURE, "an error, said in one line on stderr: a bad option, a DEST it may not use, a file that "
                        "cannot be packed with --strict, a full disk (what was finished stays: the same command "
                        "resumes)"),
         _USAGE,
         (EXIT_DOES_NOT_FIT, "--fit cannot be met: refused before anything is written, stopped while packing "
                             "once it can no longer fit (what it wrote is removed), or DEST as packed is larger "
                             "than --fit"),
         (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM): the same command resumes")],
        f"{prog} /data/imagenet /scratch/imagenet.fanstore --codec zstd:3 --replicate 'val/**'",
        more=f"codec specs (--codec SPEC, unless {AUTO_CODEC}):\n{grammar}\n  A file that would not shrink is stored "
             "as it is.")


def _add_pack_arguments(parser: argparse.ArgumentParser) -> None:
    from .pack.packer import DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_ABOVE, DEFAULT_CHUNK_SIZE, DEFAULT_CODEC

    parser.add_argument("src", metavar="SRC", nargs="+",
                        help="directory tree to pack (it is only read), or one or more archives or globs of them")
    parser.add_argument("dest", metavar="DEST",
                        help="dataset directory to write: new, empty, an interrupted pack to resume, or this pack "
                             "finished")
    parser.add_argument("--codec", default=DEFAULT_CODEC, metavar="SPEC",
                        help="a codec spec (below), or auto: measure codecs on a sample of SRC and choose per file "
                             f"kind (see --budget and --fit) (default {DEFAULT_CODEC})")
    parser.add_argument("--chunk-size", default=str(DEFAULT_CHUNK_SIZE), metavar="SIZE",
                        help="a chunk file closes before the next stored blob (a file stored whole, or one block) "
                             "would take it past SIZE, e.g. 64MiB (default); a blob larger than SIZE gets a chunk "
                             "of its own")
    parser.add_argument("--replicate", action="append", default=[], metavar="GLOB",
                        help="files matching GLOB (e.g. 'val/**') go to the group stored on every node; repeatable")
    parser.add_argument("--block-size", default=str(DEFAULT_BLOCK_SIZE), metavar="SIZE",
                        help="a file larger than --blocks-above is stored in blocks of SIZE, each decodable alone, "
                             "so a read anywhere in it decodes about SIZE bytes (default 1MiB)")
    parser.add_argument("--blocks-above", default=str(DEFAULT_BLOCKS_ABOVE), metavar="SIZE",
                        help="files larger than SIZE are stored in blocks (default 4MiB); smaller ones whole")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="compression processes (default: every core)")
    parser.add_argument("--strict", action="store_true", help="fail instead of skipping files that cannot be packed")
    parser.add_argument("--force", action="store_true", help="replace a dataset or interrupted pack already in DEST")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_selection_arguments(parser, auto_only=True)


def _add_selection_arguments(parser: argparse.ArgumentParser, auto_only: bool) -> None:
    with_auto = "; with --codec auto" if auto_only else ""
    parser.add_argument("--budget", metavar="RATE",
                        help="decode throughput the training job needs, e.g. 800MB/s (0: best ratio); with --fit, a "
                             f"floor{with_auto}")
    parser.add_argument("--prefetch-threads", type=int, default=0, metavar="K",
                        help="K threads decode ahead of the reader, so each needs only budget/K (default 0: "
                             "decoding is on the read path)")
    parser.add_argument("--fit", metavar="SIZE",
                        help="capacity the dataset must fit in, e.g. 500GB: per kind, the settings that decode "
                             "fastest while it still fits (with --nodes, what each node has); exit status "
                             f"{EXIT_DOES_NOT_FIT} when it cannot" + with_auto)
    parser.add_argument("--nodes", metavar="N",
                        help="with --fit: the dataset is served by N nodes, each storing the replicated groups and "
                             "its share of the rest, so --fit is per node")
    parser.add_argument("--tolerance", default="1%", metavar="FRACTION",
                        help="without --fit: settings storing within FRACTION of the smallest count as equal, and "
                             "the fastest to pack wins (default 1%%; 0: the smallest always)")
    parser.add_argument("--pack-speed", metavar="RATE",
                        help="each file kind must pack at RATE or more with the pack's workers, dictionary training "
                             "included, e.g. 50MB/s (default: no floor)")
    parser.add_argument("--sample", default="2%", metavar="FRACTION",
                        help="share of the data the selector measures, e.g. 2%% (default; capped in bytes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the selector's sample (default 0)")


def _selection_options(args: argparse.Namespace) -> dict[str, Any]:
    from .pack.packer import AUTO_CODEC
    from .core.units import parse_fraction, parse_rate

    if getattr(args, "codec", AUTO_CODEC) != AUTO_CODEC:
        for option, given in (("--budget", args.budget is not None), ("--prefetch-threads", args.prefetch_threads),
                              ("--fit", args.fit is not None), ("--nodes", args.nodes is not None),
                              ("--tolerance", args.tolerance != "1%"), ("--pack-speed", args.pack_speed is not None),
                              ("--sample", args.sample != "2%")):
            if given:
                raise UsageError(f"{option} only applies with --codec auto")
        return {}
    if args.budget is None and args.fit is None:
        needs = "--codec auto needs" if hasattr(args, "codec") else "fanstore select needs"
        raise UsageError(f"{needs} --budget, the decode throughput the training job needs (e.g. 800MB/s), or --fit, "
                         "the capacity the dataset must fit in (e.g. 500GB), or both")
    if args.prefetch_threads < 0:
        raise UsageError(f"--prefetch-threads: must be 0 or more, got {args.prefetch_threads}")
    fit = parse_size(args.fit, "--fit") if args.fit is not None else 0
    nodes = 0
    if args.nodes is not None:
        if not fit:
            raise UsageError("--nodes only applies with --fit (the capacity each node has for the dataset)")
        nodes = _parse_nodes(args.nodes)
    return {"budget": parse_rate(args.budget, "--budget") if args.budget is not None else 0.0,
            "prefetch_threads": args.prefetch_threads, "sample": parse_fraction(args.sample, "--sample"),
            "seed": args.seed, "fit": fit, "nodes": nodes, "tolerance": _parse_tolerance(args.tolerance),
            "pack_speed": parse_rate(args.pack_speed, "--pack-speed") if args.pack_speed is not None else 0.0}


def _parse_nodes(text: str) -> int:
    from .serve.placement import MAX_NODES

    try:
        nodes = int(text)
    except ValueError:
        raise UsageError(f"--nodes: cannot read {quoted(text)} as a number of nodes (1 to {MAX_NODES})") from None
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes: must be a whole number from 1 to {MAX_NODES}, got {nodes}")
    return nodes


def _parse_tolerance(text: str) -> float:
    """--tolerance as a fraction from 0 (unlike --sample, 0 is meaningful: the smallest stored size always wins)."""
    from .core.units import parse_fraction

    if str(text).strip().rstrip("%").strip() in ("0", "0.0"):
        return 0.0
    tolerance = parse_fraction(text, "--tolerance")
    if tolerance >= 1:
        raise UsageError(f"--tolerance: {quoted(text)} must be less than 100% (e.g. 1%)")
    return tolerance


def _run_pack(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .pack.packer import PackOptions, PackProgress, pack

    options = PackOptions(
        codec=args.codec,
        chunk_size=parse_size(args.chunk_size, "--chunk-size"),
        block_size=parse_size(args.block_size, "--block-size"),
        blocks_above=parse_size(args.blocks_above, "--blocks-above", minimum=0),
        replicate=tuple(args.replicate),
        workers=args.workers,
        strict=args.strict,
        force=args.force,
        **_selection_options(args),
    )
    bar = None

    def show(p: PackProgress) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=p.raw_total, unit="B", unit_scale=True, unit_divisor=1000, desc="packing",
                       disable=args.quiet or None, file=sys.stderr, mininterval=0.25)
        if bar.disable:
            return
        bar.update(p.raw_done - bar.n)
        ratio = p.raw_done / p.stored_done if p.stored_done else 1.0
        bar.set_postfix_str(f"files {p.files_done}/{p.files_total} ratio {ratio:.2f}x", refresh=False)

    try:
        summary = pack(args.src, args.dest, options, progress=show, on_selection=_announce_selection)
    finally:
        if bar is not None:
            bar.close()
    if summary.up_to_date:
        return _report_up_to_date(args, options, summary)
    for problem in summary.problems[:_WARNINGS_SHOWN]:
        print(f"warning: skipped {problem}", file=sys.stderr)
    if len(summary.problems) > _WARNINGS_SHOWN:
        from .core.info import all_skipped_command

        print(f"warning: ... and {len(summary.problems) - _WARNINGS_SHOWN} more skipped "
              f"({all_skipped_command(args.dest)} lists them all)", file=sys.stderr)
    reused = (f", {plural(summary.reused_chunks, 'chunk')} kept from the interrupted run" if summary.reused_chunks
              else "")
    print(f"packed {plural(summary.files, 'file')} into {plural(summary.chunks, 'chunk')}{reused}: "
          f"{format_bytes(summary.raw_bytes)} raw, {format_bytes(summary.stored_bytes)} stored, ratio "
          f"{summary.ratio:.2f}x, {_pack_time(summary)}, {len(summary.problems):,} skipped")
    if summary.selection is None:
        return 0
    print(_predicted_beside_packed(summary))
    if not options.fit:
        return 0
    line, fits = _check_fit(Path(args.dest), options.fit, options.nodes, summary.selection.need().bytes)
    print(line)
    return 0 if fits else EXIT_DOES_NOT_FIT


def _pack_time(summary: PackSummary) -> str:
    """The pack's time and speed, the codec selection's time apart (it is no part of packing), and no speed for a
    resumed pack (some of its bytes were packed by the interrupted run)."""
    selecting = (f" after {summary.selection_seconds:.1f} s choosing codecs" if summary.selection is not None
                 and summary.selection_seconds else "")
    packing = summary.seconds - summary.selection_seconds
    took = f"{packing:.1f} s" if packing >= 1 else f"{packing:.2f} s"
    if summary.reused_chunks:  # part of raw_bytes was packed before: no speed can be told
        return f"{took} this run{selecting}"
    return f"{took} at {summary.mb_per_s:,.1f} MB/s{selecting}"


def _report_up_to_date(args: argparse.Namespace, options: PackOptions, summary: PackSummary) -> int:
    """A second run of a finished pack: one line saying there is nothing to do, and, with --fit, whether DEST fits
    (the exit status the first run gave)."""
    skipped = f", {len(summary.problems):,} skipped" if summary.problems else ""
    print(f"nothing to do: {args.dest} already holds this pack of {' '.join(args.src)}, the same files with the "
          f"same options ({plural(summary.files, 'file')}, {format_bytes(summary.raw_bytes)} raw, "
          f"{format_bytes(summary.stored_bytes)} stored{skipped}); --force packs it again")
    if not options.fit:
        return 0
    predicted = summary.selection.need().bytes if summary.selection is not None else 0
    line, fits = _check_fit(Path(args.dest), options.fit, options.nodes, predicted)
    print(line)
    return 0 if fits else EXIT_DOES_NOT_FIT


def _check_fit(dest: Path, capacity: int, nodes: int, predicted: float) -> tuple[str, bool]:
    """The packed DEST measured against --fit, not predicted: the whole directory (chunk files and index), or with
    --nodes the fullest node of the placement `fanstore plan` and `fanstore serve` use. One line, and whether it
    fits."""
    if nodes:
        from .core.index import Index
        from .serve.placement import place

        placement = place(Index.load(dest), nodes)
        stored = max(placement.stored_bytes(rank) for rank in range(nodes))
        where = f"the fullest of {nodes:,} nodes stores"
    else:
        stored = sum(path.stat().st_size for path in dest.rglob("*") if path.is_file())
        where = "DEST takes"
    off = f"predicted {format_bytes(predicted)}, {stored / predicted - 1:+.1%}" if predicted else "not predicted"
    if stored <= capacity:
        return (f"fit: {where} {format_bytes(stored)} of --fit {format_bytes(capacity)} ({stored / capacity:.0%}; "
                f"{off})"), True
    return (f"does not fit: {where} {format_bytes(stored)}, {format_bytes(stored - capacity)} over --fit "
            f"{format_bytes(capacity)} ({off})"), False


def _warn_failed_codecs(selection: Selection) -> None:
    for problem in selection.failed:
        print(f"warning: codec {problem}; left out of the selection", file=sys.stderr)


def _announce_selection(selection: Selection) -> None:
    """What --codec auto chose and predicts, printed before compressing starts: the person waiting sees how long."""
    _warn_failed_codecs(selection)
    need, estimate = selection.need(), selection.estimate()
    choices = ", ".join(f"{kind} {spec}" for kind, spec in selection.codec_by_kind().items()) or "nothing sampled"
    print(f"codec selection ({selection.seconds:.1f} s): {choices}")
    fit = ""
    if selection.goal.fit_bytes:
        fit = (f"; {need.describe()} of --fit {format_bytes(selection.goal.fit_bytes)} "
               f"({need.bytes / selection.goal.fit_bytes:.0%})")
    print(f"predicted: {format_bytes(need.total)} stored with the index{fit}; pack {estimate.describe()}", flush=True)


def _predicted_beside_packed(summary: PackSummary) -> str:
    """The pack's time (the selection not counted) and stored bytes beside what the selection predicted."""
    selection = summary.selection
    if selection is None:
        return "no prediction: not packed with --codec auto"
    estimate, blobs = selection.estimate(), selection.predicted_blob_bytes()
    if not blobs or not estimate.seconds:
        return "no prediction: the selector's sample was empty"
    packing = summary.seconds - summary.selection_seconds
    resumed = (f", resumed: {plural(summary.reused_chunks, 'chunk')} {'was' if summary.reused_chunks == 1 else 'were'} "
               "already packed" if summary.reused_chunks else "")
    return (f"pack time {packing:.1f} s after the selection (predicted {estimate.seconds:.1f} s, "
            f"{packing / estimate.seconds - 1:+.0%}{resumed}); stored {format_bytes(summary.stored_bytes)} "
            f"(predicted {format_bytes(blobs)}, {summary.stored_bytes / blobs - 1:+.1%})")


def _run_select(args: argparse.Namespace) -> int:
    from selector import SelectionError
    from selector.report import format_selection, plot_selection

    from .pack.groups import GroupPlan
    from .pack.packer import make_goal, select_for, walk_sources
    from .pack.walk_archive import source_paths

    groups = GroupPlan(tuple(args.replicate))  # validates the patterns before the long part
    options = _selection_options(args)
    goal = make_goal(options["fit"], options["nodes"], options["tolerance"], options["pack_speed"], args.workers)
    sources = source_paths(args.src)
    selection = select_for(sources[0], walk_sources(sources), groups, options["budget"],
                           options["prefetch_threads"], options["sample"], options["seed"], goal)
    _warn_failed_codecs(selection)
    print(format_selection(selection))
    if args.plot:
        try:
            plot_selection(selection, Path(args.plot))
        except SelectionError as exc:
            raise UsageError(str(exc)) from None
        print(f"plot written to {args.plot}")
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from .core.api import open_dataset
    from .core.verify import verify_dataset

    with open_dataset(args.dest) as ds:
        report = verify_dataset(ds)
    for chunk, problem in sorted(report.bad_chunks.items()):
        print(f"BAD CHUNK {chunk}: {problem}")
    for bad in report.bad:
        print(f"BAD {bad}")
    chunks = f", {plural(len(report.bad_chunks), 'bad chunk file')}" if report.bad_chunks else ""
    print(f"checked {plural(report.files_checked, 'file')} ({format_bytes(report.raw_bytes)}): "
          f"{len(report.bad):,} bad{chunks}")
    return 0 if report.ok else EXIT_FAILURE


def _run_info(args: argparse.Namespace) -> int:
    from .core.api import open_dataset
    from .core.info import describe_dataset

    with open_dataset(args.dest) as ds:
        print(describe_dataset(ds, all_skipped=args.all_skipped))
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from .core.index import Index
    from .serve.placement import MAX_NODES, place

    try:
        nodes = int(args.nodes)
    except ValueError:
        raise UsageError(f"--nodes: cannot read {quoted(args.nodes)} as a number of nodes (1 to {MAX_NODES})") from None
    capacity = parse_size(args.local_capacity, "--local-capacity") if args.local_capacity is not None else None
    index = Index.load(args.dest)
    placement = place(index, nodes)
    lines, fits = _describe_plan(args.dest, len(index.chunks), placement, capacity)
    print("\n".join(lines))
    return 0 if fits else EXIT_DOES_NOT_FIT


def _describe_plan(dest: str, chunk_count: int, placement: Placement, capacity: int | None) -> tuple[list[str], bool]:
    """`fanstore plan`'s report, and whether the fullest node's share fits in `capacity` (True when not given)."""
    nodes = placement.nodes
    spread = [placement.spread_bytes(rank) for rank in range(nodes)]
    total = [placement.stored_bytes(rank) for rank in range(nodes)]
    split = set(placement.split_chunks)
    split_pieces = sum(piece.chunk in split for rank in range(nodes) for piece in placement.pieces(rank))
    replicated = len(placement.replicated_chunks)
    empty = sum(share == 0 for share in spread)
    lines = [
        f"dataset      {dest}",
        f"nodes        {nodes:,}",
        f"chunks       {chunk_count:,}: {chunk_count - replicated:,} spread, {replicated:,} replicated; "
        f"{len(split):,} split between nodes ({plural(split_pieces, 'piece')})",
        f"spread       per node {_spread_of(spread)}"
        + (f"; {plural(empty, 'node stores', 'nodes store')} none" if empty else ""),
        f"replicated   {format_bytes(placement.replicated_bytes)} on every node",
        f"total        per node {_spread_of(total)}",
    ]
    fullest = max(total)
    fits = capacity is None or fullest <= capacity
    if capacity is None:
        lines.append("capacity     not checked (--local-capacity SIZE checks it)")
    elif fits:
        lines.append(f"capacity     fits: the fullest node stores {format_bytes(fullest)} of "
                     f"{format_bytes(capacity)} ({fullest / capacity:.0%})")
    else:
        over = sum(share > capacity for share in total)
        lines.append(f"capacity     does not fit: the fullest node stores {format_bytes(fullest)}, "
                     f"{format_bytes(fullest - capacity)} over {format_bytes(capacity)} ({over:,} of "
                     f"{plural(nodes, 'node')} over)")
    lines.append(f"staging      {format_bytes(placement.staging_read_bytes())} read from DEST (each stored byte once; "
                 f"a replicated chunk by one node, which sends it on)")
    return lines, fits


def _spread_of(shares: list[int]) -> str:
    """Max, mean and min of per-node byte counts, and max/mean: how far the fullest node is from an even share."""
    mean = sum(shares) / len(shares)
    ratio = f"{max(shares) / mean:.3f}" if mean else "-"
    return (f"max {format_bytes(max(shares))}, mean {format_bytes(mean)}, min {format_bytes(min(shares))}, "
            f"max/mean {ratio}")


def _run_demo(args: argparse.Namespace) -> int:
    from .demo.demo import run_demo

    if args.scale < 1:
        raise UsageError(f"--scale: must be 1 or more, got {args.scale}")
    return run_demo(workdir=args.workdir, scale=args.scale, mount=not args.no_mount)


def _run_mount(args: argparse.Namespace) -> int:
    import logging

    from .core.dest_apart import check_apart_from_dest
    from .mount.mount import MountOptions, check_outside, dataset_paths, default_log_path, mount_background, \
        mount_foreground, resolve_mountpoint

    options = MountOptions(
        cache_size=parse_size(args.cache_size, "--cache-size") if args.cache_size else None,
        prefetch=args.prefetch,
        prefetch_list=Path(args.prefetch_list) if args.prefetch_list else None,
        prefetch_min_size=parse_size(args.prefetch_min_size, "--prefetch-min-size", minimum=0)
        if args.prefetch_min_size is not None else None,
        allow_other=args.allow_other,
        keep_cache=not args.no_keep_cache,
        kernel_timeout=args.kernel_timeout,
    )
    # Resolved once, here: mountinfo lists resolved paths, and the check, the mount and the messages must agree.
    mountpoint = resolve_mountpoint(Path(args.mountpoint))
    if args.foreground:
        check_outside(mountpoint, dataset_paths(Path(args.dest)))
        logging.basicConfig(level=logging.INFO, format="%(asctime)s fanstore: %(message)s", stream=sys.stderr)
        return mount_foreground(Path(args.dest), mountpoint, options, ready_fd=args.ready_fd)
    private_log = args.log is None
    log_path = default_log_path(mountpoint) if private_log else Path(args.log)
    check_outside(mountpoint, {**dataset_paths(Path(args.dest)), "--log": log_path})
    log_name = "the default log (--log puts it elsewhere)" if private_log else "--log"
    check_apart_from_dest(Path(args.dest), {log_name: log_path})
    pid = mount_background(Path(args.dest), mountpoint, args.argv, log_path, private_log=private_log)
    print(f"mounted {args.dest} at {args.mountpoint} (daemon pid {pid}, log {log_path}); "
          f"`fanstore umount {args.mountpoint}` to unmount")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import logging

    from .mount.mount import MountOptions
    from .serve.node import ServeOptions, run
    from .serve.transport import PeerOptions

    # The options' values are checked where they are defined (PeerOptions, MountOptions), in this order.
    peer = PeerOptions(timeout=args.peer_timeout, retry_after=args.peer_retry, max_in_flight=args.max_in_flight,
                       lost_after=args.peer_lost_after)
    mount = MountOptions(
        cache_size=parse_size(args.cache_size, "--cache-size") if args.cache_size else None,
        prefetch=args.prefetch,
        prefetch_list=Path(args.prefetch_list) if args.prefetch_list else None,
        prefetch_threads=args.prefetch_threads,
        allow_other=args.allow_other,
    )
    if args.prefetch_threads < 1:  # serve's own rule: its default is a number of threads, not 0 (one per core)
        raise UsageError(f"--prefetch-threads: must be 1 or more threads, got {args.prefetch_threads}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fanstore: %(message)s", stream=sys.stderr)
    options = ServeOptions(
        dest=Path(args.dest), mountpoint=args.mountpoint, local_dir=args.local_dir, command=tuple(args.job_command),
        stats=args.stats, ready_file=args.ready_file,
        peer=peer, mount=mount, progress=not args.quiet, doorbell=not args.no_doorbell, loop_requests=not args.mpi_thread_only)
    return run(options)


def _run_umount(args: argparse.Namespace) -> int:
    from .mount.mount import resolve_mountpoint, unmount

    unmount(resolve_mountpoint(Path(args.mountpoint)))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fanstore", **_command_help(
        "Compressed, read-only training datasets: pack a directory tree once, then read any file of it fast, "
        "through a mount, the Python API (fanstore.open_dataset) or, across the nodes of a job, `fanstore serve`. "
        "`fanstore COMMAND --help` says more of each command. Sizes are printed in SI units (kB, MB, GB: powers of "
        "1000), as speeds are in MB/s; a SIZE option takes either kind: 64MB, or 64MiB for powers of 1024.",
        [(0, "the command did what it was asked"), _ERROR, _USAGE,
         ("other", "each command's --help lists its own")],
        "fanstore demo"))
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pack_parser = commands.add_parser("pack", help="pack a directory tree into a dataset (as fanstore-pack)",
                                      **_pack_help("fanstore pack"))
    _add_pack_arguments(pack_parser)
    pack_parser.set_defaults(run=_run_pack)
    select_parser = commands.add_parser(
        "select", help="measure codecs on a sample of SRC and choose per file kind", **_command_help(
            "Measure every codec setting on a sample of SRC, on this machine, and choose one per file kind (JPEG, "
            "PNG, .npy arrays, text, ...): the one that stores least while decoding at least --budget (each of K "
            "--prefetch-threads needs only budget/K), or, with --fit SIZE, the ones that decode fastest while the "
            "whole dataset fits in SIZE. Prints every candidate with the choice marked, then the predicted stored "
            "size and pack time; nothing is written but --plot's file. `fanstore-pack --codec auto` with the same "
            "options chooses the same way, and packs with its choice.",
            [(0, "chosen, and printed"), (EXIT_FAILURE, "an error, said in one line on stderr (SRC unreadable, a bad "
                                                        "option, neither --budget nor --fit given)"),
             _USAGE, (EXIT_DOES_NOT_FIT, "--fit cannot be met, not even with the strongest settings"), _INTERRUPTED],
            "fanstore select /data/imagenet --budget 800MB/s --prefetch-threads 4 --replicate 'val/**'"))
    select_parser.add_argument("src", metavar="SRC",
                               help="the directory tree to pack (it is only read), or an archive or a glob of them")
    _add_selection_arguments(select_parser, auto_only=False)
    select_parser.add_argument("--replicate", action="append", default=[], metavar="GLOB",
                               help="as for fanstore-pack: the sample is stratified by group too (and with --nodes, "
                                    "these files are on every node)")
    select_parser.add_argument("--workers", type=int, default=0, metavar="N",
                               help="compression processes the pack will use, for its estimated time (default: every "
                                    "core)")
    select_parser.add_argument("--plot", metavar="FILE.png",
                               help="draw ratio against decode throughput, and stored size against pack time")
    select_parser.set_defaults(run=_run_select)
    verify_parser = commands.add_parser(
        "verify", help="check and decode every file; list the bad ones", **_command_help(
            "Check the dataset DEST whole: every chunk file's header and size, and every file's stored bytes "
            "against the index's checksum, decoded to the size the index records. Lists each bad chunk file and "
            "each bad file (only the files of a bad chunk are lost), then a count. Run it on a dataset copied or "
            "staged by other means, or when reads fail.",
            [(0, "every file and every chunk file is good"),
             (EXIT_FAILURE, "a bad file or chunk file was found (listed on stdout), or DEST cannot be opened (said "
                            "in one line on stderr)"),
             _USAGE, _INTERRUPTED],
            "fanstore verify /scratch/imagenet.fanstore"))
    verify_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    verify_parser.set_defaults(run=_run_verify)
    info_parser = commands.add_parser(
        "info", help="version, groups, codecs, counts, sizes and ratio", **_command_help(
            "Describe the dataset DEST from its index: format version; counts of files, directories and symlinks; "
            "raw and stored bytes and the ratio; chunks; chunk files missing or not as indexed (their headers and "
            "sizes only: `fanstore verify` reads every file); the groups (spread or replicated) and codecs, with "
            "files and bytes for each; the options it was packed with and the paths the pack skipped; with "
            "--codec auto, what the selector chose and predicted.",
            [(0, "described (damaged chunk files, if any, are listed)"),
             (EXIT_FAILURE, "DEST cannot be opened: no dataset there, or an index this version cannot read (said "
                            "in one line on stderr)"),
             _USAGE],
            "fanstore info /scratch/imagenet.fanstore --all-skipped"))
    info_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    info_parser.add_argument("--all-skipped", action="store_true",
                             help="list every path the pack skipped (by default the first 50, and how many more)")
    info_parser.set_defaults(run=_run_info)
    plan_parser = commands.add_parser(
        "plan", help="what each node of an N-node job stores, and whether it fits its local storage",
        **_command_help(
            "Print, from the index alone, how an N-node job (`fanstore serve`) places the dataset: bytes stored per "
            "node, replicated bytes, chunks split between nodes, bytes read from DEST to stage the job; with "
            "--local-capacity, whether the fullest node's share fits.",
            [(0, "every node's share fits in --local-capacity (or none is given)"),
             _ERROR, _USAGE, (EXIT_DOES_NOT_FIT, "the fullest node's share does not fit in --local-capacity")],
            "fanstore plan /scratch/imagenet.fanstore --nodes 64 --local-capacity 1.5TiB"))
    plan_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its index is all that is read)")
    plan_parser.add_argument("--nodes", required=True, metavar="N", help="nodes in the job, 1 to 4096")
    plan_parser.add_argument("--local-capacity", metavar="SIZE",
                             help="local storage each node has for the dataset, e.g. 1.5TiB")
    plan_parser.set_defaults(run=_run_plan)
    mount_parser = commands.add_parser(
        "mount", help="show the dataset as a read-only directory (FUSE)", **_command_help(
            "Show the dataset DEST at MOUNTPOINT as an ordinary read-only directory (FUSE), each file decoded when "
            "read, with a bounded cache of decoded files and prefetch. A daemon serves the mount in the "
            "background, logging to --log, and the command returns once the mount answers; `fanstore umount "
            "MOUNTPOINT` (or SIGTERM to the daemon) ends it. --foreground serves in this process instead, until "
            "unmounted, SIGTERM or Ctrl-C.",
            [(0, "mounted (with --foreground: served, then unmounted)"),
             (EXIT_FAILURE, "an error, said in one line on stderr: DEST is no dataset, MOUNTPOINT is missing or in "
                            "use or inside the dataset, FUSE is unavailable, the daemon could not start"),
             _USAGE, (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM) before the mount answered")],
            "fanstore mount /scratch/imagenet.fanstore /tmp/imagenet --cache-size 4GiB"))
    mount_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    mount_parser.add_argument("mountpoint", metavar="MOUNTPOINT",
                              help="an existing directory, outside the dataset, where its files appear")
    mount_parser.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    mount_parser.add_argument("--cache-size", metavar="SIZE",
                              help="memory for decoded files, e.g. 4GiB (default: a quarter of what the job may "
                                   "still use: available RAM, or less where its memory cgroup's limit leaves less)")
    mount_parser.add_argument("--prefetch", type=int, default=8, metavar="N",
                              help="after each file opened, decode ahead those of the next N files (in "
                                   "--prefetch-list order, else directory order) stored in at least "
                                   "--prefetch-min-size bytes (default 8; 0: off)")
    mount_parser.add_argument("--prefetch-min-size", metavar="SIZE",
                              help="prefetch only files stored in at least SIZE bytes (default 256KiB: smaller ones "
                                   "decode on request faster than a thread is handed them)")
    mount_parser.add_argument("--prefetch-list", metavar="FILE",
                              help="epoch order to prefetch in: one path a line, in the dataset or through MOUNTPOINT")
    mount_parser.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    mount_parser.add_argument("--log", metavar="FILE",
                              help="daemon log (default: mount-PATH-DIGEST.log, named after MOUNTPOINT's whole "
                                   "path, in $XDG_RUNTIME_DIR/fanstore or, without it, ~/.cache/fanstore)")
    mount_parser.add_argument("--no-keep-cache", action="store_true",
                              help="drop the kernel page cache on every open (for benchmarks)")
    mount_parser.add_argument("--kernel-timeout", type=float, metavar="SECONDS",
                              help="entry and attribute timeout (default one day; for benchmarks)")
    mount_parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount_parser.set_defaults(run=_run_mount)
    umount_parser = commands.add_parser(
        "umount", help="unmount a fanstore mount (live or stale)", **_command_help(
            "Unmount the fanstore mount at MOUNTPOINT, live or stale (one whose daemon was killed), lazily "
            "(fusermount3 -u -z, or umount -l where there is no fusermount): files open through it stay readable "
            "until closed, and the daemon then exits by itself.",
            [(0, "unmounted"),
             (EXIT_FAILURE, "an error, said in one line on stderr: nothing is mounted at MOUNTPOINT, it does not "
                            "exist, or the unmount failed"),
             _USAGE],
            "fanstore umount /tmp/imagenet"))
    umount_parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="where `fanstore mount` mounted the dataset")
    umount_parser.set_defaults(run=_run_umount)
    demo_parser = commands.add_parser(
        "demo", help="build, pack, mount and read back a small training dataset; train on it through the mount",
        **_command_help(
            "Build a small training set (digit PNGs and photo crops from scikit-learn, float32 fields, labels), "
            "pack it and read every file back through the Python API; then, where FUSE is there, through a mount "
            "(two timed epochs, and a small model trained on it as on the original directory); with torch, train a "
            "small CNN from the original, through fanstore.torch and through the mount; with mpi4py and mpiexec, "
            "serve it on two ranks of this machine. Every reader must give back the original bytes; a table "
            "compares their speeds with the plain directory's. A part whose requirement is missing is skipped, "
            "saying why.",
            [(0, "every file read back equals its original"),
             (EXIT_FAILURE, "a file read back differs or is missing (listed), or an error said in one line on "
                            "stderr"),
             _USAGE, _INTERRUPTED],
            "fanstore demo --workdir /tmp/fanstore-demo"))
    demo_parser.add_argument("--workdir", metavar="DIR",
                             help="keep the demo's files here: its source tree, the dataset, the mount's log "
                                  "(default: a temporary directory, removed at the end)")
    demo_parser.add_argument("--scale", type=int, default=1, metavar="N",
                             help="N times as many photo crops and float32 fields (the 1,797 digits stay as "
                                  "they are; default 1)")
    demo_parser.add_argument("--no-mount", action="store_true",
                             help="read through the Python API only: no mount, no serve")
    demo_parser.set_defaults(run=_run_demo)
    _add_serve_parser(commands)
    return parser


def _add_serve_parser(commands: Any) -> None:
    serve_parser = commands.add_parser(
        "serve", help="under mpiexec or srun (one rank per node): stage, mount everywhere, run -- COMMAND",
        usage="mpiexec -n N fanstore serve DEST MOUNTPOINT --local-dir DIR [options] [-- COMMAND ...]",
        **_command_help(
            "Spread DEST's chunks over the job's nodes (replicated groups on every node), stage each node's share "
            "into --local-dir, and mount the whole dataset at MOUNTPOINT on every node; files stored on another "
            "node come from it over MPI. With -- COMMAND, run COMMAND on every rank once all are mounted "
            "(FANSTORE_MOUNT, FANSTORE_RANK, FANSTORE_SIZE in its environment), then unmount and exit with the "
            "worst status; without, write MOUNTPOINT.ready once all are mounted and serve until SIGTERM. {rank} in "
            "MOUNTPOINT, --local-dir and --ready-file gives each rank its own path (several ranks on one host).",
            [(0, "every rank's COMMAND exited 0; without COMMAND, the job served until SIGTERM and unmounted"),
             (EXIT_FAILURE, "a rank could not start, stage or mount (each rank stops, and says why in one line), "
                            "or a rank was lost"),
             _USAGE,
             ("N", "the highest status of any rank's COMMAND: 128+S for one killed by signal S, 127 for one that "
                   "could not be run"),
             (128 + signal.SIGTERM, "SIGTERM before every rank was mounted")],
            "srun --ntasks-per-node=1 fanstore serve /lustre/imagenet.fanstore /tmp/imagenet --local-dir "
            "$TMPDIR/fs -- python train.py --data /tmp/imagenet/train"))
    serve_parser.add_argument("dest", metavar="DEST", help="the packed dataset, on the shared file system")
    serve_parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory on each node")
    serve_parser.add_argument("--local-dir", required=True, metavar="DIR",
                              help="node-local storage for this node's chunks (e.g. $TMPDIR or /dev/shm/...); "
                                   "chunks verified there by an earlier job are not staged again")
    serve_parser.add_argument("--stats", action="store_true",
                              help="print each rank's counters at the end, and the job's totals on rank 0")
    serve_parser.add_argument("--ready-file", metavar="FILE",
                              help="without COMMAND: written once every rank is mounted (default MOUNTPOINT.ready)")
    serve_parser.add_argument("--peer-timeout", type=float, default=5.0, metavar="SECONDS",
                              help="a peer that does not answer a request in this time is skipped for a while and "
                                   "its files read from DEST (default 5)")
    serve_parser.add_argument("--peer-retry", type=float, default=30.0, metavar="SECONDS",
                              help="how long a peer that missed a deadline is skipped (default 30)")
    serve_parser.add_argument("--peer-lost-after", type=float, default=0.0, metavar="SECONDS",
                              help="how long a peer may answer nothing before it is lost for the job: not asked "
                                   "again, its files read from DEST, and the job ends without the closing "
                                   "agreement; default 0: half of the time TCP keeps a connection waiting "
                                   "(net.ipv4.tcp_retries2; about 460 s), after which a message to that peer "
                                   "crashes MPICH; set it below your fabric's own give-up time on other networks")
    serve_parser.add_argument("--max-in-flight", type=int, default=8, metavar="K",
                              help="requests outstanding to one peer at a time, whoever asked them (default 8)")
    serve_parser.add_argument("--no-doorbell", action="store_true",
                              help="peers do not ring each other awake with a UDP datagram (for networks that drop "
                                   "UDP between nodes; fanstore turns them off itself when a start-up check fails): "
                                   "each rank then polls MPI alone, lingering after work")
    serve_parser.add_argument("--mpi-thread-only", action="store_true",
                              help="only the MPI thread calls MPI (initialised at MPI_THREAD_SERIALIZED): readers "
                                   "hand it every request to a peer instead of posting it themselves (for an MPI "
                                   "whose MPI_THREAD_MULTIPLE is slow or broken)")
    serve_parser.add_argument("--prefetch-list", metavar="FILE",
                              help="the epoch's reading order, one path a line (in the dataset or through the rank's "
                                   "MOUNTPOINT): files are fetched and decoded ahead ({rank} is replaced by the "
                                   "rank: each its own order)")
    serve_parser.add_argument("--prefetch", type=int, default=SERVE_PREFETCH, metavar="N",
                              help="after each file opened, fetch and decode ahead those of the next N files that "
                                   f"are stored on another node or in at least 256KiB (default {SERVE_PREFETCH}; 0 "
                                   "turns it off)")
    serve_parser.add_argument("--prefetch-threads", type=int, default=8, metavar="K",
                              help="threads fetching and decoding ahead (default 8)")
    serve_parser.add_argument("--cache-size", metavar="SIZE",
                              help="decoded cache of each mount (default: a quarter of what the job may still use "
                                   "once staged, available RAM or its memory cgroup's room, split among the ranks "
                                   "on one host)")
    serve_parser.add_argument("--allow-other", action="store_true", help="let other users read the mounts")
    serve_parser.add_argument("--quiet", action="store_true", help="no staging progress bar")
    serve_parser.set_defaults(run=_run_serve, job_command=[])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_command: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # everything after `--` is the job's command, options and all
        split = argv.index("--")
        argv, job_command = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    if job_command:
        args.job_command = job_command
    args.argv = argv  # a background mount re-runs itself with the same arguments
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return args.run(args)
    except DoesNotFit as exc:
        say_line(f"{prog}: error: {exc}")
        return EXIT_DOES_NOT_FIT
    except FanstoreError as exc:
        say_line(f"{prog}: error: {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        resumable = args.run is _run_pack
        print(f"{prog}: interrupted" + ("; run the same command again to resume" if resumable else ""),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe (a child's, a socket's) closed under us: say so, it is a fault
            say_line(f"{prog}: error: {exc.strerror or 'Broken pipe'}: a pipe or socket it wrote to was closed "
                     f"by its other end")
            return EXIT_FAILURE
        # The reader of our output went away (`fanstore select SRC | head`): not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


def _stdout_closed() -> bool:
    """Whether the reader of stdout has gone (a pipe's read end closed: poll says POLLERR), or stdout is no file."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


def main(argv: Sequence[str] | None = None) -> int:
    return _run("fanstore", _build_parser(), argv)


def pack_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fanstore-pack", **_pack_help("fanstore-pack"))
    parser.add_argument("--version", action=_VersionAction)
    _add_pack_arguments(parser)
    parser.set_defaults(run=_run_pack)
    return _run("fanstore-pack", parser, argv)


if __name__ == "__main__":
    sys.exit(main())
