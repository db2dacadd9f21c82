"""The decision: `plan` applies retention rules to a run's committed checkpoints and returns a `Plan` (what to keep,
and why, and what to remove); `check_metrics` refuses a `KeepBest` on a metric no checkpoint records."""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ArgumentTypeError, UsageError
from .checkpoint import Checkpoint
from .rules import KeepBest, Retention, RetentionRule, _rule_list

__all__ = ["NO_RULE_MESSAGE", "Plan", "check_metrics", "plan"]

NO_RULE_MESSAGE = ("no keep rule given: this would remove every checkpoint but the newest; pass --keep-last N "
                   "or similar")


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
    for a, b in itertools.pairwise(items):
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
            near = difflib.get_close_matches(r.metric, recorded, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            if ":" in r.metric and r.metric.rsplit(":", 1)[1].lower() not in ("min", "max"):
                hint += " (the mode after the last ':' must be min or max)"
            raise UsageError(
                f"keep-best metric {r.metric!r}: no checkpoint of {where} records it as a number, so the rule would "
                f"keep nothing and prune could remove the best checkpoint; they record: "
                f"{', '.join(recorded) or 'no numeric metrics'}{hint}. Nothing was removed")
