"""What each command of the command line does, once cli.py has parsed it: pack, select, verify, info, plan,
mount, umount, demo, serve. Each takes the parsed arguments and returns the exit status; every expected failure is
a FanstoreError, which cli.py turns into one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import EXIT_DOES_NOT_FIT, EXIT_FAILURE, UsageError, one_line, quoted, say_line, shell_word, \
    shown_path
from .core.units import format_bytes, parse_size, plural

if TYPE_CHECKING:
    from selector import Selection

    from .pack.options import PackOptions
    from .pack.packer import PackSummary
    from .pack.walk import Problem
    from .serve.placement import Placement

_WARNINGS_SHOWN = 20


def _selection_options(args: argparse.Namespace) -> dict[str, Any]:
    from .core.options import flag_of, given, value_of
    from .pack.options import AUTO_CODEC, PackOptions

    if getattr(args, "codec", AUTO_CODEC) != AUTO_CODEC:
        for name in ("budget", "prefetch_threads", "fit", "nodes", "tolerance", "pack_speed", "sample", "seed"):
            if name == "nodes" and args.nodes is not None:
                raise UsageError("--nodes only applies with --codec auto")
            if name != "nodes" and given(PackOptions, args, name):
                raise UsageError(f"{flag_of(PackOptions, name)} only applies with --codec auto")
        return {}
    if args.budget is None and args.fit is None:
        needs = "--codec auto needs" if hasattr(args, "codec") else "fanstore select needs"
        raise UsageError(f"{needs} --budget, the decode throughput the training job needs (e.g. 800MB/s), or --fit, "
                         "the capacity the dataset must fit in (e.g. 500GB), or both")
    if args.prefetch_threads < 0:
        raise UsageError(f"--prefetch-threads: must be 0 or more, got {args.prefetch_threads}")
    fit = value_of(PackOptions, args, "fit")
    nodes = 0
    if args.nodes is not None:
        if not fit:
            raise UsageError("--nodes only applies with --fit (the capacity each node has for the dataset)")
        nodes = _parse_nodes(args.nodes)
    read = {name: value_of(PackOptions, args, name) for name in ("budget", "sample", "tolerance", "pack_speed")}
    return {**read, "prefetch_threads": args.prefetch_threads, "seed": args.seed, "fit": fit, "nodes": nodes}


def _parse_nodes(text: str) -> int:
    from .serve.placement import MAX_NODES

    try:
        nodes = int(text)
    except ValueError:
        raise UsageError(f"--nodes: cannot read {quoted(text)} as a number of nodes (1 to {MAX_NODES})") from None
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes: must be a whole number from 1 to {MAX_NODES}, got {nodes}")
    return nodes


def run_pack(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .core.options import from_args
    from .core.allocator import map_large_blocks_apart
    from .pack.options import PackOptions
    from .pack.packer import pack
    from .pack.progress import PackProgress

    map_large_blocks_apart()  # this process runs one pack: its freed arrays go back, not into the heap's keep
    options = from_args(PackOptions, args)  # the sizes are read, and the values checked, before --codec auto's
    options = replace(options, **_selection_options(args))
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
        say_line(f"warning: skipped {problem}")
    if len(summary.problems) > _WARNINGS_SHOWN:
        from .core.info import all_skipped_command

        say_line(f"warning: ... and {len(summary.problems) - _WARNINGS_SHOWN} more skipped "
                 f"({all_skipped_command(args.dest)} lists them all)")
    if summary.repacked is not None:
        say_line(f"warning: {summary.repacked}")
    for pattern in summary.unmatched:
        say_line(f"warning: --replicate {quoted(pattern)} matches no file of SRC: it replicates nothing")
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
    print(one_line(f"nothing to do: {args.dest} already holds this pack of {' '.join(args.src)}, the same files with "
                   f"the same options ({plural(summary.files, 'file')}, {format_bytes(summary.raw_bytes)} raw, "
                   f"{format_bytes(summary.stored_bytes)} stored{skipped}); --force packs it again"))
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
        where = f"the fullest of {plural(nodes, 'node')} stores"
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
        say_line(f"warning: codec {problem}; left out of the selection")


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


def run_select(args: argparse.Namespace) -> int:
    from selector import SelectionError
    from selector.report import check_plot_path, format_selection, plot_selection

    from .pack.groups import GroupPlan
    from .pack.auto_codec import make_goal, select_for
    from .pack.walk_archive import walk_sources
    from .pack.walk_archive import source_paths

    groups = GroupPlan(tuple(args.replicate or ()))  # validates the patterns before the long part
    options = _selection_options(args)
    goal = make_goal(options["fit"], options["nodes"], options["tolerance"], options["pack_speed"], args.workers)
    if args.plot:  # checked before the measuring, which takes a minute on a large sample
        folder = Path(args.plot).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UsageError(f"--plot {quoted(args.plot)}: {quoted(str(folder))} is not a directory this process "
                             "can write in")
        try:
            check_plot_path(Path(args.plot))
        except SelectionError as exc:
            raise UsageError(str(exc)) from None
    sources = source_paths(args.src)
    tree = walk_sources(sources)
    selection = select_for(sources[0], tree, groups, options["budget"],
                           options["prefetch_threads"], options["sample"], options["seed"], goal)
    _warn_left_out(tree.problems, groups.unmatched())
    _warn_failed_codecs(selection)
    print(format_selection(selection))
    if args.plot:
        try:
            plot_selection(selection, Path(args.plot))
        except SelectionError as exc:
            raise UsageError(str(exc)) from None
        print(one_line(f"plot written to {args.plot}"))
    return 0


def _warn_left_out(problems: Sequence[Problem], unmatched: list[str]) -> None:
    """What `fanstore select` measured without, said as fanstore-pack says it: the paths a pack would skip (a damaged
    archive, a fifo, a link out of SRC), and --replicate patterns that match nothing. Without them a damaged archive
    selected from nothing and said only that SRC has no non-empty files."""
    for problem in problems[:_WARNINGS_SHOWN]:
        say_line(f"warning: left out (fanstore-pack skips it too): {problem}")
    if len(problems) > _WARNINGS_SHOWN:
        say_line(f"warning: ... and {len(problems) - _WARNINGS_SHOWN} more left out")
    for pattern in unmatched:
        say_line(f"warning: --replicate {quoted(pattern)} matches no file of SRC: it replicates nothing")


def run_verify(args: argparse.Namespace) -> int:
    from .core.api import open_dataset
    from .core.verify import verify_dataset

    with open_dataset(args.dest) as ds:
        report = verify_dataset(ds)
    # One line an item, as a script counts them: a problem names DEST, whose name may hold a newline.
    for chunk, problem in sorted(report.bad_chunks.items()):
        print(one_line(f"BAD CHUNK {chunk}: {problem}"))
    for bad in report.bad:
        print(one_line(f"BAD {bad}"))
    for path in report.unfindable:
        print(f"BAD PATH {quoted(path)}: the index lists it, but its hash table does not find it (a damaged index)")
    chunks = f", {plural(len(report.bad_chunks), 'bad chunk file')}" if report.bad_chunks else ""
    paths = f", {plural(len(report.unfindable), 'path')} not found by lookup" if report.unfindable else ""
    print(f"checked {plural(report.files_checked, 'file')} ({format_bytes(report.raw_bytes)}): "
          f"{len(report.bad):,} bad{chunks}{paths}")
    return 0 if report.ok else EXIT_FAILURE


def run_info(args: argparse.Namespace) -> int:
    from .core.api import open_dataset
    from .core.info import describe_dataset

    with open_dataset(args.dest) as ds:
        print(describe_dataset(ds, all_skipped=args.all_skipped))
    return 0


def run_plan(args: argparse.Namespace) -> int:
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
        f"dataset      {shown_path(dest)}",
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


def run_demo(args: argparse.Namespace) -> int:
    from .demo.demo import run_demo

    if args.scale < 1:
        raise UsageError(f"--scale: must be 1 or more, got {args.scale}")
    return run_demo(workdir=args.workdir, scale=args.scale, mount=not args.no_mount)


def run_mount(args: argparse.Namespace) -> int:
    import logging

    from .core.dest_apart import check_apart_from_dest
    from .core.options import from_args
    from .mount.mount import check_daemon_can_read, check_outside, dataset_paths, default_log_path, \
        mount_background, mount_foreground, open_daemon_log, resolve_mountpoint
    from .mount.options import MountOptions

    options = from_args(MountOptions, args)
    # Resolved once, here: mountinfo lists resolved paths, and the check, the mount and the messages must agree.
    mountpoint = resolve_mountpoint(Path(args.mountpoint))
    log_format = "%(asctime)s fanstore: %(message)s"
    # A background mount's daemon is this command re-run with --foreground and --ready-fd, its stderr the log
    # already; a user's --foreground logs to stderr, or to --log where one is given.
    if args.foreground and (args.log is None or args.ready_fd is not None):
        check_outside(mountpoint, dataset_paths(Path(args.dest)))
        logging.basicConfig(level=logging.INFO, format=log_format, stream=sys.stderr)
        return mount_foreground(Path(args.dest), mountpoint, options, ready_fd=args.ready_fd)
    private_log = args.log is None
    log_path = default_log_path(mountpoint) if private_log else Path(args.log)
    check_outside(mountpoint, {**dataset_paths(Path(args.dest)), "--log": log_path})
    log_name = "the default log (--log puts it elsewhere)" if private_log else "--log"
    check_apart_from_dest(Path(args.dest), {log_name: log_path})
    if args.foreground:
        log = os.fdopen(open_daemon_log(log_path), "a", buffering=1)
        logging.basicConfig(level=logging.INFO, format=log_format, stream=log)
        return mount_foreground(Path(args.dest), mountpoint, options)
    check_daemon_can_read(options.prefetch_list)
    pid = mount_background(Path(args.dest), mountpoint, args.argv, log_path, private_log=private_log)
    print(one_line(f"mounted {args.dest} at {args.mountpoint} (daemon pid {pid}, log {log_path}); "
                   f"`fanstore umount {shell_word(args.mountpoint)}` to unmount"))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from .core.options import from_args
    from .serve.node import run
    from .serve.options import SERVE_MOUNT, PeerOptions, ServeOptions

    # Each options class checks its values (PeerOptions, the mount's, then serve's own rule), in this order.
    peer, mount = from_args(PeerOptions, args), from_args(SERVE_MOUNT, args)
    options = from_args(ServeOptions, args, dest=Path(args.dest), mountpoint=args.mountpoint,
                        command=tuple(args.job_command), peer=peer, mount=mount)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fanstore: %(message)s", stream=sys.stderr)
    return run(options)


def run_umount(args: argparse.Namespace) -> int:
    from .mount.mount import resolve_mountpoint, unmount

    unmount(resolve_mountpoint(Path(args.mountpoint)))
    return 0
