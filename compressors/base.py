"""The codec interface every compressor implements, its errors, and the segment framing shared by LZ4 and blosc.

A codec turns one file's bytes into its stored bytes and back. Its `codec_id` and the layout of what it stores are
part of the on-disk format (docs/FORMAT.md); its `spec` string is what the index records to rebuild it.
"""

from __future__ import annotations

import abc
import re
import struct
from typing import Any, Callable

BytesLike = bytes | bytearray | memoryview

# Part of the on-disk format: LZ4 and blosc store a file larger than this as segments of this many raw bytes.
SEGMENT_SIZE = 1 << 30
_SEGMENT_LEN = struct.Struct("<I")  # stored length of the block that follows
_INT_FIELD = re.compile(r"-?[0-9]+\Z")  # no '+', '_', spaces or non-ASCII digits, which int() would take


class CodecError(Exception):
    """A codec cannot encode or decode what it was given (corrupt stored bytes, missing dictionary, bad spec)."""


class CodecSpecError(CodecError, ValueError):
    """A codec spec string or parameter is not valid; the message names the spec and what is allowed."""


class Codec(abc.ABC):
    """One compression method with fixed parameters: stateless to callers, safe to share between threads, picklable.

    Subclasses set `codec_id` (stable, written in every index), `name` (the first field of the spec) and, for
    zstd-dict only, `needs_dictionary`; the forms a spec takes are the registry's SPEC_FORMS.
    """

    codec_id: int
    name: str
    needs_dictionary: bool = False

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The canonical spec string; `codec_from_spec(codec.spec)` rebuilds an equal codec."""

    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """The parameters as JSON-able values, for reports and benchmarks."""

    @abc.abstractmethod
    def encode(self, data: BytesLike) -> bytes:
        """The stored bytes of one file's raw bytes."""

    @abc.abstractmethod
    def decode(self, stored: BytesLike, raw_size: int) -> bytes:
        """Exactly `raw_size` raw bytes back from stored bytes, or CodecError: never short, never a library error."""

    def for_file(self, head: BytesLike) -> Codec:
        """The codec that encodes any part of the file whose first bytes are `head` (kinds.HEAD_BYTES of them) as
        `encode` encodes the whole file: itself, unless a setting is read from the file (blosc's `auto` typesize,
        from a .npy header that only the file's first block holds). What it stores decodes with this codec."""
        return self

    @classmethod
    @abc.abstractmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> Codec:
        """The codec for the spec fields after the name; CodecSpecError (without the spec, the registry adds it)."""

    @abc.abstractmethod
    def _init_kwargs(self) -> dict[str, Any]:
        """Constructor arguments that rebuild an equal codec; pickling goes through them so per-thread state and
        precomputed library objects are rebuilt in the receiving process rather than copied."""

    def _key(self) -> tuple[Any, ...]:
        """What equality and hashing compare: the spec, plus any state the spec does not show."""
        return (type(self), self.spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._init_kwargs()))


class SegmentedCodec(Codec):
    """A codec whose library cannot take 2 GiB in one call (LZ4, blosc): files over `segment_size` are segmented.

    Subclasses encode with `encode_segments(data, self.segment_size, ...)` and implement `_decode_block`.

    `segment_size` is part of the format; it is a constructor argument only so tests can reach the multi-segment
    path with small inputs.
    """

    def __init__(self, segment_size: int = SEGMENT_SIZE) -> None:
        self.segment_size = check_int(segment_size, "segment size", 1, SEGMENT_SIZE)

    @abc.abstractmethod
    def _decode_block(self, block: memoryview, raw_size: int) -> bytes:
        """One block's raw bytes (exactly `raw_size`), library errors wrapped in CodecError."""

    def decode(self, stored: BytesLike, raw_size: int) -> bytes:
        return decode_segments(stored, raw_size, self.segment_size, self._decode_block)

    def _key(self) -> tuple[Any, ...]:
        return (type(self), self.spec, self.segment_size)

    def __repr__(self) -> str:
        if self.segment_size == SEGMENT_SIZE:
            return super().__repr__()
        return f"{type(self).__name__}({self.spec!r}, segment_size={self.segment_size})"


def _rebuild(cls: type[Codec], kwargs: dict[str, Any]) -> Codec:
    """Unpickles a codec by calling its constructor (see `Codec._init_kwargs`)."""
    return cls(**kwargs)


def int_field(field: str, what: str, low: int, high: int) -> int:
    """An integer spec field within [low, high], or CodecSpecError quoting the field as written."""
    if _INT_FIELD.match(field) is None or not low <= int(field) <= high:
        raise CodecSpecError(f"{what} must be an integer from {low} to {high}, got {field!r}")
    return int(field)


def check_int(value: Any, what: str, low: int, high: int) -> int:
    """A constructor argument that must be an int within [low, high] (bool is refused: True is not a level)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CodecSpecError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value


def check_field_count(cls: type[Codec], fields: list[str], most: int) -> None:
    """CodecSpecError when a spec has more fields than its grammar allows."""
    if len(fields) > most:
        extra = ":".join(fields[most:])
        raise CodecSpecError(f"unexpected field(s) {extra!r} after {cls.name}")


def check_raw_size(raw_size: int) -> None:
    """A decode target size must be a non-negative int; the index holds it, so a bad one means a corrupt index."""
    if isinstance(raw_size, bool) or not isinstance(raw_size, int) or raw_size < 0:
        raise CodecError(f"raw size must be a non-negative integer, got {raw_size!r}")


def encode_segments(data: BytesLike, segment_size: int, encode_block: Callable[[memoryview], bytes]) -> bytes:
    """Stored bytes for a codec whose library limits its input size.

    Up to `segment_size` raw bytes: one plain block. Larger: (u32 little-endian stored length, block) pairs, each
    block holding `segment_size` raw bytes except the last.
    """
    view = memoryview(data).cast("B")
    if len(view) <= segment_size:
        return encode_block(view)
    parts = []
    for start in range(0, len(view), segment_size):
        block = encode_block(view[start : start + segment_size])
        if len(block) > 0xFFFFFFFF:
            raise CodecError(f"a segment encoded to {len(block)} bytes, more than its u32 length field can hold")
        parts.append(_SEGMENT_LEN.pack(len(block)))
        parts.append(block)
    return b"".join(parts)


def decode_segments(
    stored: BytesLike, raw_size: int, segment_size: int, decode_block: Callable[[memoryview, int], bytes]
) -> bytes:
    """The inverse of `encode_segments`: exactly `raw_size` bytes, or CodecError naming what does not fit.

    `decode_block(block, block_raw_size)` must return `block_raw_size` bytes or raise CodecError.
    """
    check_raw_size(raw_size)
    view = memoryview(stored).cast("B")
    if raw_size <= segment_size:
        return _checked_block(decode_block(view, raw_size), raw_size)
    parts = []
    position = 0
    for start in range(0, raw_size, segment_size):
        block_raw_size = min(segment_size, raw_size - start)
        if position + _SEGMENT_LEN.size > len(view):
            raise CodecError(f"stored bytes end at {len(view)}, inside the length of the segment at raw offset {start}")
        (stored_len,) = _SEGMENT_LEN.unpack_from(view, position)
        position += _SEGMENT_LEN.size
        if position + stored_len > len(view):
            raise CodecError(
                f"segment at raw offset {start} needs {stored_len} stored bytes, only {len(view) - position} left"
            )
        block = decode_block(view[position : position + stored_len], block_raw_size)
        parts.append(_checked_block(block, block_raw_size))
        position += stored_len
    if position != len(view):
        raise CodecError(f"{len(view) - position} stored bytes left over after the last segment")
    return b"".join(parts)


def _checked_block(block: bytes, expected: int) -> bytes:
    if len(block) != expected:
        raise CodecError(f"decoded {len(block)} bytes, expected {expected}")
    return block
