"""Checks every rank makes at start that need the other ranks' answers (each an Iallgather of digests): what one
rank cannot see alone; and every rank's host name, once they have passed. Their problems go through the start-up agreement (polling.first_failed_rank), so one rank's
problem stops every rank before anything is copied. A rank that failed already still takes part, with nothing to
compare."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .polling import wait_all

HOST_NAME_BYTES = 64  # of a host's name gathered from every rank (host_names)


def _gather(comm: Any, mine: np.ndarray) -> np.ndarray:
    """Every rank's `mine` (uint64 digests, the same count on every rank), a row per rank."""
    from mpi4py import MPI

    everyone = np.zeros((comm.Get_size(), len(mine)), dtype=np.uint64)
    wait_all([comm.Iallgather([mine, MPI.UINT64_T], [everyone, MPI.UINT64_T])])
    return everyone


def shared_paths(comm: Any, host: str, paths: dict[str, Path | None]) -> str | None:
    """Whether another rank on this host was given one of this rank's `paths` (by option name, links followed;
    the same names on every rank, None where this rank has none): two ranks staging into one directory undo each
    other's chunk files, and two mounts on one point hide each other."""
    names = list(paths)
    mine = np.zeros(len(names), dtype=np.uint64)
    for i, name in enumerate(names):
        path = paths[name]
        if path is not None:
            mine[i] = xxhash.xxh3_64_intdigest(f"{host}\0{os.path.realpath(path)}".encode()) | 1  # never 0: none
    everyone = _gather(comm, mine)
    rank = comm.Get_rank()
    for i, name in enumerate(names):
        others = [other for other in np.flatnonzero(everyone[:, i] == mine[i]) if other != rank]
        if mine[i] and others:
            return (f"rank {rank} on {host}: {name} {paths[name]} is rank {others[0]}'s too: ranks on one host "
                    f"need their own (put {{rank}} in it)")
    return None


def other_dataset(comm: Any, host: str, dest: Path, identity: str | None) -> str | None:
    """Whether this rank's DEST holds another dataset than rank 0's (`identity`: staging.index_identity; None
    where this rank has none): a copy re-packed meanwhile, another path on this node. Each rank would place and
    ask for blobs by an index the others do not have."""
    mine = np.array([int(identity, 16) if identity else 0], dtype=np.uint64)
    first = _gather(comm, mine)[0, 0]
    if mine[0] and first and mine[0] != first:
        return (f"rank {comm.Get_rank()} on {host}: DEST {dest} is not the dataset rank 0 serves (their indexes "
                f"differ): every rank must serve the same one")
    return None


def host_names(comm: Any, host: str) -> list[str]:
    """Every rank's host name (the first HOST_NAME_BYTES bytes of it), by rank."""
    from mpi4py import MPI

    mine = np.frombuffer(host.encode("utf-8", "replace")[:HOST_NAME_BYTES].ljust(HOST_NAME_BYTES, b"\0"),
                         dtype=np.uint8)
    everyone = np.zeros(comm.Get_size() * HOST_NAME_BYTES, dtype=np.uint8)
    wait_all([comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE])])
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in everyone.reshape(-1, HOST_NAME_BYTES)]


def ranks_sharing_memory(comm: Any, host: str, cgroup: str | None) -> list[int]:
    """The ranks, this one included, that draw on the same memory as this one: on this host, and under the same
    memory cgroup limit (`cgroup`: the path of the one that binds, job_memory; None where none is set). Their
    decoded caches share it, and so do their staged bytes where their local dirs are tmpfs."""
    mine = np.array([xxhash.xxh3_64_intdigest(f"{host}\0{cgroup or ''}".encode())], dtype=np.uint64)
    everyone = _gather(comm, mine)
    return [rank for rank in range(comm.Get_size()) if everyone[rank, 0] == mine[0]]
