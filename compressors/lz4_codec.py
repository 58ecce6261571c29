"""`lz4` and `lz4:hc[:LEVEL]`: the fastest decoding, for data read many times per epoch.

Each file is one LZ4 block without a size prefix (the index holds the raw size); files over 1 GiB are stored as
segments, because an LZ4 block cannot hold 2 GiB.
"""

from __future__ import annotations

from typing import Any

import lz4.block

from .base import (
    SEGMENT_SIZE,
    BytesLike,
    CodecError,
    CodecSpecError,
    SegmentedCodec,
    check_field_count,
    check_int,
    encode_segments,
    int_field,
)

MIN_HC_LEVEL = 1
MAX_HC_LEVEL = 12
DEFAULT_HC_LEVEL = 9


class Lz4Codec(SegmentedCodec):
    """LZ4 block format: the default (fast) mode when `hc_level` is None, else high compression at that level."""

    codec_id = 2
    name = "lz4"

    def __init__(self, hc_level: int | None = None, *, segment_size: int = SEGMENT_SIZE) -> None:
        super().__init__(segment_size)
        self.hc_level = None if hc_level is None else check_int(hc_level, "lz4 hc level", MIN_HC_LEVEL, MAX_HC_LEVEL)

    @property
    def spec(self) -> str:
        return "lz4" if self.hc_level is None else f"lz4:hc:{self.hc_level}"

    def params(self) -> dict[str, Any]:
        return {"mode": "default"} if self.hc_level is None else {"mode": "hc", "level": self.hc_level}

    def encode(self, data: BytesLike) -> bytes:
        return encode_segments(data, self.segment_size, self._encode_block)

    def _encode_block(self, block: memoryview) -> bytes:
        try:
            if self.hc_level is None:
                return lz4.block.compress(block, mode="default", store_size=False)
            return lz4.block.compress(block, mode="high_compression", compression=self.hc_level, store_size=False)
        except (lz4.block.LZ4BlockError, ValueError, OverflowError) as exc:
            raise CodecError(f"{self.spec}: cannot encode {len(block)} bytes: {exc}") from exc

    def _decode_block(self, block: memoryview, raw_size: int) -> bytes:
        try:
            # The size is an upper bound to LZ4: a block that decodes shorter is caught by the caller's length check.
            return lz4.block.decompress(block, uncompressed_size=raw_size)
        except (lz4.block.LZ4BlockError, ValueError, OverflowError) as exc:
            raise CodecError(f"{self.spec}: cannot decode {len(block)} stored bytes into {raw_size}: {exc}") from exc

    @classmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> Lz4Codec:
        check_field_count(cls, fields, 2)
        if not fields:
            return cls()
        if fields[0] != "hc":
            raise CodecSpecError(f"lz4 mode must be 'hc' or left out for the default mode, got {fields[0]!r}")
        if len(fields) == 1:
            return cls(DEFAULT_HC_LEVEL)
        return cls(int_field(fields[1], "lz4 hc level", MIN_HC_LEVEL, MAX_HC_LEVEL))

    def _init_kwargs(self) -> dict[str, Any]:
        return {"hc_level": self.hc_level, "segment_size": self.segment_size}
