"""Retention rules: each chooses checkpoints to keep, with a reason; a `Retention` is their union (``a | b``).

`KeepLast`, `KeepBest`, `KeepEvery` (fixed time buckets), `KeepEverySteps` (step buckets) and `KeepTagged`; the
package docstring (luopan.retention) says what each keeps and why the time buckets are anchored.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from ..errors import ArgumentTypeError, UsageError
from ..policies.checks import _positive_int
from ..units import format_duration
from .checkpoint import Checkpoint, parse_time

__all__ = ["EPOCH", "KeepBest", "KeepEvery", "KeepEverySteps", "KeepLast", "KeepTagged", "Retention",
           "RetentionRule", "Rules"]

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


class RetentionRule(ABC):
    """Chooses checkpoints to keep, each with a short reason."""

    @abstractmethod
    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        """step -> reason for every checkpoint this rule keeps. ``checkpoints`` is sorted by step, steps unique."""

    @abstractmethod
    def describe(self) -> str:
        """One line saying what this rule keeps."""

    def __or__(self, other: object) -> Retention:
        if not isinstance(other, RetentionRule):
            return NotImplemented
        return Retention(*_members(self), *_members(other))


class Retention(RetentionRule):
    """The union of its rules: a checkpoint is kept when any rule keeps it (with every rule's reason)."""

    def __init__(self, *rules: RetentionRule) -> None:
        for r in rules:
            if not isinstance(r, RetentionRule):
                raise ArgumentTypeError(f"Retention takes retention rules (KeepLast, KeepBest, ...), got "
                                        f"{type(r).__name__}: {r!r}")
        self.rules: tuple[RetentionRule, ...] = tuple(m for r in rules for m in _members(r))

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        return {step: reasons[0] for step, reasons in self.reasons(checkpoints).items()}

    def reasons(self, checkpoints: Sequence[Checkpoint]) -> dict[int, list[str]]:
        """step -> every rule's reason, in rule order."""
        out: dict[int, list[str]] = {}
        for r in self.rules:
            for step, reason in r.keep(checkpoints).items():
                out.setdefault(step, []).append(reason)
        return out

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.rules) if self.rules else "nothing"

    def __repr__(self) -> str:
        return " | ".join(repr(r) for r in self.rules) if self.rules else "Retention()"


class KeepLast(RetentionRule):
    """Keeps the ``n`` highest steps."""

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepLast: n", n)

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        newest_first = sorted((c.step for c in checkpoints), reverse=True)[: self.n]
        return {step: f"latest #{i}" for i, step in enumerate(newest_first, 1)}

    def describe(self) -> str:
        return f"the last {self.n}"

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepBest(RetentionRule):
    """Keeps the ``n`` best values of ``metric``; missing, non-numeric and non-finite values never count.

    ``mode="min"`` ranks the lowest value first, ``"max"`` the highest; equal values rank the higher step first.
    """

    def __init__(self, n: int, metric: str, mode: str = "min") -> None:
        self.n = _positive_int("KeepBest: n", n)
        if not isinstance(metric, str) or not metric:
            raise UsageError(f"KeepBest: metric must be the name of a metric (a non-empty str), got {metric!r}")
        if mode not in ("min", "max"):
            raise UsageError(f"KeepBest: mode must be 'min' (lower is better) or 'max' (higher is better), "
                             f"got {mode!r}")
        self.metric, self.mode = metric, mode

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((sign * v, -c.step) for c in checkpoints if (v := c.metric(self.metric)) is not None)
        return {-neg_step: f"best {self.metric} #{i}" for i, (_, neg_step) in enumerate(ranked[: self.n], 1)}

    def describe(self) -> str:
        return f"the best {self.n} by {self.metric} ({'lowest' if self.mode == 'min' else 'highest'})"

    def __repr__(self) -> str:
        return f"KeepBest({self.n}, {self.metric!r}, {self.mode!r})"


class KeepEvery(RetentionRule):
    """Keeps the newest checkpoint of each fixed time bucket of ``seconds``.

    Checkpoint ``c`` is in bucket ``floor((c.created - anchor) / seconds)``, computed exactly in whole microseconds
    (``seconds`` is rounded to a microsecond; it must be at least one). ``anchor`` defaults to the Unix epoch, UTC,
    so 24h buckets are UTC days and 1h buckets clock hours. Newest: the latest ``created``; the higher step among
    equal times.
    """

    def __init__(self, seconds: float, *, anchor: datetime | None = None) -> None:
        if isinstance(seconds, timedelta):
            seconds = seconds.total_seconds()
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            raise UsageError(f"KeepEvery: seconds must be a finite number > 0, got {seconds!r}")
        try:
            self.period = timedelta(seconds=seconds)
        except OverflowError:
            raise UsageError(f"KeepEvery: seconds {seconds!r} is too long a period") from None
        if self.period < _MICROSECOND:
            raise UsageError(f"KeepEvery: seconds must be at least one microsecond, got {seconds!r}")
        self.seconds = self.period.total_seconds()
        self.anchor = EPOCH if anchor is None else parse_time(anchor)

    def bucket(self, created: datetime) -> int:
        return (created - self.anchor) // self.period

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        newest: dict[int, Checkpoint] = {}
        for c in checkpoints:
            b = self.bucket(c.created)
            cur = newest.get(b)
            if cur is None or (c.created, c.step) > (cur.created, cur.step):
                newest[b] = c
        return {c.step: f"every {format_duration(self.seconds)}" for c in newest.values()}

    def describe(self) -> str:
        at = "" if self.anchor == EPOCH else f" from {self.anchor.isoformat()}"
        return f"the newest in each {format_duration(self.seconds)}{at}"

    def __repr__(self) -> str:
        at = "" if self.anchor == EPOCH else f", anchor={self.anchor.isoformat()!r}"
        return f"KeepEvery({self.seconds:g}{at})"


class KeepEverySteps(RetentionRule):
    """Keeps the highest step of each step bucket ``floor(step / n)``: ``[0, n)``, ``[n, 2n)``, ..."""

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepEverySteps: n", n)

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        highest: dict[int, int] = {}
        for c in checkpoints:
            b = c.step // self.n
            highest[b] = max(highest.get(b, c.step), c.step)
        return {step: f"every {self.n} steps" for step in highest.values()}

    def describe(self) -> str:
        return f"the highest step in each {self.n} steps"

    def __repr__(self) -> str:
        return f"KeepEverySteps({self.n})"


class KeepTagged(RetentionRule):
    """Keeps every checkpoint carrying ``tag``."""

    def __init__(self, tag: str) -> None:
        if not isinstance(tag, str) or not tag:
            raise UsageError(f"KeepTagged: tag must be a non-empty str, got {tag!r}")
        self.tag = tag

    def keep(self, checkpoints: Sequence[Checkpoint]) -> dict[int, str]:
        return {c.step: f"tag {self.tag}" for c in checkpoints if self.tag in c.tags}

    def describe(self) -> str:
        return f"those tagged {self.tag!r}"

    def __repr__(self) -> str:
        return f"KeepTagged({self.tag!r})"


def _members(rule: RetentionRule) -> tuple[RetentionRule, ...]:
    return rule.rules if isinstance(rule, Retention) else (rule,)


def _rule_list(rules: Any) -> list[RetentionRule]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise ArgumentTypeError(f"plan takes a retention rule or an iterable of them, got {type(rules).__name__}: "
                                f"{rules!r}")
    return list(rules)


Rules = RetentionRule | Iterable[RetentionRule]  # what prune, CheckpointManager and local_retention accept
