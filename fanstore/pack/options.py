"""PackOptions: how `fanstore pack` (and `fanstore.pack`) packs, each option's default, check and help written here
once. Light on purpose: the command line reads it to build its parser, without the packer, its worker processes
or the codecs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.format import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from ..core.options import option
from ..core.units import parse_fraction, parse_rate, parse_size, size_option
from ..errors import UsageError, quoted

if TYPE_CHECKING:
    from .batches import BlockLayout

DEFAULT_CHUNK_SIZE = 64 << 20
DEFAULT_CODEC = "zstd:3"
# Files above 4 MiB are stored in 1 MiB blocks, so a read at any offset decodes about 1 MiB. Measured on float
# arrays, text and integers with zstd, lz4 and blosc: ratios are flat from 256 KiB blocks up (within 1%; zstd:19
# on text gains 4% at 4 MiB), while one block's decode, the cost of a random read, grows from about 2 ms at
# 1 MiB to 5-10 ms at 4 MiB. 1 MiB is also the most one FUSE read request carries. Files up to 4 MiB, most
# training samples, stay whole: read whole anyway, they decode in one call.
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_BLOCKS_ABOVE = 4 << 20
AUTO_CODEC = "auto"
DEFAULT_TOLERANCE = 0.01  # selector.policy.DEFAULT_TOLERANCE (the selector is imported only with --codec auto)
MIN_CHUNK_SIZE = 4096
# Worker processes at most: each compresses on one core and costs its memory; thousands only exhausted memory (5,000
# forked 1,500 processes and 8 GB before anything was packed) and 10^11 overflowed the pool's C int.
MAX_WORKERS = 1024


def _size_bounded_later(text: str, flag: str) -> int:
    """A size read as it is, 0 included: __post_init__ checks it against the option's own bounds and names them."""
    return parse_size(text, flag, minimum=0)


def _workers(workers: int) -> str:
    return "every core" if workers == 0 else str(workers)


def check_workers(workers: int) -> None:
    """--workers, for pack and select: 0 (every core) to MAX_WORKERS."""
    if not 0 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers: must be 0 (every core) to {MAX_WORKERS}, got {workers}")


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}"


def _no_floor(rate: float) -> str:
    return "no floor" if rate == 0 else f"{rate / 1e6:g}MB/s"


def parse_tolerance(text: str, flag: str = "--tolerance") -> float:
    """--tolerance as a fraction from 0 (unlike --sample, 0 is meaningful: the smallest stored size always wins)."""
    value = str(text).strip()
    try:
        tolerance = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise UsageError(f"{flag}: cannot read {quoted(text)} as a fraction (try 1% or 0.01)") from None
    if not 0 <= tolerance < 1:
        raise UsageError(f"{flag}: {quoted(text)} must be from 0% up to, not including, 100% (e.g. 1%)")
    return tolerance


@dataclass(frozen=True, slots=True)
class PackOptions:
    codec: str = option(
        DEFAULT_CODEC, flag="--codec", metavar="SPEC",
        help=f"a codec spec (below), or {AUTO_CODEC}: measure codecs on a sample of SRC and choose per file kind (see "
             "--budget and --fit) (default {default})")
    chunk_size: int = option(
        DEFAULT_CHUNK_SIZE, flag="--chunk-size", metavar="SIZE", parse=_size_bounded_later, show=size_option,
        help="a chunk file closes before the next stored blob (a file stored whole, or one block) would take it past "
             "SIZE, e.g. {default} (default); a blob larger than SIZE gets a chunk of its own")
    replicate: tuple[str, ...] = option(
        (), flag="--replicate", metavar="GLOB",
        help="files matching GLOB (e.g. 'val/**') go to the group stored on every node; repeatable")
    block_size: int = option(
        DEFAULT_BLOCK_SIZE, flag="--block-size", metavar="SIZE", parse=_size_bounded_later, show=size_option,
        help="a file larger than --blocks-above is stored in blocks of SIZE, each decodable alone, so a read "
             "anywhere in it decodes about SIZE bytes (default {default})")
    blocks_above: int = option(
        DEFAULT_BLOCKS_ABOVE, flag="--blocks-above", metavar="SIZE", parse=_size_bounded_later, show=size_option,
        help="files larger than SIZE are stored in blocks (default {default}); smaller ones whole")
    workers: int = option(0, flag="--workers", metavar="N", type=int, show=_workers,
                          help=f"compression processes, 0 to {MAX_WORKERS} (default: {{default}})")
    strict: bool = option(False, flag="--strict", help="fail instead of skipping files that cannot be packed")
    force: bool = option(False, flag="--force", help="replace a dataset or interrupted pack already in DEST")
    # Only with codec="auto": what the selector must meet, and how it samples (`fanstore select` takes them too; the
    # selector checks what it alone knows of, see packer._check_options).
    budget: float = option(  # decode throughput the trainer needs, bytes/s
        0.0, flag="--budget", metavar="RATE", parse=parse_rate, show=None,
        help="decode throughput the training job needs, e.g. 800MB/s (0: best ratio); with --fit, a floor")
    prefetch_threads: int = option(  # 0: decode on the read path; K: K threads decode ahead
        0, flag="--prefetch-threads", metavar="K", type=int,
        help="K threads decode ahead of the reader, so each needs only budget/K (default {default}: decoding is on "
             "the read path)")
    sample: float = option(
        0.02, flag="--sample", metavar="FRACTION", parse=parse_fraction, show=_percent,
        help="share of the data the selector measures, e.g. {default} (default; capped in bytes)")
    seed: int = option(0, flag="--seed", type=int, help="seed of the selector's sample (default {default})")
    fit: int = option(  # bytes the dataset must fit in (0: no --fit); with nodes, what each node has
        0, flag="--fit", metavar="SIZE", parse=parse_size, show=None,
        help="capacity the dataset must fit in, e.g. 500GB: per kind, the settings that decode fastest while it "
             "still fits (with --nodes, what each node has)")
    nodes: int = 0  # its command line is cli.py's: its bound is the placement's (serve/placement.py)
    tolerance: float = option(  # stored sizes within this share of the smallest: the faster pack wins
        DEFAULT_TOLERANCE, flag="--tolerance", metavar="FRACTION", parse=parse_tolerance, show=_percent,
        help="without --fit: settings storing within FRACTION of the smallest count as equal, and the fastest to "
             "pack wins (default {default}; 0: the smallest always)")
    pack_speed: float = option(  # bytes/s each kind must pack at (0: no floor)
        0.0, flag="--pack-speed", metavar="RATE", parse=parse_rate, show=_no_floor,
        help="each file kind must pack at RATE or more with the pack's workers, dictionary training included, e.g. "
             "50MB/s (default: {default})")

    def __post_init__(self) -> None:
        """The check of these values that needs neither codecs nor the selector, whoever builds them (the CLI, or
        Python): the option at fault is named. The codec spec, --replicate and the selector's options are checked
        when the pack starts (packer._check_options), before anything is written."""
        if self.chunk_size < MIN_CHUNK_SIZE:
            raise UsageError(f"--chunk-size: {self.chunk_size} bytes is too small (at least 4 KiB)")
        check_workers(self.workers)
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise UsageError(f"--block-size: {self.block_size} bytes is not from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}")
        if self.blocks_above < 0:
            raise UsageError(f"--blocks-above: must be 0 or more bytes, got {self.blocks_above}")
        if self.prefetch_threads < 0:
            raise UsageError(f"--prefetch-threads: must be 0 or more, got {self.prefetch_threads}")
        if self.budget < 0:
            raise UsageError(f"--budget: must be 0 or more bytes/s, got {self.budget}")

    def output_defining(self) -> dict[str, Any]:
        """The options the output bytes depend on: a resume must use the same ones."""
        defining: dict[str, Any] = {"codec": self.codec, "chunk_size": self.chunk_size,
                                    "replicate": list(self.replicate), "block_size": self.block_size,
                                    "blocks_above": self.blocks_above}
        if self.codec == AUTO_CODEC:
            defining.update(budget=self.budget, prefetch_threads=self.prefetch_threads, sample=self.sample,
                            seed=self.seed, fit=self.fit, nodes=self.nodes, tolerance=self.tolerance,
                            pack_speed=self.pack_speed)
        return defining

    @property
    def block_layout(self) -> BlockLayout:
        from .batches import BlockLayout

        return BlockLayout(self.blocks_above, self.block_size)


# The pack's options as `fanstore select --help` words them: select packs nothing, it predicts a pack.
SELECT_HELP = {
    "replicate": "as for fanstore-pack: the sample is stratified by group too (and with --nodes, these files are on "
                 "every node)",
    "workers": "compression processes the pack will use, for its estimated time (default: {default})",
}
