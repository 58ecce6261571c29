"""`none`: stored bytes are the raw bytes. Row 0 of every codec table, used for blobs that do not shrink."""

from __future__ import annotations

from typing import Any

from .base import BytesLike, Codec, CodecError, check_field_count, check_raw_size


class NullCodec(Codec):
    """Stores files as they are; decoding only checks the length, since there is nothing else to check."""

    codec_id = 0
    name = "none"

    @property
    def spec(self) -> str:
        return "none"

    def params(self) -> dict[str, Any]:
        return {}

    def encode(self, data: BytesLike) -> bytes:
        return bytes(data)

    def decode(self, stored: BytesLike, raw_size: int) -> bytes:
        check_raw_size(raw_size)
        raw = bytes(stored)
        if len(raw) != raw_size:
            raise CodecError(f"none: stored {len(raw)} bytes, expected {raw_size}")
        return raw

    @classmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> NullCodec:
        check_field_count(cls, fields, 0)
        return cls()

    def _init_kwargs(self) -> dict[str, Any]:
        return {}
