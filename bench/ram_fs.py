"""The ceiling of a Python FUSE mount on this machine: a read-only pyfuse3 file system that serves a directory
tree from RAM with no decoding, with the same kernel-cache settings fanstore uses (long entry and attribute
timeouts, keep_cache). bench_read.py mounts it beside fanstore so the two differ only in what fanstore adds.

Usage: python bench/ram_fs.py SRC MOUNTPOINT [--no-keep-cache] [--timeout S] [--enosys-open]
Prints "ready" on stdout once mounted; SIGTERM or an unmount ends it.

--enosys-open answers open() with ENOSYS, which tells a kernel with no-open support to stop sending opens at
all. pyfuse3 hands `read` only the file handle, not the inode, and with no open every handle is 0: the file
system can no longer tell which file is read. It then answers reads of handle 0 with EIO, so the bench can show
that the lever exists in the kernel but not through pyfuse3's API.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio


class RamOperations(pyfuse3.Operations):
    def __init__(self, root: str, keep_cache: bool, timeout: float, enosys_open: bool) -> None:
        super().__init__()
        self.keep_cache, self.timeout, self.enosys_open = keep_cache, timeout, enosys_open
        self.children: dict[int, dict[bytes, int]] = {}
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.data: dict[int, bytes] = {}
        self._load(root.encode(), pyfuse3.ROOT_INODE)

    def _load(self, path: bytes, inode: int) -> None:
        """Every file read into memory and every attribute built once, at mount."""
        info = os.lstat(path)
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino, attrs.st_mode, attrs.st_size = inode, info.st_mode, info.st_size
        attrs.st_nlink = 2 if stat.S_ISDIR(info.st_mode) else 1
        attrs.st_mtime_ns = attrs.st_ctime_ns = attrs.st_atime_ns = info.st_mtime_ns
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

    async def lookup(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def]
        child = self.children.get(parent_inode, {}).get(name)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[child]

    async def getattr(self, inode, ctx):  # type: ignore[no-untyped-def]
        return self.attrs[inode]

    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def]
        return inode

    async def readdir(self, fh, start_id, token):  # type: ignore[no-untyped-def]
        entries = list(self.children[fh].items())
        for position in range(start_id, len(entries)):
            name, child = entries[position]
            if not pyfuse3.readdir_reply(token, name, self.attrs[child], position + 1):
                return

    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def]
        if self.enosys_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=self.keep_cache)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def]
        data = self.data.get(fh)
        if data is None:  # fh 0: the kernel skipped open, and pyfuse3 does not pass the inode
            raise pyfuse3.FUSEError(errno.EIO)
        return memoryview(data)[off : off + size]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("mountpoint")
    parser.add_argument("--no-keep-cache", action="store_true")
    parser.add_argument("--timeout", type=float, default=24 * 3600.0)
    parser.add_argument("--enosys-open", action="store_true")
    args = parser.parse_args()
    operations = RamOperations(args.src, not args.no_keep_cache, args.timeout, args.enosys_open)
    pyfuse3.init(operations, args.mountpoint, set(pyfuse3.default_options) | {"ro", "fsname=ramfs"})

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(stop_on_signal)
            print("ready", flush=True)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
