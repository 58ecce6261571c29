"""What a pack may do to DEST: write into it, and delete only what fanstore itself wrote there.

DEST holds nothing, a finished dataset, or an interrupted pack (its journal). A finished dataset of this very pack
(the same source listing and output-defining options, every chunk file in place) is left as it is: a second run of
the same command has nothing to do. Before deleting anything, every file under fanstore's names is identified by
its content too (the index's and chunks' magic numbers, the journal's own files), without following a symlink; a
DEST holding anything else is refused, --force or not, naming the file: `fanstore-pack SRC ~` must never cost a
home directory.

Deciding and doing are two steps: `check_dest` refuses or decides without writing, and the pack runs every other
refusal of its own (the codec selection's too) before `prepare_dest` changes DEST. A refused pack leaves the file
system as it found it: no DEST where there was none, and an existing one as it was (empty, or holding the dataset
that --force would have replaced).

A pack that stops part way because it can no longer fit its --fit (fit_watch.py) puts DEST back with `undo_pack`:
it removes what this run wrote, files it did not find after `prepare_dest` (chunk files, journal records,
dictionaries) and directories it created (DEST and its missing parents too), and nothing else. What
`prepare_dest` had removed by then (with --force, the dataset being replaced) is gone, and the message says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..core.api import open_dataset
from ..core.durable import PARTIAL_SUFFIX
from ..core.dest_apart import overlap
from ..errors import FanstoreError, FormatError, UsageError, quoted
from ..core.format import (CHUNK_DIR, CHUNK_HEADER, CHUNK_HEADER_LEN, CHUNK_MAGIC, INDEX_MAGIC, INDEX_NAME,
                           INDEX_XATTR, check_chunk_header, chunk_file_name)
from ..core.index import file_identity
from .dest_lock import DestLock
from .walk_archive import check_lookup
from .journal import JOURNAL_DIR, STATE_FILE, ChunkRecord, JournalError, JournalState, PackJournal
from ..core.units import size_option
from ..core.verify import chunk_problems

_CHUNK_NAME = re.compile(r"[0-9]{8}\.fsc(\.partial)?\Z")
_JOURNAL_NAME = re.compile(r"(state\.json|chunk-[0-9]{8}\.json|dict\.[0-9]+(\.[a-z]+)?\.zdict)(\.partial)?\Z")


def check_src_and_dest(src: Path, dest: Path) -> None:
    """Neither may hold the other: a pack writes and deletes under DEST, and must not read what it writes. Links are
    followed and a directory reached by two paths (a bind mount) is seen as one (dest_apart.overlap): DEST under a
    bind mount of SRC was written into SRC, and the next run saw its own chunks as changed source files. Nor may
    SRC be a fanstore mount of the dataset in DEST: with --force, the pack removed the chunks it was reading."""
    check_lookup(dest, "DEST")
    where = overlap(dest, src)
    if where in ("is", "inside"):
        raise UsageError(f"DEST {quoted(dest)} is inside SRC {quoted(src)}; choose a directory outside it")
    if where == "holds":
        raise UsageError(f"SRC {quoted(src)} is inside DEST {quoted(dest)}, where the pack writes and may delete; "
                         "choose a DEST outside SRC")
    served = _served_index(src)
    if served is not None and served == _index_identity(dest):
        raise UsageError(f"SRC {quoted(src)} is a fanstore mount of the dataset in DEST {quoted(dest)}, which the "
                         "pack would remove while it reads it; choose another DEST")


def _served_index(src: Path) -> tuple[int, ...] | None:
    """The identity of the index a fanstore mount under SRC serves (INDEX_XATTR); None on any other file system."""
    try:
        served = json.loads(os.getxattr(src, INDEX_XATTR))
    except (OSError, ValueError):
        return None
    return tuple(served) if isinstance(served, list) else None


def _index_identity(dest: Path) -> tuple[int, ...] | None:
    try:
        return file_identity(os.stat(dest / INDEX_NAME))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class DestPlan:
    """What a pack will do to DEST, decided before anything is written: nothing (`finished`: DEST holds this
    pack already), resume the journal there, or remove the names listed (all fanstore's own) and start afresh."""

    resume: bool
    remove: tuple[str, ...] = ()
    finished: bool = False


def check_dest(dest: Path, journal: PackJournal, fingerprint: str, listing_digest: str,
               force: bool, options: dict[str, Any]) -> DestPlan:
    """A new or empty DEST, the journal of this very pack to resume (its `fingerprint`), or this very pack finished
    (its index records `listing_digest`: nothing to do); another dataset or another pack's journal only with
    --force; anything fanstore did not write, never. Reads DEST, never writes it."""
    if dest.is_symlink() and not dest.is_dir():
        if not dest.exists():  # the directory it names is not made yet, or went away
            raise UsageError(f"DEST {quoted(dest)} is a symlink to {quoted(os.readlink(dest))}, which does not "
                             "exist; make that directory, or give it as DEST")
        raise UsageError(f"DEST {quoted(dest)} is a symlink to something that is not a directory")
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"DEST {quoted(dest)} exists and is not a directory")
    present = set(os.listdir(dest)) if dest.is_dir() else set()
    foreign = _foreign_files(dest, present)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        first, by_content = foreign[0]
        if by_content:
            raise UsageError(f"DEST {quoted(dest)} holds {quoted(first)}{more}, named as fanstore's own files are but "
                             "not in their format (a damaged file of a pack, or another program's); fanstore-pack "
                             "never deletes what it cannot tell is its own: remove or move it yourself, or choose an "
                             "empty or new directory")
        raise UsageError(f"DEST {quoted(dest)} holds {quoted(first)}{more}, which fanstore did not write; "
                         "fanstore-pack never deletes what it did not write: choose an empty or new directory, "
                         "or move those files away")
    fresh = DestPlan(resume=False, remove=tuple(sorted(present)))
    chunk_files = (dest / CHUNK_DIR).is_dir() and any(True for _ in os.scandir(dest / CHUNK_DIR))
    if INDEX_NAME in present:
        if force:
            return fresh
        if _holds_this_pack(dest, listing_digest):
            return DestPlan(resume=False, finished=True)
        raise UsageError(f"DEST {quoted(dest)} already holds a fanstore dataset (of other files, or packed with "
                         "other options); pass --force to replace it")
    if journal.exists():
        try:
            previous = journal.state()
        except JournalError:  # another journal version, or damaged: replaced only on request
            if not force:
                raise
            previous = None
        if previous is not None and previous.fingerprint == fingerprint:
            return DestPlan(resume=True)  # the same pack: resume it
        if force:
            return fresh
        raise UsageError(f"DEST {quoted(dest)} holds an interrupted pack {_what_differs(previous, options)}; pass "
                         "--force to start this pack afresh there")
    if chunk_files and not force:
        raise UsageError(f"DEST {quoted(dest)} holds fanstore chunk files but no index or journal (a copy, or a "
                         "pack from elsewhere); pass --force to replace them")
    return fresh  # at most an empty chunks/ and dictionaries of a pack killed at its start


def _what_differs(previous: JournalState | None, options: dict[str, Any]) -> str:
    """Why an interrupted pack is not this one, for its refusal: the output-defining options that differ, each named
    as its flag, else SRC, which changed since (the journal keeps its listing's digest only)."""
    if previous is None:
        return "that cannot be resumed"
    changed = [f"{'--' + name.replace('_', '-')} {_as_given(name, previous.options.get(name))} then, "
               f"{_as_given(name, options.get(name))} now" for name in sorted({*previous.options, *options})
               if previous.options.get(name) != options.get(name)]
    if changed:
        return f"with other options ({'; '.join(changed)}): run it with those to resume it"
    return ("of SRC as it was then: a file or directory of SRC was changed, added or removed since, so it cannot be "
            "resumed")


_SIZE_OPTIONS = frozenset({"chunk_size", "block_size", "blocks_above", "fit"})
_RATE_OPTIONS = frozenset({"budget", "pack_speed"})
_FRACTION_OPTIONS = frozenset({"sample", "tolerance"})


def _as_given(name: str, value: Any) -> str:
    """An output-defining option's value as its flag takes it (64KiB, 100MB/s, 2%), not as the journal keeps it
    (65536, 100000000.0, 0.02); JSON for the rest (a codec spec, the --replicate patterns)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name in _SIZE_OPTIONS:
            return size_option(int(value)) if value else "0"
        if name in _RATE_OPTIONS:
            return f"{value / 1e6:g}MB/s" if value else "0"
        if name in _FRACTION_OPTIONS:
            return f"{value * 100:g}%"
    return json.dumps(value)


def _holds_this_pack(dest: Path, listing_digest: str) -> bool:
    """Whether DEST's dataset is this pack, finished: its index records the same digest of the source listing and
    the output-defining options. One whose chunk files are not all there as indexed is refused, naming the first:
    packing over it takes --force."""
    try:
        with open_dataset(dest) as ds:
            pack_meta = ds.index.meta.get("pack") if isinstance(ds.index.meta, dict) else None
            if not isinstance(pack_meta, dict) or pack_meta.get("listing_digest") != listing_digest:
                return False
            problems = chunk_problems(ds)
    except FanstoreError:  # an index this version cannot read: another dataset, as far as a pack can tell
        return False
    if problems:
        first = problems[min(problems)]
        raise UsageError(f"DEST {quoted(dest)} holds this pack, but a chunk file is missing or damaged ({first}; "
                         f"{len(problems):,} in all); pass --force to pack it again")
    return True


def prepare_dest(dest: Path, journal: PackJournal, fingerprint: str, listing_digest: str, force: bool,
                 options: dict[str, Any], planned: DestPlan, lock: DestLock) -> None:
    """Carry out what check_dest decided, the pack's first write to DEST. DEST is made and locked for this pack
    (dest_lock.py), then checked again: time has passed since (the codec selection), another pack may have written
    there, and what is deleted must be what was found to be fanstore's."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"DEST {quoted(dest)} cannot be created: {exc.strerror}") from None
    lock.take()
    if check_dest(dest, journal, fingerprint, listing_digest, force, options) != planned:
        raise UsageError(f"DEST {quoted(dest)} changed while the pack was getting ready (is another process "
                         "writing there?); nothing was written: run the same command again")
    _remove_ours(dest, set(planned.remove))
    try:
        (dest / CHUNK_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = f"cannot be written ({quoted(str(dest / CHUNK_DIR))} cannot be made)" if dest.is_dir() else \
            "cannot be created"
        raise UsageError(f"DEST {quoted(dest)} {what}: {exc.strerror}") from None


def keep_sound_chunks(dest: Path, journal: PackJournal) -> tuple[list[ChunkRecord], str | None]:
    """The journaled chunks a resumed pack keeps: those before the first whose file is no longer as the journal
    recorded it (missing, another size, another header: removed, cut short or replaced since the interruption),
    and, if one is not, what is wrong with it. From that chunk on, journal records and chunk files are discarded
    and packed again: kept, they made an index of chunks that are not there, and a pack that said it succeeded."""
    finished = journal.finished_chunks()
    sound, damage = 0, None
    for record in finished:
        damage = _chunk_damage(dest, record)
        if damage is not None:
            break
        sound += 1
    journal.forget_chunks_from(sound)
    discard_unrecorded_chunks(dest, sound)
    return finished[:sound], damage


def _chunk_damage(dest: Path, record: ChunkRecord) -> str | None:
    """What is wrong with a journaled chunk's file (its type, size and header: one open, no blob read), or None."""
    path = dest / chunk_file_name(record.chunk_id)
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return f"{path} is not a regular file"
        if info.st_size != record.size:
            return f"{path} is {info.st_size:,} bytes, the journal says {record.size:,}"
        with open(path, "rb") as chunk:
            header = chunk.read(CHUNK_HEADER_LEN)
        check_chunk_header(header, record.chunk_id, path)
    except FileNotFoundError:
        return f"{path} is missing"
    except FormatError as exc:  # an OSError too
        return str(exc)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if CHUNK_HEADER.unpack(header)[4] != record.group:
        return f"{path} holds a chunk of another group than the journal says"
    return None


def discard_unrecorded_chunks(dest: Path, finished: int) -> None:
    """Chunk files past the journal (a crash between publishing a chunk and journaling it) are written again.
    Only chunk files are there: check_dest refused anything else."""
    for path in (dest / CHUNK_DIR).iterdir():
        stem = path.name.split(".")[0]
        if path.name.endswith(PARTIAL_SUFFIX) or int(stem) >= finished:
            path.unlink()


def _foreign_files(dest: Path, present: set[str]) -> list[tuple[Path, bool]]:
    """Everything under DEST that fanstore did not write, by name and by content, each with whether only its content
    says so (named as fanstore's, not in its format): the refusal then says it may be a pack's damaged file rather
    than claim fanstore never wrote it."""
    foreign = [(dest / name, False) for name in sorted(present - {INDEX_NAME, INDEX_NAME + PARTIAL_SUFFIX, CHUNK_DIR,
                                                                  JOURNAL_DIR})]
    for name, magic in ((INDEX_NAME, INDEX_MAGIC), (INDEX_NAME + PARTIAL_SUFFIX, INDEX_MAGIC)):
        if name in present and not _written_by_us(dest / name, magic, torn_ok=name.endswith(PARTIAL_SUFFIX)):
            foreign.append((dest / name, os.path.isfile(dest / name) and not os.path.islink(dest / name)))
    if CHUNK_DIR in present:
        foreign += _foreign_in(dest / CHUNK_DIR, _CHUNK_NAME,
                               lambda path: _written_by_us(path, CHUNK_MAGIC, torn_ok=path.name.endswith(".partial")))
    if JOURNAL_DIR in present:
        foreign += _foreign_in(dest / JOURNAL_DIR, _JOURNAL_NAME, _journal_file)
    return foreign


def _foreign_in(directory: Path, names: re.Pattern[str],
                ours: Callable[[Path], bool]) -> list[tuple[Path, bool]]:
    """A directory of fanstore's: a real directory (not a symlink to elsewhere) holding only its files."""
    if directory.is_symlink() or not directory.is_dir():
        return [(directory, False)]
    foreign = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        path = directory / entry.name
        if not names.match(entry.name):
            foreign.append((path, False))
        elif not ours(path):
            foreign.append((path, entry.is_file(follow_symlinks=False)))
    return foreign


def _written_by_us(path: Path, magic: bytes, torn_ok: bool) -> bool:
    """A regular file (not a symlink) starting with fanstore's magic; a `.partial` one may also be empty or
    zero-filled, as a pack killed mid-write leaves it."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return False
        with open(path, "rb") as file:
            head = file.read(len(magic))
    except OSError:
        return False
    return head == magic or (torn_ok and head.strip(b"\0") == b"")


def _journal_file(path: Path) -> bool:
    if path.name != STATE_FILE:
        return stat.S_ISREG(os.lstat(path).st_mode)  # chunk records, dictionaries and partials: named as ours
    try:
        return os.path.isfile(path) and not path.is_symlink() and "journal_version" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _remove_ours(dest: Path, present: set[str]) -> None:
    for name in present:
        target = dest / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()


@dataclass(frozen=True, slots=True)
class DestFound:
    """DEST as the command found it, for `undo_pack`: the directories a pack would create (DEST and the parents it
    lacks, deepest first) and DEST's names, both before `prepare_dest`."""

    missing: tuple[Path, ...]
    names: frozenset[str]


def dest_as_found(dest: Path) -> DestFound:
    """DEST before `prepare_dest` (after check_dest: a directory, or nothing)."""
    missing: list[Path] = []
    at = Path(os.path.abspath(dest))
    while not os.path.lexists(at) and at.parent != at:
        missing.append(at)
        at = at.parent
    return DestFound(tuple(missing), frozenset(os.listdir(dest)) if not missing else frozenset())


def files_of_ours(dest: Path) -> frozenset[str]:
    """The files in DEST's chunk and journal directories now ('chunks/00000000.fsc'): taken once `prepare_dest` has
    done its part, what `undo_pack` keeps."""
    found = set()
    for directory in (CHUNK_DIR, JOURNAL_DIR):
        if (dest / directory).is_dir() and not (dest / directory).is_symlink():
            found.update(f"{directory}/{name}" for name in os.listdir(dest / directory))
    return frozenset(found)


def undo_pack(dest: Path, found: DestFound, kept: frozenset[str], planned: DestPlan, force: bool) -> str:
    """Remove what this pack wrote to DEST (any open chunk already aborted): the files under fanstore's names in
    its chunk and journal directories that are not in `kept`, then those directories and DEST and its parents if
    the pack created them (only when empty: os.rmdir). Returns, in a few words, how DEST is left."""
    failed: list[str] = []
    for directory, names in ((CHUNK_DIR, _CHUNK_NAME), (JOURNAL_DIR, _JOURNAL_NAME)):
        where = dest / directory
        if where.is_symlink() or not where.is_dir():
            continue
        for entry in sorted(os.scandir(where), key=lambda e: e.name):
            if (f"{directory}/{entry.name}" not in kept and names.match(entry.name)
                    and entry.is_file(follow_symlinks=False)):
                try:
                    os.unlink(entry.path)
                except OSError as exc:
                    failed.append(f"{entry.path}: {exc.strerror}")
        if directory not in found.names:
            _remove_empty(where, failed)
    for directory in found.missing:  # deepest first: DEST, then the parents the pack made for it
        if not _remove_empty(directory, failed):
            break
    if failed:
        return f"what it wrote could not all be removed ({failed[0]})"
    if found.missing:
        return "nothing of it is kept: DEST does not exist, as before"
    if planned.resume:
        return "this run's chunks are removed: DEST holds the interrupted pack as it was"
    replaced = [what for name, what in ((INDEX_NAME, "dataset"), (JOURNAL_DIR, "interrupted pack"))
                if name in planned.remove]
    if replaced:
        return (f"what it wrote is removed, and DEST holds no {replaced[0]}: the one it held was removed before "
                "packing" + (" (--force)" if force else ""))
    return "what it wrote is removed: DEST is as it was"


def _remove_empty(directory: Path, failed: list[str]) -> bool:
    """rmdir: whether `directory` is gone; one that is not empty (someone else's files) is left, and said."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        return True
    except OSError as exc:
        failed.append(f"{directory}: {exc.strerror}")
        return False
    return True
