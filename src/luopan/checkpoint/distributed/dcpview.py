"""A DCP checkpoint's ``dcp`` member (docs/format.md §8.4) seen as the sharded layouts of a collective save (§10.5), so
that ``load``, ``load_into`` and ``export`` assemble its shards into whole tensors with the same machinery and the
same checks (chunks of their entries' shape and dtype, tiling the global shape exactly). Torch-free: luopan.dcp.layout
decodes the member for DCP itself."""

from __future__ import annotations

from typing import Any

from ...errors import CorruptManifestError
from ...format.manifest import Manifest
from ...format.names import escape_key
from .ranks import Ranks, Sharded, parse_layouts, parse_ranks


def dcp_layouts(m: Manifest) -> dict[str, Sharded]:
    """{key path: layout} of every tensor of DCP checkpoint ``m`` stored as shards (a tensor stored whole under its
    name is an ordinary entry). CorruptManifestError when the member disagrees with the entries."""
    where = f"manifest run {m.run!r} step {m.step}: its DCP layout is damaged"
    raw: dict[str, Any] = {}
    try:
        doc = m.doc["dcp"]
        stored: dict[str, list[tuple[Any, Any]]] = {}  # fqn -> [(offsets, entry index)]
        for (fqn, offset, _hint), info in doc["storage"]:
            if type(info) is dict and "entry" in info:
                stored.setdefault(fqn, []).append((offset, info["entry"]))
        for fqn, t in doc["tensors"].items():
            items = stored.get(fqn)
            if not items:
                continue  # nothing stored, nothing in the tree to assemble
            path = escape_key(fqn)
            if len(items) == 1 and type(items[0][1]) is int and 0 <= items[0][1] < len(m.entries) \
                    and m.entries[items[0][1]]["path"] == path:
                continue  # stored whole
            sizes = {tuple(o): list(s) for o, s in t["chunks"]}
            chunks = []
            for offset, i in items:
                at = tuple(offset) if offset is not None else (0,) * len(t["size"])
                if at not in sizes:
                    raise CorruptManifestError(f"{where}: {fqn!r} stores a chunk at {list(at)} its layout lacks")
                chunks.append([list(at), sizes[at], i, []])
            if len(chunks) != len(t["chunks"]):
                raise CorruptManifestError(f"{where}: {fqn!r} has {len(t['chunks'])} chunks in its layout and "
                                           f"{len(chunks)} stored")
            raw[path] = {"dtype": t["dtype"], "size": t["size"], "chunks": chunks}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptManifestError(f"{where} ({type(exc).__name__}: {str(exc)[:200]})") from None
    return parse_layouts(raw, m.entries, where)


def layouts(m: Manifest) -> Ranks:
    """The checked layouts ``m`` records: a collective save's ``ranks`` member, or a DCP checkpoint's ``dcp`` member
    (no ranks recorded: world 0, every rank loads it whole)."""
    if "ranks" not in m.doc and "dcp" in m.doc:
        return Ranks(sharded=dcp_layouts(m))
    return parse_ranks(m)
