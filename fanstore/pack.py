"""Pack: walk SRC -> plan groups and codecs -> compress in workers -> chunk files -> index (written last).

Interrupt it at any moment and run it again with the same arguments: finished chunks are kept (the journal says
which), the rest is redone, and the result is byte-identical to an uninterrupted pack.
"""

from __future__ import annotations

import errno
import json
import operator
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import xxhash

from compressors import CodecError, codec_from_spec

from .chunk_writer import PARTIAL_SUFFIX, ChunkWriter
from .codec_plan import ANY_KIND, NONE_ROW, CodecPlan, build_codec_plan
from .compress import CompressedBatch, PlanFiles, Skipped, WorkerPool, compress_in_order
from .errors import PackError, UsageError
from .format import CHUNK_DIR, CHUNK_DTYPE, INDEX_NAME, NO_CHUNK
from .groups import GroupPlan
from .index import EntryRecord, IndexLayout, write_index_atomically
from .journal import JOURNAL_DIR, ChunkRecord, PackJournal
from .kinds import OTHER
from .walk import Problem, SourceEntry, SourceTree, walk_source

if TYPE_CHECKING:
    from selector import Selection

DEFAULT_CHUNK_SIZE = 64 << 20
DEFAULT_CODEC = "zstd:3"
AUTO_CODEC = "auto"
PROGRESS_INTERVAL = 0.1  # seconds between progress callbacks: once per file costs more than packing a small file


@dataclass(frozen=True, slots=True)
class PackOptions:
    codec: str = DEFAULT_CODEC
    chunk_size: int = DEFAULT_CHUNK_SIZE
    replicate: tuple[str, ...] = ()
    workers: int = 0  # 0: every core
    strict: bool = False
    force: bool = False
    # Only with codec="auto": what the selector must meet, and how it samples.
    budget: float = 0.0  # decode throughput the trainer needs, bytes/s
    prefetch_threads: int = 0  # 0: decode on the read path; K: K threads decode ahead
    sample: float = 0.02
    seed: int = 0

    def output_defining(self) -> dict[str, Any]:
        """The options the output bytes depend on: a resume must use the same ones."""
        defining: dict[str, Any] = {"codec": self.codec, "chunk_size": self.chunk_size,
                                    "replicate": list(self.replicate)}
        if self.codec == AUTO_CODEC:
            defining.update(budget=self.budget, prefetch_threads=self.prefetch_threads, sample=self.sample,
                            seed=self.seed)
        return defining


@dataclass(slots=True)
class PackSummary:
    files: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    reused_chunks: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def mb_per_s(self) -> float:
        return self.raw_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PackProgress:
    """How far a pack has got, handed to the progress callback every PROGRESS_INTERVAL and at the end."""

    files_done: int
    files_total: int
    raw_done: int
    raw_total: int
    stored_done: int


def pack(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: PackOptions = PackOptions(),
    tree: SourceTree | None = None,
    progress: Callable[[PackProgress], None] | None = None,
) -> PackSummary:
    """Pack SRC into the dataset directory DEST. `tree` is a walk of SRC the caller already made."""
    started = time.monotonic()
    _check_options(options)
    workers = _worker_count(options.workers)
    # Workers hand blobs back through memfd shared memory (Linux); elsewhere this process compresses alone.
    pool = WorkerPool(workers) if workers > 1 and hasattr(os, "memfd_create") else None
    try:
        summary = _pack_with(Path(src), Path(dest), options, tree, progress, pool)
    finally:
        if pool is not None:
            pool.close()
    summary.seconds = time.monotonic() - started
    return summary


def _pack_with(src_path: Path, dest_path: Path, options: PackOptions, tree: SourceTree | None,
               progress: Callable[[PackProgress], None] | None, pool: WorkerPool | None) -> PackSummary:
    groups = GroupPlan(options.replicate)
    if tree is None:
        tree = walk_source(src_path, pool.executor if pool is not None else None)
    _check_dest_outside_src(src_path, dest_path)
    if options.strict and tree.problems:
        raise PackError(f"--strict: {tree.problems[0]} ({len(tree.problems)} path(s) cannot be packed)")
    # Files in (group, path) order: a chunk holds one group only, and the replicated group comes last. The walk
    # gives them in path order already, so a stable split by group is enough. Each file's group is matched once
    # here; the loop below only looks it up.
    by_group: dict[int, list[SourceEntry]] = {}
    for entry in tree.files:
        by_group.setdefault(groups.group_of(entry.path), []).append(entry)
    in_order = sorted(by_group.items())
    files = [entry for _, members in in_order for entry in members]
    file_groups = [group for group, members in in_order for _ in members]
    del by_group, in_order
    fingerprint = _fingerprint(tree, options)
    journal = PackJournal(dest_path)
    _prepare_dest(dest_path, journal, fingerprint, options)

    selection = _selection(options, src_path, tree, journal)
    spec_by_kind = {ANY_KIND: options.codec} if selection is None else _spec_by_kind(selection)
    plan = build_codec_plan(spec_by_kind, groups, files, file_groups, src_path, journal)
    if not journal.exists():
        journal.start({"fingerprint": fingerprint, "options": options.output_defining(), "codecs": plan.rows,
                       "selection": selection.to_json() if selection is not None else None})
    finished = journal.finished_chunks()
    _discard_unrecorded_chunks(dest_path, len(finished))
    start_file = finished[-1].end_file if finished else 0

    builder = _ChunkBuilder(dest_path, journal, options.chunk_size, files, file_groups, finished)
    raw_total = sum(f.size for f in files)
    plan_files = PlanFiles([f.path for f in files], [f.size for f in files], file_groups)
    next_report = 0.0
    # Most of the index is known from the walk: it is laid out in a thread while the workers compress. It starts
    # once the first batch is back, so that it does not hold the GIL while the first batches go out.
    background = ThreadPoolExecutor(1, thread_name_prefix="fanstore-index-layout")
    layout: Future[IndexLayout] | None = None
    try:
        for batch in compress_in_order(src_path, plan, plan_files, start_file, pool):
            if layout is None:
                layout = background.submit(_index_layout, tree)
            if options.strict:
                skipped = next((r for r in batch.results if isinstance(r, Skipped)), None)
                if skipped is not None:
                    raise PackError(f"--strict: {skipped.problem}")
            builder.add_batch(batch)
            if progress is not None and time.monotonic() >= next_report:
                progress(builder.progress(len(files), raw_total))
                next_report = time.monotonic() + PROGRESS_INTERVAL
        records = builder.close_all()
        if layout is None:  # nothing was left to compress (a resume after the last chunk)
            layout = background.submit(_index_layout, tree)
        if progress is not None:
            progress(builder.progress(len(files), raw_total))
        summary = _summarise(records, tree.problems)
        _write_index(dest_path, tree, layout, records, plan, groups, options, summary, selection)
        background.shutdown(wait=True)  # its thread is idle by now: pack() leaves no thread behind
    except OSError as exc:
        builder.abort()
        raise _global_error(exc, dest_path) from None
    except BaseException:
        builder.abort()
        raise
    finally:
        background.shutdown(wait=False, cancel_futures=True)
    journal.remove()
    summary.reused_chunks = len(finished)
    return summary


class _ChunkBuilder:
    """Feeds blobs into chunk files in plan order, closing a chunk when the next blob would overflow it or
    belongs to another group, and journals each chunk once it is safely on disk."""

    def __init__(
        self,
        dest: Path,
        journal: PackJournal,
        chunk_size: int,
        files: list[SourceEntry],
        file_groups: list[int],
        finished: list[ChunkRecord],
    ) -> None:
        self.dest = dest
        self.journal = journal
        self.chunk_size = chunk_size
        self.files = files
        self.file_groups = file_groups
        self.records = list(finished)
        self.next_chunk = len(finished)
        self.first_file = finished[-1].end_file if finished else 0  # first plan entry of the open chunk
        self.next_number = self.first_file  # plan entries before this one are accounted for
        self.writer: ChunkWriter | None = None
        self.rows: list[list[Any]] = []
        self.problems: list[list[str]] = []
        self._done = _summarise(finished, [])

    def _account_empty_files(self, upto: int) -> None:
        """Empty files have no blob and no task; they are recorded where the plan passes them."""
        while self.next_number < upto:
            entry = self.files[self.next_number]
            if entry.size == 0:
                self.rows.append([entry.path, 0, entry.mtime_ns, entry.mode, NO_CHUNK, 0, 0, NONE_ROW,
                                  xxhash.xxh3_64_intdigest(b"")])
                self._done.files += 1
            self.next_number += 1

    def add_batch(self, batch: CompressedBatch) -> None:
        """Record a batch's files and append their blobs, copying each run of blobs bound for one chunk at once
        (they lie back to back in `batch.blobs`)."""
        files, file_groups, done = self.files, self.file_groups, self._done
        run_start = run_end = 0  # blobs[run_start:run_end] belong to the open chunk but are not appended yet
        for result in batch.results:
            if type(result) is not tuple:
                self._append_run(batch.blobs[run_start:run_end])
                run_start = run_end
                self._skip(result)  # type: ignore[arg-type]
                continue
            number, blob_offset, stored_len, codec, checksum, raw_size = result
            if number != self.next_number:
                self._account_empty_files(number)
            writer = self.writer
            group = file_groups[number]
            pending = run_end - run_start
            overflows = writer is not None and writer.size + pending + stored_len > self.chunk_size
            if writer is not None and (writer.group != group or overflows):
                self._append_run(batch.blobs[run_start:run_end])
                self._close_chunk(end_file=number)
                writer, pending = None, 0
            if writer is None:
                writer = self.writer = ChunkWriter(self.dest, self.next_chunk, group)
            if pending == 0:
                run_start = run_end = blob_offset
            entry = files[number]
            self.rows.append([entry.path, raw_size, entry.mtime_ns, entry.mode, writer.chunk_id,
                              writer.size + pending, stored_len, codec, checksum])
            run_end += stored_len
            self.next_number = number + 1
            done.files += 1
            done.raw_bytes += raw_size
            done.stored_bytes += stored_len
        self._append_run(batch.blobs[run_start:run_end])

    def _append_run(self, blobs: memoryview) -> None:
        if len(blobs):
            assert self.writer is not None
            self.writer.append(blobs)

    def _skip(self, skipped: Skipped) -> None:
        self._account_empty_files(skipped.number)
        self.problems.append([skipped.problem.path, skipped.problem.reason])
        self._done.problems.append(skipped.problem)
        self.next_number = skipped.number + 1

    def _close_chunk(self, end_file: int) -> None:
        assert self.writer is not None
        size = self.writer.finish()
        record = ChunkRecord(self.writer.chunk_id, self.writer.group, size, self.first_file, end_file,
                             self.rows, self.problems)
        self.journal.record_chunk(record)
        self.records.append(record)
        self.writer = None
        self.next_chunk += 1
        self.first_file = end_file
        self.rows, self.problems = [], []

    def close_all(self) -> list[ChunkRecord]:
        """Finish the last chunk; trailing empty files and skips go in a record with no chunk file."""
        self._account_empty_files(len(self.files))
        if self.writer is not None:
            self._close_chunk(end_file=len(self.files))
        if self.rows or self.problems:
            self.records.append(
                ChunkRecord(NO_CHUNK, 0, 0, self.first_file, len(self.files), self.rows, self.problems)
            )
            self.rows, self.problems = [], []
        return self.records

    def progress(self, files_total: int, raw_total: int) -> PackProgress:
        done = self._done
        return PackProgress(done.files + len(done.problems), files_total, done.raw_bytes, raw_total,
                            done.stored_bytes)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _summarise(records: list[ChunkRecord], walk_problems: list[Problem]) -> PackSummary:
    summary = PackSummary(problems=list(walk_problems))
    for record in records:
        summary.files += len(record.files)
        summary.raw_bytes += sum(row[1] for row in record.files)
        summary.stored_bytes += sum(row[6] for row in record.files)
        summary.problems.extend(Problem(path, reason) for path, reason in record.problems)
        summary.chunks += record.chunk_id != NO_CHUNK
    summary.problems.sort(key=lambda p: p.path)
    return summary


def _check_options(options: PackOptions) -> None:
    if options.chunk_size < 4096:
        raise UsageError(f"--chunk-size: {options.chunk_size} bytes is too small (at least 4 KiB)")
    if options.workers < 0:
        raise UsageError(f"--workers: must be 0 (all cores) or more, got {options.workers}")
    if options.codec == AUTO_CODEC:
        if options.prefetch_threads < 0:
            raise UsageError(f"--prefetch-threads: must be 0 or more, got {options.prefetch_threads}")
        if options.budget < 0:
            raise UsageError(f"--budget: must be 0 or more bytes/s, got {options.budget}")
        return
    try:
        codec_from_spec(options.codec)
    except CodecError as exc:
        raise UsageError(f"--codec: {exc}") from None


def _worker_count(workers: int) -> int:
    return workers or len(os.sched_getaffinity(0))


def _check_dest_outside_src(src: Path, dest: Path) -> None:
    real_src, real_dest = os.path.realpath(src), os.path.realpath(dest)
    if real_dest == real_src or real_dest.startswith(real_src + os.sep):
        raise UsageError(f"DEST {str(dest)!r} is inside SRC {str(src)!r}; choose a directory outside it")


def _prepare_dest(dest: Path, journal: PackJournal, fingerprint: str, options: PackOptions) -> None:
    """Fresh DEST, or the journal of the same pack to resume; anything else is refused (or cleared by --force)."""
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"DEST {str(dest)!r} exists and is not a directory")
    ours = {INDEX_NAME, CHUNK_DIR, JOURNAL_DIR, INDEX_NAME + ".partial"}
    present = set(os.listdir(dest)) if dest.is_dir() else set()
    if present - ours:
        raise UsageError(
            f"DEST {str(dest)!r} is not empty and is not a fanstore dataset; choose an empty or new directory"
        )
    if options.force:
        for name in present:
            target = dest / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    elif INDEX_NAME in present:
        raise UsageError(f"DEST {str(dest)!r} already holds a fanstore dataset; pass --force to replace it")
    elif journal.exists():
        previous = journal.state()
        if previous.get("fingerprint") != fingerprint:
            raise UsageError(
                f"DEST {str(dest)!r} holds an interrupted pack of other files or options "
                f"({json.dumps(previous.get('options'))}); run that command to resume it, or pass --force"
            )
    elif present:
        for name in present:
            target = dest / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    try:
        (dest / CHUNK_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"DEST {str(dest)!r} cannot be created: {exc.strerror}") from None


def _discard_unrecorded_chunks(dest: Path, finished: int) -> None:
    """Chunk files past the journal (a crash between publishing a chunk and journaling it) are rewritten."""
    for path in (dest / CHUNK_DIR).iterdir():
        stem = path.name.split(".")[0]
        if path.name.endswith(PARTIAL_SUFFIX) or not stem.isdigit() or int(stem) >= finished:
            path.unlink()


def _fingerprint(tree: SourceTree, options: PackOptions) -> str:
    """Identifies a pack's inputs: a resume must see the same tree and the same output-defining options."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(options.output_defining(), sort_keys=True).encode())
    for e in tree.entries:
        digest.update(f"{e.path}\0{e.mode}\0{e.size}\0{e.mtime_ns}\0{e.link_target}\n".encode("utf-8"))
    for p in tree.problems:
        digest.update(f"!{p.path}\0{p.reason}\n".encode("utf-8"))
    return digest.hexdigest()


def _selection(options: PackOptions, src: Path, tree: SourceTree, journal: PackJournal) -> Selection | None:
    """With --codec auto, the selector's choice; a resumed pack reuses the journaled one (timings vary)."""
    if options.codec != AUTO_CODEC:
        return None
    from selector import Budget, Selection, select_codecs  # measuring codecs is only needed here

    if journal.exists() and journal.state().get("selection"):
        return Selection.from_json(journal.state()["selection"])
    budget = Budget(options.budget, options.prefetch_threads)
    return select_codecs(src, budget, fraction=options.sample, seed=options.seed, replicate=options.replicate,
                         tree=tree)


def _spec_by_kind(selection: Selection) -> dict[str, str]:
    """Per-kind specs; a kind the sample did not see gets the choice for `other` files, else lz4 (fast to decode)."""
    by_kind = dict(selection.codec_by_kind())
    by_kind[ANY_KIND] = by_kind.get(OTHER, "lz4")
    return by_kind


def _index_layout(tree: SourceTree, leave_out: frozenset[str] = frozenset()) -> IndexLayout:
    """The index's layout from the walk alone: every entry of the tree but the files in `leave_out`."""
    return IndexLayout(EntryRecord(e.path, e.mode, e.mtime_ns, e.size, link_target=e.link_target)
                       for e in tree.entries if e.path not in leave_out)


def _write_index(
    dest: Path,
    tree: SourceTree,
    layout: Future[IndexLayout],
    records: list[ChunkRecord],
    plan: CodecPlan,
    groups: GroupPlan,
    options: PackOptions,
    summary: PackSummary,
    selection: Selection | None,
) -> None:
    """`layout` is the tree's layout, built while the files were compressed; it is built again without the files
    that turned out not to be packable during the pack (they vanished or changed), which is rare."""
    rows = [row for record in records for row in record.files]  # rows as ChunkRecord.files describes them
    packed = frozenset(row[0] for row in rows)
    if len(packed) == len(tree.files):
        index_layout = layout.result()
    else:
        index_layout = _index_layout(tree, frozenset(e.path for e in tree.files) - packed)

    def column(at: int) -> Iterator[int]:
        return map(operator.itemgetter(at), rows)

    index_layout.place_blobs([row[0] for row in rows], chunk=column(4), offset=column(5), stored_len=column(6),
                             codec=column(7), checksum=column(8))
    chunk_rows = [r for r in records if r.chunk_id != NO_CHUNK]
    chunks = np.zeros(len(chunk_rows), dtype=CHUNK_DTYPE)
    for r in chunk_rows:
        chunks[r.chunk_id] = (r.size, r.group, sum(1 for row in r.files if row[4] == r.chunk_id))
    meta = {
        "pack": {
            **options.output_defining(),
            "files": summary.files,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "skipped": [{"path": p.path, "reason": p.reason} for p in summary.problems],
        }
    }
    if selection is not None:
        meta["selection"] = selection.to_json()
    index_bytes = index_layout.to_bytes(chunks, groups.table(), plan.rows, plan.dictionaries, meta)
    write_index_atomically(dest, index_bytes)


def _global_error(exc: OSError, dest: Path) -> PackError:
    where = exc.filename or dest
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackError(f"disk full writing {where}: free some space and run the same command again to resume")
    return PackError(f"cannot write {where}: {exc.strerror or exc}; run the same command again to resume")
