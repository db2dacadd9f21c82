"""Retention: which checkpoints of a run to keep, and why (the decision behind ``luopan prune``).

Pure decision logic, no I/O: the caller lists a run's committed checkpoints, asks for a `Plan`, shows it
(``--dry-run`` prints `Plan.describe`) and removes exactly ``plan.remove``::

    rules = KeepLast(5) | KeepBest(3, "loss") | KeepEvery(parse_duration("24h")) | KeepEverySteps(10_000)
    p = plan([Checkpoint.from_info(i, pinned=i.step in pins) for i in repo.checkpoints(run)], rules)
    for line in p.describe():
        print(line)
    ...remove p.remove...

Input. `Checkpoint` records: ``step`` (unique within the run), ``created`` (a timezone-aware datetime), ``metrics``,
``pinned`` and ``tags``. `Checkpoint.from_info` builds one from a ``CheckpointInfo`` (or anything with ``step``,
``created`` as an ISO-8601 string or datetime, and ``metrics``) plus the pin state, which the listing does not hold.
Only committed checkpoints may be passed: "newest" means the highest committed step, as ``Repo.load`` uses.

Rules, each a small object; what a combination keeps is the union of what its rules keep (``a | b`` or
``Retention(a, b)``):

- `KeepLast(n)`: the ``n`` highest steps (reason ``"latest #1"`` for the newest, ...).
- `KeepBest(n, metric, mode)`: the ``n`` best values of ``metric`` (``"min"``: lowest; ``"max"``: highest); a
  checkpoint whose metric is missing, not a number (str, bool, None) or not finite (NaN, ±inf) never counts; equal
  values rank the higher step first (reason ``"best loss #1"``).
- `KeepEvery(seconds)`: time buckets of fixed length, anchored at the Unix epoch (UTC) unless another ``anchor`` is
  given: checkpoint ``c`` is in bucket ``floor((c.created - anchor) / seconds)`` (exact, in whole microseconds), and
  the newest checkpoint of each bucket is kept; newest means the latest ``created``, the higher step among equal
  times. So ``24h`` keeps the last checkpoint of each UTC day, ``1h`` of each clock hour (reason ``"every 24h"``).
- `KeepEverySteps(n)`: step buckets ``floor(step / n)``: steps ``[0, n)``, ``[n, 2n)``, ...; the highest step of each
  bucket is kept (with saves every 500 steps, ``KeepEverySteps(10000)`` keeps 9500, 19500, ... and the newest).
- `KeepTagged(tag)`: every checkpoint carrying ``tag`` (reason ``"tag NAME"``).

Always kept, whatever the rules: the newest checkpoint (reason ``"newest"``) and pinned ones (``"pinned"``). Giving no
rule at all is refused with a ValueError rather than removing everything but the newest.

Why the time buckets are fixed (anchored at the epoch) rather than counted back from the newest checkpoint: prune is
run again and again as a run goes on. Buckets anchored at the newest checkpoint move with every new save, so two
survivors of an earlier prune, about one period apart, can later fall into one bucket and one of them goes: repeated
pruning erodes "one per 24h" into gaps of up to two days. Fixed buckets never move, so the survivor of a bucket stays
the survivor for good (only the newest bucket gains checkpoints), and a run pruned after every save keeps one
checkpoint for each period that ever held one.

Guarantees (tested): the protected categories (newest, pinned, the ``n`` latest of each `KeepLast`, the ``n`` best of
each `KeepBest`, the newest of each bucket) always survive; planning again on the survivors keeps the same
checkpoints for the same reasons and removes nothing (every rule's choice among a subset that still holds its winners
is those winners; the anchors do not depend on the checkpoints); the plan depends only on the set of checkpoints, not
their order.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from .errors import ArgumentTypeError, UsageError
from .policies import _positive_int

__all__ = [
    "Checkpoint",
    "KeepBest",
    "KeepEvery",
    "KeepEverySteps",
    "KeepLast",
    "KeepTagged",
    "Plan",
    "Retention",
    "RetentionRule",
    "check_metrics",
    "parse_duration",
    "parse_keep_best",
    "parse_keep_every_steps",
    "parse_keep_last",
    "plan",
    "rules_from_flags",
]

NO_RULE_MESSAGE = ("no keep rule given: this would remove every checkpoint but the newest; pass --keep-last N "
                   "or similar")

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


# --- input -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint, as retention sees it."""

    step: int
    created: datetime  # timezone-aware
    metrics: Mapping[str, Any] = field(default_factory=dict)
    pinned: bool = False
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise UsageError(f"Checkpoint: step must be an int >= 0, got {self.step!r}")
        if not isinstance(self.created, datetime):
            raise UsageError(f"Checkpoint {self.step}: created must be a datetime, got {self.created!r}")
        if self.created.tzinfo is None or self.created.utcoffset() is None:
            raise UsageError(f"Checkpoint {self.step}: created must be timezone-aware (e.g. UTC), got "
                             f"{self.created.isoformat()}")
        if isinstance(self.tags, str):
            raise UsageError(f"Checkpoint {self.step}: tags must be a tuple of str, got the str {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))

    @classmethod
    def from_info(cls, info: Any, *, pinned: bool = False, tags: Iterable[str] = ()) -> Checkpoint:
        """From a ``CheckpointInfo`` (or any object with ``step``, ``created`` and ``metrics``) and its pin state.

        ``created`` may be an ISO-8601 string (as manifests hold it; a trailing ``Z`` means UTC) or a datetime.
        """
        return cls(info.step, parse_time(info.created), dict(info.metrics or {}), bool(pinned), tuple(tags))

    def metric(self, name: str) -> float | None:
        """The metric as a finite float; None when missing, not a number (str, bool, None) or not finite."""
        value = self.metrics.get(name) if self.metrics else None
        if value is None or isinstance(value, (bool, str, bytes)):
            return None
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            return None
        return v if math.isfinite(v) else None


def parse_time(value: Any) -> datetime:
    """A timezone-aware datetime from a datetime or an ISO-8601 string (``Z`` accepted for UTC)."""
    if isinstance(value, datetime):
        t = value
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            t = datetime.fromisoformat(text)
        except ValueError:
            raise UsageError(f"created time {value!r} is not ISO-8601, e.g. 2024-05-01T12:00:00+00:00") from None
    else:
        raise UsageError(f"created time must be an ISO-8601 str or a datetime, got {value!r}")
    if t.tzinfo is None or t.utcoffset() is None:
        raise UsageError(f"created time {value!r} has no timezone: give one, e.g. +00:00 for UTC")
    return t


# --- rules -------------------------------------------------------------------------------------------------------


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
        return {c.step: f"every {_fmt_s(self.seconds)}" for c in newest.values()}

    def describe(self) -> str:
        at = "" if self.anchor == EPOCH else f" from {self.anchor.isoformat()}"
        return f"the newest in each {_fmt_s(self.seconds)}{at}"

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


# --- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a prune keeps (step -> reasons, ascending steps) and removes (ascending steps)."""

    keep: dict[int, list[str]]
    remove: list[int]
    checkpoints: tuple[Checkpoint, ...] = field(repr=False, default=())  # the input, sorted by step
    rules: str = ""  # the rules, described

    @property
    def kept(self) -> list[int]:
        return list(self.keep)

    def describe(self) -> list[str]:
        """Lines for people: the rules, then every checkpoint (kept and why, or removed), then a summary."""
        lines = [f"rules: always the newest and pinned; {self.rules}"] if self.rules else []
        width = max((len(str(c.step)) for c in self.checkpoints), default=1)
        for c in self.checkpoints:
            created = c.created.isoformat(timespec="seconds")
            if c.step in self.keep:
                lines.append(f"keep    step {c.step:>{width}}  {created}  ({', '.join(self.keep[c.step])})")
            else:
                lines.append(f"remove  step {c.step:>{width}}  {created}")
        total = len(self.keep) + len(self.remove)
        lines.append(f"keeping {len(self.keep)} of {total} checkpoint{'s' if total != 1 else ''}, removing "
                     f"{len(self.remove)}")
        return lines


def plan(checkpoints: Iterable[Checkpoint], rules: RetentionRule | Iterable[RetentionRule]) -> Plan:
    """Decide which of a run's committed ``checkpoints`` to keep under ``rules`` (their union).

    The newest checkpoint (highest step) and pinned ones are kept whatever the rules. Raises ValueError when no rule
    is given, when a step appears twice, or for input that is not `Checkpoint` records.
    """
    retention = rules if isinstance(rules, Retention) else (
        Retention(rules) if isinstance(rules, RetentionRule) else Retention(*_rule_list(rules)))
    if not retention.rules:
        raise UsageError(NO_RULE_MESSAGE)
    items = list(checkpoints)
    for c in items:
        if not isinstance(c, Checkpoint):
            raise ArgumentTypeError(f"plan takes Checkpoint records (Checkpoint.from_info builds one from a "
                            f"CheckpointInfo), got {type(c).__name__}: {c!r}")
    items.sort(key=lambda c: c.step)
    for a, b in zip(items, items[1:]):
        if a.step == b.step:
            raise UsageError(f"step {a.step} is listed twice: a run has one checkpoint per step")
    by_rule = retention.reasons(items)
    keep: dict[int, list[str]] = {}
    for i, c in enumerate(items):
        reasons = []
        if i == len(items) - 1:
            reasons.append("newest")
        if c.pinned:
            reasons.append("pinned")
        reasons.extend(by_rule.get(c.step, []))
        if reasons:
            keep[c.step] = reasons
    remove = [c.step for c in items if c.step not in keep]
    return Plan(keep, remove, tuple(items), retention.describe())


def check_metrics(checkpoints: Sequence[Checkpoint], rules: RetentionRule | Iterable[RetentionRule],
                  where: str = "the run") -> None:
    """UsageError when a `KeepBest` rule names a metric that none of ``checkpoints`` records as a finite number: such
    a rule keeps nothing, and a typo (``Loss``, ``1:loss:mni``) would let prune remove the best checkpoint. The
    message names the metrics the checkpoints do record."""
    retention = rules if isinstance(rules, Retention) else (
        Retention(rules) if isinstance(rules, RetentionRule) else Retention(*_rule_list(rules)))
    recorded = sorted({k for c in checkpoints for k in (c.metrics or {}) if c.metric(k) is not None})
    for r in retention.rules:
        if isinstance(r, KeepBest) and not any(c.metric(r.metric) is not None for c in checkpoints):
            import difflib

            near = difflib.get_close_matches(r.metric, recorded, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            if ":" in r.metric and r.metric.rsplit(":", 1)[1].lower() not in ("min", "max"):
                hint += " (the mode after the last ':' must be min or max)"
            raise UsageError(
                f"keep-best metric {r.metric!r}: no checkpoint of {where} records it as a number, so the rule would "
                f"keep nothing and prune could remove the best checkpoint; they record: "
                f"{', '.join(recorded) or 'no numeric metrics'}{hint}. Nothing was removed")


# --- CLI flags ---------------------------------------------------------------------------------------------------

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_DURATION_FORM = "a number with a unit s, m, h, d or w, e.g. 24h, 7d, 90m, 3600s or 1h30m"


def parse_duration(text: str) -> float:
    """Seconds from ``"24h"``, ``"7d"``, ``"90m"``, ``"3600s"``, ``"2w"`` or a sum like ``"1h30m"``; must be > 0."""
    if not isinstance(text, str):
        raise UsageError(f"a duration must be {_DURATION_FORM}, got {text!r}")
    s = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        hint = " (the unit is required)" if re.fullmatch(r"\d+(\.\d+)?", s) else ""
        raise UsageError(f"duration {text!r} must be {_DURATION_FORM}{hint}")
    if not total > 0 or not math.isfinite(total):
        raise UsageError(f"duration {text!r} must be longer than zero")
    return total


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


# --- helpers -----------------------------------------------------------------------------------------------------


def _members(rule: RetentionRule) -> tuple[RetentionRule, ...]:
    return rule.rules if isinstance(rule, Retention) else (rule,)


def _rule_list(rules: Any) -> list[RetentionRule]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise ArgumentTypeError(f"plan takes a retention rule or an iterable of them, got {type(rules).__name__}: {rules!r}")
    return list(rules)


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


def _fmt_s(seconds: float) -> str:
    """A period for people: 90s, 1m30s, 90m... as 1h30m, 24h, 36h, 2d, 7d, 0.5s (whole days from two days on)."""
    if seconds < 1 or seconds != int(seconds):
        return f"{seconds:g}s"
    s = int(seconds)
    if s >= 2 * 86400 and s % 86400 == 0:
        return f"{s // 86400}d"
    parts = []
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            q, s = divmod(s, size)
            parts.append(f"{q}{unit}")
    return "".join(parts)
