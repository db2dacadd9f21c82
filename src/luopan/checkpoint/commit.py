"""Stage 4 of a save: seal the manifest (committed through the repository's write transaction: the checkpoint exists
from then on), then point the run's latest ref at it (docs/format.md §9, §10)."""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import UnsupportedValueError
from ..format.canonical import compress_json, sealed_checksum
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import seal_manifest
from ..format.names import latest_ref_key
from ..format.refs import build_ref
from ..store.base import Store


def seal_checkpoint(doc: dict[str, Any], run: str, step: int, compress: bool) -> tuple[bytes, bytes]:
    """(sealed JSON, bytes to store) of the manifest of ``run`` ``step`` (``compress``: a zstd frame of it, §4).
    Raises on metadata that is not JSON, and on a manifest larger than readers accept (never commit one)."""
    raw = seal_manifest(doc)
    if len(raw) > MAX_MANIFEST_BYTES:  # readers refuse larger ones (docs/format.md §11)
        raise UnsupportedValueError(
            f"the manifest of run {run!r} step {step} would be {len(raw)} bytes, more than readers accept "
            f"({MAX_MANIFEST_BYTES}): use a larger chunk_size for this repository, or split the state into runs")
    return raw, compress_json(raw) if compress else raw


def write_latest_ref(store: Store, run: str, step: int, raw: bytes, stacklevel: int = 5) -> None:
    """Point the run's latest ref at the committed checkpoint. The ref is advisory (docs/format.md §9): failing to
    update it must not report the save as failed, or a caller would retry a step that already exists."""
    try:
        store.put(latest_ref_key(run), build_ref(run, step, sealed_checksum(raw)))
    except OSError as exc:
        warnings.warn(f"checkpoint {run!r} step {step} is committed, but its latest ref could not be updated "
                      f"({exc}); readers ignore a stale ref and the next save repairs it", stacklevel=stacklevel)
