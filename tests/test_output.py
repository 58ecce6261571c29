"""Output that adds up: each message that once did not (issue 33) is checked here, one test a message, through the
real CLI on small real files where a command prints it. Sizes in one unit family (SI: kB, MB, GB, as speeds in
MB/s), counts with their plural, speeds that leave out what they do not measure, reasons that agree with the table
beside them, '-' where a figure would mean nothing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli
from fanstore import PackOptions, pack
from fanstore.core.units import format_bytes, parse_size, plural, size_option
from selector import Budget
from selector.measure import Measurement
from selector.policy import NONE_SPEC, choose
from selector.units import decimal_bytes, format_seconds
from selector.units import size_option as selector_size_option

BINARY_UNIT = re.compile(r"\d ?[KMGTP]iB\b")  # a size printed in powers of 1024 (an option echoed as given aside)


def _one_file(tmp_path: Path) -> Path:
    src = tmp_path / "one"
    src.mkdir()
    (src / "a.txt").write_text("hello\n" * 1000)
    return src


def _mixed(tmp_path: Path) -> Path:
    """Text that compresses, random bytes that do not, an empty file."""
    rng = np.random.default_rng(33)
    src = tmp_path / "mixed"
    (src / "text").mkdir(parents=True)
    for number in range(6):
        (src / "text" / f"{number}.txt").write_text(" ".join(map(str, rng.integers(0, 50, 2000))))
    (src / "noise.bin").write_bytes(rng.integers(0, 256, 150_000, np.uint8).tobytes())
    (src / "empty.txt").write_bytes(b"")
    return src


def _without_option_echoes(text: str) -> str:
    """The output less the options it echoes as given (`--chunk-size 64MiB`), which are exact, not sizes read."""
    return re.sub(r"--[a-z-]+ \d+[KMGTP]iB", "", text)


def test_sizes_print_in_one_family_the_same_as_the_selectors() -> None:
    counts = [0, 17, 999, 999.6, 1000, 1234, 6000, 999_950, 12_700_000, 950e6, 1.5e9, 12.3e9, 4.2e12, 7e15, 2e18]
    assert [format_bytes(count) for count in counts] == [decimal_bytes(count) for count in counts]
    assert [format_bytes(count) for count in (17, 1234, 999_950, 12_700_000, 1.5e9)] == \
        ["17 B", "1.23 kB", "1 MB", "12.7 MB", "1.5 GB"]  # 999.95 kB rounds up to the next unit, not to 1e+03 kB


def test_an_option_is_echoed_as_the_option_takes_it_exactly() -> None:
    assert [size_option(count) for count in (64 << 20, 1 << 20, 500 * 10**9, 4096, 1000, 4097)] == \
        ["64MiB", "1MiB", "500GB", "4KiB", "1kB", "4097"]
    assert all(parse_size(size_option(count)) == count for count in (64 << 20, 500 * 10**9, 4097, 3 << 30, 1536))


def test_a_suggested_option_is_given_as_the_option_was_given(tmp_path: Path) -> None:
    """select --fit 10MB --nodes 2 suggested `fanstore plan DEST --nodes 2 --local-capacity 10000000`: the --fit
    given back in bytes, where the output echoes an option as the option takes it (docs/OUTPUT.md)."""
    counts = (64 << 20, 1 << 20, 500 * 10**9, 4096, 1000, 4097, 10**7, 3 << 40, 1536 << 30)
    assert [selector_size_option(count) for count in counts] == [size_option(count) for count in counts]
    out = run_cli("select", str(_one_file(tmp_path)), "--fit", "10MB", "--nodes", "2", "--workers", "1",
                  check=True).stdout
    assert "`fanstore plan DEST --nodes 2 --local-capacity 10MB` checks" in out, out


def test_counts_take_their_plural() -> None:
    assert [plural(1, "file"), plural(2, "file"), plural(1883, "chunk"), plural(0, "batch", "batches")] == \
        ["1 file", "2 files", "1,883 chunks", "0 batches"]


def test_pack_says_one_file_into_one_chunk_in_the_units_info_uses(tmp_path: Path) -> None:
    """Was: 'packed 1 files into 1 chunks: 5.9 KiB raw', and stored sizes in MiB beside the selector's MB."""
    dest = tmp_path / "ds"
    packed = run_cli("fanstore-pack", str(_one_file(tmp_path)), str(dest), "--workers", "1", "--quiet", check=True)
    assert packed.stdout.startswith("packed 1 file into 1 chunk: 6 kB raw, "), packed.stdout
    stored = re.search(r", (\S+ \S*B) stored,", packed.stdout)[1]
    info = run_cli("info", str(dest), check=True).stdout
    assert re.search(rf"^stored bytes [\d,]+ \({re.escape(stored)}\)$", info, re.M), info
    assert not BINARY_UNIT.search(packed.stdout + _without_option_echoes(info)), packed.stdout + info


def test_the_pack_speed_leaves_out_the_codec_selection(tmp_path: Path) -> None:
    """Was: '7.5 s, 3.0 MB/s' for a --codec auto pack whose selection took most of the 7.5 s."""
    src = _mixed(tmp_path)
    summary = pack(src, tmp_path / "api", PackOptions(codec="auto", budget=0.0, workers=1))
    assert 0 < summary.selection_seconds < summary.seconds
    assert summary.mb_per_s == pytest.approx(summary.raw_bytes / 1e6 / (summary.seconds - summary.selection_seconds))
    proc = run_cli("fanstore-pack", str(src), str(tmp_path / "cli"), "--codec", "auto", "--budget", "0", "--workers",
                   "1", "--quiet", check=True)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("packed "))
    assert re.search(r", [\d.]+ s at [\d,.]+ MB/s after [\d.]+ s choosing codecs, 0 skipped$", line), line
    plain = run_cli("fanstore-pack", str(src), str(tmp_path / "plain"), "--workers", "1", "--quiet", check=True)
    assert "choosing codecs" not in plain.stdout and " MB/s, 0 skipped" in plain.stdout, plain.stdout


def _measured(spec: str, ratio: float, encode_mbps: float) -> Measurement:
    return Measurement("text", spec, 10, 1_000_000, round(1_000_000 / ratio), encode_mbps, 500.0)


def test_the_reason_names_the_faster_packer_when_a_tie_keeps_the_smaller() -> None:
    """Was: 'the fastest to pack of the 3' for a setting the table showed packing slowest of them (within 25% of
    the fastest, which counts as a tie, so the smaller stored size won)."""
    smallest = _measured("zstd:9", 4.00, 80)  # 1 MB at 80 MB/s: 0.0125 s
    faster = _measured("zstd:6", 3.99, 95)  # 0.0105 s: faster, but by less than 25%
    choice = choose("text", [_measured(NONE_SPEC, 1.0, 5000), smallest, faster], Budget(0))
    assert choice.spec == "zstd:9"
    assert "the fastest to pack" not in choice.reason, choice.reason
    assert "of the 2 within 1.0% of it, zstd:6 packs faster (0.0105 s), but this takes at most 25% longer, which " \
           "counts as a tie, and stores less" in choice.reason, choice.reason
    quick = choose("text", [smallest, _measured("zstd:6", 3.99, 200)], Budget(0))
    assert quick.spec == "zstd:6" and "and the fastest to pack of the 2 within 1.0% of the best" in quick.reason


def test_pack_times_keep_three_significant_digits() -> None:
    """Was: every 'pack s' 0.0 on a small tree, so the reason's 'fastest to pack' could not be checked."""
    assert [format_seconds(seconds) for seconds in (0, 0.000523, 0.0125, 0.25, 9.999, 12.5, 1234.4)] == \
        ["0", "0.000523", "0.0125", "0.250", "10.0", "12.5", "1,234"]


def test_select_prints_a_dash_where_a_figure_means_nothing(tmp_path: Path) -> None:
    """Was: '8,030,711 MB/s' decode for data stored as it is, 'meets budget: yes' with no budget, an empty 'sample'
    column and '1 files'."""
    proc = run_cli("select", str(_mixed(tmp_path)), "--fit", "10MB", "--workers", "1", check=True)
    out = proc.stdout
    header = next(line for line in out.splitlines() if line.strip().startswith("spec"))
    assert header.split()[-2:] == ["meets", "budget"], header  # no 'sample' column: every setting saw the sample
    cells_of = [line.replace("  *  ", "     ").split() for line in out.splitlines()]
    rows = [cells for cells in cells_of if len(cells) > 5 and re.fullmatch(r"\d+\.\d\d", cells[1])]  # a ratio
    assert rows, out
    for spec, _, _, decode, encode, *_, pack_seconds, meets in rows:  # (the stored sizes take two cells each)
        assert meets == "-", (spec, out)  # no --budget, no --pack-speed: no floor to meet
        if spec == NONE_SPEC:
            assert (decode, encode, pack_seconds) == ("-", "-", "-"), (spec, out)
    other = out[out.index("\nother: 1 file,"):].split("\n\n")[0]
    decodes = [line.replace("  *  ", "     ").split()[3] for line in other.splitlines()[3:-1]]
    assert len(decodes) > 5 and set(decodes) == {"-"}, other
    assert not BINARY_UNIT.search(out), out


def test_select_on_one_file_and_one_node_says_them_in_the_singular(tmp_path: Path) -> None:
    """Was: 'estimated pack time of SRC (1 files, ...)' and '--fit 1 MB on each of 1 nodes'."""
    out = run_cli("select", str(_one_file(tmp_path)), "--fit", "1MB", "--nodes", "1", "--workers", "1",
                  check=True).stdout
    assert "estimated pack time of SRC (1 file, " in out and "--fit 1 MB on each of 1 node: " in out, out
    assert not re.search(r"\b1 (files|nodes)\b", out), out


def test_info_names_no_codec_with_no_files_as_a_count_and_echoes_the_chunk_size(tmp_path: Path) -> None:
    """Was: 'zstd:19 0 files, 0 B -> 0 B (1.00x)', '--chunk-size 67108864' and 'skipped 0 path(s)'."""
    src = tmp_path / "noise"
    src.mkdir()
    (src / "a.bin").write_bytes(np.random.default_rng(1).integers(0, 256, 50_000, np.uint8).tobytes())
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(src), str(dest), "--codec", "zstd:19", "--workers", "1", "--quiet", check=True)
    info = run_cli("info", str(dest), check=True).stdout
    codecs = info[info.index("codecs:\n"):].split("\n\n")[0].splitlines()[1:]
    assert [line.split()[:3] for line in codecs] == [["none", "1", "file,"], ["zstd:19", "no", "files:"]], info
    assert codecs[1].endswith("it made none of the files given it smaller, so they are stored as is"), info
    assert "packed with   --codec zstd:19 --chunk-size 64MiB --block-size 1MiB --blocks-above 4MiB\n" in info, info
    assert "\nskipped      none" in info, info


def test_info_counts_a_file_stored_in_blocks_under_each_of_its_blocks_codecs(tmp_path: Path) -> None:
    """A 12 MiB file whose first block is random (stored as is) and the rest zeros (zstd): info said 'none 1 file,
    12.6 MB stored as is' and 'zstd:3 no files: it made none of the files given it smaller', of a dataset storing
    1.05 MB. Each block counts under the codec that stored it."""
    src = tmp_path / "src"
    src.mkdir()
    random_block = np.random.default_rng(2).integers(0, 256, 1 << 20, np.uint8).tobytes()
    (src / "a.bin").write_bytes(random_block + bytes(11 << 20))
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(src), str(dest), "--codec", "zstd:3", "--workers", "1", "--quiet", check=True)
    info = run_cli("info", str(dest), check=True).stdout
    codecs = info[info.index("codecs:\n"):].split("\n\n")[0].splitlines()[1:]
    assert codecs[0].split() == ["none", "1", "block", "of", "1", "file", "stored", "in", "blocks,", "1.05", "MB",
                                 "stored", "as", "is"], info
    assert codecs[1].startswith("  zstd:3  11 blocks of 1 file stored in blocks, 11.5 MB -> "), info


def test_info_gives_every_option_the_bytes_depend_on_so_the_same_pack_has_nothing_to_do(tmp_path: Path) -> None:
    """Was: 'packed with --codec zstd:3 --chunk-size 1MiB --replicate val/**', no --block-size or --blocks-above
    (packed with 64KiB and 256KiB), and a glob a shell would expand: the command pasted back packed it again."""
    src = tmp_path / "src"
    (src / "val").mkdir(parents=True)
    (src / "val" / "big.bin").write_bytes(bytes(range(256)) * 2_000)
    (src / "small.txt").write_text("small\n")
    dest = tmp_path / "ds"
    options = ["--chunk-size", "1MiB", "--block-size", "64KiB", "--blocks-above", "256KiB", "--replicate", "val/**"]
    run_cli("fanstore-pack", str(src), str(dest), *options, "--quiet", check=True)
    info = run_cli("info", str(dest), check=True).stdout
    line = next(line for line in info.splitlines() if line.startswith("packed with"))
    assert line == "packed with   --codec zstd:3 " + " ".join(options[:-1]) + " 'val/**'", info
    again = subprocess.run(f"{shlex.quote(sys.executable)} -m fanstore pack {src} {dest} "
                           + line.removeprefix("packed with"), shell=True, capture_output=True, text=True,
                           cwd=src, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert again.returncode == 0 and again.stdout.startswith("nothing to do"), again.stdout + again.stderr


def test_info_says_a_kind_stored_as_is_decodes_nothing(tmp_path: Path) -> None:
    """Was: 'other none predicted 1.00x at 312,657 MB/s decode'."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(_mixed(tmp_path)), str(dest), "--codec", "auto", "--fit", "10MB", "--workers", "1",
            "--quiet", check=True)
    info = run_cli("info", str(dest), check=True).stdout
    assert "codec selection (--codec auto): --fit 10 MB, no decode floor (no --budget); sample " in info, info
    chosen = [line.split(None, 2) for line in info[info.index("codec selection"):].splitlines()[1:]]
    assert chosen and all(figures == "stored as is: nothing to decode" for _, spec, figures in chosen
                          if spec == NONE_SPEC), info
    assert any(spec == NONE_SPEC for _, spec, _ in chosen), info  # --fit with room to spare: the fastest decode


def test_verify_and_plan_count_in_the_singular(tmp_path: Path) -> None:
    """Was: 'checked 1 files' and '1 nodes store none'."""
    dest = tmp_path / "ds"
    run_cli("fanstore-pack", str(_one_file(tmp_path)), str(dest), "--workers", "1", "--quiet", check=True)
    assert run_cli("verify", str(dest), check=True).stdout == "checked 1 file (6 kB): 0 bad\n"
    plan = run_cli("plan", str(dest), "--nodes", "2", check=True).stdout
    assert "; 1 node stores none\n" in plan and "(0 pieces)" in plan, plan


def test_serve_stats_count_blobs_and_say_so() -> None:
    """Was: 'reads from local chunks 387' and 'from rank 1: 2625 (2.6 MiB)': counts of what, unsaid, unseparated."""
    pytest.importorskip("mpi4py", reason="fanstore.serve needs mpi4py")
    from fanstore.serve.job_stats import format_rank, format_totals

    peer = {"fetched": 1496, "fetched_bytes": 2_150_000, "asked": 1, "served": 1, "served_bytes": 2_140_000,
            "failed": 0, "refused": 0}
    stats = {"rank": 0, "host": "vm", "reads": {"local": 387, "local_bytes": 2_390_000, "fallback": 0,
                                                "fallback_bytes": 0, "peers": {"1": peer}},
             "staging": {"dest_bytes": 2_390_000, "received_bytes": 0, "sent_bytes": 246_000, "reused_bytes": 0,
                         "seconds": 0.1, "bad_blobs": 1}}
    assert format_rank(stats).splitlines() == [
        "rank 0 (vm): 387 blobs read from local chunks (2.39 MB); doorbell off",
        "  from rank 1: 1,496 blobs (2.15 MB) in 1 request; to rank 1: 1 blob (2.14 MB); failed 0, refused 0",
        "  from DEST (fallback): 0 blobs (0 B)",
        "  staging: 2.39 MB from DEST, 0 B from peers, 246 kB to peers, 0 B reused, 0.1 s, 1 bad blob"]
    assert format_totals([stats]) == ("job (1 rank): blobs read 387 local, 1,496 from peers (2.15 MB), 0 from DEST; "
                                       "bytes read from DEST: 2.39 MB staging (2,390,000 B), 0 B during the epochs "
                                       "(0 B)")


def test_serve_stats_say_how_many_remote_blobs_the_readers_were_lent() -> None:
    pytest.importorskip("mpi4py", reason="fanstore.serve needs mpi4py")
    from fanstore.serve.job_stats import format_rank

    stats = {"rank": 1, "host": "vm", "reads": {"local": 0, "local_bytes": 0, "fallback": 0, "fallback_bytes": 0,
                                                "peers": {}},
             "ahead": {"asked": 10, "fetched_ahead": 10, "ahead_hits": 9, "ahead_joined": 2, "lent": 8,
                       "not_lent": 2, "arena_full": 1},
             "staging": {"dest_bytes": 0, "received_bytes": 0, "sent_bytes": 0, "reused_bytes": 0, "seconds": 0.1,
                         "bad_blobs": 0}}
    lines = format_rank(stats).splitlines()
    assert "  to fanstore.torch readers: 8 remote blobs lent in the node's arena, 2 sent through the socket (1 "\
           "receive found the arena full)" in lines, lines
    del stats["ahead"]["arena_full"]
    assert "  to fanstore.torch readers: 8 remote blobs lent in the node's arena, 2 sent through the socket" \
        in format_rank(stats).splitlines()
    assert "  fetched ahead on this node (mount and fanstore.torch readers): 10 blobs; reads asked for 10 remote " \
           "blobs, 9 of them fetched ahead (2 waited for theirs on its way)" in lines, lines
    stats["ahead"]["ahead_joined_failed"] = 1  # no hit: its reader read the blob itself
    assert ("  fetched ahead on this node (mount and fanstore.torch readers): 10 blobs; reads asked for 10 remote "
            "blobs, 9 of them fetched ahead (2 waited for theirs on its way); 1 read waited for one whose fetch "
            "failed (read again by its reader)") in format_rank(stats).splitlines()


def test_serve_stats_say_how_many_accepts_failed_for_want_of_a_descriptor() -> None:
    pytest.importorskip("mpi4py", reason="fanstore.serve needs mpi4py")
    from fanstore.serve.job_stats import format_rank

    stats = {"rank": 0, "host": "vm", "reads": {"local": 0, "local_bytes": 0, "fallback": 0, "fallback_bytes": 0,
                                                "peers": {}},
             "ahead": {"refused": 0, "turned_away": 2, "out_of_descriptors": 3},
             "staging": {"dest_bytes": 0, "received_bytes": 0, "sent_bytes": 0, "reused_bytes": 0, "seconds": 0.1,
                         "bad_blobs": 0}}
    assert "  the node's readers: 0 requests refused (malformed), 2 connections turned away (over the limit), 3 "\
           "accepts failed for want of a file descriptor" in format_rank(stats).splitlines()


def test_serve_stats_count_what_fanstore_torch_readers_read_themselves() -> None:
    """A job whose readers read half their files from the node's own chunks said `0 local` in its totals: those
    reads never pass through the serve process. The readers tell it (COUNTS), and both lines say them."""
    pytest.importorskip("mpi4py", reason="fanstore.serve needs mpi4py")
    from fanstore.serve.job_stats import format_rank, format_totals

    stats = {"rank": 0, "host": "vm", "reads": {"local": 3, "local_bytes": 300, "fallback": 1, "fallback_bytes": 10,
                                                "peers": {"1": {"fetched": 40, "fetched_bytes": 4000, "asked": 2,
                                                                "served": 0, "served_bytes": 0, "failed": 0,
                                                                "refused": 0}}},
             "ahead": {"readers_local": 37, "readers_local_bytes": 3700, "readers_dest": 2, "readers_dest_bytes": 20},
             "staging": {"dest_bytes": 0, "received_bytes": 0, "sent_bytes": 0, "reused_bytes": 0, "seconds": 0.1,
                         "bad_blobs": 0}}
    assert "  read by fanstore.torch readers themselves: 37 blobs from local chunks (3.7 kB), 2 blobs from DEST " \
           "(20 B)" in format_rank(stats).splitlines()
    assert format_totals([stats]) == ("job (1 rank): blobs read 40 local, 40 from peers (4 kB), 3 from DEST; bytes "
                                      "read from DEST: 0 B staging (0 B), 30 B during the epochs (30 B)")
