"""How the selector writes sizes, times and counts in its reasons and tables: sizes as every fanstore command prints
them (fanstore.core.units; the selector knows nothing of fanstore, and tests/test_output.py holds the two equal)."""

from __future__ import annotations

import math


def format_seconds(seconds: float) -> str:
    """A time to three significant digits, so that short ones still compare: 0.000523, 0.25, 12.5, 1,234."""
    if seconds <= 0:
        return "0"
    rounded = float(f"{seconds:.3g}")  # 9.999 is 10.0, not 10.00
    if rounded >= 100:
        return f"{seconds:,.0f}"
    return f"{rounded:.{max(0, 2 - math.floor(math.log10(rounded)))}f}"


def decimal_bytes(count: float) -> str:
    """A size in SI units to three significant digits, as --fit and --budget are usually given: 10 GB, 12.3 GB,
    950 MB. The same text as fanstore.core.units.format_bytes, which every fanstore command prints sizes with (the
    selector knows nothing of fanstore; a test holds the two equal)."""
    value = float(count)
    if abs(round(value)) < 1000:
        return f"{value:.0f} B"
    for unit in _SI_UNITS:
        value /= 1000
        if abs(float(f"{value:.3g}")) < 1000:  # 999.96 kB would round to 1e+03 kB: it is 1 MB
            return f"{value:.3g} {unit}"
    return f"{value:,.0f} {_SI_UNITS[-1]}"


_SI_UNITS = ("kB", "MB", "GB", "TB", "PB")


# Exact units for echoing a size option, largest first (as fanstore.core.units.size_option; a test holds them equal).
_EXACT_UNITS = (("TiB", 1 << 40), ("TB", 10**12), ("GiB", 1 << 30), ("GB", 10**9), ("MiB", 1 << 20),
                ("MB", 10**6), ("KiB", 1 << 10), ("kB", 10**3))


def size_option(count: int) -> str:
    """A size as a SIZE option takes it, exactly: 10MB, 1.5TiB given as 1536GiB, 4097; for a command it suggests
    (`fanstore plan --local-capacity 10MB` after `--fit 10MB`), where the bytes would read 10000000."""
    for unit, scale in _EXACT_UNITS:
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return str(count)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and the noun it takes: 1 worker, 2 workers, 1,000 files (as fanstore.core.units.plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
