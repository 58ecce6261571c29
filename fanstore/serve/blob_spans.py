"""Spans of whole blobs: what staging moves in one read of DEST and one message to a peer, and checks as it
arrives, against each blob's checksum and, where a span starts its chunk, the chunk's header (no blob holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..core.format import CHUNK_HEADER_LEN, check_chunk_header
from ..errors import FormatError
from .placement import BlobTable

SPAN_BYTES = 8 << 20  # one read from DEST, one message to a peer: whole blobs, about this many bytes


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [start, end) of a chunk moved in one read and one message: whole blobs (and the header from 0)."""

    chunk: int
    start: int
    end: int


def spans_of(blobs: BlobTable, chunk: int, start: int, end: int, span_bytes: int = SPAN_BYTES) -> list[Span]:
    """[start, end) of `chunk` cut at blob boundaries into spans of about `span_bytes` (a larger blob alone)."""
    rows = blobs.in_range(chunk, start, end)
    offsets = blobs.offset[rows].astype(np.int64)
    spans = []
    span_start = start
    for offset in offsets.tolist():
        if offset - span_start >= span_bytes:
            spans.append(Span(chunk, span_start, offset))
            span_start = offset
    if end > span_start:
        spans.append(Span(chunk, span_start, end))
    return spans


def header_problem(span: Span, data: bytes | memoryview, what: Path) -> str | None:
    """Why the chunk header at the start of `span` is not one a reader takes (format.check_chunk_header: magic,
    version, chunk id), naming `what`; None when it is, or when the span does not start the chunk. No blob holds
    the header, so its checksums never cover it."""
    if span.start != 0:
        return None
    try:
        check_chunk_header(bytes(data[:CHUNK_HEADER_LEN]), span.chunk, what)
    except FormatError as exc:
        return str(exc)
    return None


def check_span(blobs: BlobTable, span: Span, data: bytes | memoryview) -> list[int]:
    """Offsets of the blobs in `span` whose bytes in `data` do not match their checksum."""
    rows = blobs.in_range(span.chunk, span.start, span.end)
    view = memoryview(data)
    bad = []
    for offset, length, checksum in zip(blobs.offset[rows].tolist(), blobs.stored_len[rows].tolist(),
                                        blobs.checksum[rows].tolist()):
        at = offset - span.start
        if xxhash.xxh3_64_intdigest(view[at : at + length]) != checksum:
            bad.append(offset)
    return bad
