"""The artifact kind as the repository core sees it: version manifests at
``artifacts/<name>/_v/<version:08d>.json`` (docs/format.md §2, §8.2)."""

from __future__ import annotations

from typing import Any

from ..format.names import (
    ARTIFACTS,
    artifact_manifest_key,
    artifact_pin_key,
    check_artifact,
    is_artifact_name,
)
from ..format.limits import MAX_SMALL_BYTES
from ..repository.kinds import Catalog, Kind, scan_numbered
from ..store.base import Store
from .manifest import parse_artifact_manifest


def scan(store: Store, name: str | None, strays: bool) -> Catalog:
    """Committed versions by artifact name (or of one ``name``, already checked); with ``strays``, what else lies
    under ``artifacts/`` (or the name's directory)."""
    return scan_numbered(store, ARTIFACTS, name, strays, is_series=is_artifact_name,
                         what="an artifact version manifest (artifacts/<name>/_v/<version:08d>.json)")


def _scan(store: Store, name: str | None, strays: bool) -> Catalog:
    return scan(store, name, strays)


def _parse(data: bytes, key: str, name: str | None, version: int | None, _store: object = None) -> dict[str, Any]:
    return parse_artifact_manifest(data, key, name, version)


def _parents(doc: dict[str, Any]) -> list[str]:
    return list(doc["parents"])


def _companions(name: str, version: int) -> list[tuple[str, int]]:
    return [(artifact_pin_key(name, version), MAX_SMALL_BYTES)]


ARTIFACTS_KIND = Kind(
    name="artifact", root=ARTIFACTS, series_noun="artifact", number_noun="version",
    manifest_key=artifact_manifest_key, scan=_scan, parse=_parse, pin_key=artifact_pin_key,
    check_series=check_artifact, companions=_companions, marker="_artifacts/", inputs=_parents,
    manifest_noun="version",
)
