"""Save policies: when a training loop should write a checkpoint.

A checkpoint manager asks its policy once per training step and tells it about every save::

    reason = policy.should_save(step, metrics, now)   # a short str saying why, or None
    if reason:
        ...save, timing how long the training loop was blocked...
        policy.saved(step, now, cost_s)

``step`` counts the steps completed; ``metrics`` maps names to floats (it may be empty, lack a policy's metric or
hold NaN); ``now`` is ``time.monotonic()`` (tests pass their own). ``a | b`` saves when either policy says so.

Contract every policy keeps:

- ``should_save`` must be called every step, also when another policy already decided to save: policies that watch
  a metric keep moving windows that need every value. It never raises over odd metrics (missing, non-numeric,
  non-finite): a training run must not stop because of its save policy.
- A policy that fires counts its own firing as a save, so a loop that forgets ``saved`` does not save every step;
  ``saved`` is how a policy learns of saves that other policies caused, and what they cost.
- Windows count observations (steps where the metric was present and finite), not steps.
- ``state_dict()`` is plain JSON (never NaN). A monotonic clock means nothing in another process, so timers store
  the seconds elapsed since the last save as of their latest call, and resume counting from there at their first
  call after ``load_state_dict``. A policy that fired at that latest call stores 0 (its firing counts as the save);
  one that did not stores the time since the previous save, so a resumed run may save at most one interval early.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from typing import Any

from .errors import ArgumentTypeError, UsageError

__all__ = ["AnyOf", "EveryNSteps", "EveryTSeconds", "LossSpike", "Phased", "SavePolicy", "YoungDaly"]

# YoungDaly's save cost C is the mean of this many latest measurements: recent enough to follow saves getting
# cheaper once the repository holds the frozen chunks (the first save writes everything), smooth enough to ride
# out one slow fsync.
_COST_WINDOW = 5


class SavePolicy(ABC):
    """Decides, once per training step, whether to save a checkpoint, and says why."""

    @abstractmethod
    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        """A short reason to save after ``step`` (e.g. ``"every 50 steps"``), or None."""

    def saved(self, step: int, now: float, cost_s: float) -> None:
        """A checkpoint of ``step`` was saved at ``now``; the training loop was blocked ``cost_s`` seconds."""

    @abstractmethod
    def describe(self) -> str:
        """One line saying when this policy saves."""

    def state_dict(self) -> dict[str, Any]:
        """The policy's memory as plain JSON, for a resumed run; configuration is not included."""
        return {"policy": type(self).__name__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore memory saved by `state_dict` of a policy of the same class."""
        _check_kind(self, state)

    def __or__(self, other: object) -> AnyOf:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return AnyOf(*_members(self), *_members(other))


class AnyOf(SavePolicy):
    """Saves when any of its policies says so; the reason is the first one given, in the order passed.

    Every policy is asked every step (so all see every metric value), and every save is reported to all of them.
    """

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise UsageError("AnyOf needs at least one policy, e.g. AnyOf(EveryNSteps(100), LossSpike())")
        for p in policies:
            if not isinstance(p, SavePolicy):
                raise ArgumentTypeError(f"AnyOf takes SavePolicy objects, got {type(p).__name__}: {p!r}")
        self.policies: tuple[SavePolicy, ...] = tuple(policies)

    def should_save(self, step: int, metrics: Mapping[str, float] | None, now: float) -> str | None:
        first = None
        for p in self.policies:  # no short circuit: every policy observes every step
            reason = p.should_save(step, metrics, now)
            if reason and first is None:
                first = reason
        return first

    def saved(self, step: int, now: float, cost_s: float) -> None:
        for p in self.policies:
            p.saved(step, now, cost_s)

    def describe(self) -> str:
        return "; or ".join(p.describe() for p in self.policies)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "AnyOf", "policies": [p.state_dict() for p in self.policies]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        states = state.get("policies")
        if not isinstance(states, list) or len(states) != len(self.policies):
            got = len(states) if isinstance(states, list) else "no"
            raise UsageError(f"AnyOf state holds {got} policies, this AnyOf has {len(self.policies)}: "
                             "compose the same policies, in the same order, as the run that saved it")
        for p, s in zip(self.policies, states):
            p.load_state_dict(s)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


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
            return f"every {_fmt_s(self.seconds)}"
        return None

    def saved(self, step: int, now: float, cost_s: float) -> None:
        self._timer.reset(now)

    def describe(self) -> str:
        return f"every {_fmt_s(self.seconds)}"

    def state_dict(self) -> dict[str, Any]:
        return {"policy": "EveryTSeconds", "elapsed_s": self._timer.elapsed()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(self, state)
        self._timer.restore(state.get("elapsed_s"))

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.seconds:g})"


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
            return f"young-daly: every {_fmt_s(interval)} (C={_fmt_s(cost)}, MTBF {_fmt_s(self.mtbf_s)})"
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
            bounds += f", at least {_fmt_s(self.min_interval_s)}"
        if math.isfinite(self.max_interval_s):
            bounds += f", at most {_fmt_s(self.max_interval_s)}"
        return (f"every sqrt(2 x save cost x MTBF {_fmt_s(self.mtbf_s)}), overhead <= {self.max_overhead:.0%}"
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


# --- helpers ---------------------------------------------------------------------------------------------------


def _members(policy: SavePolicy) -> tuple[SavePolicy, ...]:
    return policy.policies if isinstance(policy, AnyOf) else (policy,)


def _check_kind(policy: SavePolicy, state: Mapping[str, Any]) -> None:
    name = type(policy).__name__
    if not isinstance(state, Mapping):
        raise UsageError(f"{name}.load_state_dict takes the dict its state_dict() returned, got {type(state).__name__}")
    if state.get("policy") != name:
        raise UsageError(f"state is for policy {state.get('policy')!r}, not {name}: load it into the same policy "
                         "that saved it")


def _metric(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """The metric as a float, None when absent or not a number (never raises: training must not stop here)."""
    if not metrics:
        return None
    value = metrics.get(name)
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _relative(delta: float, reference: float) -> float:
    """delta / |reference|, with a zero reference giving 0 for no change and ±inf otherwise."""
    if reference == 0:
        return 0.0 if delta == 0 else math.copysign(math.inf, delta)
    return delta / abs(reference)


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


def _fmt_s(seconds: float) -> str:
    """A duration for people: 0.25s, 4s, 12m14s, 1h30m, 24h."""
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.0f}s"
    total = round(seconds)
    if total < 3600:
        m, s = divmod(total, 60)
        return f"{m}m{s:02d}s" if s else f"{m}m"
    h, rest = divmod(total, 3600)
    m = rest // 60
    return f"{h}h{m:02d}m" if m else f"{h}h"
