"""faiss indexes as a small skeleton plus big arrays (docs/format.md §17.2): what a snapshot stores and a load
rebuilds.

Decomposed types: IndexFlat (L2, IP), IndexIVFFlat, IndexIVFPQ, IndexIVFScalarQuantizer (array inverted lists),
IndexHNSWFlat, and any of them inside IndexIDMap / IndexIDMap2. The skeleton is ``faiss.serialize_index`` of the
index while its big arrays are swapped out for empty ones (restored in ``finally``, before anything else sees the
index); the arrays are then read as views of faiss's own memory, never copied. A load deserializes the skeleton,
sizes each array in place, and the caller reads the chunks straight into faiss's memory. Other index types are stored
as one array of ``faiss.serialize_index`` bytes (it works; consecutive snapshots share nothing).

This module imports faiss: only ``luopan.index`` functions that need it import it, on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

FLAT = ("IndexFlat", "IndexFlatL2", "IndexFlatIP")
IVF = ("IndexIVFFlat", "IndexIVFPQ", "IndexIVFScalarQuantizer")
HNSW = ("IndexHNSWFlat",)
IDMAP = ("IndexIDMap", "IndexIDMap2")
SERIALIZED = "serialized"  # the entry of an index stored whole

Bad = Callable[[str], Exception]


@dataclass
class Parts:
    """A decomposed index: ``arrays`` are (path, array) with their manifest shapes (views of faiss memory)."""

    layout: str  # "parts" or "serialized"
    index_type: str
    skeleton: bytes
    arrays: list[tuple[str, np.ndarray]] = field(default_factory=list)
    fields: dict[str, int] = field(default_factory=dict)
    ivfs: list[Lists] = field(default_factory=list)


@dataclass
class Lists:
    """The inverted lists of an IVF node at ``prefix``: per list, views of its codes and ids (docs/format.md §17.2:
    stored as segments, not per list)."""

    prefix: str
    code_size: int
    codes: list[np.ndarray]
    ids: list[np.ndarray]


def is_faiss_index(obj: object) -> bool:
    return isinstance(obj, faiss.Index)


def _cls(node: Any) -> str:
    return type(node).__name__


def _down(node: Any) -> Any:
    return faiss.downcast_index(node)


def type_name(index: Any) -> str:
    """``IndexIDMap2(IndexIVFFlat)``: the class, and the wrapped class of an IDMap."""
    node = _down(index)
    name = _cls(node)
    if name in IDMAP:
        return f"{name}({type_name(node.index)})"
    return name


def supported(index: Any) -> bool:
    """Whether the index is decomposed into shareable arrays (else stored whole)."""
    node = _down(index)
    name = _cls(node)
    if name in FLAT:
        return True
    if name in IVF:
        return _cls(faiss.downcast_InvertedLists(node.invlists)) == "ArrayInvertedLists"
    if name in HNSW:
        return _cls(_down(node.storage)) in FLAT
    if name in IDMAP:
        return supported(node.index)
    return False


def accepts_ids(index: Any) -> bool:
    """Whether ``add_with_ids`` works (IDMap, IVF); flat and HNSW indexes number vectors in order."""
    node = _down(index)
    return _cls(node) in IDMAP or isinstance(node, faiss.IndexIVF)


def removes_ids(index_type: str) -> bool:
    return "HNSW" not in index_type


def _view(ptr: Any, n: int, dtype: Any) -> np.ndarray:
    if n == 0 or ptr is None:
        return np.empty(0, dtype=dtype)
    arr = faiss.rev_swig_ptr(ptr, n)
    if arr.dtype != np.dtype(dtype):
        arr = arr.view(dtype)
    return arr


# -- saving -------------------------------------------------------------------------------------------------------
def decompose(index: Any) -> Parts:
    """The skeleton and array views of ``index`` (left as it was found). Not safe while another thread uses it."""
    name = type_name(index)
    if not supported(index):
        data = faiss.serialize_index(index)
        return Parts(SERIALIZED, name, b"", [(SERIALIZED, data)])
    undo: list[Callable[[], None]] = []
    fields: dict[str, int] = {}
    node = _down(index)
    try:
        replacement = _strip(node, "", undo, fields)
        skeleton = faiss.serialize_index(replacement if replacement is not None else node).tobytes()
    finally:
        for step in reversed(undo):
            step()
    parts = Parts("parts", name, skeleton, fields=fields)
    _collect(node, "", parts.arrays, parts.ivfs)
    return parts


def _empty_flat(node: Any) -> Any:
    fresh = faiss.IndexFlat(node.d, node.metric_type)
    fresh.metric_arg = node.metric_arg
    return fresh


def _strip(node: Any, prefix: str, undo: list[Callable[[], None]], fields: dict[str, int]) -> Any:
    """Swap ``node``'s arrays out (recording how to undo it); returns an empty stand-in for a flat node."""
    name = _cls(node)
    if name in FLAT:
        return _empty_flat(node)
    ntotal = node.ntotal

    def restore_ntotal() -> None:
        node.ntotal = ntotal

    if name in IVF:
        orig, own = node.invlists, node.own_invlists
        empty = faiss.ArrayInvertedLists(node.nlist, node.code_size)
        node.own_invlists = False
        node.replace_invlists(empty, False)

        def restore_lists() -> None:
            node.replace_invlists(orig, own)
            del empty_ref[:]

        empty_ref = [empty]
        undo.append(restore_lists)
    elif name in HNSW:
        storage = node.storage
        stand_in = _strip(_down(storage), prefix + "storage/", undo, fields)
        hnsw = node.hnsw
        levels, offsets = faiss.Int32Vector(), faiss.UInt64Vector()
        offsets.push_back(0)
        hnsw.levels.swap(levels)
        hnsw.offsets.swap(offsets)
        nb = hnsw.neighbors
        neighbors = _view(nb.data(), nb.size(), np.int32).copy()
        nb.clear()
        fields[prefix + "hnsw.entry_point"] = int(hnsw.entry_point)
        fields[prefix + "hnsw.max_level"] = int(hnsw.max_level)
        ep, ml = hnsw.entry_point, hnsw.max_level
        hnsw.entry_point, hnsw.max_level = -1, -1
        node.storage = stand_in

        def restore_graph() -> None:
            node.storage = storage
            hnsw.levels.swap(levels)
            hnsw.offsets.swap(offsets)
            nb.resize(len(neighbors))
            if len(neighbors):
                _view(nb.data(), len(neighbors), np.int32)[:] = neighbors
            hnsw.entry_point, hnsw.max_level = ep, ml
            keep[:] = []

        keep = [stand_in]
        undo.append(restore_graph)
    elif name in IDMAP:
        sub = node.index
        stand_in = _strip(_down(sub), prefix + "index/", undo, fields)
        id_map = faiss.Int64Vector()
        node.id_map.swap(id_map)
        if stand_in is not None:
            node.index = stand_in

        def restore_map() -> None:
            node.id_map.swap(id_map)
            if stand_in is not None:
                node.index = sub

        undo.append(restore_map)
    else:  # pragma: no cover  (supported() said so)
        raise TypeError(name)
    node.ntotal = 0
    undo.append(restore_ntotal)
    return None


def _collect(node: Any, prefix: str, out: list[tuple[str, np.ndarray]], ivfs: list[Lists]) -> None:
    name = _cls(node)
    if name in FLAT:
        cs = node.code_size
        out.append((prefix + "codes", _view(node.codes.data(), node.codes.size(), np.uint8).reshape(-1, cs)))
    elif name in IVF:
        ivfs.append(_lists(node, prefix))
    elif name in HNSW:
        _collect(_down(node.storage), prefix + "storage/", out, ivfs)
        h = node.hnsw
        out.append((prefix + "hnsw/levels", _view(h.levels.data(), h.levels.size(), np.int32)))
        out.append((prefix + "hnsw/offsets", _view(h.offsets.data(), h.offsets.size(), np.uint64)))
        out.append((prefix + "hnsw/neighbors", _view(h.neighbors.data(), h.neighbors.size(), np.int32)))
    elif name in IDMAP:
        _collect(_down(node.index), prefix + "index/", out, ivfs)
        out.append((prefix + "id_map", _view(node.id_map.data(), node.id_map.size(), np.int64)))


def _lists(node: Any, prefix: str) -> Lists:
    lists = faiss.downcast_InvertedLists(node.invlists)
    cs = lists.code_size
    out = Lists(prefix, cs, [], [])
    for i in range(node.nlist):
        n = lists.list_size(i)
        out.codes.append(_view(lists.get_codes(i) if n else None, n * cs, np.uint8))
        out.ids.append(_view(lists.get_ids(i) if n else None, n, np.int64))
    return out


def id_map(index: Any) -> np.ndarray | None:
    """The external ids of an IDMap (a view), None for other types."""
    node = _down(index)
    if _cls(node) in IDMAP:
        return _view(node.id_map.data(), node.id_map.size(), np.int64)
    return None


# -- loading ------------------------------------------------------------------------------------------------------
def deserialize(data: bytes | np.ndarray, bad: Bad) -> Any:
    try:
        return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as exc:
        raise bad(f"faiss cannot read it: {str(exc).splitlines()[0][:300]}") from None


def ivf_prefixes(index: Any) -> list[tuple[str, int, int]]:
    """(prefix, nlist, code_size) of every IVF node of a deserialized skeleton."""
    node, prefix = _down(index), ""
    while _cls(node) in IDMAP or _cls(node) in HNSW:
        if _cls(node) in HNSW:
            return []
        node, prefix = _down(node.index), prefix + "index/"
    return [(prefix, node.nlist, node.code_size)] if _cls(node) in IVF else []


def allocate(index: Any, shapes: dict[str, tuple[str, list[int]]], sizes: dict[str, np.ndarray], bad: Bad
             ) -> tuple[list[tuple[str, np.ndarray]], list[Lists]]:
    """Size every array of a deserialized skeleton from the manifest's (dtype, shape) by path, and every IVF node's
    lists from ``sizes`` (prefix -> entries per list); returns writable views of faiss's memory to read the chunks
    into. ``bad`` makes the error for a manifest that does not fit."""
    out: list[tuple[str, np.ndarray]] = []
    ivfs: list[Lists] = []
    _allocate(_down(index), "", shapes, sizes, bad, out, ivfs)
    return out, ivfs


def _shape(shapes: dict[str, tuple[str, list[int]]], path: str, dtype: str, width: int | None, bad: Bad) -> int:
    if path not in shapes:
        raise bad(f"it lacks the entry {path!r}")
    got_dtype, shape = shapes[path]
    want = [width] if width is not None else []
    if got_dtype != dtype or len(shape) != 1 + len(want) or shape[1:] != want:
        raise bad(f"entry {path!r} is {got_dtype} {shape}, expected {dtype} [n{''.join(f', {w}' for w in want)}]")
    return shape[0]


def _allocate(node: Any, prefix: str, shapes: dict[str, tuple[str, list[int]]], sizes: dict[str, np.ndarray],
              bad: Bad, out: list[tuple[str, np.ndarray]], ivfs: list[Lists]) -> None:
    name = _cls(node)
    if name in FLAT:
        cs = node.code_size
        n = _shape(shapes, prefix + "codes", "uint8", cs, bad)
        node.codes.resize(n * cs)
        out.append((prefix + "codes", _view(node.codes.data(), n * cs, np.uint8)))
    elif name in IVF:
        lists = faiss.downcast_InvertedLists(node.invlists)
        counts = sizes.get(prefix)
        if _cls(lists) != "ArrayInvertedLists" or counts is None or len(counts) != node.nlist:
            raise bad(f"its inverted lists at {prefix or 'the top'} do not match the skeleton")
        for i, n in enumerate(counts.tolist()):
            lists.resize(i, n)
        ivfs.append(_lists(node, prefix))
    elif name in HNSW:
        storage = _down(node.storage)
        if _cls(storage) not in FLAT:
            raise bad("its HNSW storage is not a flat index")
        _allocate(storage, prefix + "storage/", shapes, sizes, bad, out, ivfs)
        h = node.hnsw
        for vec, part, dtype in ((h.levels, "levels", np.int32), (h.offsets, "offsets", np.uint64),
                                 (h.neighbors, "neighbors", np.int32)):
            n = _shape(shapes, f"{prefix}hnsw/{part}", np.dtype(dtype).name, None, bad)
            vec.resize(n)
            out.append((f"{prefix}hnsw/{part}", _view(vec.data(), n, dtype)))
    elif name in IDMAP:
        _allocate(_down(node.index), prefix + "index/", shapes, sizes, bad, out, ivfs)
        n = _shape(shapes, prefix + "id_map", "int64", None, bad)
        node.id_map.resize(n)
        out.append((prefix + "id_map", _view(node.id_map.data(), n, np.int64)))
    else:
        raise bad(f"its skeleton is a {name}, which is not stored in parts")


def finish(index: Any, fields: dict[str, int], bad: Bad) -> None:
    """Set the counts the skeleton had zeroed, restore ``fields`` and check what faiss's reader would check (an HNSW
    graph's ranges, IDMap sizes) before the index is searched."""
    _finish(_down(index), "", fields, bad)
    unused = set(fields) - _field_names(_down(index), "")
    if unused:
        raise bad(f"fields {sorted(unused)[:5]} belong to no part of a {type_name(index)}")


def _field_names(node: Any, prefix: str) -> set[str]:
    name = _cls(node)
    if name in HNSW:
        return {prefix + "hnsw.entry_point", prefix + "hnsw.max_level"}
    if name in IDMAP:
        return _field_names(_down(node.index), prefix + "index/")
    return set()


def _finish(node: Any, prefix: str, fields: dict[str, int], bad: Bad) -> None:
    name = _cls(node)
    if name in FLAT:
        node.ntotal = node.codes.size() // node.code_size
    elif name in IVF:
        lists = faiss.downcast_InvertedLists(node.invlists)
        node.ntotal = sum(lists.list_size(i) for i in range(node.nlist))
    elif name in HNSW:
        storage = _down(node.storage)
        _finish(storage, prefix + "storage/", fields, bad)
        _check_hnsw(node.hnsw, storage.ntotal, prefix, fields, bad)
        node.ntotal = storage.ntotal
    elif name in IDMAP:
        sub = _down(node.index)
        _finish(sub, prefix + "index/", fields, bad)
        n = node.id_map.size()
        if n != sub.ntotal:
            raise bad(f"its id map holds {n} ids for {sub.ntotal} vectors")
        node.ntotal = n
        if name == "IndexIDMap2":
            node.construct_rev_map()


def _check_hnsw(h: Any, ntotal: int, prefix: str, fields: dict[str, int], bad: Bad) -> None:
    """What faiss's validate_HNSW checks, vectorized: search never reads outside the graph."""
    levels = _view(h.levels.data(), h.levels.size(), np.int32)
    offsets = _view(h.offsets.data(), h.offsets.size(), np.uint64)
    neighbors = _view(h.neighbors.data(), h.neighbors.size(), np.int32)
    cum = np.array([h.cum_nneighbor_per_level.at(i) for i in range(h.cum_nneighbor_per_level.size())],
                   dtype=np.int64)
    entry, top = fields.get(prefix + "hnsw.entry_point"), fields.get(prefix + "hnsw.max_level")
    if entry is None or top is None:
        raise bad(f"it lacks the HNSW entry point or top level of {prefix or 'the index'}")
    ok = (len(levels) == ntotal and len(offsets) == ntotal + 1 and len(cum) > 0 and cum[0] == 0
          and bool(np.all(np.diff(cum) >= 0)) and -1 <= entry < max(ntotal, 0) and top < len(cum)
          and (ntotal > 0 or entry == -1))
    if ok and ntotal:
        ok = bool(levels.min() >= 1 and levels.max() < len(cum))
        # search descends from max_level through the entry point's own lists: faiss keeps max_level equal to the
        # entry point's top level, and a larger one would read past that node's neighbors
        ok = ok and entry >= 0 and top == int(levels[entry]) - 1
    elif ok:
        ok = entry == -1 and top == -1
    if ok:
        ok = offsets[0] == 0 and (ntotal == 0 or bool(np.array_equal(
            np.diff(offsets.astype(np.int64)), cum[levels]))) and int(offsets[-1]) <= len(neighbors)
    if ok and len(neighbors):
        ok = bool(neighbors.min() >= -1 and neighbors.max() < ntotal)
    if not ok:
        raise bad("its HNSW graph is inconsistent (levels, offsets, neighbors or entry point out of range)")
    h.entry_point, h.max_level = entry, top
