"""``du``: logical bytes over every manifest of every kind vs the bytes their distinct chunks take as stored, and
physical bytes in the store (docs/format.md §2a)."""

from __future__ import annotations

from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..store.base import KeyNotFound
from .kinds import Opened
from .verify import manifest_chunk_refs


def usage(repo: Opened) -> dict[str, int]:
    """What the repository holds and costs (``checkpoints``, ``artifacts``: how many of each;
    ``damaged_manifests``: ones that could not be read, not counted):

    * ``logical_bytes``: what restoring every manifest of every kind would write (their ``stats.logical_bytes``);
    * ``stored_bytes``, ``chunks``: the distinct chunks those manifests reference, as stored (compressed): the dedup
      ratio is ``logical_bytes / stored_bytes``, the one definition ``luopan du`` and ``luopan stats`` share;
    * ``physical_bytes``: every byte in the store (``pack_bytes``, ``index_bytes``, ``manifest_bytes``,
      ``ref_bytes``): the stored chunks plus metadata and pack bytes no manifest references (what ``gc`` frees)."""
    out: dict[str, int] = {k.count_key: 0 for k in repo.kinds}
    logical = damaged = 0
    chunks: dict[str, int] = {}  # "hash/pack/offset" -> stored length: each stored copy counted once
    for kind in repo.kinds:
        for series, number in kind.scan(repo.store, None, False).pairs():
            try:
                doc = repo.read_manifest(kind, series, number)
                refs = list(manifest_chunk_refs(kind, series, number, doc))
            except (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound):
                damaged += 1  # counted, not fatal: `verify` names it
                continue
            logical += doc["stats"]["logical_bytes"]
            chunks.update((f"{r.hash}/{r.pack}/{r.offset}", r.length) for r in refs)
            out[kind.count_key] += 1
    sizes = {"packs": 0, "index": 0, "refs": 0, **{k.root.rstrip("/"): 0 for k in repo.kinds}}
    for top in sizes:
        for key in repo.store.list(top + "/"):
            try:
                sizes[top] += repo.store.size(key)
            except (KeyNotFound, StorageError):
                pass
    manifests = sum(sizes[k.root.rstrip("/")] for k in repo.kinds)
    out.update({"damaged_manifests": damaged, "logical_bytes": logical, "stored_bytes": sum(chunks.values()),
                "chunks": len(chunks), "physical_bytes": sum(sizes.values()),
                "pack_bytes": sizes["packs"], "index_bytes": sizes["index"], "manifest_bytes": manifests,
                "ref_bytes": sizes["refs"]})
    return out
