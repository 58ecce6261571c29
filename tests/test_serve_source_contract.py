"""The serve sources pass the exact-blob ChunkSource contract (tests/chunk_source_contract.py), with real parts:

- a PyTorch reader's sources (fanstore/serve/node_client.py) against a node endpoint (node_endpoint.py) running in
  this process on a real Unix socket, its holder of blobs fetched ahead and all: NodeServeSource, which asks the
  serve process alone, and NodeChunkSource, a served node's reader as rank 0 of two (its own blobs from its
  staged copy, the others through the socket, DEST behind both);
- a rank's sources (fanstore/serve/sources.py) under `mpiexec -n 2`, rank 0 asking rank 1 over real MPI:
  PeerChunkSource (the other rank's blobs alone) and PlacedChunkSource (the mount's source under serve).
  tests/serve_source_contract.py runs the contract's tests on rank 0 and reports each one; each is a test here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chunk_source_contract import ExactBlobContract, contract_checks, dataset_blobs, pack_contract_dataset
from conftest import REPO
from fanstore.core.chunk_source import LocalChunkSource
from fanstore.core.format import chunk_file_name
from fanstore.core.index import Index
from fanstore.serve.blobs_ahead import BlobsAhead
from fanstore.serve.node_client import NodeChunkSource, NodeConnection, NodeServeSource
from fanstore.serve.node_endpoint import NodeEndpoint
from fanstore.serve.node_protocol import BlobLookup
from fanstore.serve.placement import NO_OWNER, BlobTable, place
from fanstore.serve.staged_source import StagedChunkSource

NODE_RANK, NODES = 0, 2  # the node whose reader NodeChunkSource is, of a job of NODES


@pytest.fixture(scope="module")
def shared_dataset(tmp_path_factory) -> Path:
    """One dataset for the module's sources (none writes to it): packed once, not once a test."""
    return pack_contract_dataset(tmp_path_factory.mktemp("contract"))


@pytest.fixture(scope="module")
def endpoint(shared_dataset, tmp_path_factory):
    """The node's serve process's endpoint, in this process: it serves blobs from the dataset directory (what a
    peer would send), through its holder, on a real socket in its local directory."""
    index = Index.load(shared_dataset)
    served = LocalChunkSource(shared_dataset, index.chunks["size"])
    lookup = BlobLookup(BlobTable.of(index), len(index.chunks))
    ahead = BlobsAhead(served.start_reads, lookup.locate)
    local_dir = tmp_path_factory.mktemp("node")
    node = NodeEndpoint(local_dir, {"rank": NODE_RANK}, served, lookup, ahead)
    yield node
    node.close()
    ahead.close()
    served.close()


class TestNodeServeSource(ExactBlobContract):
    """Every blob asked of the node's serve process (READ, and READS for read_many); it refuses what is not a
    blob. No path that reads without waiting (start_read: False)."""

    @pytest.fixture
    def dataset(self, shared_dataset):
        return shared_dataset

    @pytest.fixture
    def make_source(self, endpoint):
        return lambda: NodeServeSource(NodeConnection(str(endpoint.path)))


class TestNodeChunkSource(ExactBlobContract):
    """A served node's reader, rank 0 of two: its own blobs from its staged copy (which holds only this rank's
    chunks, as staging leaves it), the others' through the serve process, DEST behind both."""

    @pytest.fixture
    def dataset(self, shared_dataset):
        return shared_dataset

    @pytest.fixture
    def make_source(self, dataset, endpoint, tmp_path):
        index = Index.load(dataset)
        sizes = index.chunks["size"]
        owners = place(index, NODES).owners
        copy = tmp_path / "local"
        shutil.copytree(dataset / "chunks", copy / "chunks")
        mine = {chunk for chunk, offset, _ in dataset_blobs(dataset) if owners.is_local(NODE_RANK, chunk, offset)}
        for chunk_id in set(range(len(sizes))) - mine:
            (copy / chunk_file_name(chunk_id)).unlink()

        def make() -> NodeChunkSource:
            dest = LocalChunkSource(dataset, sizes)
            return NodeChunkSource(NodeConnection(str(endpoint.path)), NODE_RANK, owners,
                                   StagedChunkSource(LocalChunkSource(copy, sizes), dest, NODE_RANK), dest,
                                   frozenset())
        return make


def test_a_node_reader_gets_the_other_ranks_blobs_from_the_serve_process(shared_dataset, endpoint):
    """Not from DEST behind it: the contract above would pass on DEST alone."""
    dataset = shared_dataset
    index = Index.load(dataset)
    sizes = index.chunks["size"]
    owners = place(index, NODES).owners
    remote = [blob for blob in dataset_blobs(dataset) if owners.owner(blob[0], blob[1]) not in (NODE_RANK, NO_OWNER)]
    assert remote
    dest = LocalChunkSource(dataset, sizes)
    asked_before = endpoint.stats()["asked"]
    with NodeChunkSource(NodeConnection(str(endpoint.path)), NODE_RANK, owners,
                         StagedChunkSource(LocalChunkSource(dataset, sizes), dest, NODE_RANK), dest,
                         frozenset()) as source:
        for blob in remote:
            source.read(*blob)
        source.read_many(remote)
        assert source.fallbacks == 0
    assert endpoint.stats()["asked"] - asked_before == 2 * len(remote), endpoint.stats()


# The rank's sources under mpiexec: one job for every check, each reported as a test of its own.
MPI_SOURCES = ("PeerChunkSource", "PlacedChunkSource")


@pytest.fixture(scope="module")
def mpi_contract(tmp_path_factory):
    """What tests/serve_source_contract.py saw on rank 0, by source and check; the job's stderr."""
    from test_serve import _REASON, MPIEXEC

    if _REASON is not None:
        pytest.skip(f"needs MPI: {_REASON}")
    root = tmp_path_factory.mktemp("mpi_contract")
    dest = pack_contract_dataset(root)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(Path(__file__).with_name(
        "serve_source_contract.py")), str(dest), str(root)], capture_output=True, text=True, env=env, timeout=180,
        cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {line["rank"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert set(seen) == {0, 1}, done.stdout
    return seen, done.stderr


@pytest.mark.parametrize("check", contract_checks(ExactBlobContract))
@pytest.mark.parametrize("source", MPI_SOURCES)
def test_a_ranks_source_passes_the_exact_blob_contract_over_mpi(mpi_contract, source, check):
    seen, _ = mpi_contract
    assert seen[0]["contract"][source][check] == "ok", seen[0]["contract"][source][check]


def test_a_ranks_placed_source_gets_the_other_ranks_blobs_from_it_over_mpi(mpi_contract):
    """Not from DEST behind it: the contract would pass on DEST alone. Each rank served the other."""
    seen, stderr = mpi_contract
    assert seen[0]["blobs"]["of rank 1"] > 0 and seen[1]["served"] > 0, seen
    assert seen[0]["contract"]["PlacedChunkSource"]["answered_by_the_peer"] == "ok", seen[0]
    assert "Traceback" not in stderr, stderr
