"""How much a checkpoint's tensors changed, and how its config differs (``luopan diff``, ``repo.diff``).

``tensor_change`` compares two tensors of one shape slice by slice (``SLICE`` elements at a time, in float64), so a
diff holds one tensor of each checkpoint at a time, never two whole checkpoints: for floating-point and complex
tensors the relative L2 norm ``||b - a|| / ||a||`` and the largest absolute difference, for every dtype the number
of elements that differ (integer and bool tensors: that count, and the largest absolute difference of integers).

``run_config`` is what a checkpoint says about how it was made, flattened to dotted keys: the run record's
``config`` (``CheckpointManager(config=…)``, docs/format.md §8.1), the manifest's ``metadata`` (§8), and the JSON
settings a training framework keeps in the state tree (Lightning's ``hyper_parameters``, the HF Trainer's
``training_args``, a ``config`` subtree). ``config_diff`` compares two of them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import LuopanError
from ..format.manifest import Manifest

SLICE = 1 << 20  # elements compared at a time (8 MiB per float64 slice)
# Subtrees of a state tree that hold a framework's settings (Lightning, HF Trainer, plain configs).
CONFIG_SUBTREES = ("hyper_parameters", "hparams", "training_args", "config", "args")
MAX_CONFIG_KEYS = 2000  # a config of more keys is cut (a report table, a diff), saying so
_FLOAT = ("float", "bfloat16")
_INTS = {f"{u}int{n}" for u in ("", "u") for n in (8, 16, 32, 64)} | {"bool"}


def _category(dtype: str) -> str:
    """"float", "complex", "int" (integers and bool) or "bytes" (packed and bit dtypes: compared byte by byte)."""
    if dtype.startswith("complex"):
        return "complex"
    if dtype.startswith(_FLOAT) and not dtype.startswith("float4"):
        return "float"
    return "int" if dtype in _INTS else "bytes"


def _flat(obj: Any) -> Any:
    obj = obj.detach() if hasattr(obj, "detach") else obj
    return obj.reshape(-1)


def _as_numpy(part: Any, category: str) -> np.ndarray:
    """A slice of a flat tensor or array as a NumPy array of float64 (complex128 for complex, int64/uint64 or bool
    for integers)."""
    if isinstance(part, np.ndarray):
        if category == "float":
            return part.astype(np.float64)
        if category == "complex":
            return part.astype(np.complex128)
        return part
    torch = __import__("torch")
    if category == "float":
        return part.to(torch.float64).numpy()
    if category == "complex":
        return part.to(torch.complex128).numpy()
    if part.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        return part.numpy()
    return part.contiguous().view(torch.uint8).numpy()  # uint16/32/64: compared as bytes


def _as_bytes(obj: Any) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    torch = __import__("torch")
    return obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_change(a: Any, b: Any, dtype: str) -> dict[str, Any]:
    """The size of the change from ``a`` to ``b`` (tensors or arrays of one dtype and shape, on the host):
    ``differing`` (elements), ``max_abs`` (float, None for bool and byte-compared dtypes) and ``rel_l2``
    (``||b - a|| / ||a||``; None for integers; 0 when both are zero, inf when only ``a`` is)."""
    category = _category(dtype)
    if category == "bytes":
        xa, xb = _as_bytes(a), _as_bytes(b)
        return {"differing": int(np.count_nonzero(xa != xb)), "max_abs": None, "rel_l2": None,
                "compared": "bytes"}
    fa, fb = _flat(a), _flat(b)
    n = int(fa.shape[0])
    differing, max_abs, diff_sq, base_sq = 0, 0.0, 0.0, 0.0
    nan = False
    for lo in range(0, n, SLICE):
        xa, xb = _as_numpy(fa[lo:lo + SLICE], category), _as_numpy(fb[lo:lo + SLICE], category)
        if xa.dtype == np.bool_:
            differing += int(np.count_nonzero(xa != xb))
            continue
        if category == "int" and xa.dtype == np.uint8 and dtype != "uint8":  # compared as bytes
            differing += int(np.count_nonzero(xa != xb))
            continue
        if category == "int":
            d = np.abs(xb.astype(np.float64) - xa.astype(np.float64))
            differing += int(np.count_nonzero(xa != xb))
            max_abs = max(max_abs, float(d.max(initial=0.0)))
            continue
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where both are inf: equal, not NaN
            d = np.abs(xb - xa)
        same = (xa == xb) | (np.isnan(xa) & np.isnan(xb)) if category == "float" else xa == xb
        differing += int(xa.size - np.count_nonzero(same))
        d = np.where(same, 0.0, d)
        nan = nan or bool(np.isnan(d).any())
        max_abs = max(max_abs, float(np.nanmax(d, initial=0.0)))
        with np.errstate(invalid="ignore", over="ignore"):
            diff_sq += float(np.vdot(d, d).real)
            base_sq += float(np.vdot(xa, xa).real)
    out: dict[str, Any] = {"differing": differing, "max_abs": None if dtype == "bool" else max_abs,
                           "rel_l2": None, "compared": "values"}
    if category in ("float", "complex"):
        if nan:
            out["max_abs"], out["rel_l2"] = float("nan"), float("nan")
        elif diff_sq == 0.0:
            out["rel_l2"] = 0.0
        else:
            out["rel_l2"] = math.sqrt(diff_sq) / math.sqrt(base_sq) if base_sq else float("inf")
    return out


def add_changes(d: dict[str, Any], a: Manifest, b: Manifest, load: Callable[[Manifest, int], Any]) -> None:
    """Fill each entry ``d["changed"]`` lists (a ``diff_manifests`` result) with the size of its change: ``differing``,
    ``max_abs``, ``rel_l2`` (see ``tensor_change``); None where the dtype or shape changed. ``load(m, i)`` reads
    entry ``i`` of manifest ``m`` (``Reading.load_entry``): one tensor of each checkpoint at a time."""
    ia = {e["path"]: i for i, e in enumerate(a.entries)}
    ib = {e["path"]: i for i, e in enumerate(b.entries)}
    for c in d["changed"]:
        c.update(differing=None, max_abs=None, rel_l2=None)
        if c["was"] is not None:
            continue  # dtype or shape changed: no element-wise comparison
        xa = load(a, ia[c["path"]])
        xb = load(b, ib[c["path"]])
        try:
            c.update(tensor_change(xa, xb, c["dtype"]))
        finally:
            del xa, xb


def _plain(node: dict[str, Any]) -> Any:
    """A state-tree skeleton node (docs/format.md §8) as plain JSON: tensors as "<tensor>", typed values as their
    encoding."""
    (tag, value), = node.items()
    if tag == "dict":
        return {str(k): _plain(v) for k, v in value}
    if tag in ("list", "tuple"):
        return [_plain(v) for v in value]
    if tag == "entry":
        return "<tensor>"
    if tag == "typed":  # §8.3: dataclasses, namespaces, enums hold nodes; paths, dates, dtypes a plain "v"
        v = value.get("v")
        if isinstance(v, dict) and len(v) == 1:
            return _plain(v)
        if isinstance(v, list) and all(isinstance(x, dict) and len(x) == 1 for x in v):
            return [_plain(x) for x in v]
        return v
    if tag == "float" and isinstance(value, str):
        return float(value)
    return value


def flatten_config(value: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys (lists and scalars are values)."""
    out = {} if out is None else out
    if isinstance(value, dict) and value:
        for k, v in value.items():
            flatten_config(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif prefix:
        out[prefix] = value
    return out


def _settings(node: dict[str, Any], where: str, depth: int) -> list[tuple[str, dict[str, Any]]]:
    """(dotted path, node) of the settings subtrees (CONFIG_SUBTREES) of a tree, at most ``depth`` dicts down
    (Lightning's ``hyper_parameters`` at the top, a CheckpointManager's ``extras.hyper_parameters`` below it)."""
    found = []
    for k, v in node.get("dict", []) if isinstance(node, dict) else []:
        if not isinstance(v, dict):
            continue
        if k in CONFIG_SUBTREES and ("dict" in v or "typed" in v):
            found.append((f"{where}.{k}", v))
        elif depth > 1 and "dict" in v:
            found += _settings(v, f"{where}.{k}", depth - 1)
    return found


def run_config(record: dict[str, Any] | None, manifest: Manifest | None) -> dict[str, Any]:
    """What a run's record and one of its checkpoints say about how it was made, as dotted keys: ``config.*`` (the
    record's config), ``metadata.*`` (the manifest's), and ``<subtree>.*`` for the settings subtrees of the state
    tree (CONFIG_SUBTREES)."""
    out: dict[str, Any] = {}
    if record and isinstance(record.get("config"), dict) and record["config"]:
        flatten_config(record["config"], "config", out)
    if manifest is not None:
        if isinstance(manifest.doc.get("metadata"), dict) and manifest.doc["metadata"]:
            flatten_config(manifest.doc["metadata"], "metadata", out)
        for where, node in _settings(manifest.tree, "state", 2):
            try:
                flatten_config(_plain(node), where, out)
            except (ValueError, TypeError, AttributeError, KeyError):
                continue
    if len(out) > MAX_CONFIG_KEYS:
        keys = sorted(out)[:MAX_CONFIG_KEYS]
        out = {k: out[k] for k in keys} | {"…": f"{len(out) - MAX_CONFIG_KEYS} more keys not shown"}
    return out


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """{"changed": {key: [a, b]}, "added": {key: b}, "removed": {key: a}, "same": n} of two ``run_config``s."""
    return {"changed": {k: [a[k], b[k]] for k in sorted(a) if k in b and a[k] != b[k]},
            "added": {k: b[k] for k in sorted(b) if k not in a},
            "removed": {k: a[k] for k in sorted(a) if k not in b},
            "same": sum(1 for k in a if k in b and a[k] == b[k])}


def read_record(repo: Any, run: str) -> dict[str, Any] | None:
    """The run's record, or None when it has none or it cannot be read (a diff still compares the tensors)."""
    from .runs.record import Run
    try:
        return Run(repo, run).record()
    except (LuopanError, OSError):
        return None
