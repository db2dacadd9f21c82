"""The artifact kind as the repository core sees it: version manifests at
``artifacts/<name>/_v/<version:08d>.json`` (docs/format.md §2, §8.2)."""

from __future__ import annotations

from typing import Any

from ..format.names import (
    ARTIFACT_VERSIONS,
    ARTIFACTS,
    artifact_manifest_key,
    artifact_pin_key,
    check_artifact,
    is_artifact_name,
    step_from_manifest_key,
)
from ..format.limits import MAX_SMALL_BYTES
from ..repository.kinds import Catalog, Kind
from ..store.base import Store, Stray
from .manifest import parse_artifact_manifest


def scan(store: Store, name: str | None, strays: bool) -> Catalog:
    """Committed versions by artifact name (or of one ``name``, already checked); with ``strays``, what else lies
    under ``artifacts/`` (or the name's directory)."""
    prefix = ARTIFACTS if name is None else f"{ARTIFACTS}{name}/"
    cat = Catalog()
    if strays:
        keys, found = store.list_with_strays(prefix)
    else:
        keys, found = list(store.list(prefix)), []
    for key in keys:
        parts = key.split("/")
        number = step_from_manifest_key(key) if len(parts) >= 4 and parts[-2] == ARTIFACT_VERSIONS else None
        series = "/".join(parts[1:-2])
        if number is not None and number >= 1 and is_artifact_name(series):
            if name is None or series == name:
                cat.steps.setdefault(series, []).append(number)
            continue
        if not strays:
            continue
        if name is not None and number is not None and number >= 1 and is_artifact_name(series):
            continue  # a deeper artifact under this name's directory ("datasets" vs "datasets/clean")
        if number is not None and number >= 1:
            cat.shadows.append(key)  # a manifest under an invalid name: kept by gc, never listed
        cat.strays.append(Stray(key, "not an artifact version manifest (artifacts/<name>/_v/<version:08d>.json)"))
    for numbers in cat.steps.values():
        numbers.sort()
    if strays:
        cat.strays.extend(found)
        cat.strays.sort(key=lambda s: s.key)
    return cat


def _scan(store: Store, name: str | None, strays: bool) -> Catalog:
    return scan(store, name, strays)


def _parse(data: bytes, key: str, name: str | None, version: int | None) -> dict[str, Any]:
    return parse_artifact_manifest(data, key, name, version)


def _parents(doc: dict[str, Any]) -> list[str]:
    return list(doc["parents"])


def _companions(name: str, version: int) -> list[tuple[str, int]]:
    return [(artifact_pin_key(name, version), MAX_SMALL_BYTES)]


ARTIFACTS_KIND = Kind(
    name="artifact", root=ARTIFACTS, series_noun="artifact", number_noun="version",
    manifest_key=artifact_manifest_key, scan=_scan, parse=_parse, pin_key=artifact_pin_key,
    check_series=check_artifact, companions=_companions, marker="_artifacts/", inputs=_parents,
)
