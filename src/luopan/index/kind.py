"""The index kind as the repository core sees it: snapshot manifests at ``indexes/<name>/_v/<version:08d>.json``,
pins at ``refs/pins/_indexes/<name>/<version:08d>.json`` (docs/format.md §17.1)."""

from __future__ import annotations

from typing import Any

from ..format.limits import MAX_SMALL_BYTES
from ..repository.kinds import Catalog, Kind, log_sizes, scan_numbered
from ..store.base import KeyNotFound, Store
from .manifest import parse_current, parse_index_manifest
from .names import (
    CURRENT_NAME,
    CURRENT_REFS,
    INDEX_PINS,
    INDEXES,
    LOG_DIR,
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
    return scan_numbered(store, INDEXES, name, strays, is_series=is_index_name, own=_in_log,
                         what="an index snapshot manifest (indexes/<name>/_v/<version:08d>.json) or op log")


def _scan(store: Store, name: str | None, strays: bool) -> Catalog:
    return scan(store, name, strays)


def _series_of_log(parts: list[str]) -> str | None:
    for i in range(2, len(parts) - 1):
        if parts[i] == LOG_DIR and is_index_name("/".join(parts[1:i])):
            return "/".join(parts[1:i])
    return None


def _logs(store: Store) -> dict[str, int]:
    """index name -> bytes of its op log's files (§17.5)."""
    return log_sizes(store, INDEXES, _series_of_log)


def _parse(data: bytes, key: str, name: str | None, version: int | None, _store: object = None) -> dict[str, Any]:
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
    protected=_live, plural="indexes", manifest_noun="version", logs=_logs,
)
