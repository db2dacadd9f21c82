"""The index kind as the repository core sees it: snapshot manifests at ``indexes/<name>/_v/<version:08d>.json``,
pins at ``refs/pins/_indexes/<name>/<version:08d>.json`` (docs/format-index.md)."""

from __future__ import annotations

from typing import Any

from ..format.limits import MAX_SMALL_BYTES
from ..format.names import step_from_manifest_key
from ..repository.kinds import Catalog, Kind
from ..store.base import KeyNotFound, Store, Stray
from .manifest import parse_current, parse_index_manifest
from .names import (
    CURRENT_NAME,
    CURRENT_REFS,
    INDEX_PINS,
    INDEXES,
    LOG_DIR,
    VERSIONS,
    check_index,
    current_ref_key,
    index_manifest_key,
    index_pin_key,
    is_index_name,
    log_prefix,
)

__all__ = ["CURRENT_NAME", "CURRENT_REFS", "INDEX_KIND", "INDEX_PINS", "LOG_DIR", "check_index", "current_ref_key",
           "index_manifest_key", "index_pin_key", "is_index_name", "log_prefix"]

def _in_log(parts: list[str]) -> bool:
    """Whether ``indexes/…`` key parts lie in some index's op log directory (``indexes/<name>/log/…``)."""
    return any(parts[i] == LOG_DIR and is_index_name("/".join(parts[1:i])) for i in range(2, len(parts) - 1))


def scan(store: Store, name: str | None, strays: bool) -> Catalog:
    """Committed versions by index name (or of one ``name``, already checked); with ``strays``, what else lies under
    ``indexes/`` (or the name's directory) that is neither a manifest nor part of an op log."""
    prefix = INDEXES if name is None else f"{INDEXES}{name}/"
    cat = Catalog()
    if strays:
        keys, found = store.list_with_strays(prefix)
    else:
        keys, found = list(store.list(prefix)), []
    for key in keys:
        parts = key.split("/")
        number = step_from_manifest_key(key) if len(parts) >= 4 and parts[-2] == VERSIONS else None
        series = "/".join(parts[1:-2])
        if number is not None and number >= 1 and is_index_name(series):
            if name is None or series == name:
                cat.steps.setdefault(series, []).append(number)
            continue
        if not strays or _in_log(parts):
            continue
        if name is not None and number is not None and number >= 1 and is_index_name(series):
            continue  # a deeper index under this name's directory ("kb" vs "kb/main")
        if number is not None and number >= 1:
            cat.shadows.append(key)  # a manifest under an invalid name: kept by gc, never listed
        cat.strays.append(Stray(key, "not an index snapshot manifest (indexes/<name>/_v/<version:08d>.json) or op log"))
    for numbers in cat.steps.values():
        numbers.sort()
    if strays:
        cat.strays.extend(s for s in found if not _in_log(s.key.split("/")))
        cat.strays.sort(key=lambda s: s.key)
    return cat


def _scan(store: Store, name: str | None, strays: bool) -> Catalog:
    return scan(store, name, strays)


def _parse(data: bytes, key: str, name: str | None, version: int | None) -> dict[str, Any]:
    return parse_index_manifest(data, key, name, version)


def _companions(name: str, version: int) -> list[tuple[str, int]]:
    return [(index_pin_key(name, version), MAX_SMALL_BYTES)]


def _live(store: Store, name: str) -> set[int]:
    """The live version, which retention keeps like a pin (a damaged current ref is an error: nothing is pruned)."""
    key = current_ref_key(name)
    try:
        data = store.get_limited(key, MAX_SMALL_BYTES)
    except KeyNotFound:
        return set()
    return {parse_current(data, key, name)["version"]}


INDEX_KIND = Kind(
    name="index", root=INDEXES, series_noun="index", number_noun="version",
    manifest_key=index_manifest_key, scan=_scan, parse=_parse, pin_key=index_pin_key,
    check_series=check_index, companions=_companions, marker="_indexes/", inputs=lambda doc: [],
    protected=_live, plural="indexes",
)
