"""The node socket's wire format (docs/SERVE.md, "The node's own readers"), and the one place that checks what a
reader sends on it: every field of a request and every row of a plan is range-checked before anything uses it, and
a value out of range is refused with a reason that names the field.

Little-endian. A request: REQUEST (magic FSNQ, kind, chunk, offset, length) and, for PLAN and READS, `length` rows
of PLAN_ROW (chunk, offset, stored length, int64). A reply: REPLY (magic FSNP, status, payload length) and the
payload: the blob, the node's description (HELLO, JSON), its readers' counters (STATS, JSON), or a UTF-8 reason
(status not OK; TURNED_AWAY: the connection's, closed after it, whatever it asked); for READS, one READS_ROW
(status, length) per blob asked, then each one's bytes (its blob, or the reason it failed) in the order asked.
ARENA's reply carries the node's shared memory (blob_arena.py) as a descriptor (SCM_RIGHTS) beside its JSON size;
READS_SHARED asks as READS does, `chunk` counting the tokens given back (u64 each, after the rows), and its reply is
the token of the blobs it lends (0: none), one SHARED_ROW (status, length, place in the arena or -1) per blob, then
the bytes of those not lent (a blob, or a reason), in order.
COUNTS carries READ_COUNTS after its header (`length` its size) and is answered OK and empty.

Imports nothing of MPI: the node's readers (DataLoader workers) import it too.
"""

from __future__ import annotations

import struct

import numpy as np

from .placement import BlobTable
from .statuses import RequestRefused, Status

REQUEST = struct.Struct("<4sIIQQ")  # magic, kind, chunk, offset, length (PLAN: rows that follow)
REPLY = struct.Struct("<4sIQ")  # magic, status, payload length
REQUEST_MAGIC, REPLY_MAGIC = b"FSNQ", b"FSNP"
HELLO, READ, PLAN, STATS, READS, ARENA, READS_SHARED, COUNTS = 1, 2, 3, 4, 5, 6, 7, 8
KIND_NAMES = {HELLO: "HELLO", READ: "READ", PLAN: "PLAN", STATS: "STATS", READS: "READS", ARENA: "ARENA",
              READS_SHARED: "READS_SHARED", COUNTS: "COUNTS"}
OK, REFUSED, UNAVAILABLE, CORRUPT = Status.OK, Status.REFUSED, Status.UNAVAILABLE, Status.CORRUPT  # as a peer's
TURNED_AWAY = Status.TURNED_AWAY  # the connection, not the request: closed after the reason, whatever was asked
PLAN_ROW = np.dtype([("chunk", "<i8"), ("offset", "<i8"), ("length", "<i8")])
READS_ROW = np.dtype([("status", "<u4"), ("length", "<u8")])  # of each blob a READS asked for, in its reply
SHARED_ROW = np.dtype([("status", "<u4"), ("unused", "<u4"), ("length", "<u8"), ("place", "<i8")])  # READS_SHARED's
# COUNTS: what a reader read without the serve process since its last COUNTS (local blobs and bytes, DEST blobs and
# bytes), `length` its bytes; for --stats. Each value below 2^53, so that the totals stay exact in JSON.
READ_COUNTS = struct.Struct("<QQQQ")
TOKEN = struct.Struct("<Q")  # a READS_SHARED reply's lending; tokens given back follow a READS_SHARED's rows
# What one READS may ask for: a DataLoader batch's remote blobs, or a prefetch window's, in one round trip; the serve
# process holds them all until the reply is sent.
READS_MAX_BLOBS = 4096
READS_MAX_BYTES = 64 << 20
FEW_ROWS = 64  # a request of at most this many rows is looked up in Python ints (BlobLookup._few_rows)
# Tokens one READS_SHARED may give back, and what a connection may hold lent at once (more goes through the socket).
MAX_RETURNED = 4096
LENT_MAX_BYTES = 4 * READS_MAX_BYTES
# ARENA's refusal by a node without an arena: an answer (the reader asks READS), not a connection turned away.
NO_ARENA = "this node has no shared arena: ask READS"


class Refused(RequestRefused):
    """A request the node does not take; the message names the field at fault. `fatal`: what follows the request
    on its connection cannot be told apart from it any more, so the connection is closed after the reply."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class BlobLookup:
    """The dataset's blobs as a node's readers may name them: each field checked against the dataset (a chunk it
    has, an offset inside that chunk's blobs, a length from 1 to its largest blob), then (chunk, offset, length)
    found as one row of the BlobTable, for a READ or for a plan's rows at once (vectorised: a plan of a million rows
    costs milliseconds and no Python object per row).

    A blob's key is its position in the chunks' blob bytes laid end to end (its chunk's base plus its offset):
    sorted as the table is, so one searchsorted finds every row. 8 bytes per blob, made once."""

    def __init__(self, blobs: BlobTable, chunk_count: int) -> None:
        self.blobs = blobs
        self.chunk_count = chunk_count
        chunks = blobs.chunk.astype(np.int64)
        offsets = blobs.offset.astype(np.int64)  # an index checked at open keeps blobs inside chunks of < 2^62 bytes
        ends = np.zeros(chunk_count, dtype=np.int64)
        np.maximum.at(ends, chunks, offsets + blobs.stored_len.astype(np.int64))
        self._chunk_ends = ends  # where the last blob of each chunk ends: no blob starts at or past it
        self._bases = np.cumsum(ends) - ends
        self._keys = self._bases[chunks] + offsets
        self._end_list: list[int] = ends.tolist()  # a READ's checks, in Python ints: per blob, no numpy call
        self._base_list: list[int] = self._bases.tolist()
        self.largest = int(blobs.stored_len.max()) if len(blobs) else 0
        # A plan keeps blob rows: 4 bytes each below 2^31 blobs.
        self.row_dtype = np.dtype(np.int32) if len(blobs) < (1 << 31) else np.dtype(np.int64)

    def __len__(self) -> int:
        return len(self.blobs)

    def read_row(self, chunk: int, offset: int, length: int) -> int:
        """The row of the blob a READ names; Refused, naming the field, for anything else. Scalar arithmetic: a
        READ comes per remote blob."""
        if not 0 <= chunk < self.chunk_count:
            raise Refused(self._bad_chunk("", chunk))
        end = self._end_list[chunk]
        if not 0 <= offset < end:
            raise Refused(self._bad_offset("", chunk, offset, end))
        if not 1 <= length <= self.largest:
            raise Refused(self._bad_length("", length))
        key = self._base_list[chunk] + offset
        row = int(self._keys.searchsorted(key))
        if (row == len(self._keys) or self._keys[row] != key
                or (row + 1 < len(self._keys) and self._keys[row + 1] == key)
                or int(self.blobs.stored_len[row]) != length):
            raise Refused(f"no blob of {length} bytes at offset {offset} of chunk {chunk}")
        return row

    def plan_rows(self, rows: np.ndarray, first: int, what: str = "plan row") -> np.ndarray:
        """Each plan row's blob row in the table (-1 where no blob is exactly there: a row inside a blob, between
        blobs); Refused at the first row with a field out of range, naming the row (`what`, numbered from `first`)
        and the field."""
        if len(rows) <= FEW_ROWS:
            return self._few_rows(rows, first, what)
        chunks, offsets, lengths = rows["chunk"], rows["offset"], rows["length"]
        bad_chunk = (chunks < 0) | (chunks >= self.chunk_count)
        safe_chunks = np.where(bad_chunk, 0, chunks)
        ends = self._chunk_ends[safe_chunks] if self.chunk_count else np.zeros(len(rows), dtype=np.int64)
        bad_offset = ~bad_chunk & ((offsets < 0) | (offsets >= ends))
        bad_length = (lengths < 1) | (lengths > self.largest)
        bad = bad_chunk | bad_offset | bad_length
        if bad.any():
            number = int(np.flatnonzero(bad)[0])
            chunk, offset, length = int(chunks[number]), int(offsets[number]), int(lengths[number])
            prefix = f"{what} {first + number}: "
            if bad_chunk[number]:
                raise Refused(self._bad_chunk(prefix, chunk))
            if bad_offset[number]:
                raise Refused(self._bad_offset(prefix, chunk, offset, int(ends[number])))
            raise Refused(self._bad_length(prefix, length))
        keys = self._bases[chunks] + offsets
        found = np.minimum(np.searchsorted(self._keys, keys), max(len(self._keys) - 1, 0))
        if not len(self._keys):
            return np.full(len(rows), -1, dtype=np.int64)
        # Exactly one blob there (a crafted index may put two at one offset: neither is served), of that length.
        following = np.minimum(found + 1, len(self._keys) - 1)
        alone = (following == found) | (self._keys[following] != keys)
        match = (self._keys[found] == keys) & alone & (self.blobs.stored_len[found].astype(np.int64) == lengths)
        return np.where(match, found, -1)

    def _few_rows(self, rows: np.ndarray, first: int, what: str) -> np.ndarray:
        """plan_rows of a request of a few rows (a DataLoader batch's remote blobs), checked in Python ints with
        one searchsorted: numpy's cost per call, a dozen masks over a few rows, was most of such a request's cost."""
        keys: list[int] = []
        for number, (chunk, offset, length) in enumerate(rows.tolist()):
            if not 0 <= chunk < self.chunk_count:
                raise Refused(self._bad_chunk(f"{what} {first + number}: ", chunk))
            end = self._end_list[chunk]
            if not 0 <= offset < end:
                raise Refused(self._bad_offset(f"{what} {first + number}: ", chunk, offset, end))
            if not 1 <= length <= self.largest:
                raise Refused(self._bad_length(f"{what} {first + number}: ", length))
            keys.append(self._base_list[chunk] + offset)
        found = np.full(len(keys), -1, dtype=np.int64)
        table_keys, stored_len, count = self._keys, self.blobs.stored_len, len(self._keys)
        for number, (row, key, length) in enumerate(zip(table_keys.searchsorted(keys).tolist(), keys,
                                                        rows["length"].tolist())):
            # Exactly one blob there (a crafted index may put two at one offset: neither is served), of that length.
            if row < count and table_keys[row] == key and (row + 1 == count or table_keys[row + 1] != key) \
                    and stored_len[row] == length:
                found[number] = row
        return found

    def _bad_chunk(self, prefix: str, chunk: int) -> str:
        return f"{prefix}chunk {chunk}: the dataset's chunks are 0 to {self.chunk_count - 1}"

    @staticmethod
    def _bad_offset(prefix: str, chunk: int, offset: int, end: int) -> str:
        return f"{prefix}offset {offset} of chunk {chunk}: " + \
            ("negative" if offset < 0 else f"past the end of the chunk's blobs ({end})")

    def _bad_length(self, prefix: str, length: int) -> str:
        return f"{prefix}length {length}: a blob of this dataset is 1 to {self.largest} bytes long"

    def locate(self, row: int) -> tuple[int, int, int]:
        """(chunk, offset, stored length) of the table's `row`."""
        return int(self.blobs.chunk[row]), int(self.blobs.offset[row]), int(self.blobs.stored_len[row])
