"""`fanstore serve --stats`: each rank's counters (reads by where they came from, its peers, the node's holder of
blobs fetched ahead, staging, the cache's bound) on its own lines, and rank 0's totals for the job, gathered over
MPI once every rank agreed on the job's end (a job that ends without that agreement gets each rank's own lines).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from ..core.units import format_bytes, plural
from ..mount.mount import CacheBound
from .sources import PlacedChunkSource
from .staging import StagingReport
from .transport import PeerTransport


def rank_stats(transport: PeerTransport, source: PlacedChunkSource, report: StagingReport,
               readers: dict[str, int] | None = None, loop_requests: bool = False,
               bound: CacheBound | None = None) -> dict[str, Any]:
    return {"rank": transport.rank, "host": transport.host, "reads": source.stats(), "staging": asdict(report),
            "ahead": readers or {},  # the node's holder of blobs fetched ahead
            "doorbell": "{}:{}".format(*transport.bell.address) if transport.bell is not None else None,
            "loop_requests": loop_requests, "cache": asdict(bound) if bound is not None else None}


def report_stats(transport: PeerTransport, source: PlacedChunkSource, report: StagingReport,
                  readers: dict[str, int], loop_requests: bool, bound: CacheBound) -> None:
    """Each rank's counters on its own lines; rank 0 adds the job's totals (counters sent to it over MPI)."""
    from mpi4py import MPI

    rank, size = transport.rank, transport.size
    mine = rank_stats(transport, source, report, readers, loop_requests, bound)
    _say(format_rank(mine))
    encoded = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
    lengths = np.zeros(size, dtype=np.int64)
    transport.collective(lambda comm: (comm.Iallgather([np.array([len(encoded)], dtype=np.int64), MPI.INT64_T],
                                                       [lengths, MPI.INT64_T]), lambda: None)).result()
    gathered = np.zeros(int(lengths.sum()), dtype=np.uint8)
    displacements = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    transport.collective(lambda comm: (comm.Igatherv([encoded, MPI.BYTE],
                                                     [gathered, (lengths, displacements), MPI.BYTE], root=0),
                                       lambda: None)).result()
    if rank == 0:
        ranks = [json.loads(gathered[d : d + n].tobytes()) for d, n in zip(displacements, lengths)]
        _say(format_totals(ranks))


def report_rank_alone(transport: PeerTransport, source: PlacedChunkSource, report: StagingReport,
                      readers: dict[str, int], loop_requests: bool, bound: CacheBound) -> None:
    """This rank's counters alone, in a job that ended without every rank's agreement (a rank lost, a verdict):
    the totals' collective would wait for the missing, and where the reads of the ranks left went (their peers,
    DEST) is what such a job is looked at for."""
    _say(format_rank(rank_stats(transport, source, report, readers, loop_requests, bound))
         + f"\n  (rank {transport.rank}'s counters alone: the job ended without every rank, so no totals)")


def _say(text: str) -> None:
    """Lines in one write, so mpiexec does not interleave them with another rank's."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def format_rank(stats: dict[str, Any]) -> str:
    """A rank's counters. They count blobs, what a read fetches: a file stored whole, or one block of a large one;
    a blob fetched ahead (prefetch) counts as fetched whether or not a read comes for it."""
    local, staging = stats["reads"], stats["staging"]
    lines = [f"rank {stats['rank']} ({stats['host']}): {plural(local['local'], 'blob')} read from local chunks "
             f"({format_bytes(local['local_bytes'])}); "
             + (f"doorbell on ({stats['doorbell']})" if stats.get("doorbell") else "doorbell off")
             + ("; readers post their peer requests" if stats.get("loop_requests") else "")]
    for peer, counters in local["peers"].items():
        lines.append(f"  from rank {peer}: {plural(counters['fetched'], 'blob')} "
                     f"({format_bytes(counters['fetched_bytes'])}) in {plural(counters['asked'], 'request')}; "
                     f"to rank {peer}: {plural(counters['served'], 'blob')} "
                     f"({format_bytes(counters['served_bytes'])}); "
                     f"failed {counters['failed']:,}, refused {counters['refused']:,}")
    lines.append(f"  from DEST (fallback): {plural(local['fallback'], 'blob')} "
                 f"({format_bytes(local['fallback_bytes'])})")
    readers = stats.get("ahead") or {}
    if readers.get("asked"):
        lines.append(f"  fetched ahead on this node (mount and fanstore.torch readers): "
                     f"{plural(readers['fetched_ahead'], 'blob')}; reads asked for "
                     f"{plural(readers['asked'], 'remote blob')}, {readers['ahead_hits']:,} of them fetched ahead "
                     f"({readers['ahead_joined']:,} waited for theirs on its way)"
                     + (f"; {plural(readers['ahead_joined_failed'], 'read')} waited for one whose fetch failed "
                        f"(read again by its reader)" if readers.get("ahead_joined_failed") else "")
                     + (f", {plural(readers['ahead_failed_batches'], 'batch', 'batches')} failed to start (logged)"
                        if readers.get("ahead_failed_batches") else ""))
    if readers.get("readers_local") or readers.get("readers_dest"):
        lines.append(f"  read by fanstore.torch readers themselves: {plural(readers['readers_local'], 'blob')} from "
                     f"local chunks ({format_bytes(readers['readers_local_bytes'])}), "
                     f"{plural(readers['readers_dest'], 'blob')} from DEST "
                     f"({format_bytes(readers['readers_dest_bytes'])})")
    if readers.get("lent") or readers.get("not_lent"):
        lines.append(f"  to fanstore.torch readers: {plural(readers['lent'], 'remote blob')} lent in the node's arena, "
                     f"{readers['not_lent']:,} sent through the socket"
                     + (f" ({plural(readers['arena_full'], 'receive')} found the arena full)"
                        if readers.get("arena_full") else ""))
    if readers.get("refused") or readers.get("turned_away") or readers.get("out_of_descriptors"):
        lines.append(f"  the node's readers: {plural(readers.get('refused', 0), 'request')} refused (malformed), "
                     f"{plural(readers.get('turned_away', 0), 'connection')} turned away (over the limit)"
                     + (f", {plural(readers['out_of_descriptors'], 'accept')} failed for want of a file descriptor"
                        if readers.get("out_of_descriptors") else ""))
    lines.append(f"  staging: {format_bytes(staging['dest_bytes'])} from DEST, "
                 f"{format_bytes(staging['received_bytes'])} from peers, {format_bytes(staging['sent_bytes'])} to "
                 f"peers, {format_bytes(staging['reused_bytes'])} reused, {staging['seconds']:.1f} s"
                 + (f", {plural(staging['bad_blobs'], 'bad blob')}" if staging["bad_blobs"] else ""))
    if stats.get("cache"):
        lines.append(f"  {CacheBound(**stats['cache']).describe()}")
    return "\n".join(lines)


def format_totals(ranks: list[dict[str, Any]]) -> str:
    """The job's reads, the serve processes' and those their fanstore.torch readers made themselves (local, DEST)."""
    def readers(rank: dict[str, Any], key: str) -> int:
        return int((rank.get("ahead") or {}).get(key, 0))

    staged = sum(r["staging"]["dest_bytes"] for r in ranks)
    fallback = sum(r["reads"]["fallback_bytes"] + readers(r, "readers_dest_bytes") for r in ranks)
    local = sum(r["reads"]["local"] + readers(r, "readers_local") for r in ranks)
    dest = sum(r["reads"]["fallback"] + readers(r, "readers_dest") for r in ranks)
    remote = sum(c["fetched"] for r in ranks for c in r["reads"]["peers"].values())
    remote_bytes = sum(c["fetched_bytes"] for r in ranks for c in r["reads"]["peers"].values())
    return (f"job ({plural(len(ranks), 'rank')}): blobs read {local:,} local, {remote:,} from peers "
            f"({format_bytes(remote_bytes)}), {dest:,} from DEST; bytes read "
            f"from DEST: {format_bytes(staged)} staging ({staged:,} B), {format_bytes(fallback)} during the epochs "
            f"({fallback:,} B)")
