"""Stage 4 of a save: commit the manifest (the checkpoint exists from then on), then the run's latest ref
(docs/format.md §10)."""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import CheckpointExistsError, UnsupportedValueError
from ..format.canonical import compress_json, sealed_checksum
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import seal_manifest
from ..format.names import latest_ref_key, manifest_key
from ..format.refs import build_ref
from ..store.base import Store, retract


def commit_manifest(store: Store, run: str, step: int, overwrite: bool, doc: dict[str, Any],
                    compress: bool = False) -> str:
    """Seal and write the manifest of ``run`` ``step`` (``compress``: as a zstd frame, docs/format.md §4), then its
    latest ref; returns the manifest's key."""
    raw = seal_manifest(doc)  # raises on metadata that is not JSON
    data = compress_json(raw) if compress else raw
    if len(raw) > MAX_MANIFEST_BYTES:  # readers refuse larger ones (docs/format.md §11): never commit one
        raise UnsupportedValueError(
            f"the manifest of run {run!r} step {step} would be {len(raw)} bytes, more than readers accept "
            f"({MAX_MANIFEST_BYTES}): use a larger chunk_size for this repository, or split the state into runs")
    mkey = manifest_key(run, step)
    try:
        if overwrite:
            store.put(mkey, data)
        elif not store.put_if_absent(mkey, data):
            raise CheckpointExistsError(
                f"run {run!r} step {step} was committed by another writer during this save; "
                "pass overwrite=True to replace it"
            )
    except OSError:
        # The manifest may be visible but not durable (e.g. the directory fsync failed). A save that raises must
        # not leave a checkpoint behind, so take ours back (best effort) before reporting the failure.
        if not overwrite:
            retract(store, mkey, data)
        raise
    # The checkpoint is committed now. The ref is advisory (docs/format.md §9): failing to update it must not
    # report the save as failed, or a caller would retry a step that already exists.
    try:
        store.put(latest_ref_key(run), build_ref(run, step, sealed_checksum(raw)))
    except OSError as exc:
        warnings.warn(f"checkpoint {run!r} step {step} is committed, but its latest ref could not be updated "
                      f"({exc}); readers ignore a stale ref and the next save repairs it", stacklevel=5)
    return mkey
