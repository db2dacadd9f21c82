"""``du``: logical bytes over every manifest of every kind vs physical bytes in the store (docs/format.md §2a)."""

from __future__ import annotations

from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..store.base import KeyNotFound
from .kinds import Opened


def usage(repo: Opened) -> dict[str, int]:
    """Logical bytes over every manifest of every kind vs physical bytes in the store (``checkpoints``,
    ``artifacts``: how many of each; ``damaged_manifests``: ones that could not be read)."""
    out: dict[str, int] = {k.count_key: 0 for k in repo.kinds}
    logical = damaged = 0
    for kind in repo.kinds:
        for series, number in kind.scan(repo.store, None, False).pairs():
            try:
                logical += repo.read_manifest(kind, series, number)["stats"]["logical_bytes"]
            except (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound):
                damaged += 1  # counted, not fatal: `verify` names it
                continue
            out[kind.count_key] += 1
    sizes = {"packs": 0, "index": 0, "refs": 0, **{k.root.rstrip("/"): 0 for k in repo.kinds}}
    for top in sizes:
        for key in repo.store.list(top + "/"):
            try:
                sizes[top] += repo.store.size(key)
            except (KeyNotFound, StorageError):
                pass
    manifests = sum(sizes[k.root.rstrip("/")] for k in repo.kinds)
    out.update({"damaged_manifests": damaged, "logical_bytes": logical, "physical_bytes": sum(sizes.values()),
                "pack_bytes": sizes["packs"], "index_bytes": sizes["index"], "manifest_bytes": manifests,
                "ref_bytes": sizes["refs"]})
    return out
