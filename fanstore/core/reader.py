"""The read path: entry -> chunk source -> verify checksum -> decode. The API and the mount both read through it."""

from __future__ import annotations

import os
import stat
from typing import Sequence

import xxhash

from compressors import Codec, CodecError, codec_from_spec

from .chunk_source import ChunkSource
from ..errors import (ChunkCorrupt, ChunkError, ChunkUnavailable, FanstoreError, FormatError, IsADirectory, UsageError,
                     quoted, shown_path)
from .format import FLAG_BLOCKED, NO_CHUNK, chunk_file_name, fields_view
from .index import Index, file_identity

_checksum = xxhash.xxh3_64_intdigest
# The fields a read needs, by name, in this order (format.fields_view): of an entry, and of a block.
_READ_FIELDS = ("size", "offset", "stored_len", "checksum", "mode", "chunk", "codec", "flags")
_BLOCK_FIELDS = ("offset", "checksum", "chunk", "stored_len", "codec")


def build_codecs(index: Index) -> list[Codec]:
    """The codec table of an index as codec objects, built once at open (dictionaries loaded once)."""
    codecs = []
    for number, row in enumerate(index.codecs):
        dictionary = index.dictionaries.get(row["dictionary"]) if row.get("dictionary") else None
        try:
            codec = codec_from_spec(row["spec"], dictionary=dictionary)
        except CodecError as exc:
            raise FormatError(f"{index.path}: codecs[{number}]: {exc}") from None
        if codec.needs_dictionary and dictionary is None:
            raise FormatError(f"{index.path}: codecs[{number}].dictionary: {quoted(row['spec'])} decodes with a "
                              "dictionary, and the row names none")
        if codec.codec_id != row["id"]:
            raise FormatError(f"{index.path}: codec {quoted(row['spec'])} has id {row['id']}, expected "
                              f"{codec.codec_id}")
        codecs.append(codec)
    return codecs


class Reader:
    """Reads files, or blocks of files stored in blocks, by entry number. Thread-safe: it holds no per-read state.

    A file stored whole is one blob; a file stored in blocks (format 1.1) is one blob per `block_size` raw bytes,
    each decodable alone, so a read at any offset needs only the blocks it touches.
    """

    def __init__(self, index: Index, source: ChunkSource) -> None:
        self.index = index
        self.source = source
        self.codecs = build_codecs(index)
        self.block_size = index.block_size
        self._entries = index.entries
        self._read_rows = fields_view(index.entries, *_READ_FIELDS)
        self._block_rows = fields_view(index.blocks, *_BLOCK_FIELDS)

    def read(self, entry: int) -> bytes:
        """The original bytes of a regular file, whole."""
        size, offset, stored_len, checksum, mode, chunk, codec, flags = self._read_rows[entry].item()
        if not stat.S_ISREG(mode):
            raise IsADirectory(f"{quoted(self.index.path_of(entry))} is not a regular file")
        if size == 0:
            return b""
        if flags & FLAG_BLOCKED:
            return b"".join(self.read_block(entry, block) for block in range(self.index.block_count(entry)))
        stored = self._fetch(entry, -1, chunk, offset, stored_len, checksum)
        return self._decode(entry, -1, stored, codec, size, chunk, offset)

    def read_many(self, entries: Sequence[int]) -> list[bytes | FanstoreError]:
        """`read` of several files, each one's bytes or the error its `read` would raise: the blobs of the files
        stored whole are asked of the source together (ChunkSource.read_many: one round trip to the node's serve
        process for a DataLoader batch), then each is verified and decoded as `read` does."""
        results: list[bytes | FanstoreError | None] = [None] * len(entries)
        whole: list[tuple[int, int, int, int, int, int, int, int]] = []
        for number, entry in enumerate(entries):
            size, offset, stored_len, checksum, mode, chunk, codec, flags = self._read_rows[entry].item()
            if stat.S_ISREG(mode) and size > 0 and not flags & FLAG_BLOCKED:
                whole.append((number, entry, size, offset, stored_len, checksum, chunk, codec))
                continue
            try:
                results[number] = self.read(entry)
            except FanstoreError as exc:
                results[number] = exc
        fetched = self.source.read_many([(chunk, offset, stored_len)
                                         for _, _, _, offset, stored_len, _, chunk, _ in whole]) if whole else []
        for (number, entry, size, offset, stored_len, checksum, chunk, codec), stored in zip(whole, fetched):
            try:
                stored = self._checked(stored, entry, -1, chunk, offset, stored_len, checksum)
                results[number] = self._decode(entry, -1, stored, codec, size, chunk, offset)
            except FanstoreError as exc:
                results[number] = exc
        return results  # type: ignore[return-value]

    def read_block(self, entry: int, block: int) -> bytes:
        """The original bytes of one block of a file stored in blocks: `block_size` bytes, the last one fewer."""
        offset, checksum, chunk, stored_len, codec = self._block_row(entry, block)
        stored = self._fetch(entry, block, chunk, offset, stored_len, checksum)
        size = int(self._entries[entry]["size"])
        raw_size = min(self.block_size, size - block * self.block_size)
        return self._decode(entry, block, stored, codec, raw_size, chunk, offset)

    def load(self, key: int | tuple[int, int]) -> bytes:
        """A decoded-cache loader: an entry number is a whole file, (entry, block) one block of a file."""
        return self.read(key) if type(key) is int else self.read_block(*key)  # type: ignore[misc]

    def read_stored(self, entry: int, block: int = -1) -> bytes:
        """The stored (compressed) blob of a file stored whole, or of one block, checksum-verified: what a peer
        node is sent."""
        if block >= 0:
            offset, checksum, chunk, stored_len, _ = self._block_row(entry, block)
        else:
            _, offset, stored_len, checksum, _, chunk, _, flags = self._read_rows[entry].item()
            if flags & FLAG_BLOCKED:
                raise UsageError(f"{quoted(self.index.path_of(entry))} is stored in blocks: ask for one block")
            if chunk == NO_CHUNK:
                return b""
        return self._fetch(entry, block, chunk, offset, stored_len, checksum)

    def _block_row(self, entry: int, block: int) -> tuple[int, int, int, int, int]:
        """(offset, checksum, chunk, stored_len, codec) of one block of a file stored in blocks."""
        rows = self.index.block_rows(entry)
        if not 0 <= block < len(rows):
            raise UsageError(f"{quoted(self.index.path_of(entry))} has no block {block} (it is stored in {len(rows)})")
        return self._block_rows[rows[block]].item()

    def _packed_again(self) -> str:
        """Why a chunk may not be what this index says although nothing is damaged: its dataset was packed again
        (--force) since it was opened, and the chunks not yet open are the new pack's. An error path only: one stat
        of the index file, whose identity was taken when it was loaded. "" when the index file is still the same."""
        if self.index.file_identity is None:
            return ""
        try:
            now = file_identity(os.stat(self.index.path))
        except OSError:
            now = None
        if now == self.index.file_identity:
            return ""
        return (f" ({self.index.path.parent} was packed again since this dataset was opened: its index file is "
                f"another now, or gone; open the dataset again)")

    def _where(self, entry: int, block: int) -> str:
        return shown_path(self.index.path_of(entry)) + (f" (block {block})" if block >= 0 else "")

    def decode_fetched(self, entry: int, stored: bytes | memoryview) -> bytes | None:
        """A file stored whole, from the stored blob its caller fetched itself (ChunkSource.start_read): verified,
        then decoded, exactly as `read` would. None when the blob fails its checksum (that copy is damaged: the
        caller reads the other, read_other_copy); ChunkCorrupt when a sound blob does not decode (the index is
        wrong: every copy fails alike)."""
        size, offset, stored_len, checksum, _, chunk, codec, _ = self._read_rows[entry].item()
        if _checksum(stored) != checksum:
            return None
        return self._decode(entry, -1, stored, codec, size, chunk, offset)

    def read_other_copy(self, entry: int) -> bytes:
        """A file stored whole whose blob, fetched by its caller, failed its checksum: read from the source's other
        copy (ChunkSource.read_other_copy) once, verified and decoded; ChunkCorrupt if there is no sound one."""
        size, offset, stored_len, checksum, _, chunk, codec, _ = self._read_rows[entry].item()
        stored = self._other_copy(entry, -1, chunk, offset, stored_len, checksum)
        return self._decode(entry, -1, stored, codec, size, chunk, offset)

    def _fetch(self, entry: int, block: int, chunk: int, offset: int, stored_len: int, checksum: int) -> bytes:
        try:
            stored = self.source.read(chunk, offset, stored_len)
        except ChunkError as exc:
            return self._checked(exc, entry, block, chunk, offset, stored_len, checksum)  # raises, naming the file
        if _checksum(stored) != checksum:  # the common case stays inline: a read per file comes this way
            stored = self._other_copy(entry, block, chunk, offset, stored_len, checksum)
        return stored

    def _checked(self, stored: bytes | memoryview | ChunkError, entry: int, block: int, chunk: int, offset: int,
                 stored_len: int, checksum: int) -> bytes:
        """What the source gave for a blob, verified: its error again, now naming the file; bytes that fail their
        checksum replaced by the source's other copy, or ChunkCorrupt."""
        if isinstance(stored, ChunkError):
            raise type(stored)(f"{self._where(entry, block)}: {stored}{self._packed_again()}",
                               path=self.index.path_of(entry),
                               chunk_id=chunk) from None
        if _checksum(stored) != checksum:
            stored = self._other_copy(entry, block, chunk, offset, stored_len, checksum)
        return stored  # type: ignore[return-value]

    def _other_copy(self, entry: int, block: int, chunk: int, offset: int, stored_len: int, checksum: int) -> bytes:
        """The blob the source gave failed its checksum: the source's other copy of it, if it keeps one (a node's
        staged chunk has DEST behind it) and that one is sound; else the file is corrupt."""
        try:
            stored = self.source.read_other_copy(chunk, offset, stored_len)
        except ChunkError:
            stored = None
        if stored is None or _checksum(stored) != checksum:
            raise self._corrupt(entry, block, chunk, offset, stored_len) from None
        return stored

    def _corrupt(self, entry: int, block: int, chunk: int, offset: int, stored_len: int) -> ChunkCorrupt:
        return ChunkCorrupt(f"{self._where(entry, block)}: checksum mismatch in chunk {chunk} "
                            f"({chunk_file_name(chunk)} at offset {offset:,}, {stored_len:,} bytes)"
                            f"{self._packed_again()}",
                            path=self.index.path_of(entry), chunk_id=chunk)

    def _decode(self, entry: int, block: int, stored: bytes, codec: int, raw_size: int, chunk: int,
                offset: int) -> bytes:
        try:
            return self.codecs[codec].decode(stored, raw_size)
        except CodecError as exc:
            raise ChunkCorrupt(f"{self._where(entry, block)}: cannot decode blob in chunk {chunk} "
                               f"({chunk_file_name(chunk)} at offset {offset}): {exc}{self._packed_again()}",
                               path=self.index.path_of(entry), chunk_id=chunk) from None
        except MemoryError:
            raise ChunkUnavailable(f"{self._where(entry, block)}: not enough memory to decode {raw_size} bytes",
                                   path=self.index.path_of(entry), chunk_id=chunk) from None
