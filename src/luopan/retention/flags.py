"""``luopan prune``'s flags as retention rules: ``--keep-last N``, ``--keep-best N:METRIC[:min|max]``,
``--keep-every DURATION`` (luopan.units grammar: 24h, 7d, 1h30m), ``--keep-every-steps N``, ``--keep-tag TAG``."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import UsageError
from ..units import parse_duration
from .rules import (
    KeepBest,
    KeepEvery,
    KeepEverySteps,
    KeepLast,
    KeepTagged,
    Retention,
    RetentionRule,
)

__all__ = ["parse_duration", "parse_keep_best", "parse_keep_every_steps", "parse_keep_last", "rules_from_flags"]


def parse_keep_last(text: str | int) -> KeepLast:
    """``--keep-last N``: a positive integer."""
    return KeepLast(_parse_count("--keep-last", text, "N, a positive integer, e.g. 5"))


def parse_keep_every_steps(text: str | int) -> KeepEverySteps:
    """``--keep-every-steps N``: a positive integer (``_`` separators allowed: 10_000)."""
    return KeepEverySteps(_parse_count("--keep-every-steps", text, "N, a positive integer, e.g. 10000"))


def parse_keep_best(text: str) -> KeepBest:
    """``--keep-best N:METRIC[:min|max]``, e.g. ``3:loss:min`` or ``2:accuracy:max``; the mode defaults to min.

    The metric name may itself hold colons (``3:eval:loss:min``): the first field is N, a trailing ``min``/``max``
    is the mode, and what lies between is the metric.
    """
    form = "N:METRIC[:min|max], e.g. 3:loss:min or 2:accuracy:max"
    if not isinstance(text, str) or ":" not in text:
        raise UsageError(f"--keep-best takes {form}, got {text!r}")
    count, rest = text.split(":", 1)
    mode = "min"
    head, sep, tail = rest.rpartition(":")
    if sep and tail in ("min", "max"):
        rest, mode = head, tail
    elif sep and tail.lower() in ("min", "max", "minimize", "maximize", "lower", "higher"):
        raise UsageError(f"--keep-best: the mode must be 'min' or 'max' (lowercase), got {tail!r} in {text!r}")
    n = _parse_count("--keep-best", count, form)
    if not rest:
        raise UsageError(f"--keep-best: no metric name in {text!r}; it takes {form}")
    return KeepBest(n, rest, mode)


def rules_from_flags(*, keep_last: str | int | None = None, keep_best: Iterable[str] = (),
                     keep_every: Iterable[str] = (), keep_every_steps: Iterable[str | int] = (),
                     keep_tag: Iterable[str] = ()) -> Retention:
    """The `Retention` for ``luopan prune``'s flags (the repeatable ones as lists). Empty when none is given:
    `plan` then refuses with the no-rule message."""
    rules: list[RetentionRule] = []
    if keep_last is not None:
        rules.append(parse_keep_last(keep_last))
    rules.extend(parse_keep_best(t) for t in keep_best)
    rules.extend(KeepEvery(parse_duration(t)) for t in keep_every)
    rules.extend(parse_keep_every_steps(t) for t in keep_every_steps)
    rules.extend(KeepTagged(t) for t in keep_tag)
    return Retention(*rules)


def _parse_count(flag: str, text: object, form: str) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    elif isinstance(text, str) and re.fullmatch(r"\s*\d+(_\d+)*\s*", text):
        n = int(text)
    else:
        raise UsageError(f"{flag} takes {form}, got {text!r}")
    if n < 1:
        raise UsageError(f"{flag} takes {form}, got {text!r} (must be at least 1)")
    return n
