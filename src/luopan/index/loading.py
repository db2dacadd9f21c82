"""Rebuilding a faiss index from a snapshot manifest: the skeleton deserialized, every array sized in faiss's own
memory from the manifest, each chunk read and verified straight into it, then what faiss's reader checks checked
(docs/format.md §17.6)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptManifestError
from ..store.base import Store
from .extents import Gathered, read_into
from .ivf import check_counts, paths, segment_views
from .manifest import IDS, SKELETON


def build(store: Store, fc: Any, doc: dict[str, Any], key: str, owner: str) -> Any:
    """The faiss index a parsed manifest ``doc`` (read from ``key``) describes."""

    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"index manifest {key}: {msg}")

    entries = {e["path"]: e for e in doc["entries"]}
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
        targets: list[tuple[dict[str, Any], np.ndarray | Gathered]] = [(entries[p], v) for p, v in views]
        for node in lists:
            for k, (codes, ids, _m) in enumerate(segment_views(node, counts_of[node.prefix])):
                targets.append((entries[f"{node.prefix}ivf/{k}/codes"], codes))
                targets.append((entries[f"{node.prefix}ivf/{k}/ids"], ids))
        read_into(store, owner, doc, targets)
        fc.finish(index, doc["fields"], bad)
    if index.ntotal != doc["ntotal"] or index.d != doc["dim"]:
        raise bad(f"it rebuilds {index.ntotal} vectors of dimension {index.d}, it says {doc['ntotal']} of "
                  f"{doc['dim']}")
    return index


def read_array(store: Store, doc: dict[str, Any], path: str, owner: str) -> np.ndarray | None:
    """One 1-D or 2-D entry as a NumPy array (None when the manifest has no such entry)."""
    for e in doc["entries"]:
        if e["path"] == path:
            out = np.empty(e["shape"], dtype=e["dtype"])
            read_into(store, owner, doc, [(e, out)])
            return out
    return None
