"""Compressing one batch, in a worker process or in the packing process alike: each file (or block) read, checked
to be still the file the walk saw, unchanged while read, compressed with its group's and kind's codec, and
checksummed; its blob left in the batch's buffer, back to back with the others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import xxhash

from compressors.kinds import HEAD_BYTES, file_kind

from .batches import Batch, PlanFiles
from .codec_plan import NONE_ROW, CodecPlan
from .entry_columns import time_column
from .walk import Problem


@dataclass(frozen=True, slots=True)
class Skipped:
    """A planned file that could not be packed (it changed, vanished or cannot be read)."""

    number: int
    problem: Problem


# A compressed file or block, as a plain tuple (it crosses the process boundary 100,000s of times, and a tuple
# pickles several times faster than a dataclass): plan number, block number (WHOLE_FILE for a file stored whole),
# offset of its blob in the batch's `blobs`, stored length, codec row, checksum of the stored bytes, raw size.
SlotBlob = tuple[int, int, int, int, int, int, int]
WHOLE_FILE = -1


@dataclass(frozen=True, slots=True)
class Supplied:
    """A batch's raw bytes read by the packing process (from archives: archive_feed.py), back to back in plan
    order: whole files, or the batch's blocks. `head` is a blocks batch's file's first bytes (its kind's sniff);
    `failed` the files that could not be read, and why."""

    raw: memoryview
    head: bytes = b""
    failed: dict[int, str] = field(default_factory=dict)


# Why a file whose size is not what it reads is skipped, and what to do.
_NOT_ITS_SIZE = " (a /proc or /sys file?); copy it to a regular file to pack it"


class _Changed(Exception):
    """The file is not the one the walk saw, or changed while read: it is skipped for this reason."""


class BlobCompressor:
    """Reads a file (or some of its blocks), checks it is still the file the walk saw, compresses and checksums."""

    def __init__(self, root: Path, plan: CodecPlan, files: PlanFiles) -> None:
        self.root = root
        self.plan = plan
        self.files = files
        self._sniffed_groups = frozenset(g for g in plan.by_group if plan.depends_on_kind(g))

    def compress_into(self, batch: Batch, into: memoryview, supplied: Supplied | None = None
                      ) -> list[SlotBlob | Skipped]:
        """Compress a batch, leaving its blobs in `into` back to back; its raw bytes are read from SRC, or are
        `supplied`."""
        if batch.end_block:
            if supplied is not None:
                return self._supplied_blocks_into(batch, supplied, into)
            return self._blocks_into(batch.first, batch.first_block, batch.end_block, into)
        return self._files_into(batch.first, batch.end, into, supplied)

    def _files_into(self, first: int, end: int, into: memoryview, supplied: Supplied | None = None
                    ) -> list[SlotBlob | Skipped]:
        results: list[SlotBlob | Skipped] = []
        used = 0
        supplied_at = 0
        raw: bytes | bytearray | memoryview
        for number in range(first, end):
            size = self.files.sizes[number]
            if size == 0:
                continue  # empty files have no blob; the packer records them itself
            if supplied is not None:
                raw = supplied.raw[supplied_at : supplied_at + size]
                supplied_at += size
                if number in supplied.failed:
                    results.append(Skipped(number, Problem(self.files.paths[number], supplied.failed[number])))
                    continue
            else:
                try:
                    with self._open(number) as fd:
                        raw = self._read_exactly(fd, number, size, 0)
                        self._check_ends_at_size(fd, number)
                        self._check_unchanged_after(fd, number)
                except _Changed as changed:
                    results.append(Skipped(number, Problem(self.files.paths[number], str(changed))))
                    continue
            codec = self.plan.row_for(self.files.groups[number], self._kind(number, raw))
            stored, codec = self._encode(raw, codec)
            length = len(stored)
            into[used : used + length] = stored
            results.append((number, WHOLE_FILE, used, length, codec, xxhash.xxh3_64_intdigest(stored), size))
            used += length
        return results

    def _blocks_into(self, number: int, first_block: int, end_block: int, into: memoryview
                     ) -> list[SlotBlob | Skipped]:
        """Blocks of one large file, read one at a time: packing a file of any size needs memory for a few blocks."""
        size, block_size = self.files.sizes[number], self.files.layout.block_size
        results: list[SlotBlob | Skipped] = []
        used = 0
        try:
            with self._open(number) as fd:
                head = os.pread(fd, HEAD_BYTES, 0)
                codec = self.plan.row_for(self.files.groups[number], self._kind(number, head))
                for block in range(first_block, end_block):
                    offset = block * block_size
                    raw = self._read_exactly(fd, number, min(block_size, size - offset), offset)
                    stored, block_codec = self._encode(raw, codec, head)
                    length = len(stored)
                    into[used : used + length] = stored
                    results.append((number, block, used, length, block_codec, xxhash.xxh3_64_intdigest(stored),
                                    len(raw)))
                    used += length
                if end_block == self.files.layout.blocks_of(size):
                    self._check_ends_at_size(fd, number)
                self._check_unchanged_after(fd, number)
        except _Changed as changed:
            return [Skipped(number, Problem(self.files.paths[number], str(changed)))]
        return results

    def _supplied_blocks_into(self, batch: Batch, supplied: Supplied, into: memoryview) -> list[SlotBlob | Skipped]:
        """_blocks_into for blocks whose bytes were read for this process."""
        number, block_size = batch.first, self.files.layout.block_size
        if number in supplied.failed:
            return [Skipped(number, Problem(self.files.paths[number], supplied.failed[number]))]
        codec = self.plan.row_for(self.files.groups[number], self._kind(number, supplied.head))
        results: list[SlotBlob | Skipped] = []
        used = 0
        for block in range(batch.first_block, batch.end_block):
            start = (block - batch.first_block) * block_size
            raw = supplied.raw[start : min(start + block_size, batch.raw_bytes)]
            stored, block_codec = self._encode(raw, codec, supplied.head)
            length = len(stored)
            into[used : used + length] = stored
            results.append((number, block, used, length, block_codec, xxhash.xxh3_64_intdigest(stored), len(raw)))
            used += length
        return results

    def _encode(self, raw: bytes | bytearray | memoryview, codec: int, head: bytes | None = None
                ) -> tuple[bytes | bytearray | memoryview, int]:
        """Stored bytes and codec row; raw bytes under `none` when compressing would not make them smaller. A block
        of a file is encoded as the whole file would be (Codec.for_file of its `head`), under the same row."""
        if codec == NONE_ROW:
            return raw, NONE_ROW
        encoder = self.plan.codecs[codec] if head is None else self.plan.codecs[codec].for_file(head)
        stored = encoder.encode(raw)
        return (raw, NONE_ROW) if len(stored) >= len(raw) else (stored, codec)

    def _kind(self, number: int, raw: bytes | bytearray | memoryview) -> str:
        if self.files.groups[number] not in self._sniffed_groups:
            return ""
        return file_kind(self.files.paths[number], bytes(raw[:HEAD_BYTES]))

    @contextlib.contextmanager
    def _open(self, number: int) -> Iterator[int]:
        """The file, opened without following a symlink or blocking on a fifo, and only if it is still the file
        the walk saw: a regular file with the same size, mtime and ctime (and inode, unless all those match)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(self.root, self.files.paths[number]), flags)
        except FileNotFoundError:
            raise _Changed("vanished during the pack") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Changed("became a symlink during the pack") from None
            raise _Changed(f"cannot read: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            files = self.files
            if not stat.S_ISREG(info.st_mode):
                raise _Changed("is no longer a regular file")
            same_times = time_column(info.st_mtime_ns) == files.mtimes[number] and \
                time_column(info.st_ctime_ns) == files.ctimes[number]
            # Another inode number alone is no replacement: a FUSE file system without numbers of its own (sshfs)
            # numbers a file afresh once the kernel forgot it. A file renamed over this one has its own ctime.
            if info.st_ino != files.inos[number] and not (info.st_size == files.sizes[number] and same_times):
                raise _Changed("was replaced by another file during the pack")
            if info.st_size != files.sizes[number]:
                raise _Changed(f"changed size during the pack ({files.sizes[number]} bytes at walk, "
                               f"{info.st_size} now)")
            if not same_times:
                raise _Changed("changed during the pack (modified since the walk)")
            yield fd
        except OSError as exc:
            raise _Changed(f"cannot read: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _read_exactly(self, fd: int, number: int, length: int, offset: int) -> bytearray:
        """`length` bytes at `offset`. A file that ends sooner changed under us, or is one whose size does not
        tell its content (a /proc or /sys file says 4096 bytes and reads fewer)."""
        buffer = bytearray(length)
        view = memoryview(buffer)
        done = 0
        while done < length:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                self._check_unchanged_after(fd, number)
                raise _Changed(f"reads {offset + done} bytes where its size says {self.files.sizes[number]}"
                               f"{_NOT_ITS_SIZE}")
            done += got
        return buffer

    def _check_ends_at_size(self, fd: int, number: int) -> None:
        """A file that reads on past its size (a /proc file says 0 bytes, or fewer than it gives) would be packed
        cut short, without a word: it is skipped instead."""
        size = self.files.sizes[number]
        try:
            past_the_end = os.pread(fd, 1, size)
        except OSError:  # a file system that fails a read past the end (an HTTP range past it): read whole already
            return
        if past_the_end:
            self._check_unchanged_after(fd, number)  # one appended to as we read is a file that changed
            raise _Changed(f"reads past the {size} bytes its size says{_NOT_ITS_SIZE}")

    def _check_unchanged_after(self, fd: int, number: int) -> None:
        """A write while the file was read changes its size, mtime or ctime: the bytes read may be a mix."""
        info = os.fstat(fd)
        if (info.st_size, time_column(info.st_mtime_ns), time_column(info.st_ctime_ns)) != (
                self.files.sizes[number], self.files.mtimes[number], self.files.ctimes[number]):
            raise _Changed("changed while it was being read")
