"""Codecs for fanstore blobs: one file's bytes in, its stored bytes out, and back.

`codec_from_spec("zstd:3")` builds a codec from the spec string an index records; `CODEC_TYPES` lists the kinds.
"""

from .base import Codec, CodecError, CodecSpecError
from .registry import CODEC_TYPES, codec_from_spec
from .zstd_codec import (DEFAULT_DICT_SIZE, DICT_TRAIN_FILE_BYTES, DICT_TRAIN_FILES, DICT_TRAIN_TOTAL_BYTES,
                         dictionary_size, train_dictionary, training_draw)

__all__ = [
    "CODEC_TYPES",
    "DEFAULT_DICT_SIZE",
    "DICT_TRAIN_FILES",
    "DICT_TRAIN_FILE_BYTES",
    "DICT_TRAIN_TOTAL_BYTES",
    "Codec",
    "CodecError",
    "CodecSpecError",
    "codec_from_spec",
    "dictionary_size",
    "train_dictionary",
    "training_draw",
]
