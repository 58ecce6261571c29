"""bench/bench_select.py --held-out-only, for real: on the held-out tree (bench/held_out_tree.py, kind `other`
mostly one 3 MiB file of random bytes, which a sample drawn by files missed), a `--codec auto` pack with `--fit`
just above the bound of a selection's prediction stores within 5% of the prediction and within its bound, and fits
(issue 33). Bytes only: nothing here depends on how busy the machine is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_held_out_tree_stores_what_its_selection_predicts(tmp_path: Path) -> None:
    figures = tmp_path / "held-out.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_select.py"), "--held-out-only", "--quick",
                           "--cache", str(tmp_path / "cache"), "--json", str(figures)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(figures.read_text())["held_out"]
    assert run["stopped"] == "" and run["files"] == 629, run
    assert abs(run["predicted_stored"] / run["stored_bytes"] - 1) <= 0.05, run
    assert run["stored_bytes"] <= run["stored_bound"], run
    assert run["dest_bytes"] <= run["dest_bound"] <= run["fit"], run  # the index and its dictionaries counted too
    verdicts = [line.split()[0] for line in proc.stdout.split("\ntargets\n")[1].splitlines() if line.strip()]
    assert verdicts == ["PASS"] * 3, proc.stdout
