"""Byte sizes and durations, parsed and formatted in one place for the whole package and the CLI.

**Durations** (``parse_duration``): one or more terms, each a number (digits with an optional decimal point: ``90``,
``1.5``, ``.5``; no sign, no exponent, no separators), optional spaces, then a unit; terms add up and may be
separated by spaces. Case does not matter. Units: ``s``, ``sec``, ``secs``, ``second``, ``seconds``; ``m``, ``min``,
``mins``, ``minute``, ``minutes``; ``h``, ``hr``, ``hrs``, ``hour``, ``hours``; ``d``, ``day``, ``days``; ``w``,
``week``, ``weeks``. So ``24h``, ``24 h``, ``7d``, ``90m``, ``45 min``, ``1h30m``, ``1h 30m``, ``2 weeks`` and
``0.5s`` are durations; ``24`` (no unit), ``1e3s`` (exponent), ``-1h``, ``24x`` and ``0h`` (not positive) are not.
A bare number is never a duration here: a caller that takes seconds as a number (``--grace 0``) checks for one
itself.

**Sizes** (``parse_bytes``): a number (exponents, ``_`` and ``,`` separators allowed: ``1.5e9``, ``4_096``), optional
spaces, then a unit, case-insensitive: none or ``B`` (bytes), ``KB``/``MB``/``GB``/``TB`` (powers of 10),
``KiB``/``MiB``/``GiB``/``TiB`` (powers of 2). At least one byte; fractions of a byte are dropped.

**Formatting**: ``format_duration`` writes what ``parse_duration`` reads (``90s`` -> ``1m30s``, ``24h``, ``7d``,
``0.25s``): whole seconds from a minute on, three significant digits below; ``format_bytes`` writes binary units
(``1.5 MiB``, as luopan reports sizes) or, with ``decimal=True``, decimal ones (``70.0 GB``, as ``luopan plan``
and the reference article). Both outputs parse back.

Errors are `UsageError` (a ValueError); callers that report another luopan error (``luopan plan``:
PlanInputError) convert it, keeping the message.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from .errors import UsageError

__all__ = ["BYTE_UNITS", "DURATION_UNITS", "format_bytes", "format_duration", "format_seconds", "parse_bytes",
           "parse_duration"]

# --- durations ---------------------------------------------------------------------------------------------------

_MINUTE, _HOUR, _DAY, _WEEK = 60, 3600, 86400, 604800
DURATION_UNITS: dict[str, int] = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), _MINUTE),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), _HOUR),
    **dict.fromkeys(("d", "day", "days"), _DAY),
    **dict.fromkeys(("w", "week", "weeks"), _WEEK),
}
_DURATION_FORM = "a number and a unit, e.g. 24h, 7d, 90m, 3600s or 1h30m (units s, m/min, h, d, w)"
_TERM = re.compile(r"\s*(\d*\.?\d+)\s*([a-z]*)")


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """Seconds from a duration such as ``"24h"``, ``"45 min"``, ``"1h30m"`` or ``"2 weeks"`` (module docstring).

    Must be > 0 (``>= 0`` with ``allow_zero``) and finite. Raises UsageError saying what is wrong.
    """
    if not isinstance(text, str):
        raise UsageError(f"a duration must be a str: {_DURATION_FORM}; got {text!r}")
    s = text.strip().lower()
    pos, total = 0, 0.0
    while pos < len(s):
        m = _TERM.match(s, pos)
        if not m:
            break
        number, unit = m.groups()
        if not unit:
            if m.end() == len(s):
                raise UsageError(f"duration {text!r}: a unit is missing (the unit is required); write "
                                 f"{_DURATION_FORM}")
            break
        if unit not in DURATION_UNITS:
            if unit == "e" and m.end() < len(s) and s[m.end()] in "0123456789+-":
                raise UsageError(f"duration {text!r}: exponents are not accepted; write {_DURATION_FORM}")
            raise UsageError(f"duration {text!r}: unknown unit {unit!r}; write {_DURATION_FORM}")
        total += float(number) * DURATION_UNITS[unit]
        pos = m.end()
    if not s or pos != len(s):
        raise UsageError(f"{text!r} is not a duration; write {_DURATION_FORM}")
    if not math.isfinite(total):
        raise UsageError(f"duration {text!r} is too long")
    if total < 0 or (total == 0 and not allow_zero):
        raise UsageError(f"duration {text!r} must be positive (longer than zero)")
    return total


def format_duration(seconds: float) -> str:
    """A duration for people, in the grammar `parse_duration` reads: ``0.25s``, ``4s``, ``1m30s``, ``13m51s``,
    ``1h30m``, ``24h``, ``36h``, ``2d``, ``7d``, ``2d12h``.

    Below a minute, three significant digits; from a minute on, whole seconds (rounded) split into hours, minutes
    and seconds, zero parts left out, with whole days from two days on. Negative: a leading ``-``; not finite:
    ``inf``/``nan``.
    """
    if not math.isfinite(seconds):
        return str(float(seconds))
    if seconds < 0:
        return "-" + format_duration(-seconds)
    short = Decimal(f"{seconds:.3g}")
    if short < 60:
        return f"{short:f}s"
    s = int(seconds + 0.5)
    parts = []
    if s >= 2 * _DAY:
        q, s = divmod(s, _DAY)
        parts.append(f"{q}d")
    for unit, size in (("h", _HOUR), ("m", _MINUTE), ("s", 1)):
        if s >= size:
            q, s = divmod(s, size)
            parts.append(f"{q}{unit}")
    return "".join(parts)


def format_seconds(seconds: float) -> str:
    """A duration as a count of seconds, for tables comparing them (``luopan plan``'s time per save, written as
    the reference article does): ``140 s``, ``1,400 s``, ``0.28 s``, ``5 ms``."""
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds >= 0.01 else f"{seconds * 1000:.2g} ms"
    return f"{seconds:,.0f} s"


# --- byte sizes --------------------------------------------------------------------------------------------------

BYTE_UNITS: dict[str, int] = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_FORM = "256MiB, 1GB or 4096"
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)")


def parse_bytes(text: str) -> int:
    """Bytes from a size such as ``"256MiB"``, ``"1GB"``, ``"1.5 GiB"`` or ``"4096"`` (module docstring).

    Decimal units are powers of 10, ``…iB`` powers of 2. At least one byte. Raises UsageError.
    """
    if not isinstance(text, str):
        raise UsageError(f"a size is a str such as {_BYTES_FORM}, got {text!r}")
    m = _SIZE.fullmatch(text.strip().replace("_", "").replace(",", ""))
    if not m:
        raise UsageError(f"{text!r} is not a size; write it like {_BYTES_FORM}")
    unit = m.group(2).lower()
    if unit not in BYTE_UNITS:
        raise UsageError(f"{text!r}: unknown unit {m.group(2)!r}; use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB")
    value = float(m.group(1)) * BYTE_UNITS[unit]
    if not math.isfinite(value):
        raise UsageError(f"{text!r}: the size is too large")
    n = int(value)
    if n < 1:
        raise UsageError(f"{text!r}: the size must be at least one byte")
    return n


def format_bytes(n: float, *, decimal: bool = False) -> str:
    """A size for people: binary units by default (``512 B``, ``1.5 MiB``, ``7.7 GiB``), decimal ones with
    ``decimal=True`` (``70.0 GB``). Whole bytes below one unit, one decimal above, TiB/TB at most."""
    base, units = (1000, ("B", "KB", "MB", "GB", "TB")) if decimal else (1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable")
