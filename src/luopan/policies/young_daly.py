"""`YoungDaly`: saves at the interval sqrt(2 x measured save cost x MTBF), within bounds."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..errors import UsageError
from ..units import format_duration
from .base import SavePolicy, _check_kind
from .checks import _fraction, _non_negative_float, _positive_float
from .schedule import _Timer

__all__ = ["YoungDaly"]

# YoungDaly's save cost C is the mean of this many latest measurements: recent enough to follow saves getting
# cheaper once the repository holds the frozen chunks (the first save writes everything), smooth enough to ride
# out one slow fsync.
_COST_WINDOW = 5


class YoungDaly(SavePolicy):
    """Saves at the Young–Daly interval ``sqrt(2 * C * MTBF)``, which minimises expected lost time.

    ``C`` is the measured save cost: the mean of the latest ``cost_s`` values reported to `saved` (the time the
    training loop was blocked, so async saves earn short intervals). Before the first measurement it is
    ``initial_cost_s``; without one, the policy saves at its first call, to measure.

    Bounds, in this order: at most ``max_interval_s``; then at least ``min_interval_s`` and at least
    ``C / max_overhead`` (checkpointing never takes more than ``max_overhead`` of the time between saves; this
    wins over ``max_interval_s`` when the two conflict). Time is counted from the last save of any policy (or the
    first call). Costs that are negative or non-finite are ignored. The ``min_interval_s`` default of one minute
    keeps a near-zero measured cost (an async save that only copies to host) from meaning a save every step.
    """

    def __init__(self, mtbf_s: float, *, max_overhead: float = 0.05, initial_cost_s: float | None = None,
                 min_interval_s: float = 60.0, max_interval_s: float = math.inf) -> None:
        self.mtbf_s = _positive_float("YoungDaly: mtbf_s", mtbf_s)
        self.max_overhead = _fraction("YoungDaly: max_overhead", max_overhead, allow_one=True)
        if initial_cost_s is not None:
            initial_cost_s = _positive_float("YoungDaly: initial_cost_s", initial_cost_s)
        self.initial_cost_s = initial_cost_s
        self.min_interval_s = _non_negative_float("YoungDaly: min_interval_s", min_interval_s)
        self.max_interval_s = _positive_float("YoungDaly: max_interval_s", max_interval_s, allow_inf=True)
        if self.min_interval_s > self.max_interval_s:
            raise UsageError(f"YoungDaly: min_interval_s ({min_interval_s:g}) must not exceed max_interval_s "
                             f"({max_interval_s:g})")
        self._costs: deque[float] = deque(maxlen=_COST_WINDOW)
        self._timer = _Timer()
        self._measuring = False  # fired to measure the cost; waiting for `saved`

    @property
    def cost_s(self) -> float | None:
        """The save cost C in use: the mean of recent measurements, else ``initial_cost_s`` (None: unknown)."""
        if self._costs:
            return sum(self._costs) / len(self._costs)
        return self.initial_cost_s

    @property
    def interval_s(self) -> float | None:
        """Seconds between saves for the current C (None until C is known)."""
        cost = self.cost_s
        if cost is None:
            return None
        interval = min(math.sqrt(2.0 * cost * self.mtbf_s), self.max_interval_s)
        return max(interval, self.min_interval_s, cost / self.max_overhead)

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        elapsed = self._timer.tick(now)
        cost, interval = self.cost_s, self.interval_s
        if cost is None or interval is None:
            if self._measuring:
                return None
            self._measuring = True
            self._timer.reset(now)
            return "young-daly: first save, to measure its cost"
        if elapsed >= interval:
            self._timer.reset(now)
            return (f"young-daly: every {format_duration(interval)} (C={format_duration(cost)}, "
                    f"MTBF {format_duration(self.mtbf_s)})")
        return None

    def saved(self, step: int, now: float, cost_s: float) -> None:
        self._timer.reset(now)
        try:
            cost = float(cost_s)
        except (TypeError, ValueError):
            return
        if math.isfinite(cost) and cost >= 0:
            self._costs.append(cost)
            self._measuring = False

    def describe(self) -> str:
        bounds = ""
        if self.min_interval_s > 0:
            bounds += f", at least {format_duration(self.min_interval_s)}"
        if math.isfinite(self.max_interval_s):
            bounds += f", at most {format_duration(self.max_interval_s)}"
        return (f"every sqrt(2 x save cost x MTBF {format_duration(self.mtbf_s)}), overhead <= {self.max_overhead:.0%}"
                f"{bounds}")

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "YoungDaly", "costs": list(self._costs), "elapsed_s": self._timer.elapsed()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        self._costs = deque((float(c) for c in state.get("costs", [])), maxlen=_COST_WINDOW)
        self._timer.restore(state.get("elapsed_s"))
        self._measuring = False

    def __repr__(self) -> str:
        parts = [f"{self.mtbf_s:g}", f"max_overhead={self.max_overhead:g}"]
        if self.initial_cost_s is not None:
            parts.append(f"initial_cost_s={self.initial_cost_s:g}")
        if self.min_interval_s != 60:
            parts.append(f"min_interval_s={self.min_interval_s:g}")
        if math.isfinite(self.max_interval_s):
            parts.append(f"max_interval_s={self.max_interval_s:g}")
        return f"YoungDaly({', '.join(parts)})"
