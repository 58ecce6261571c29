"""Human sizes on the command line (`64MiB`, `512K`, `1GB`), parsed in one place.

Follows coreutils: `K`, `M`, `G` and `KiB`, `MiB`, `GiB` are powers of 1024; `KB`, `MB`, `GB` powers of 1000.
"""

from __future__ import annotations

import re

from .errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(ib|b)?)?\s*(?:b|bytes?)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str, option: str = "size") -> int:
    """Bytes from `4096`, `64M`, `64MiB`, `1.5GB`; raises UsageError naming the option."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise UsageError(f"{option}: cannot read {text!r} as a size (try 64MiB, 512K or 1048576)")
    number, prefix, suffix = match.groups()
    value = float(number)
    if prefix:
        base = 1000 if (suffix or "").lower() == "b" else 1024
        value *= base ** _POWERS[prefix.lower()]
    if value < 1:
        raise UsageError(f"{option}: {text!r} must be at least one byte")
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
