"""A short soak of `fanstore serve` (bench/soak_serve.py --small): 3 ranks on this machine, each rank's COMMAND
reading every file every epoch in a shuffled order, with a decoded cache far below the dataset, each file's pages
dropped from the page cache after its read so that every epoch reaches the daemons. What the job must show after
its warm-up (2 epochs): no read failed, open files and threads constant, RSS growing under a generous bound (the
20-epoch soak in bench/ judges < 1 MiB an epoch). Behaviour, never time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from fanstore.mount.mount import fuse_unavailable_reason
from test_serve import _mpi_unavailable_reason

_REASON = fuse_unavailable_reason() or _mpi_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs FUSE and MPI: {_REASON}")

EPOCHS = 4
STEADY_AFTER = 2  # bench/soak_serve.py's warm-up
# An epoch of the small set reads about 90 MB a rank: a decoded file kept per read, or a buffer per remote blob,
# would grow RSS by tens of MiB an epoch; allocator settling measured 0.3-3.8 MiB an epoch here.
RSS_BOUND = 8 << 20  # bytes an epoch after the warm-up
IDLE_BOUND = 0.10  # of a core at the end: a thread left spinning would take most of one


def test_a_short_soak_leaks_nothing_and_fails_no_read(tmp_path: Path) -> None:
    figures = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "soak_serve.py"), "--small", "--epochs", str(EPOCHS),
                           "--idle-seconds", "1", "--cache", str(tmp_path / "cache"), "--json", str(figures)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert figures.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(figures.read_text())
    report = done.stdout[-6000:]
    assert result["epochs"] == EPOCHS and result["steady_after"] == STEADY_AFTER
    assert result["returncode"] == 0, report

    # Every read succeeded, byte for byte (the readers check each file's size and CRC-32).
    failed = [(epoch + 1, rank, reports["messages"]) for epoch, epoch_reports in enumerate(result["reports"])
              for rank, reports in enumerate(epoch_reports) if reports["failures"]]
    assert not failed, failed

    # The soak reads through the daemons, not the page cache: a second read is the kernel's, one after
    # POSIX_FADV_DONTNEED reaches the daemon again, and so does every epoch.
    for first, again, after_drop in result["probe"]:
        assert first >= 1 and again == 0 and after_drop >= 1, result["probe"]
    for epoch_reports in result["reports"]:
        for reports in epoch_reports:
            assert reports["blob_reads"] >= 0.9 * reports["files"], report
            assert reports["cache_evictions"] > 0, report  # the decoded cache churns

    # After the warm-up: open files and threads (trio's idle workers aside) constant, RSS nearly so.
    steady = result["samples"][STEADY_AFTER:]
    for rank in range(result["ranks"]):
        assert len({sample[rank]["fds"] for sample in steady}) == 1, report
        assert len({sample[rank]["lasting_threads"] for sample in steady}) == 1, report
        grown = steady[-1][rank]["rss"] - steady[0][rank]["rss"]
        assert grown < RSS_BOUND * (EPOCHS - STEADY_AFTER), report
    assert max(result["idle_end"]) < IDLE_BOUND, report
