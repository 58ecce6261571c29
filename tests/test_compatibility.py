"""Minor versions only add: this reader (format 1.1) reads a hand-made 1.9 index that carries what it does not
know, skipping what the rule lets it skip and refusing, in one line, what it must not (docs/FORMAT.md, Versioning).

The 1.9 dataset is the golden 1.1 dataset as a later writer would write it: headers saying 1.9, a header grown to
72 bytes, TOC keys and section keys this reader does not know, and new sections, typed or bytes, required or not.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from conftest import assert_one_line_error, run_cli
from fanstore import FormatError, open_dataset
from fanstore.core.format import (CHUNK_HEADER, CHUNK_HEADER_LEN, INDEX_HEADER, INDEX_MAGIC, INDEX_NAME, SECTION_ALIGN,
                             layout_tag)
from fanstore.core.index_file import parse_index
from fanstore.core.verify import verify_dataset

GOLDEN = Path(__file__).resolve().parent / "golden" / "v1.1"
FUTURE_MINOR = 9
FUTURE_HEADER_LEN = 72  # a later minor version grew the header by 8 bytes
# A typed section a later writer adds for its own use: a reader that does not know it reads on without it.
FUTURE_ROWS = np.array([(1, 2, b""), (3, 4, b""), (5, 6, b"")],
                       dtype=[("when", "<i8"), ("what", "<u4"), ("spare", "V4")])


def write_future_dataset(out: Path, extra_sections: dict[str, tuple[np.ndarray, dict[str, Any]]],
                         major: int = 1, minor: int = FUTURE_MINOR, header_len: int = FUTURE_HEADER_LEN,
                         edit_toc: Any = None) -> Path:
    """The golden 1.1 dataset rewritten as version major.minor, with `extra_sections` (name: array and extra keys
    of its TOC entry) after the known ones and `edit_toc` applied to the TOC last."""
    index_path = GOLDEN / "dataset" / INDEX_NAME
    toc, sections = parse_index(index_path, index_path.read_bytes())
    (out / "chunks").mkdir(parents=True)
    for chunk in sorted((GOLDEN / "dataset" / "chunks").iterdir()):
        data = bytearray(chunk.read_bytes())
        magic, _, _, chunk_id, group = CHUNK_HEADER.unpack_from(data)
        data[:CHUNK_HEADER_LEN] = CHUNK_HEADER.pack(magic, major, minor, chunk_id, group)
        (out / "chunks" / chunk.name).write_bytes(bytes(data))
    arrays = {**{name: np.asarray(array) for name, array in sections.items()},
              **{name: array for name, (array, _) in extra_sections.items()}}
    toc = json.loads(json.dumps(toc))
    toc["version"] = f"{major}.{minor}"
    toc["future_key"] = {"a later writer's": ["own", "key"]}
    toc["groups"][0]["future_key"] = 1
    toc["codecs"][1]["future_key"] = "x"
    toc["sections"]["entries"]["future_key"] = True
    for name, (array, keys) in extra_sections.items():
        toc["sections"][name] = {"offset": 0, "count": len(array), "dtype": layout_tag(array.dtype), **keys}
    if edit_toc is not None:
        edit_toc(toc)
    toc_room = 1 << 16  # the TOC gets a fixed room, so the sections' offsets do not move its length
    cursor = header_len + toc_room
    body_parts = []
    for name, array in arrays.items():
        toc["sections"][name]["offset"] = cursor
        data = array.tobytes() + bytes(-array.nbytes % SECTION_ALIGN)
        body_parts.append(data)
        cursor += len(data)
    if edit_toc is not None:
        edit_toc(toc)  # again: an edit may set an offset on purpose
    toc_bytes = json.dumps(toc).encode()
    body = toc_bytes + b" " * (toc_room - len(toc_bytes)) + b"".join(body_parts)
    header = INDEX_HEADER.pack(INDEX_MAGIC, major, minor, header_len, toc_room, len(body),
                               xxhash.xxh3_64_intdigest(body))
    (out / INDEX_NAME).write_bytes(header + b"FUTURE!!"[: header_len - len(header)] + body)
    return out


def _reads_as_packed(dataset: Path) -> None:
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    with open_dataset(dataset) as ds:
        assert ds.index.toc["version"] == f"1.{FUTURE_MINOR}"
        for path, row in manifest.items():
            if stat.S_ISREG(row["mode"]):
                assert hashlib.sha256(ds.read(path)).hexdigest() == row["sha256"], path
            elif stat.S_ISLNK(row["mode"]):
                assert ds.readlink(path) == row["link"]
        assert verify_dataset(ds).ok


def test_the_unchanged_golden_dataset_as_1_9_reads(tmp_path):
    """The crafting alone (versions, a longer header, unknown keys) keeps the dataset readable."""
    _reads_as_packed(write_future_dataset(tmp_path / "ds", {}))


@pytest.mark.parametrize("layout", ["typed", "bytes"])
def test_an_unknown_section_is_skipped(tmp_path, layout):
    future = FUTURE_ROWS if layout == "typed" else np.frombuffer(b"later minor version's bytes", dtype="u1")
    dataset = write_future_dataset(tmp_path / "ds", {"future_rows": (future, {}),
                                                     "future_unmarked": (FUTURE_ROWS, {"required": False})})
    _reads_as_packed(dataset)
    info = run_cli("info", str(dataset), check=True).stdout
    assert "format       1.9" in info


@pytest.mark.parametrize("layout", ["typed", "bytes"])
def test_an_unknown_required_section_is_refused_in_one_line(tmp_path, layout):
    future = FUTURE_ROWS if layout == "typed" else np.frombuffer(b"must be understood", dtype="u1")
    dataset = write_future_dataset(tmp_path / "ds", {"future_rows": (FUTURE_ROWS, {}),
                                                     "future_required": (future, {"required": True})})
    with pytest.raises(FormatError) as refused:
        open_dataset(dataset)
    message = str(refused.value)
    assert "'future_required'" in message and "required" in message and "1.9" in message, message
    assert str(dataset / INDEX_NAME) in message and "future_rows" not in message
    for command in (["info"], ["verify"], ["plan", "--nodes", "2"]):
        assert_one_line_error(run_cli(command[0], str(dataset), *command[1:]), "'future_required'", "newer fanstore")


def test_a_known_section_marked_required_reads(tmp_path):
    """A later writer may mark `blocks` required (a 1.1 reader knows it): nothing changes for this reader."""
    dataset = write_future_dataset(tmp_path / "ds", {"future_rows": (FUTURE_ROWS, {})},
                                   edit_toc=lambda toc: toc["sections"]["blocks"].update(required=True))
    _reads_as_packed(dataset)


def _set_section(name: str, **keys: Any):
    return lambda toc: toc["sections"][name].update(keys)


# An unknown section is skipped, not ignored: it must still be well-formed, so a damaged TOC is not read past.
DAMAGED_UNKNOWN = {
    "a layout tag that is none": (_set_section("future_rows", dtype="when:int64"), "not a layout tag"),
    "a layout tag with a size 0": (_set_section("future_rows", dtype="|V0"), "not a layout tag"),
    "past the end of the file": (_set_section("future_rows", count=10**9), "outside"),
    "over a known section": (lambda toc: toc["sections"]["future_rows"].update(
        offset=toc["sections"]["entries"]["offset"]), "overlaps"),
    "required that is not true or false": (_set_section("future_rows", required="yes"), "required"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_UNKNOWN))
def test_a_damaged_unknown_section_is_refused_naming_it(tmp_path, case):
    edit, needle = DAMAGED_UNKNOWN[case]
    dataset = write_future_dataset(tmp_path / "ds", {"future_rows": (FUTURE_ROWS, {})}, edit_toc=edit)
    with pytest.raises(FormatError, match=needle) as refused:
        open_dataset(dataset)
    assert "future_rows" in str(refused.value) or "entries" in str(refused.value)


def test_a_changed_layout_of_a_known_section_is_refused(tmp_path):
    """A minor version never re-lays out a section: a new layout needs a new name."""
    dataset = write_future_dataset(tmp_path / "ds", {}, edit_toc=_set_section("chunks", dtype="size:<u8,group:<u8"))
    assert_one_line_error(run_cli("info", str(dataset)), "'chunks'", "layout")


def test_another_major_version_is_refused_in_one_line(tmp_path):
    dataset = write_future_dataset(tmp_path / "ds", {}, major=2, minor=0)
    assert_one_line_error(run_cli("info", str(dataset)), str(dataset / INDEX_NAME), "version 2.0", "1.x")
