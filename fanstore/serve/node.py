"""One rank of `fanstore serve`: start MPI, stage, mount the whole dataset, run the job's command, report.

    place (every rank alone) -> check every rank can start (agreed; start_checks.py) -> watchdog -> stage (collective)
    -> index copied into the local directory (the node's readers load it there) -> transport thread
    -> mount (local | peer -> DEST) -> all mounted (agreed) -> COMMAND or ready file
    -> all done (Iallreduce of the worst status) -> unmount -> counters to rank 0 (job_stats.py) -> stop MPI

One process per node holds MPI, the mount and the command's parent. MPI is called by the main thread until the
transport starts, then by the transport's thread, and, where the library gives MPI_THREAD_MULTIPLE, by the threads
that ask peers for blobs, the mount's event loop among them, to post their requests (remote_blobs.py). MPI_THREAD_SERIALIZED is the least this needs (checked at start). Every wait after start-up is non-blocking and polled (polling.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from ..core.api import Dataset
from ..core.chunk_source import LocalChunkSource
from ..core.allocator import keep_freed_memory
from ..core.descriptors import descriptor_limit, free_descriptors, raise_descriptor_limit
from ..core.dest_apart import check_apart_from_dest
from ..core.durable import partial_of
from ..errors import ChunkUnavailable, FanstoreError, Terminated, UsageError, quoted, say_line
from ..core.format import CHUNK_DIR, INDEX_NAME
from ..core.index import Index
from ..core.index_file import map_index_file, mark_copy_checked
from ..mount.job_memory import job_memory
from ..mount.mount import cache_bound, check_mountpoint, check_outside, dataset_paths, \
    fuse_answer, fuse_mounted_at, resolve_mountpoint, serve_dataset, unmount
from ..mount.mountinfo import fuse_device
from ..core.pause import pause_point
from ..mount.prefetch import may_block_flags, read_prefetch_list
from . import watchdog
from .blob_arena import open_arena
from .blobs_ahead import BlobsAhead, EntriesAhead
from .command_processes import new_token
from .doorbell import open_doorbell
from .early_end import EarlyEnd
from .job_stats import report_rank_alone, report_stats
from .lifecycle import Lifecycle
from .node_endpoint import SOCKET_NAME, NodeEndpoint, answer_within
from .node_protocol import BlobLookup
from .placement import BlobTable, Placement, place
from .polling import first_failed_rank
from .ready_file import clear_left_ready_file
from .sources import PeerChunkSource, PlacedChunkSource
from .start_checks import host_names, other_dataset, ranks_sharing_memory, shared_paths
from .staged_source import StagedChunkSource
from .local_dir import LOCK_NAME, WATCHDOG_LOG, StagingBroken, StagingError, check_written_in_place, claim_local_dir, \
    copy_index
from .staging import StagingReport, Stager, index_identity
from .statuses import RequestRefused
from ..mount.options import MountOptions
from .options import ServeOptions
from .transport import PeerTransport, mpi_failure

log = logging.getLogger("fanstore.serve")

# Descriptors a rank needs free once MPI has started: about 15 for the rest of its start (its watchdog, doorbell,
# arena, index, staging, FUSE) and a few for readers' connections and chunk files. With fewer, a rank crashed at start
# (a hard limit of 32: its watchdog's pipe, a traceback, MPI's shared memory left in /dev/shm) or turned every reader
# away (48).
FREE_DESCRIPTORS_TO_START = 32
INTERRUPTED = "fanstore serve: rank {rank}: interrupted before every rank was mounted; ending the job"


class ServeError(FanstoreError):
    """`fanstore serve` cannot start or go on on this rank; the message names the rank and the host."""


def start_mpi(multiple: bool = True) -> Any:
    """The MPI module, initialised at the thread level this design needs (asking for MPI_THREAD_MULTIPLE, which the
    mount's own peer requests use, unless not `multiple`); ServeError when it cannot be had."""
    try:
        import mpi4py
    except ImportError:
        raise UsageError("fanstore serve needs mpi4py: pip install 'fanstore[mpi]' (on a cluster, build it against "
                         "the site's MPI; see README, Run on a cluster)") from None
    mpi4py.rc.thread_level = "multiple" if multiple else "serialized"
    mpi4py.rc.finalize = False  # finalised here, and only once every rank agreed to end (see run)
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise ServeError(f"the MPI library gives thread level {MPI.Query_thread()}; fanstore serve needs "
                         f"MPI_THREAD_SERIALIZED ({MPI.THREAD_SERIALIZED}): one thread serves peers while others "
                         f"read (use an MPI built with thread support)")
    return MPI


_PATH_MAX = 4096  # bytes of a path the kernel takes


def format_for_rank(template: str, rank: int, option: str) -> Path:
    """`template` (a path option) with its `{rank}`s written for `rank`. Braces hold `rank` alone: str.format also
    reads attributes and items (`{rank.__class__}` made a directory `l<class 'int'>`); and a format spec
    (`{rank:03d}`) no wider than a path, which `{rank:>99999999999}` was, ending in a MemoryError."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unclosed or lone brace
        raise UsageError(f"{option} {quoted(template)}: only {{rank}} may appear in braces ({exc})") from None
    for _, name, spec, conversion in fields:
        if name is None:
            continue
        if name != "rank":
            raise UsageError(f"{option} {quoted(template)}: only {{rank}} may appear in braces ({quoted(name)})")
        field = "{rank" + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if any(int(number) > _PATH_MAX for number in re.findall(r"\d+", spec or "")):
            raise UsageError(f"{option} {quoted(template)}: {field} is wider than a path")
        try:
            field.format(rank=rank)
        except ValueError as exc:  # a spec an int cannot take ({rank:.3}), an unknown conversion ({rank!x})
            raise UsageError(f"{option} {quoted(template)}: cannot write the rank as {field} ({exc})") from None
    return Path(template.format(rank=rank))


def shm_files_mapped() -> list[str]:
    """MPICH's /dev/shm files this process maps: what a killed job leaves behind unless someone removes them."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                paths.add(path)
    return sorted(paths)


class RankWatchdog:
    """This rank's watchdog (watchdog.py) as the rank holds it: started in a session of its own, kept alive by the
    write end of a pipe, and told at the rank's end whether that end is clean.

    A thread, "watchdog watch", owns the wait for the watchdog's end and nothing else. A watchdog that ends before
    the rank (killed by hand, by the OOM killer) is logged once, naming the rank: from then on the rank has none,
    and a rank killed leaves its mount and ready file behind. It never changes the job's status: the rank's end
    (`close`) does not fail on a watchdog gone.
    """

    def __init__(self, rank: int, mountpoint: Path, ready_file: Path, local_dir: Path, token: str) -> None:
        """`local_dir`: the rank's, held by it (its lock), where the watchdog's log goes and the readers' socket lies.
        `token`: what marks the processes of the rank's command (command_processes.py), which the watchdog ends
        should the rank die before it could."""
        self._rank = rank
        self._mountpoint = mountpoint
        read_end, self._keep_alive = os.pipe()
        log_fd = os.open(local_dir / WATCHDOG_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", watchdog.__file__, str(read_end), str(mountpoint), str(ready_file),
                 str(local_dir / SOCKET_NAME), str(local_dir / LOCK_NAME), token, *shm_files_mapped(),
                 str(partial_of(ready_file))],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                start_new_session=True)
        finally:
            os.close(read_end)
            os.close(log_fd)
        self._lock = threading.Lock()  # guards _ending and _reported, which the watch thread reads
        self._ending = False  # the rank is ending: the watchdog's end is expected
        self._reported = False
        threading.Thread(target=self._watch, name="watchdog watch", daemon=True).start()

    def _watch(self) -> None:
        code = self._process.wait()
        with self._lock:
            if self._ending:
                return
        self._report_gone(code)

    def _report_gone(self, code: int | None) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
        how = "" if code is None else f" (killed by signal {-code})" if code < 0 else f" (exit status {code})"
        log.warning("rank %d: its watchdog (pid %d) has ended%s; the rank goes on without one: should it die now, "
                    "its mount at %s stays behind (`fanstore umount %s` clears it)", self._rank, self._process.pid,
                    how, self._mountpoint, self._mountpoint)

    def mounted(self, mountpoint: Path) -> None:
        """The rank's mount is up: the watchdog is told its device, the one mount at `mountpoint` it may remove
        (another job given the same MOUNTPOINT may have one there by the time this rank is gone)."""
        device = fuse_device(mountpoint)
        if device is None:
            return
        try:
            os.write(self._keep_alive, watchdog.MOUNTED + device.encode() + b"\n")
        except BrokenPipeError:  # gone already: the watch thread says so
            pass

    def close(self, clean: bool) -> None:
        """The rank is ending: `clean` when MPI was finalised (the watchdog then leaves MPI's files alone, since
        other ranks may still be finishing with them); else the watchdog cleans up after the rank."""
        with self._lock:
            self._ending = True
        try:
            if clean:
                os.write(self._keep_alive, watchdog.CLEAN_EXIT)
        except BrokenPipeError:  # gone before the rank's end, whatever the watch thread saw of it
            self._report_gone(self._process.returncode)
        finally:
            os.close(self._keep_alive)


def clear_stale_mount(mountpoint: Path) -> None:
    """A mount left at `mountpoint` by a killed daemon (ENOTCONN) is removed; a live or hung one is an error."""
    if fuse_mounted_at(mountpoint) and fuse_answer(mountpoint) != 0:
        log.warning("%s: clearing a stale mount left by an earlier job", mountpoint)
        unmount(mountpoint)
        deadline = time.monotonic() + 5
        while fuse_mounted_at(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
    check_mountpoint(mountpoint)


class RequestChecker:
    """Serves peers' requests from this rank's directory, only for whole blobs of chunks staging verified, sent as
    staged: staging checked every blob against its checksum, and the reader checks it again (reading DEST where it
    fails), so the sender does not hash it a third time. A chunk staging could not verify is never sent: its
    readers read DEST (the `direct` chunks)."""

    def __init__(self, rank: int, placement: Placement, blobs: BlobTable, local: StagedChunkSource,
                 chunk_count: int, unverified: set[int]) -> None:
        self._rank = rank
        self._placement = placement
        self._blobs = blobs
        self._local = local
        self._chunk_count = chunk_count
        self._unverified = unverified

    def check(self, peer: int, chunk: int, offset: int, length: int) -> None:
        if not 0 <= chunk < self._chunk_count:
            raise RequestRefused(f"chunk {chunk} is not in the dataset")
        if not self._placement.is_local(self._rank, chunk, offset):
            raise RequestRefused(f"chunk {chunk} at {offset} is not stored on rank {self._rank}")
        if self._blobs.blob_row(chunk, offset, length) is None:
            raise RequestRefused(f"chunk {chunk}: no blob of {length} bytes at offset {offset}")
        if chunk in self._unverified:
            raise ChunkUnavailable(f"chunk {chunk} was not staged whole on rank {self._rank}", chunk_id=chunk)

    def read_into(self, chunk: int, offset: int, length: int, out: memoryview) -> None:
        self._local.read_staged_into(chunk, offset, length, out)


@dataclass
class _RankStart:
    """What a rank finds and checks alone at start, before any rank writes anything: the dataset's index (mapped
    from DEST), its identity and placement, and this rank's paths. Any problem raises, naming the option."""

    index: Index
    index_bytes: Any  # the index file's bytes (a map of DEST's file), until copied into --local-dir
    identity: str
    placement: Placement
    mountpoint: Path
    local_dir: Path
    ready_file: Path
    mount_options: MountOptions
    prefetch_order: list[int] | None

    @classmethod
    def of(cls, options: ServeOptions, rank: int, size: int) -> "_RankStart":
        free = free_descriptors()
        if free is not None and free < FREE_DESCRIPTORS_TO_START:
            raise UsageError(f"only {free} file descriptors free of its open file limit ({descriptor_limit()}) once MPI "
                             f"started, fewer than the {FREE_DESCRIPTORS_TO_START} a rank needs: raise `ulimit -Hn` "
                             f"for the job")
        prefetch_order = None
        # Mapped from DEST and read once (the check, the identity, the copy into DIR), never copied into this
        # process: at 10^7 files the index is a gigabyte. Once copied, the rank maps its copy instead.
        index_bytes, _ = map_index_file(options.dest)
        index = Index.from_bytes(options.dest / INDEX_NAME, index_bytes)
        identity = index_identity(index_bytes)
        placement = place(index, size)
        given = format_for_rank(options.mountpoint, rank, "MOUNTPOINT").absolute()
        mountpoint = resolve_mountpoint(given)
        local_dir = format_for_rank(options.local_dir, rank, "--local-dir").absolute()
        # Beside MOUNTPOINT as given: one that is a link had it beside the link's target, where no script looks.
        named = given if given.name not in ("", "..") else mountpoint
        ready_file = format_for_rank(options.ready_file, rank, "--ready-file").absolute() if options.ready_file \
            else named.with_name(named.name + ".ready")
        mount_options = options.mount
        if mount_options.prefetch_list is not None:  # each rank its own epoch order: a DistributedSampler's share
            prefetch_list = format_for_rank(str(mount_options.prefetch_list), rank, "--prefetch-list").absolute()
            if not prefetch_list.is_file():
                raise UsageError(f"--prefetch-list: {quoted(prefetch_list)} is not a file")
            mount_options = replace(mount_options, prefetch_list=prefetch_list)
            prefetch_order = read_prefetch_list(index, prefetch_list, mountpoint)  # a bad one stops all, now
        # Nothing this rank reads once mounted may lie under its mount: its reads would wait on itself for good.
        check_outside(mountpoint, {**dataset_paths(options.dest), "--local-dir": local_dir,
                                   "--local-dir's chunk directory": local_dir / CHUNK_DIR,
                                   "--local-dir's copy of the index": local_dir / INDEX_NAME,
                                   "--ready-file": ready_file})
        # Before anything below writes (the ready file of a killed job removed, DIR made), and before any copy:
        # staging into DEST would truncate its chunk files.
        writes = {"--local-dir": local_dir, "--local-dir's chunk directory": local_dir / CHUNK_DIR}
        if options.ready_file or not options.command:  # a ready file named is removed at start, command or not
            writes["--ready-file" if options.ready_file else "the ready file MOUNTPOINT.ready"] = ready_file
        check_apart_from_dest(options.dest, writes)
        if not options.command and not os.access(ready_file.parent, os.W_OK | os.X_OK):
            option = "--ready-file" if options.ready_file else "MOUNTPOINT.ready (--ready-file puts it elsewhere)"
            raise UsageError(f"{option}: cannot write {ready_file}: its directory does not exist or is not writable")
        clear_stale_mount(mountpoint)
        try:
            local_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise UsageError(f"--local-dir {local_dir}: not a directory") from None
        except OSError as exc:  # read-only, a file in the way: said as the option, not as Python's repr
            raise UsageError(f"--local-dir {local_dir}: cannot make it a directory: {exc.strerror}"
                             + ("" if exc.filename in (None, str(local_dir)) else f" ({exc.filename})")) from None
        if not local_dir.is_dir():
            raise UsageError(f"--local-dir {local_dir}: not a directory")
        # Left by a killed job: a batch script waiting for it must wait for us. A running job's is refused.
        clear_left_ready_file(ready_file, "--ready-file" if options.ready_file else
                              "MOUNTPOINT.ready (--ready-file puts it elsewhere)")
        return cls(index, index_bytes, identity, placement, mountpoint, local_dir, ready_file, mount_options,
                   prefetch_order)


def _start_together(options: ServeOptions, comm: Any, mpi: Any, early: EarlyEnd) -> _RankStart:
    """Every rank's start (_RankStart), agreed: a rank with a problem, or a MOUNTPOINT or --local-dir shared by two
    ranks, or a DEST holding another dataset than rank 0's, stops every rank, each with its line, before any copy."""
    rank, size, host = comm.Get_rank(), comm.Get_size(), socket.gethostname()
    problem = None
    try:  # every rank's problem goes through the agreement below: a rank must not leave the others waiting
        start = _RankStart.of(options, rank, size)
    except (FanstoreError, OSError) as exc:
        problem, start = f"rank {rank} on {host}: {exc}", None
    mountpoint = start.mountpoint if start is not None else None
    local_dir = start.local_dir if start is not None else None
    problem = shared_paths(comm, host, {"MOUNTPOINT": mountpoint, "--local-dir": local_dir}) \
        or other_dataset(comm, host, options.dest, start.identity if start is not None else None) or problem
    if problem is None:  # no rank of this job shares it: one that holds it now is another job's
        try:
            share = {piece.chunk for piece in start.placement.pieces(rank)} | set(start.placement.replicated_chunks)
            check_written_in_place(local_dir, sorted(share))
            claim_local_dir(local_dir)  # held until this process ends
        except StagingError as exc:
            problem = f"rank {rank} on {host}: {exc}"
    failed = first_failed_rank(comm, problem is not None)
    if problem is not None or failed is not None:
        _refuse_together(comm, mpi, early, problem or f"rank {failed} cannot start (see its message); stopping")
    assert start is not None
    return start


def run(options: ServeOptions) -> int:
    """Serve on this rank until the job ends; the exit status is the worst of every rank's COMMAND."""
    # `kill -USR2 PID` prints every thread's stack: what a stuck rank waits on. Not USR1: mpiexec sends it to
    # every rank when one dies (with -disable-auto-cleanup), and SLURM jobs often ask for it before their end.
    faulthandler.register(signal.SIGUSR2)
    # Before any thread starts: each would grow a malloc arena of its own, which fragments (bench/soak_serve.py:
    # the serve process's RSS grew 0.2-0.4 MiB an epoch for good that way, and stayed flat with one arena).
    keep_freed_memory()
    # Before MPI and every pool sized by the limit (chunk files kept open, reader connections): MPI alone holds about
    # 40 descriptors, and a soft limit of 48 left the readers none though the hard one allowed 20,000.
    too_few = raise_descriptor_limit()
    mpi = start_mpi(options.loop_requests)
    comm = mpi.COMM_WORLD.Dup()
    early = EarlyEnd(mpi, relay=options.loop_requests)
    try:
        return _serve_rank(options, comm, mpi, early, too_few)
    except KeyboardInterrupt as exc:
        # Before every rank agreed that all are mounted (the lifecycle's signals end it in order from there): every
        # rank ends through MPI_Finalize, with the status `fanstore serve --help` gives (early_end.py says why).
        signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
        early.end(signum, INTERRUPTED.format(rank=comm.Get_rank()))
        return 128 + signum


def _serve_rank(options: ServeOptions, comm: Any, mpi: Any, early: EarlyEnd, too_few: str | None = None) -> int:
    """Check, stage this rank's share, then serve it until the job ends; the job's status. `too_few`: why its open
    file limit is short, said once the rank has started (one that cannot start says why it cannot, alone)."""
    rank = comm.Get_rank()
    host = socket.gethostname()
    start = _start_together(options, comm, mpi, early)
    if too_few is not None:
        log.warning("rank %d on %s: %s", rank, host, too_few)
    mountpoint, local_dir = start.mountpoint, start.local_dir
    index, index_bytes, identity, placement = start.index, start.index_bytes, start.identity, start.placement
    ready_file, mount_options, prefetch_order = start.ready_file, start.mount_options, start.prefetch_order
    del start  # its map of DEST's index goes with index_bytes, once copied
    hosts = host_names(comm, host)  # to name a rank that stops answering at the end
    cgroup = job_memory().cgroup  # the memory cgroup whose limit binds, if any
    memory_sharers = ranks_sharing_memory(comm, host, cgroup.path if cgroup is not None else None)
    token = new_token()  # marks the processes of the rank's command, for the rank and its watchdog to end
    guard = RankWatchdog(rank, mountpoint, ready_file, local_dir, token)

    bar = _progress_bar(rank, options.progress)
    try:
        report = Stager(comm, index, placement, options.dest, local_dir, progress=bar, identity=identity,
                        index_copy_bytes=len(index_bytes), memory_sharers=memory_sharers).run()
        copy_index(local_dir, index_bytes, rank)  # where the node's readers load the index (HELLO: index_dir)
        mark_copy_checked(local_dir, index_bytes)  # checked here in full: the node's readers need not again
        index = Index.load(local_dir)  # that copy, mapped: nothing of the index is read from DEST from here on
        del index_bytes
    except (StagingBroken, mpi.Exception) as exc:
        # The other ranks are half-way through staging with this one, or about to wait on it in the next collective
        # (or one of them has died): only the launcher can end them all.
        reason = exc if isinstance(exc, StagingBroken) else \
            f"rank {rank} on {host}: staging failed: {mpi_failure(exc)} (has another rank died?)"
        say_line(f"fanstore serve: error: {reason}; stopping the job")
        comm.Abort(1)
    except StagingError as exc:  # refused before any copy, every rank agreeing (a local dir too small)
        if bar is not None:
            bar(-1, -1)
        _refuse_together(comm, mpi, early, str(exc), guard)
    if bar is not None:
        bar(-1, -1)
    with contextlib.ExitStack() as teardown:  # unwound in reverse: the endpoint first, the doorbell last
        status, lifecycle = _serve_staged(options, comm, index, placement, local_dir, mountpoint, ready_file,
                                          mount_options, prefetch_order, report, hosts, memory_sharers, token,
                                          teardown, guard, early)
    if lifecycle.interrupted:  # mounted, and signalled while the others were mounting: ended as run() ends them
        early.end(signal.SIGTERM, INTERRUPTED.format(rank=rank))
    else:
        early.close()
        if lifecycle.agreed:
            comm.Free()
            mpi.Finalize()
    guard.close(clean=lifecycle.agreed or lifecycle.interrupted)
    return status


def _serve_staged(options: ServeOptions, comm: Any, index: Index, placement: Placement, local_dir: Path,
                  mountpoint: Path, ready_file: Path, mount_options: MountOptions, prefetch_order: list[int] | None,
                  report: StagingReport, hosts: list[str], memory_sharers: list[int], token: str,
                  teardown: contextlib.ExitStack, guard: RankWatchdog, early: EarlyEnd) -> tuple[int, Lifecycle]:
    """Once staged: the transport, the node's holder and endpoint, the mount and COMMAND; each part's close is
    pushed on `teardown` as it starts. Returns the job's status and the lifecycle (whether every rank agreed)."""
    rank, size, host = comm.Get_rank(), comm.Get_size(), socket.gethostname()
    sizes = index.chunks["size"]
    dest = LocalChunkSource(options.dest, sizes)
    local = StagedChunkSource(LocalChunkSource(local_dir, sizes), dest, rank)
    unverified = set(report.unverified_chunks)
    bell = open_doorbell(comm, options.doorbell)
    if bell is not None:
        teardown.callback(bell.close)
    arena = open_arena()
    if arena is not None:
        teardown.callback(arena.close)
    blobs = placement.blobs  # one table for staging, the peers' requests and the node's readers
    transport = PeerTransport(comm, RequestChecker(rank, placement, blobs, local, len(sizes), unverified),
                              options.peer, bell, arena)
    transport.start()
    teardown.callback(transport.stop)
    source = PlacedChunkSource(rank, placement.owners, local, PeerChunkSource(transport, placement.owners), dest,
                               direct=unverified)
    # The node's one holder of blobs fetched ahead: plans of the training processes (through the endpoint) and of
    # the mount, within one bound.
    lookup = BlobLookup(blobs, len(sizes))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    endpoint = NodeEndpoint(local_dir, {"dest": str(Path(options.dest).absolute()), "local_dir": str(local_dir),
                                        "index_dir": str(local_dir), "rank": rank, "size": size,
                                        "direct": sorted(unverified), "owners": placement.owners.to_json(),
                                        "answer_within": answer_within(options.peer.timeout,
                                                                       options.peer.max_in_flight)},
                            source, lookup, ahead, arena)
    lifecycle = Lifecycle(transport, options.command, mountpoint, ready_file, endpoint.path, hosts, token,
                          early)
    # Chosen once staged: a local dir on tmpfs has taken its share of the job's memory by now.
    bound = cache_bound(mount_options.cache_size, shared_by=len(memory_sharers))

    def close_together() -> None:
        """Once every rank agreed on the job's status: the counters (--stats), then the closing barrier."""
        if lifecycle.agreed:
            if options.stats:
                report_stats(transport, source, report, endpoint.stats(), transport.remote.any_thread, bound)
            transport.collective(lambda comm: (comm.Ibarrier(), lambda: None)).result()

    teardown.callback(close_together)
    teardown.callback(ahead.close)
    teardown.callback(endpoint.close)
    pause_point("serve: staged")
    try:
        check_mountpoint(mountpoint)  # again: staging may have taken long enough for it to go
        with Dataset(index, source) as dataset:
            status = serve_dataset(dataset, mountpoint, mount_options, while_mounted=lifecycle,
                                   prefetch_order=prefetch_order, bound=bound,
                                   ahead=EntriesAhead(ahead, lookup, index, may_block_flags(index, source)),
                                   on_mount=lambda: guard.mounted(mountpoint))
    except FanstoreError as exc:
        say_line(f"fanstore serve: error: rank {rank} on {host}: {exc}")
        status = 1
    if not lifecycle.started:  # never mounted: the mounted ranks wait for its word
        status = lifecycle.without_mount(status)
    if options.stats and lifecycle.started and not lifecycle.agreed and not lifecycle.interrupted:
        report_rank_alone(transport, source, report, endpoint.stats(), transport.remote.any_thread, bound)
    return status, lifecycle


def _refuse_together(comm: Any, mpi: Any, early: EarlyEnd, message: str, guard: RankWatchdog | None = None) \
        -> NoReturn:
    """End this rank at start, once every rank has agreed that one of them cannot go on (first_failed_rank): each
    finalises MPI and leaves with fanstore's own status and its own line (`message`). A rank that left without
    MPI_Finalize would have the launcher SIGKILL the others, in some runs and not others (`BAD TERMINATION`, exit
    9), and leave MPI's /dev/shm files to a watchdog. A watchdog started (`guard`) is told the end is clean."""
    early.close()  # its thread calls MPI
    comm.Free()
    mpi.Finalize()
    if guard is not None:
        guard.close(clean=True)
    raise ServeError(message)


def _progress_bar(rank: int, enabled: bool) -> Any:
    """Rank 0's staging bar (its own share; every rank stages at once), or None."""
    if rank != 0 or not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, desc="staging", leave=False)

    def update(done: int, total: int) -> None:
        if done < 0:
            bar.close()
            return
        bar.total = total
        bar.n = done
        bar.refresh()

    return update
