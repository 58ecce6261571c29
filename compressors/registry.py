"""Spec string -> codec. The table of codec types is read-only: a codec is added here, in one line, not at run time.

A codec's module (and the library it wraps: blosc, lz4, zstandard) is imported the first time a spec names it, so
a reader whose dataset uses only zstd never pays for importing blosc, in every process it starts.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator, Mapping

from .base import Codec, CodecSpecError

# Spec name -> (module in this package, class) of its codec type.
_CODEC_HOMES: Mapping[str, tuple[str, str]] = types.MappingProxyType({
    "none": ("null_codec", "NullCodec"),
    "zstd": ("zstd_codec", "ZstdCodec"),
    "lz4": ("lz4_codec", "Lz4Codec"),
    "blosc": ("blosc_codec", "BloscCodec"),
    "zstd-dict": ("zstd_codec", "ZstdDictCodec"),
})


class _CodecTypes(Mapping[str, type[Codec]]):
    """Read-only spec name -> codec type; looking a name up imports that codec's module, and only that one."""

    def __getitem__(self, name: str) -> type[Codec]:
        module_name, class_name = _CODEC_HOMES[name]
        return getattr(importlib.import_module(f".{module_name}", __package__), class_name)

    def __iter__(self) -> Iterator[str]:
        return iter(_CODEC_HOMES)

    def __len__(self) -> int:
        return len(_CODEC_HOMES)

    def __repr__(self) -> str:
        return f"CODEC_TYPES({', '.join(_CODEC_HOMES)})"


CODEC_TYPES: Mapping[str, type[Codec]] = _CodecTypes()


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
