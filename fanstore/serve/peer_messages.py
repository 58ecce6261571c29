"""The messages ranks exchange for blobs (asked by remote_blobs.py, answered by transport.py),
and what one rank counts of them, per peer. docs/SERVE.md, "Peer requests", has the table.

A request names up to MAX_BLOBS blobs: the first in the 32-byte header, each further one in 20 bytes after it. Its
reply carries every blob one after the other (OK); or, to a request for several of which the peer could not give
some, a status byte a blob, the blobs that came and why the first other one failed (PARTIAL); or no blob and a
reason. The asker posts its receive before the reply is known, so every reply fits in reply_room. The statuses,
and the error an asker makes of each, are statuses.py's (shared with the node endpoint's replies).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

from ..core.chunk_source import BlobRead
from .statuses import Status, status_error

TAG_REQUEST = 1
FIRST_REPLY_TAG = 16  # reply tags run from here to the library's TAG_UB, one range for every request of a rank
# (remote_blobs.py), which wraps
REQUEST = struct.Struct("<4sIIIQQ")  # magic, reply tag, chunk, flags, offset, length
REQUEST_MAGIC = b"FSRQ"
MORE_BLOB = struct.Struct("<IQQ")  # chunk, offset, length: each further blob of a request that asks for several
MAX_BLOBS = 64  # blobs one request may ask for: the reply carries them one after the other
# Request flags 1 and 2 (ring the asker's event loop, ring nobody) are retired: they served an event loop that
# completed its own requests, before remote_blobs.py. A request that sets them is answered as any other.
PING = 4  # request flag: no blob; the reply, OK and empty, says the rank is there (lifecycle.PeerWatch)
TAG_VERDICT = 4  # from rank 0, once it gives up on lost ranks: the job's status and why (VERDICT, then the reason)
VERDICT = struct.Struct("<4si")  # magic, status
VERDICT_MAGIC = b"FSVD"
REPLY_HEADER = struct.Struct("<4sI")  # magic, status; the blobs, some of them (PARTIAL) or a UTF-8 reason follow
REPLY_MAGIC = b"FSRP"
_OK, _PARTIAL = Status.OK.value, Status.PARTIAL.value  # plain ints, compared once a reply
_NO_BLOB = frozenset(int(status) for status in Status) - {_OK, _PARTIAL}  # a reply of these carries a reason alone
# Room for a reason in any reply, however few bytes were asked: the asker's receive is posted before the reply is
# known, and a reply longer than it would fail in MPI itself (a 5-byte blob found corrupt has a 150-byte reason).
REASON_ROOM = 1024


@dataclass
class PeerCounters:
    """What went between this rank and one peer, as --stats prints it."""

    fetched: int = 0  # blobs this rank got from the peer
    fetched_bytes: int = 0
    asked: int = 0  # requests this rank sent the peer: one may ask for several blobs
    served: int = 0  # blobs this rank sent to the peer
    served_bytes: int = 0
    failed: int = 0  # blobs of ours whose request timed out, was refused or found the peer skipped
    refused: int = 0  # malformed requests from the peer


def reply_room(length: int, blobs: int = 1) -> int:
    """Bytes to receive a reply into, for a request of `blobs` blobs of `length` bytes in all: the blobs, or a
    reason, and room for a status per blob (a reply that carries some of them)."""
    return REPLY_HEADER.size + blobs + max(length, REASON_ROOM)


def error_reply(status: int, reason: str) -> bytes:
    """A reply that carries no blobs: the status and the reason, cut to fit any asker's receive."""
    return REPLY_HEADER.pack(REPLY_MAGIC, status) + reason.encode()[:REASON_ROOM]


def request_message(tag: int, flags: int, reads: Sequence[BlobRead]) -> bytes:
    """A request for `reads` (1 to MAX_BLOBS blobs of one peer): the first in the header, the others after it."""
    first = reads[0]
    message = REQUEST.pack(REQUEST_MAGIC, tag, first.chunk_id, flags, first.offset, first.length)
    if len(reads) == 1:
        return message
    return message + b"".join([MORE_BLOB.pack(read.chunk_id, read.offset, read.length) for read in reads[1:]])


def partial_reply(statuses: bytes, parts: list[bytes], reason: str, blobs_bytes: int) -> bytes:
    """The reply to a request for several blobs of which some failed (`statuses`, one a blob, OK for each of
    `parts`): the statuses, the blobs that came, and the reason the first failed one did not, cut to what the
    asker's receive still holds (reply_room of the `blobs_bytes` asked)."""
    room = reply_room(blobs_bytes, len(statuses)) - REPLY_HEADER.size - len(statuses) - sum(map(len, parts))
    return b"".join([REPLY_HEADER.pack(REPLY_MAGIC, _PARTIAL), statuses, *parts, reason.encode()[:max(0, room)]])


def hand_out_reply(peer: int, reads: Sequence[BlobRead], buffer: Any, count: int, counters: PeerCounters,
                   copy: bool = False) -> None:
    """Give each read its blob from a reply of `count` bytes in `buffer` (any bytes-like object; views of it, or bytes
    with `copy`), or the error the peer's status stands for (statuses.status_error: the reader reads the blob
    elsewhere, DEST); counted blob by blob.

    The reply carries every blob one after the other (OK); or some of them (PARTIAL: a status a blob, then the
    blobs that came, then why the first one that did not failed); or no blob and a reason (any other status)."""
    header, blobs = REPLY_HEADER.size, len(reads)
    magic, code = REPLY_HEADER.unpack_from(buffer) if count >= header else (b"", -1)
    statuses, start, fits = None, header, False
    if magic == REPLY_MAGIC and code == _OK:
        fits = count == header + sum(read.length for read in reads)
    elif magic == REPLY_MAGIC and code == _PARTIAL and blobs > 1 and count >= header + blobs:
        statuses, start = bytes(buffer[header : header + blobs]), header + blobs
        fits = count >= start + sum(read.length for read, status in zip(reads, statuses) if status == _OK)
    if not fits:
        counters.failed += blobs
        asked = f"chunk {reads[0].chunk_id} at {reads[0].offset}" if blobs == 1 else f"a request for {blobs} blobs"
        if magic == REPLY_MAGIC and code in _NO_BLOB:  # the reason follows (it names the blob)
            reason, answerer = _text(buffer[header:count]), f"rank {peer}"
        else:
            reason, answerer, code = f"rank {peer} sent a malformed reply ({count} bytes) to {asked}", "", -1
        for read in reads:
            read.done(None, status_error(code, reason, read.chunk_id, answerer, asked))
        return
    view = memoryview(buffer)
    reason: str | None = None  # why the first blob that did not come failed: the reply's last bytes
    for number, read in enumerate(reads):
        if statuses is None or statuses[number] == _OK:
            blob = view[start : start + read.length]
            start += read.length
            counters.fetched += 1
            counters.fetched_bytes += read.length
            read.done(bytes(blob) if copy else blob, None)
            continue
        counters.failed += 1
        first = reason is None
        if first:
            carried = sum(other.length for other, status in zip(reads, statuses) if status == _OK)
            reason = _text(buffer[header + blobs + carried : count])
        read.done(None, status_error(statuses[number], reason if first else "", read.chunk_id, f"rank {peer}",
                                     f"chunk {read.chunk_id} at {read.offset}"))


def _text(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", "replace")
