"""Human sizes on the command line (`64MiB`, `512K`, `1GB`), parsed in one place.

Follows coreutils: `K`, `M`, `G` and `KiB`, `MiB`, `GiB` are powers of 1024; `KB`, `MB`, `GB` powers of 1000.
"""

from __future__ import annotations

import re

from .errors import UsageError, quoted

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(ib|b)?)?\s*(?:b|bytes?)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


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
    if value < minimum:
        raise UsageError(f"{option}: {quoted(text)} must be at least {minimum} byte{'s' if minimum != 1 else ''}")
    return int(value)


def format_bytes(count: float) -> str:
    """A byte count a person reads at a glance: 1.5 GiB, 12.0 KiB, 17 B."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count:.1f} PiB"


_RATE_RE = re.compile(r"^\s*(.+?)\s*/\s*s(?:ec)?\s*$", re.IGNORECASE)


def parse_rate(text: str, option: str = "rate") -> float:
    """Bytes per second from `800MB/s`, `1.5GiB/s`, `0` (no requirement); raises UsageError naming the option."""
    match = _RATE_RE.match(str(text))
    body = match.group(1) if match else str(text)
    if body.strip() == "0":
        return 0.0
    try:
        return float(parse_size(body, option))
    except UsageError:
        raise UsageError(f"{option}: cannot read {quoted(text)} as a throughput (try 800MB/s or 1GiB/s)") from None


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
