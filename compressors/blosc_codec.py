"""`blosc:INNER:LEVEL[:shuffle|bitshuffle|noshuffle][:TYPESIZE|auto]`: shuffle filters for numeric arrays.

Shuffling groups the n-th bytes of every element together, which is what makes float fields compress; it needs
the element size, so `auto` reads it from a `.npy` header. Each file is one blosc buffer (it carries its own
sizes); files over 1 GiB are stored as segments, because blosc cannot take 2 GiB in one call.

Threads: the readers decode from many Python threads at once, and python-blosc holds the GIL through
compression unless told otherwise; with the GIL released it also switches to c-blosc's context functions, which
keep no shared state, so calls from several threads are safe. The number of blosc-internal threads per call is
python-blosc's process-wide setting (`blosc.set_nthreads`), which cannot be set per call; this module leaves it
alone, so a program that decodes from many threads of its own may want to set it to 1.
"""

from __future__ import annotations

import ast
import functools
import re
import struct
import types
from typing import Any

import blosc
import numpy.lib.format as npy_format
from blosc.blosc_extension import error as BloscLibraryError

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

# Decoding must run in parallel in reader threads; python-blosc holds the GIL during (de)compression by default.
blosc.set_releasegil(True)

INNER_COMPRESSORS = tuple(blosc.compressor_list())
SHUFFLES = types.MappingProxyType(
    {"shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE, "noshuffle": blosc.NOSHUFFLE}
)
MIN_LEVEL = 0
MAX_LEVEL = 9
MAX_TYPESIZE = blosc.MAX_TYPESIZE  # 255
DEFAULT_SHUFFLE = "shuffle"
DEFAULT_TYPESIZE = 4  # what `auto` uses for anything that is not a .npy file: float32 and int32 are the common cases

# A blosc buffer starts with a 16-byte header: version, its codec's version, flags, typesize, then its raw size,
# block size and stored size (little-endian uint32). Read here: python-blosc's cbuffer_validate never releases the
# buffer it is given, so every blob it checked stayed in memory for good.
_HEADER = struct.Struct("<4BIII")
_HEADER_SIZE = _HEADER.size
_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 10_000  # numpy's own limit on the header it will parse
# Per .npy major version: how the header's length is stored after the magic and version bytes, and its encoding.
_NPY_HEADER_LENGTH = types.MappingProxyType({1: ("<H", "latin1"), 2: ("<I", "latin1"), 3: ("<I", "utf8")})
_PYTHON2_LONG = re.compile(r"(?<=[0-9])[lL]\b")  # numpy on Python 2 wrote the shape's integers as longs: (64L,)


class BloscCodec(SegmentedCodec):
    """blosc with an inner compressor, a level, a shuffle filter and an element size (`typesize`, None = auto)."""

    codec_id = 3
    name = "blosc"

    def __init__(
        self,
        inner: str,
        level: int,
        shuffle: str = DEFAULT_SHUFFLE,
        typesize: int | None = None,
        *,
        segment_size: int = SEGMENT_SIZE,
    ) -> None:
        super().__init__(segment_size)
        if inner not in INNER_COMPRESSORS:
            raise CodecSpecError(f"blosc inner compressor must be one of {', '.join(INNER_COMPRESSORS)}, got {inner!r}")
        if shuffle not in SHUFFLES:
            raise CodecSpecError(f"blosc shuffle must be one of {', '.join(SHUFFLES)}, got {shuffle!r}")
        self.inner = inner
        self.level = check_int(level, "blosc level", MIN_LEVEL, MAX_LEVEL)
        self.shuffle = shuffle
        self.typesize = None if typesize is None else check_int(typesize, "blosc typesize", 1, MAX_TYPESIZE)

    @property
    def spec(self) -> str:
        typesize = "auto" if self.typesize is None else self.typesize
        return f"blosc:{self.inner}:{self.level}:{self.shuffle}:{typesize}"

    def params(self) -> dict[str, Any]:
        typesize = "auto" if self.typesize is None else self.typesize
        return {"inner": self.inner, "level": self.level, "shuffle": self.shuffle, "typesize": typesize}

    def encode(self, data: BytesLike) -> bytes:
        view = memoryview(data).cast("B")
        # Every segment shuffles with the element size of the whole file, which only its start can tell.
        typesize = self.typesize if self.typesize is not None else auto_typesize(view)
        return encode_segments(view, self.segment_size, functools.partial(self._encode_block, typesize=typesize))

    def for_file(self, head: BytesLike) -> BloscCodec:
        """With `auto`: this setting at the file's own element size, so that every block of a large .npy file
        shuffles by it, not the first block alone (the others hold no header: they shuffled by 4 bytes)."""
        if self.typesize is not None:
            return self
        return BloscCodec(self.inner, self.level, self.shuffle, auto_typesize(head), segment_size=self.segment_size)

    def _encode_block(self, block: memoryview, typesize: int) -> bytes:
        try:
            return blosc.compress(block, typesize, self.level, SHUFFLES[self.shuffle], self.inner)
        except (BloscLibraryError, ValueError) as exc:
            raise CodecError(f"{self.spec}: cannot encode {len(block)} bytes: {exc}") from exc

    def _decode_block(self, block: memoryview, raw_size: int) -> bytes:
        # python-blosc trusts the header: check it describes exactly this block and raw_size before decoding.
        if len(block) < _HEADER_SIZE:
            raise CodecError(f"{self.spec}: {len(block)} stored bytes are not a valid blosc buffer")
        *_, header_raw_size, _, header_stored_size = _HEADER.unpack_from(block)
        if header_stored_size != len(block):
            raise CodecError(f"{self.spec}: {len(block)} stored bytes are not a valid blosc buffer (its header says "
                             f"{header_stored_size})")
        if header_raw_size != raw_size:
            raise CodecError(f"{self.spec}: blosc header says {header_raw_size} raw bytes, expected {raw_size}")
        try:
            return blosc.decompress(block)
        except (BloscLibraryError, ValueError) as exc:
            raise CodecError(f"{self.spec}: cannot decode {len(block)} stored bytes into {raw_size}: {exc}") from exc

    @classmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> BloscCodec:
        if len(fields) < 2:
            raise CodecSpecError("blosc needs an inner compressor and a level")
        inner, level_field, *options = fields
        if inner not in INNER_COMPRESSORS:
            raise CodecSpecError(f"blosc inner compressor must be one of {', '.join(INNER_COMPRESSORS)}, got {inner!r}")
        level = int_field(level_field, "blosc level", MIN_LEVEL, MAX_LEVEL)
        shuffle = DEFAULT_SHUFFLE
        if options and (options[0] in SHUFFLES or not (options[0] == "auto" or options[0].isdigit())):
            shuffle = options.pop(0)
            if shuffle not in SHUFFLES:
                raise CodecSpecError(
                    f"blosc shuffle must be one of {', '.join(SHUFFLES)} (or a TYPESIZE), got {shuffle!r}"
                )
        typesize = None
        if options:
            typesize_field = options.pop(0)
            if typesize_field != "auto":
                typesize = int_field(typesize_field, "blosc typesize", 1, MAX_TYPESIZE)
        check_field_count(cls, options, 0)
        return cls(inner, level, shuffle, typesize)

    def _init_kwargs(self) -> dict[str, Any]:
        return {
            "inner": self.inner,
            "level": self.level,
            "shuffle": self.shuffle,
            "typesize": self.typesize,
            "segment_size": self.segment_size,
        }


def auto_typesize(data: BytesLike) -> int:
    """The element size `auto` shuffles with: the item size from a .npy header, else DEFAULT_TYPESIZE.

    The header is parsed here rather than by numpy's array loader: the loader warns on stderr about headers written
    by Python 2 (advice to re-save the file, for whoever loads the array) and lets a tokenizer error escape from a
    torn one; a codec that only needs the item size has no use for either."""
    descr = _npy_descr(memoryview(data).cast("B"))
    if descr is None:
        return DEFAULT_TYPESIZE
    try:
        itemsize = npy_format.descr_to_dtype(descr).itemsize
    except (ValueError, TypeError, KeyError, IndexError):
        return DEFAULT_TYPESIZE  # a descr numpy cannot read: treat the file as plain bytes
    return itemsize if 1 <= itemsize <= MAX_TYPESIZE else DEFAULT_TYPESIZE


def _npy_descr(view: memoryview) -> Any:
    """The `descr` of the .npy header `view` starts with (None when it does not start with one that reads): the
    header is a Python dict literal, after the magic, two version bytes and the header's length."""
    if bytes(view[: len(_NPY_MAGIC)]) != _NPY_MAGIC or len(view) < len(_NPY_MAGIC) + 2:
        return None
    layout = _NPY_HEADER_LENGTH.get(view[len(_NPY_MAGIC)])
    if layout is None:
        return None
    length_format, encoding = layout
    start = len(_NPY_MAGIC) + 2 + struct.calcsize(length_format)
    if len(view) < start:
        return None
    (length,) = struct.unpack_from(length_format, view, len(_NPY_MAGIC) + 2)
    if length > _NPY_MAX_HEADER or len(view) < start + length:
        return None
    try:
        text = bytes(view[start : start + length]).decode(encoding)
    except UnicodeDecodeError:
        return None
    for literal in (text, _PYTHON2_LONG.sub("", text)):
        try:
            header = ast.literal_eval(literal)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        return header.get("descr") if isinstance(header, dict) else None
    return None
