"""What luopan.hf keeps of a Trainer besides model and optimizer: RNG states as arrays, JSON of its own files, and
the numbers it logged at a step."""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The RNG states the Trainer saves (Python, NumPy, torch CPU and CUDA), as arrays only."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": np.array(list(internal) + [version], dtype=np.uint64),
        "python_gauss": np.array([] if gauss is None else [gauss], dtype=np.float64),
        "numpy_key": np.asarray(np_state["state"]["key"], dtype=np.uint32),
        "numpy_misc": np.array([np_state["state"]["pos"], np_state["has_gauss"], np_state["gauss"]],
                               dtype=np.float64),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def set_rng_state(saved: dict[str, Any]) -> None:
    py = [int(x) for x in np.asarray(saved["python"]).tolist()]
    gauss = np.asarray(saved["python_gauss"]).tolist()
    random.setstate((py[-1], tuple(py[:-1]), gauss[0] if gauss else None))
    pos, has_gauss, cached = np.asarray(saved["numpy_misc"]).tolist()
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": np.asarray(saved["numpy_key"]),
                                                               "pos": int(pos)},
                         "has_gauss": int(has_gauss), "gauss": float(cached)})
    torch.random.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        if len(saved["cuda"]) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(list(saved["cuda"]))
        else:
            warnings.warn(f"the checkpoint has CUDA RNG states for {len(saved['cuda'])} devices, this process sees "
                          f"{torch.cuda.device_count()}: CUDA RNG not restored, so losses may differ from an "
                          "uninterrupted run", stacklevel=2)


def plain(value: Any) -> Any:
    """JSON data for the Trainer's own files: sets as lists, enums as values, non-finite floats as JSON allows."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "value", str(value))


def logged_metrics(state: Any, step: int) -> dict[str, float] | None:
    """The numbers the Trainer logged at this step (eval metrics, loss), for `luopan ls` and retention."""
    out: dict[str, float] = {}
    for row in state.log_history:
        if row.get("step") == step:
            out.update({k: float(v) for k, v in row.items()
                        if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out or None
