"""Rebuilding a faiss index from a snapshot manifest: the skeleton deserialized, every array sized in faiss's own
memory from the manifest, each chunk read and verified straight into it, then what faiss's reader checks checked
(docs/format.md §17.6)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptManifestError, IntegrityError
from ..store.base import Store
from .extents import Gathered, as_bytes, read_into
from .ivf import check_counts, paths, segment_views
from .manifest import IDS, SKELETON
from .rowmap import check_runs, digest, expand

Target = np.ndarray | Gathered


def live_entries(doc: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The entries as the arrays they stand for (a row map's columns with their live row count, its runs left out),
    and the row map of each pooled column (§17.7)."""
    rowmaps = doc.get("rowmaps", [])
    pooled = {c: rm for rm in rowmaps for c in rm["columns"]}
    runs = {rm["runs"] for rm in rowmaps}
    live = {}
    for e in doc["entries"]:
        p = e["path"]
        if p in runs:
            continue
        live[p] = {**e, "shape": [pooled[p]["rows"], *e["shape"][1:]]} if p in pooled else e
    return live, pooled


def fill_rowmaps(store: Store, owner: str, doc: dict[str, Any], targets: dict[str, Target], bad: Any) -> None:
    """Assemble each pooled column into its target: the pool read and verified, its rows gathered by the runs, and
    the live bytes checked against the row map's XXH3-128 (an IntegrityError names the manifest)."""
    entries = {e["path"]: e for e in doc["entries"]}
    for rm in doc.get("rowmaps", []):
        cols = [c for c in rm["columns"] if c in targets]
        if not cols:
            continue
        re = entries[rm["runs"]]
        runs = np.empty(re["shape"], dtype=np.int64)
        read_into(store, owner, doc, [(re, runs)])
        pool_rows, rows = entries[rm["columns"][0]]["shape"][0], rm["rows"]
        check_runs(runs, pool_rows, rows, bad, rm["runs"])
        idx = expand(runs)
        for c in cols:
            e = entries[c]
            pool = np.empty(e["shape"], dtype=e["dtype"])
            read_into(store, owner, doc, [(e, pool)])
            width = pool.nbytes // pool_rows if pool_rows else 0
            gathered = np.take(pool.view(np.uint8).reshape(pool_rows, width), idx, axis=0) if rows else \
                np.empty((0, width), np.uint8)
            flat = gathered.reshape(-1)
            dest = targets[c]
            pieces = dest.pieces if isinstance(dest, Gathered) else [as_bytes(dest)]
            off = 0
            for piece in pieces:
                if len(piece):
                    np.frombuffer(piece, dtype=np.uint8)[:] = flat[off:off + len(piece)]
                off += len(piece)
            if off != len(flat):
                raise bad(f"row map column {c!r} does not fit its array")
        if len(cols) == len(rm["columns"]):
            got = digest([t if isinstance(t, Gathered) else Gathered([as_bytes(t)])
                          for t in (targets[c] for c in cols)])
            if got != rm["xxh3"]:
                raise IntegrityError(f"{owner}: the rows assembled by row map {rm['runs']!r} do not hash to its xxh3 "
                                     f"({got} != {rm['xxh3']}); the index is not returned")


def build(store: Store, fc: Any, doc: dict[str, Any], key: str, owner: str) -> Any:
    """The faiss index a parsed manifest ``doc`` (read from ``key``) describes."""

    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"index manifest {key}: {msg}")

    entries, pooled = live_entries(doc)
    if doc["layout"] == "serialized":
        if set(entries) - {"serialized", IDS}:
            raise bad("a serialized index has other entries")
        e = entries["serialized"]
        buf = np.empty(e["shape"][0], dtype=np.uint8)
        read_into(store, owner, doc, [(e, buf)])
        index = fc.deserialize(buf, bad)
    else:
        e = entries[SKELETON]
        if e["dtype"] != "uint8" or len(e["shape"]) != 1:
            raise bad("its skeleton entry is not a byte array")
        skeleton = np.empty(e["shape"][0], dtype=np.uint8)
        read_into(store, owner, doc, [(e, skeleton)])
        index = fc.deserialize(skeleton, bad)
        sizes: dict[str, np.ndarray] = {}
        counts_of: dict[str, np.ndarray] = {}
        known = {SKELETON, IDS}
        for prefix, nlist, code_size in fc.ivf_prefixes(index):
            ce = entries.get(prefix + "ivf/counts")
            if ce is None or ce["dtype"] != "int64" or len(ce["shape"]) != 2:
                raise bad(f"it lacks the inverted list counts {prefix}ivf/counts")
            counts = np.empty(ce["shape"], dtype=np.int64)
            read_into(store, owner, doc, [(ce, counts)])
            check_counts(counts, nlist, entries, prefix, code_size, bad)
            sizes[prefix], counts_of[prefix] = counts.sum(axis=0), counts
            known |= paths(prefix, len(counts))
        shapes = {p: (x["dtype"], x["shape"]) for p, x in entries.items() if p not in known}
        views, lists = fc.allocate(index, shapes, sizes, bad)
        extra = set(shapes) - {p for p, _v in views}
        if extra:
            raise bad(f"entries {sorted(extra)[:5]} belong to no array of a {fc.type_name(index)}")
        wanted: list[tuple[str, Target]] = list(views)
        for node in lists:
            for k, (codes, ids, _m) in enumerate(segment_views(node, counts_of[node.prefix])):
                wanted += [(f"{node.prefix}ivf/{k}/codes", codes), (f"{node.prefix}ivf/{k}/ids", ids)]
        read_into(store, owner, doc, [(entries[p], v) for p, v in wanted if p not in pooled])
        fill_rowmaps(store, owner, doc, {p: v for p, v in wanted if p in pooled}, bad)
        fc.finish(index, doc["fields"], bad)
    if index.ntotal != doc["ntotal"] or index.d != doc["dim"]:
        raise bad(f"it rebuilds {index.ntotal} vectors of dimension {index.d}, it says {doc['ntotal']} of "
                  f"{doc['dim']}")
    return index


def read_array(store: Store, doc: dict[str, Any], path: str, owner: str) -> np.ndarray | None:
    """One 1-D or 2-D array as NumPy (None when the manifest has no such entry); a row map's column is assembled."""
    entries, pooled = live_entries(doc)
    e = entries.get(path)
    if e is None:
        return None
    out = np.empty(e["shape"], dtype=e["dtype"])
    if path in pooled:
        fill_rowmaps(store, owner, doc, {path: out}, lambda msg: CorruptManifestError(f"index {owner}: {msg}"))
    else:
        read_into(store, owner, doc, [(e, out)])
    return out
