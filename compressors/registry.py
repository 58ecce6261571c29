"""Spec string -> codec. The table of codec types is read-only: a codec is added here, in one line, not at run time."""

from __future__ import annotations

import types
from typing import Mapping

from .base import Codec, CodecSpecError
from .blosc_codec import BloscCodec
from .lz4_codec import Lz4Codec
from .null_codec import NullCodec
from .zstd_codec import ZstdCodec, ZstdDictCodec

CODEC_TYPES: Mapping[str, type[Codec]] = types.MappingProxyType(
    {codec_type.name: codec_type for codec_type in (NullCodec, ZstdCodec, Lz4Codec, BloscCodec, ZstdDictCodec)}
)


def codec_from_spec(spec: str, dictionary: bytes | None = None) -> Codec:
    """The codec a spec string names (`zstd:3`, `lz4:hc:9`, `blosc:lz4:5:shuffle:auto`, ...).

    `dictionary` is for codecs that need one (zstd-dict) and refused for the others, so a codec table that pairs
    a dictionary with the wrong codec is caught. A bad spec raises CodecSpecError naming the spec.
    """
    known = ", ".join(sorted(CODEC_TYPES))
    if not isinstance(spec, str):
        raise CodecSpecError(f"a codec spec must be a string, got {spec!r} (known codecs: {known})")
    name, *fields = spec.strip().split(":")
    codec_type = CODEC_TYPES.get(name)
    if codec_type is None:
        what = "empty codec name" if not name else f"unknown codec {name!r}"
        raise CodecSpecError(f"{what} in spec {spec!r} (known: {known})")
    if dictionary is not None and not codec_type.needs_dictionary:
        raise CodecSpecError(f"codec {name!r} takes no dictionary, but one was given with spec {spec!r}")
    try:
        return codec_type.from_spec_fields(fields, dictionary)
    except CodecSpecError as exc:
        raise CodecSpecError(f"{exc} in spec {spec!r}") from None
