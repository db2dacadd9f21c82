"""Argument checks shared by the save policies (and retention's rules): each returns the value or raises UsageError
naming the argument and what it must be."""

from __future__ import annotations

import math

from ..errors import UsageError


def _number(what: str, value: object, expected: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise UsageError(f"{what} must be {expected}, got {value!r}")
    return float(value)


def _positive_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{what} must be a positive int, got {value!r}")
    return value


def _non_negative_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"{what} must be an int >= 0, got {value!r}")
    return value


def _positive_float(what: str, value: object, allow_inf: bool = False) -> float:
    expected = "a number > 0" if allow_inf else "a finite number > 0"
    v = _number(what, value, expected)
    if v <= 0 or (math.isinf(v) and not allow_inf):
        raise UsageError(f"{what} must be {expected}, got {value!r}")
    return v


def _non_negative_float(what: str, value: object) -> float:
    v = _number(what, value, "a finite number >= 0")
    if v < 0 or math.isinf(v):
        raise UsageError(f"{what} must be a finite number >= 0, got {value!r}")
    return v


def _fraction(what: str, value: object, allow_one: bool = False) -> float:
    expected = f"a fraction in (0, 1{']' if allow_one else ')'}"
    v = _number(what, value, expected)
    if not (0 < v < 1 or (allow_one and v == 1)):
        raise UsageError(f"{what} must be {expected}, got {value!r}")
    return v


def _metric_name(who: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise UsageError(f"{who}: metric must be the name of a metric (a non-empty str), got {name!r}")
    return name
