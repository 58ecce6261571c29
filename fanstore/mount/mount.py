"""`fanstore mount` and `fanstore umount`: the lifecycle of the FUSE view.

`mount` returns once the file system answers (or stays in the foreground); a background mount is the same
program re-run with --foreground in its own session, reporting readiness through a pipe. SIGTERM and SIGINT
unmount cleanly, and a daemon killed outright (SIGKILL, the OOM killer) has its mount removed by libfuse's
auto-unmount helper; a mount point left behind all the same (the helper killed too, a serve rank's mount), or held
by a daemon that no longer answers, is recognised (from mountinfo and a statvfs with a timeout, never a stat the
kernel may answer from its cache) and the command that clears it is named.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..core.api import Dataset, open_dataset
from ..core.cache import DecodedCache
from ..core.chunk_source import LocalChunkSource
from ..core.allocator import keep_freed_memory
from ..core.descriptors import raise_descriptor_limit
from ..core.pause import pause_point
from .auto_unmount import FuseDeviceReleasedFirst, auto_unmount_option
from .daemon_tuning import install_fast_session_loop
from ..core.dest_apart import overlap
from ..errors import FanstoreError, UsageError, one_line, quoted, shell_word
from ..core.format import CHUNK_DIR, INDEX_NAME
from .job_memory import JobMemory, job_memory
from .kernel_holds import KernelHolds
from .mount_claim import MountpointClaim
from .mountinfo import FANSTORE_SUBTYPE, fuse_mount_holding, fuse_mounted_at, fuse_mounts, fuse_type, \
    read_ahead_setting, resolve_mountpoint, \
    set_read_ahead  # noqa: F401 (fuse_mounted_at, read_ahead_setting: their old home)
from .options import INLINE_DECODE_BYTES, READ_AHEAD_KIB, MountOptions  # noqa: F401 (MountOptions: its old home)
from .prefetch import FetchedAhead, FileOrder, Prefetcher, may_block_flags, read_prefetch_list
from ..core.units import format_bytes, plural, size_option

if TYPE_CHECKING:
    from .fuse_ops import FanstoreOperations  # imported with FUSE, when mounting

log = logging.getLogger("fanstore.mount")

DEFAULT_CACHE_FRACTION = 0.25  # of the memory the job may still use when the mount starts (job_memory)
PROBE_TIMEOUT = 3.0  # seconds a FUSE daemon gets to answer before its mount counts as hung


class MountError(FanstoreError, OSError):
    """The mount cannot be made or removed; the message says why and what to run."""


@dataclass(frozen=True, slots=True)
class CacheBound:
    """The decoded cache's bound and where it came from, as the mount's log and `serve --stats` say it."""

    size: int  # bytes
    why: str  # "--cache-size", or what the default is a fraction of

    def describe(self) -> str:
        given = f" {size_option(self.size)}" if self.why == "--cache-size" else ""  # as it was given, exactly
        return f"cache {format_bytes(self.size)}: {self.why}{given}"


def cache_bound(cache_size: int | None, memory: JobMemory | None = None, shared_by: int = 1) -> CacheBound:
    """`cache_size` when given, else a quarter of what the job may still use: the machine's available memory or,
    where the job's memory cgroup leaves less (a batch job's limit, a local dir on tmpfs already staged), that;
    split evenly when `shared_by` processes (serve's ranks on one host) each take their cache from it.

    A `cache_size` beyond what the job may use is kept, and logged: the job may be OOM-killed once the cache fills.
    """
    memory = memory or job_memory()
    if cache_size is not None:
        if cache_size * shared_by > memory.available:
            log.warning("--cache-size %s%s is more than %s: the job may be killed for its memory once the caches "
                        "fill", size_option(cache_size), f" on each of {shared_by} ranks" if shared_by > 1 else "",
                        memory.describe())
        return CacheBound(cache_size, "--cache-size")
    why = f"a quarter of {memory.describe()}"
    if shared_by > 1:
        why += f", split among the {shared_by} ranks on this host that draw on it"
    return CacheBound(int(memory.available * DEFAULT_CACHE_FRACTION / shared_by), why)


def fuse_unavailable_reason() -> str | None:
    """Why this machine cannot mount a fanstore view, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3 cannot be imported ({exc}); it builds against libfuse3-dev"
    return None


def dataset_paths(dest: Path) -> dict[str, Path]:
    """What a daemon serving DEST reads from it once mounted, by name for messages (check_outside)."""
    return {"DEST": dest, "DEST's index": dest / INDEX_NAME, "DEST's chunk directory": dest / CHUNK_DIR}


def check_outside(mountpoint: Path, paths: dict[str, Path]) -> None:
    """Paths the daemon uses once mounted (the dataset, its index and chunk directory, its log, a node's local
    directory and its chunks, by name) must be neither MOUNTPOINT nor inside it: the mount would hide them, and a
    daemon reading through its own mount waits on itself for good (its readers too, unkillable, in the kernel).

    Each path counts as written (the daemon opens it so, through any link on the way) and as resolved (where it
    really is), and a directory reached by two paths (a bind mount) is one (dest_apart.overlap). `mountpoint` is
    resolved (resolve_mountpoint), and looked up only where no FUSE mount holds it: one whose daemon hangs would
    hold the lookup for good (check_mountpoint then says what it is).
    """
    look = fuse_mount_holding(str(mountpoint), fuse_mounts()) is None
    for name, path in paths.items():
        lies = overlap(path, mountpoint, as_written=True, look_at_other=look)
        if lies == "is":
            raise UsageError(f"MOUNTPOINT {mountpoint} is {name} {path}: the mount would hide it from fanstore "
                             f"itself; mount elsewhere")
        if lies == "inside":
            raise UsageError(f"MOUNTPOINT {mountpoint}: {name} {path} lies inside it, and the mount would hide it "
                             f"from fanstore itself; mount elsewhere")


def check_mountpoint(mountpoint: Path) -> None:
    """A mount point must be an existing empty directory that nothing is mounted on, stale mounts included.

    `mountpoint` is resolved (resolve_mountpoint). Whether a FUSE file system is there is read from mountinfo,
    never from a stat: the kernel answers a stat of a killed daemon's mount from its cache for a day.
    """
    holder = fuse_mount_holding(str(mountpoint), fuse_mounts())
    if holder is not None:
        here = holder == str(mountpoint)
        where = f"{mountpoint}:" if here else f"{mountpoint}: inside {holder},"
        answer = fuse_answer(Path(holder))
        # `fanstore umount` ends only fanstore's mounts: another FUSE file system's is fusermount3's to end.
        ours = fuse_type(Path(holder)) == f"fuse.{FANSTORE_SUBTYPE}"
        holder_word = shell_word(holder)
        unmount_it = f"`fanstore umount {holder_word}`" if ours else \
            f"`fusermount3 -u {holder_word}` (it is not fanstore's)"
        if answer == errno.ENOTCONN:
            raise MountError(f"{where} a stale mount left by a daemon that was killed; clear it with {unmount_it}"
                             + (f" (or `fusermount3 -u {holder_word}`)" if ours else ""))
        if answer is None:
            raise MountError(f"{where} mounted but not answering within {PROBE_TIMEOUT:g} s (its daemon is "
                             f"stopped or hung); detach it with {unmount_it}")
        if here:
            raise MountError(f"{mountpoint}: something is already mounted here; {unmount_it} first")
    try:
        os.stat(mountpoint)  # no FUSE mount here; one above it has just answered
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} does not exist; create the directory first") from None
        raise MountError(f"{mountpoint}: {exc.strerror}") from None
    if not os.path.isdir(mountpoint):
        raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} is not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"{mountpoint}: another file system is mounted here; mount elsewhere")
    try:
        with os.scandir(mountpoint) as entries:
            first = next(entries, None)
    except OSError as exc:
        raise MountError(f"{mountpoint}: {exc.strerror}") from None
    if first is not None:  # the mount would hide it, as libfuse 2 refused to without -o nonempty
        raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} is not empty (it holds {quoted(first.name)}): the mount "
                         "would hide what it holds; give an empty directory")


def fuse_answer(mountpoint: Path, timeout: float = PROBE_TIMEOUT) -> int | None:
    """Ask the daemon of the FUSE mount at `mountpoint` something: the errno it ends with (0: answered), ENOTCONN
    when the daemon is gone, None when no answer came within `timeout` seconds.

    statvfs is never answered from the kernel's cache, so it reaches the daemon. A hung daemon would hold the
    caller forever, so the call waits in a daemon thread that the caller leaves behind.
    """
    outcome: list[int] = []

    def ask() -> None:
        try:
            os.statvfs(mountpoint)
            outcome.append(0)
        except OSError as exc:
            outcome.append(exc.errno)

    asker = threading.Thread(target=ask, name=f"statvfs {mountpoint}", daemon=True)
    asker.start()
    asker.join(timeout)
    return outcome[0] if outcome else None


def mount_foreground(dataset: Path, mountpoint: Path, options: MountOptions, ready_fd: int | None = None) -> int:
    """Serve until unmounted or signalled. `ready_fd` gets one line, `ok` or the error, once the mount answers."""
    if ready_fd is not None:  # passed down to us, so inheritable: the auto-unmount helper would hold it open
        os.set_inheritable(ready_fd, False)
    too_few = raise_descriptor_limit()  # before the dataset sizes its pool of open chunk files by it
    if too_few is not None:
        log.warning("%s: %s", mountpoint, too_few)
    try:
        check_mountpoint(mountpoint)
        ds = open_dataset(dataset)
    except FanstoreError as exc:
        _report_ready(ready_fd, f"error: {exc}")
        raise
    with ds:
        _hold_chunk_files(ds, mountpoint)
        return serve_dataset(ds, mountpoint, options, ready_fd=ready_fd, auto_unmount=True)


def _hold_chunk_files(ds: Dataset, mountpoint: Path) -> None:
    """Open DEST's chunk files before mounting, up to the source's bound: a pack with --force over DEST while
    mounted replaces them, and the mount (its index the old one) then goes on serving the dataset as mounted, as
    squashfuse serves the image it opened. A chunk first opened after that pack would be the new one, read at the
    old index's offsets: every file in it would fail."""
    source = ds.reader.source
    if not isinstance(source, LocalChunkSource):
        return
    held, chunks = source.open_ahead(), len(ds.index.chunks)
    if held < chunks:
        log.info("%s: %d of %d chunk files fit the open file limit and are held open; the others are opened as "
                 "read, so a pack over DEST while mounted would fail their reads", mountpoint, held, chunks)


def serve_dataset(ds: Dataset, mountpoint: Path, options: MountOptions, ready_fd: int | None = None,
                  while_mounted: Callable[[threading.Event], int] | None = None,
                  prefetch_order: list[int] | None = None, bound: CacheBound | None = None,
                  ahead: FetchedAhead | None = None, on_mount: Callable[[], None] | None = None,
                  auto_unmount: bool = False) -> int:
    """Mount `ds` at `mountpoint` and serve until unmounted or signalled; the caller closes `ds`.

    `while_mounted(stop)`, when given, runs in a thread once the kernel has the mount; the mount ends when it
    returns, and its result is returned. SIGTERM or SIGINT sets `stop`, and ends the mount once it returns.
    `prefetch_order`: the entries of options.prefetch_list, when the caller has read it already. `bound`: the
    cache's, when the caller has chosen it already (cache_bound). `ahead`: who fetches files from other nodes ahead
    of their reads (under serve, the node's holder); its `covers` are the files that may be slow to come.
    `on_mount()`: called as soon as the kernel has the mount (a serve rank tells its watchdog which mount is its).
    `auto_unmount`: the mount is removed when this process ends without unmounting (auto_unmount.py); only the
    standalone mount asks: a serve rank's watchdog does it by device, and libfuse would fork in an MPI process.
    """
    import pyfuse3

    claim = None
    try:
        session = _open_session(ds, mountpoint, options, prefetch_order, bound, ahead)
        if options.fast_session_loop:
            install_fast_session_loop()
        claim = MountpointClaim(mountpoint)  # held until unmounted: no other mount comes between check and mount
    except FanstoreError as exc:
        if claim is not None:
            claim.close()
        _report_ready(ready_fd, f"error: {exc}")
        raise
    early: list[int] = []
    held = _hold_signals(early)  # from the moment the mount is seen to the session loop's own receiver
    stop = threading.Event()
    device_hold = None
    try:
        try:
            _init_fuse(session.operations, mountpoint, options.allow_other, auto_unmount)
            if auto_unmount:
                device_hold = FuseDeviceReleasedFirst()
            if on_mount is not None:
                on_mount()
            pause_point("mount: mounted")
        except FanstoreError as exc:
            claim.close()
            _report_ready(ready_fd, f"error: {exc}")
            raise
        try:
            return _serve_until_unmounted(session.operations, mountpoint, options.read_ahead_kib, stop, ready_fd,
                                          while_mounted, early)
        finally:
            stop.set()
            if session.prefetcher is not None:
                session.prefetcher.close()
            stats = session.cache.stats()
            log.info("unmounted %s; cache: %s, %s, %s, %s, %s held", mountpoint, plural(stats.hits, "hit"),
                     plural(stats.misses, "miss", "misses"), plural(stats.waits, "wait"),
                     plural(stats.evictions, "eviction"), format_bytes(stats.bytes_held))
            if device_hold is not None:
                device_hold.close()
            _close_fuse(pyfuse3, mountpoint)
            claim.close()
    finally:
        for number, handler in held.items():
            signal.signal(number, handler)


def _hold_signals(received: list[int]) -> dict[int, object]:
    """SIGTERM and SIGINT noted in `received`, not raised, until the session loop's receiver takes them (it acts
    on those noted first): the mount is in mountinfo from its start, and a SIGTERM before the receiver was open
    raised inside the loop (a traceback, exit 1, where a signal a moment later unmounts and exits 0). Returns the
    handlers to put back."""
    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    return {number: signal.signal(number, note) for number in (signal.SIGTERM, signal.SIGINT)}


@dataclass(frozen=True, slots=True)
class _Session:
    """What one mount answers the kernel with: `operations`, reading through `cache`, `prefetcher` ahead of them."""

    operations: FanstoreOperations
    cache: DecodedCache
    prefetcher: Prefetcher | None


def _open_session(ds: Dataset, mountpoint: Path, options: MountOptions, prefetch_order: list[int] | None,
                  bound: CacheBound | None, ahead: FetchedAhead | None) -> _Session:
    """The cache, the prefetcher (none when no file is worth one) and the FUSE operations over them (see
    serve_dataset for the arguments)."""
    from .fuse_ops import KERNEL_CACHE_TIMEOUT, FanstoreOperations, PrefetchView

    index = ds.index
    bound = bound or cache_bound(options.cache_size)
    log.info("%s: %s", mountpoint, bound.describe())
    keep_freed_memory()
    cache = DecodedCache(bound.size, ds.reader.load)
    cores = len(os.sched_getaffinity(0))
    kernel_holds = KernelHolds(len(index.entries))
    prefetcher = None
    min_size = INLINE_DECODE_BYTES if options.prefetch_min_size is None else options.prefetch_min_size
    # Read even when no prefetcher is made: a list that is wrong is an error whatever the dataset holds.
    order_list = prefetch_order
    if order_list is None and options.prefetch_list:
        order_list = read_prefetch_list(index, options.prefetch_list, mountpoint)
    # Files another node stores: always worth fetching ahead.
    slow = ahead.covers if ahead is not None else may_block_flags(index, ds.reader.source)
    # No prefetcher at all when no file is big enough to be worth one: each open would only look for work.
    if options.prefetch > 0 and bool(((index.entries["stored_len"] >= min_size) | slow).any()):
        prefetcher = Prefetcher(PrefetchView(cache, kernel_holds), FileOrder(index, order_list, min_size, slow),
                                options.prefetch, options.prefetch_threads or cores)
    operations = FanstoreOperations(
        index, cache, prefetcher, options.decode_threads or 2 * cores, keep_cache=options.keep_cache,
        timeout=options.kernel_timeout if options.kernel_timeout is not None else KERNEL_CACHE_TIMEOUT,
        kernel_holds=kernel_holds, source=ds.reader.source, may_block=slow, reader=ds.reader,
        ahead=ahead)
    if prefetcher is not None and ahead is not None and order_list:
        ahead.follow(np.asarray(order_list, dtype=np.int64))  # the list is the mount's plan, all epoch long
    return _Session(operations, cache, prefetcher)


def _init_fuse(operations: FanstoreOperations, mountpoint: Path, allow_other: bool, auto_unmount: bool) -> None:
    """Hand the kernel the mount (read-only); MountError when it refuses."""
    import pyfuse3

    fuse_options = set(pyfuse3.default_options) | {"ro", "fsname=fanstore", f"subtype={FANSTORE_SUBTYPE}"}
    if allow_other:
        fuse_options.add("allow_other")
    if auto_unmount:
        fuse_options |= auto_unmount_option(mountpoint)
    try:
        pyfuse3.init(operations, str(mountpoint), fuse_options)
    except RuntimeError as exc:
        raise MountError(f"{mountpoint}: cannot mount: {exc}") from None


def _serve_until_unmounted(operations: FanstoreOperations, mountpoint: Path, read_ahead_kib: int, stop: threading.Event,
                           ready_fd: int | None, while_mounted: Callable[[threading.Event], int] | None,
                           early: list[int]) -> int:
    """Answer the kernel's requests until unmounted, signalled (`early`: signals that came before the loop ran),
    or `while_mounted` returns (its result is returned; else 0); readiness is reported once the session loop runs
    and takes signals, the read-ahead set once the kernel has answered INIT."""
    import pyfuse3
    import trio

    outcome: list[int] = []

    async def after_init() -> None:
        await operations.initialized.wait()
        if read_ahead_kib > 0:
            set_read_ahead(mountpoint, read_ahead_kib)
        if while_mounted is not None:
            outcome.append(await trio.to_thread.run_sync(while_mounted, stop))
            pyfuse3.terminate()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(_unmount_on_signal, stop, while_mounted is None, early)
            nursery.start_soon(after_init)
            _report_ready(ready_fd, "ok")
            await pyfuse3.main()
            stop.set()  # unmounted from outside: a while_mounted still running is told to end
            nursery.cancel_scope.cancel()

    trio.run(serve)
    return outcome[0] if outcome else 0


async def _unmount_on_signal(stop: threading.Event, terminate: bool, early: list[int],
                             task_status: object = None) -> None:
    """SIGTERM or SIGINT (those in `early` first) sets `stop`; the mount ends here unless a `while_mounted` ends it
    once it sees `stop`. Started (`task_status`) once it takes signals."""
    import pyfuse3
    import trio

    def unmount(signum: int) -> bool:
        log.info("signal %d: unmounting", signum)
        stop.set()
        if terminate:
            pyfuse3.terminate()
        return terminate

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()  # type: ignore[union-attr]
        for signum in early:
            if unmount(signum):
                return
        async for signum in signals:
            if unmount(signum):
                return


def _close_fuse(pyfuse3: object, mountpoint: Path) -> None:
    """Always ask for the unmount: libfuse skips it when an external umount already ended the session.

    Never stat the mount point here to decide: our own loop no longer answers, so the stat would wait forever.
    """
    pyfuse3.close(unmount=True)  # type: ignore[attr-defined]


def _report_ready(ready_fd: int | None, message: str) -> None:
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, (one_line(message) + "\n").encode("utf-8", "replace"))
        os.close(ready_fd)
    except OSError:
        pass


def check_daemon_can_read(prefetch_list: Path | None) -> None:
    """Refuse a --prefetch-list a background mount's daemon cannot read as this process could: the daemon opens it
    after this command, so a fifo no one writes held it (and this command, waiting on it) for good, and a pipe of the
    caller's shell (`<(...)`, /dev/fd/N) is not the daemon's to open. --foreground reads it in this process."""
    if prefetch_list is None:
        return
    try:
        mode = os.stat(prefetch_list).st_mode
    except OSError:
        return  # read_prefetch_list says why, naming it
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise UsageError(f"--prefetch-list {quoted(str(prefetch_list))} is a pipe or fifo, which the mount's daemon "
                         "cannot read as this shell would: write the list to a file, or mount with --foreground")


def mount_background(dataset: Path, mountpoint: Path, argv: list[str], log_path: Path,
                     private_log: bool = False) -> int:
    """Start the foreground mount as a daemon in its own session; return once it is ready (or failed). `argv` is
    the command line as given, from the command's name on (`mount DEST MOUNTPOINT ...`).

    `private_log`: `log_path` is default_log_path's, not the user's choice, and is opened only as open_daemon_log
    says a private log is.
    """
    check_mountpoint(mountpoint)
    log_fd = open_daemon_log(log_path, private=private_log)
    read_end, write_end = os.pipe()
    # The daemon's own options go right after the command's name: appended, they followed a `--` the user gave
    # for a DEST or MOUNTPOINT that starts with '-', and the daemon took them for arguments and refused them.
    command, given = argv[:1], argv[1:]
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "fanstore", *command, "--foreground", "--ready-fd", str(write_end), *given],
            pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
            start_new_session=True,
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(log_fd)
        os.close(write_end)
    with os.fdopen(read_end, "rb") as ready:
        answer = ready.readline().decode("utf-8", "replace").strip()
    if answer == "ok":
        return daemon.pid
    daemon.wait()
    raise MountError(answer.removeprefix("error: ") or f"the mount daemon exited with status {daemon.returncode}; "
                                                        f"see {log_path}")


def default_log_path(mountpoint: Path) -> Path:
    """Where a background mount logs without --log: in a directory of this user's, never a shared one like /tmp,
    where anyone could plant a symlink at the predictable name and have the daemon (often root) append to any file.
    Named after the mount point's whole path (resolved), so mounts at /a/mnt and /b/mnt keep their logs apart.
    """
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR", "")
    usable = runtime_dir.startswith("/") and os.path.isdir(runtime_dir)
    base = Path(runtime_dir) if usable else _home() / ".cache"
    return base / "fanstore" / f"mount-{_log_name(mountpoint)}.log"


def _home() -> Path:
    """This user's home: $HOME where it is an absolute path, else the password database's. HOME='' made the log's
    directory /.cache, on the root file system, and a relative HOME one under wherever the mount was run; the XDG
    spec has a relative path ignored."""
    home = os.environ.get("HOME", "")
    if home.startswith("/"):
        return Path(home)
    import pwd

    return Path(pwd.getpwuid(os.geteuid()).pw_dir)


_LOG_NAME_READABLE = 100  # characters of the path a log's name keeps (its end: the last names tell mounts apart)


def _log_name(mountpoint: Path) -> str:
    """The mount point's path as one file name: its names joined by '-' (`/scratch/u/mnt` -> `scratch-u-mnt`),
    then a digest of the whole path, which tells apart paths the joined names do not (`/a-b/c` and `/a/b-c`,
    a path too long to keep whole, names with characters replaced)."""
    readable = "-".join(re.sub(r"[^A-Za-z0-9._+=,@-]", "_", part) for part in mountpoint.parts if part != "/")
    digest = hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:8]
    return f"{readable[-_LOG_NAME_READABLE:].lstrip('-') or 'root'}-{digest}"


def open_daemon_log(log_path: Path, private: bool = False) -> int:
    """A descriptor appending to the daemon's log; any failure is one line naming the file.

    A log named by --log is opened as given. A `private` one (the default log) only inside a directory of ours
    that no one else may write to, never through a symlink, and only if it is a regular file of ours.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    if not private:
        try:
            # O_NONBLOCK: a FIFO no process reads fails (ENXIO) where a blocking open waited for a reader for good;
            # one with a reader (`--log >(logger)`) opens.
            log_fd = os.open(log_path, flags | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            reason = "a fifo that no process reads" if exc.errno == errno.ENXIO else f"cannot open: {exc.strerror}"
            raise UsageError(f"--log {quoted(log_path)}: {reason}") from None
        os.set_blocking(log_fd, True)
        return log_fd
    directory_fd = _open_private_directory(log_path.parent)
    try:
        # Opened relative to the directory checked, so a directory swapped since cannot redirect it; O_NONBLOCK
        # so that a FIFO planted there cannot hold the open.
        log_fd = os.open(log_path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600, dir_fd=directory_fd)
    except OSError as exc:
        reason = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise MountError(f"log {log_path} {reason}; remove it, or give --log FILE") from None
    finally:
        os.close(directory_fd)
    info = os.fstat(log_fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(log_fd)
        raise MountError(f"log {log_path} is not a regular file of this user's; remove it, or give --log FILE")
    os.set_blocking(log_fd, True)
    return log_fd


def _open_private_directory(directory: Path) -> int:
    """`directory` (created 0700 if missing), opened only if it is a real directory of ours that no one else may
    write to: otherwise a symlink or file planted in it could take the log's place."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        # O_DIRECTORY | O_NOFOLLOW fails on a symlink with ENOTDIR, not ELOOP: ask lstat which it was.
        reason = "is a symbolic link" if directory.is_symlink() else f"cannot be used: {exc.strerror}"
        raise MountError(f"log directory {directory} {reason}; give --log FILE") from None
    info = os.fstat(directory_fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        os.close(directory_fd)
        raise MountError(f"log directory {directory} is not private (owner uid {info.st_uid}, "
                         f"{stat.filemode(info.st_mode)}); make it 0700 and ours, or give --log FILE")
    return directory_fd


def wait_for_exit(pid: int, timeout: float = 30.0) -> bool:
    """Wait for a mount daemon to end (reaping it if it is our child); False if it is still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # not our child: it is gone once signal 0 cannot reach it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.05)
    return False


def unmount(mountpoint: Path) -> None:
    """Unmount a fanstore view, stale or live; the daemon then exits by itself.

    `mountpoint` is resolved (resolve_mountpoint): mountinfo, which decides here, lists resolved paths only.
    """
    mounts = fuse_mounts()
    if str(mountpoint) not in mounts:
        if fuse_mount_holding(str(mountpoint), mounts) is None:  # else a lookup could wait on a hung daemon
            if not os.path.lexists(mountpoint):
                raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} does not exist")
            if not os.path.isdir(mountpoint):
                raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} is not a directory")
        raise UsageError(f"{mountpoint}: no FUSE file system is mounted here")
    fs_type = fuse_type(mountpoint)
    if fs_type != f"fuse.{FANSTORE_SUBTYPE}":  # a path mistyped: someone's sshfs or squashfuse is not ours to end
        raise UsageError(f"MOUNTPOINT {quoted(mountpoint)} holds {fs_type}, not a fanstore mount; fusermount3 -u "
                         "unmounts any FUSE file system")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    command = [tool, "-u", "-z", str(mountpoint)] if tool else ["umount", "-l", str(mountpoint)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise MountError(f"{mountpoint}: {' '.join(command)} failed: {done.stderr.strip()}")
