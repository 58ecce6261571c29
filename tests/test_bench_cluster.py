"""bench/bench_cluster.py --quick, for real: two ranks under mpiexec, PyTorch training processes, the simulated
parallel file system (bench/shared_fs.py) and `fanstore serve`. It checks what the file system was asked, never
how long anything took: the direct way's requests are the ones the model's rules predict for the files each rank
read, and the served ways make none during the epochs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_until

sys.path.insert(0, str(REPO / "bench"))
from bench_serve import serve_requirements_missing  # noqa: E402

_MISSING = serve_requirements_missing()
if _MISSING:
    pytest.skip(f"needs FUSE and MPI: missing {'; '.join(_MISSING)}", allow_module_level=True)
pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    base = tmp_path_factory.mktemp("cluster")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_cluster.py"), "--quick", "--cache",
                           str(base / "cache"), "--json", str(base / "run.json"), "--png", str(base / "run.png")],
                          capture_output=True, text=True, timeout=600, cwd=base)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (base / "run.png").stat().st_size > 0
    return json.loads((base / "run.json").read_text()), proc.stdout, base


def result(run: dict, way: str) -> dict:
    return next(r for r in run["results"] if r["way"] == way)


def phase(figures: dict, name: str) -> dict:
    return next(p for p in figures["phases"] if p["name"] == name)


def test_direct_asks_what_the_model_rules_predict(quick: tuple[dict, str, Path]) -> None:
    run, _out, base = quick
    data = run["sets"][0]
    direct = result(run, "direct")
    metadata = reads = read_bytes = 0
    for rank in direct["rank_figures"]:  # each rank on a node of its own, with its own client
        paths = [f"{data['original']}/{data['paths'][item]}" for item in rank["read"]]
        folders = {"/".join(path.split("/")[:depth]) for path in paths for depth in range(1, path.count("/") + 1)}
        # Each folder's lookup; each file's lookup (its intent-open) and close; each file read whole in one RPC.
        metadata += len(folders) + 2 * len(paths)
        reads += len(paths)
        read_bytes += sum((base / "cache" / "cluster" / path).stat().st_size for path in paths)
    epoch = phase(direct, "epoch 1")
    assert (epoch["metadata_rpcs"], epoch["read_rpcs"], epoch["read_bytes"]) == (metadata, reads, read_bytes)
    assert epoch["rpcs"].get("open", 0) == 0, "every open came right after its lookup"
    assert sum(len(r["read"]) for r in direct["rank_figures"]) == len(data["paths"]), "the ranks split the set"
    assert phase(direct, "job")["rpcs"] == {} and phase(direct, "end")["rpcs"] == {}


@pytest.mark.parametrize("way", ["served", "served mount"])
def test_served_asks_nothing_during_the_epochs(quick: tuple[dict, str, Path], way: str) -> None:
    run, _out, _base = quick
    served, data = result(run, way), run["sets"][0]
    assert all(phase(served, f"epoch {e + 1}")["rpcs"] == {} for e in range(served["epochs"]))
    staging = phase(served, "job")
    assert staging["read_bytes"] >= data["stored_bytes"] * 0.99, "staging read the dataset"
    assert sum(e["files"] for r in served["rank_figures"] for e in r["epochs"]) == len(data["paths"])


def test_packed_asks_for_the_index_and_chunks_not_the_files(quick: tuple[dict, str, Path]) -> None:
    run, _out, _base = quick
    packed, direct = result(run, "packed"), result(run, "direct")
    assert phase(packed, "epoch 1")["metadata_rpcs"] < phase(direct, "epoch 1")["metadata_rpcs"] / 20


def test_the_report_ends_with_the_targets_and_nothing_is_left(quick: tuple[dict, str, Path]) -> None:
    _run, out, base = quick
    assert "targets (images):" in out and "PASS  served makes 0 RPCs" in out
    with open("/proc/self/mountinfo") as mountinfo:
        assert not [line for line in mountinfo if "bench-cluster-" in line or "shared_fs-node" in line]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"bench-cluster-" not in command and b"shared_fs.py --" not in command, command


def test_a_bench_killed_mid_job_leaves_nothing(tmp_path: Path) -> None:
    """SIGKILL while a job runs: its reaper ends the job, the file system's processes and every mount, and removes
    the work directory."""
    cache = tmp_path / "cache"
    bench = subprocess.Popen([sys.executable, str(REPO / "bench" / "bench_cluster.py"), "--quick", "--cache",
                              str(cache), "--png", str(tmp_path / "run.png")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_until(lambda: bench.poll() is not None or _fuse_mounts("bench-cluster-"), "the first job's mounts", 300)
        assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
        mount = Path(_fuse_mounts("bench-cluster-")[0])
        workdir = next(folder for folder in mount.parents if folder.name.startswith("bench-cluster-"))
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait()
        wait_until(lambda: not _fuse_mounts("bench-cluster-") and not _processes_mentioning(str(workdir))
                   and not workdir.exists(), "the reaper's clean-up", 120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _fuse_mounts(text: str) -> list[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        return [line.split()[4] for line in mountinfo if text in line.split()[4] and " - fuse" in line]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found
