"""Spec string -> codec. The table of codec types is read-only: a codec is added here, in one line, not at run time.

A codec's module (and the library it wraps: blosc, lz4, zstandard) is imported the first time a spec names it, so
a reader whose dataset uses only zstd never pays for importing blosc, in every process it starts.

The spec grammar is written here once (SPEC_FORMS): `fanstore-pack --help` and README.md show `codec_grammar()`,
and the error for a bad spec the form of the codec it names, or all the forms.
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

# Spec name -> (the forms its specs take, what they mean). The ranges are the codecs' own (tests/test_codecs.py
# builds each codec at both ends of each and one past them).
SPEC_FORMS: Mapping[str, tuple[str, str]] = types.MappingProxyType({
    "none": ("none", "stored as is"),
    "zstd": ("zstd[:LEVEL]", "LEVEL -7..22, default 3"),
    "zstd-dict": ("zstd-dict[:LEVEL]", "zstd with a dictionary trained per group, so that many small similar files "
                                       "compress nearly as well as one archive; LEVEL -7..22, default 3"),
    "lz4": ("lz4[:hc[:LEVEL]]", "the fastest to decode; hc compresses more, LEVEL 1..12, default 9"),
    "blosc": ("blosc:INNER:LEVEL[:SHUFFLE][:TYPESIZE]",
              "for arrays of numbers: INNER blosclz, lz4, lz4hc, zlib or zstd; LEVEL 0..9; SHUFFLE shuffle "
              "(default), bitshuffle or noshuffle; TYPESIZE 1..255 or auto (default: a .npy file's element size, "
              "else 4)"),
})
GRAMMAR_WIDTH = 76  # columns of codec_grammar(): indented, it fits --help on an 80-column terminal, and README.md
_MEANING_COLUMN = 20  # where meanings start; a longer form has its meaning on the lines below it


def codec_grammar() -> str:
    """Every spec form and what it means, as `fanstore-pack --help` and README.md show them: the meanings in a
    column of their own, wrapped within it."""
    import textwrap

    lines = []
    for form, meaning in SPEC_FORMS.values():
        wrapped = textwrap.wrap(meaning, GRAMMAR_WIDTH - _MEANING_COLUMN)
        if len(form) + 2 > _MEANING_COLUMN:
            lines.append(form)
        else:
            lines.append(f"{form:<{_MEANING_COLUMN}}{wrapped.pop(0)}")
        lines.extend(" " * _MEANING_COLUMN + line for line in wrapped)
    return "\n".join(lines)


def spec_form(name: str) -> str:
    """One codec's line of the grammar, on one line: what an error about a spec naming it shows."""
    form, meaning = SPEC_FORMS[name]
    return f"{form}: {meaning}"


def spec_forms() -> str:
    """The forms alone, on one line: what an error about a spec naming no known codec shows."""
    return " | ".join(form for form, _ in SPEC_FORMS.values())


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
        raise CodecSpecError(f"{what} in spec {spec!r} (known: {known}); a spec is {spec_forms()}")
    if dictionary is not None and not codec_type.needs_dictionary:
        raise CodecSpecError(f"codec {name!r} takes no dictionary, but one was given with spec {spec!r}")
    try:
        return codec_type.from_spec_fields(fields, dictionary)
    except CodecSpecError as exc:
        raise CodecSpecError(f"{exc} in spec {spec!r}; expected {spec_form(name)}") from None
