"""Human sizes on the command line (`64MiB`, `512K`, `1GB`), parsed in one place; and sizes and counts as every
command prints them, formatted in one place.

Parsing follows coreutils: `K`, `M`, `G` and `KiB`, `MiB`, `GiB` are powers of 1024; `KB`, `MB`, `GB` powers of
1000. Printing uses one unit family, SI's powers of 1000 (kB, MB, GB), as the speeds beside the sizes do (MB/s):
a size and a speed on one line then divide without a conversion, and --fit 500GB reads back as 500 GB. An option's
own value is echoed as the option takes it (`--chunk-size 64MiB`), exactly: see size_option.
"""

from __future__ import annotations

import math
import re

from ..errors import UsageError, quoted

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(ib|b)?)?\s*(?:b|bytes?)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


class _TooLarge(UsageError):
    """A number past a float's range (400 digits): parse_rate passes it on as it is, not as one it cannot read."""


def parse_size(text: str, option: str = "size", minimum: int = 1) -> int:
    """Bytes from `4096`, `64M`, `64MiB`, `1.5GB`; raises UsageError naming the option."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise UsageError(f"{option}: cannot read {quoted(text)} as a size (try 64MiB, 512K or 1048576)")
    number, prefix, suffix = match.groups()
    value = float(number)
    if prefix:
        base = 1000 if (suffix or "").lower() == "b" else 1024
        value *= base ** _POWERS[prefix.lower()]
    if not math.isfinite(value):  # float() of 400 digits is inf, which int() cannot take
        raise _TooLarge(f"{option}: {quoted(text)} is too large to be a size")
    if not prefix and not value.is_integer():
        raise UsageError(f"{option}: {quoted(text)} is not a whole number of bytes (a fraction takes a unit: 1.5MB)")
    if value < minimum:
        raise UsageError(f"{option}: {quoted(text)} must be at least {minimum} byte{'s' if minimum != 1 else ''}")
    return int(value)


_SI_UNITS = ("kB", "MB", "GB", "TB", "PB")


def format_bytes(count: float) -> str:
    """A byte count a person reads at a glance, in SI units to three significant digits: 17 B, 6.1 kB, 12.7 MB,
    950 MB, 1.5 GB. (selector.units.decimal_bytes prints the same: the selector knows nothing of fanstore.)"""
    value = float(count)
    if abs(round(value)) < 1000:
        return f"{value:.0f} B"
    for unit in _SI_UNITS:
        value /= 1000
        if abs(float(f"{value:.3g}")) < 1000:  # 999.96 kB would round to 1e+03 kB: it is 1 MB
            return f"{value:.3g} {unit}"
    return f"{value:,.0f} {_SI_UNITS[-1]}"


# Exact units for echoing an option's value, largest first; a value that is none of their multiples is echoed
# in bytes.
_EXACT_UNITS = (("TiB", 1 << 40), ("TB", 10**12), ("GiB", 1 << 30), ("GB", 10**9), ("MiB", 1 << 20),
                ("MB", 10**6), ("KiB", 1 << 10), ("kB", 10**3))


def size_option(count: int) -> str:
    """A size as a SIZE option takes it and gives it back exactly: 64MiB, 500GB, 4097 (what parse_size reads as
    `count`), for echoing options: `--chunk-size 64MiB`, where format_bytes would say 67.1 MB."""
    for unit, scale in _EXACT_UNITS:
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return str(count)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and the noun it takes: 1 file, 2 files, 1,883 files (`nouns` where adding an s is wrong)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


_RATE_RE = re.compile(r"^\s*(.+?)\s*/\s*s(?:ec)?\s*$", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")


def parse_rate(text: str, option: str = "rate") -> float:
    """Bytes per second from `800MB/s`, `1.5GiB/s`, `200B/s`, `0` (no requirement); raises UsageError naming the
    option. A number without a unit is refused unless it is 0: `--budget 800` read as 800 bytes/s was met by every
    codec, and the selection printed 'budget 0 MB/s' for what was meant as 800 MB/s."""
    match = _RATE_RE.match(str(text))
    body = match.group(1) if match else str(text)
    try:
        rate = float(parse_size(body, option, minimum=0))  # 0 (or 0MB/s): no requirement
    except _TooLarge:
        raise UsageError(f"{option}: {quoted(text)} is too large to be a throughput") from None
    except UsageError:
        raise UsageError(f"{option}: cannot read {quoted(text)} as a throughput (try 800MB/s or 1GiB/s)") from None
    if rate and _BARE_NUMBER_RE.match(body):
        raise UsageError(f"{option}: {quoted(text)} has no unit: write {body.strip()}MB/s, {body.strip()}B/s or "
                         "another unit (0 alone means no floor)")
    return rate


def parse_fraction(text: str, option: str = "fraction") -> float:
    """A fraction from `2%` or `0.02`, in (0, 1]; raises UsageError naming the option."""
    value = str(text).strip()
    try:
        fraction = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise UsageError(f"{option}: cannot read {quoted(text)} as a fraction (try 2% or 0.02)") from None
    if not 0 < fraction <= 1:
        raise UsageError(f"{option}: {quoted(text)} must be more than 0% and at most 100%")
    return fraction
