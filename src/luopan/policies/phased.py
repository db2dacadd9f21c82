"""`Phased`: dense saves while the loss falls, sparse ones once it has flattened (or from a given step)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..errors import UsageError
from .base import SavePolicy, _check_kind, _metric
from .checks import _fraction, _metric_name, _positive_float, _positive_int

__all__ = ["Phased"]


class Phased(SavePolicy):
    """Dense saves while the loss still falls, sparse ones once it has flattened ("every 50 early, 200 late").

    Saves at steps that are multiples of the current interval: ``early_every`` in the early phase, ``late_every``
    in the late one.

    By step: with ``switch_at_step=S`` the phase is early before step S and late from S on; nothing else is looked at.

    By loss (the default): the last ``2 * window`` observations of ``metric`` form two windows, *previous* and
    *recent*. The relative improvement is ``(mean(previous) - mean(recent)) / |mean(previous)|``; the loss is
    flat once its magnitude is below ``flat_below`` (default 0.01: the moving mean moved by less than 1% over the
    last ``window`` observations, either way; a rising loss is not converged), and the policy switches to the
    late phase. It stays late even if the loss later falls faster again (a learning-rate drop, say): the run has
    converged once and sparse saves are what was asked for. It switches back to early only if the loss rises:
    when the recent window's mean exceeds the lowest window mean seen since the switch by more than
    ``rise_above`` (default 0.05, relative), a threshold well above ``flat_below`` so noise on a plateau does not
    flap between phases; it switches to late again once the loss is flat at its new level. Before ``2 * window``
    observations the phase is early. Defaults: ``metric="loss"``, ``window=100``.
    """

    def __init__(self, early_every: int, late_every: int, *, metric: str | None = None, window: int | None = None,
                 flat_below: float | None = None, rise_above: float | None = None,
                 switch_at_step: int | None = None) -> None:
        self.early_every = _positive_int("Phased: early_every", early_every)
        self.late_every = _positive_int("Phased: late_every", late_every)
        if self.early_every >= self.late_every:
            raise UsageError(f"Phased: early_every ({early_every}) must be smaller than late_every ({late_every}): "
                             "dense saves early, sparse ones once converged; for a fixed interval use EveryNSteps")
        if switch_at_step is not None:
            loss_options = {"metric": metric, "window": window, "flat_below": flat_below, "rise_above": rise_above}
            given = [k for k, v in loss_options.items() if v is not None]
            if given:
                raise UsageError(f"Phased: switch_at_step switches by step alone, so {', '.join(given)} would be "
                                 "ignored; pass switch_at_step or the loss options, not both")
            self.switch_at_step: int | None = _positive_int("Phased: switch_at_step", switch_at_step)
        else:
            self.switch_at_step = None
        self.metric = _metric_name("Phased", "loss" if metric is None else metric)
        self.window = _positive_int("Phased: window", 100 if window is None else window)
        self.flat_below = _fraction("Phased: flat_below", 0.01 if flat_below is None else flat_below)
        self.rise_above = _positive_float("Phased: rise_above", 0.05 if rise_above is None else rise_above,
                                          allow_inf=True)
        self._values: deque[float] = deque(maxlen=2 * self.window)
        self._late = False
        self._since: int | None = None  # step of the last phase switch
        self._best: float | None = None  # lowest recent-window mean since switching to late

    @property
    def phase(self) -> str:
        """``"early"`` or ``"late"``."""
        return "late" if self._late else "early"

    @property
    def interval(self) -> int:
        """The current save interval in steps."""
        return self.late_every if self._late else self.early_every

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        if self.switch_at_step is not None:
            self._late = step >= self.switch_at_step
        else:
            value = _metric(metrics, self.metric)
            if value is not None and math.isfinite(value):
                self._observe(step, value)
        if step <= 0 or step % self.interval:
            return None
        if self.switch_at_step is not None:
            when = f"from step {self.switch_at_step}" if self._late else f"until step {self.switch_at_step}"
        elif self._late:
            when = f"{self.metric} flat since step {self._since}"
        elif self._since is not None:
            when = f"{self.metric} rose at step {self._since}"
        else:
            when = f"{self.metric} still falling"
        return f"every {self.interval} steps ({when})"

    def _observe(self, step: int, value: float) -> None:
        self._values.append(value)
        if len(self._values) < 2 * self.window:
            return
        values = list(self._values)
        previous = sum(values[: self.window]) / self.window
        recent = sum(values[self.window:]) / self.window
        if not self._late:
            if abs(_relative(previous - recent, previous)) < self.flat_below:
                self._late, self._since, self._best = True, step, recent
        else:
            assert self._best is not None
            self._best = min(self._best, recent)
            if _relative(recent - self._best, self._best) > self.rise_above:
                self._late, self._since, self._best = False, step, None

    def describe(self) -> str:
        if self.switch_at_step is not None:
            return f"every {self.early_every} steps until step {self.switch_at_step}, then every {self.late_every}"
        return (f"every {self.early_every} steps while {self.metric} falls, every {self.late_every} once flat "
                f"(moving mean improves < {self.flat_below:.2%} per {self.window} values; back to dense if it "
                f"rises > {self.rise_above:.2%})")

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "Phased", "late": self._late, "since": self._since, "best": self._best,
                "values": list(self._values)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        self._late = bool(state.get("late", False))
        self._since = state.get("since")
        best = state.get("best")
        self._best = None if best is None else float(best)
        if self._late and self._best is None and self.switch_at_step is None:
            self._late = False  # a state from step mode (or damaged): re-detect flatness from the values
        self._values = deque((float(v) for v in state.get("values", [])), maxlen=2 * self.window)

    def __repr__(self) -> str:
        if self.switch_at_step is not None:
            return f"Phased({self.early_every}, {self.late_every}, switch_at_step={self.switch_at_step})"
        return (f"Phased({self.early_every}, {self.late_every}, metric={self.metric!r}, window={self.window}, "
                f"flat_below={self.flat_below:g}, rise_above={self.rise_above:g})")


def _relative(delta: float, reference: float) -> float:
    """delta / |reference|, with a zero reference giving 0 for no change and ±inf otherwise."""
    if reference == 0:
        return 0.0 if delta == 0 else math.copysign(math.inf, delta)
    return delta / abs(reference)
