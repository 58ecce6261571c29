"""A FUSE file system whose inode numbers are not stable: each lookup numbers the file afresh, as libfuse's
high-level API does (sshfs, for one) for a file the kernel forgot. Run: python renumbering_fs.py MOUNTPOINT."""

from __future__ import annotations

import errno
import itertools
import stat
import sys

import pyfuse3
import trio

FILES = {f"f{i}.txt".encode(): b"content of file %d\n" % i * 50 for i in range(8)}
TIME_NS = 1_600_000_000 * 10**9


class RenumberingFs(pyfuse3.Operations):
    """One directory of FILES; a name looked up gets a new inode number every time (entries are not cached)."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers = itertools.count(pyfuse3.ROOT_INODE + 1)
        self.names: dict[int, bytes] = {}

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        attributes = pyfuse3.EntryAttributes()
        attributes.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            attributes.st_mode, attributes.st_size = stat.S_IFDIR | 0o755, 0
        else:
            attributes.st_mode, attributes.st_size = stat.S_IFREG | 0o644, len(FILES[self.names[inode]])
        attributes.st_mtime_ns = attributes.st_ctime_ns = attributes.st_atime_ns = TIME_NS
        attributes.entry_timeout = attributes.attr_timeout = 0
        return attributes

    async def getattr(self, inode, ctx=None):
        return self._attributes(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name not in FILES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = next(self.numbers)
        self.names[inode] = name
        return self._attributes(inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for offset, name in enumerate(sorted(FILES)[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, await self.lookup(pyfuse3.ROOT_INODE, name), offset):
                break

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh, off, size):
        return FILES[self.names[fh]][off : off + size]


if __name__ == "__main__":
    options = set(pyfuse3.default_options)
    options.add("fsname=renumbering")
    pyfuse3.init(RenumberingFs(), sys.argv[1], options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()
