"""Refs: ``refs/runs/<run>/latest.json``, the advisory pointer to a run's newest manifest (docs/format.md §9)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptRepoError
from .canonical import seal, unseal_file
from .names import MAX_STEP, is_run_name, latest_ref_key, manifest_key


def build_ref(run: str, step: int, manifest_checksum: str) -> bytes:
    return seal({"manifest": manifest_key(run, step), "manifest_checksum": manifest_checksum, "step": step})


def parse_ref(data: bytes, where: str) -> dict[str, Any]:
    """The ref's fields, checked: ``manifest`` is the key of ``step``'s manifest of a valid run. Raises
    CorruptRepoError on any damage."""
    doc = unseal_file(data, f"ref {where}")
    step, key, checksum = doc.get("step"), doc.get("manifest"), doc.get("manifest_checksum")
    parts = key.split("/") if isinstance(key, str) else []
    if (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP or len(parts) != 4
            or not is_run_name(parts[1]) or key != manifest_key(parts[1], step) or not isinstance(checksum, str)):
        raise CorruptRepoError(f"ref {where} is damaged: it does not name a manifest and its step")
    if where.startswith("refs/") and where != latest_ref_key(parts[1]):
        raise CorruptRepoError(f"ref {where} names a manifest of another run ({key})")
    return doc
