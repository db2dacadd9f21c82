"""`LossSpike`: an emergency save when the loss jumps above its moving mean, or stops being finite."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..errors import UsageError
from .base import SavePolicy, _check_kind, _metric
from .checks import _metric_name, _non_negative_int, _positive_float, _positive_int

__all__ = ["LossSpike"]


class LossSpike(SavePolicy):
    """Emergency save when ``metric`` jumps above ``factor`` times its moving mean, or stops being finite.

    A value spikes when it exceeds ``factor`` × the mean of the previous ``window`` finite values (once at least
    ``min_history`` are known; a mean <= 0 never makes a finite spike, this is for positive losses). Spike values
    do enter the window, so a lasting jump to a new level stops counting as a spike after a few steps.

    Non-finite values (NaN, ±inf) always count, from the first step, and never enter the window. The state saved
    then may already be diverged (the update that produced or followed the NaN has been applied), and the state
    before it cannot be recovered by the manager; the save still happens, with a reason that says so, because it
    is what one inspects to find the cause, while the checkpoint before it stays the last good one. It fires once
    per unbroken run of non-finite values, so a diverged run does not fill the repository (and push good
    checkpoints out of retention) with copies of NaN weights.

    ``cooldown``: at most one save by this policy per ``cooldown`` steps (default 50), so one spike spread over
    several steps saves once.
    """

    def __init__(self, factor: float = 2.0, window: int = 50, *, metric: str = "loss", min_history: int = 10,
                 cooldown: int = 50) -> None:
        factor = _positive_float("LossSpike: factor", factor)
        if factor <= 1:
            raise UsageError(f"LossSpike: factor must be > 1 (a spike is a value factor times its moving mean), "
                             f"got {factor!r}")
        self.factor = factor
        self.window = _positive_int("LossSpike: window", window)
        self.metric = _metric_name("LossSpike", metric)
        self.min_history = _positive_int("LossSpike: min_history", min_history)
        if self.min_history > self.window:
            raise UsageError(f"LossSpike: min_history ({min_history}) cannot exceed window ({window}): "
                             "the window never holds more values")
        self.cooldown = _non_negative_int("LossSpike: cooldown", cooldown)
        self._values: deque[float] = deque(maxlen=self.window)
        self._last_fired: int | None = None  # step of this policy's last save
        self._in_nonfinite = False  # inside an unbroken run of non-finite values that already saved

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        value = _metric(metrics, self.metric)
        if value is None:
            return None
        reason = None
        if not math.isfinite(value):
            if not self._in_nonfinite and self._cooled(step):
                self._in_nonfinite = True
                reason = (f"{self.metric} is {value}: saved for inspection; the state may already be diverged, "
                          "the checkpoint before this one is the last good one")
        else:
            self._in_nonfinite = False
            if len(self._values) >= self.min_history and self._cooled(step):
                mean = sum(self._values) / len(self._values)
                if mean > 0 and value > self.factor * mean:
                    reason = f"{self.metric} spike: {value:.4g} > {self.factor:g} x moving mean {mean:.4g}"
            self._values.append(value)
        if reason:
            self._last_fired = step
        return reason

    def _cooled(self, step: int) -> bool:
        return self._last_fired is None or step - self._last_fired >= self.cooldown

    def describe(self) -> str:
        return (f"when {self.metric} > {self.factor:g}x its mean over the last {self.window} values, or is "
                f"non-finite (at most once per {self.cooldown} steps)")

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "LossSpike", "values": list(self._values), "last_fired": self._last_fired,
                "in_nonfinite": self._in_nonfinite}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        self._values = deque((float(v) for v in state.get("values", [])), maxlen=self.window)
        last = state.get("last_fired")
        self._last_fired = None if last is None else int(last)
        self._in_nonfinite = bool(state.get("in_nonfinite", False))

    def __repr__(self) -> str:
        return (f"LossSpike(factor={self.factor:g}, window={self.window}, metric={self.metric!r}, "
                f"min_history={self.min_history}, cooldown={self.cooldown})")
