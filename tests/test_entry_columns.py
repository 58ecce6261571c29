"""The packer's walk in columns (pack/entry_columns.py): a path column keeps its ends in 32 bits while its blob is
under 4 GiB and in 64 bits past it, and every way of reading it gives the same paths either way (the limit is
lowered here: a 4 GiB blob is no test's to make)."""

from __future__ import annotations

import numpy as np
import pytest

from fanstore.pack import entry_columns
from fanstore.pack.entry_columns import EntryColumns, EntryColumnsBuilder, SourceEntry

PATHS = [f"d{number % 7}/{'x' * (number % 13)}f{number:05d}.bin" for number in range(3000)]


def _columns(paths: list[str]) -> EntryColumns:
    return EntryColumns.of(SourceEntry(path, 0o100644, number, 7, "", number) for number, path in enumerate(paths))


@pytest.mark.parametrize("limit", [1 << 32, 1000], ids=["32-bit ends", "64-bit ends"])
def test_a_path_column_reads_the_same_with_narrow_or_wide_ends(monkeypatch, limit):
    monkeypatch.setattr(entry_columns, "NARROW_ENDS_BELOW", limit)
    columns = _columns(PATHS)
    assert columns.paths.ends.dtype == (np.uint32 if limit > len(columns.paths.blob) else np.int64)
    assert list(columns.paths) == PATHS
    assert columns.paths.lengths().tolist() == [len(path) for path in PATHS]
    numbers = np.array([2999, 0, 17, 1500, 17], dtype=np.int64)
    assert columns.paths.gather(numbers) == [PATHS[n].encode() for n in numbers]
    assert columns.paths.lengths_of(numbers).tolist() == [len(PATHS[n]) for n in numbers]
    assert list(columns.take(numbers).paths) == [PATHS[n] for n in numbers]
    into = np.zeros(len(columns.paths.blob), np.uint8)
    used = columns.paths.gather_into(numbers, into)
    assert into[:used].tobytes() == b"".join(PATHS[n].encode() for n in numbers)
    both = EntryColumnsBuilder()  # two listings joined, as several archives' are: the second's ends move on
    both.extend(columns, 10, 20)
    both.extend(columns)
    joined = both.build()
    assert list(joined.paths) == PATHS[10:20] + PATHS
    assert joined.size.tolist() == list(range(10, 20)) + list(range(3000))
