"""Ratio, encode speed and decode throughput of each candidate codec on one kind's sample, on this machine.

Everything is measured the way the packer stores and the reader decodes, so the numbers predict the packed
dataset: each file is encoded on its own and stored raw (codec `none`) when that is not smaller; decoding goes file
by file, one `decode(stored, raw_size)` call each, per-call overhead included, single-threaded, in this process,
each file right after its stored bytes are checksummed, as `Reader.read` verifies them before decoding.

Decoding is timed on the thread's CPU clock, the best of a few passes: another process on the machine takes wall
time from the measuring thread but not CPU time, so a loaded machine measures the speeds a quiet one does (within a
few percent) and a choice near the budget does not flip with the load (policy.py names settings within
DECODE_NOISE of it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import blosc
import xxhash

from compressors import (
    DICT_TRAIN_FILE_BYTES,
    DICT_TRAIN_FILES,
    DICT_TRAIN_TOTAL_BYTES,
    Codec,
    CodecError,
    codec_from_spec,
    train_dictionary,
)
from compressors.kinds import NPY, OTHER

from .bound import StoredEstimate, stored_estimate
from .errors import SelectionError
from .sample import SampleFile

MB = 1e6  # throughputs are in MB/s of raw bytes, as budgets are usually given
DEFAULT_REPEATS = 3
# What one zstd dictionary training costs whatever its bytes (its tables), on the 2-core development machine. JPEG
# heads: 0.12 MB trained in 20 ms, 0.6 MB in 36 ms, 2.5 MB in 82 ms, 10 MB in 0.32 s, 20 MB in 0.47 s; timed per
# byte alone, the selector's small trainings predicted a pack's training on a few MB of JPEG heads two to five
# times too long: hence a fixed cost, and n log n. Shared libraries (site-packages' `other`) show less of one: 0.32
# MB in 29 ms, 10 MB in 0.97 s, and a pack's 19.2 MB in 1.46-1.72 s where the selector's two trainings of 0.64 MB
# took 0.099-0.109 s. With 20 ms here the estimate said 1.13-1.15 s; with 10 ms it says 1.4-1.5 s.
TRAIN_FIXED_SECONDS = 0.01
# Encoders this slow (zstd's btultra levels) would dominate the selection time: they are measured on a random
# prefix of the kind's sample this large. Deterministic, so the same sample gives the same ratios.
SLOW_SPEC_BYTES = 4 << 20
_SLOW_ZSTD_LEVEL = 16
_SLOW_BLOSC_ZSTD_LEVEL = 7  # blosc's zstd level 7 is zstd 13, 9 is zstd 22
_SLOW_LZ4_HC_LEVEL = 10
_MIN_SECONDS = 1e-9  # a timer that read zero must not make a throughput infinite (JSON has no infinity)
# How far apart two measurements of one decoder's speed fall: on the 2-core development machine, decoding JPEG and
# text samples with lz4, zstd and zstd-dict, timed on the thread's CPU clock as the best of DEFAULT_REPEATS passes,
# three quiet runs and three with both cores busy with other processes differed by up to 15% (wall-clock time
# halved under the load). A speed within this share above the budget is not told apart from one below it.
DECODE_NOISE = 0.15
# A timed pass over a small sample is repeated within the pass until it lasts this long, so that timer resolution
# and one-off interruptions do not decide the throughput.
MIN_PASS_SECONDS = 0.005
_MAX_LOOPS = 1000
# The timer is read once per this many files (or stored bytes), not per file: a timer call costs as much as
# decoding a small file from a fast codec. Small enough that a batch stays in the core's own cache.
READ_PATH_BATCH_FILES = 16
READ_PATH_BATCH_BYTES = 256 << 10
_DecodeWork = tuple[Callable[[bytes, int], bytes], bytes, int]  # (decode, stored bytes, raw size) of one file
_Encoded = tuple[int, float]  # (stored bytes, encode seconds) of one file

_BASE_SPECS = (
    "none", "lz4", "lz4:hc:9",
    "zstd:1", "zstd:3", "zstd:6", "zstd:9", "zstd:15", "zstd:19",
    "zstd-dict:3", "zstd-dict:9", "zstd-dict:19",
)
# Shuffling only helps fixed-size elements: arrays, and unknown binary data, which is often arrays without a header.
_BLOSC_SPECS = tuple(
    f"blosc:{inner}:{level}:{shuffle}:auto"
    for inner, level in (("lz4", 5), ("lz4", 9), ("zstd", 1), ("zstd", 5))
    for shuffle in ("shuffle", "bitshuffle")
)
_BLOSC_KINDS = (NPY, OTHER)


def _n_log_n(n: float) -> float:
    return n * math.log2(max(n, 2.0))


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """One codec setting on one kind's sample. `files` and `raw_bytes` say what was measured (slow settings: a
    prefix); `stored_bytes` counts files that did not shrink at their raw size, as the packer stores them, and is
    what `raw_bytes` would store in SRC's mix: each file weighted by the bytes of the tree it stands for
    (SampleFile.weight), as the encode speed is too. `stored_rse` is the sampling error of the kind's stored bytes
    in SRC as a share of them (bound.py): the prediction's confidence bound is BOUND_Z of it above."""

    kind: str
    spec: str
    files: int
    raw_bytes: int
    stored_bytes: int
    encode_mbps: float
    decode_mbps: float
    raw_files: int = 0  # files stored as they are because the codec did not make them smaller
    dict_bytes: int = 0  # size of the trained dictionary (zstd-dict), stored once per dataset, not in stored_bytes
    # zstd-dict: the seconds its two dictionaries took to train, and the bytes they were trained on. The packer
    # trains one per group on up to DICT_TRAIN_TOTAL_BYTES, one after another, and at high levels that can take
    # longer than compressing the whole kind: the pack-time estimate scales this figure to the packer's bytes.
    train_seconds: float = 0.0
    train_bytes: int = 0
    stored_rse: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def train_seconds_for(self, train_bytes: int, dictionaries: int) -> float:
        """Seconds the packer takes to train `dictionaries` dictionaries on `train_bytes` in all with this setting
        (0 when it trains none), scaled from the selector's two trainings: each costs TRAIN_FIXED_SECONDS and then
        grows as n log n in its bytes n (zstd's COVER trainer sorts the suffixes of its input). The selector's
        trainings are small, so most of their time can be the fixed cost: at least a quarter of it counts as
        growing work, in case this machine is faster than the one TRAIN_FIXED_SECONDS was measured on."""
        if not self.train_bytes or not train_bytes or dictionaries < 1:
            return 0.0
        growing = max(self.train_seconds - 2 * TRAIN_FIXED_SECONDS, self.train_seconds / 4)
        per_unit = growing / _n_log_n(self.train_bytes / 2) / 2
        return dictionaries * (TRAIN_FIXED_SECONDS + per_unit * _n_log_n(train_bytes / dictionaries))

    @property
    def saving(self) -> float:
        """The share of the raw bytes the codec saves: what capacity is gained."""
        return 1.0 - self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["encode_mbps"] = round(self.encode_mbps, 3)
        record["decode_mbps"] = round(self.decode_mbps, 3)
        record["train_seconds"] = round(self.train_seconds, 4)
        record["stored_rse"] = round(self.stored_rse, 5)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Measurement:
        return cls(**{name: record[name] for name in cls.__dataclass_fields__ if name in record})


def candidate_specs(kind: str) -> list[str]:
    """The grid of settings measured for a kind: every codec over a few levels, zstd with and without a trained
    dictionary, and for arrays blosc with byte and bit shuffle (typesize read from the .npy header)."""
    return list(_BASE_SPECS + (_BLOSC_SPECS if kind in _BLOSC_KINDS else ()))


def is_slow_spec(spec: str) -> bool:
    """Whether a setting encodes so slowly that it is measured on a sub-sample (see SLOW_SPEC_BYTES)."""
    codec = codec_from_spec(spec)
    level = getattr(codec, "level", 0)
    if codec.name in ("zstd", "zstd-dict"):
        return level >= _SLOW_ZSTD_LEVEL
    if codec.name == "blosc":
        return getattr(codec, "inner", "") == "zstd" and level >= _SLOW_BLOSC_ZSTD_LEVEL
    if codec.name == "lz4":
        return (getattr(codec, "hc_level", None) or 0) >= _SLOW_LZ4_HC_LEVEL
    return False


def measure_kind(
    kind: str, files: list[SampleFile], specs: Sequence[str], repeats: int = DEFAULT_REPEATS,
    on_failed: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """One Measurement per spec (in the order given) on `files`, the sample of one kind.

    A zstd-dict setting is left out when the sample is too small to train a dictionary on: the packer would then
    use plain zstd at that level, which the grid measures anyway. A setting whose codec fails on the sample (raises,
    or does not give back the bytes it was given) is left out too, and `on_failed` told why: a broken codec must
    not be chosen, and must not stop the others from being measured.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SelectionError(f"repeats: decode passes must be a positive integer, got {repeats!r}")
    files = [f for f in files if f.data]
    if not files:
        return []
    subsets = {spec: _prefix(files, SLOW_SPEC_BYTES) if is_slow_spec(spec) else files for spec in specs}
    dictionaries = _train_dictionaries({spec: subset for spec, subset in subsets.items()
                                        if codec_from_spec(spec).needs_dictionary})
    measurements = []
    encoded: dict[str, dict[int, _Encoded]] = {}  # per spec, per file (by id): its stored bytes and seconds
    with _single_threaded_blosc():
        for spec in specs:
            trained = dictionaries.get(spec)
            try:
                codecs, dict_bytes = _codecs_for(spec, subsets[spec], trained[:2] if trained else None)
                if codecs is None:
                    continue
                measurement, encoded[spec] = _measure(kind, spec, subsets[spec], codecs, dict_bytes, repeats)
            except Exception as exc:  # noqa: BLE001 - a codec library's failure, of whatever type: the setting is out
                if on_failed is not None:
                    on_failed(f"{spec} on {kind} files: {exc if isinstance(exc, CodecError) else repr(exc)}")
                continue
            if trained is not None:
                measurement = dataclasses.replace(measurement, train_seconds=trained[2], train_bytes=trained[3])
            measurements.append(measurement)
    return [_on_whole_sample(m, subsets[m.spec], files, measurements, encoded) for m in measurements]


def _on_whole_sample(measurement: Measurement, subset: list[SampleFile], files: list[SampleFile],
                     measurements: list[Measurement], encoded: dict[str, dict[int, _Encoded]]) -> Measurement:
    """A setting measured on a prefix of the sample (a slow one), carried over to the whole sample by a reference:
    the strongest setting of its codec measured on the whole. Each file stores what the reference stores it in,
    times what the setting stores of the reference's on the prefix (as it is where the reference did not shrink it),
    and encodes as much faster or slower as on the prefix. A prefix can compress better than its kind: one large
    file's pieces, random one MiB in three, gave zstd:19 ratio 4.00 on a prefix with fewer random ones, where every
    other setting measured 3.00; zstd:19 was chosen and the pack stored 45% more than predicted."""
    if len(subset) >= len(files) or not measurement.raw_bytes:
        return measurement
    name = codec_from_spec(measurement.spec).name
    references = [m for m in measurements if len(encoded[m.spec]) == len(files) and m.spec != measurement.spec
                  and codec_from_spec(m.spec).name == name]
    if not references:
        return measurement
    reference, own = encoded[references[-1].spec], encoded[measurement.spec]  # the grid's last is the strongest
    shrunk = [f for f in subset if reference[id(f)][0] < len(f.data)]
    relative = (sum(own[id(f)][0] for f in shrunk) / sum(reference[id(f)][0] for f in shrunk)) if shrunk else 1.0
    whole = stored_estimate(files, [len(f.data) if reference[id(f)][0] >= len(f.data)
                                    else min(len(f.data), reference[id(f)][0] * relative) for f in files])
    reference_seconds = sum(f.weight * reference[id(f)][1] for f in subset)
    own_seconds = sum(f.weight * own[id(f)][1] for f in subset)
    encode_mbps = (references[-1].encode_mbps * reference_seconds / own_seconds if reference_seconds > 0
                   and own_seconds > 0 else measurement.encode_mbps)
    return dataclasses.replace(measurement, stored_bytes=max(1, round(measurement.raw_bytes * whole.fraction)),
                               encode_mbps=encode_mbps)


@contextlib.contextmanager
def _single_threaded_blosc() -> Iterator[None]:
    """blosc decodes with a pool of its own threads (one per core by default); a measurement of one decoder must
    not borrow the other cores, which K prefetch threads or the trainer would be using."""
    previous = blosc.set_nthreads(1)
    try:
        yield
    finally:
        blosc.set_nthreads(previous)


def _prefix(files: list[SampleFile], limit: int) -> list[SampleFile]:
    """The first files up to `limit` bytes (at least one): a random sub-sample, since the sample is in seeded order.
    Files drawn for certain come first: each stands for itself alone, and a kind's bytes may be mostly one of them
    (a large file of random bytes among small compressible ones)."""
    prefix: list[SampleFile] = []
    total = 0
    for sample_file in sorted(files, key=lambda f: f.inclusion < 1.0):  # stable: the seeded order otherwise
        if prefix and total + len(sample_file.data) > limit:
            break
        prefix.append(sample_file)
        total += len(sample_file.data)
    return prefix


def _train_dictionaries(
    files_by_spec: dict[str, list[SampleFile]],
) -> dict[str, tuple[bytes | None, bytes | None, float, int]]:
    """Per zstd-dict spec, dictionaries trained on the even- and on the odd-numbered files (see `_codecs_for`), the
    seconds both trainings took and the bytes they were trained on (what the pack-time estimate scales).

    Training is the slowest step at high levels and zstd releases the GIL while training, so the dictionaries are
    trained in threads, one per core; the result does not depend on it (training itself is single-threaded), and
    each training is timed in its own thread, so on its own core.
    """
    jobs = [(spec, half, codec_from_spec(spec).level)  # type: ignore[attr-defined]
            for spec, files in files_by_spec.items() for half in (files[0::2], files[1::2])]
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(jobs), _usable_cores())) as pool:
        trained = list(pool.map(lambda job: _timed_train(job[1], job[2]), jobs))
    result = {}
    for number in range(0, len(jobs), 2):
        (even, even_seconds, even_bytes), (odd, odd_seconds, odd_bytes) = trained[number], trained[number + 1]
        result[jobs[number][0]] = (even, odd, even_seconds + odd_seconds, even_bytes + odd_bytes)
    return result


def _usable_cores() -> int:
    """The cores this process may run on (taskset and batch schedulers restrict them), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _codecs_for(
    spec: str, files: list[SampleFile], dictionaries: tuple[bytes | None, bytes | None] | None
) -> tuple[list[Codec] | None, int]:
    """The codec each file is encoded with, and the dictionary size (None: no dictionary could be trained).

    zstd-dict is cross-fitted: a dictionary trained on the even-numbered files encodes the odd ones and the other
    way round. Trained and measured on the same files, a dictionary memorises them and promises a ratio the packer,
    whose dictionary has seen only a small part of a large group, would not reach.
    """
    codec = codec_from_spec(spec)
    if not codec.needs_dictionary:
        return [codec] * len(files), 0
    if dictionaries is None:
        return None, 0
    trained_on_even, trained_on_odd = dictionaries
    if trained_on_even is None or trained_on_odd is None:
        return None, 0
    even_codec = codec_from_spec(spec, dictionary=trained_on_odd)
    odd_codec = codec_from_spec(spec, dictionary=trained_on_even)
    codecs = [even_codec if number % 2 == 0 else odd_codec for number in range(len(files))]
    return codecs, max(len(trained_on_even), len(trained_on_odd))


def _timed_train(files: list[SampleFile], level: int) -> tuple[bytes | None, float, int]:
    """A dictionary trained the way the packer trains one, on these files; the seconds it took and its input bytes."""
    samples: list[bytes] = []
    total = 0
    for sample_file in files[:DICT_TRAIN_FILES]:
        samples.append(sample_file.data[:DICT_TRAIN_FILE_BYTES])
        total += len(samples[-1])
        if total >= DICT_TRAIN_TOTAL_BYTES:
            break
    if not samples:
        return None, 0.0, 0
    started = time.thread_time()  # this thread's CPU time: what the training costs, whatever else runs
    dictionary = train_dictionary(samples, level=level)
    return dictionary, time.thread_time() - started, total


def _measure(
    kind: str, spec: str, files: list[SampleFile], codecs: list[Codec], dict_bytes: int, repeats: int
) -> tuple[Measurement, dict[int, _Encoded]]:
    """The setting measured on `files`, and each file's stored bytes and encode seconds (by id)."""
    none = codec_from_spec("none")
    work: list[_DecodeWork] = []
    encoded: dict[int, _Encoded] = {}
    raw_files = 0
    clock = time.perf_counter
    weighted_raw = weighted_seconds = unweighted_seconds = 0.0
    for sample_file, codec in zip(files, codecs):
        # A piece is encoded as the packer encodes a block: with the codec the whole file would get (`for_file`).
        encoder = codec.for_file(sample_file.head) if sample_file.truncated else codec
        started = clock()
        try:
            stored = encoder.encode(sample_file.data)
        except Exception as exc:  # noqa: BLE001 - named with the file, for measure_kind to report
            raise CodecError(f"encoding {sample_file.path!r} failed: {exc}") from exc
        seconds = clock() - started
        if len(stored) >= len(sample_file.data):
            stored, codec = sample_file.data, none
            raw_files += 1
        work.append((codec.decode, stored, len(sample_file.data)))
        encoded[id(sample_file)] = (len(stored), seconds)
        weighted_raw += sample_file.weight * len(sample_file.data)
        weighted_seconds += sample_file.weight * seconds
        unweighted_seconds += seconds
    # One untimed pass checks every file comes back intact and warms the per-thread decoders, as a running
    # reader's are; then the timed passes, each decoding the whole sample `loops` times, the best of them counted.
    started = time.thread_time()
    for (decode, stored, raw_size), sample_file in zip(work, files):
        try:
            intact = decode(stored, raw_size) == sample_file.data
        except Exception as exc:  # noqa: BLE001 - named with the file, for measure_kind to report
            raise CodecError(f"decoding {sample_file.path!r} failed: {exc}") from exc
        if not intact:
            raise CodecError(f"decoding {sample_file.path!r} did not give back its bytes")
    check_seconds = time.thread_time() - started
    loops = min(_MAX_LOOPS, max(1, math.ceil(MIN_PASS_SECONDS / max(check_seconds, _MIN_SECONDS))))
    batches = read_path_batches(work)
    pass_seconds = []
    for _ in range(repeats):
        pass_seconds.append(sum(_timed_decode_pass(batches) for _ in range(loops)) / loops)
    raw_bytes = sum(len(sample_file.data) for sample_file in files)
    estimate = stored_estimate(files, [len(stored) for _, stored, _ in work])
    if weighted_raw <= 0 or estimate.raw <= 0:  # every weight 0: an estimate rounded away; the sample's own mix then
        weighted_raw, weighted_seconds = raw_bytes, unweighted_seconds
        estimate = StoredEstimate(raw_bytes, sum(len(stored) for _, stored, _ in work), 0.0)
    return Measurement(
        kind=kind,
        spec=spec,
        files=len({sample_file.path for sample_file in files}),
        raw_bytes=raw_bytes,
        stored_bytes=max(1, round(raw_bytes * estimate.fraction)),
        encode_mbps=weighted_raw / MB / max(weighted_seconds, _MIN_SECONDS),
        decode_mbps=raw_bytes / MB / max(min(pass_seconds), _MIN_SECONDS),
        raw_files=raw_files,
        dict_bytes=dict_bytes,
        stored_rse=estimate.relative_error,
    ), encoded


def read_path_batches(work: list[_DecodeWork]) -> list[list[_DecodeWork]]:
    """The files in order, cut into batches of READ_PATH_BATCH_FILES files or READ_PATH_BATCH_BYTES stored bytes."""
    batches: list[list[_DecodeWork]] = []
    batch: list[_DecodeWork] = []
    batch_bytes = 0
    for item in work:
        if batch and (len(batch) >= READ_PATH_BATCH_FILES or batch_bytes + len(item[1]) > READ_PATH_BATCH_BYTES):
            batches.append(batch)
            batch, batch_bytes = [], 0
        batch.append(item)
        batch_bytes += len(item[1])
    if batch:
        batches.append(batch)
    return batches


def _timed_decode_pass(batches: list[list[_DecodeWork]]) -> float:
    """CPU seconds this thread spent decoding every file once, each batch right after its stored bytes were
    checksummed (the clock's own cost taken off each reading).

    This is what the read path does (Reader.read verifies the xxh3 of a blob, then decodes it): the decoder reads
    bytes in cache, but its own tables and dictionary are no longer as warm as in a tight loop of decodes. Timed in
    a tight loop over the sample, both figures were off the packed dataset's: a sample larger than the cache came
    from memory (decoders that mostly copy, as on JPEGs, looked up to 2x slower, and varied with the memory
    layout), while dictionary codecs on small files promised 15-25% more.
    """
    checksum = xxhash.xxh3_64_intdigest
    clock, clock_cost = time.thread_time, _clock_cost()
    seconds = 0.0
    for batch in batches:
        for _, stored, _ in batch:
            checksum(stored)
        started = clock()
        for decode, stored, raw_size in batch:
            decode(stored, raw_size)
        seconds += max(0.0, clock() - started - clock_cost)
    return seconds


@functools.cache
def _clock_cost() -> float:
    """What one reading of the thread's CPU clock costs (a system call on some virtual machines: 0.8 us, as much as
    decoding a small file), the least of many."""
    clock = time.thread_time
    least = math.inf
    for _ in range(200):
        started = clock()
        least = min(least, clock() - started)
    return least
