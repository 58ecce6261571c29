"""--codec auto's side of the packer: the selector's Goal from command-line values, the selector's choice for a
walked SRC with its errors as fanstore's, and the codec spec per file kind that the codec plan takes from it.

The selector is imported inside these functions only, so that a pack with a named codec never loads it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from compressors.kinds import OTHER

from ..core.format import CHUNK_HEADER_LEN
from ..errors import DoesNotFit, UsageError
from .archive_pieces import pieces_of
from .batches import BlockLayout
from .codec_plan import ANY_KIND
from .groups import SPREAD, GroupPlan
from .index_size import index_bytes_bound
from .options import DEFAULT_TOLERANCE, check_workers
from .walk import SourceTree

if TYPE_CHECKING:
    from selector import Goal, Selection

    from .options import PackOptions


def make_goal(fit: int = 0, nodes: int = 0, tolerance: float = DEFAULT_TOLERANCE, pack_speed: float = 0.0,
              workers: int = 0) -> Goal:
    """A selector.Goal from command-line values (sizes in bytes, --pack-speed in bytes/s, --workers 0: every core,
    capped at the cores); a bad value is a UsageError naming its option."""
    from selector import Goal, SelectionError
    from selector.estimate import usable_workers

    check_workers(workers)
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

    if options is None:  # `fanstore select`: the default options (imported here: packer.py imports this module)
        from .options import PackOptions

        options = PackOptions()
    replicated = frozenset(number for number, group in enumerate(groups.table()) if group["replicated"])
    with pieces_of(src, tree) as pieces:
        try:
            return select_codecs(pieces, Budget(budget, prefetch_threads), tree.files_in_read_order(),
                                 groups.group_of, fraction=fraction, seed=seed, replicate=groups.replicate,
                                 goal=goal if goal is not None else Goal(), replicated_groups=replicated,
                                 fixed_bytes=index_bytes_bound(tree, groups, options),
                                 node_slack=node_slack(tree, groups, options.block_layout))
        except SelectorDoesNotFit as exc:
            raise DoesNotFit(str(exc)) from None
        except SelectionError as exc:
            raise UsageError(str(exc)) from None


def node_slack(tree: SourceTree, groups: GroupPlan, layout: BlockLayout) -> int:
    """The most the placement may give one node of an N-node job beyond its even share of the spread bytes: it cuts
    the spread chunks only between blobs, so a node may hold up to the largest spread blob more (raw bytes: a blob
    stores at most its raw bytes), and the headers of the two chunks it may share with its neighbours. Without it,
    --fit --nodes with more nodes than blobs, or blobs larger than a node's share, accepted a fit no placement
    could give."""
    files = tree.files_in_read_order()
    sizes = np.asarray(files.size, dtype=np.int64)
    blobs = np.where(sizes > layout.blocks_above, np.minimum(sizes, layout.block_size), sizes)
    for number in np.argsort(-blobs, kind="stable").tolist():  # the largest blob first; most often it is spread
        if not blobs[number]:
            break
        if groups.group_of(files.paths[number]) == SPREAD:
            return int(blobs[number]) + 2 * CHUNK_HEADER_LEN
    return 0


def spec_by_kind(selection: Selection) -> dict[str, str]:
    """Per-kind specs; a kind the sample did not see gets the choice for `other` files, else lz4 (fast to decode)."""
    by_kind = dict(selection.codec_by_kind())
    by_kind[ANY_KIND] = by_kind.get(OTHER, "lz4")
    return by_kind
