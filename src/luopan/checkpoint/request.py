"""A save request: a state tree flattened and checked, its metrics and metadata snapshotted, and what change detection
knows before any byte is written (tensor version records, touched-row hints)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedValueError
from ..format.canonical import canonical, json_culprit
from ..tree import Leaf
from .rowdelta import normalise_hint


@dataclass
class SaveRequest:
    """One save, checked and snapshotted before any byte is written: what `save` and `save_async` hand the writer."""

    run: str
    step: int
    skeleton: dict[str, Any]
    leaves: list[Leaf]
    metrics: dict[str, Any]
    metadata: dict[str, Any] | None
    overwrite: bool
    versions: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    unchanged: frozenset[int] = frozenset()
    hints: dict[str, Any] = field(default_factory=dict)  # touched rows per table path
    snapshot: bool = False  # save_async: leaves were copied, except the ones in ``unchanged``
    inputs: list[str] = field(default_factory=list)  # "NAME@N" of what the checkpoint was made from (lineage)


def tensor_versions(leaves: list[Leaf]) -> dict[int, tuple[str, tuple[Any, ...]]]:
    """leaf index -> (path, record) for torch tensor leaves: the tier-1 change-detection record of one save
    (weak reference to the storage, version counter, address, layout, dtype, device, conj/neg bits).

    The version counter is shared by a tensor, its views and ``detach()``, so a fresh ``state_dict()`` of the same
    parameters still matches; torch returns the same storage object on every call, so a weak reference to it
    tells a live storage from a freed one whose address was reused. Tensors without a version counter
    (inference mode) get no record and are always read.
    """
    out = {}
    for i, leaf in enumerate(leaves):
        t = leaf.obj
        if leaf.kind != "torch" or leaf.alias_of is not None or leaf.nbytes == 0 or t.is_inference():
            continue
        storage = t.untyped_storage()
        try:
            ref = weakref.ref(storage)
        except TypeError:
            continue
        out[i] = (leaf.path, (ref, t._version, storage.data_ptr(), t.storage_offset(), leaf.shape, t.stride(),
                              t.dtype, "cpu" if t.is_cpu else str(t.device), t.is_conj(), t.is_neg()))
    return out


def same_version(seen: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    storage = seen[0]()
    return storage is not None and storage is now[0]() and seen[1:] == now[1:]


def entries_by_path(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in doc["entries"] if "chunks" in e}


def touched_hints(touched_rows: dict[str, Any] | None, leaves: list[Leaf]) -> dict[str, Any]:
    """touched_rows checked against the state: each key a table entry, each value valid row numbers (copied)."""
    if not touched_rows:
        return {}
    if not isinstance(touched_rows, dict):
        raise UnsupportedValueError(
            f"touched_rows must be a dict of key path -> row numbers, got {type(touched_rows).__name__}")
    by_path = {leaf.path: leaf for leaf in leaves}
    out = {}
    for path, ids in touched_rows.items():
        leaf = by_path.get(path)
        if leaf is None:
            near = sorted(p for p in by_path if len(by_path[p].shape) >= 2)[:10]
            raise UnsupportedValueError(
                f"touched_rows names {path!r}, which is not a key path of the state; tables in the state: "
                f"{', '.join(near) or 'none'}")
        if len(leaf.shape) < 2 or leaf.alias_of is not None:
            raise UnsupportedValueError(
                f"touched_rows names {path!r}, which is not a table (a tensor with at least 2 dimensions stored "
                "under its own key)")
        out[path] = normalise_hint(path, ids, leaf.shape[0])
    return out


def check_json(name: str, value: Any, kind: type) -> None:
    if value is None:
        return
    if not isinstance(value, kind):
        raise UnsupportedValueError(f"{name} must be a {kind.__name__} of JSON values, got {type(value).__name__}")
    try:
        canonical(value)
    except (TypeError, ValueError, RecursionError) as exc:  # ValueError: NaN, ints > 4300 digits, lone surrogates
        where = json_culprit(value, name)
        raise UnsupportedValueError(
            f"{name} must hold only JSON-storable values (str without lone surrogates, finite numbers, ints under "
            f"4300 digits, bool, None, lists, dicts with str keys){' — ' + where if where else ''}: {exc}"
        ) from None
