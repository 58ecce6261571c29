"""The ceiling of a Python FUSE mount on this machine: a read-only pyfuse3 file system that serves a directory
tree from RAM with no decoding, and with the kernel settings fanstore's mount uses (entry and attribute
timeouts, keep_cache, read-ahead, the same session loop). bench_read.py mounts it beside fanstore, so the two
differ only in what fanstore does per request: look names up in its index, decode, manage its cache.

Usage: python bench/ram_fs.py SRC MOUNTPOINT [--no-keep-cache] [--timeout S] [--read-ahead KIB]
                              [--plain-loop] [--no-open {eio,zeros}] [--stats FILE]
Serves in the foreground until unmounted or sent SIGTERM. SIGUSR1 writes the requests answered so far, per
operation, to --stats as JSON: the bench reads them to show what each kernel-cache lever saves.

--no-open answers open() with ENOSYS. A kernel with no-open support (FUSE_NO_OPEN_SUPPORT, which libfuse 3
accepts) takes that as "opens always succeed" and stops sending opens and releases. But pyfuse3 calls
read(fh, off, size) with the file handle only (its fuse_read handler drops the inode libfuse gives it), and
without an open every handle is 0: the file system cannot tell which file is read. With eio such reads fail;
with zeros they get zero bytes of the requested length: wrong bytes at the right sizes, which prices the lever
without making it usable.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import signal
import stat
import sys
from pathlib import Path

import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fanstore's own kernel settings, this checkout

from fanstore.mount.fuse_ops import KERNEL_CACHE_TIMEOUT  # noqa: E402
from fanstore.mount.daemon_tuning import install_fast_session_loop  # noqa: E402
from fanstore.mount.mount import READ_AHEAD_KIB, set_read_ahead  # noqa: E402


class RamOperations(pyfuse3.Operations):
    """Every file read into memory and every attribute built once, at mount; requests only look things up."""

    def __init__(self, root: str, keep_cache: bool, timeout: float, no_open: str | None) -> None:
        super().__init__()
        self.keep_cache, self.timeout, self.no_open = keep_cache, timeout, no_open
        self.children: dict[int, dict[bytes, int]] = {}
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.data: dict[int, bytes] = {}
        self.requests: collections.Counter[str] = collections.Counter()
        self.handles_read: set[int] = set()
        self.initialized = trio.Event()
        self._load(os.fsencode(root), pyfuse3.ROOT_INODE)
        self._zeros = bytes(max((len(d) for d in self.data.values()), default=0))

    def _load(self, path: bytes, inode: int) -> None:
        info = os.lstat(path)
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino, attrs.st_mode, attrs.st_size = inode, info.st_mode, info.st_size
        attrs.st_nlink = 2 if stat.S_ISDIR(info.st_mode) else 1
        attrs.st_mtime_ns = attrs.st_ctime_ns = attrs.st_atime_ns = info.st_mtime_ns
        attrs.st_uid, attrs.st_gid = os.getuid(), os.getgid()
        attrs.st_blksize = 128 * 1024
        attrs.st_blocks = (info.st_size + 511) // 512
        attrs.entry_timeout = attrs.attr_timeout = self.timeout
        self.attrs[inode] = attrs
        if stat.S_ISDIR(info.st_mode):
            self.children[inode] = {}
            for name in sorted(os.listdir(path)):
                child = len(self.attrs) + 1
                self.children[inode][name] = child
                self._load(path + b"/" + name, child)
        else:
            with open(path, "rb") as f:
                self.data[inode] = f.read()

    def init(self) -> None:
        self.initialized.set()  # the INIT reply is written before the task waiting on this runs

    async def lookup(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def]
        self.requests["lookup"] += 1
        child = self.children.get(parent_inode, {}).get(name)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[child]

    async def getattr(self, inode, ctx):  # type: ignore[no-untyped-def]
        self.requests["getattr"] += 1
        return self.attrs[inode]

    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def]
        self.requests["opendir"] += 1
        return inode

    async def readdir(self, fh, start_id, token):  # type: ignore[no-untyped-def]
        self.requests["readdir"] += 1
        entries = list(self.children[fh].items())
        for position in range(start_id, len(entries)):
            name, child = entries[position]
            if not pyfuse3.readdir_reply(token, name, self.attrs[child], position + 1):
                return

    async def releasedir(self, fh):  # type: ignore[no-untyped-def]
        self.requests["releasedir"] += 1

    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def]
        self.requests["open"] += 1
        if self.no_open is not None:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=self.keep_cache)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def]
        self.requests["read"] += 1
        self.handles_read.add(fh)
        data = self.data.get(fh)
        if data is None:  # fh 0: the kernel skipped open, and pyfuse3 does not pass the inode
            if self.no_open == "zeros":
                return memoryview(self._zeros)[:size]
            raise pyfuse3.FUSEError(errno.EIO)
        return memoryview(data)[off : off + size]

    async def release(self, fh):  # type: ignore[no-untyped-def]
        self.requests["release"] += 1

    def stats(self) -> dict[str, object]:
        return {"requests": dict(self.requests), "handles_read": sorted(self.handles_read)[:10]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("mountpoint")
    parser.add_argument("--no-keep-cache", action="store_true")
    parser.add_argument("--timeout", type=float, default=KERNEL_CACHE_TIMEOUT, help="entry and attribute timeout")
    parser.add_argument("--read-ahead", type=int, default=READ_AHEAD_KIB, metavar="KIB")
    parser.add_argument("--plain-loop", action="store_true", help="pyfuse3's own session loop, as shipped")
    parser.add_argument("--no-open", choices=("eio", "zeros"))
    parser.add_argument("--stats", type=Path)
    args = parser.parse_args()
    operations = RamOperations(args.src, not args.no_keep_cache, args.timeout, args.no_open)
    if not args.plain_loop:
        install_fast_session_loop()
    pyfuse3.init(operations, args.mountpoint, set(pyfuse3.default_options) | {"ro", "fsname=ramfs"})

    async def write_stats_and_stop_on_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                if signum != signal.SIGUSR1:
                    pyfuse3.terminate()
                    return
                if args.stats is not None:
                    partial = args.stats.with_suffix(".partial")
                    partial.write_text(json.dumps(operations.stats()))
                    partial.replace(args.stats)

    async def set_read_ahead_after_init() -> None:
        await operations.initialized.wait()
        set_read_ahead(Path(args.mountpoint), args.read_ahead)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_stats_and_stop_on_signal)
            nursery.start_soon(set_read_ahead_after_init)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
