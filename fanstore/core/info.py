"""`fanstore info`: what a dataset holds and how well it compressed, from the index alone."""

from __future__ import annotations

import shlex
import stat
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import one_line, shell_word, shown_path
from .api import Dataset
from .format import FLAG_BLOCKED, FORMAT_MAJOR, FORMAT_MINOR, NO_CHUNK, chunk_file_name
from .units import format_bytes, plural, size_option
from .verify import chunk_problems

if TYPE_CHECKING:
    from .index import Index

SKIPPED_SHOWN = 50  # skipped paths `fanstore info` lists unless asked for all


def describe_dataset(ds: Dataset, all_skipped: bool = False) -> str:
    """`fanstore info`'s report; it lists the first SKIPPED_SHOWN skipped paths, or every one with `all_skipped`."""
    index = ds.index
    kinds = index.entries["mode"] & 0o170000
    files = index.entries[kinds == stat.S_IFREG]
    lines = _totals_lines(ds, kinds, files)
    lines.extend(_describe_chunk_files(ds))
    lines.extend(["", "groups:"])
    lines.extend(_group_lines(index, files))
    lines.append("")
    lines.append("codecs:")
    lines.extend(_codec_lines(index, files))
    describe_pack = partial(_describe_pack, dataset=str(ds.path), shown=None if all_skipped else SKIPPED_SHOWN)
    for key, describe in (("pack", describe_pack), ("selection", _describe_selection)):
        if index.meta.get(key):
            lines.append("")
            lines.extend(_described_meta(key, index.meta[key], describe))
    return "\n".join(lines)


def _totals_lines(ds: Dataset, kinds: np.ndarray, files: np.ndarray) -> list[str]:
    """The dataset's path and format, its entries by type (`kinds`: each one's file type bits; `files`: the regular
    files' entries), its raw and stored bytes, chunks and blocks."""
    index = ds.index
    raw = int(files["size"].sum())
    stored = int(files["stored_len"].sum())
    lines = [
        f"dataset      {shown_path(str(ds.path))}",
        f"format       {index.toc.get('version', f'{FORMAT_MAJOR}.{FORMAT_MINOR}')}",
        f"files        {len(files):,}",
        f"directories  {int((kinds == stat.S_IFDIR).sum()):,}",
        f"symlinks     {int((kinds == stat.S_IFLNK).sum()):,}",
        f"raw bytes    {raw:,} ({format_bytes(raw)})",
        f"stored bytes {stored:,} ({format_bytes(stored)})",
        f"ratio        {raw / stored if stored else 1.0:.2f}x",
        f"chunks       {len(index.chunks):,} ({format_bytes(int(index.chunks['size'].sum()))} on disk, "
        f"index {format_bytes(index.path.stat().st_size)})",
    ]
    blocked = int(np.count_nonzero(index.entries["flags"] & FLAG_BLOCKED))
    if blocked:
        noun = "large file" if blocked == 1 else "large files"
        lines.append(f"blocks       {blocked:,} {noun} in {plural(len(index.blocks), 'block')} of "
                     f"{format_bytes(index.block_size)} (--block-size {size_option(index.block_size)}), each "
                     "decodable alone")
    return lines


def _group_lines(index: Index, files: np.ndarray) -> list[str]:
    """Per group: where it is stored, its patterns, its files, chunks and stored bytes."""
    # A file's group is its chunk's; empty files have no chunk and count as group 0.
    has_chunk = files["chunk"] != NO_CHUNK
    file_groups = np.zeros(len(files), dtype=np.int64)
    file_groups[has_chunk] = index.chunks["group"][files["chunk"][has_chunk]]
    lines = []
    for number, group in enumerate(index.groups):
        chosen = files[file_groups == number]
        chunk_count = int((index.chunks["group"] == number).sum())
        where = "every node" if group["replicated"] else "spread over nodes"
        patterns = f" ({', '.join(group['patterns'])})" if group.get("patterns") else ""
        lines.append(
            f"  {group['name']:<11} {where}{patterns}: {plural(len(chosen), 'file')}, {plural(chunk_count, 'chunk')}, "
            f"{format_bytes(int(chosen['stored_len'].sum()))} stored"
        )
    return lines


def _codec_lines(index: Index, files: np.ndarray) -> list[str]:
    """Per codec row (with its dictionary): its files and bytes, raw -> stored, or why it holds none. A file stored
    in blocks counts under the row of each block (its entry's row says nothing of them: a file whose first block
    was stored as is showed as `none` whole, and its blocks' codec as holding no files)."""
    names = [row["spec"] + (f" with {row['dictionary']}" if row.get("dictionary") else "") for row in index.codecs]
    width = max(map(len, names), default=0)
    blocked = (files["flags"] & FLAG_BLOCKED) != 0
    whole = files[~blocked]
    block_rows, block_raw, block_files = _blocks_by_row(index, files[blocked])
    lines = []
    for number, row in enumerate(index.codecs):
        chosen = whole[whole["codec"] == number]
        in_row = block_rows["codec"] == number
        c_raw = int(chosen["size"].sum()) + int(block_raw[in_row].sum())
        c_stored = int(chosen["stored_len"].sum()) + int(block_rows["stored_len"][in_row].sum())
        counts = ", ".join(part for part in (
            plural(len(chosen), "file") if len(chosen) else "",
            f"{plural(int(in_row.sum()), 'block')} of {plural(len(set(block_files[in_row].tolist())), 'file')} "
            "stored in blocks" if in_row.any() else "") if part)
        if row["spec"] == "none":
            if counts:
                lines.append(f"  {names[number]:<{width}}  {counts}, {format_bytes(c_raw)} stored as is")
        elif not counts:  # given to files, it made none of them smaller: `none` holds them
            lines.append(f"  {names[number]:<{width}}  no files: it made none of the files given it smaller, so "
                         "they are stored as is")
        else:
            lines.append(f"  {names[number]:<{width}}  {counts}, {format_bytes(c_raw)} -> "
                         f"{format_bytes(c_stored)} ({c_raw / c_stored if c_stored else 1.0:.2f}x)")
    return lines


def _blocks_by_row(index: Index, blocked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block rows of the files stored in blocks, each block's raw bytes (block_size, the last one's the rest)
    and the file (its number among `blocked`) it belongs to."""
    rows, raw, owners = [], [], []
    for number, entry in enumerate(blocked):
        count = -(-int(entry["size"]) // index.block_size) if index.block_size else 0
        first = int(entry["offset"])
        rows.append(index.blocks[first:first + count])
        raw.append(np.minimum(index.block_size, int(entry["size"]) - index.block_size * np.arange(count)))
        owners.append(np.full(count, number))
    if not rows:
        return index.blocks[:0], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(rows), np.concatenate(raw), np.concatenate(owners)


def _described_meta(key: str, record: Any, describe: Callable[[Any], list[str]]) -> list[str]:
    """Lines for one `meta` record. The metadata is informational (no read depends on it): a record not as
    fanstore writes it is shown as such, never an error."""
    try:
        return describe(record)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        return [f"meta.{key}      not as fanstore writes it ({type(exc).__name__}: {exc}); it is informational only"]


def _describe_pack(pack_meta: dict, dataset: str, shown: int | None) -> list[str]:
    """The pack's options and the paths it skipped: the first `shown`, then how many more and how to see them."""
    # Every option the stored bytes depend on, as a shell takes it: the same pack again finds nothing to do.
    blocks = "".join(f" {flag} {size_option(int(pack_meta[key]))}" for flag, key in
                     (("--block-size", "block_size"), ("--blocks-above", "blocks_above")) if key in pack_meta)
    lines = [f"packed with   --codec {pack_meta['codec']} --chunk-size {size_option(int(pack_meta['chunk_size']))}"
             + blocks + "".join(f" --replicate {shlex.quote(p)}" for p in pack_meta.get("replicate", []))]
    skipped = pack_meta.get("skipped", [])
    lines.append(f"skipped      {plural(len(skipped), 'path')}:" if skipped else "skipped      none")
    lines.extend(f"  {shown_path(s['path'])}: {s['reason']}" for s in skipped[:shown])
    if shown is not None and len(skipped) > shown:
        lines.append(f"  ... and {len(skipped) - shown} more: {all_skipped_command(dataset)} lists them all")
    return lines


def all_skipped_command(dataset: str) -> str:
    """The command that lists every path a pack skipped, as the messages that leave some out name it."""
    return f"`fanstore info {shell_word(dataset)} --all-skipped`"


def _describe_selection(selection: dict) -> list[str]:
    """The selector's choice per kind and what it predicted from the sample (recorded by `--codec auto`)."""
    budget = selection["budget"]
    threads = budget["prefetch_threads"]
    regime = f"{plural(threads, 'prefetch thread')}" if threads else "decoding on the read path"
    fit = selection.get("goal", {}).get("fit_bytes")
    if budget["bytes_per_s"]:
        floor = (f"budget {budget['bytes_per_s'] / 1e6:,.0f} MB/s, {regime}, so each decode must reach "
                 f"{budget['required_decode_mbps']:,.0f} MB/s")
    else:
        floor = "no decode floor (no --budget)" if fit else "no speed requirement (budget 0): best ratio"
    if fit:
        floor = f"--fit {format_bytes(fit)}, {floor}"
    sample = selection["sample"]
    lines = [f"codec selection (--codec auto): {floor}; sample {plural(sample['files'], 'file')}, "
             f"{format_bytes(sample['bytes'])}, seed {sample['seed']}"]
    predicted = {(m["kind"], m["spec"]): m for m in selection["measurements"]}
    for kind, choice in selection["choices"].items():
        m = predicted.get((kind, choice["spec"]))
        ratio = m["raw_bytes"] / m["stored_bytes"] if m and m["stored_bytes"] else 1.0
        if not m:
            figures = "not measured"
        elif choice["spec"] == "none" or m["stored_bytes"] >= m["raw_bytes"]:
            figures = "stored as is: nothing to decode"  # its measured speed is a copy's
        else:
            figures = f"predicted {ratio:.2f}x at {m['decode_mbps']:,.0f} MB/s decode"
        note = "" if choice["meets_budget"] else " (nothing met the budget)"
        lines.append(f"  {kind:<8} {choice['spec']:<28} {figures}{note}")
    return lines


def _describe_chunk_files(ds: Dataset) -> list[str]:
    """Chunk files missing, unreadable or not what the index says, with how many files each takes down; found
    from each file's type, header and size (no blob is read: `fanstore verify` checks every blob)."""
    problems = chunk_problems(ds)
    if not problems:
        return [f"chunk files  all {len(ds.index.chunks):,} present, headers and sizes as indexed"]
    index = ds.index
    files_in = np.zeros(len(index.chunks), dtype=np.int64)
    whole = (index.entries["chunk"] != NO_CHUNK) & ((index.entries["flags"] & FLAG_BLOCKED) == 0)
    np.add.at(files_in, index.entries["chunk"][whole], 1)
    blocked = np.flatnonzero(index.entries["flags"] & FLAG_BLOCKED)
    for entry in blocked:  # a file stored in blocks is lost with any chunk holding one of its blocks
        rows = index.block_rows(int(entry))
        np.add.at(files_in, np.unique(index.blocks["chunk"][rows.start : rows.stop]), 1)
    lines = [f"chunk files  {len(problems):,} of {len(index.chunks):,} cannot be read; their files fail:"]
    for chunk, problem in sorted(problems.items()):
        lines.append(one_line(f"  {chunk_file_name(chunk)}: {plural(int(files_in[chunk]), 'file')}: {problem}"))
    return lines
