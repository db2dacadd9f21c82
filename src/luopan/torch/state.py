"""Training state as one tree: modules, optimizers, schedulers, AMP scaler, RNGs, data position, counters, extras.

``TrainingState(model=…, optimizer=…, scheduler=…, scaler=…, loader=…)`` names the objects of a training loop; each
needs ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers, ``GradScaler``,
``ResumableLoader``, torchdata's ``StatefulDataLoader``, your own objects). ``capture()`` returns a luopan state tree
(no pickle: tensors, NumPy arrays and JSON values only) that also holds the RNG states of Python ``random``, NumPy's
global generator, torch CPU and CUDA, any NumPy/torch generators passed as ``generators=``, and ``extras``.
``restore(tree)`` checks everything against the live objects first and raises one StateMismatchError listing every
problem before anything is touched.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import LayoutMismatchError, StateMismatchError, UnsupportedValueError
from ..tree import flatten

RESERVED = ("rng", "generators", "extras")
# Optimizer state that has its parameter's shape in torch's optimizers (others, e.g. Adafactor's row/column
# variances or LBFGS's flat buffers, have their own shapes and are left to load_state_dict).
PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                          "sum", "exp_inf", "ax", "grad_avg", "prev"})


def _world() -> dict[str, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"world_size": dist.get_world_size(), "rank": dist.get_rank()}
    return {"world_size": 1, "rank": 0}


class TrainingState:
    """The objects a training loop must persist to resume exactly. See the module docstring."""

    def __init__(self, *, generators: Mapping[str, Any] | None = None, extras: dict[str, Any] | None = None,
                 rng: bool = True, layout: str | None = None, **components: Any) -> None:
        for name, obj in components.items():  # "rng", "generators" and "extras" are parameters, never names
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UnsupportedValueError(
                    f"component {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(); pass plain "
                    "values in extras=, generators in generators=")
        for name, g in (generators or {}).items():
            if not isinstance(g, (np.random.Generator, np.random.RandomState, torch.Generator)):
                raise UnsupportedValueError(
                    f"generator {name!r} is a {type(g).__name__}; pass numpy Generator/RandomState or torch.Generator")
        self.components = dict(components)
        self.generators = dict(generators or {})
        self.extras = extras if extras is not None else {}
        self.rng = rng
        self.layout = layout  # e.g. "dp=8" or "fsdp=4,tp=2": checked on restore like the world size

    # -- capture ------------------------------------------------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        tree: dict[str, Any] = {name: obj.state_dict() for name, obj in self.components.items()}
        tree["generators"] = {name: _generator_state(g) for name, g in self.generators.items()}
        tree["extras"] = self.extras
        if self.rng:
            tree["rng"] = _global_rng_state()
        return tree

    def metadata(self) -> dict[str, Any]:
        """What restore checks besides the tree: world size, rank, declared parallel layout."""
        return {"luopan.torch": {**_world(), "layout": self.layout, "torch": torch.__version__}}

    # -- restore ------------------------------------------------------------------------------------------------
    def check(self, tree: dict[str, Any], metadata: dict[str, Any] | None = None, *, strict: bool = True,
              where: str = "the checkpoint") -> list[str]:
        """Every problem restoring ``tree`` into the live objects would hit (empty: it fits)."""
        problems: list[str] = []
        for name, obj in self.components.items():
            if name not in tree:
                if strict:
                    problems.append(f"component {name!r} is not in {where} (it has: "
                                    f"{', '.join(k for k in tree if k not in RESERVED) or 'none'})")
                continue
            problems += [f"{name}: {p}" for p in _component_problems(obj, tree[name], strict)]
        if strict:
            problems += [f"{where} has component {k!r}, which this TrainingState lacks"
                         for k in tree if k not in RESERVED and k not in self.components]
        saved_gens = tree.get("generators", {})
        for name, g in self.generators.items():
            if name not in saved_gens:
                if strict:
                    problems.append(f"generator {name!r} is not in {where}")
            elif _generator_kind(g) != saved_gens[name].get("kind"):
                problems.append(f"generator {name!r}: {where} has a {saved_gens[name].get('kind')}, "
                                f"this is a {_generator_kind(g)}")
        if self.rng and "rng" not in tree and strict:
            problems.append(f"{where} has no RNG state (saved with rng=False)")
        return problems

    def check_layout(self, metadata: dict[str, Any], where: str) -> None:
        recorded = metadata.get("luopan.torch")
        if not recorded:
            return
        now = {**_world(), "layout": self.layout}
        diffs = [f"{k}: saved with {recorded.get(k)!r}, now {now[k]!r}" for k in ("world_size", "layout")
                 if recorded.get(k) != now[k]]
        if diffs:
            raise LayoutMismatchError(
                f"{where} was saved by a different parallel layout ({'; '.join(diffs)}): each rank's state would "
                "not match; restart with the saved world size/layout, or reshard (export the model weights with "
                "`luopan export` and load them into the new layout)")
        if recorded.get("torch") and recorded["torch"] != torch.__version__:
            warnings.warn(f"{where} was saved with torch {recorded['torch']}; this is torch {torch.__version__}: "
                          "bitwise-identical resumption is not guaranteed across versions", stacklevel=3)

    def restore(self, tree: dict[str, Any], metadata: dict[str, Any] | None = None, *, strict: bool = True,
                where: str = "the checkpoint") -> None:
        """Load ``tree`` (from ``capture``) into the live objects, after checking all of it first."""
        if metadata is not None:
            self.check_layout(metadata, where)
        problems = self.check(tree, metadata, strict=strict, where=where)
        if problems:
            raise StateMismatchError(
                f"cannot restore {where} ({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
                + "\nfix the training setup to match, or pass strict=False to restore only what both sides have")
        # Modules first: optimizers map their state onto the parameters.
        order = sorted(self.components, key=lambda n: not isinstance(self.components[n], torch.nn.Module))
        for name in order:
            if name not in tree:
                continue
            obj = self.components[name]
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(tree[name], strict=strict)
            else:
                obj.load_state_dict(tree[name])
        for name, g in self.generators.items():
            if name in tree.get("generators", {}):
                _set_generator_state(g, tree["generators"][name])
        saved_extras = tree.get("extras", {})
        if isinstance(saved_extras, dict):
            self.extras.clear()
            self.extras.update(saved_extras)
        if self.rng and "rng" in tree:
            _set_global_rng_state(tree["rng"])


def _component_problems(obj: Any, saved: Any, strict: bool) -> list[str]:
    if hasattr(obj, "check_state_dict"):
        return list(obj.check_state_dict(saved))
    if isinstance(obj, torch.nn.Module):
        return _tensor_problems(obj.state_dict(), saved, strict)
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_problems(obj, saved)
    return []


def _tensor_problems(live: Any, saved: Any, strict: bool) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"checkpoint holds a {type(saved).__name__}, not a state dict"]
    _, a = flatten(dict(live))
    _, b = flatten(dict(saved))
    have = {leaf.path: leaf for leaf in a}
    got = {leaf.path: leaf for leaf in b}
    out = []
    for path, leaf in have.items():
        other = got.get(path)
        if other is None:
            if strict:
                out.append(f"missing in checkpoint: {path!r}")
        elif (other.dtype, tuple(other.shape)) != (leaf.dtype, tuple(leaf.shape)):
            out.append(f"{path!r}: checkpoint has {other.dtype}{tuple(other.shape)}, "
                       f"model has {leaf.dtype}{tuple(leaf.shape)}")
    if strict:
        out += [f"unexpected in checkpoint: {p!r}" for p in got if p not in have]
    return out


def _optimizer_problems(opt: torch.optim.Optimizer, saved: Any) -> list[str]:
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        return ["checkpoint does not hold an optimizer state dict"]
    groups = opt.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups):
        return [f"checkpoint has {len(saved_groups)} parameter groups, the optimizer {len(groups)}"]
    out = []
    params = []
    for k, (g, s) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(s["params"]):
            out.append(f"parameter group {k}: checkpoint has {len(s['params'])} parameters, the optimizer "
                       f"{len(g['params'])}")
        params += list(zip(s["params"], g["params"]))
    by_id = dict(params)
    for pid, st in saved["state"].items():
        p = by_id.get(pid)
        if p is None:
            out.append(f"state for parameter #{pid}, which no parameter group lists")
            continue
        for key, value in (st.items() if isinstance(st, Mapping) else []):
            if key in PARAM_SHAPED and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(p.shape):
                out.append(f"state[{pid}][{key!r}] has shape {tuple(value.shape)}, its parameter {tuple(p.shape)}")
    return out


def _global_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": np.array(internal, dtype=np.uint64), "gauss": gauss},
        "numpy": np_state,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_global_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in np.asarray(py["internal"]).tolist()), py["gauss"]))
    np_state = dict(state["numpy"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            warnings.warn(f"checkpoint has CUDA RNG states for {len(saved)} devices, this process sees "
                          f"{torch.cuda.device_count()}: CUDA RNG not restored", stacklevel=3)


def _generator_kind(g: Any) -> str:
    if isinstance(g, torch.Generator):
        return "torch"
    if isinstance(g, np.random.RandomState):
        return "numpy-randomstate"
    return f"numpy-{type(g.bit_generator).__name__}"


def _generator_state(g: Any) -> dict[str, Any]:
    if isinstance(g, torch.Generator):
        return {"kind": "torch", "state": g.get_state()}
    if isinstance(g, np.random.RandomState):
        return {"kind": "numpy-randomstate", "state": g.get_state(legacy=False)}
    return {"kind": _generator_kind(g), "state": g.bit_generator.state}


def _set_generator_state(g: Any, saved: dict[str, Any]) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(saved["state"])
    elif isinstance(g, np.random.RandomState):
        g.set_state(dict(saved["state"]))
    else:
        g.bit_generator.state = saved["state"]


def rng_state() -> dict[str, Any]:
    """The global RNG states (Python ``random``, NumPy's global generator, torch CPU, CUDA when initialized) as a
    luopan state tree: what ``TrainingState.capture()`` stores under ``rng``."""
    return _global_rng_state()


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global RNG states ``rng_state()`` captured."""
    _set_global_rng_state(state)


def generator_state(g: Any) -> dict[str, Any]:
    """The state of a torch or NumPy generator as a luopan state tree."""
    return _generator_state(g)


def set_generator_state(g: Any, saved: dict[str, Any]) -> None:
    """Restore a generator's state ``generator_state()`` captured."""
    _set_generator_state(g, saved)
