"""Crafted indexes: a dataset from someone else is refused at open with one line naming the field, or served; it
never raises anything but a fanstore error, never hangs, never reaches outside the dataset.

Each crafted index is rewritten with a valid checksum, so the body checksum cannot be what catches it: the checks
at open (fanstore/core/index_file.py, then index_check.py) must. The fuzz tests mutate one field at a time of a real
packed index (entry fields, path bytes, block rows, chunk rows, the table of contents); the cases below are one per
class of defect.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_one_line_error, make_tree, run_cli
from fanstore import FanstoreError, FormatError, PackOptions, open_dataset, pack
from fanstore.core.format import (ENTRY_DTYPE, FORMAT_MAJOR, FORMAT_MINOR, INDEX_HEADER, INDEX_HEADER_LEN, INDEX_MAGIC, INDEX_NAME, SECTION_ALIGN,
                             chunk_file_name)
from fanstore.core.index_check import MAX_EQUAL_HASHES
from fanstore.core.index_file import parse_index
from fanstore.core.info import describe_dataset
from fanstore.serve.placement import NO_OWNER, BlobTable, place
from fanstore.core.verify import verify_dataset

TOC_ROOM = 1 << 16  # the TOC is padded to a fixed room, so a mutated TOC leaves the sections where they were
HANG_SECONDS = 20


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[Path, dict[str, Any], dict[str, np.ndarray]]:
    """A real dataset with every kind of entry: files whole and in blocks (some blocks raw), empty files, empty
    directories, symlinks, two groups, a dictionary."""
    root = tmp_path_factory.mktemp("crafted")
    src = make_tree(root / "src")
    (src / "large.bin").write_bytes(bytes(range(256)) * 200 + os.urandom(20_000))
    (src / "xy").write_text("a two-byte name, to be crafted into '..'")
    dest = root / "ds"
    pack(src, dest, PackOptions(codec="zstd-dict:3", chunk_size=32 * 1024, replicate=("val/**",), block_size=4096,
                                blocks_above=16 * 1024, workers=1))
    toc, sections = parse_index(dest / INDEX_NAME, (dest / INDEX_NAME).read_bytes())
    return dest, toc, {name: np.array(array) for name, array in sections.items()}


def craft(dataset: Path, out: Path, toc: dict[str, Any], sections: dict[str, np.ndarray],
          mutate_toc: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of `dataset` whose index holds `sections` and `toc` (then `mutate_toc`), with a valid checksum."""
    if not out.exists():
        (out / "chunks").mkdir(parents=True)
        for chunk in sorted((dataset / "chunks").iterdir()):
            os.link(chunk, out / "chunks" / chunk.name)
    toc = copy.deepcopy(toc)
    cursor = INDEX_HEADER_LEN + TOC_ROOM
    body_parts = []
    for name, array in sections.items():
        toc["sections"][name].update(offset=cursor, count=len(array))
        data = array.tobytes()
        padding = -len(data) % SECTION_ALIGN
        body_parts.append(data + bytes(padding))
        cursor += len(data) + padding
    if mutate_toc is not None:
        mutate_toc(toc)
    toc_bytes = json.dumps(toc).encode("utf-8", "surrogatepass")
    if len(toc_bytes) > TOC_ROOM:
        toc_bytes = toc_bytes[:TOC_ROOM]
    body = toc_bytes + b" " * (TOC_ROOM - len(toc_bytes)) + b"".join(body_parts)
    header = INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, INDEX_HEADER_LEN, TOC_ROOM, len(body),
                               xxhash.xxh3_64_intdigest(body))
    (out / INDEX_NAME).write_bytes(header + body)
    return out


def _raise_hang(signum: int, frame: object) -> None:
    raise TimeoutError(f"a crafted index kept the reader busy for {HANG_SECONDS} s")


def exercise(dataset: Path) -> str:
    """Open a dataset and use every read path on it. Returns 'refused' or 'served'; any exception that is not a
    fanstore error, or a hang, fails the caller."""
    previous = signal.signal(signal.SIGALRM, _raise_hang)
    signal.alarm(HANG_SECONDS)
    try:
        try:
            ds = open_dataset(dataset)
        except FanstoreError:
            return "refused"
        with ds:
            _use_everything(ds)
        return "served"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _use_everything(ds) -> None:
    """Every public read call, each allowed to fail with a fanstore error (a crafted rename, say, leaves a name the
    hash table does not find: PathNotFound), and each tried whatever the others did."""
    def tolerant(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except FanstoreError:
            return None

    tolerant(lambda: describe_dataset(ds))
    tolerant(lambda: verify_dataset(ds))
    for dirpath, dirnames, filenames in tolerant(lambda: list(ds.walk())) or []:
        tolerant(lambda: ds.listdir(dirpath))
        for name in dirnames + filenames:
            path = f"{dirpath}/{name}" if dirpath else name
            tolerant(lambda: ds.stat(path, follow_symlinks=False))
            tolerant(lambda: ds.stat(path))
            tolerant(lambda: ds.readlink(path))
            tolerant(lambda: ds.read(path))
            handle = tolerant(lambda: ds.open(path))
            if handle is not None:
                with handle:
                    for offset in (0, 1, 4095, 4096, 5000, 10**6):
                        handle.seek(offset)
                        tolerant(lambda: handle.read(300))
                    handle.seek(0)
                    tolerant(handle.readline)
    for entry in range(len(ds.index.entries)):
        tolerant(lambda: ds.stat_entry(entry))
        tolerant(lambda: ds.reader.read(entry))
    for name in ("labels.txt", "cats/img_001.png", "../etc/passwd", "/", "", "large.bin"):
        tolerant(lambda: ds.read(name))
    for nodes in (1, 3, 64):  # `fanstore plan` and `fanstore serve`: every rank places the index alone
        tolerant(lambda: _use_placement(place(ds.index, nodes), ds.index))


def _use_placement(placement, index) -> None:
    """What plan, staging and a serving rank ask of a placement: sizes, pieces, readers and each blob's owner."""
    for rank in range(placement.nodes):
        placement.stored_bytes(rank)
        placement.pieces(rank)
    placement.staging_read_bytes()
    placement.replicated_readers()
    table = BlobTable.of(index)
    for chunk, offset in zip(table.chunk.tolist(), table.offset.tolist()):
        owner = placement.owner(chunk, offset)
        assert owner == NO_OWNER or 0 <= owner < placement.nodes, (chunk, offset, owner)


ENTRY_FIELDS = [name for name in ENTRY_DTYPE.names]
SPECIAL_U64 = [0, 1, 2, 31, 32, 255, 4095, 4096, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**48 + 1,
               2**63 - 1, 2**63, 2**64 - 1]
FILE_TYPES = [stat.S_IFIFO | 0o644, stat.S_IFCHR | 0o600, stat.S_IFBLK | 0o600, stat.S_IFSOCK | 0o755, 0,
              stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777, 0o170000 | 0o777]


def _value_for(field: str) -> st.SearchStrategy[int]:
    info = np.iinfo(ENTRY_DTYPE[field])
    specials = [v for v in SPECIAL_U64 if info.min <= v <= info.max] + [info.max, info.min]
    if field == "mode":
        specials += FILE_TYPES
    return st.one_of(st.sampled_from(specials), st.integers(int(info.min), int(info.max)))


# CI runs a fixed set of examples; FANSTORE_FUZZ_EXAMPLES=N runs N random ones per test, for a longer hunt.
_LONG_FUZZ = int(os.environ.get("FANSTORE_FUZZ_EXAMPLES", "0"))
FUZZ_SETTINGS = settings(max_examples=_LONG_FUZZ or 250, deadline=None, derandomize=not _LONG_FUZZ,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_entry_fields(original, tmp_path_factory, data):
    dataset, toc, sections = original
    entries = sections["entries"].copy()
    entry = data.draw(st.integers(0, len(entries) - 1), label="entry")
    field = data.draw(st.sampled_from(ENTRY_FIELDS), label="field")
    entries[field][entry] = data.draw(_value_for(field), label="value")
    out = craft(dataset, tmp_path_factory.mktemp("entry"), toc, {**sections, "entries": entries})
    exercise(out)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_path_bytes(original, tmp_path_factory, data):
    dataset, toc, sections = original
    paths = sections["paths"].copy()
    for _ in range(data.draw(st.integers(1, 3), label="bytes changed")):
        at = data.draw(st.integers(0, len(paths) - 1), label="at")
        paths[at] = data.draw(st.sampled_from([0, ord("/"), ord("."), 0xFF, 0xC3, 0x80, ord("a")]), label="byte")
    out = craft(dataset, tmp_path_factory.mktemp("paths"), toc, {**sections, "paths": paths})
    exercise(out)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_blocks_chunks_and_hash_order(original, tmp_path_factory, data):
    dataset, toc, sections = original
    name = data.draw(st.sampled_from(["blocks", "chunks", "hash_order", "path_hash", "first_child", "file_order"]),
                     label="section")
    array = sections[name].copy()
    row = data.draw(st.integers(0, len(array) - 1), label="row")
    if array.dtype.names:
        field = data.draw(st.sampled_from([f for f in array.dtype.names if f != "reserved"]), label="field")
        info = np.iinfo(array.dtype[field])
        array[field][row] = data.draw(st.one_of(st.sampled_from([v for v in SPECIAL_U64 if v <= info.max]),
                                                st.integers(0, int(info.max))), label="value")
    else:
        array[row] = data.draw(st.integers(0, int(np.iinfo(array.dtype).max)), label="value")
    out = craft(dataset, tmp_path_factory.mktemp(name), toc, {**sections, name: array})
    exercise(out)


_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=12),
                         st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                  st.integers(0, 9), max_size=2))


def _toc_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a TOC (dict keys and list indices), to pick one to change or delete."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _toc_paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for index, inner in enumerate(value[:4]):
            found += _toc_paths(inner, prefix + (index,))
    return found


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_table_of_contents(original, tmp_path_factory, data):
    dataset, toc, sections = original
    key_paths = [p for p in _toc_paths(toc) if p[0] != "meta" or len(p) < 3]
    where = data.draw(st.sampled_from(key_paths), label="key path")
    delete = data.draw(st.booleans(), label="delete")
    value = data.draw(_JSON_VALUES, label="value")

    def mutate(crafted: dict[str, Any]) -> None:
        parent = crafted
        for key in where[:-1]:
            parent = parent[key]
        if delete and isinstance(parent, dict):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = value

    out = craft(dataset, tmp_path_factory.mktemp("toc"), toc, sections, mutate)
    exercise(out)


def test_the_unchanged_craft_is_served(original, tmp_path):
    """The crafting itself keeps a dataset valid: what the fuzz tests refuse, their mutation caused."""
    dataset, toc, sections = original
    assert exercise(craft(dataset, tmp_path / "same", toc, sections)) == "served"


def _entry_of(sections: dict[str, np.ndarray], path: str) -> int:
    entries, blob = sections["entries"], sections["paths"].tobytes()
    for number, row in enumerate(entries):
        if blob[int(row["path_off"]): int(row["path_off"]) + int(row["path_len"])] == path.encode():
            return number
    raise KeyError(path)


def _set(field: str, value: int, path: str = "labels.txt") -> Callable:
    def change(sections: dict[str, np.ndarray]) -> None:
        sections["entries"][field][_entry_of(sections, path)] = value
    return change


def _set_path(path: str, new: bytes) -> Callable:
    """Overwrite a path's bytes in place (same length)."""
    def change(sections: dict[str, np.ndarray]) -> None:
        row = sections["entries"][_entry_of(sections, path)]
        start = int(row["path_off"])
        sections["paths"][start: start + len(new)] = np.frombuffer(new, dtype=np.uint8)
    return change


def _set_link(path: str, target: bytes) -> Callable:
    def change(sections: dict[str, np.ndarray]) -> None:
        entry = _entry_of(sections, path)
        sections["entries"]["offset"][entry] = len(sections["paths"])
        sections["entries"]["stored_len"][entry] = sections["entries"]["size"][entry] = len(target)
        sections["paths"] = np.concatenate((sections["paths"], np.frombuffer(target, dtype=np.uint8)))
    return change


def _swap_hash_order(sections: dict[str, np.ndarray]) -> None:
    sections["hash_order"][1] = sections["hash_order"][0]


def _derived(name: str, edit: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """Change a 1.2 section of u32 entry numbers (stored as bytes) through `edit`, which may also resize it."""
    def change(sections: dict[str, np.ndarray]) -> None:
        sections[name] = edit(sections[name].view("<u4").copy()).view(np.uint8)
    return change


def _swapped(values: np.ndarray) -> np.ndarray:
    values[[0, 1]] = values[[1, 0]]
    return values


def _set_row(row: int, value: int) -> Callable[[np.ndarray], np.ndarray]:
    def edit(values: np.ndarray) -> np.ndarray:
        values[row] = value
        return values
    return edit


def _block_field(field: str, value: int) -> Callable:
    def change(sections: dict[str, np.ndarray]) -> None:
        sections["blocks"][field][3] = value
    return change


# One crafted index per class of defect, with the words its refusal must contain.
CRAFTED = {
    "a fifo entry": (_set("mode", stat.S_IFIFO | 0o644), "entries[", "is a fifo"),
    "a device entry": (_set("mode", stat.S_IFCHR | 0o644), "is a character device"),
    "a name '..'": (_set_path("xy", b".."), "'..'"),
    "a name '.'": (_set_path("xy", b".y"), "previous sibling"),  # '.y' sorts before its siblings
    "a name with '/' inside": (_set_path("labels.txt", b"lab/ls.txt"), "path"),
    "a NUL in a path": (_set_path("labels.txt", b"lab\0ls.txt"), "NUL"),
    "a path not UTF-8": (_set_path("labels.txt", b"lab\xffls.txt"), "UTF-8"),
    "two entries with one path": (_set_path("random.bin", b"labels.txt"), "previous sibling"),
    "a path outside its parent": (_set_path("train/cat/img_001.png", b"train/dog/img_001.png"), "parent"),
    "a parent that is a file": (_set("parent", 3, "train/cat"), "parent"),
    "a blob past its chunk's end": (_set("offset", 2**40), "outside chunk"),
    "a size of 2**63": (_set("size", 2**63), "size"),
    "a size its stored bytes cannot hold": (_set("size", 2**40), "cannot hold"),
    "a chunk id out of range": (_set("chunk", 4000), "names no chunk"),
    "a codec row out of range": (_set("codec", 200), "names no codec"),
    "an unknown flag": (_set("flags", 0x80), "unknown bits"),
    "hash order not a permutation": (_swap_hash_order, "permutation"),
    "a symlink climbing out": (_set_link("cats", b"../../../etc"), "leaves the dataset"),
    "an absolute symlink": (_set_link("latest.npy", b"/etc/passwd"), "absolute"),
    "a symlink with an inner '..'": (_set_link("latest.npy", b"train/../../x"), "not normalized"),
    "a block past its chunk": (_block_field("offset", 2**50), "outside chunk"),
    "a block of a wrong codec row": (_block_field("codec", 99), "names no codec"),
    "children that are not the tree's": (_derived("first_child", _set_row(1, 2)), "first_child[1]"),
    "a first_child row past the entries": (_derived("first_child", _set_row(-1, 2**32 - 1)), "first_child["),
    "a first_child one row short": (_derived("first_child", lambda values: values[:-1]), "first_child", "bytes"),
    "files out of path order": (_derived("file_order", _swapped), "file_order[1]", "path order"),
    "a directory in the file order": (_derived("file_order", _set_row(0, 0)), "file_order", "exactly once"),
    "a file order past the entries": (_derived("file_order", _set_row(2, 2**31)), "file_order", "exactly once"),
    "a file order one file short": (_derived("file_order", lambda values: values[:-1]), "file_order"),
    "a dictionary that is not one": (lambda sections: sections.update(
        {name: np.frombuffer(os.urandom(len(array)), dtype=np.uint8) for name, array in sections.items()
         if name.startswith("dict.")}), "codecs[1]", "unusable dictionary"),
    "a file order of a part of a number": (lambda sections: sections.update(file_order=sections["file_order"][:-1]),
                                           "file_order", "whole number"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_each_crafted_index_is_refused_naming_the_field(original, tmp_path, case):
    dataset, toc, sections = original
    change, *needles = CRAFTED[case]
    crafted_sections = {name: array.copy() for name, array in sections.items()}
    change(crafted_sections)
    out = craft(dataset, tmp_path / "crafted", toc, crafted_sections)
    with pytest.raises(FanstoreError) as refused:
        open_dataset(out)
    for needle in needles:
        assert needle in str(refused.value), str(refused.value)
    assert str(out / INDEX_NAME) in str(refused.value)
    for command in ("info", "verify"):
        assert_one_line_error(run_cli(command, str(out), timeout=60), *needles)


TOC_CASES = {
    "not an object": (lambda toc: toc.clear() or toc.update({"x": [1]}), "format"),
    "no sections": (lambda toc: toc.pop("sections"), "sections"),
    "a codec row of the wrong type": (lambda toc: toc["codecs"].__setitem__(1, "zstd"), "codecs[1]"),
    "a dictionary naming no section": (lambda toc: toc["codecs"][1].__setitem__("dictionary", "dict.9"),
                                       "names no dictionary"),
    "a dictionary codec naming none": (lambda toc: toc["codecs"][1].__setitem__("dictionary", None),
                                       "codecs[1].dictionary: 'zstd-dict:3' decodes with a dictionary"),
    "a section outside the file": (lambda toc: toc["sections"]["entries"].__setitem__("offset", 2**40), "outside"),
    "a section over another": (lambda toc: toc["sections"]["paths"].__setitem__(
        "offset", toc["sections"]["entries"]["offset"]), "overlaps"),
    "a block size of 0": (lambda toc: toc.__setitem__("block_size", 0), "block_size"),
    "another layout for entries": (lambda toc: toc["sections"]["entries"].__setitem__("dtype", "<u8"), "layout"),
}


@pytest.mark.parametrize("case", sorted(TOC_CASES))
def test_each_crafted_table_of_contents_is_refused(original, tmp_path, case):
    dataset, toc, sections = original
    mutate, needle = TOC_CASES[case]
    out = craft(dataset, tmp_path / "crafted", toc, sections, mutate)
    with pytest.raises(FanstoreError, match=re.escape(needle)):
        open_dataset(out)


def test_header_fields_are_checked(original, tmp_path):
    dataset, toc, sections = original
    out = craft(dataset, tmp_path / "crafted", toc, sections)
    data = bytearray((out / INDEX_NAME).read_bytes())
    for offset, fmt, value, needle in ((12, "<I", 63, "header length"), (12, "<I", 2**31, "header length"),
                                       (16, "<Q", 2**40, "runs past"), (24, "<Q", 5, "longer than its header says"),
                                       (24, "<Q", 2**40, "truncated")):
        crafted = bytearray(data)
        struct.pack_into(fmt, crafted, offset, value)
        if needle == "runs past":  # keep the checksum valid: this is the TOC length, inside the checked body
            struct.pack_into("<Q", crafted, 32, xxhash.xxh3_64_intdigest(bytes(crafted[INDEX_HEADER_LEN:])))
        (out / INDEX_NAME).write_bytes(bytes(crafted))
        with pytest.raises(FanstoreError, match=needle):
            open_dataset(out)


def test_a_mount_of_a_crafted_index_is_refused_in_one_line(original, tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    dataset, toc, sections = original
    crafted_sections = {name: array.copy() for name, array in sections.items()}
    _set_link("cats", b"../../../etc")(crafted_sections)
    out = craft(dataset, tmp_path / "crafted", toc, crafted_sections)
    (tmp_path / "mnt").mkdir()
    assert_one_line_error(run_cli("mount", str(out), str(tmp_path / "mnt"), "--log", str(tmp_path / "log")),
                          "symlink target", "leaves the dataset")
    assert not os.path.ismount(tmp_path / "mnt")
    assert chunk_file_name(0)  # the chunks themselves were never the problem


@pytest.mark.parametrize("name", ["abcdefgh", "abcdefghijklmnop", "a" * 24])
def test_a_name_of_whole_8_byte_words_beside_a_longer_one_it_starts_is_not_a_duplicate(tmp_path, name):
    """Names are compared 8 bytes at a time: one that ends exactly at a word's end, followed by a sibling that starts
    with it ('filelock', 'filelock-4.2.12.dist-info'), was refused as a duplicate, so the pack could not be opened."""
    from fanstore import PackOptions, open_dataset, pack

    src = tmp_path / "src"
    src.mkdir()
    for suffix in ("", "-1", "0"):
        (src / f"{name}{suffix}").write_bytes(suffix.encode() or b"plain")
    pack(src, tmp_path / "ds", PackOptions(codec="none", workers=1))
    with open_dataset(tmp_path / "ds") as dataset:
        assert dataset.listdir("") == sorted(f"{name}{suffix}" for suffix in ("", "-1", "0"))
        assert dataset.read(name) == b"plain" and dataset.read(f"{name}-1") == b"-1"


_NAME_TEXT = st.text(alphabet="ab-\u00e9", max_size=4)


@st.composite
def _sibling_names(draw: Callable[..., Any]) -> list[bytes]:
    """Sibling names sharing a stem that often ends at an 8-byte word's edge, mostly sorted as a packer writes them,
    sometimes with a duplicate or in any order."""
    stem = draw(st.sampled_from(["", "a" * 7, "abcdefgh", "b" * 9, "filelock", "x" * 15, "y" * 16, "z" * 24]))
    names = [(stem + draw(_NAME_TEXT)).encode() for _ in range(draw(st.integers(2, 6)))]
    names = [name for name in names if name] or [b"a", b"b"]
    how = draw(st.sampled_from(["sorted", "duplicate", "any"]))
    if how == "sorted":
        return sorted(set(names)) if len(set(names)) > 1 else [names[0], names[0] + b"a"]
    if how == "duplicate":
        names = sorted(names)
        return names[:1] + names
    return names


@settings(max_examples=300, deadline=None)
@given(encoded=_sibling_names())
def test_sibling_order_is_checked_as_bytes_compare_whatever_the_name_lengths(encoded):
    """The word-at-a-time check agrees with comparing names as bytes: siblings are accepted exactly when each name
    sorts strictly after the one before, for names ending anywhere in or at the edge of an 8-byte word."""
    from fanstore.core.index_check import Refuse, _check_sibling_order

    padded = np.frombuffer(b"".join(encoded) + bytes(8), dtype=np.uint8)
    lens = np.array([0] + [len(e) for e in encoded], dtype=np.int64)  # entry 0 is the root: no name
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    parents = np.zeros(len(lens), dtype=np.int64)
    in_order = all(a < b for a, b in zip(encoded, encoded[1:]))
    try:
        _check_sibling_order(Refuse(Path("index")), padded, starts, lens, parents)
    except FanstoreError as exc:
        assert not in_order, f"{encoded} refused: {exc}"
    else:
        assert in_order, f"{encoded} accepted"


_HOSTILE_META = [float("inf"), float("-inf"), float("nan"), 10**400, -(10**400), -1, 0, "x", None, True, [], {},
                 [1, 2], {"a": 1}]


def _meta_paths(value: Any, prefix: tuple) -> list[tuple]:
    """Every key path below `value` (dict keys, and the first two items of each list)."""
    found = []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += [prefix + (key,)] + _meta_paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for number, inner in enumerate(value[:2]):
            found += [prefix + (number,)] + _meta_paths(inner, prefix + (number,))
    return found


@pytest.mark.parametrize("dataset", ["crafted", "golden auto"])
def test_any_value_anywhere_in_meta_is_described_never_raised(original, dataset):
    """`meta` (the pack's options, skipped paths, the selector's choice) is informational, and a crafted one is read
    like any other JSON: an infinite chunk size or a 400-digit byte count once made `fanstore info` print a
    traceback (OverflowError). Every value at every key path, hostile ones included, gives lines."""
    path = original[0] if dataset == "crafted" else Path(__file__).parent / "golden" / "v1.1-auto" / "dataset"
    with open_dataset(path) as ds:
        meta = copy.deepcopy(ds.index.meta)
        paths = _meta_paths(meta, ())
        assert len(paths) > (40 if dataset == "golden auto" else 5)
        for where in paths:
            for value in _HOSTILE_META:
                crafted = copy.deepcopy(meta)
                parent = crafted
                for key in where[:-1]:
                    parent = parent[key]
                parent[where[-1]] = value
                ds.index.meta = crafted
                assert describe_dataset(ds), where


def _hash_of_path_changed(sections: dict[str, np.ndarray]) -> None:
    """The hash of one path rewritten (between its neighbours, so the table stays sorted)."""
    hashes = sections["path_hash"]
    gaps = np.flatnonzero(hashes[1:] - hashes[:-1] > 2)
    hashes[gaps[0]] += 1


def _hash_order_swapped(sections: dict[str, np.ndarray]) -> None:
    """Two entries' places in the hash table swapped: still a permutation, each now under the other's hash."""
    order = sections["hash_order"]
    order[0], order[1] = order[1], order[0]


@pytest.mark.parametrize("damage, lost", [(_hash_of_path_changed, 1), (_hash_order_swapped, 2)])
def test_paths_the_hash_table_cannot_find_are_reported_by_verify(original, tmp_path, damage, lost):
    """A hash table that opens (sorted, a permutation) but holds another hash than a path's leaves that path listed
    and unreadable by name. Open does not hash every path (10^7 of them take seconds); `fanstore verify` does, and
    names each such path."""
    dataset, toc, sections = original
    sections = {name: array.copy() for name, array in sections.items()}
    damage(sections)
    out = craft(dataset, tmp_path / "crafted", toc, sections)
    with open_dataset(out) as ds:
        missed = [ds.index.path_of(entry) for entry in ds.index.unfindable().tolist()]
        assert len(missed) == lost
        for path in missed:
            assert path.rpartition("/")[2] in ds.listdir(path.rpartition("/")[0])
            with pytest.raises(FanstoreError):
                ds.stat(path, follow_symlinks=False)
    result = run_cli("verify", str(out))
    assert result.returncode == 1
    for path in missed:
        assert f"BAD PATH '{path}': the index lists it, but its hash table does not find it" in result.stdout
    assert f"{lost} path{'s' if lost > 1 else ''} not found by lookup" in result.stdout
    with open_dataset(dataset) as ds:
        assert ds.index.unfindable().tolist() == []


def _sparse_zeros(index: Path) -> None:
    os.truncate(index, 0)
    os.truncate(index, 64 << 30)


def _sparse_tail(index: Path) -> None:
    os.truncate(index, 64 << 30)  # the header's body length is the real index's: 64 GiB of it are not


def _sparse_body_as_the_header_says(index: Path) -> None:
    """A header whose body length is the file's 64 GiB: consistent, so only reading the body tells it is damaged."""
    data = bytearray(index.read_bytes())
    struct.pack_into("<Q", data, 24, (64 << 30) - INDEX_HEADER_LEN)
    index.write_bytes(bytes(data))
    os.truncate(index, 64 << 30)


def _limit_address_space() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize("damage, needle", [(_sparse_zeros, "bad magic"), (_sparse_tail, "longer than its header"),
                                            (_sparse_body_as_the_header_says, "memory")])
def test_an_index_file_too_large_to_map_is_refused_in_one_line_never_read_whole(original, tmp_path, damage, needle):
    """Under an address-space limit (`ulimit -v`, as batch systems set) a 64 GiB index file cannot be mapped, and the
    reader fell back to reading all of it: a MemoryError traceback from info, verify and open_dataset. The header
    is checked against the file's size first, and a body too large for memory is one line naming the index."""
    dataset, toc, sections = original
    out = craft(dataset, tmp_path / "crafted", toc, sections)
    damage(out / INDEX_NAME)
    for command in ("info", "verify"):
        assert_one_line_error(run_cli(command, str(out), timeout=120, preexec_fn=_limit_address_space),
                              str(out / INDEX_NAME), needle)


@pytest.mark.parametrize("run, refused", [(MAX_EQUAL_HASHES, False), (MAX_EQUAL_HASHES + 4, True)])
def test_a_long_run_of_one_path_hash_is_refused_at_open(original, tmp_path, run, refused):
    """A lookup compares the path of every entry sharing its hash: a table holding one value many times in a row
    (sorted, a permutation: it opened) made each lookup of a path hashed there a scan of the run, linear in the
    dataset at worst. Open refuses a run longer than any real pack has (three paths sharing an xxh3-64 hash are
    all but impossible), naming the row."""
    dataset, toc, sections = original
    sections = {name: array.copy() for name, array in sections.items()}
    assert len(sections["path_hash"]) > run
    sections["path_hash"][:run] = sections["path_hash"][run - 1]  # still sorted
    out = craft(dataset, tmp_path / "crafted", toc, sections)
    if refused:
        with pytest.raises(FormatError, match=rf"path_hash.* holds {run} equal values in a row from row 0 \(at most "
                                              rf"{MAX_EQUAL_HASHES}\)"):
            open_dataset(out)
    else:
        with open_dataset(out) as ds:
            assert ds.read("labels.txt")


def _root_hash_changed(sections: dict[str, np.ndarray]) -> None:
    """The root's slot of the hash table given its neighbour's hash (still sorted): a lookup of '' no longer finds
    it."""
    hashes, order = sections["path_hash"], sections["hash_order"]
    at = int(np.flatnonzero(order == 0)[0])
    hashes[at] = hashes[at - 1] if at else hashes[at + 1]


def test_a_root_the_hash_table_cannot_find_opens_and_serves_every_reader(original, tmp_path):
    """The root is entry 0 (checked at open), but opening looked it up by its path's hash: a hash table that did not
    find '' made open_dataset, info, verify and the mount fail with "'': no such file or directory in the dataset",
    a line naming neither DEST nor the index. As for any path the table misses, the dataset opens and verify names
    it; every path resolves, through the root."""
    dataset, toc, sections = original
    sections = {name: array.copy() for name, array in sections.items()}
    _root_hash_changed(sections)
    out = craft(dataset, tmp_path / "crafted", toc, sections)
    image = (dataset.parent / "src" / "train/cat/img_001.png").read_bytes()
    with open_dataset(out) as ds:
        assert "labels.txt" in ds.listdir("")
        assert ds.index.unfindable().tolist() == [0]
        for path in ("train/cat/img_001.png", "cats/img_001.png", "train/dog/../cat/img_001.png",
                     "/cats/./img_001.png"):
            assert ds.read(path) == image, path
    assert run_cli("info", str(out), timeout=60).returncode == 0
    verified = run_cli("verify", str(out), timeout=60)
    assert verified.returncode == 1 and "BAD PATH '': the index lists it" in verified.stdout, verified.stdout
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing on this machine: FUSE mounts cannot be tested")
    from fanstore.mount.mount import unmount

    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = run_cli("mount", str(out), str(mountpoint), "--log", str(tmp_path / "log"), timeout=60)
    assert mounted.returncode == 0, mounted.stderr
    try:
        assert "labels.txt" in os.listdir(mountpoint)
        assert (mountpoint / "cats" / "img_001.png").read_bytes() == image
    finally:
        unmount(mountpoint)


def _limit_address_space_to_800_mib() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (800 << 20, 800 << 20))


def test_an_index_that_does_not_fit_in_memory_once_read_is_refused_in_one_line(original, tmp_path, monkeypatch):
    """A table of contents of 40 MB holding ten million empty objects (meta is free-form) takes twenty times its
    size as Python objects: under an address-space limit `fanstore info` and `verify` died in a MemoryError
    traceback from json. Running out of memory anywhere in opening the index is one line naming the index."""
    dataset, toc, sections = original
    monkeypatch.setattr(__import__(__name__), "TOC_ROOM", 41 << 20)
    out = craft(dataset, tmp_path / "crafted", toc, sections,
                lambda crafted: crafted["meta"].__setitem__("junk", [{}] * (10 << 20)))
    for command in ("info", "verify"):
        assert_one_line_error(run_cli(command, str(out), timeout=120, preexec_fn=_limit_address_space_to_800_mib),
                              str(out / INDEX_NAME), "not enough memory")


def _blob_of_64_gib(dataset: Path, toc: dict[str, Any], sections: dict[str, np.ndarray], out: Path) -> Path:
    """labels.txt made a 64 GiB file stored as it is, in its chunk made a sparse file of 1 TiB (the index says so):
    a blob too large to read into memory, as an honest file stored whole of that size would be under a limit."""
    sections = {name: array.copy() for name, array in sections.items()}
    entry = _entry_of(sections, "labels.txt")
    chunk = int(sections["entries"]["chunk"][entry])
    sections["chunks"]["size"][chunk] = 1 << 40
    for field, value in (("offset", 32), ("stored_len", 1 << 36), ("size", 1 << 36), ("codec", 0)):
        sections["entries"][field][entry] = value
    craft(dataset, out, toc, sections)
    chunk_path = out / chunk_file_name(chunk)
    data = chunk_path.read_bytes()
    chunk_path.unlink()  # a hard link to the original's
    chunk_path.write_bytes(data)
    os.truncate(chunk_path, 1 << 40)
    return out


_READ_EVERY_FILE = r"""
import sys
from fanstore import FanstoreError, open_dataset
with open_dataset(sys.argv[1]) as ds:
    for path in ("labels.txt", "random.bin", "train/cat/img_001.png"):
        try:
            print(path, len(ds.read(path)))
        except FanstoreError as exc:
            print(path, type(exc).__name__, exc)
"""


def test_a_blob_too_large_for_memory_fails_its_file_alone(original, tmp_path):
    """A blob of 64 GiB could not be read into memory (pread allocates it): a bare MemoryError came out of
    Dataset.read (not a fanstore error), `fanstore verify` died in a traceback and a DataLoader worker with it.
    It is ChunkUnavailable naming the file, as a decode without memory was already; the other files read."""
    dataset, toc, sections = original
    out = _blob_of_64_gib(dataset, toc, sections, tmp_path / "crafted")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    read = subprocess.run([sys.executable, "-c", _READ_EVERY_FILE, str(out)], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=_limit_address_space)
    assert read.returncode == 0 and "Traceback" not in read.stderr, read.stderr
    said = dict(line.split(" ", 1) for line in read.stdout.splitlines())
    assert said["labels.txt"].startswith("ChunkUnavailable labels.txt: ") and "not enough memory" in said["labels.txt"]
    assert said["random.bin"] == "200000" and said["train/cat/img_001.png"] == "3012", said
    verified = run_cli("verify", str(out), timeout=120, preexec_fn=_limit_address_space)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert "labels.txt" in verified.stdout and "not enough memory" in verified.stdout, verified.stdout
