"""A --fit pack that the selection accepted but that can no longer fit while packing stops there, through the real
CLI: one line naming --fit, the exit status of a refused --fit pack, and DEST as the command found it. The tree
fools the sample honestly, nothing patched: one large file whose blocks the sample measures are zeros and whose
other blocks are random, so the selection predicts a few kB and the pack stores megabytes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, dir_bytes, run_cli
from fanstore.errors import EXIT_DOES_NOT_FIT
from fanstore.errors import DoesNotFit
from fanstore.pack.fit_watch import FitWatch
from fanstore.core.format import INDEX_HEADER_LEN
from fanstore.pack.groups import GroupPlan
from fanstore.pack.journal import JOURNAL_DIR
from fanstore.pack.walk import walk_source
from selector.fit import Need
from selector.sample import PIECE_BYTES, draw_sample

FOOLING_BYTES = 24 << 20  # three batches of the packer (8 MiB each): the first already breaks --fit
FIT = ["--fit", "4MB"]


def write_fooling_tree(root: Path) -> list[int]:
    """SRC with one file of random bytes but for the blocks the selector's sample (default --sample and --seed)
    measures, which are zeros; returns their offsets. Which blocks are drawn depends on the path, size and seed
    only, so they are found on the random file and zeroed after."""
    root.mkdir()
    path = root / "big.bin"
    data = bytearray(np.random.default_rng(33).integers(0, 256, FOOLING_BYTES, dtype=np.uint8).tobytes())
    path.write_bytes(data)

    def drawn() -> list[int]:
        return sorted(f.offset for f in draw_sample(root, walk_source(root).files, GroupPlan(()).group_of))

    offsets = drawn()
    for offset in offsets:
        data[offset : offset + PIECE_BYTES] = bytes(PIECE_BYTES)
    path.write_bytes(data)
    assert drawn() == offsets and len(offsets) < FOOLING_BYTES // PIECE_BYTES // 4
    return offsets


@pytest.fixture(scope="module")
def fooling_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("fooling") / "src"
    write_fooling_tree(src)
    return src


def listing(dest: Path) -> dict[str, bytes] | None:
    """Every path under DEST (directories too) and each file's bytes; None when DEST does not exist."""
    if not dest.exists():
        return None
    return {**{p.relative_to(dest).as_posix() + "/": b"" for p in dest.rglob("*") if p.is_dir()}, **dir_bytes(dest)}


def assert_stopped(proc: subprocess.CompletedProcess, fit_words: str, stored_words: str, dest_words: str) -> None:
    """Accepted by the selection (its prediction announced), then stopped while packing in one line."""
    assert proc.returncode == EXIT_DOES_NOT_FIT, proc.stdout + proc.stderr
    assert "predicted: " in proc.stdout and "packed " not in proc.stdout, proc.stdout
    assert_one_line_error(proc, f"{fit_words}: the pack stopped, it can no longer fit: ", stored_words,
                          "MB raw, where the selection predicted ", dest_words)


@pytest.mark.parametrize("found", ["no DEST (nor its parent)", "an empty DEST"])
def test_a_pack_that_breaks_its_fit_stops_and_leaves_dest_as_it_found_it(fooling_tree: Path, tmp_path: Path,
                                                                         found: str) -> None:
    dest = tmp_path / "parent" / "ds"
    if found == "an empty DEST":
        dest.mkdir(parents=True)
    before = listing(dest)
    proc = run_cli("fanstore-pack", str(fooling_tree), str(dest), "--codec", "auto", *FIT, "--quiet")
    assert_stopped(proc, "--fit 4 MB", "MB stored already (chunk files and the index) after 8.39 MB of 25.2 MB raw",
                   "DEST does not exist, as before" if before is None else "DEST is as it was")
    assert listing(dest) == before
    if before is None:
        assert not dest.parent.exists(), "the parent the pack created for DEST is removed too"


def test_with_nodes_the_mean_of_the_nodes_is_watched(fooling_tree: Path, tmp_path: Path) -> None:
    """Per node, the pack knows the least the fullest node stores: the replicated chunks and the spread ones / N."""
    dest = tmp_path / "ds"
    proc = run_cli("fanstore-pack", str(fooling_tree), str(dest), "--codec", "auto", *FIT, "--nodes", "2", "--quiet")
    assert_stopped(proc, "--fit 4 MB --nodes 2", "each node would store 4.19 MB or more (0 B replicated + 8.39 MB "
                   "spread / 2)", "DEST does not exist, as before")
    assert not dest.exists()


def test_a_stopped_pack_over_a_dataset_with_force_says_the_dataset_is_gone(fooling_tree: Path,
                                                                           tmp_path: Path) -> None:
    """--force removes the dataset it replaces before packing: the stopped pack removes its own files and says so."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(fooling_tree), str(dest), "--codec", "lz4", "--quiet", check=True)
    proc = run_cli("fanstore-pack", str(fooling_tree), str(dest), "--codec", "auto", *FIT, "--force", "--quiet")
    assert_stopped(proc, "--fit 4 MB", "stored already",
                   "DEST holds no dataset: the one it held was removed before packing (--force)")
    assert [path for path in dest.rglob("*") if not path.is_dir()] == []


def test_a_resumed_pack_that_breaks_its_fit_keeps_the_interrupted_pack(fooling_tree: Path, tmp_path: Path,
                                                                       paused_pack) -> None:
    """The interrupted run's chunks and journal were there before the command: only this run's go."""
    dest = tmp_path / "ds"
    arguments = ["--codec", "auto", *FIT, "--chunk-size", "1MiB", "--workers", "1", "--quiet"]
    paused_pack(fooling_tree, dest, arguments, "chunk:1").kill_group()  # chunk 0 written and journaled
    before = listing(dest)
    assert before is not None and "chunks/00000000.fsc" in before and f"{JOURNAL_DIR}/chunk-00000000.json" in before
    proc = run_cli("fanstore-pack", str(fooling_tree), str(dest), *arguments)
    assert_stopped(proc, "--fit 4 MB", "stored already",
                   "this run's chunks are removed: DEST holds the interrupted pack as it was")
    assert listing(dest) == before


def _watch(nodes: int = 0, replicated: frozenset[int] = frozenset()) -> FitWatch:
    return FitWatch.for_pack(1000, nodes, replicated, index_entries_bytes=100, dictionary_bytes=50, raw_total=5000,
                             predicted=Need(total=900.0, replicated=0.0, spread=900.0, nodes=nodes))


def test_the_watch_stops_only_once_the_floor_is_past_the_fit() -> None:
    """Without --nodes: chunk files + the index's header, entries and dictionaries; at --fit exactly, it fits."""
    watch = _watch()
    at_fit = 1000 - INDEX_HEADER_LEN - 150
    watch.check({0: at_fit - 300, 1: 300}, raw_done=2000)
    with pytest.raises(DoesNotFit, match=r"^--fit 1 kB: the pack stopped, .* after 2 kB of 5 kB raw, where the "
                                         r"selection predicted 900 B$"):
        watch.check({0: at_fit - 299, 1: 300}, raw_done=2000)


def test_with_nodes_the_watch_counts_replicated_bytes_whole_and_spread_bytes_shared() -> None:
    watch = _watch(nodes=4, replicated=frozenset({1}))
    watch.check({0: 4 * 700, 1: 300}, raw_done=1)  # 300 + 700: at --fit; the index is not staged, not counted
    with pytest.raises(DoesNotFit, match=r"each node would store 1 kB or more \(301 B replicated \+ 2.8 kB spread "
                                         r"/ 4\)"):
        watch.check({0: 4 * 700, 1: 301}, raw_done=1)
    with pytest.raises(DoesNotFit, match=r"--nodes 4: .*1 kB or more"):
        watch.check({0: 4 * 700 + 1, 1: 300}, raw_done=1)
