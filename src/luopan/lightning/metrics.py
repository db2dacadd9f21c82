"""The metrics a Lightning checkpoint records in its luopan manifest (``luopan ls --best val_loss``, prune by metric,
the report).

Lightning hands a ``CheckpointIO`` the checkpoint dict only, never the trainer, so the metrics come from that dict:
each ``ModelCheckpoint`` callback state names its ``monitor`` and the ``current_score`` that triggered this save
(the monitored value at this step, no extra setup), and :class:`luopan.lightning.ExactResume`, when used, adds every
scalar the module logged (``trainer.callback_metrics``) at the moment of the save under ``metrics`` in its own state.
"""

from __future__ import annotations

import math
from typing import Any

EXACT_RESUME_KEY = "luopan.ExactResume"  # ExactResume's callback state key


def scalar(value: Any) -> float | int | None:
    """``value`` as a plain number when it is one (a 0-d or 1-element tensor or array, a Python or NumPy number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = numel() if callable(numel) else numel
        if count != 1:
            return None
        item = value.item()
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return item if isinstance(item, (int, float)) and not isinstance(item, bool) else None


def scalars(metrics: Any) -> dict[str, float | int]:
    """The scalar members of a metrics mapping (``trainer.callback_metrics``), tensors converted."""
    out: dict[str, float | int] = {}
    for name, value in (metrics or {}).items():
        number = scalar(value)
        if isinstance(name, str) and number is not None:
            out[name] = number
    return out


def checkpoint_metrics(checkpoint: dict[str, Any]) -> dict[str, float | int]:
    """Every metric the checkpoint dict can tell: ExactResume's logged scalars, then each ModelCheckpoint's monitored
    ``current_score`` (the value that decided this save; it wins over a logged value of the same name)."""
    states = checkpoint.get("callbacks") or {}
    out: dict[str, float | int] = {}
    for key, state in states.items():
        if isinstance(state, dict) and str(key).startswith(EXACT_RESUME_KEY):
            out.update(scalars(state.get("metrics")))
    for state in states.values():
        if not isinstance(state, dict) or not isinstance(state.get("monitor"), str):
            continue
        score = scalar(state.get("current_score"))
        if score is not None and not (isinstance(score, float) and math.isnan(score) and state["monitor"] in out):
            out[state["monitor"]] = score
    return out
