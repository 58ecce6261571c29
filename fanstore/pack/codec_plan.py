"""Which codec each file is compressed with: one spec for all, or one per file kind (what `--codec auto` chose).

The plan is the codec table the index records (row 0 is always `none`) plus, per group, the row for each kind.
`zstd-dict` trains one dictionary per group (and kind), on a sample of the files that will use it: with kinds
listed, the ANY_KIND row's dictionary is trained on the files of the kinds not listed only, so none is trained (and
stored) when every file has a row of its own kind. A set too small to train on falls back to plain zstd at the
same level. Dictionaries are journaled, so a resumed pack uses the very same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from compressors import DICT_TRAIN_FILE_BYTES, Codec, codec_from_spec, train_dictionary, training_draw
from compressors.kinds import HEAD_BYTES, file_kind

from .entry_columns import EntryColumns
from .groups import GroupPlan
from .journal import PackJournal


class Pieces(Protocol):
    """Reads SRC by path where it is no directory (archive_pieces.ArchivePieces): b"" when it cannot."""

    def read(self, path: str, offset: int, size: int) -> bytes: ...


ANY_KIND = "*"
NONE_ROW = 0


@dataclass(slots=True)
class CodecPlan:
    rows: list[dict[str, Any]] = field(default_factory=lambda: [{"id": 0, "spec": "none", "dictionary": None}])
    codecs: list[Codec] = field(default_factory=lambda: [codec_from_spec("none")])
    dictionaries: dict[str, bytes] = field(default_factory=dict)
    # group -> kind -> row; ANY_KIND is the row for kinds not listed
    by_group: dict[int, dict[str, int]] = field(default_factory=dict)

    def row_for(self, group: int, kind: str) -> int:
        rows = self.by_group[group]
        return rows.get(kind, rows[ANY_KIND])

    def depends_on_kind(self, group: int) -> bool:
        """Whether files of this group must be sniffed to pick their codec (not when one codec fits all)."""
        return len(set(self.by_group[group].values())) > 1

    def _add(self, codec: Codec, dictionary_name: str | None) -> int:
        row = {"id": codec.codec_id, "spec": codec.spec, "dictionary": dictionary_name}
        if row not in self.rows:
            self.rows.append(row)
            self.codecs.append(codec)
        return self.rows.index(row)


def build_codec_plan(
    spec_by_kind: dict[str, str],
    groups: GroupPlan,
    files: EntryColumns,
    file_groups: np.ndarray,
    src: Path | Pieces,
    journal: PackJournal,
) -> CodecPlan:
    """`spec_by_kind` maps kinds to specs and must hold ANY_KIND, the spec for every other kind; `file_groups`
    holds the group of each of `files`."""
    plan = CodecPlan()
    for group in range(len(groups.table())):
        samples_by_kind: dict[str, list[bytes]] | None = None
        plan.by_group[group] = {}
        for kind, spec in sorted(spec_by_kind.items()):
            codec = codec_from_spec(spec)
            dictionary_name = None
            if codec.needs_dictionary:
                dictionary_name = f"dict.{group}" if kind == ANY_KIND else f"dict.{group}.{kind}"
                dictionary = journal.load_dictionary(dictionary_name)
                if dictionary is None:
                    if samples_by_kind is None:
                        # Numbers, not entries: a SourceEntry for every file of a group, to sample a few, took
                        # 260 MB more than the pack's own peak at 10^6 files.
                        members = np.flatnonzero((file_groups == group) & (files.size > 0))
                        samples_by_kind = _dictionary_samples(src, files, members,
                                                              frozenset(spec_by_kind) - {ANY_KIND})
                    dictionary = train_dictionary(samples_by_kind.get(kind, []), level=codec.level)
                    if dictionary is not None:
                        journal.save_dictionary(dictionary_name, dictionary)
                if dictionary is not None:
                    codec = codec_from_spec(spec, dictionary=dictionary)
                    plan.dictionaries[dictionary_name] = dictionary
                else:
                    codec, dictionary_name = codec_from_spec(f"zstd:{codec.level}"), None
            plan.by_group[group][kind] = NONE_ROW if codec.spec == "none" else plan._add(codec, dictionary_name)
    return plan


def _dictionary_samples(src: Path | Pieces, files: EntryColumns, members: np.ndarray,
                        listed: frozenset[str]) -> dict[str, list[bytes]]:
    """A deterministic random sample of a group's files (`members`: their numbers in `files`; training_draw, as the
    selector predicts it), each cut to its first bytes, under the row that will compress the file: its kind when
    `listed` names it, else ANY_KIND (every sample when none is listed). Read in file order (an archive's reads go
    forward)."""
    samples: dict[str, list[bytes]] = {}
    if not len(members):
        return samples
    for number in members[training_draw(files.size[members])].tolist():
        entry = files[number]
        if not isinstance(src, Path):  # archives: archive_pieces.ArchivePieces
            sample = src.read(entry.path, 0, DICT_TRAIN_FILE_BYTES)
            if not sample:
                continue
        else:
            try:
                with open(src / entry.path, "rb") as f:
                    sample = f.read(DICT_TRAIN_FILE_BYTES)
            except OSError:
                continue  # the compress step reports it
        kind = file_kind(entry.path, sample[:HEAD_BYTES]) if listed else ANY_KIND
        samples.setdefault(kind if kind in listed else ANY_KIND, []).append(sample)
    return samples
