"""`fanstore-pack --codec auto` end to end, through the real CLI (or `pack()`, where a test fixes the selection): the
selector's choice per kind is what the pack stores with, is recorded in the index and shown by `fanstore info`, and
survives a SIGKILL and a resume; a refused pack leaves DEST as it found it."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, dataset_digest, dir_bytes, python2_npy, run_cli, tree_digest
from fanstore import PackOptions, open_dataset, pack
from fanstore.errors import UsageError
from fanstore.pack.journal import JOURNAL_DIR, STATE_FILE
from compressors.kinds import HEAD_BYTES, file_kind
from selector.measure import DECODE_NOISE

KINDS = {"jpeg", "npy", "text"}


def _jpeg(rng: np.random.Generator, side: int) -> bytes:
    """A smooth image with a little noise, like a photo crop, as a JPEG."""
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side] / side
    channels = [np.sin(2 * np.pi * (rng.uniform(0.5, 3) * x + rng.uniform(0.5, 3) * y + rng.uniform(0, 1)))
                for _ in range(3)]
    image = (np.stack(channels, axis=-1) * 100 + 128 + rng.normal(0, 6, (side, side, 3))).clip(0, 255)
    buffer = io.BytesIO()
    Image.fromarray(image.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def build_mixed_tree(root: Path, scale: int = 1) -> Path:
    """JPEG photos, float32 .npy fields and CSV/label text in train/ and val/, plus an empty file."""
    rng = np.random.default_rng(31)
    for split, classes in (("train", 3), ("val", 1)):
        for number in range(classes):
            folder = root / split / f"class_{number}"
            folder.mkdir(parents=True)
            for image in range(8 * scale):
                (folder / f"img_{image:03d}.jpg").write_bytes(_jpeg(rng, 96))
            for field in range(2 * scale):
                wave = np.sin(np.linspace(0, rng.uniform(4, 40), 128 * 256)).reshape(128, 256)
                np.save(folder / f"field_{field:02d}.npy", (wave * 3 + 290).astype(np.float32))
            rows = "".join(f"img_{i:03d}.jpg,{i % 5},{rng.random():.4f}\n" for i in range(300 * scale))
            (folder / "labels.csv").write_text("path,label,weight\n" + rows)
    (root / "README.txt").write_text("a small mixed training set\n" * 40)
    (root / "empty.txt").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def mixed_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixed_tree(tmp_path_factory.mktemp("auto") / "src")


@pytest.fixture(scope="module")
def auto_pack(mixed_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    dest = tmp_path_factory.mktemp("auto-ds") / "ds"
    proc = run_cli("fanstore-pack", str(mixed_tree), str(dest), "--codec", "auto", "--budget", "800MB/s",
                   "--prefetch-threads", "2", "--quiet", "--workers", "1", check=True)
    return dest, proc


def _kind_of(root: Path, path: str) -> str:
    with open(root / path, "rb") as f:
        return file_kind(path, f.read(HEAD_BYTES))


def test_auto_pack_reads_back_byte_identical(mixed_tree: Path, auto_pack) -> None:
    dest, proc = auto_pack
    assert "packed" in proc.stdout and "0 skipped" in proc.stdout
    with open_dataset(dest) as ds:
        assert dataset_digest(ds) == tree_digest(mixed_tree)


def test_auto_pack_records_and_uses_a_choice_per_kind(mixed_tree: Path, auto_pack) -> None:
    dest, _ = auto_pack
    with open_dataset(dest) as ds:
        index = ds.index
        selection = index.meta["selection"]
        assert selection["budget"] == {"bytes_per_s": 800e6, "prefetch_threads": 2, "required_decode_mbps": 400.0,
                                       "decode_noise": DECODE_NOISE}
        bytes_by_kind: dict[str, int] = {}
        for path in ds.files():
            if ds.stat(path).st_size:
                kind = _kind_of(mixed_tree, path)
                bytes_by_kind[kind] = bytes_by_kind.get(kind, 0) + ds.stat(path).st_size
        assert set(bytes_by_kind) == KINDS and set(selection["choices"]) == KINDS
        # Each extension here means one kind, so the selector's estimate of each kind's bytes is exact.
        assert selection["sample"]["kind_bytes"] == bytes_by_kind
        assert index.meta["pack"]["codec"] == "auto" and index.meta["pack"]["budget"] == 800e6
        specs = [row["spec"] for row in index.codecs]
        for path in ds.files():
            entry = index.lookup(path)
            if int(index.entries[entry]["size"]) == 0:
                continue
            used = specs[int(index.entries[entry]["codec"])]
            chosen = selection["choices"][_kind_of(mixed_tree, path)]["spec"]
            # A file the chosen codec does not shrink is stored as it is; zstd-dict is recorded as its spec.
            assert used in (chosen, "none"), (path, used, chosen)


def test_auto_pack_prints_its_predictions_before_and_after(auto_pack) -> None:
    _, proc = auto_pack
    lines = proc.stdout.splitlines()
    announced = next(number for number, line in enumerate(lines) if line.startswith("predicted: "))
    packed = next(number for number, line in enumerate(lines) if line.startswith("packed "))
    assert announced < packed, "the estimate is printed before the pack, for the person who waits"
    assert "stored with the index; pack " in lines[announced] and "with 1 worker:" in lines[announced]
    assert lines[packed + 1].startswith("pack time ") and "after the selection (predicted " in lines[packed + 1]


def test_auto_pack_with_room_to_spare_on_each_node_stores_for_the_fastest_decode(mixed_tree: Path,
                                                                                 tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    proc = run_cli("fanstore-pack", str(mixed_tree), str(dest), "--codec", "auto", "--fit", "1GB", "--nodes", "2",
                   "--replicate", "val/**", "--workers", "1", "--quiet", check=True)
    assert "fit: the fullest of 2 nodes stores" in proc.stdout and "of --fit 1 GB" in proc.stdout
    with open_dataset(dest) as ds:
        selection = ds.index.meta["selection"]
        assert {choice["spec"] for choice in selection["choices"].values()} == {"none"}
        assert selection["goal"]["fit_bytes"] == 10**9 and selection["goal"]["nodes"] == 2
        assert ds.index.meta["pack"]["fit"] == 10**9 and ds.index.meta["pack"]["nodes"] == 2
        assert dataset_digest(ds) == tree_digest(mixed_tree)


def test_info_shows_the_selection(auto_pack) -> None:
    dest, _ = auto_pack
    info = run_cli("info", str(dest), check=True).stdout
    assert "codec selection (--codec auto)" in info and "2 prefetch threads" in info
    with open_dataset(dest) as ds:
        choices = ds.index.meta["selection"]["choices"]
    for kind, choice in choices.items():
        assert any(line.split()[:2] == [kind, choice["spec"]] for line in info.splitlines()), (kind, info)


@pytest.mark.parametrize("arguments", [
    ["--budget", "800MB/s"],  # a budget without --codec auto (the default codec is zstd:3)
    ["--codec", "auto"],  # auto without a budget
])
def test_budget_and_auto_go_together(mixed_tree: Path, tmp_path: Path, arguments: list[str]) -> None:
    dest = tmp_path / "ds"
    assert_one_line_error(run_cli("fanstore-pack", str(mixed_tree), str(dest), *arguments, "--quiet"), "--budget")
    assert not dest.exists(), "a refused pack must not create DEST"


# --- what the codecs store, and what they print -----------------------------------------------------------------------

@pytest.mark.parametrize("codec", [["--codec", "auto", "--budget", "0"], ["--codec", "blosc:zstd:5:shuffle:auto"]])
def test_packing_npy_files_writes_nothing_to_stderr(tmp_path: Path, codec: list[str]) -> None:
    """.npy files as numpy writes them today, as it wrote them on Python 2, and one with a torn header: blosc reads
    their item size (while selecting, and in the workers while packing) without numpy's loader warnings."""
    rng = np.random.default_rng(5)
    src = tmp_path / "src"
    src.mkdir()
    for number in range(6):
        field = np.cumsum(rng.standard_normal((32, 256)), axis=1).astype(np.float32)
        np.save(src / f"field_{number}.npy", field)
        (src / f"old_field_{number}.npy").write_bytes(python2_npy(field))
    (src / "torn.npy").write_bytes(b"\x93NUMPY\x01\x00\x46\x00{'descr': '<f4', 'shape': ((((" + bytes(4096))
    packed = run_cli("fanstore-pack", str(src), str(tmp_path / "ds"), *codec, "--workers", "2", "--quiet",
                     check=True)
    assert packed.stderr == ""
    with open_dataset(tmp_path / "ds") as ds:
        assert dataset_digest(ds) == tree_digest(src)


def build_record_tree(root: Path) -> Path:
    """Many small similar files of two kinds, JSON records (`text`) and extensionless binary records (`other`):
    what zstd dictionaries are for."""
    rng = np.random.default_rng(3)
    root.mkdir(parents=True)
    for number in range(300):
        record = {"id": number, "label": int(rng.integers(0, 10)), "score": round(float(rng.random()), 4)}
        (root / f"record_{number:04d}.json").write_text(json.dumps(record, indent=2) + "\n" + "trailer line\n" * 5)
        (root / f"blob_{number:04d}").write_bytes(b"\x00REC" + number.to_bytes(4, "little") + b"\x00\x01\x02" * 30
                                                  + rng.integers(0, 4, 60, np.uint8).tobytes() + b"\x00end\x00" * 8)
    return root


def _pack_choosing(src: Path, dest: Path, specs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An auto pack whose selection chooses `specs` per kind (kinds left out: as if the sample had lacked them)."""
    from selector import Choice

    pack_module = importlib.import_module("fanstore.pack.packer")
    select_for = pack_module.select_for

    def choosing(*args, **kwargs):
        selection = select_for(*args, **kwargs)
        selection.choices = {kind: Choice(kind, spec, None, True, "chosen by the test") for kind, spec in specs.items()}
        return selection

    monkeypatch.setattr(pack_module, "select_for", choosing)
    pack(src, dest, PackOptions(codec="auto", budget=0, workers=1))


def _dictionaries_in_use(ds) -> set[str]:
    """The dictionaries of the codec rows some file or block is stored with."""
    index = ds.index
    rows = {int(row) for row in index.entries["codec"][index.entries["size"] > 0]}
    rows |= {int(row) for row in index.blocks["codec"]}
    return {index.codecs[row]["dictionary"] for row in rows} - {None}


def test_an_auto_pack_stores_no_dictionary_that_no_file_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind has a dictionary of its own: none is trained for the kinds the sample lacked, as there are none."""
    src = build_record_tree(tmp_path / "src")
    _pack_choosing(src, tmp_path / "ds", {"text": "zstd-dict:3", "other": "zstd-dict:19"}, monkeypatch)
    with open_dataset(tmp_path / "ds") as ds:
        assert sorted(ds.index.dictionaries) == ["dict.0.other", "dict.0.text"]
        assert _dictionaries_in_use(ds) == set(ds.index.dictionaries)
        assert dataset_digest(ds) == tree_digest(src)


def test_kinds_the_sample_lacked_get_a_dictionary_trained_on_their_files(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection names `other` only: the JSON records take the row for kinds it lacked, `other`'s choice, with
    dict.0 trained on them; and a single zstd-dict codec has every file use dict.0."""
    src = build_record_tree(tmp_path / "src")
    _pack_choosing(src, tmp_path / "auto", {"other": "zstd-dict:19"}, monkeypatch)
    pack(src, tmp_path / "single", PackOptions(codec="zstd-dict:19", workers=1))
    for name in ("auto", "single"):
        with open_dataset(tmp_path / name) as ds:
            expected = ["dict.0", "dict.0.other"] if name == "auto" else ["dict.0"]
            assert sorted(ds.index.dictionaries) == expected, name
            assert _dictionaries_in_use(ds) == set(expected)
            json_rows = {int(ds.index.entries["codec"][ds.index.lookup(path)]) for path in ds.files()
                         if path.endswith(".json")}
            assert {ds.index.codecs[row]["dictionary"] for row in json_rows} == {"dict.0"}
            assert dataset_digest(ds) == tree_digest(src)


def test_a_dictionary_is_trained_on_files_drawn_as_the_selector_draws_them(tmp_path: Path) -> None:
    """8,000 JSON records that alternate between two vocabularies (a pair of record kinds, or a caption beside each
    record, in one directory): the packer trained its dictionary on every second file in path order, so on one
    vocabulary only, and stored 56% more than the selector, which trains on a random draw, predicted. It draws its
    training files at random too, and stores what was predicted."""
    rng = np.random.default_rng(4)
    vocabularies = (["epoch", "loss", "accuracy", "learning_rate", "momentum", "weight_decay"],
                    ["bbox", "category", "segmentation", "iscrowd", "image_id", "area"])
    src = tmp_path / "src"
    src.mkdir()
    for number in range(8000):
        words = rng.permutation(vocabularies[number % 2])[:4]
        (src / f"r{number:05d}.json").write_text(
            "{" + ", ".join(f'"{word}": {int(rng.integers(0, 1000))}' for word in words) + "}\n")
    summary = pack(src, tmp_path / "ds", PackOptions(codec="auto", budget=0, tolerance=0, workers=1))
    assert summary.selection is not None and summary.selection.codec_by_kind()["text"].startswith("zstd-dict:")
    predicted = summary.selection.predicted_blob_bytes()
    assert abs(summary.stored_bytes / predicted - 1) < 0.05, (summary.stored_bytes, predicted)


# --- refused packs ----------------------------------------------------------------------------------------------------

REFUSALS = {
    "does not fit": (["--codec", "auto", "--fit", "1kB"], "--fit 1 kB"),
    "a seed the selector refuses": (["--codec", "auto", "--budget", "1GB/s", "--seed", "-1"], "--seed"),
    "a bad codec": (["--codec", "zstd:99"], "--codec"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
@pytest.mark.parametrize("found", ["no DEST", "an empty DEST", "a dataset and --force"])
def test_a_refused_pack_leaves_dest_as_it_found_it(mixed_tree: Path, tmp_path: Path, refusal: str,
                                                   found: str) -> None:
    """Whatever refuses the pack (the selection, --fit, an option), it refuses before its first write to DEST."""
    arguments, needle = REFUSALS[refusal]
    dest = tmp_path / "ds"
    if found == "an empty DEST":
        dest.mkdir()
    elif found == "a dataset and --force":
        run_cli("fanstore-pack", str(mixed_tree), str(dest), "--codec", "lz4", "--workers", "1", "--quiet",
                check=True)
        arguments = [*arguments, "--force"]
    before = sorted(dest.rglob("*")) if dest.exists() else None
    contents = dir_bytes(dest) if dest.exists() else None
    assert_one_line_error(run_cli("fanstore-pack", str(mixed_tree), str(dest), *arguments, "--quiet"), needle)
    if before is None:
        assert not dest.exists(), "a refused pack must not create DEST"
    else:
        assert sorted(dest.rglob("*")) == before and dir_bytes(dest) == contents


def test_a_finished_auto_pack_run_again_selects_nothing_and_checks_its_fit(mixed_tree: Path, tmp_path: Path) -> None:
    """The second run of a finished --codec auto pack does not measure again (its choice is the index's): one line
    saying there is nothing to do, and, with --fit, the fit of DEST as it stands, with the exit status it gives."""
    dest = tmp_path / "ds"
    arguments = [str(mixed_tree), str(dest), "--codec", "auto", "--fit", "1GB", "--workers", "1", "--quiet"]
    first = run_cli("fanstore-pack", *arguments, check=True)
    assert "codec selection" in first.stdout
    contents = dir_bytes(dest)
    again = run_cli("fanstore-pack", *arguments, check=True)
    lines = again.stdout.splitlines()
    assert lines[0].startswith(f"nothing to do: {dest} already holds this pack") and len(lines) == 2, again.stdout
    assert lines[1].startswith("fit: DEST takes") and "predicted" in lines[1], lines[1]
    assert "codec selection" not in again.stdout and dir_bytes(dest) == contents


@pytest.mark.parametrize(("options", "option"), [
    ({"budget": float("inf")}, "--budget"), ({"budget": 1e9, "sample": 0.0}, "--sample"),
    ({"budget": 1e9, "seed": -1}, "--seed"), ({"budget": 1e9, "seed": 1 << 64}, "--seed"),
])
def test_options_the_selector_would_refuse_are_refused_before_the_walk(tmp_path: Path, options: dict,
                                                                       option: str) -> None:
    """SRC does not exist: the option must be refused before the walk would find that out."""
    with pytest.raises(UsageError, match=option):
        pack(tmp_path / "never walked", tmp_path / "ds", PackOptions(codec="auto", workers=1, **options))
    assert not (tmp_path / "ds").exists()


def test_what_appears_in_dest_during_the_selection_is_not_deleted(mixed_tree: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """DEST is checked before the selection and again before the first write: a file another process put there
    meanwhile is refused, never deleted as if it were the pack's own."""
    pack_module = importlib.import_module("fanstore.pack.packer")  # the package's `pack` is the function
    dest = tmp_path / "ds"
    dest.mkdir()
    select_for = pack_module.select_for

    def select_while_another_process_writes(*args, **kwargs):
        (dest / "theirs.txt").write_text("not fanstore's")
        return select_for(*args, **kwargs)

    monkeypatch.setattr(pack_module, "select_for", select_while_another_process_writes)
    with pytest.raises(UsageError, match="theirs.txt"):
        pack(mixed_tree, dest, PackOptions(codec="auto", budget=1e9, workers=1))
    assert [path.name for path in dest.iterdir()] == ["theirs.txt"]


# --- interrupted and resumed --------------------------------------------------------------------------------------

RESUME_ARGS = ["--codec", "auto", "--budget", "0", "--chunk-size", "64KiB", "--workers", "2", "--quiet"]


def test_a_killed_auto_pack_resumes_with_the_journaled_selection(tmp_path: Path, paused_pack) -> None:
    # Budget 0 picks the strongest (slowest) encoders and two workers take a while to start: the pack is still
    # compressing when the journal, written right after the selection, appears.
    src = build_mixed_tree(tmp_path / "src", scale=3)
    dest = tmp_path / "ds"
    state = dest / JOURNAL_DIR / STATE_FILE
    paused_pack(src, dest, RESUME_ARGS, "planned").kill_group()  # selection journaled
    assert not (dest / "fanstore.index").exists(), "an interrupted pack must not look complete"
    journaled = json.loads(state.read_text())["selection"]
    assert set(journaled["choices"]) == KINDS

    resumed = run_cli("fanstore-pack", str(src), str(dest), *RESUME_ARGS, check=True)
    assert "packed" in resumed.stdout
    with open_dataset(dest) as ds:
        # Measured again, the timings (and so the record) would differ: equality means the journal was reused.
        assert ds.index.meta["selection"] == journaled
        assert dataset_digest(ds) == tree_digest(src)
    assert not (dest / JOURNAL_DIR).exists()
