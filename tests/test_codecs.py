"""Codecs: round trips, spec strings, pickling, corrupt input, dictionaries and threads, for every codec type.

Tests are parametrised over SPECS, so a new codec or option is covered by adding one line there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compressors import CODEC_TYPES, Codec, CodecError, CodecSpecError, codec_from_spec, train_dictionary
from compressors.base import SEGMENT_SIZE
from compressors.blosc_codec import INNER_COMPRESSORS, SHUFFLES, BloscCodec, auto_typesize
from compressors.lz4_codec import Lz4Codec
from compressors.registry import GRAMMAR_WIDTH, SPEC_FORMS, codec_grammar, spec_form
from compressors.zstd_codec import ZstdDictCodec
from conftest import python2_npy

REPO = Path(__file__).resolve().parent.parent

SPECS = [
    "none",
    "zstd:1",
    "zstd:19",
    "zstd:-5",
    "lz4",
    "lz4:hc",
    "lz4:hc:12",
    "blosc:lz4:5:shuffle",
    "blosc:zstd:9:bitshuffle",
    "blosc:blosclz:1:noshuffle",
    "blosc:zlib:3:shuffle:8",
    "zstd-dict:3",
    "zstd-dict:19",
]
# Codecs that can tell corrupt stored bytes from good ones (`none` can only check the length).
CHECKING_SPECS = [spec for spec in SPECS if spec != "none"]


def _record(rng: random.Random, number: int) -> bytes:
    """A small JSON-like record, like the per-sample metadata files that zstd-dict is for."""
    items = [
        {
            "sku": f"SKU-{rng.randint(0, 99999):05d}",
            "qty": rng.randint(1, 9),
            "price": round(rng.random() * 100, 2),
            "note": rng.choice(["gift wrap", "express", "standard shipping", "store pickup"]),
        }
        for _ in range(rng.randint(2, 12))
    ]
    label = rng.choice(["cat", "dog", "bird"])
    record = {"id": number, "user": f"user{rng.randint(0, 999)}", "label": label, "items": items}
    return json.dumps(record).encode()


@pytest.fixture(scope="session")
def records() -> list[bytes]:
    rng = random.Random(11)
    return [_record(rng, number) for number in range(2200)]


@pytest.fixture(scope="session")
def dictionary(records: list[bytes]) -> bytes:
    trained = train_dictionary(records[:2000])
    assert trained is not None
    return trained


def make_codec(spec: str, dictionary: bytes | None) -> Codec:
    """The codec for a spec, given the shared dictionary when its type needs one."""
    name = spec.split(":")[0]
    return codec_from_spec(spec, dictionary=dictionary if CODEC_TYPES[name].needs_dictionary else None)


@pytest.fixture(params=SPECS)
def codec(request: pytest.FixtureRequest, dictionary: bytes) -> Codec:
    return make_codec(request.param, dictionary)


@pytest.fixture(params=CHECKING_SPECS)
def checking_codec(request: pytest.FixtureRequest, dictionary: bytes) -> Codec:
    return make_codec(request.param, dictionary)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def smooth_field_npy() -> bytes:
    """5 MiB float32 .npy of a smooth 2-D field: the kind of file blosc's shuffle is for."""
    y = np.linspace(0.0, 6.0 * np.pi, 1280, dtype=np.float64)[:, None]
    x = np.linspace(0.0, 4.0 * np.pi, 1024, dtype=np.float64)[None, :]
    field = (np.sin(y) * np.cos(x) + 0.1 * y).astype(np.float32)
    return _npy_bytes(field)


PAYLOADS = {
    "empty": b"",
    "one byte": b"\x7f",
    "64 KiB random": random.Random(5).randbytes(64 << 10),
}


def test_specs_cover_every_codec_type() -> None:
    assert {spec.split(":")[0] for spec in SPECS} == set(CODEC_TYPES)


def test_codec_ids_are_the_on_disk_contract() -> None:
    assert {name: codec_type.codec_id for name, codec_type in CODEC_TYPES.items()} == {
        "none": 0,
        "zstd": 1,
        "lz4": 2,
        "blosc": 3,
        "zstd-dict": 4,
    }
    assert all(codec_type.name == name for name, codec_type in CODEC_TYPES.items())
    assert [name for name, codec_type in CODEC_TYPES.items() if codec_type.needs_dictionary] == ["zstd-dict"]


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        CODEC_TYPES["evil"] = Codec  # type: ignore[index]


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_round_trip_small(codec: Codec, payload: bytes) -> None:
    stored = codec.encode(payload)
    assert isinstance(stored, bytes)
    assert codec.decode(stored, len(payload)) == payload
    assert codec.decode(memoryview(stored), len(payload)) == payload


def test_round_trip_memoryview_input(codec: Codec) -> None:
    payload = b"memoryview input " * 100
    assert codec.decode(codec.encode(memoryview(payload)), len(payload)) == payload


def test_a_codec_keeps_no_hold_on_the_bytes_it_is_given(codec: Codec, smooth_field_npy: bytes) -> None:
    """Readers decode millions of blobs: a library call that keeps a buffer it was given (python-blosc's
    cbuffer_validate did) leaks every blob for good. Each call, good input or bad, must let go of its buffers."""
    stored = codec.encode(smooth_field_npy)
    raw_view = memoryview(smooth_field_npy)
    codec.encode(raw_view)
    raw_view.release()  # BufferError if the encoder still holds an export of it
    for blob, raw_size in ((stored, len(smooth_field_npy)), (stored[: len(stored) // 2], len(smooth_field_npy)),
                           (bytes(64), 1000)):
        before = sys.getrefcount(blob)
        view = memoryview(blob)
        try:
            codec.decode(view, raw_size)
        except CodecError:
            pass
        view.release()
        assert sys.getrefcount(blob) == before

def test_round_trip_large_compressible(codec: Codec, smooth_field_npy: bytes) -> None:
    stored = codec.encode(smooth_field_npy)
    assert codec.decode(stored, len(smooth_field_npy)) == smooth_field_npy
    assert len(stored) <= len(smooth_field_npy) + 1024  # float mantissas may not shrink, but never blow up


def test_blosc_shuffle_is_what_shrinks_float_fields(smooth_field_npy: bytes) -> None:
    """The reason blosc is offered: with its shuffle, a fast inner compressor beats zstd on float arrays."""

    def stored_size(spec: str) -> int:
        return len(codec_from_spec(spec).encode(smooth_field_npy))

    assert stored_size("blosc:lz4:5:shuffle") < stored_size("zstd:3")
    assert stored_size("blosc:lz4:5:shuffle") < 0.9 * stored_size("blosc:lz4:5:noshuffle")


@pytest.mark.parametrize(
    "make",
    [
        lambda size: Lz4Codec(segment_size=size),
        lambda size: Lz4Codec(12, segment_size=size),
        lambda size: BloscCodec("lz4", 5, segment_size=size),
        lambda size: BloscCodec("zstd", 3, "bitshuffle", 8, segment_size=size),
    ],
    ids=["lz4", "lz4:hc:12", "blosc:lz4:5", "blosc:zstd:3:bitshuffle:8"],
)
@pytest.mark.parametrize("raw_size", [0, 1, 4096, 4097, 3 * 4096, 10 * 4096 + 123])
def test_segments(make, raw_size: int) -> None:
    """Files above the segment size are stored as (u32 length, block) pairs; at or below it as one block."""
    segment_size = 4096
    codec = make(segment_size)
    payload = (random.Random(raw_size).randbytes(raw_size // 3) + b"segment " * raw_size)[:raw_size]
    stored = codec.encode(payload)
    assert codec.decode(stored, raw_size) == payload
    if raw_size <= segment_size:
        assert stored == make(SEGMENT_SIZE).encode(payload)  # one plain block, as without segmenting
        return
    position, segments = 0, 0
    while position < len(stored):
        (stored_len,) = struct.unpack_from("<I", stored, position)
        position += 4 + stored_len
        segments += 1
    assert position == len(stored)
    assert segments == -(-raw_size // segment_size)
    with pytest.raises(CodecError):
        codec.decode(stored[:-1], raw_size)
    with pytest.raises(CodecError):
        codec.decode(stored + b"\x00", raw_size)
    with pytest.raises(CodecError):
        codec.decode(stored, raw_size + 1)
    with pytest.raises(CodecError):
        make(segment_size * 2).decode(stored, raw_size)


def test_spec_round_trip(codec: Codec) -> None:
    rebuilt = codec_from_spec(codec.spec, dictionary=getattr(codec, "dictionary", None))
    assert rebuilt == codec
    assert hash(rebuilt) == hash(codec)
    assert rebuilt.spec == codec.spec
    assert codec.spec in repr(codec)
    json.dumps(codec.params())


@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("zstd", "zstd:3"),
        ("  zstd:7\n", "zstd:7"),
        ("zstd:-7", "zstd:-7"),
        ("zstd:022", "zstd:22"),
        ("lz4:hc", "lz4:hc:9"),
        ("lz4:hc:1", "lz4:hc:1"),
        ("blosc:lz4:5", "blosc:lz4:5:shuffle:auto"),
        ("blosc:lz4hc:0:noshuffle", "blosc:lz4hc:0:noshuffle:auto"),
        ("blosc:zlib:3:8", "blosc:zlib:3:shuffle:8"),
        ("blosc:zstd:9:bitshuffle:auto", "blosc:zstd:9:bitshuffle:auto"),
        ("zstd-dict", "zstd-dict:3"),
    ],
)
def test_canonical_spec(spec: str, canonical: str) -> None:
    assert codec_from_spec(spec).spec == canonical
    assert codec_from_spec(canonical) == codec_from_spec(spec)


def test_codecs_differ_by_parameters(dictionary: bytes) -> None:
    assert codec_from_spec("zstd:3") != codec_from_spec("zstd:4")
    assert codec_from_spec("zstd:3") != codec_from_spec("zstd-dict:3", dictionary=dictionary)
    assert codec_from_spec("zstd-dict:3", dictionary=dictionary) != codec_from_spec("zstd-dict:3")
    assert Lz4Codec() != Lz4Codec(segment_size=4096)
    assert len({codec_from_spec(spec) for spec in ["lz4", "lz4", "lz4:hc", "lz4:hc:9"]}) == 2


def test_pickle_round_trip(codec: Codec) -> None:
    payload = b"pickled codecs decode what the original encoded " * 50
    stored = codec.encode(payload)  # populates this thread's (de)compressor first
    clone = pickle.loads(pickle.dumps(codec))
    assert clone == codec
    assert clone.decode(stored, len(payload)) == payload
    assert codec.decode(clone.encode(payload), len(payload)) == payload


def test_pickle_keeps_segment_size() -> None:
    codec = BloscCodec("lz4", 5, segment_size=1000)
    clone = pickle.loads(pickle.dumps(codec))
    assert clone.segment_size == 1000 and clone == codec


def test_truncated_input_raises_codec_error(codec: Codec) -> None:
    payload = b"some data that compresses " * 200
    stored = codec.encode(payload)
    for cut in (stored[:-1], stored[: len(stored) // 2], stored[:1], b""):
        with pytest.raises(CodecError):
            codec.decode(cut, len(payload))


def test_garbage_input_raises_codec_error(checking_codec: Codec) -> None:
    rng = random.Random(3)
    for size in (1, 5, 16, 100, 5000):
        garbage = rng.randbytes(size)
        for raw_size in (0, 1, 1000):
            with pytest.raises(CodecError):
                checking_codec.decode(garbage, raw_size)


def test_wrong_raw_size_raises_codec_error(codec: Codec) -> None:
    payload = b"0123456789abcdef" * 64
    stored = codec.encode(payload)
    for raw_size in (len(payload) - 1, len(payload) + 1, 0):
        with pytest.raises(CodecError):
            codec.decode(stored, raw_size)
    with pytest.raises(CodecError):
        codec.decode(stored, -1)


def test_bit_flip_never_escapes_as_library_error(checking_codec: Codec) -> None:
    """A corrupt blob either decodes to the right length or raises CodecError, never another exception."""
    payload = b"bit flips " * 500
    stored = bytearray(checking_codec.encode(payload))
    rng = random.Random(9)
    for _ in range(50):
        damaged = bytearray(stored)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        try:
            assert len(checking_codec.decode(bytes(damaged), len(payload))) == len(payload)
        except CodecError:
            pass


BAD_SPECS = [
    "",
    "   ",
    "zstf:3",
    "zstd:99",
    "zstd:-8",
    "zstd:x",
    "zstd:",
    "zstd:+3",
    "zstd:3:1",
    "lz4:fast",
    "lz4:hc:0",
    "lz4:hc:13",
    "lz4:hc:9:1",
    "blosc",
    "blosc:nope:5",
    "blosc:lz4",
    "blosc:lz4:11",
    "blosc:lz4:5:sideways",
    "blosc:lz4:5:shuffle:0",
    "blosc:lz4:5:shuffle:256",
    "blosc:lz4:5:shuffle:auto:1",
    "none:1",
    "zstd-dict:23",
    "ZSTD:3",
]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_bad_spec_raises_codec_spec_error_naming_it(spec: str) -> None:
    with pytest.raises(CodecSpecError) as caught:
        codec_from_spec(spec)
    assert repr(spec) in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, CodecError)


def test_bad_spec_messages_say_what_is_allowed() -> None:
    known = r"\(known: blosc, lz4, none, zstd, zstd-dict\)"
    with pytest.raises(CodecSpecError, match=r"unknown codec 'zstf' in spec 'zstf:3' " + known):
        codec_from_spec("zstf:3")
    with pytest.raises(CodecSpecError, match=r"zstd level must be an integer from -7 to 22, got 'x' in spec 'zstd:x'"):
        codec_from_spec("zstd:x")


def _range_after(text: str, name: str) -> tuple[int, int]:
    """The `NAME LOW..HIGH` a grammar line gives."""
    match = re.search(rf"{name} (-?[0-9]+)\.\.(-?[0-9]+)", text)
    assert match, (name, text)
    return int(match[1]), int(match[2])


def _accepts(spec: str) -> bool:
    try:
        codec_from_spec(spec)
    except CodecSpecError:
        return False
    return True


def test_the_grammar_says_what_the_codecs_accept() -> None:
    """SPEC_FORMS is the one grammar README.md, --help and the errors show: each range and default it states is
    the codecs' own, at both ends and one past them, and every codec type has a line."""
    assert set(SPEC_FORMS) == set(CODEC_TYPES)
    for name, prefix in (("zstd", "zstd:"), ("zstd-dict", "zstd-dict:"), ("lz4", "lz4:hc:")):
        meaning = SPEC_FORMS[name][1]
        low, high = _range_after(meaning, "LEVEL")
        assert [_accepts(f"{prefix}{level}") for level in (low - 1, low, high, high + 1)] == [False, True, True, False]
        default = int(re.search(r"default (-?[0-9]+)", meaning)[1])
        assert codec_from_spec(prefix.rstrip(":")).spec == f"{prefix}{default}"
    blosc = SPEC_FORMS["blosc"][1]
    inner = re.search(r"INNER ([a-z0-9, ]+?);", blosc)[1].replace(" or ", ", ").split(", ")
    assert inner == list(INNER_COMPRESSORS) and all(_accepts(f"blosc:{name}:5") for name in inner)
    low, high = _range_after(blosc, "LEVEL")
    assert [_accepts(f"blosc:lz4:{level}") for level in (low - 1, low, high, high + 1)] == [False, True, True, False]
    shuffles = re.search(r"SHUFFLE ([a-z (),]+?);", blosc)[1].replace(" (default)", "").replace(" or ", ", ")
    assert shuffles.split(", ") == list(SHUFFLES) and "shuffle (default)" in blosc
    assert codec_from_spec("blosc:lz4:5").spec == codec_from_spec("blosc:lz4:5:shuffle:auto").spec
    low, high = _range_after(blosc, "TYPESIZE")
    assert [_accepts(f"blosc:lz4:5:{size}") for size in (low - 1, low, high, high + 1)] == [False, True, True, False]
    assert codec_from_spec("lz4").spec == "lz4" and _accepts("none") and not _accepts("none:1")


@pytest.mark.parametrize("spec, codec", [("zstd:99", "zstd"), ("lz4:hc:9:1", "lz4"), ("blosc:lz4", "blosc"),
                                         ("zstd-dict:x", "zstd-dict"), ("none:3", "none")])
def test_a_bad_spec_shows_its_codecs_line_of_the_grammar(spec: str, codec: str) -> None:
    with pytest.raises(CodecSpecError) as caught:
        codec_from_spec(spec)
    assert str(caught.value).endswith(f"in spec {spec!r}; expected {spec_form(codec)}"), caught.value
    assert spec_form(codec) == ": ".join(SPEC_FORMS[codec])


def test_a_spec_naming_no_codec_shows_every_form() -> None:
    with pytest.raises(CodecSpecError) as caught:
        codec_from_spec("gzip:9")
    assert str(caught.value).endswith("; a spec is " + " | ".join(form for form, _ in SPEC_FORMS.values()))


def test_the_grammar_lists_every_form_with_its_meaning_wrapped_in_a_column() -> None:
    grammar = codec_grammar()
    assert all(len(line) <= GRAMMAR_WIDTH for line in grammar.splitlines())
    assert " ".join(grammar.split()) == " ".join(" ".join(pair) for pair in SPEC_FORMS.values())


def test_non_string_spec_raises_codec_spec_error() -> None:
    with pytest.raises(CodecSpecError):
        codec_from_spec(3)  # type: ignore[arg-type]


def test_dictionary_only_for_codecs_that_take_one(dictionary: bytes) -> None:
    with pytest.raises(CodecSpecError, match="'zstd:3'"):
        codec_from_spec("zstd:3", dictionary=dictionary)


def test_zstd_dict_without_dictionary_refuses_to_work(dictionary: bytes) -> None:
    codec = codec_from_spec("zstd-dict:3")
    assert codec.needs_dictionary and codec.level == 3  # type: ignore[attr-defined]
    with pytest.raises(CodecError):
        codec.encode(b"record")
    stored = codec_from_spec("zstd-dict:3", dictionary=dictionary).encode(b"record")
    with pytest.raises(CodecError):
        codec.decode(stored, 6)


def test_zstd_dict_needs_the_same_dictionary(records: list[bytes], dictionary: bytes) -> None:
    other = train_dictionary(records[1000:2200])
    assert other is not None and other != dictionary
    record = records[2100]
    stored = ZstdDictCodec(3, dictionary).encode(record)
    try:
        assert ZstdDictCodec(3, other).decode(stored, len(record)) != record
    except CodecError:
        pass


def test_constructor_validates_arguments() -> None:
    for build in (
        lambda: ZstdDictCodec(23),
        lambda: ZstdDictCodec(3, b""),
        lambda: Lz4Codec(0),
        lambda: Lz4Codec(True),
        lambda: Lz4Codec(segment_size=0),
        lambda: Lz4Codec(segment_size=SEGMENT_SIZE + 1),
        lambda: BloscCodec("nope", 5),
        lambda: BloscCodec("lz4", 10),
        lambda: BloscCodec("lz4", 5, "sideways"),
        lambda: BloscCodec("lz4", 5, "shuffle", 0),
    ):
        with pytest.raises(CodecSpecError):
            build()


def test_train_dictionary_is_deterministic(records: list[bytes], dictionary: bytes) -> None:
    again = train_dictionary([bytes(record) for record in records[:2000]])
    assert again == dictionary
    assert 256 <= len(dictionary) <= 112640


def test_train_dictionary_does_not_depend_on_the_cpu_count(records: list[bytes]) -> None:
    """The same samples trained in a process pinned to one CPU give the same dictionary as here."""
    samples = records[:400]
    script = (
        "import hashlib, os, pickle, sys\n"
        "from compressors import train_dictionary\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "samples = pickle.loads(sys.stdin.buffer.read())\n"
        "print(hashlib.sha256(train_dictionary(samples)).hexdigest())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], input=pickle.dumps(samples), capture_output=True, env=env, check=True
    )
    here = train_dictionary(samples)
    assert here is not None
    assert proc.stdout.decode().strip() == hashlib.sha256(here).hexdigest()


def test_train_dictionary_shrinks_to_a_tenth_of_the_samples(records: list[bytes]) -> None:
    samples = records[:200]
    trained = train_dictionary(samples)
    assert trained is not None
    assert len(trained) <= sum(map(len, samples)) // 10


@pytest.mark.parametrize("samples", [[], [b""], [b"x"], [b"tiny"] * 5, [b"hello world" * 10] * 3])
def test_train_dictionary_returns_none_when_it_cannot_train(samples: list[bytes]) -> None:
    assert train_dictionary(samples) is None


def test_dictionary_beats_plain_zstd_on_small_similar_records(records: list[bytes], dictionary: bytes) -> None:
    held_out = records[2000:]
    raw = sum(map(len, held_out))
    plain = codec_from_spec("zstd:3")
    with_dict = codec_from_spec("zstd-dict:3", dictionary=dictionary)
    plain_ratio = raw / sum(len(plain.encode(record)) for record in held_out)
    dict_ratio = raw / sum(len(with_dict.encode(record)) for record in held_out)
    assert dict_ratio > plain_ratio * 1.2, (plain_ratio, dict_ratio)


def test_blosc_auto_typesize_reads_npy_headers() -> None:
    floats64 = _npy_bytes(np.linspace(0, 1, 5000))
    int16 = _npy_bytes(np.arange(5000, dtype=np.int16))
    assert auto_typesize(floats64) == 8
    assert auto_typesize(int16) == 2
    assert auto_typesize(_npy_bytes(np.zeros(10, dtype="u1,f8"))) == 9
    assert auto_typesize(_npy_bytes(np.zeros(3, dtype="S300"))) == 4  # more than blosc can shuffle by
    assert auto_typesize(b"plain bytes") == 4
    assert auto_typesize(b"") == 4
    assert auto_typesize(b"\x93NUMPY\x01\x00\xff\xff garbage") == 4
    assert auto_typesize(b"\x93NUMPY\x09\x00") == 4
    auto = codec_from_spec("blosc:lz4:5:shuffle:auto")
    assert auto.encode(floats64) == codec_from_spec("blosc:lz4:5:shuffle:8").encode(floats64)
    assert auto.encode(b"x" * 1000) == codec_from_spec("blosc:lz4:5:shuffle:4").encode(b"x" * 1000)


def test_blosc_auto_typesize_reads_python2_and_torn_headers_without_a_word() -> None:
    """numpy's loader warns about a Python 2 header and lets a tokenizer error out of a torn one: the item size is
    read all the same, or the default taken, and nothing is written to stderr or raised."""
    floats64 = np.linspace(0, 1, 5000)
    torn = _npy_bytes(floats64)[:40] + b"((((" + _npy_bytes(floats64)[44:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert auto_typesize(python2_npy(floats64)) == 8
        assert auto_typesize(python2_npy(np.zeros((3, 4), dtype=np.int16))) == 2
        assert auto_typesize(torn) == 4
        assert auto_typesize(b"\x93NUMPY\x01\x00\x08\x00'''abcd\n" + bytes(64)) == 4  # an open string
        auto = codec_from_spec("blosc:lz4:5:shuffle:auto")
        assert auto.decode(auto.encode(torn), len(torn)) == torn


def test_threads_share_one_codec(codec: Codec) -> None:
    """8 threads encoding and decoding with the same instance at once all get the right bytes."""
    rng = random.Random(17)
    payloads = [rng.randbytes(rng.randint(0, 2000)) + b"abc" * rng.randint(0, 30000) for _ in range(16)]
    stored = [codec.encode(payload) for payload in payloads]
    start = threading.Barrier(8)

    def work(worker: int) -> bool:
        start.wait()
        for round_number in range(20):
            number = (worker + round_number) % len(payloads)
            payload = payloads[number]
            if codec.decode(stored[number], len(payload)) != payload:
                return False
            if round_number % 5 == 0 and codec.decode(codec.encode(payload), len(payload)) != payload:
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=3000), spec=st.sampled_from(SPECS))
def test_round_trip_any_bytes(dictionary: bytes, payload: bytes, spec: str) -> None:
    codec = make_codec(spec, dictionary)
    assert codec.decode(codec.encode(payload), len(payload)) == payload
