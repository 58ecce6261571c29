"""Pack: walk SRC -> plan groups and codecs -> compress in workers -> chunk files -> index (written last).

Interrupt it at any moment and run it again with the same arguments: finished chunks are kept (the journal says
which), the rest is redone, and the result is byte-identical to an uninterrupted pack. Run it again once finished,
SRC unchanged: there is nothing to do, and DEST is left as it is. A --fit pack that can no longer fit while packing
(fit_watch.py) stops there and removes what it wrote, as if refused (dest.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import xxhash

from compressors import CodecError, codec_from_spec
from compressors.kinds import OTHER

from .chunk_builder import ChunkBuilder
from .codec_plan import ANY_KIND, CodecPlan, build_codec_plan
from .archive_feed import ArchiveFeed
from .archive_pieces import ArchivePieces
from .compress import BlockLayout, PlanFiles, Skipped, WorkerPool, compress_in_order
from .dest import (
    check_dest,
    check_src_and_dest,
    dest_as_found,
    discard_unrecorded_chunks,
    files_of_ours,
    prepare_dest,
    undo_pack,
)
from ..errors import DoesNotFit, PackError, UsageError
from .fit_watch import FitWatch
from .options import AUTO_CODEC, DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_ABOVE, DEFAULT_CHUNK_SIZE, DEFAULT_CODEC, \
    DEFAULT_TOLERANCE, PackOptions  # noqa: F401 (the defaults: their old home)
from ..core.format import (BLOCK_DTYPE, CHUNK_DTYPE, CHUNK_HEADER_LEN, FLAG_BLOCKED, INDEX_HEADER_LEN, MAX_BLOCK_SIZE,
                     MIN_BLOCK_SIZE, NO_CHUNK)
from .groups import GroupPlan
from ..core.index import Index, IndexLayout, write_packed_index
from .journal import BlockRow, ChunkRecord, JournalState, PackJournal
from ..core.pause import pause_point
from .walk import Problem, SourceEntry, SourceTree, walk_source
from .walk_archive import source_paths, walk_archives

if TYPE_CHECKING:
    from selector import Goal, Selection

# The index takes this much per entry besides its path: its 64-byte record, 8-byte path hash, 4-byte place in the
# lookup order and (1.2) 4-byte first_child row; and per regular file its 4-byte place in file_order (1.2); beyond
# them only its table of contents and dictionaries (on the generated bench tree, 114,204 entries, 12.8 MB). A total
# --fit counts it; a pack watching its --fit counts it as the least the index takes.
INDEX_BYTES_PER_ENTRY = 80
INDEX_BYTES_PER_FILE = 4
# The rest of an index's table of contents, the selection record aside: format and version, one line a section, the
# codec table (a line a codec), the pack's counters and the sections' alignment: 1.2 KB with the options, groups
# and problems counted apart on the held-out bench tree; a few times that, so that a --fit planned with it is not
# short (a test holds the bound within 8 KiB of what a pack writes).
TOC_ALLOWANCE = 4096
PROGRESS_INTERVAL = 0.1  # seconds between progress callbacks: once per file costs more than packing a small file


@dataclass(slots=True)
class PackSummary:
    files: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    reused_chunks: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    selection: Selection | None = None  # with --codec auto: what was chosen, and what it predicted
    selection_seconds: float = 0.0  # spent selecting in this run (0 when a resumed pack reused the journaled one)
    up_to_date: bool = False  # DEST held this very pack, finished: nothing was done, the figures are its index's

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def mb_per_s(self) -> float:
        """Raw MB packed a second: the codec selection's seconds are not counted, as it packs nothing."""
        packing = self.seconds - self.selection_seconds
        return self.raw_bytes / 1e6 / packing if packing > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PackProgress:
    """How far a pack has got, handed to the progress callback every PROGRESS_INTERVAL and at the end."""

    files_done: int
    files_total: int
    raw_done: int
    raw_total: int
    stored_done: int


def pack(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    options: PackOptions = PackOptions(),
    tree: SourceTree | None = None,
    progress: Callable[[PackProgress], None] | None = None,
    on_selection: Callable[[Selection], None] | None = None,
) -> PackSummary:
    """Pack SRC into the dataset directory DEST. SRC is a directory, or one or more archives (paths or globs, see
    walk_archive.source_paths). `tree` is a walk of SRC the caller already made. With --codec auto,
    `on_selection` is given the selection before compressing starts (its predictions, for the person who waits).
    DoesNotFit when --fit cannot be met: refused before DEST is written, or, once the chunk files written can no
    longer fit, stopped with what this run wrote removed."""
    started = time.monotonic()
    _check_options(options)
    sources = source_paths(src)
    for source in sources:
        check_src_and_dest(source, Path(dest))
    workers = _worker_count(options.workers)
    # Workers hand blobs back through memfd shared memory (Linux); elsewhere this process compresses alone.
    pool = WorkerPool(workers) if workers > 1 and hasattr(os, "memfd_create") else None
    try:
        summary = _pack_with(sources, Path(dest), options, tree, progress, on_selection, pool)
    except BrokenProcessPool:  # from the walk or from compressing: the pool cannot go on
        raise PackError("a worker process died (killed, or out of memory); finished chunks are kept: run the same "
                        "command again to resume") from None
    finally:
        if pool is not None:
            pool.close()
    summary.seconds = time.monotonic() - started
    return summary


def _pack_with(sources: list[Path], dest_path: Path, options: PackOptions, tree: SourceTree | None,
               progress: Callable[[PackProgress], None] | None,
               on_selection: Callable[[Selection], None] | None, pool: WorkerPool | None) -> PackSummary:
    groups = GroupPlan(options.replicate)
    src_path = sources[0]
    if tree is None:
        tree = walk_sources(sources, pool.executor if pool is not None else None)
    if options.strict and tree.problems:
        raise PackError(f"--strict: {tree.problems[0]} ({len(tree.problems)} path(s) cannot be packed)")
    # Files in (group, path) order (archives: (group, stream order)): a chunk holds one group only, and the
    # replicated group comes last. The walk gives them in that order already, so a stable split by group is
    # enough. Each file's group is matched once here; the loop below only looks it up.
    by_group: dict[int, list[SourceEntry]] = {}
    for entry in tree.files_in_read_order():
        by_group.setdefault(groups.group_of(entry.path), []).append(entry)
    in_order = sorted(by_group.items())
    files = [entry for _, members in in_order for entry in members]
    file_groups = [group for group, members in in_order for _ in members]
    del by_group, in_order
    fingerprint, listing_digest = _fingerprint(tree, options), _fingerprint(tree, options, ctimes=False)
    journal = PackJournal(dest_path)
    dest_plan = check_dest(dest_path, journal, fingerprint, listing_digest, options.force)
    if dest_plan.finished:
        return _finished_summary(dest_path)
    selecting = time.monotonic()
    selection = _selection(options, src_path, tree, groups, journal if dest_plan.resume else None)
    selection_seconds = time.monotonic() - selecting
    # The first write to DEST: every refusal (bad options, DEST, the selection, --fit) has been raised above it.
    found = dest_as_found(dest_path)
    prepare_dest(dest_path, journal, fingerprint, listing_digest, options.force, dest_plan)
    kept = files_of_ours(dest_path)  # what a pack stopped by its --fit keeps: all this run wrote goes
    pause_point("walked")
    if selection is not None and on_selection is not None:
        on_selection(selection)
    spec_by_kind = {ANY_KIND: options.codec} if selection is None else _spec_by_kind(selection)
    with _pieces_of(src_path, tree) as pieces:
        plan = build_codec_plan(spec_by_kind, groups, files, file_groups, pieces, journal)
    if not journal.exists():
        journal.start(JournalState(fingerprint, options.output_defining(), plan.rows,
                                   selection.to_json() if selection is not None else None))
    pause_point("planned")
    finished = journal.finished_chunks()
    discard_unrecorded_chunks(dest_path, len(finished))
    builder = ChunkBuilder(dest_path, journal, options.chunk_size, files, file_groups, options.block_layout,
                           finished)
    start_file, start_block = builder.resume_from
    raw_total = sum(f.size for f in files)
    watch = _fit_watch(options, selection, groups, tree, plan, raw_total)
    plan_files = PlanFiles([f.path for f in files], [f.size for f in files], file_groups, [f.ino for f in files],
                           [f.mtime_ns for f in files], [f.ctime_ns for f in files], options.block_layout)
    next_report = 0.0

    file_count = len(files)  # `files` goes before the index is written; the count stays

    def report() -> None:
        if progress is not None:
            progress(PackProgress(builder.files_done + len(builder.skipped), file_count, builder.raw_done,
                                  raw_total, builder.stored_done))

    # Most of the index is known from the walk: it is laid out in a thread while the workers compress. It starts
    # once the first batch is back, so that it does not hold the GIL while the first batches go out.
    background = ThreadPoolExecutor(1, thread_name_prefix="fanstore-index-layout")
    layout: Future[IndexLayout] | None = None
    feed = None
    if tree.archives:
        feed = ArchiveFeed(tree.archives, plan_files.paths, plan_files.inos, plan_files.sizes)
    try:
        for batch in compress_in_order(src_path, plan, plan_files, start_file, start_block, pool, feed):
            if layout is None:
                layout = background.submit(_index_layout, tree)
            if options.strict:
                skipped = next((r for r in batch.results if isinstance(r, Skipped)), None)
                if skipped is not None:
                    raise PackError(f"--strict: {skipped.problem}")
            builder.add_batch(batch)
            if watch is not None:
                watch.check(builder.chunk_bytes(), builder.raw_done)
            if time.monotonic() >= next_report:
                report()
                next_report = time.monotonic() + PROGRESS_INTERVAL
        records = builder.close_all()
        if layout is None:  # nothing was left to compress (a resume after the last chunk)
            layout = background.submit(_index_layout, tree)
        report()
        summary = _summarise(records, tree.problems)
        summary.reused_chunks = len(finished)
        pause_point("index")
        index_bytes = _index_bytes(tree, layout, records, files, plan, groups, options, summary, selection,
                                   listing_digest)
        # What the index holds of each file is in its bytes now: the walk, the plan, the journal's rows and the
        # layout go before the bytes are written and checked, which is a pack's peak of memory (a caller that
        # handed in its `tree` still holds that).
        builder.let_go()
        finished.clear()
        del records, plan_files, layout, files, file_groups, tree
        if feed is not None:
            feed.close()
            feed = None
        write_packed_index(dest_path, index_bytes)  # and stamps it, checked, for this node's first open
        del index_bytes
        background.shutdown(wait=True)  # its thread is idle by now: pack() leaves no thread behind
    except OSError as exc:
        builder.abort()
        raise _global_error(exc, dest_path) from None
    except DoesNotFit as exc:  # the running total broke --fit: DEST goes back to what the command found
        builder.abort()
        raise DoesNotFit(f"{exc}; {undo_pack(dest_path, found, kept, dest_plan, options.force)}") from None
    except BaseException:
        builder.abort()
        raise
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        if feed is not None:
            feed.close()
    journal.remove()
    summary.selection, summary.selection_seconds = selection, selection_seconds
    return summary


def _fit_watch(options: PackOptions, selection: Selection | None, groups: GroupPlan, tree: SourceTree,
               plan: CodecPlan, raw_total: int) -> FitWatch | None:
    """With --fit, what the pack watches after each batch (fit_watch.py); None without."""
    if not options.fit or selection is None:
        return None
    replicated = frozenset(number for number, group in enumerate(groups.table()) if group["replicated"])
    return FitWatch.for_pack(options.fit, options.nodes, replicated, index_bytes_estimate(tree),
                             sum(map(len, plan.dictionaries.values())), raw_total, selection.need())


def walk_sources(sources: list[Path], executor: Executor | None = None) -> SourceTree:
    """The tree SRC gives: a directory's walk, or the listing of archives (walk_archive.source_paths's list)."""
    if len(sources) == 1 and sources[0].is_dir():
        return walk_source(sources[0], executor)
    return walk_archives(sources, executor)


def _summarise(records: list[ChunkRecord], walk_problems: list[Problem]) -> PackSummary:
    summary = PackSummary(problems=list(walk_problems))
    for record in records:
        summary.files += len(record.files)
        summary.raw_bytes += int(record.files.column("size").sum())
        summary.stored_bytes += int(record.files.column("stored_len").sum())
        summary.problems.extend(record.problems)
        summary.chunks += record.chunk_id != NO_CHUNK
    summary.problems.sort(key=lambda p: p.path)
    return summary


def _check_options(options: PackOptions) -> None:
    if options.chunk_size < 4096:
        raise UsageError(f"--chunk-size: {options.chunk_size} bytes is too small (at least 4 KiB)")
    if options.workers < 0:
        raise UsageError(f"--workers: must be 0 (all cores) or more, got {options.workers}")
    if not MIN_BLOCK_SIZE <= options.block_size <= MAX_BLOCK_SIZE:
        raise UsageError(f"--block-size: {options.block_size} bytes is not from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}")
    if options.blocks_above < 0:
        raise UsageError(f"--blocks-above: must be 0 or more bytes, got {options.blocks_above}")
    GroupPlan(options.replicate)  # a bad --replicate fails now, before worker processes start
    if options.codec == AUTO_CODEC:
        _check_selection_options(options)
        return
    try:
        codec_from_spec(options.codec)
    except CodecError as exc:
        raise UsageError(f"--codec: {exc}") from None


def _check_selection_options(options: PackOptions) -> None:
    """Every --codec auto option the selector would refuse, refused before anything is walked."""
    from selector import Budget, SelectionError
    from selector.sample import check_fraction, check_seed

    if options.prefetch_threads < 0:
        raise UsageError(f"--prefetch-threads: must be 0 or more, got {options.prefetch_threads}")
    if options.budget < 0:
        raise UsageError(f"--budget: must be 0 or more bytes/s, got {options.budget}")
    try:
        Budget(options.budget, options.prefetch_threads)
        check_fraction(options.sample)
        check_seed(options.seed)
    except SelectionError as exc:
        raise UsageError(str(exc)) from None
    _goal(options)  # --fit, --nodes, --tolerance, --pack-speed


def _worker_count(workers: int) -> int:
    return workers or len(os.sched_getaffinity(0))


def _fingerprint(tree: SourceTree, options: PackOptions, ctimes: bool = True) -> str:
    """Identifies a pack's inputs: a resume must see the same tree and the same output-defining options, down to
    each entry's ctime (a file rewritten with its mtime put back is not resumed over). Without `ctimes`, the
    digest the index records as `listing_digest`: the index holds no time of SRC's files but their mtimes (packs of
    a copy of SRC stay byte-identical), and a second run finds the pack finished when every path, mode, size, mtime
    and link target is as packed, as make and rsync judge a file unchanged."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(options.output_defining(), sort_keys=True).encode())
    if ctimes:  # archives: who each archive file is (its members have no ctime of their own)
        for identity in tree.identity:
            digest.update(f"@{identity}\n".encode("utf-8", "surrogateescape"))
    for e in tree.entries:
        ctime = f"{e.ctime_ns}\0" if ctimes else ""
        digest.update(f"{e.path}\0{e.mode}\0{e.size}\0{e.mtime_ns}\0{ctime}{e.link_target}\n".encode("utf-8"))
    for p in tree.problems:
        digest.update(f"!{p.path}\0{p.reason}\n".encode("utf-8"))
    return digest.hexdigest()


def _selection(options: PackOptions, src: Path, tree: SourceTree, groups: GroupPlan,
               resumed: PackJournal | None) -> Selection | None:
    """With --codec auto, the selector's choice; a resumed pack reuses the one in its journal (timings vary)."""
    if options.codec != AUTO_CODEC:
        return None
    from selector import Selection, SelectionError

    journaled = resumed.state().selection if resumed is not None else None
    if resumed is not None and journaled:
        try:
            return Selection.from_json(journaled)
        except (SelectionError, KeyError, TypeError) as exc:
            raise PackError(f"{resumed.dir}: the journaled codec selection cannot be read ({exc}); pass --force to "
                            "start the pack afresh") from None
    return select_for(src, tree, groups, options.budget, options.prefetch_threads, options.sample, options.seed,
                      _goal(options), options)


def _goal(options: PackOptions) -> Goal:
    """The selector's Goal for these options (the selector's errors as fanstore's usage errors)."""
    return make_goal(options.fit, options.nodes, options.tolerance, options.pack_speed, options.workers)


def make_goal(fit: int = 0, nodes: int = 0, tolerance: float = DEFAULT_TOLERANCE, pack_speed: float = 0.0,
              workers: int = 0) -> Goal:
    """A selector.Goal from command-line values (sizes in bytes, --pack-speed in bytes/s, --workers 0: every core,
    capped at the cores); a bad value is a UsageError naming its option."""
    from selector import Goal, SelectionError
    from selector.estimate import usable_workers

    if workers < 0:
        raise UsageError(f"--workers: must be 0 (all cores) or more, got {workers}")
    try:
        return Goal(fit_bytes=fit, nodes=nodes, tolerance=tolerance, pack_mbps=pack_speed / 1e6,
                    workers=usable_workers(workers))
    except SelectionError as exc:
        raise UsageError(str(exc)) from None


def select_for(src: Path, tree: SourceTree, groups: GroupPlan, budget: float, prefetch_threads: int,
               fraction: float, seed: int, goal: Goal | None = None, options: PackOptions | None = None) -> Selection:
    """The selector's choice for a walked SRC (`budget` in bytes/s, `goal` a selector.Goal, default: no --fit;
    `options`, the pack's, for the chunk and block sizes the index is bounded with): fanstore walks and groups, the
    selector samples and measures (archives: it reads through ArchivePieces, given the files in stream order, so
    that its reads go forward). Its errors become fanstore's one-line usage errors; a --fit that cannot be met,
    DoesNotFit."""
    from selector import Budget, DoesNotFit as SelectorDoesNotFit, Goal, SelectionError, select_codecs

    replicated = frozenset(number for number, group in enumerate(groups.table()) if group["replicated"])
    with _pieces_of(src, tree) as pieces:
        try:
            return select_codecs(pieces, Budget(budget, prefetch_threads), tree.files_in_read_order(),
                                 groups.group_of, fraction=fraction, seed=seed, replicate=groups.replicate,
                                 goal=goal if goal is not None else Goal(), replicated_groups=replicated,
                                 fixed_bytes=index_bytes_bound(tree, groups,
                                                               options if options is not None else PackOptions()))
        except SelectorDoesNotFit as exc:
            raise DoesNotFit(str(exc)) from None
        except SelectionError as exc:
            raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _pieces_of(src: Path, tree: SourceTree) -> Iterator[Path | ArchivePieces]:
    """What reads SRC out of order: the directory itself, or a reader of the archives, closed after."""
    if not tree.archives:
        yield src
        return
    pieces = ArchivePieces(tree)
    try:
        yield pieces
    finally:
        pieces.close()


def index_bytes_estimate(tree: SourceTree) -> int:
    """The least the index of SRC takes: INDEX_BYTES_PER_ENTRY per entry, plus its path, and INDEX_BYTES_PER_FILE
    per regular file."""
    return (sum(INDEX_BYTES_PER_ENTRY + len(entry.path.encode("utf-8", "surrogateescape")) for entry in tree.entries)
            + INDEX_BYTES_PER_FILE * sum(1 for _ in tree.files))


def index_bytes_bound(tree: SourceTree, groups: GroupPlan, options: PackOptions) -> int:
    """The most the index and the chunk headers of a pack of SRC take, whatever the codecs, the selection record
    aside (the selector counts its own): what --fit plans with. Its entries and paths, the block rows of the files
    stored in blocks, a chunk row and a chunk header for each chunk there can be (stored bytes are at most raw
    ones, and a chunk holds one group), the header, and a table of contents of the pack's options, groups, walk
    problems and codecs, each section aligned."""
    layout = options.block_layout
    block_rows = sum(layout.blocks_of(entry.size) for entry in tree.files)
    raw = sum(entry.size for entry in tree.files)
    chunks = -(-raw // options.chunk_size) + len(groups.table())
    contents = json.dumps({"pack": options.output_defining(), "groups": groups.table(),
                           "skipped": [{"path": p.path, "reason": p.reason} for p in tree.problems]},
                          separators=(",", ":"))
    return (INDEX_HEADER_LEN + index_bytes_estimate(tree) + block_rows * BLOCK_DTYPE.itemsize
            + chunks * (CHUNK_DTYPE.itemsize + CHUNK_HEADER_LEN) + len(contents.encode()) + TOC_ALLOWANCE)


def _spec_by_kind(selection: Selection) -> dict[str, str]:
    """Per-kind specs; a kind the sample did not see gets the choice for `other` files, else lz4 (fast to decode)."""
    by_kind = dict(selection.codec_by_kind())
    by_kind[ANY_KIND] = by_kind.get(OTHER, "lz4")
    return by_kind


def _index_layout(tree: SourceTree, leave_out: frozenset[str] = frozenset()) -> IndexLayout:
    """The index's layout from the walk alone: every entry of the tree but the files in `leave_out`."""
    return IndexLayout(tree.entries if not leave_out else [e for e in tree.entries if e.path not in leave_out])


def _index_bytes(
    tree: SourceTree,
    layout: Future[IndexLayout],
    records: list[ChunkRecord],
    files: list[SourceEntry],
    plan: CodecPlan,
    groups: GroupPlan,
    options: PackOptions,
    summary: PackSummary,
    selection: Selection | None,
    listing_digest: str,
) -> bytearray:
    """The index file's bytes. `layout` is the tree's layout, built while the files were compressed; it is built again without the files
    that turned out not to be packable during the pack (they vanished or changed), which is rare. The listing's
    digest is recorded, so that running the same pack again finds it finished."""
    paths = [path for record in records for path in record.files.paths]

    def column(name: str) -> np.ndarray:
        return np.concatenate([record.files.column(name) for record in records] or [np.zeros(0, np.uint64)])

    if len(paths) == len(tree.files):  # every file of the walk was packed (a file is recorded once)
        index_layout = layout.result()
    else:
        index_layout = _index_layout(tree, frozenset(e.path for e in tree.files) - frozenset(paths))
    flags = column("flags")
    blocked = np.flatnonzero(flags & FLAG_BLOCKED)
    sizes = column("size")
    blocks, first_block_rows = _blocks_table(index_layout, records, [(paths[n], int(sizes[n])) for n in blocked],
                                             files, options.block_layout)
    del sizes
    # A file stored in blocks: its offset is its first row in the blocks section.
    offsets = column("offset")
    offsets[blocked] = [first_block_rows[paths[n]] for n in blocked]
    index_layout.place_blobs(paths, chunk=column("chunk"), offset=offsets, stored_len=column("stored_len"),
                             codec=column("codec"), checksum=column("checksum"), flags=flags)
    del paths, flags, offsets
    chunk_rows = [r for r in records if r.chunk_id != NO_CHUNK]
    chunks = np.zeros(len(chunk_rows), dtype=CHUNK_DTYPE)
    for r in chunk_rows:  # blobs in the chunk: whole files, and blocks
        stored_whole = (r.files.column("flags") & FLAG_BLOCKED) == 0
        whole = int(np.count_nonzero((r.files.column("chunk") == r.chunk_id) & stored_whole))
        chunks[r.chunk_id] = (r.size, r.group, whole + len(r.blocks))
    meta = {
        "pack": {
            **options.output_defining(),
            "files": summary.files,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "skipped": [{"path": p.path, "reason": p.reason} for p in summary.problems],
            "listing_digest": listing_digest,
        }
    }
    if selection is not None:
        meta["selection"] = selection.to_json()
    return index_layout.to_bytes(chunks, groups.table(), plan.rows, plan.dictionaries, meta, blocks=blocks,
                                 block_size=options.block_size)


def _finished_summary(dest: Path) -> PackSummary:
    """What DEST's finished pack holds, from its index (check_dest found it to be this pack): a second run of the
    same command reports it and does nothing."""
    index = Index.load(dest)
    pack_meta = index.meta["pack"]
    summary = PackSummary(files=pack_meta["files"], raw_bytes=pack_meta["raw_bytes"],
                          stored_bytes=pack_meta["stored_bytes"], chunks=len(index.chunks),
                          problems=[Problem(p["path"], p["reason"]) for p in pack_meta["skipped"]], up_to_date=True)
    if index.meta.get("selection"):
        from selector import Selection, SelectionError

        try:
            summary.selection = Selection.from_json(index.meta["selection"])
        except (SelectionError, KeyError, TypeError):  # informational: a --fit check then goes unpredicted
            pass
    return summary


def _blocks_table(index_layout: IndexLayout, records: list[ChunkRecord], blocked_files: list[tuple[str, int]],
                  files: list[SourceEntry], block_layout: BlockLayout) -> tuple[np.ndarray | None, dict[str, int]]:
    """The `blocks` section (None when no file is stored in blocks): the blocks of each file stored in blocks
    (`blocked_files`, their paths and sizes), files in entry order; and each such file's first row in it, by path."""
    blocked_rows = sorted((_BlockedRow(path, size) for path, size in blocked_files),
                          key=lambda row: index_layout.entry_of(row.path))
    if not blocked_rows:
        return None, {}
    number_of = {files[n].path: n for n in range(len(files)) if block_layout.blocks_of(files[n].size)}
    placed: dict[int, list[tuple[int, BlockRow]]] = {}
    for record in records:
        for block_row in record.blocks:
            placed.setdefault(block_row.file, []).append((record.chunk_id, block_row))
    table = np.zeros(sum(block_layout.blocks_of(row.size) for row in blocked_rows), dtype=BLOCK_DTYPE)
    first_rows: dict[str, int] = {}
    cursor = 0
    for row in blocked_rows:
        file_blocks = sorted(placed[number_of[row.path]], key=lambda chunk_and_block: chunk_and_block[1].block)
        if [block.block for _, block in file_blocks] != list(range(block_layout.blocks_of(row.size))):
            raise PackError(f"{row.path}: its blocks in the journal are not the file's blocks 0..n-1; pass --force "
                            "to pack afresh")
        first_rows[row.path] = cursor
        for chunk, block in file_blocks:
            table[cursor] = (block.offset, block.checksum, chunk, block.stored_len, block.codec, b"")
            cursor += 1
    return table, first_rows


class _BlockedRow(NamedTuple):
    """A file stored in blocks, as _blocks_table lays out its blocks."""

    path: str
    size: int


def _global_error(exc: OSError, dest: Path) -> PackError:
    where = exc.filename or dest
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackError(f"disk full writing {where}: free some space and run the same command again to resume")
    return PackError(f"cannot write {where}: {exc.strerror or exc}; run the same command again to resume")
