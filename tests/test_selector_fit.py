"""The dual objective and pack time: --fit (total and per node), the tolerance rule, --pack-speed, the pack-time
estimate, and their bad input. The policy is tested on measurements fed to it, never on timing in the test; the
command line on a small tree, where only the options' handling is checked."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from compressors import DICT_TRAIN_FILE_BYTES, DICT_TRAIN_FILES, DICT_TRAIN_TOTAL_BYTES, codec_from_spec, training_draw
from conftest import assert_one_line_error, run_cli
from selector import Budget, DoesNotFit, Goal, Selection, SelectionError
from selector.estimate import (FIXED_SECONDS, HEAD_READ_SECONDS_PER_FILE, HEAD_READ_SECONDS_PER_MB,
                               READ_SECONDS_PER_FILE, READ_SECONDS_PER_MB, WALK_SECONDS_PER_FILE, WRITE_SECONDS_PER_MB,
                               estimate_pack, files_by_group, kind_scales, training_heads, usable_workers)
from selector.fit import choose_to_fit, need_of
from selector.measure import TRAIN_FIXED_SECONDS, Measurement, measure_kind
from selector.policy import NONE_SPEC, KindScale, choose
from selector.sample import SampleFile
from selector.units import decimal_bytes

RAW = 1_000_000  # bytes of every fed measurement's sample


def measured(kind: str, spec: str, ratio: float, decode_mbps: float, encode_mbps: float = 100.0,
             train_seconds: float = 0.0) -> Measurement:
    """A measurement as measure_kind would give it, with these figures."""
    return Measurement(kind, spec, 10, RAW, round(RAW / ratio), encode_mbps, decode_mbps,
                       train_seconds=train_seconds, train_bytes=RAW if train_seconds else 0)


def grid(kind: str) -> list[Measurement]:
    """`none`, a fast weak codec and a slow strong one."""
    return [measured(kind, NONE_SPEC, 1.0, 20_000, 5_000), measured(kind, "lz4", 2.0, 2_000, 500),
            measured(kind, "zstd:19", 4.0, 400, 2)]


SCALES = {"npy": KindScale(2_000_000_000), "text": KindScale(1_000_000_000)}
MEASUREMENTS = grid("npy") + grid("text")


def specs(choices: dict) -> dict[str, str]:
    return {kind: choice.spec for kind, choice in choices.items()}


# --- --fit -----------------------------------------------------------------------------------------------------------

def test_a_fit_only_the_strongest_settings_meet_chooses_them() -> None:
    strongest = 2_000_000_000 / 4 + 1_000_000_000 / 4
    choices = choose_to_fit(MEASUREMENTS, SCALES, Budget(0), Goal(fit_bytes=round(strongest)))
    assert specs(choices) == {"npy": "zstd:19", "text": "zstd:19"}
    assert all("needed to fit" in choice.reason for choice in choices.values())


def test_a_fit_everything_meets_chooses_the_fastest_decoder() -> None:
    choices = choose_to_fit(MEASUREMENTS, SCALES, Budget(0), Goal(fit_bytes=10**12))
    assert specs(choices) == {"npy": NONE_SPEC, "text": NONE_SPEC}
    assert all("decodes fastest" in choice.reason and choice.meets_budget for choice in choices.values())


def test_a_fit_moves_the_kind_that_saves_most_per_second_of_decoding_first() -> None:
    # At none both kinds store 3 GB; lz4 saves 1 GB of npy for 1 s of decoding, 0.5 GB of text for 0.5 s: a tie
    # in rate, so the larger saving goes first, and it is enough.
    choices = choose_to_fit(MEASUREMENTS, SCALES, Budget(0), Goal(fit_bytes=2_100_000_000))
    assert specs(choices) == {"npy": "lz4", "text": NONE_SPEC}
    # Slower npy decoding makes text's step the better buy.
    slow_npy = [m if m.spec != "lz4" or m.kind != "npy" else measured("npy", "lz4", 2.0, 500, 500)
                for m in MEASUREMENTS]
    choices = choose_to_fit(slow_npy, SCALES, Budget(0), Goal(fit_bytes=2_600_000_000))
    assert specs(choices) == {"npy": NONE_SPEC, "text": "lz4"}


def test_a_fit_steps_back_a_kind_the_last_move_made_unnecessary() -> None:
    # text moves first (cheap step), then npy must jump; once npy is strong, text fits at none again.
    scales = {"npy": KindScale(2_000_000_000), "text": KindScale(100_000_000)}
    measurements = [measured("npy", NONE_SPEC, 1.0, 20_000), measured("npy", "zstd:19", 4.0, 400),
                    measured("text", NONE_SPEC, 1.0, 20_000), measured("text", "lz4", 1.1, 10_000)]
    choices = choose_to_fit(measurements, scales, Budget(0), Goal(fit_bytes=700_000_000))
    assert specs(choices) == {"npy": "zstd:19", "text": NONE_SPEC}


def test_an_impossible_fit_says_by_how_much_in_one_line() -> None:
    scales = {"text": KindScale(24_600_000_000)}
    measurements = [measured("text", NONE_SPEC, 1.0, 20_000), measured("text", "zstd:19", 2.0, 400)]
    with pytest.raises(DoesNotFit) as caught:
        choose_to_fit(measurements, scales, Budget(0), Goal(fit_bytes=10_000_000_000))
    assert str(caught.value) == "--fit 10 GB: the strongest settings store 12.3 GB, 2.3 GB (23%) over"
    with pytest.raises(DoesNotFit, match=r"that meet --budget 1,000 MB/s store 24.6 GB, .* over"):
        choose_to_fit(measurements, scales, Budget(1e9), Goal(fit_bytes=10_000_000_000))


def test_the_budget_is_a_floor_under_fit() -> None:
    choices = choose_to_fit(MEASUREMENTS, SCALES, Budget(1e9), Goal(fit_bytes=1_600_000_000))
    assert specs(choices) == {"npy": "lz4", "text": "lz4"}  # zstd:19 would fit better but decodes too slowly


def test_per_node_fit_counts_replicated_bytes_on_every_node() -> None:
    # 1 GB replicated and 4 GB spread on 4 nodes: 2 GB a node. Halving the replicated kind saves 0.5 GB a node for
    # 1 s of decoding; halving the spread kind saves as much a node (2 GB / 4) for 4 s.
    scales = {"text": KindScale(1_000_000_000, replicated_bytes=1_000_000_000), "npy": KindScale(4_000_000_000)}
    measurements = [measured(kind, spec, ratio, speed) for kind in ("text", "npy")
                    for spec, ratio, speed in ((NONE_SPEC, 1.0, 20_000), ("zstd:3", 2.0, 1_000))]
    goal = Goal(fit_bytes=1_600_000_000, nodes=4)
    choices = choose_to_fit(measurements, scales, Budget(0), goal)
    assert specs(choices) == {"npy": NONE_SPEC, "text": "zstd:3"}
    need = need_of({kind: choice.measurement for kind, choice in choices.items()}, scales, goal)
    assert need.bytes == 500_000_000 + 1_000_000_000
    assert need.describe() == "1.5 GB per node (500 MB replicated + 4 GB spread / 4)"
    with pytest.raises(DoesNotFit, match=r"^--fit 900 MB --nodes 4: the strongest settings store 1 GB per node"):
        choose_to_fit(measurements, scales, Budget(0), Goal(fit_bytes=900_000_000, nodes=4))


def test_spread_bytes_round_up_per_node() -> None:
    need = need_of({"text": None}, {"text": KindScale(10)}, Goal(fit_bytes=5, nodes=3))
    assert need.bytes == 4  # ceil(10 / 3)


# --- the tolerance rule and --pack-speed --------------------------------------------------------------------------

def test_the_tolerance_rule_picks_the_faster_of_two_near_equal_settings() -> None:
    strong_slow = measured("text", "zstd:19", 4.00, 500, encode_mbps=2)
    near_fast = measured("text", "zstd:9", 3.97, 500, encode_mbps=40)  # stores 0.8% more
    pair = [measured("text", NONE_SPEC, 1.0, 20_000), strong_slow, near_fast]
    assert choose("text", pair, Budget(0)).spec == "zstd:9"
    assert "the fastest to pack of the 2" in choose("text", pair, Budget(0)).reason
    assert choose("text", pair, Budget(0), goal=Goal(tolerance=0)).spec == "zstd:19"
    far_fast = measured("text", "zstd:9", 3.90, 500, encode_mbps=40)  # stores 2.6% more
    assert choose("text", [strong_slow, far_fast], Budget(0)).spec == "zstd:19"
    assert choose("text", [strong_slow, far_fast], Budget(0), goal=Goal(tolerance=0.03)).spec == "zstd:9"


def test_the_tolerance_rule_counts_dictionary_training() -> None:
    # zstd-dict:19 encodes faster than zstd:19 here, but training its dictionaries on 1 GB takes about 8 s.
    with_dict = measured("text", "zstd-dict:19", 4.00, 500, encode_mbps=3, train_seconds=0.02)
    plain = measured("text", "zstd:19", 3.98, 500, encode_mbps=2)
    scale = KindScale(10_000_000, train_bytes=1_000_000_000)
    assert scale.pack_seconds(with_dict, 1) == pytest.approx(10 / 3 + with_dict.train_seconds_for(1_000_000_000, 1))
    assert with_dict.train_seconds_for(1_000_000_000, 1) > 10 / 2  # slower than zstd:19 compressing it all
    assert choose("text", [with_dict, plain], Budget(0), scale=scale).spec == "zstd:19"
    assert choose("text", [with_dict, plain], Budget(0), scale=KindScale(10_000_000)).spec == "zstd-dict:19"


def test_dictionary_training_time_is_a_fixed_cost_and_n_log_n_in_the_bytes() -> None:
    def n_log_n(n: float) -> float:
        return n * math.log2(n)

    # The selector's two trainings, of half a MB each, took 0.1 s: 0.06 s of it beyond their fixed costs.
    m = measured("text", "zstd-dict:9", 4.0, 500, train_seconds=2 * TRAIN_FIXED_SECONDS + 0.06)
    assert m.train_seconds_for(RAW // 2, 1) == pytest.approx(TRAIN_FIXED_SECONDS + 0.03)
    # 100 MB in 3 dictionaries: 3 fixed costs, and each dictionary's bytes grow the rest as n log n, so more than
    # 100 times the selector's growing part, and far less than 100 times its whole time.
    many = m.train_seconds_for(100 * RAW, 3)
    assert many == pytest.approx(3 * (TRAIN_FIXED_SECONDS + 0.03 * n_log_n(100 * RAW / 3) / n_log_n(RAW / 2)))
    assert 100 * 0.06 < many - 3 * TRAIN_FIXED_SECONDS < 100 * 0.1
    assert m.train_seconds_for(0, 3) == 0 and measured("text", "zstd:9", 4.0, 500).train_seconds_for(RAW, 1) == 0
    # Trainings faster than their fixed cost (a faster machine): a quarter of their time still counts as growing.
    quick = measured("text", "zstd-dict:9", 4.0, 500, train_seconds=TRAIN_FIXED_SECONDS)
    assert quick.train_seconds_for(RAW // 2, 1) == pytest.approx(TRAIN_FIXED_SECONDS + TRAIN_FIXED_SECONDS / 8)


def test_near_equal_pack_times_keep_the_smaller_size() -> None:
    # 20% apart in pack time could be noise: the smaller stored size stays; twice as fast is not.
    first = measured("text", "zstd:6", 4.00, 500, encode_mbps=40)
    assert choose("text", [first, measured("text", "zstd:9", 3.99, 500, encode_mbps=48)], Budget(0)).spec == "zstd:6"
    assert choose("text", [first, measured("text", "zstd:9", 3.99, 500, encode_mbps=80)], Budget(0)).spec == "zstd:9"


def test_a_kinds_ratio_weights_each_file_by_the_bytes_it_stands_for() -> None:
    rng = np.random.default_rng(5)
    text = SampleFile("a.log", "text", 0, b"the same line again\n" * 5000, weight=3.0)
    noise = SampleFile("b.bin", "text", 0, rng.integers(0, 256, 100_000, np.uint8).tobytes(), weight=1.0)
    m = measure_kind("text", [text, noise], ["zstd:3"], repeats=1)[0]
    stored_text = len(codec_from_spec("zstd:3").encode(text.data))
    weighted = (3 * stored_text + len(noise.data)) / (3 * len(text.data) + len(noise.data))
    assert m.raw_bytes == len(text.data) + len(noise.data) and m.raw_files == 1
    assert m.stored_bytes == round(m.raw_bytes * weighted)


def test_pack_speed_is_a_hard_floor() -> None:
    scale = KindScale(100_000_000)
    pair = [measured("text", NONE_SPEC, 1.0, 20_000, 5_000), measured("text", "zstd:19", 4.0, 500, encode_mbps=2),
            measured("text", "zstd:3", 3.0, 500, encode_mbps=150)]
    goal = Goal(pack_mbps=50, tolerance=0)
    assert choose("text", pair, Budget(0), goal=goal, scale=scale).spec == "zstd:3"
    # Two workers pack zstd:3 at 300 MB/s, one at 150 MB/s.
    assert choose("text", pair, Budget(0), goal=Goal(pack_mbps=200, workers=2), scale=scale).spec == "zstd:3"
    none = choose("text", pair, Budget(0), goal=Goal(pack_mbps=200, workers=1), scale=scale)
    assert none.spec == NONE_SPEC and "--pack-speed not met" in none.reason and "zstd:3" in none.reason
    fit = choose_to_fit(pair, {"text": scale}, Budget(0), Goal(fit_bytes=40_000_000, pack_mbps=50))
    assert specs(fit) == {"text": "zstd:3"}  # zstd:19 would store less, but packs at 2 MB/s
    with pytest.raises(DoesNotFit, match="that meet --pack-speed 50 MB/s store 33.3 MB"):
        choose_to_fit(pair, {"text": scale}, Budget(0), Goal(fit_bytes=30_000_000, pack_mbps=50))


# --- the estimate --------------------------------------------------------------------------------------------------

def test_the_pack_time_estimate_overlaps_the_workers_with_the_chunk_writes() -> None:
    text = measured("text", "zstd-dict:19", 4.0, 500, encode_mbps=2, train_seconds=0.5)  # 0.5 s per MB trained
    npy = measured("npy", "lz4", 2.0, 2_000, encode_mbps=500)
    scales = {"text": KindScale(100_000_000, train_bytes=4_000_000), "npy": KindScale(1_000_000_000)}
    estimate = estimate_pack({"text": text, "npy": npy, "png": None}, {**scales, "png": KindScale(5)}, 1000,
                             1_100_000_005, workers=2)
    parallel = min(2, usable_workers(0))  # at most the cores of this machine
    assert estimate.compress_seconds == pytest.approx((100 / 2 + 1000 / 500) / parallel)
    assert estimate.train_seconds == pytest.approx(text.train_seconds_for(4_000_000, 1))
    assert estimate.walk_seconds == pytest.approx(FIXED_SECONDS + 1000 * WALK_SECONDS_PER_FILE)
    assert estimate.read_seconds == pytest.approx((1000 * READ_SECONDS_PER_FILE + 1100 * READ_SECONDS_PER_MB)
                                                  / parallel)
    # What is written is what is stored: text at 4x, npy at 2x, png and the 5 bytes no kind holds as they are.
    assert estimate.write_seconds == pytest.approx((25 + 500 + 0.000005) * WRITE_SECONDS_PER_MB)
    # Compressing is slower than writing here, so it sets the time; the writes happen meanwhile.
    assert estimate.read_seconds + estimate.compress_seconds > estimate.write_seconds
    assert estimate.seconds == pytest.approx(estimate.walk_seconds + estimate.train_seconds + estimate.read_seconds
                                             + estimate.compress_seconds)
    assert "with 2 workers" in estimate.describe()
    assert 1 <= usable_workers(64) == usable_workers(0) and usable_workers(1) == 1
    # Nothing compressed, large files: writing the chunk files is the slower stage, and sets the time.
    stored_as_is = estimate_pack({"npy": None}, {"npy": KindScale(10_000_000_000)}, 10, 10_000_000_000, workers=2)
    assert stored_as_is.compress_seconds == 0 and stored_as_is.write_seconds > stored_as_is.read_seconds
    assert stored_as_is.seconds == pytest.approx(stored_as_is.walk_seconds + stored_as_is.write_seconds)
    # Other processes leaving half a core: the workers' stage on one worker's worth, the packing process's terms
    # at half speed.
    busy = estimate_pack({"text": text, "npy": npy}, scales, 1000, 1_100_000_000, workers=2,
                         others_cores=usable_workers(0) - 0.5)
    assert busy.compress_seconds == pytest.approx(100 / 2 + 1000 / 500)
    assert busy.read_seconds == pytest.approx(1000 * READ_SECONDS_PER_FILE + 1100 * READ_SECONDS_PER_MB)
    assert busy.train_seconds == pytest.approx(2 * text.train_seconds_for(4_000_000, 1))
    assert busy.walk_seconds == pytest.approx(2 * (FIXED_SECONDS + 1000 * WALK_SECONDS_PER_FILE))
    assert busy.write_seconds == pytest.approx(2 * 525 * WRITE_SECONDS_PER_MB)
    assert "other processes used" in busy.describe()


class _File:
    def __init__(self, path: str, size: int) -> None:
        self.path, self.size, self.is_file = path, size, True


def test_training_heads_follow_the_packers_rule() -> None:
    small = [_File(f"a/{n:05d}", 1000) for n in range(10)]
    assert training_heads(files_by_group(small, lambda path: 0)) == {0: [(f.path, 1000) for f in small]}
    many = [_File(f"b/{n:06d}", DICT_TRAIN_FILE_BYTES * 2) for n in range(DICT_TRAIN_FILES * 3)]
    in_val = [_File(f"val/{n}", 10) for n in range(3)]
    found = training_heads(files_by_group(many + in_val + [_File("empty", 0)],
                                          lambda path: 1 if path.startswith("val/") else 0))
    # The packer's random draw (training_draw), until the total reaches DICT_TRAIN_TOTAL_BYTES (the file that
    # crosses it counts), in path order; spread over the group, not every n-th file.
    heads = math.ceil(DICT_TRAIN_TOTAL_BYTES / DICT_TRAIN_FILE_BYTES)
    drawn = training_draw([f.size for f in many]).tolist()
    assert found[0] == [(many[n].path, DICT_TRAIN_FILE_BYTES) for n in drawn] and len(drawn) == heads
    assert drawn == sorted(drawn) and len({n % 3 for n in drawn}) == 3 and drawn[-1] > len(many) // 2
    assert found[1] == [(f.path, 10) for f in in_val]


def test_dictionary_training_is_charged_to_the_kinds_that_train() -> None:
    # One extension per kind: each head counts for its own kind. `other` bears no dictionary for the kinds the
    # sample lacked (the packer trains that one on their own files only, and here there are none).
    sample = [SampleFile("a.txt", "text", 0, b"x" * 300, stratum_bytes=3000),
              SampleFile("b.so", "other", 0, b"y" * 100, stratum_bytes=1000)]
    heads = {0: [("x/1.txt", 1000), ("x/2.txt", 1000), ("y/1.so", 500), ("z/1.txt", 1000)]}
    scales = kind_scales(sample, {"text": 3000, "other": 1000}, frozenset(), heads)
    assert (scales["text"].train_bytes, scales["other"].train_bytes) == (3000, 500)


def test_a_head_counts_for_the_kinds_its_extension_holds_in_the_sample() -> None:
    # The packer reads the first files in path order: here mostly libraries, though the tree is mostly text. An
    # extension holding two kinds shares its heads as the sample's weighted bytes do; an extension the sample
    # lacks takes the group's shares.
    sample = [SampleFile("a.py", "text", 0, b"x" * 100, stratum_bytes=9000, weight=80.0),
              SampleFile("b.so", "other", 0, b"y" * 100, stratum_bytes=1000, weight=6.0),
              SampleFile("c.so", "text", 0, b"z" * 100, stratum_bytes=9000, weight=2.0)]
    heads = {0: [("lib/a.so", 4000), ("lib/b.so", 4000), ("lib/c.pyx", 1000)]}
    scales = kind_scales(sample, {"text": 9000, "other": 1000}, frozenset(), heads)
    assert scales["other"].train_bytes == round(8000 * 6 / 8 + 1000 * 0.1)
    assert scales["text"].train_bytes == round(8000 * 2 / 8 + 1000 * 0.9)


def test_reading_the_heads_is_charged_when_a_dictionary_is_trained() -> None:
    text = measured("text", "zstd-dict:9", 4.0, 500, encode_mbps=20, train_seconds=0.5)
    plain = measured("text", "zstd:9", 3.5, 500, encode_mbps=20)
    scales = {"text": KindScale(100_000_000, train_bytes=4_000_000)}
    reads = (2000, 30_000_000)
    with_dict = estimate_pack({"text": text}, scales, 1000, 100_000_000, workers=1, cores=1, head_reads=reads)
    assert with_dict.train_seconds == pytest.approx(text.train_seconds_for(4_000_000, 1) + 2000
                                                    * HEAD_READ_SECONDS_PER_FILE + 30 * HEAD_READ_SECONDS_PER_MB)
    without = estimate_pack({"text": plain}, scales, 1000, 100_000_000, workers=1, cores=1, head_reads=reads)
    assert without.train_seconds == 0


def test_decimal_bytes() -> None:
    assert [decimal_bytes(n) for n in (10e9, 12.3e9, 950e6, 1234, 12)] == ["10 GB", "12.3 GB", "950 MB", "1.23 kB",
                                                                         "12 B"]


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "option"), [
    ({"fit_bytes": -1}, "--fit"), ({"fit_bytes": 1.5}, "--fit"), ({"nodes": 2}, "--nodes"),
    ({"fit_bytes": 10, "nodes": 0.5}, "--nodes"), ({"fit_bytes": 10, "nodes": 5000}, "--nodes"),
    ({"tolerance": -0.1}, "--tolerance"), ({"tolerance": 1.0}, "--tolerance"),
    ({"tolerance": float("nan")}, "--tolerance"), ({"pack_mbps": -5}, "--pack-speed"),
    ({"pack_mbps": float("inf")}, "--pack-speed"), ({"workers": 0}, "--workers"),
])
def test_a_bad_goal_names_the_option(arguments: dict, option: str) -> None:
    with pytest.raises(SelectionError, match=option):
        Goal(**arguments)


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fit") / "src"
    (root / "val").mkdir(parents=True)
    for number in range(12):
        (root / f"log_{number:02d}.txt").write_text(f"step {number} loss 0.{number:04d}\n" * 400)
    (root / "val" / "labels.csv").write_text("path,label\n" + "img.jpg,3\n" * 500)
    return root


@pytest.mark.parametrize(("arguments", "option"), [
    (["--fit", "lots"], "--fit"), (["--fit", "0"], "--fit"), (["--fit", "1GB", "--nodes", "x"], "--nodes"),
    (["--fit", "1GB", "--nodes", "0"], "--nodes"), (["--fit", "1GB", "--nodes", "5000"], "--nodes"),
    (["--budget", "1GB/s", "--nodes", "4"], "--nodes"), (["--budget", "1GB/s", "--tolerance", "150%"], "--tolerance"),
    (["--budget", "1GB/s", "--tolerance", "some"], "--tolerance"),
    (["--budget", "1GB/s", "--tolerance", "100%"], "--tolerance"),
    (["--budget", "1GB/s", "--pack-speed", "fast"], "--pack-speed"),
    (["--budget", "1GB/s", "--workers", "-1"], "--workers"), ([], "--fit"),
    (["--budget", "800"], "--budget: '800' has no unit"), (["--budget", "800/s"], "--budget: '800/s' has no unit"),
    (["--budget", "1GB/s", "--pack-speed", "50"], "--pack-speed: '50' has no unit"),
])
def test_bad_selection_options_are_one_line_errors(small_tree: Path, arguments: list[str], option: str) -> None:
    assert_one_line_error(run_cli("select", str(small_tree), *arguments), option)


@pytest.mark.parametrize("option", [["--fit", "1GB"], ["--tolerance", "2%"], ["--pack-speed", "10MB/s"],
                                    ["--nodes", "2"]])
def test_selection_options_need_codec_auto(small_tree: Path, tmp_path: Path, option: list[str]) -> None:
    result = run_cli("fanstore-pack", str(small_tree), str(tmp_path / "ds"), *option, "--quiet")
    assert_one_line_error(result, option[0])
    assert "only applies with --codec auto" in result.stderr


def test_an_impossible_fit_fails_in_one_line_with_its_own_status(small_tree: Path, tmp_path: Path) -> None:
    result = run_cli("select", str(small_tree), "--fit", "1kB")
    assert_one_line_error(result, "--fit")
    assert result.returncode == 3
    assert "--fit 1 kB: the strongest settings store" in result.stderr and "over" in result.stderr
    packed = run_cli("fanstore-pack", str(small_tree), str(tmp_path / "ds"), "--codec", "auto", "--fit", "100B",
                     "--nodes", "2", "--replicate", "val/**", "--quiet")
    assert_one_line_error(packed, "--fit 100 B --nodes 2")
    assert packed.returncode == 3 and "per node" in packed.stderr


def test_per_node_fit_counts_the_blobs_the_placement_cannot_cut(tmp_path: Path) -> None:
    # Four incompressible 1 MB files on 8 nodes: spread / 8 is 500 kB, but the placement never cuts a file, so four
    # nodes store 1 MB each. A --fit of 700 kB was accepted, the whole tree packed, and only the final check failed.
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(7)
    for number in range(4):
        (src / f"r{number}.bin").write_bytes(rng.bytes(1_000_000))
    dest = tmp_path / "ds"
    refused = run_cli("fanstore-pack", str(src), str(dest), "--codec", "auto", "--fit", "700kB", "--nodes", "8",
                      "--quiet")
    assert_one_line_error(refused, "--fit 700 kB --nodes 8", "slack")
    assert refused.returncode == 3 and "packed" not in refused.stdout and not dest.exists()
    packed = run_cli("fanstore-pack", str(src), str(dest), "--codec", "auto", "--fit", "1600kB", "--nodes", "8",
                     "--quiet", check=True)
    assert "fit: the fullest of 8 nodes stores 1 MB" in packed.stdout
    run_cli("plan", str(dest), "--nodes", "8", "--local-capacity", "1600kB", check=True)


def test_select_shows_the_fit_and_the_pack_time(small_tree: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the test extra installs it")
    plot = tmp_path / "tradeoff.png"
    result = run_cli("select", str(small_tree), "--fit", "1GB", "--nodes", "3", "--replicate", "val/**",
                     "--workers", "1", "--plot", str(plot), check=True)
    assert "--fit 1 GB on each of 3 nodes: the fastest decode that fits" in result.stdout
    assert "estimated pack time of SRC (13 files" in result.stdout and "with 1 worker:" in result.stdout
    assert "fits --fit 1 GB:" in result.stdout and "per node" in result.stdout
    assert "choice for text: none - decodes fastest" in result.stdout
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# --- the record ----------------------------------------------------------------------------------------------------

def test_a_record_from_before_goals_reads_as_no_fit_no_tolerance(small_tree: Path) -> None:
    from fanstore.pack.walk import walk_source
    from selector import select_codecs

    selection = select_codecs(small_tree, Budget(0), walk_source(small_tree).files, goal=Goal(fit_bytes=10**9),
                              fixed_bytes=1000)
    # A busy machine (less than a core left) and unrounded figures: the record must still predict the same.
    selection = dataclasses.replace(selection, others_cores=selection.cores - 0.123456789)
    record = json.loads(json.dumps(selection.to_json()))
    again = Selection.from_json(record)
    assert again.to_json() == record and again.goal == Goal(fit_bytes=10**9)
    assert record["predicted"]["stored_bytes"] == round(selection.need().total)
    for key in ("goal", "tree", "predicted"):
        del record[key]
    old = Selection.from_json(record)
    assert old.goal.tolerance == 0 and old.goal.fit_bytes == 0 and old.codec_by_kind() == selection.codec_by_kind()
    assert selection.fixed_bytes > 1000  # the selection counts its own record in the index too
    assert old.need().total == pytest.approx(selection.need().total - selection.fixed_bytes, rel=0.01)  # no index


def test_what_fit_plans_for_the_index_is_at_least_what_a_pack_writes(tmp_path: Path) -> None:
    """--fit plans with the most the index and the chunk headers take (index_bytes_bound) and, for a zstd-dict
    choice, with the dictionaries the packer trains on all its heads (not the sample's smaller ones), and the
    selection's own record (selector.record_bytes): a real auto pack with two groups, files stored in blocks and
    dictionaries writes no more than that, and a fixed-codec pack's index and headers stay within the bound."""
    from fanstore import PackOptions, open_dataset, pack
    from fanstore.pack.groups import GroupPlan
    from fanstore.pack.index_size import index_bytes_bound
    from fanstore.pack.walk import walk_source

    rng = np.random.default_rng(11)
    src = tmp_path / "src"
    words = [f"token{number}".encode() for number in range(300)]
    for group in ("train", "val"):
        for number in range(1500):  # small similar records: a dictionary pays, trained on more than the sample
            path = src / group / f"r{number:04d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b'{"id": %d, "text": "%s"}' % (number, b" ".join(rng.choice(words, 200))))
    (src / "train" / "big.bin").write_bytes(rng.integers(0, 4, 9 << 20, dtype=np.uint8).tobytes())  # in blocks
    options = PackOptions(codec="auto", budget=0, replicate=("val/*",), chunk_size=1 << 20, workers=1)
    pack(src, tmp_path / "auto", options)
    chunk_headers = 32 * sum(1 for _ in (tmp_path / "auto" / "chunks").iterdir())
    with open_dataset(tmp_path / "auto") as dataset:
        selection = Selection.from_json(dataset.index.meta["selection"])
        dictionaries = sum(map(len, dataset.index.dictionaries.values()))
    index_bytes = (tmp_path / "auto" / "fanstore.index").stat().st_size
    assert dictionaries  # the case this is about
    scales = selection.scales_by_kind()
    planned_dictionaries = sum(scales[kind].dictionary_bytes(m) for kind, m in selection.chosen().items() if m)
    assert planned_dictionaries >= dictionaries, (planned_dictionaries, dictionaries, [(m.spec, m.dict_bytes) for m in selection.chosen().values() if m])
    assert selection.fixed_bytes + planned_dictionaries >= index_bytes + chunk_headers

    fixed = PackOptions(codec="zstd:3", replicate=("val/*",), chunk_size=1 << 20, workers=1)
    pack(src, tmp_path / "fixed", fixed)
    written = ((tmp_path / "fixed" / "fanstore.index").stat().st_size
               + 32 * sum(1 for _ in (tmp_path / "fixed" / "chunks").iterdir()))
    assert written <= index_bytes_bound(walk_source(src), GroupPlan(("val/*",)), fixed) <= written + 8192
