"""Fixed schedules: `EveryNSteps` (by step count) and `EveryTSeconds` (by time since the last save), and the timer
that carries "time since the last save" across a resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..units import format_duration
from .base import SavePolicy, _check_kind
from .checks import _positive_float, _positive_int

__all__ = ["EveryNSteps", "EveryTSeconds"]


class EveryNSteps(SavePolicy):
    """Saves after every ``n``-th step: steps n, 2n, 3n, ... (never step 0)."""

    def __init__(self, n: int) -> None:
        self.n = _positive_int("EveryNSteps: n", n)

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        if step > 0 and step % self.n == 0:
            return f"every {self.n} steps"
        return None

    def describe(self) -> str:
        return f"every {self.n} steps"

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class _Timer:
    """Time since the last save, from monotonic `now` values, portable across processes through `elapsed`."""

    def __init__(self) -> None:
        self.last_save: float | None = None  # `now` of the last save (or of the first call, before any)
        self.last_now: float | None = None  # the latest `now` seen
        self.resume_elapsed: float | None = None  # from load_state_dict, applied at the next call

    def tick(self, now: float) -> float:
        """Record `now`; seconds since the last save (0 at the first call of a fresh run)."""
        if self.resume_elapsed is not None:
            self.last_save, self.resume_elapsed = now - self.resume_elapsed, None
        elif self.last_save is None:
            self.last_save = now
        self.last_now = now
        return now - self.last_save

    def reset(self, now: float) -> None:
        self.last_save = self.last_now = now
        self.resume_elapsed = None

    def elapsed(self) -> float | None:
        if self.resume_elapsed is not None:
            return self.resume_elapsed
        if self.last_save is None or self.last_now is None:
            return None
        return max(0.0, self.last_now - self.last_save)

    def restore(self, elapsed: Any) -> None:
        self.last_save = self.last_now = None
        self.resume_elapsed = None if elapsed is None else max(0.0, float(elapsed))


class EveryTSeconds(SavePolicy):
    """Saves once ``seconds`` have passed since the last save (of any policy), or since the first call."""

    def __init__(self, seconds: float) -> None:
        self.seconds = _positive_float("EveryTSeconds: seconds", seconds)
        self._timer = _Timer()

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        if self._timer.tick(now) >= self.seconds:
            self._timer.reset(now)
            return f"every {format_duration(self.seconds)}"
        return None

    def saved(self, step: int, now: float, cost_s: float) -> None:
        self._timer.reset(now)

    def describe(self) -> str:
        return f"every {format_duration(self.seconds)}"

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "EveryTSeconds", "elapsed_s": self._timer.elapsed()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        self._timer.restore(state.get("elapsed_s"))

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.seconds:g})"
