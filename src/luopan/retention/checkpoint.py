"""The input of retention: `Checkpoint`, one committed checkpoint of a run as the rules see it, and `parse_time`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import UsageError

__all__ = ["Checkpoint", "parse_time"]


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
