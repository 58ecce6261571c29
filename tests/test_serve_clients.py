"""Real file formats (tests/client_files.py) read under a real `mpiexec -n 3 fanstore serve` on ranks that store
none of their bytes: every blob comes from a peer over MPI, or from DEST when the peer does not answer. Each dataset
is packed twice, every file stored whole and the large ones in small blocks, as tests/test_clients.py packs it.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from client_files import BLOCK, hdf5_contents, pack_client_tree, sqlite_contents, tar_contents, zip_contents
from fanstore import open_dataset
from fanstore.serve.placement import place
from test_serve import _REASON, RANKS, Job, jobs  # noqa: F401  (jobs: the fixture)

pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs FUSE and MPI: {_REASON}")
PEER_TIMEOUT = 1.0


@pytest.fixture(scope="module", params=["whole", "blocks"])
def packed(request, tmp_path_factory) -> tuple[Path, Path]:
    return pack_client_tree(tmp_path_factory.mktemp(f"serve-clients-{request.param}"), request.param)


def _owners(dest: Path, name: str) -> set[int]:
    """The ranks that store a blob of `name` (its own, or one of its blocks')."""
    with open_dataset(dest) as dataset:
        index, entry = dataset.index, dataset.resolve(name)
        rows = index.block_rows(entry)
        blobs = index.blocks[rows.start : rows.stop] if len(rows) else index.entries[entry : entry + 1]
        return set(place(index, RANKS).owners.owners_of(blobs["chunk"], blobs["offset"]).tolist())


def test_every_client_reads_files_stored_on_other_ranks_as_the_original(packed, tmp_path, jobs):
    """On each rank, through its mount (clients, random and block-straddling reads, reads past the end, a mapping,
    two processes at once) and through the node's dataset (clients, seeks, FileDataset(None)), the files of which
    the rank stores nothing; each file is such a file on some rank."""
    src, dest = packed
    script = Path(__file__).with_name("serve_clients_remote.py")
    job = Job(tmp_path, dest, command=[sys.executable, str(script), str(src), str(dest), str(BLOCK)])
    jobs.append(job)
    code, out, err = job.finish()
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and len(reports) == RANKS, out + err
    assert [report["problems"] for report in reports] == [[]] * RANKS, out
    assert set().union(*(report["remote"] for report in reports)) == set(os.listdir(src)), out
    assert all(report["from_peers"] > 0 for report in reports), out
    assert "Traceback" not in err, err


def test_a_peer_stopped_mid_read_costs_its_readers_a_deadline_not_a_wrong_answer(packed, tmp_path, jobs):
    """The rank that stores the database stops answering while another rank's readers, through the mount and the
    node's dataset, are partway through it: they get the rest from DEST after one deadline, right, and the
    clients of the other files read them as before."""
    src, dest = packed
    stalled = max(_owners(dest, "table.sqlite"))
    reader = min(rank for rank in range(RANKS) if rank not in _owners(dest, "table.sqlite"))
    job = Job(tmp_path, dest, "--peer-timeout", str(PEER_TIMEOUT), "--stats")
    jobs.append(job)
    pids = job.wait_ready()
    mountpoint = job.mountpoints[reader]
    from fanstore.serve.node_client import open_served_dataset

    database = (src / "table.sqlite").read_bytes()
    with open_served_dataset(job.ready_files()[reader].read_text().splitlines()[2]) as served, \
            open(mountpoint / "table.sqlite", "rb") as through_mount, served.open("table.sqlite") as through_api:
        first_parts = (through_mount.read(BLOCK + 10), through_api.read(3 * BLOCK + 10))
        os.kill(pids[stalled], signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert first_parts[0] + through_mount.read() == database
            assert first_parts[1] + through_api.read() == database
            assert sqlite_contents(mountpoint / "table.sqlite") == sqlite_contents(src / "table.sqlite")
            with open(mountpoint / "bundle.tar", "rb") as bundle, open(src / "bundle.tar", "rb") as original:
                assert tar_contents(bundle) == tar_contents(original)
            with served.open("archive.zip") as archive:
                assert zip_contents(io.BufferedReader(archive)) == zip_contents(src / "archive.zip")
            if (src / "data.h5").exists():
                assert hdf5_contents(mountpoint / "data.h5") == hdf5_contents(src / "data.h5")
            elapsed = time.monotonic() - started
        finally:
            os.kill(pids[stalled], signal.SIGCONT)
    assert elapsed < 10 * PEER_TIMEOUT, elapsed
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()
    assert code == 0, out + err
    assert f"rank {stalled}: no answer within 1 s" in err, err
    fallback = re.search(rf"^rank {reader} \(.*\n(?:  .*\n)*?  from DEST \(fallback\): ([\d,]+) blob", out, re.M)
    assert fallback and int(fallback[1].replace(",", "")) > 0, out
    assert "Traceback" not in err, err
