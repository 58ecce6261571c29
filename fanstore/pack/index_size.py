"""How large the index of a pack of SRC will be, known from the walk before anything is packed: --fit plans with
the most it takes (index_bytes_bound) and a pack watching its --fit counts the least (index_bytes_estimate)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from ..core.format import BLOCK_DTYPE, CHUNK_DTYPE, CHUNK_HEADER_LEN, INDEX_HEADER_LEN
from .groups import GroupPlan
from .walk import SourceTree

if TYPE_CHECKING:
    from .options import PackOptions

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


def index_bytes_estimate(tree: SourceTree) -> int:
    """The least the index of SRC takes: INDEX_BYTES_PER_ENTRY per entry, plus its path, and INDEX_BYTES_PER_FILE
    per regular file."""
    entries = tree.entries
    return (INDEX_BYTES_PER_ENTRY * len(entries) + int(entries.paths.lengths().sum())
            + INDEX_BYTES_PER_FILE * int(np.count_nonzero(entries.is_file())))


def index_bytes_bound(tree: SourceTree, groups: GroupPlan, options: PackOptions) -> int:
    """The most the index and the chunk headers of a pack of SRC take, whatever the codecs, the selection record
    aside (the selector counts its own): what --fit plans with. Its entries and paths, the block rows of the files
    stored in blocks, a chunk row and a chunk header for each chunk there can be (stored bytes are at most raw
    ones, and a chunk holds one group), the header, and a table of contents of the pack's options, groups, walk
    problems and codecs, each section aligned."""
    layout = options.block_layout
    sizes = tree.entries.size[tree.entries.is_file()].tolist()
    block_rows = sum(map(layout.blocks_of, sizes))
    raw = sum(sizes)
    chunks = -(-raw // options.chunk_size) + len(groups.table())
    contents = json.dumps({"pack": options.output_defining(), "groups": groups.table(),
                           "skipped": [{"path": p.path, "reason": p.reason} for p in tree.problems]},
                          separators=(",", ":"))
    return (INDEX_HEADER_LEN + index_bytes_estimate(tree) + block_rows * BLOCK_DTYPE.itemsize
            + chunks * (CHUNK_DTYPE.itemsize + CHUNK_HEADER_LEN) + len(contents.encode()) + TOC_ALLOWANCE)
