"""Pack: walk SRC -> plan groups and codecs -> compress in workers -> chunk files -> index (written last).

Interrupt it at any moment and run it again with the same arguments: finished chunks are kept (the journal says
which), the rest is redone, and the result is byte-identical to an uninterrupted pack. Run it again once finished,
SRC unchanged: there is nothing to do, and DEST is left as it is. A --fit pack that can no longer fit while packing
(fit_watch.py) stops there and removes what it wrote, as if refused (dest.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from compressors import CodecError, codec_from_spec

from ..core.allocator import give_back_free_heap
from ..core.format import NO_CHUNK
from ..core.index import Index, IndexLayout, write_packed_index
from ..core.pause import pause_point
from ..core.units import plural
from ..errors import DoesNotFit, PackError, UsageError
from .archive_feed import ArchiveFeed
from .archive_pieces import pieces_of
from .auto_codec import make_goal, select_for, spec_by_kind
from .batches import PlanFiles
from .blob_compressor import Skipped
from .chunk_builder import ChunkBuilder
from .codec_plan import ANY_KIND, CodecPlan, build_codec_plan
from .compress import CompressedBatch, WorkerPool, compress_in_order
from .dest import (
    DestFound,
    DestPlan,
    check_dest,
    check_src_and_dest,
    dest_as_found,
    files_of_ours,
    keep_sound_chunks,
    prepare_dest,
    undo_pack,
)
from .dest_lock import DestLock
from .fingerprint import pack_fingerprint
from .fit_watch import FitWatch
from .groups import GroupPlan
from .index_bytes import blocked_plan_numbers, index_layout, packed_layout, placed_index
from .index_size import index_bytes_estimate
from .journal import ChunkRecord, JournalState, PackJournal
from .options import AUTO_CODEC, PackOptions
from .progress import PackProgress, ProgressReport
from .entry_columns import EntryColumns
from .walk import Problem, SourceTree
from .walk_archive import source_paths, walk_sources

if TYPE_CHECKING:
    from selector import Goal, Selection


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
    unmatched: list[str] = field(default_factory=list)  # --replicate patterns that matched no file
    repacked: str | None = None  # a resume found a journaled chunk damaged: what, and that it was packed again

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def mb_per_s(self) -> float:
        """Raw MB packed a second: the codec selection's seconds are not counted, as it packs nothing."""
        packing = self.seconds - self.selection_seconds
        return self.raw_bytes / 1e6 / packing if packing > 0 else 0.0


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
    if not os.fspath(dest):  # Path('') is the current directory: the chunks would land there
        raise UsageError("DEST: an empty path (an unset variable?)")
    sources = source_paths(src)
    for source in sources:
        check_src_and_dest(source, Path(dest))
    workers = _worker_count(options.workers)
    pool = None
    try:
        # Workers hand blobs back through memfd shared memory (Linux); elsewhere this process compresses alone.
        # Started inside the try, so that an interrupt as it returns still closes it.
        pool = WorkerPool(workers) if workers > 1 and hasattr(os, "memfd_create") else None
        with DestLock(Path(dest)) as lock:  # taken after the workers are forked: they never hold it
            lock.take_if_there()
            summary = _pack_with(sources, Path(dest), options, tree, progress, on_selection, pool, lock)
    except BrokenProcessPool:  # from the walk or from compressing: the pool cannot go on
        raise PackError("a worker process died (killed, or out of memory); finished chunks are kept: run the same "
                        "command again to resume") from None
    finally:
        if pool is not None:
            pool.close()
    summary.seconds = time.monotonic() - started
    return summary


@dataclass(slots=True)
class _PackRun:
    """One pack's state, handed from step to step: SRC's walk, its files in the order they are packed (each with
    its group), the digests that identify them (fingerprint.py), DEST's journal, with --codec auto the selection."""

    src: Path
    dest: Path
    options: PackOptions
    groups: GroupPlan
    tree: SourceTree
    files: EntryColumns
    file_groups: np.ndarray
    fingerprint: str
    listing_digest: str
    journal: PackJournal
    selection: Selection | None = None
    others: EntryColumns | None = None  # once the walk is let go of: its directories and symlinks

    def let_go_of_the_walk(self) -> None:
        """Once the index's layout is built, which holds what the index keeps of every entry: the walk's entries go
        (the plan holds its files), but for its directories and symlinks, kept for a layout built again without
        files the pack could not pack (index_bytes.packed_layout). A caller that handed in its `tree` holds that."""
        if self.others is None:
            entries = self.tree.entries
            self.others = entries.take(np.flatnonzero(~entries.is_file()))
            self.tree = replace(self.tree, entries=EntryColumns.of(()))

    def let_go_of_the_plan(self) -> None:
        """Once each file's blob is placed in the index's layout: the plan goes before the index's bytes are made,
        written and checked, which is a pack's peak of memory."""
        self.files, self.others = EntryColumns.of(()), None
        self.file_groups = np.zeros(0, np.uint8)


class _DestBefore(NamedTuple):
    """DEST as the command found it, before its first write: what a pack stopped by its --fit goes back to."""

    found: DestFound
    kept: frozenset[str]  # what a pack stopped by its --fit keeps: all this run wrote goes
    plan: DestPlan


def _pack_with(sources: list[Path], dest_path: Path, options: PackOptions, tree: SourceTree | None,
               progress: Callable[[PackProgress], None] | None,
               on_selection: Callable[[Selection], None] | None, pool: WorkerPool | None,
               lock: DestLock) -> PackSummary:
    """The pack's steps: walk, check DEST, select (--codec auto), prepare DEST, plan the codecs, then compress into
    chunk files and write the index."""
    run = _walked(sources, dest_path, options, tree, pool)
    give_back_free_heap()  # the walk's temporaries: the compress step's peak would stand on them
    lock.take_if_there()  # made by another pack during the walk: its journal is not an interrupted pack's
    dest_plan = check_dest(dest_path, run.journal, run.fingerprint, run.listing_digest, options.force,
                           options.output_defining())
    if dest_plan.finished:
        run.journal.remove()  # left by a run killed after its index was in place: the one step it had left
        return _finished_summary(dest_path)
    selecting = time.monotonic()
    run.selection = _selection(options, run.src, run.tree, run.groups, run.journal if dest_plan.resume else None)
    selection_seconds = time.monotonic() - selecting
    # The first write to DEST: every refusal (bad options, DEST, the selection, --fit) has been raised above it.
    # A write that fails from here on (a full disk, DEST made read-only) is one line, as in _chunks_and_index: the
    # journal's start and its dictionaries are written before any chunk.
    with _writing(run.dest):
        before = _prepare_dest(run, dest_plan, lock)
    pause_point("walked")
    if run.selection is not None and on_selection is not None:
        on_selection(run.selection)
    with _writing(run.dest):
        plan = _codec_plan(run)
    pause_point("planned")
    summary = _chunks_and_index(run, plan, progress, pool, before)
    summary.unmatched = run.groups.unmatched()
    pause_point("indexed")
    run.journal.remove()
    summary.selection, summary.selection_seconds = run.selection, selection_seconds
    return summary


def _walked(sources: list[Path], dest_path: Path, options: PackOptions, tree: SourceTree | None,
            pool: WorkerPool | None) -> _PackRun:
    """SRC walked (unless the caller did), refused under --strict if anything cannot be packed, its files in the
    order they are packed: (group, path) order (archives: (group, stream order)), as a chunk holds one group only
    and the replicated group comes last. The walk gives them in that order already, so a stable split by group is
    enough; each file's group is matched once here, and only looked up after."""
    groups = GroupPlan(options.replicate)
    if tree is None:
        tree = walk_sources(sources, pool.executor if pool is not None else None)
    if options.strict and tree.problems:
        raise PackError(f"--strict: {tree.problems[0]} ({plural(len(tree.problems), 'path')} cannot be packed)")
    numbers = tree.file_numbers_in_read_order()
    file_groups = np.zeros(len(numbers), dtype=np.uint8)
    if groups.replicate:
        paths = tree.entries.paths
        file_groups[:] = [groups.group_of(paths[number]) for number in numbers.tolist()]
        by_group = np.argsort(file_groups, kind="stable")
        numbers, file_groups = numbers[by_group], file_groups[by_group]
    defining = options.output_defining()
    return _PackRun(sources[0], dest_path, options, groups, tree, tree.entries.take(numbers), file_groups,
                    pack_fingerprint(tree, defining), pack_fingerprint(tree, defining, ctimes=False),
                    PackJournal(dest_path))


def _prepare_dest(run: _PackRun, dest_plan: DestPlan, lock: DestLock) -> _DestBefore:
    """DEST made ready for this pack (check_dest planned how), and what it held before, for a pack its --fit stops."""
    found = dest_as_found(run.dest)
    prepare_dest(run.dest, run.journal, run.fingerprint, run.listing_digest, run.options.force,
                 run.options.output_defining(), dest_plan, lock)
    return _DestBefore(found, files_of_ours(run.dest), dest_plan)


def _codec_plan(run: _PackRun) -> CodecPlan:
    """Each file's codec (dictionaries trained on SRC's files); a fresh pack's journal starts with it."""
    options, selection = run.options, run.selection
    spec_of_kind = {ANY_KIND: options.codec} if selection is None else spec_by_kind(selection)
    with pieces_of(run.src, run.tree) as pieces:
        plan = build_codec_plan(spec_of_kind, run.groups, run.files, run.file_groups, pieces, run.journal)
    if not run.journal.exists():
        run.journal.start(JournalState(run.fingerprint, options.output_defining(), plan.rows,
                                       selection.to_json() if selection is not None else None))
    return plan


def _chunks_and_index(run: _PackRun, plan: CodecPlan, progress: Callable[[PackProgress], None] | None,
                      pool: WorkerPool | None, before: _DestBefore) -> PackSummary:
    """Compress the files the journal has not got yet into chunk files, then write the index (atomically). On any
    failure the chunk being written goes; once --fit broke, DEST goes back to what the command found."""
    with _writing(run.dest):
        finished, damage = keep_sound_chunks(run.dest, run.journal)
    builder = ChunkBuilder(run.dest, run.journal, run.options.chunk_size, run.files, run.file_groups,
                           run.options.block_layout, finished)
    files = run.files
    plan_files = PlanFiles(files.paths, files.size, run.file_groups, files.ino, files.mtime_ns, files.ctime_ns,
                           run.options.block_layout)
    del files
    # Most of the index is known from the walk: it is laid out in a thread while the workers compress.
    background = ThreadPoolExecutor(1, thread_name_prefix="fanstore-index-layout")
    feed = None
    if run.tree.archives:
        feed = ArchiveFeed(run.tree.archives, plan_files.paths, plan_files.inos, plan_files.sizes, run.tree.linked)
    try:
        records, layout = _compress_all(run, plan, plan_files, builder, feed, pool, background, progress)
        summary = _summarise(records, run.tree.problems)
        summary.reused_chunks = len(finished)
        if damage is not None:
            summary.repacked = f"{damage}: chunks from {len(finished)} on are packed again"
        pause_point("index")
        layout.result()
        run.let_go_of_the_walk()
        packed = packed_layout(layout, records, run.files, run.others or EntryColumns.of(()))
        number_of = blocked_plan_numbers(run.files, run.options.block_layout)
        # The layout holds what the index keeps of the walk: the plan goes before the blobs are placed, so that it
        # does not stand beside the layout and the journal's rows.
        builder.let_go()
        del plan_files, layout
        run.let_go_of_the_plan()
        if feed is not None:
            feed.close()
            feed = None
        give_back_free_heap()
        placed = placed_index(packed, records, number_of, run.options.block_layout)
        # The journal's rows go before the index's bytes are made, written and checked, a pack's peak of memory.
        finished.clear()
        del records, packed, number_of
        give_back_free_heap()  # what the records and the walk took: the index's bytes and check would stand on it
        packed_index = placed.to_bytes(plan, run.groups, run.options.block_layout, _index_meta(run, summary))
        del placed
        write_packed_index(run.dest, packed_index)  # and stamps it, checked, for this node's first open
        del packed_index
        background.shutdown(wait=True)  # its thread is idle by now: pack() leaves no thread behind
    except OSError as exc:
        builder.abort()
        raise _global_error(exc, run.dest) from None
    except DoesNotFit as exc:  # the running total broke --fit: DEST goes back to what the command found
        builder.abort()
        raise DoesNotFit(f"{exc}; {undo_pack(run.dest, before.found, before.kept, before.plan, run.options.force)}"
                         ) from None
    except BaseException:
        builder.abort()
        raise
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        if feed is not None:
            feed.close()
    return summary


def _compress_all(run: _PackRun, plan: CodecPlan, plan_files: PlanFiles, builder: ChunkBuilder,
                  feed: ArchiveFeed | None, pool: WorkerPool | None, background: ThreadPoolExecutor,
                  progress: Callable[[PackProgress], None] | None) -> tuple[list[ChunkRecord], Future[IndexLayout]]:
    """The files left to pack, compressed in order into the builder's chunk files, under --strict and --fit's
    watch, progress reported; the chunk records, and the index's layout, made in `background` meanwhile. It starts
    once the first batch is back, so that it does not hold the GIL while the first batches go out."""
    start_file, start_block = builder.resume_from
    raw_total = int(run.files.size.sum())
    watch = _fit_watch(run.options, run.selection, run.groups, run.tree, plan, raw_total)
    report = ProgressReport(progress, builder, len(run.files), raw_total)
    layout: Future[IndexLayout] | None = None
    for batch in compress_in_order(run.src, plan, plan_files, start_file, start_block, pool, feed):
        if layout is None:
            layout = background.submit(index_layout, run.tree.entries)
        elif layout.done() and run.others is None:
            layout.result()  # its error, if any, now
            run.let_go_of_the_walk()  # the records grow from here on: the walk's columns need not stand beside them
        if run.options.strict:
            _refuse_skipped(batch)
        builder.add_batch(batch)
        if watch is not None:
            watch.check(builder.chunk_bytes(), builder.raw_done)
        report.every_interval()
    records = builder.close_all()
    if layout is None:  # nothing was left to compress (a resume after the last chunk)
        layout = background.submit(index_layout, run.tree.entries)
    report.now()
    return records, layout


def _refuse_skipped(batch: CompressedBatch) -> None:
    """--strict: a file that could not be packed (it changed or vanished since the walk) stops the pack."""
    skipped = next((r for r in batch.results if isinstance(r, Skipped)), None)
    if skipped is not None:
        raise PackError(f"--strict: {skipped.problem}")


def _index_meta(run: _PackRun, summary: PackSummary) -> dict[str, Any]:
    """The index's `meta`: the pack's options and figures, the paths it skipped, and the listing's digest, so that
    running the same pack again finds it finished; with --codec auto, the selection."""
    meta: dict[str, Any] = {
        "pack": {
            **run.options.output_defining(),
            "files": summary.files,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "skipped": [{"path": p.path, "reason": p.reason} for p in summary.problems],
            "listing_digest": run.listing_digest,
        }
    }
    if run.selection is not None:
        meta["selection"] = run.selection.to_json()
    return meta


def _fit_watch(options: PackOptions, selection: Selection | None, groups: GroupPlan, tree: SourceTree,
               plan: CodecPlan, raw_total: int) -> FitWatch | None:
    """With --fit, what the pack watches after each batch (fit_watch.py); None without."""
    if not options.fit or selection is None:
        return None
    replicated = frozenset(number for number, group in enumerate(groups.table()) if group["replicated"])
    return FitWatch.for_pack(options.fit, options.nodes, replicated, index_bytes_estimate(tree),
                             sum(map(len, plan.dictionaries.values())), raw_total, selection.need())


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
    """What PackOptions' own check (its __post_init__) cannot do without codecs or the selector."""
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

    try:
        Budget(options.budget, options.prefetch_threads)
        check_fraction(options.sample)
        check_seed(options.seed)
    except SelectionError as exc:
        raise UsageError(str(exc)) from None
    _goal(options)  # --fit, --nodes, --tolerance, --pack-speed


def _worker_count(workers: int) -> int:
    return workers or len(os.sched_getaffinity(0))


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


@contextlib.contextmanager
def _writing(dest: Path) -> Iterator[None]:
    """A write to DEST that fails (a full disk, DEST made read-only) ends the pack in one line, resumable."""
    try:
        yield
    except OSError as exc:
        raise _global_error(exc, dest) from None


def _global_error(exc: OSError, dest: Path) -> PackError:
    where = exc.filename or dest
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackError(f"disk full writing {where}: free some space and run the same command again to resume")
    return PackError(f"cannot write {where}: {exc.strerror or exc}; run the same command again to resume")
