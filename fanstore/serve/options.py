"""`fanstore serve`'s options, each default, check and help written here once: PeerOptions (how a rank asks its
peers), ServeOptions (the job), and the mount options as serve gives them (its own defaults and wording).

Light on purpose: the command line reads it to build its parser, and must not load MPI, FUSE or trio to do so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..core.options import option
from ..core.units import size_option
from ..errors import UsageError
from ..mount.options import INLINE_DECODE_BYTES, MountOptions


def _seconds(seconds: float) -> str:
    return f"{seconds:g}"


@dataclass(frozen=True, slots=True)
class PeerOptions:
    timeout: float = option(  # seconds a peer gets to answer one request
        5.0, flag="--peer-timeout", metavar="SECONDS", type=float, show=_seconds,
        help="a peer that answers nothing in this time (since its oldest request was posted and since its last "
             "reply) is skipped for a while and its files read from DEST (default {default})")
    retry_after: float = option(  # seconds a peer that missed a deadline is skipped
        30.0, flag="--peer-retry", metavar="SECONDS", type=float, show=_seconds,
        help="how long a peer that missed a deadline is skipped (default {default})")
    max_in_flight: int = option(  # requests outstanding to one peer, whoever asked them
        8, flag="--max-in-flight", metavar="K", type=int,
        help="requests outstanding to one peer at a time, whoever asked them (default {default})")
    # Bytes a request for several blobs may ask for in all (one blob may be larger): the reply is built whole, so
    # this bounds what one request can make the serving rank hold. Askers stay far below (sources.BATCH_BYTES).
    max_reply_bytes: int = 64 << 20
    # Seconds a peer may leave every request unanswered before it is lost for good: never asked again in this job
    # (its files are read from DEST) and left out of the closing agreement. 0: half of what TCP waits before it
    # gives a connection up (tcp_give_up_seconds): once TCP has, the next message posted to that peer crashes the
    # process inside the MPI library (measured with MPICH over UCX: SIGSEGV in the Isend; docs/SERVE.md).
    lost_after: float = option(
        0.0, flag="--peer-lost-after", metavar="SECONDS", type=float, show=_seconds,
        help="how long a peer may answer nothing before it is lost for the job: not asked again, its files read "
             "from DEST, and the job ends without the closing agreement; default {default}: half of the time TCP "
             "keeps a connection waiting (net.ipv4.tcp_retries2; about 460 s), after which a message to that peer "
             "crashes MPICH; set it below your fabric's own give-up time on other networks")

    def __post_init__(self) -> None:
        """The one check of these values, whoever builds them (the CLI, or Python): the option at fault is named."""
        for flag, value in (("--peer-timeout", self.timeout), ("--peer-retry", self.retry_after)):
            if not 0 < value < math.inf:
                raise UsageError(f"{flag}: must be a number of seconds more than 0 (and finite), got {value}")
        if not 0 <= self.lost_after < math.inf:
            raise UsageError(f"--peer-lost-after: must be 0 (half of TCP's give-up time) or more seconds (and finite), "
                             f"got {self.lost_after}")
        if self.max_in_flight < 1:
            raise UsageError(f"--max-in-flight: must be 1 or more requests, got {self.max_in_flight}")
        if self.max_reply_bytes < 1:
            raise UsageError(f"PeerOptions.max_reply_bytes: must be 1 or more bytes, got {self.max_reply_bytes}")

    def lost_after_seconds(self) -> float:
        return self.lost_after if self.lost_after > 0 else tcp_give_up_seconds() / 2


_TCP_RTO_MIN, _TCP_RTO_MAX = 0.2, 120.0  # the kernel's bounds of a TCP retransmission timeout, in seconds


def tcp_give_up_seconds(retries2_file: str = "/proc/sys/net/ipv4/tcp_retries2") -> float:
    """How long this network namespace's TCP keeps retransmitting a segment nobody acknowledges before it gives the
    connection up: the kernel's model for net.ipv4.tcp_retries2 (15 by default: 924.6 s), the timeout starting
    at the smallest and doubling up to the largest. At least that long: a slower path starts from a larger one."""
    try:
        retries = int(Path(retries2_file).read_text())
    except (OSError, ValueError):
        retries = 15
    doublings = int(math.log2(_TCP_RTO_MAX / _TCP_RTO_MIN))
    if retries <= doublings:
        return ((2 << retries) - 1) * _TCP_RTO_MIN
    return ((2 << doublings) - 1) * _TCP_RTO_MIN + (retries - doublings) * _TCP_RTO_MAX


# Under serve, files from other nodes are fetched ahead in batches, each peer's in one request: a deeper window
# makes the batches larger. Measured with 3 ranks, 128 KiB files, --prefetch-list, a CPU per node: remote files/s at
# 89.3-90.0% of local with 16, against 83.0-85.5% with 8 (mount's default) and 83.2-89.5% with 32.
SERVE_PREFETCH = 16
# Each rank's mount, as serve gives it unless told otherwise: a number of threads fetching ahead (not 0, one per
# core: most of them wait on the network).
SERVE_MOUNT = MountOptions(prefetch=SERVE_PREFETCH, prefetch_threads=8)
# The mount's options as `fanstore serve --help` words them: under serve they fetch from other nodes too.
SERVE_MOUNT_HELP = {
    "prefetch_list": "the epoch's reading order, one file's path a line (in the dataset or through the rank's "
                     "MOUNTPOINT; or split by NUL bytes, as find -print0 writes it): files are fetched and decoded "
                     "ahead ({rank} is replaced by the rank: each its own order)",
    "prefetch": "after each file opened, fetch and decode ahead those of the next N files that are stored on another "
                f"node or in at least {size_option(INLINE_DECODE_BYTES)} (default {{default}}; 0 turns it off)",
    "prefetch_threads": "threads fetching and decoding ahead (default {default})",
    "cache_size": "decoded cache of each mount (default: a quarter of what the job may still use once staged, "
                  "available RAM or its memory cgroup's room, split among the ranks on one host)",
    "allow_other": "let other users read the mounts",
}


@dataclass(frozen=True)
class ServeOptions:
    dest: Path
    mountpoint: str  # `{rank}` is replaced by the rank
    local_dir: str = option(  # `{rank}` is replaced by the rank
        flag="--local-dir", metavar="DIR", required=True,
        help="node-local storage for this node's chunks (e.g. $TMPDIR or /dev/shm/...); chunks verified there by an "
             "earlier job are not staged again")
    command: tuple[str, ...] = ()
    stats: bool = option(False, flag="--stats",
                         help="print each rank's counters at the end, and the job's totals on rank 0")
    ready_file: str | None = option(  # default MOUNTPOINT.ready
        None, flag="--ready-file", metavar="FILE",
        help="without COMMAND: written once every rank is mounted (default MOUNTPOINT.ready)")
    peer: PeerOptions = PeerOptions()
    mount: MountOptions = SERVE_MOUNT
    progress: bool = option(True, flag="--quiet", help="no staging progress bar")
    doorbell: bool = option(  # peers ring each other awake over UDP (doorbell.py); else they poll alone
        True, flag="--no-doorbell",
        help="peers do not ring each other awake with a UDP datagram (for networks that drop UDP between nodes; "
             "fanstore turns them off itself when a start-up check fails): each rank then polls MPI alone, "
             "lingering after work")
    loop_requests: bool = option(  # MPI_THREAD_MULTIPLE: readers post their own requests to peers (remote_blobs.py)
        True, flag="--mpi-thread-only",
        help="only the MPI thread calls MPI (initialised at MPI_THREAD_SERIALIZED): readers hand it every request to "
             "a peer instead of posting it themselves (for an MPI whose MPI_THREAD_MULTIPLE is slow or broken)")

    def __post_init__(self) -> None:
        """Serve's own rule beyond the mount's: threads fetch ahead, so their number is given, not 0 (one per core)."""
        if self.mount.prefetch_threads < 1:
            raise UsageError(f"--prefetch-threads: must be 1 or more threads, got {self.mount.prefetch_threads}")
