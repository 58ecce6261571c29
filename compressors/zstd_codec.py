"""`zstd:LEVEL` and `zstd-dict:LEVEL`, plus the dictionary trainer that zstd-dict packs use.

Files are compressed one by one and many are tiny, so frames carry nothing a reader already knows: no magic
number, checksum, content size or dictionary id (the index holds the size and an xxh3 of the stored bytes).
"""

from __future__ import annotations

import threading
from typing import Any

import zstandard

from .base import BytesLike, Codec, CodecError, CodecSpecError, check_field_count, check_int, check_raw_size, int_field

MIN_LEVEL = -7
MAX_LEVEL = 22
DEFAULT_LEVEL = 3
DEFAULT_DICT_SIZE = 112640  # zstd's own default (110 KiB)
# What a dictionary is trained on, at most: the packer and the selector draw their training sets alike (at
# random: training_draw), so the selector's predicted ratio is the one the pack gets.
DICT_TRAIN_FILES = 4000
DICT_TRAIN_FILE_BYTES = 128 << 10  # the head of each file
DICT_TRAIN_TOTAL_BYTES = 32 << 20

_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS
# What the encoder stores for empty input (frame header, one empty last block); decoded once to warm a dictionary.
_EMPTY_FRAME = b"\x00\x00\x01\x00\x00"
# Dictionary training: fixed cover parameters so the result depends on the samples only, never on the CPU count.
_TRAIN_K = 1024  # segment size
_TRAIN_D = 8  # dmer size
_MIN_DICT_SIZE = 256  # zstd cannot build a smaller dictionary
_SAMPLE_BYTES_PER_DICT_BYTE = 10


class _ZstdBase(Codec):
    """Shared by zstd and zstd-dict: magicless frames, and one (de)compressor per thread.

    zstandard's compressor and decompressor objects must not be used by two threads at once, and building one per
    call would cost more than decoding a small file, so each thread builds its own on first use and keeps it.
    """

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = check_int(level, f"{self.name} level", MIN_LEVEL, MAX_LEVEL)
        self._params = zstandard.ZstdCompressionParameters.from_level(
            self.level, format=_FORMAT, write_checksum=0, write_content_size=0, write_dict_id=0
        )
        self._per_thread = threading.local()

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.level}"

    def params(self) -> dict[str, Any]:
        return {"level": self.level}

    def _dict_data(self) -> zstandard.ZstdCompressionDict | None:
        return None

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._per_thread, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(compression_params=self._params, dict_data=self._dict_data())
            self._per_thread.compressor = compressor
        return compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._per_thread, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor(dict_data=self._dict_data(), format=_FORMAT)
            self._per_thread.decompressor = decompressor
        return decompressor

    def encode(self, data: BytesLike) -> bytes:
        try:
            return self._compressor().compress(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.spec}: cannot encode: {exc}") from exc

    def decode(self, stored: BytesLike, raw_size: int) -> bytes:
        check_raw_size(raw_size)
        try:
            # Frames hold no content size, so the output limit is what sizes the buffer; at least 1, because 0
            # would mean "take the size from the frame header".
            raw = self._decompressor().decompress(stored, max_output_size=max(raw_size, 1), allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.spec}: cannot decode {len(stored)} stored bytes into {raw_size}: {exc}") from exc
        if len(raw) != raw_size:
            raise CodecError(f"{self.spec}: decoded {len(raw)} bytes, expected {raw_size}")
        return raw

    @classmethod
    def _level_from_fields(cls, fields: list[str]) -> int:
        check_field_count(cls, fields, 1)
        return int_field(fields[0], f"{cls.name} level", MIN_LEVEL, MAX_LEVEL) if fields else DEFAULT_LEVEL


class ZstdCodec(_ZstdBase):
    """zstd at a fixed level, one magicless frame per file."""

    codec_id = 1
    name = "zstd"

    @classmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> ZstdCodec:
        return cls(cls._level_from_fields(fields))

    def _init_kwargs(self) -> dict[str, Any]:
        return {"level": self.level}


class ZstdDictCodec(_ZstdBase):
    """zstd with a dictionary trained on the group's own files: small similar files share their common parts.

    The dictionary is not in the spec (the index stores it as a section), so a codec may be built without one,
    to read its level while planning a pack; it then refuses to encode or decode.
    """

    codec_id = 4
    name = "zstd-dict"
    needs_dictionary = True

    def __init__(self, level: int = DEFAULT_LEVEL, dictionary: BytesLike | None = None) -> None:
        super().__init__(level)
        self.dictionary = bytes(dictionary) if dictionary is not None else None
        self._zstd_dict: zstandard.ZstdCompressionDict | None = None
        if self.dictionary is None:
            return
        if not self.dictionary:
            raise CodecSpecError(f"{self.spec}: the dictionary is empty")
        try:
            # A trained dictionary, as fanstore writes: read as raw content, any bytes would pass here and every
            # decode with them fail.
            zstd_dict = zstandard.ZstdCompressionDict(self.dictionary, dict_type=zstandard.DICT_TYPE_FULLDICT)
            # Digest the dictionary once here rather than in every thread's compressor.
            zstd_dict.precompute_compress(compression_params=self._params)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.spec}: unusable dictionary of {len(self.dictionary)} bytes: {exc}") from exc
        self._zstd_dict = zstd_dict
        # zstandard digests the dictionary for decoding lazily, outside the GIL, on the first decode: two threads
        # decoding first at once would both build it. Decoding an empty frame here builds it before any sharing.
        self.decode(_EMPTY_FRAME, 0)

    def _dict_data(self) -> zstandard.ZstdCompressionDict:
        if self._zstd_dict is None:
            raise CodecError(f"{self.spec} has no dictionary: build it with codec_from_spec(spec, dictionary=...)")
        return self._zstd_dict

    @classmethod
    def from_spec_fields(cls, fields: list[str], dictionary: bytes | None) -> ZstdDictCodec:
        return cls(cls._level_from_fields(fields), dictionary)

    def _init_kwargs(self) -> dict[str, Any]:
        return {"level": self.level, "dictionary": self.dictionary}

    def _key(self) -> tuple[Any, ...]:
        return (type(self), self.spec, self.dictionary)

    def __repr__(self) -> str:
        size = "no dictionary" if self.dictionary is None else f"dictionary of {len(self.dictionary)} bytes"
        return f"{type(self).__name__}({self.spec!r}, {size})"


def dictionary_size(training_bytes: int, dict_size: int = DEFAULT_DICT_SIZE) -> int:
    """The size of the dictionary train_dictionary trains on `training_bytes` of samples (at most; zstd may return
    fewer), 0 when they are too few: the rule written once, for the selector to predict what a pack stores."""
    size = min(dict_size, training_bytes // _SAMPLE_BYTES_PER_DICT_BYTE)
    return size if size >= _MIN_DICT_SIZE else 0


def training_draw(sizes: Any) -> Any:
    """Which of a group's files (their sizes, in file order) the packer trains a dictionary on: at most
    DICT_TRAIN_FILES drawn at random, until their heads reach DICT_TRAIN_TOTAL_BYTES (the one that crosses it
    counts); their numbers, in file order. Random, as the selector's sample is: every n-th file in path order, as
    the packer took before, met files that alternate (a caption beside each record, a pair of kinds) on one side
    only, and stored 56% more than the selector predicted. The order is splitmix64 of each number, the same with
    any numpy: a repeated pack trains the same dictionary."""
    import numpy as np

    heads = np.minimum(np.asarray(sizes, dtype=np.int64), DICT_TRAIN_FILE_BYTES)
    with np.errstate(over="ignore"):
        mixed = np.arange(len(heads), dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed ^= mixed >> np.uint64(31)
    order = np.argsort(mixed, kind="stable")[:DICT_TRAIN_FILES]
    reached = np.cumsum(heads[order]) >= DICT_TRAIN_TOTAL_BYTES
    count = int(np.argmax(reached)) + 1 if reached.any() else len(order)
    return np.sort(order[:count])


def train_dictionary(
    samples: list[bytes], dict_size: int = DEFAULT_DICT_SIZE, level: int = DEFAULT_LEVEL
) -> bytes | None:
    """A zstd dictionary for files like `samples`, or None when they are too few or too small to train on.

    Deterministic: the same samples give the same bytes on any machine (for a given zstd version), because a
    resumed or repeated pack must produce an identical dataset. The dictionary is kept to at most a tenth of the sample bytes, since a larger
    one only memorises the samples.
    """
    check_int(level, "zstd level", MIN_LEVEL, MAX_LEVEL)
    check_int(dict_size, "dictionary size", 1, 1 << 31)
    training = [bytes(sample) for sample in samples if len(sample)]
    dict_size = dictionary_size(sum(map(len, training)), dict_size)
    if not dict_size:
        return None
    try:
        trained = zstandard.train_dictionary(
            dict_size,
            training,
            k=min(_TRAIN_K, dict_size),
            d=_TRAIN_D,
            split_point=1.0,  # train on every sample; the default holds a quarter back to score k/d candidates
            level=level,
            threads=1,  # parameters are fixed, so there is nothing to search in parallel
        )
    except zstandard.ZstdError:
        return None
    return trained.as_bytes()
