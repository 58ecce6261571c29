"""The client side of shared_fs.py: a node's mount of the simulated parallel file system, asking the model for
every RPC that Lustre's client would send and waiting as long as the model says. The rules are in shared_fs.py's
docstring; this file applies them to FUSE's requests."""

from __future__ import annotations

import errno
import os
import socket
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import pyfuse3
import trio

from shared_fs import FLUSH, FLUSHED, HEADER, KINDS, MIB, PAGE, READ, REPLY, REPORT_EVERY, REQUEST, REQUEST_BODY, \
    SAMPLES, Parameters

CACHE_TIMEOUT = 3600.0  # the kernel keeps names and attributes, as the client does under its locks
READDIR_PAGE = 1000  # entries a readdir RPC returns


class ModelLink:
    """The client's connection to the model: an RPC is a request answered when its modelled latency has passed.
    At most --mds-in-flight metadata and --oss-in-flight read RPCs are out at once."""

    def __init__(self, connection: socket.socket, parameters: Parameters) -> None:
        self._connection = connection
        self._next_id = 0
        self._waiting: dict[int, trio.Event] = {}
        self._answers: dict[int, float] = {}
        self._samples = array("d")  # done at, 0 metadata | 1 read, achieved, configured
        self._metadata_slots = trio.Semaphore(parameters.mds_in_flight)
        self._read_slots = trio.Semaphore(parameters.oss_in_flight)

    async def rpc(self, kind: int, nbytes: int = 0) -> None:
        async with self._read_slots if kind == READ else self._metadata_slots:
            self._next_id = request_id = (self._next_id + 1) % FLUSH
            done = self._waiting[request_id] = trio.Event()
            sent = time.monotonic()
            self._connection.sendall(HEADER.pack(REQUEST_BODY.size, REQUEST)
                                     + REQUEST_BODY.pack(request_id, kind, nbytes, sent))
            await done.wait()
            now = time.monotonic()
            self._samples.extend((now, float(kind == READ), now - sent, self._answers.pop(request_id)))

    async def receive(self) -> None:
        """Hand each answer to the RPC waiting for it; the model gone ends the mount."""
        pending = b""
        while True:
            await trio.lowlevel.wait_readable(self._connection)
            data = self._connection.recv(1 << 16)
            if not data:
                pyfuse3.terminate()
                return
            pending += data
            whole = len(pending) - len(pending) % REPLY.size
            for request_id, latency in REPLY.iter_unpack(pending[:whole]):
                if request_id == FLUSH:
                    self.send_samples()
                    self._connection.sendall(HEADER.pack(0, FLUSHED))
                    continue
                self._answers[request_id] = latency
                self._waiting.pop(request_id).set()
            pending = pending[whole:]

    async def report(self) -> None:
        """Send the latencies achieved to the model, which files them by phase."""
        while True:
            await trio.sleep(REPORT_EVERY)
            self.send_samples()

    def send_samples(self) -> None:
        if self._samples:
            body, self._samples = self._samples.tobytes(), array("d")
            self._connection.sendall(HEADER.pack(len(body), SAMPLES) + body)


@dataclass(slots=True)
class OpenFile:
    fd: int
    inode: int
    size: int
    next_offset: int = 0  # where the last read ended: a read starting here is sequential
    closed: bool = False  # its close RPC is sent (at the first flush)


class PageCache:
    """Which pages this node holds, least recently used first; the bytes themselves are read from the directory."""

    def __init__(self, capacity: int) -> None:
        self._pages: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity // PAGE

    @staticmethod
    def key(inode: int, page: int) -> int:
        return (inode << 40) | page

    def missing(self, inode: int, first: int, last: int) -> list[int]:
        """The pages of [first, last] not held; those held become the most recently used."""
        pages, absent = self._pages, []
        for page in range(first, last + 1):
            key = (inode << 40) | page
            if key in pages:
                pages.move_to_end(key)
            else:
                absent.append(page)
        return absent

    def add(self, inode: int, pages: list[int]) -> None:
        held = self._pages
        for page in pages:
            held[(inode << 40) | page] = None
        while len(held) > self._capacity:
            held.popitem(last=False)


class LustreClient(pyfuse3.Operations):
    """A read-only view of a directory that pays, for each request, the RPCs Lustre's client would send."""

    def __init__(self, directory: os.PathLike[str], link: ModelLink, parameters: Parameters) -> None:
        super().__init__()
        self._link = link
        self._paths: dict[int, bytes] = {pyfuse3.ROOT_INODE: os.fsencode(directory)}
        self._inodes: dict[int, int] = {os.lstat(directory).st_ino: pyfuse3.ROOT_INODE}
        self._known: set[int] = set()  # names and attributes this client holds
        self._learning: dict[int, trio.Event] = {}  # those on their way
        self._intent: set[int] = set()  # looked up by an RPC that the next open takes over
        self._files: dict[int, OpenFile] = {}
        self._listings: dict[int, list[tuple[bytes, int]]] = {}
        self._next_handle = 0
        self._cache = PageCache(parameters.page_cache)
        self._coming: dict[int, trio.Event] = {}  # page key -> its RPC's end, for pages on their way
        self._rpc_pages = parameters.rpc_size // PAGE
        self._whole_file = parameters.whole_file
        self._readahead_pages = parameters.readahead // PAGE
        self._nursery: trio.Nursery | None = None

    # --- names and attributes ---------------------------------------------------------------------------------

    def _inode_of(self, path: bytes, info: os.stat_result) -> int:
        inode = self._inodes.get(info.st_ino)
        if inode is None:
            inode = self._inodes[info.st_ino] = len(self._inodes) + 1
        self._paths[inode] = path
        return inode

    def _attributes(self, inode: int, info: os.stat_result) -> pyfuse3.EntryAttributes:
        attributes = pyfuse3.EntryAttributes()
        attributes.st_ino, attributes.st_mode, attributes.st_size = inode, info.st_mode, info.st_size
        attributes.st_nlink, attributes.st_uid, attributes.st_gid = info.st_nlink, info.st_uid, info.st_gid
        attributes.st_mtime_ns, attributes.st_ctime_ns = info.st_mtime_ns, info.st_ctime_ns
        attributes.st_atime_ns = info.st_atime_ns
        attributes.st_blksize, attributes.st_blocks = MIB, info.st_blocks
        attributes.entry_timeout = attributes.attr_timeout = CACHE_TIMEOUT
        return attributes

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._paths[parent_inode] + b"/" + name
        try:
            info = os.lstat(path)
        except OSError as exc:
            await self._link.rpc(KINDS.index("lookup"))  # the server says there is no such name
            raise pyfuse3.FUSEError(exc.errno) from None
        inode = self._inode_of(path, info)
        if await self._learn(inode, "lookup"):
            self._intent.add(inode)
        return self._attributes(inode, info)

    async def _learn(self, inode: int, kind: str) -> bool:
        """Fetch a name's attributes unless held or on their way (one RPC however many ask at once); whether this
        request sent the RPC."""
        if inode in self._known:
            return False
        coming = self._learning.get(inode)
        if coming is not None:
            await coming.wait()
            return False
        coming = self._learning[inode] = trio.Event()
        try:
            await self._link.rpc(KINDS.index(kind))
            self._known.add(inode)
        finally:
            del self._learning[inode]
            coming.set()
        return True

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        await self._learn(inode, "getattr")
        return self._attributes(inode, os.lstat(self._paths[inode]))

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        await self._learn(inode, "readlink")
        return os.readlink(self._paths[inode])

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        await self._link.rpc(KINDS.index("statfs"))
        info = os.statvfs(self._paths[pyfuse3.ROOT_INODE])
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                     "f_namemax"):
            setattr(data, name, getattr(info, name))
        return data

    # --- opening and closing ----------------------------------------------------------------------------------

    async def _open_rpc(self, inode: int) -> None:
        """An open the lookup's intent RPC did not already cover costs one."""
        if inode in self._intent:
            self._intent.discard(inode)
        else:
            await self._link.rpc(KINDS.index("open"))

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        await self._open_rpc(inode)
        fd = os.open(self._paths[inode], os.O_RDONLY | os.O_CLOEXEC)
        self._next_handle += 1
        self._files[self._next_handle] = OpenFile(fd, inode, os.fstat(fd).st_size)
        return pyfuse3.FileInfo(fh=self._next_handle, direct_io=True)

    async def flush(self, fh: int) -> None:
        """close(2): Lustre's close waits for its RPC."""
        opened = self._files[fh]
        if not opened.closed:
            opened.closed = True
            await self._link.rpc(KINDS.index("close"))

    async def release(self, fh: int) -> None:
        opened = self._files.pop(fh)
        os.close(opened.fd)
        if not opened.closed:
            await self._link.rpc(KINDS.index("close"))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        await self._open_rpc(inode)
        path = self._paths[inode]
        entries = []
        with os.scandir(path) as listing:
            for entry in listing:
                entries.append((os.fsencode(entry.name), 0))
        entries.sort()
        self._next_handle += 1
        self._listings[self._next_handle] = entries
        self._files[self._next_handle] = OpenFile(-1, inode, 0)
        return self._next_handle

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries, parent = self._listings[fh], self._paths[self._files[fh].inode]
        for position in range(start_id, len(entries)):
            if position % READDIR_PAGE == 0:
                await self._link.rpc(KINDS.index("readdir"))
            name = entries[position][0]
            path = parent + b"/" + name
            info = os.lstat(path)
            attributes = self._attributes(self._inode_of(path, info), info)
            attributes.entry_timeout = attributes.attr_timeout = 0  # a listing gives names, not attributes
            if not pyfuse3.readdir_reply(token, name, attributes, position + 1):
                return

    async def releasedir(self, fh: int) -> None:
        self._listings.pop(fh, None)
        self._files.pop(fh)
        await self._link.rpc(KINDS.index("close"))

    # --- data -------------------------------------------------------------------------------------------------

    async def read(self, fh: int, off: int, size: int) -> bytes:
        opened = self._files[fh]
        end = min(off + size, opened.size)
        if off >= end:
            return b""
        first, last = off // PAGE, (end - 1) // PAGE
        fetch_last = last
        if opened.size <= self._whole_file:
            fetch_last = (opened.size - 1) // PAGE  # a small file is read whole
        elif off == opened.next_offset and off > 0:  # sequential: read ahead
            fetch_last = min(last + self._readahead_pages, (opened.size - 1) // PAGE)
        opened.next_offset = end
        fetch_first = 0 if opened.size <= self._whole_file else first
        await self._fetch(opened, fetch_first, fetch_last, first, last)
        return os.pread(opened.fd, end - off, off)

    async def _fetch(self, opened: OpenFile, fetch_first: int, fetch_last: int, first: int, last: int) -> None:
        """Make pages [first, last] present: send RPCs for every page of [fetch_first, fetch_last] neither held
        nor on its way, wait for those of [first, last]; the pages read ahead come in behind."""
        inode, coming = opened.inode, self._coming
        absent = [page for page in self._cache.missing(inode, fetch_first, fetch_last)
                  if (inode << 40) | page not in coming]
        waits = []
        for run in self._rpcs(absent, opened.size):
            done = trio.Event()
            for page in run:
                coming[(inode << 40) | page] = done
            nbytes = min((run[-1] + 1) * PAGE, opened.size) - run[0] * PAGE
            if run[0] <= last and run[-1] >= first:
                waits.append(done)
            self._nursery_of().start_soon(self._read_rpc, inode, run, nbytes, done)
        for page in range(first, last + 1):
            done = coming.get((inode << 40) | page)
            if done is not None and done not in waits:
                waits.append(done)
        for done in waits:
            await done.wait()

    def _rpcs(self, pages: list[int], size: int) -> list[list[int]]:
        """Runs of consecutive pages, none across an RPC-sized, RPC-aligned boundary."""
        runs: list[list[int]] = []
        for page in pages:
            if runs and page == runs[-1][-1] + 1 and page % self._rpc_pages != 0:
                runs[-1].append(page)
            else:
                runs.append([page])
        return runs

    async def _read_rpc(self, inode: int, pages: list[int], nbytes: int, done: trio.Event) -> None:
        try:
            await self._link.rpc(READ, nbytes)
            self._cache.add(inode, pages)
        finally:
            for page in pages:
                self._coming.pop((inode << 40) | page, None)
            done.set()

    def _nursery_of(self) -> trio.Nursery:
        """Read RPCs run in a nursery of their own, so a read ahead outlives the request that sent it."""
        if self._nursery is None:
            raise RuntimeError("the client's nursery is not running")
        return self._nursery

    async def run_rpcs(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()
