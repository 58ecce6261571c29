"""A real pack process killed with SIGKILL at several points resumes to byte-identical output."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, dir_bytes, numbered_files, run_cli
from fanstore.pack.journal import JOURNAL_DIR, JOURNAL_VERSION, STATE_FILE, BlockRow, FileRow

ARGS = ["--codec", "zstd-dict:19", "--chunk-size", "256KiB", "--replicate", "val/**", "--workers", "2", "--quiet"]


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory) -> Path:
    """Enough data at a slow level that a pack takes a few seconds and writes dozens of chunks."""
    root = tmp_path_factory.mktemp("resume") / "src"
    rng = np.random.default_rng(11)
    for split, count in (("train", 700), ("val", 150)):
        for i in range(count):
            folder = root / split / f"class_{i % 7}"
            folder.mkdir(parents=True, exist_ok=True)
            smooth = np.cumsum(rng.standard_normal(4096 + (i % 5) * 1024)).astype(np.float32)
            (folder / f"sample_{i:04d}.npy").write_bytes(smooth.tobytes())
    (root / "empty").mkdir()
    (root / "zero.bin").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def reference(big_tree, tmp_path_factory) -> dict[str, bytes]:
    dest = tmp_path_factory.mktemp("reference") / "ds"
    run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    return dir_bytes(dest)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (the forkserver's workers are grandchildren)."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child)
    return found


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("event", ["walked", "planned", "chunk:1", "chunk:5", "chunk:20", "index"])
def test_sigkill_then_resume_is_byte_identical(big_tree, reference, tmp_path, event, paused_pack):
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, event).kill_group()
    assert not (dest / "fanstore.index").exists(), "an interrupted pack must not look complete"
    resumed = run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert "packed" in resumed.stdout
    if event.startswith("chunk:") or event == "index":
        kept = int(event.split(":")[1]) if ":" in event else len(list((dest / "chunks").iterdir()))
        assert f"{kept} chunk{'s' if kept != 1 else ''} kept from the interrupted run" in resumed.stdout
    assert dir_bytes(dest) == reference


def test_killed_after_its_index_was_in_place_the_pack_ends_its_journal_on_the_next_run(big_tree, reference,
                                                                                     tmp_path, paused_pack):
    """A kill between the index's rename and the journal's removal left the journal in DEST for good: the next
    run found the pack finished ("nothing to do") and kept it, so DEST was not what a pack writes."""
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "indexed").kill_group()
    assert (dest / "fanstore.index").exists() and (dest / ".fanstore-pack").exists()
    again = run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert "nothing to do" in again.stdout
    assert not (dest / ".fanstore-pack").exists()
    assert dir_bytes(dest) == reference


def test_killed_twice_then_resumed(big_tree, reference, tmp_path, paused_pack):
    dest = tmp_path / "ds"
    for event in ("chunk:3", "chunk:12"):
        paused_pack(big_tree, dest, ARGS, event).kill_group()
    run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert dir_bytes(dest) == reference


def test_resume_with_other_options_is_refused(big_tree, tmp_path, paused_pack):
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "chunk:2").kill_group()
    other = run_cli("fanstore-pack", str(big_tree), str(dest), "--codec", "lz4", "--quiet")
    assert other.returncode != 0 and "interrupted pack" in other.stderr and "Traceback" not in other.stderr
    forced = run_cli("fanstore-pack", str(big_tree), str(dest), "--codec", "lz4", "--quiet", "--force")
    assert forced.returncode == 0, forced.stderr


def test_the_journal_is_named_records_with_a_version(big_tree, tmp_path, paused_pack):
    """state.json names its fields and its version; each chunk record holds one named column per row field."""
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "chunk:2").kill_group()
    state = json.loads((dest / JOURNAL_DIR / STATE_FILE).read_text())
    assert set(state) == {"journal_version", "fingerprint", "options", "codecs", "selection"}
    assert state["journal_version"] == JOURNAL_VERSION
    record = json.loads((dest / JOURNAL_DIR / "chunk-00000001.json").read_text())
    assert set(record["files"]) == set(FileRow._fields) and set(record["blocks"]) == set(BlockRow._fields)
    assert set(record["problems"]) == {"path", "reason"}
    lengths = {len(column) for column in record["files"].values()}
    assert len(lengths) == 1 and lengths.pop() > 0


@pytest.mark.parametrize("version", [JOURNAL_VERSION - 1, JOURNAL_VERSION + 1, str(JOURNAL_VERSION)])
def test_a_journal_of_another_version_is_refused_in_one_line(big_tree, reference, tmp_path, paused_pack, version):
    """A real interrupted pack whose journal says another version (an older fanstore's, with positional rows, a
    newer one's, or a version of another type): resuming it is refused naming the file and both versions, and
    nothing in DEST changes. (A state.json without a version is not fanstore's: test_bad_input.)"""
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "chunk:2").kill_group()
    state_path = dest / JOURNAL_DIR / STATE_FILE
    state = json.loads(state_path.read_text())
    state["journal_version"] = version
    state_path.write_text(json.dumps(state))
    before = dir_bytes(dest)
    assert_one_line_error(run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS), str(state_path),
                          f"journal version {version!r}", f"resumes version {JOURNAL_VERSION}", "--force")
    assert dir_bytes(dest) == before
    if version == JOURNAL_VERSION + 1:  # what the refusal offers works (once: it is the same pack for each version)
        run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, "--force", check=True)
        assert dir_bytes(dest) == reference


@pytest.mark.parametrize("damage", ["a column missing", "columns of two lengths", "a positional row"])
def test_a_damaged_chunk_record_is_refused_in_one_line(big_tree, tmp_path, paused_pack, damage):
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "chunk:2").kill_group()
    record_path = dest / JOURNAL_DIR / "chunk-00000001.json"
    record = json.loads(record_path.read_text())
    if damage == "a column missing":
        del record["files"]["stored_len"]
    elif damage == "columns of two lengths":
        record["files"]["checksum"].pop()
    else:
        record["files"] = [list(row) for row in zip(*(record["files"][name] for name in FileRow._fields))]
    record_path.write_text(json.dumps(record))
    assert_one_line_error(run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS), str(record_path), "damaged",
                          "--force")


def test_workers_die_with_a_packer_killed_by_sigkill(big_tree, tmp_path, paused_pack):
    """Only the packer is killed (not its process group): its workers must not outlive it."""
    paused = paused_pack(big_tree, tmp_path / "ds", ARGS, "chunk:2")
    workers = _descendants(paused.proc.pid)
    assert len(workers) >= 2, workers
    os.kill(paused.proc.pid, signal.SIGKILL)
    paused.proc.communicate(timeout=60)
    assert _gone_within(workers, 10) == set()


def test_sigterm_stops_the_packer_and_its_workers_resumably(big_tree, reference, tmp_path, paused_pack):
    dest = tmp_path / "ds"
    paused = paused_pack(big_tree, dest, ARGS, "chunk:2")
    workers = _descendants(paused.proc.pid)
    os.kill(paused.proc.pid, signal.SIGTERM)
    _, err = paused.proc.communicate(timeout=60)
    assert paused.proc.returncode == 130 and "Traceback" not in err
    assert "interrupted; run the same command again to resume" in err
    assert _gone_within(workers, 10) == set()
    run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    assert dir_bytes(dest) == reference


def test_a_worker_killed_mid_pack_is_one_line_and_resumable(tmp_path, paused_pack):
    """More batches than are in flight, so the packer still needs its pool after one worker is killed."""
    src = tmp_path / "src"
    rng = np.random.default_rng(5)
    for i in range(4000):
        folder = src / f"part_{i % 20:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"row_{i:05d}.txt").write_text(" ".join(map(str, rng.integers(0, 1000, 300))))
    args = ["--codec", "zstd:3", "--chunk-size", "64KiB", "--workers", "2", "--quiet"]
    run_cli("fanstore-pack", str(src), str(tmp_path / "reference"), *args, check=True)
    dest = tmp_path / "ds"
    paused = paused_pack(src, dest, args, "chunk:1")
    worker = min(_descendants(paused.proc.pid))
    os.kill(worker, signal.SIGKILL)
    failed = paused.resume()
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert [line for line in failed.stderr.splitlines() if line.strip()] == [
        "fanstore-pack: error: a worker process died (killed, or out of memory); finished chunks are kept: run the "
        "same command again to resume"]
    resumed = run_cli("fanstore-pack", str(src), str(dest), *args, check=True)
    assert "chunks kept from the interrupted run" in resumed.stdout
    assert dir_bytes(dest) == dir_bytes(tmp_path / "reference")


@pytest.mark.parametrize("damage", ["removed", "cut short", "another chunk's file", "a record past a gap"])
def test_a_journaled_chunk_damaged_since_is_packed_again(big_tree, reference, tmp_path, paused_pack, damage):
    """The resume kept every journaled chunk without looking at its file: one removed or cut short between the
    runs gave an index of chunks that are not there, from a pack that said it succeeded. Journal records past a
    gap (their files discarded by the run that found the gap) were trusted by the run after."""
    dest = tmp_path / "ds"
    paused_pack(big_tree, dest, ARGS, "chunk:10").kill_group()
    chunk = dest / "chunks" / "00000004.fsc"
    if damage == "removed":
        chunk.unlink()
    elif damage == "cut short":
        os.truncate(chunk, chunk.stat().st_size - 1)
    elif damage == "another chunk's file":
        chunk.write_bytes((dest / "chunks" / "00000003.fsc").read_bytes())
    else:
        (dest / JOURNAL_DIR / "chunk-00000004.json").unlink()
        paused_pack(big_tree, dest, ARGS, "chunk:6").kill_group()  # chunks 4 and 5 again; records 6 to 9 stale
    resumed = run_cli("fanstore-pack", str(big_tree), str(dest), *ARGS, check=True)
    if damage != "a record past a gap":
        assert "4 chunks kept from the interrupted run" in resumed.stdout
        assert "chunks/00000004.fsc" in resumed.stderr and "from 4 on are packed again" in resumed.stderr
    assert dir_bytes(dest) == reference
    assert run_cli("verify", str(dest)).returncode == 0


def test_a_second_pack_into_a_dest_being_packed_is_refused(big_tree, reference, tmp_path, paused_pack):
    """Nothing kept two packs out of one DEST: the second (with --force, or resuming the same journal) removed or
    rewrote the first's chunk files, and the one to finish wrote an index of chunks the other had replaced (or one
    died in a traceback of rmtree). The first pack holds DEST; a second is refused in one line and writes nothing."""
    dest = tmp_path / "ds"
    first = paused_pack(big_tree, dest, ARGS, "chunk:2")
    before = dir_bytes(dest)
    for args in (["--codec", "lz4", "--quiet", "--force"], ARGS):
        assert_one_line_error(run_cli("fanstore-pack", str(big_tree), str(dest), *args), f"DEST '{dest}'",
                              "being written by another fanstore-pack")
        assert dir_bytes(dest) == before
    finished = first.resume()
    assert finished.returncode == 0, finished.stderr
    assert dir_bytes(dest) == reference


def test_a_refused_resume_names_the_options_that_differ_or_says_src_changed(tmp_path, paused_pack):
    """The refusal printed the interrupted pack's options as JSON and said 'run that command to resume it': run again
    after SRC changed, the same command got the same advice for good, and another option was not named."""
    src = tmp_path / "src"
    numbered_files(src, 300, lambda number: 3000 + number)
    args = ["--codec", "none", "--chunk-size", "64KiB", "--workers", "1", "--quiet"]
    dest = tmp_path / "ds"
    paused_pack(src, dest, args, "chunk:2").kill_group()
    other = ["--codec", "lz4", "--chunk-size", "128KiB", "--workers", "1", "--quiet"]
    assert_one_line_error(run_cli("fanstore-pack", str(src), str(dest), *other), "interrupted pack with other options",
                          '--chunk-size 64KiB then, 128KiB now', '--codec "none" then, "lz4" now', "--force")
    # Each value as its option is written (--budget 100000000.0 then, 50000000.0 now, before), --codec auto's too
    auto = ["--codec", "auto", "--budget", "100MB/s", "--sample", "2%", "--chunk-size", "64KiB", "--workers", "1",
            "--quiet"]
    auto_dest = tmp_path / "auto"
    paused_pack(src, auto_dest, auto, "planned").kill_group()
    other_auto = [*auto[:2], "--budget", "50MB/s", "--sample", "2.5%", "--fit", "1GB", *auto[6:]]
    assert_one_line_error(run_cli("fanstore-pack", str(src), str(auto_dest), *other_auto),
                          "interrupted pack with other options", "--budget 100MB/s then, 50MB/s now",
                          "--sample 2% then, 2.5% now", "--fit 0 then, 1GB now")
    (src / "f007.bin").write_bytes(b"changed")
    assert_one_line_error(run_cli("fanstore-pack", str(src), str(dest), *args), "of SRC as it was then",
                          "changed, added or removed since", "--force")
