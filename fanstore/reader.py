"""The read path: entry -> chunk source -> verify checksum -> decode. The API and the mount both read through it."""

from __future__ import annotations

import stat

import xxhash

from compressors import Codec, CodecError, codec_from_spec

from .chunk_source import ChunkSource
from .errors import ChunkCorrupt, ChunkError, FormatError, IsADirectory
from .format import NO_CHUNK, chunk_file_name
from .index import Index

_checksum = xxhash.xxh3_64_intdigest


def build_codecs(index: Index) -> list[Codec]:
    """The codec table of an index as codec objects, built once at open (dictionaries loaded once)."""
    codecs = []
    for row in index.codecs:
        dictionary = index.dictionaries.get(row["dictionary"]) if row.get("dictionary") else None
        try:
            codec = codec_from_spec(row["spec"], dictionary=dictionary)
        except CodecError as exc:
            raise FormatError(f"{index.path}: codec table: {exc}") from None
        if codec.codec_id != row["id"]:
            raise FormatError(f"{index.path}: codec {row['spec']!r} has id {row['id']}, expected {codec.codec_id}")
        codecs.append(codec)
    return codecs


class Reader:
    """Reads whole files by entry number. Thread-safe: it holds no per-read state."""

    def __init__(self, index: Index, source: ChunkSource) -> None:
        self.index = index
        self.source = source
        self.codecs = build_codecs(index)
        self._entries = index.entries

    def read_stored(self, entry: int) -> bytes:
        """The stored (compressed) blob of a file, checksum-verified: what a peer node is sent."""
        _, size, _, offset, stored_len, checksum, _, mode, chunk, _, _, _ = self._entries[entry].item()
        if chunk == NO_CHUNK:
            return b""
        try:
            stored = self.source.read(chunk, offset, stored_len)
        except ChunkError as exc:  # the same kind of error, now naming the file too
            raise type(exc)(f"{self.index.path_of(entry)}: {exc}", path=self.index.path_of(entry),
                            chunk_id=chunk) from None
        if _checksum(stored) != checksum:
            raise ChunkCorrupt(
                f"{self.index.path_of(entry)}: checksum mismatch in chunk {chunk} "
                f"({chunk_file_name(chunk)} at offset {offset}, {stored_len} bytes)",
                path=self.index.path_of(entry),
                chunk_id=chunk,
            )
        return stored

    def read(self, entry: int) -> bytes:
        """The original bytes of a regular file."""
        _, size, _, offset, stored_len, _, _, mode, chunk, _, codec, _ = self._entries[entry].item()
        if not stat.S_ISREG(mode):
            raise IsADirectory(f"{self.index.path_of(entry)!r} is not a regular file")
        if size == 0:
            return b""
        stored = self.read_stored(entry)
        try:
            return self.codecs[codec].decode(stored, size)
        except CodecError as exc:
            raise ChunkCorrupt(
                f"{self.index.path_of(entry)}: cannot decode blob in chunk {chunk} "
                f"({chunk_file_name(chunk)} at offset {offset}): {exc}",
                path=self.index.path_of(entry),
                chunk_id=chunk,
            ) from None
