"""Staging: each rank copies what the placement gives it from DEST into its local directory, verified.

A rank's local directory (local_dir.py) mirrors DEST's chunk files by name, as sparse files of the chunks' sizes
holding the rank's bytes (its pieces, every replicated chunk, and the header of each): the single-node
LocalChunkSource reads them unchanged, and the placement guarantees no read reaches a hole. Spread pieces are read
from DEST by their rank alone; each replicated chunk is read from DEST by one rank (Placement.replicated_reader),
which sends it to the others over MPI: every stored byte leaves the shared file system once per job, and each chunk
file a rank reads is opened once, not once a span (dest_files.py). Bytes move in spans of whole blobs, and every
blob is checked against its checksum as it arrives (blob_spans.py). A manifest lists the ranges verified, so a job
restarted on the same nodes stages only what its directory lacks (what it holds is checked again, locally, first:
the file, the headers and the blobs; a range that fails is logged and staged again). Once staged, the directory
also gets a copy of DEST's index file (local_dir.copy_index), which the node's readers load instead of DEST's; the
manifest's checks and reuse look at chunk files alone.

Every wait here is a Testsome or an Improbe between sleeps (polling.py): staging runs while other ranks are still
reading DEST, and must not spin their cores.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from ..core.format import CHUNK_HEADER_LEN, INDEX_NAME, chunk_file_name
from ..core.index import Index
from ..mount.job_memory import job_memory, memory_file_system
from ..core.units import format_bytes, plural
from .blob_spans import Span, check_span, header_problem, spans_of
from .dest_files import DestChunkFiles
from .local_dir import LocalDirectory, StagingBroken, StagingError
from .placement import Placement
from .polling import Backoff, first_failed_rank, wait_all

log = logging.getLogger("fanstore.serve")

SENDS_IN_FLIGHT = 4  # spans a rank is sending at once, each to every rank that lacks it
TAG_STAGE = 2
TAG_STAGED = 3  # to rank 0, empty: this rank's staging is done
SPAN_HEADER = struct.Struct("<IIQ")  # chunk, flags, start; the span's bytes follow
SPAN_MISSING = 1  # the sender could not read the span: nothing follows, and the receiver leaves a hole
# Seconds with nothing from a rank this one waits on before it says so: a node whose read of DEST hangs (a stuck
# parallel file system client) stalls every rank waiting for its spans, and at a thousand nodes the one to look
# at must be named.
STALL_REPORT = 60.0


@dataclass
class StagingReport:
    """What staging did on one rank, as --stats prints it."""

    reused_bytes: int = 0  # verified in the local directory already (a restarted job)
    dest_bytes: int = 0  # read from DEST
    received_bytes: int = 0  # replicated bytes from peers
    sent_bytes: int = 0  # replicated bytes sent to peers
    written_bytes: int = 0
    bad_blobs: int = 0  # blobs whose checksum did not match; their files will fail to read, the rest not
    unreadable: list[str] = field(default_factory=list)  # DEST chunk files that could not be read
    unverified_chunks: list[int] = field(default_factory=list)  # staged with a fault: read from DEST instead
    seconds: float = 0.0


def index_identity(index_bytes: bytes | mmap.mmap) -> str:
    """What tells one packed dataset from another: the checksum of its index file's bytes."""
    return f"{xxhash.xxh3_64_intdigest(index_bytes):016x}"


def dataset_identity(dest: Path) -> str:
    """The identity (index_identity) of the dataset in `dest`, its index file read for it."""
    with open(dest / INDEX_NAME, "rb") as index_file:
        return index_identity(index_file.read())


class Stager:
    """Stages one rank's share; `run()` returns once every rank's share is in place (collectively)."""

    def __init__(self, comm: Any, index: Index, placement: Placement, dest: Path, local_dir: Path,
                 progress: Callable[[int, int], None] | None = None, stall_report: float = STALL_REPORT,
                 identity: str | None = None, index_copy_bytes: int = 0,
                 memory_sharers: list[int] | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.index = index
        self.placement = placement
        self.dest = dest
        self.local = LocalDirectory(local_dir, index.chunks["size"])
        self._dest_files = DestChunkFiles(dest)  # each chunk file opened once however many spans it gives
        self.blobs = placement.blobs
        self.report = StagingReport()
        self._progress = progress
        self._stall_report = stall_report
        self._sizes = [int(size) for size in index.chunks["size"]]
        self._readers = placement.replicated_readers()
        self._replicated = frozenset(placement.replicated_chunks)
        self._identity = identity  # dataset_identity(dest), when the caller has it already
        self._index_copy_bytes = index_copy_bytes  # what the caller's copy_index writes here once staged
        self._memory_sharers = memory_sharers or [self.rank]  # ranks on this one's memory (ranks_sharing_memory)
        self._verified: dict[int, list[tuple[int, int]]] = {}
        self._unverified: set[int] = set()  # chunks with a bad or missing span: not recorded in the manifest

    # --- what to do -------------------------------------------------------------------------------------------

    def _share(self) -> list[Span]:
        """This rank's ranges: its pieces (each with the chunk's header) and every replicated chunk whole."""
        share = []
        for piece in self.placement.pieces(self.rank):
            if piece.start > 0:
                share.append(Span(piece.chunk, 0, CHUNK_HEADER_LEN))
            share.append(Span(piece.chunk, piece.start, piece.end))
        share.extend(Span(chunk, 0, self._sizes[chunk]) for chunk in self.placement.replicated_chunks)
        return share

    def _reusable(self, share: list[Span], identity: str) -> set[Span]:
        """Ranges of the share that the manifest lists and that still check as staging checked them (the file's type
        and size, the chunk's header, every blob): not staged again. A range listed that no longer checks is staged
        again, and its chunk's damage logged once: its readers would otherwise read DEST, job after job."""
        held = self.local.read_manifest(identity)
        reusable = set()
        damaged: dict[int, str] = {}
        for span in share:
            if not any(a <= span.start and span.end <= b for a, b in held.get(span.chunk, [])):
                continue
            path = self.local.chunk_path(span.chunk)
            data = self.local.read(span)
            if data is None:
                problem = f"{path}: missing, unreadable, or not chunk {span.chunk}'s size"
            else:
                bad = check_span(self.blobs, span, data)
                problem = header_problem(span, data, path) or (
                    f"{path}: {plural(len(bad), 'blob')} with a bad checksum (first at offset {bad[0]})"
                    if bad else None)
            if problem is None:
                reusable.add(span)
            else:
                damaged.setdefault(span.chunk, problem)
        for chunk, problem in sorted(damaged.items()):
            log.warning("rank %d: staging: %s: this node's copy of chunk %d, verified by an earlier job, is damaged; "
                        "staging it again", self.rank, problem, chunk)
        return reusable

    def run(self) -> StagingReport:
        started = time.monotonic()
        identity = self._identity = self._identity or dataset_identity(self.dest)
        share = self._share()
        reusable = self._reusable(share, identity)
        missing = [span for span in share if span not in reusable]
        self.report.reused_bytes = sum(span.end - span.start for span in reusable)
        for span in reusable:
            self._verified.setdefault(span.chunk, []).append((span.start, span.end))
        self._check_capacity(missing)
        try:
            self._stage(reusable, missing)
        except OSError as exc:  # reading DEST has its own rules (_read_dest): this is the local directory failing
            raise StagingBroken(f"rank {self.rank} on {socket.gethostname()}: --local-dir {self.local.path}: cannot "
                                f"write {exc.filename or 'to it'}: {exc.strerror}") from None
        self.report.seconds = time.monotonic() - started
        self._hear_every_rank_staged()
        return self.report

    def _hear_every_rank_staged(self) -> None:
        """Every rank tells rank 0 its staging is done, and rank 0 names those it has not heard from a while after
        its own: a rank whose read of DEST hangs would otherwise hold the others at the next collective, which
        cannot say who is missing."""
        from mpi4py import MPI

        if self.rank != 0:
            wait_all([self.comm.Isend([b"", MPI.BYTE], dest=0, tag=TAG_STAGED)])
            return
        waiting, status, backoff = set(range(1, self.size)), MPI.Status(), Backoff()
        since, reported = time.monotonic(), False
        while waiting:
            message = self.comm.Improbe(MPI.ANY_SOURCE, TAG_STAGED, status)
            if message is not None:
                message.Recv([bytearray(0), MPI.BYTE])
                waiting.discard(status.Get_source())
                backoff.progressed()
                continue
            if not reported and time.monotonic() - since > self._stall_report:
                reported = True
                named = sorted(waiting)
                log.warning("rank 0: staging: %d rank%s still staging %.0f s after this one: %s%s", len(named),
                            "s" if len(named) > 1 else "", time.monotonic() - since,
                            ", ".join(map(str, named[:10])), " ..." if len(named) > 10 else "")
            backoff.sleep()

    def _stage(self, reusable: set[Span], missing: list[Span]) -> None:
        from mpi4py import MPI

        # Which replicated chunks each rank lacks, so a chunk goes only where it is missing.
        replicated = self.placement.replicated_chunks
        lacks_mine = np.array([Span(c, 0, self._sizes[c]) not in reusable for c in replicated], dtype=np.uint8)
        lacks = np.zeros((self.size, len(replicated)), dtype=np.uint8)
        wait_all([self.comm.Iallgather([lacks_mine, MPI.BYTE], [lacks, MPI.BYTE])])
        position = {chunk: i for i, chunk in enumerate(replicated)}

        if missing:
            self.local.forget_manifest()
        keep = {span.chunk for span in reusable}
        for chunk in sorted({span.chunk for span in missing}):
            self.local.open_for_staging(chunk, keep=chunk in keep)

        own_spans = [s for span in missing if span.chunk not in position
                     for s in spans_of(self.blobs, span.chunk, span.start, span.end)]
        to_send = []  # (span, ranks to send it to, whether this rank needs it too)
        expected: Counter[int] = Counter()  # spans to receive, by sender
        for chunk in replicated:
            receivers = [r for r in range(self.size) if lacks[r, position[chunk]]]
            if not receivers:
                continue
            reader = self._readers[chunk]
            spans = spans_of(self.blobs, chunk, 0, self._sizes[chunk])
            if reader == self.rank:
                to_send.extend((span, [r for r in receivers if r != self.rank], self.rank in receivers)
                               for span in spans)
            elif self.rank in receivers:
                expected[reader] += len(spans)
        total = (sum(span.end - span.start for span, _, _ in to_send)
                 + sum(s.end - s.start for s in own_spans)
                 + sum(span.end - span.start for span in missing if span.chunk in position
                       and self._readers[span.chunk] != self.rank))
        self._dest_files.expect([span.chunk for span in own_spans] + [span.chunk for span, _, _ in to_send])
        try:
            self._move(own_spans, to_send, expected, total)
        finally:
            self._dest_files.close()
        self.local.close()
        self._record(missing)

    def _check_capacity(self, missing: list[Span]) -> None:
        """Every rank checks its directory's free space before anything is copied, for its share and the copy of the
        index written once staged, and, where the directory is memory (tmpfs), the memory the job may still use; if
        one cannot take them, no rank copies anything, and that rank says why in one line (not once staged, when
        the whole job would have to end)."""
        chunk_bytes = sum(span.end - span.start for span in missing)
        needed = chunk_bytes + self._index_copy_bytes
        try:
            self.local.path.mkdir(parents=True, exist_ok=True)
            info = os.statvfs(self.local.path)
            free, device, problem = info.f_bavail * info.f_frsize, os.stat(self.local.path).st_dev, ""
        except OSError as exc:
            free, device, problem = 0, None, f"cannot use it: {exc.strerror}"
        together, others = self._file_system_sharers(device, needed)
        if not problem and together > free:
            also = (f", {format_bytes(together)} with rank{'s' if len(others) > 1 else ''} {', '.join(others)}, whose "
                    f"--local-dir is on the same file system") if others else ""
            problem = (f"not enough space: needs {format_bytes(needed)} ({needed:,} bytes){also}, {format_bytes(free)} "
                       "free")
        problem = self._memory_problem(0 if problem else needed) or problem
        failed = first_failed_rank(self.comm, bool(problem))
        if problem:
            raise StagingError(f"rank {self.rank} on {socket.gethostname()}: --local-dir {self.local.path}: {problem}, "
                               f"for its share of the chunk files ({chunk_bytes:,} bytes) and its copy of DEST's index "
                               f"({self._index_copy_bytes:,} bytes)")
        if failed is not None:
            raise StagingError(f"rank {failed} cannot stage its share (see its message); nothing was copied")

    def _file_system_sharers(self, device: int | None, needed: int) -> tuple[int, list[str]]:
        """What the ranks whose local directory is on the same file system as this one's (the same host and
        device: one tmpfs or disk for several ranks of a host) will write there together, and those other ranks
        that write any. Each checked its free space alone, and all three of three ranks sharing a 160 MiB tmpfs
        passed and filled it mid-staging. A collective: every rank calls it (device None: its directory failed)."""
        from mpi4py import MPI

        key = 0 if device is None else xxhash.xxh3_64_intdigest(f"{socket.gethostname()}\0{device}".encode())
        mine = np.array([key, needed], dtype=np.uint64)
        everyone = np.zeros((self.size, 2), dtype=np.uint64)
        wait_all([self.comm.Iallgather([mine, MPI.UINT64_T], [everyone, MPI.UINT64_T])])
        if device is None:
            return needed, []
        sharing = everyone[:, 0] == np.uint64(key)
        others = [str(rank) for rank in np.flatnonzero(sharing).tolist() if rank != self.rank and everyone[rank, 1]]
        return int(everyone[sharing, 1].sum()), others

    def _memory_problem(self, needed: int) -> str:
        """What a local directory on tmpfs lacks in memory ("" when nothing), for `needed` bytes written there.

        Its pages take the machine's memory and are charged to the memory cgroup of the rank that writes them (a
        batch job's limit), so they must fit what the job may still use (job_memory), together with those of the
        ranks that draw on the same memory (memory_sharers). A collective: every rank calls it."""
        from mpi4py import MPI

        fs_type = memory_file_system(self.local.path) if needed else None
        mine = np.array([needed if fs_type else 0], dtype=np.int64)
        everyone = np.zeros(self.size, dtype=np.int64)
        wait_all([self.comm.Iallgather([mine, MPI.INT64_T], [everyone, MPI.INT64_T])])
        if fs_type is None:
            return ""
        memory = job_memory()
        together = int(everyone[self._memory_sharers].sum())
        if together <= memory.available:
            return ""
        others = [str(rank) for rank in self._memory_sharers if rank != self.rank and everyone[rank]]
        where = " under the same memory cgroup" if memory.cgroup is not None else ""
        also = (f", {format_bytes(together)} with rank{'s' if len(others) > 1 else ''} {', '.join(others)} on this "
                f"host{where}") if others else ""
        return (f"not enough memory: it is on a {fs_type}, whose files take the job's memory: needs "
                f"{format_bytes(needed)} ({needed:,} bytes){also}, {memory.describe()}")

    # --- moving the bytes -------------------------------------------------------------------------------------

    def _move(self, own_spans: list[Span], to_send: list, expected: Counter[int], total: int) -> None:
        """Move this rank's bytes until nothing is left to read, send or receive: each round stages one span of its
        own, starts sending one replicated span, reaps finished sends and takes every span that came; it sleeps
        only after a round in which nothing moved."""
        from mpi4py import MPI

        done_bytes = 0
        sending: list[tuple[list[Any], bytes]] = []  # MPI requests of one span, and the buffer they send
        awaited = +expected  # spans still to come, by sender
        backoff = Backoff()
        status = MPI.Status()
        own = deque(own_spans)
        send_queue = deque(to_send)
        quiet_since, reported = time.monotonic(), False
        while own or send_queue or sending or awaited:
            progressed = False
            if own:  # this rank's own pieces, a span per round so peers waiting on our sends are not held up
                done_bytes += self._stage_own(own.popleft())
                progressed = True
            if send_queue and len(sending) < SENDS_IN_FLIGHT:
                done_bytes += self._send_replicated(*send_queue.popleft(), sending)
                progressed = True
            if sending:
                progressed |= self._reap_sends(sending)
            received, arrived = self._take_arrived(awaited, status)
            done_bytes += received
            progressed |= arrived
            if self._progress is not None:
                self._progress(done_bytes, total)
            if progressed:
                backoff.progressed()
                quiet_since, reported = time.monotonic(), False
                continue
            if awaited and not reported and time.monotonic() - quiet_since > self._stall_report:
                reported = True
                self._report_stall(awaited, time.monotonic() - quiet_since)
            backoff.sleep()

    def _stage_own(self, span: Span) -> int:
        """One span of this rank's own pieces, from DEST into the local directory; its length, done either way."""
        data = self._read_dest(span)
        if data is not None:
            self._check_and_write(span, data)
        return span.end - span.start

    def _send_replicated(self, span: Span, receivers: list[int], needed_here: bool,
                         sending: list[tuple[list[Any], bytes]]) -> int:
        """Start sending a replicated span this rank reads to `receivers` (flagged SPAN_MISSING when it could not
        be read), writing it here too when this rank lacks it; its sends join `sending`. Its length."""
        from mpi4py import MPI

        data = self._read_replicated(span)
        if data is not None and needed_here:
            self._check_and_write(span, data)
        message = SPAN_HEADER.pack(span.chunk, 0 if data is not None else SPAN_MISSING, span.start) + (
            data if data is not None else b"")
        requests = [self.comm.Isend([message, MPI.BYTE], dest=r, tag=TAG_STAGE) for r in receivers]
        self.report.sent_bytes += (len(message) - SPAN_HEADER.size) * len(receivers)
        sending.append((requests, message))
        return span.end - span.start

    @staticmethod
    def _reap_sends(sending: list[tuple[list[Any], bytes]]) -> bool:
        """Drop from `sending` the spans whose sends have all completed, and their buffers; whether any had."""
        from mpi4py import MPI

        still = [(requests, message) for requests, message in sending if not MPI.Request.Testall(requests)]
        reaped = len(still) < len(sending)
        sending[:] = still
        return reaped

    def _take_arrived(self, awaited: Counter[int], status: Any) -> tuple[int, bool]:
        """Receive every span that has come while some are awaited (`awaited`: spans still to come, by sender, a
        sender done dropped from it); the bytes they brought, and whether any came."""
        from mpi4py import MPI

        received, arrived = 0, False
        while awaited:
            incoming = self.comm.Improbe(MPI.ANY_SOURCE, TAG_STAGE, status)
            if incoming is None:
                break
            buffer = np.empty(status.Get_count(MPI.BYTE), np.uint8)  # a span's megabytes, not zeroed first
            incoming.Recv([buffer, MPI.BYTE])
            source = status.Get_source()
            awaited[source] -= 1
            if awaited[source] <= 0:  # a sender done is forgotten (and one never expected stays out)
                del awaited[source]
            received += self._receive(source, buffer)
            arrived = True
        return received, arrived

    def _report_stall(self, awaited: Counter[int], quiet_for: float) -> None:
        """Name the ranks this one still waits on: a stalled read of DEST on one node holds up all that wait on it."""
        log.warning("rank %d: staging: nothing has come from rank%s %s for %.0f s; still waiting (a stalled read of "
                    "the dataset on that node?)", self.rank, "s" if len(awaited) > 1 else "",
                    ", ".join(map(str, sorted(awaited))), quiet_for)

    def _read_dest(self, span: Span) -> bytes | None:
        path = self._dest_files.path(span.chunk)
        try:
            data = self._dest_files.read(span.chunk, span.start, span.end - span.start)
        except OSError as exc:
            self._unreadable(span.chunk, f"{path}: {exc.strerror}")
            return None
        self.report.dest_bytes += len(data)
        if len(data) != span.end - span.start:
            self._unreadable(span.chunk, f"{path}: shorter than the index says (truncated)")
            return None
        return data

    def _read_replicated(self, span: Span) -> bytes | None:
        """A replicated span this rank sends: from its own verified copy when it has one, else from DEST."""
        if any(a <= span.start and span.end <= b for a, b in self._verified.get(span.chunk, [])):
            data = self.local.read(span)
            if data is not None:
                self._dest_files.done(span.chunk)
                return data
        return self._read_dest(span)

    def _unreadable(self, chunk: int, reason: str) -> None:
        self._unverified.add(chunk)
        if reason not in self.report.unreadable:
            self.report.unreadable.append(reason)
            log.error("staging: %s; the files in that chunk will fail to read", reason)

    def _receive(self, source: int, message: bytearray | np.ndarray) -> int:
        if len(message) < SPAN_HEADER.size:
            log.error("staging: rank %d sent a malformed span (%d bytes): dropped", source, len(message))
            return 0
        chunk, flags, start = SPAN_HEADER.unpack_from(message)
        if chunk not in self._replicated:
            log.error("staging: rank %d sent a span of chunk %d, not a replicated chunk: dropped", source, chunk)
            return 0
        if flags & SPAN_MISSING:
            self._unreadable(chunk, f"rank {source} could not read {chunk_file_name(chunk)} from the dataset")
            return 0
        data = memoryview(message)[SPAN_HEADER.size:]
        span = Span(chunk, start, start + len(data))
        if span.end > self._sizes[chunk]:
            log.error("staging: rank %d sent bytes past the end of chunk %d: dropped", source, chunk)
            return 0
        self.report.received_bytes += len(data)
        self._check_and_write(span, data)
        return len(data)

    def _check_and_write(self, span: Span, data: bytes | memoryview) -> None:
        problem = header_problem(span, data, self.dest / chunk_file_name(span.chunk))
        if problem is not None:
            self._unverified.add(span.chunk)
            log.error("staging: %s; the files in that chunk will fail to read", problem)
        bad = check_span(self.blobs, span, data)
        if bad:
            self.report.bad_blobs += len(bad)
            self._unverified.add(span.chunk)
            log.error("staging: %s: %s with a bad checksum (first at offset %d); the files they hold will fail to "
                      "read, the rest not", self.dest / chunk_file_name(span.chunk), plural(len(bad), "blob"), bad[0])
        self.local.write(span.chunk, span.start, data)
        self.report.written_bytes += len(data)

    def _record(self, missing: list[Span]) -> None:
        """The manifest: every range staged here and verified, plus those reused."""
        for span in missing:
            if span.chunk not in self._unverified:
                self._verified.setdefault(span.chunk, []).append((span.start, span.end))
        self.local.write_manifest(self._identity, self._verified)
        self.report.unverified_chunks = sorted(self._unverified)
