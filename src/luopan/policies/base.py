"""The save-policy contract (`SavePolicy`), the union of policies (`AnyOf`, ``a | b``) and what every policy shares:
reading a metric without ever raising, checking that a state is the policy's own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from ..errors import ArgumentTypeError, UsageError

__all__ = ["AnyOf", "SavePolicy"]


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
