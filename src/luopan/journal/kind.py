"""The journal kind as the repository core sees it (docs/format.md §2a, §16): snapshot manifests at
``journals/<name>/_v/<seq:08d>.json``, numbered by the seq they cover up to; the live log's segments under
``journals/<name>/log/`` belong to the journal and are neither manifests nor strays."""

from __future__ import annotations

from typing import Any

from ..format.limits import MAX_SMALL_BYTES
from ..format.names import step_from_manifest_key
from ..repository.kinds import Catalog, Kind
from ..store.base import Store, Stray
from .manifest import parse_snapshot_manifest
from .names import (
    JOURNALS,
    LOG_DIR,
    SNAPSHOTS,
    check_journal,
    is_journal_name,
    snapshot_key,
    snapshot_pin_key,
)




def scan(store: Store, name: str | None, strays: bool) -> Catalog:
    """Committed snapshots by journal name (or of one ``name``, already checked); with ``strays``, what else lies
    under ``journals/`` that is neither a snapshot manifest nor a file of a journal's log directory."""
    prefix = JOURNALS if name is None else f"{JOURNALS}{name}/"
    cat = Catalog()
    if strays:
        keys, found = store.list_with_strays(prefix)
    else:
        keys, found = list(store.list(prefix)), []
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and is_journal_name(parts[1]) and parts[2] == LOG_DIR:
            continue  # the live log (segments, LOCK): the journal's own files
        number = step_from_manifest_key(key) if len(parts) == 4 and parts[2] == SNAPSHOTS else None
        if number is not None and is_journal_name(parts[1]):
            cat.steps.setdefault(parts[1], []).append(number)
            continue
        if not strays:
            continue
        if number is not None:
            cat.shadows.append(key)  # a snapshot manifest under an invalid name: kept by gc, never listed
        cat.strays.append(Stray(key, "not a journal snapshot manifest (journals/<name>/_v/<seq:08d>.json) or log file"))
    for numbers in cat.steps.values():
        numbers.sort()
    if strays:
        cat.strays.extend(found)
        cat.strays.sort(key=lambda s: s.key)
    return cat


def _parse(data: bytes, key: str, name: str | None, seq: int | None) -> dict[str, Any]:
    return parse_snapshot_manifest(data, key, name, seq)


def _companions(name: str, seq: int) -> list[tuple[str, int]]:
    return [(snapshot_pin_key(name, seq), MAX_SMALL_BYTES)]


JOURNAL_KIND = Kind(
    name="journal", root=JOURNALS, series_noun="journal", number_noun="seq",
    manifest_key=snapshot_key, scan=scan, parse=_parse, pin_key=snapshot_pin_key,
    check_series=check_journal, companions=_companions, marker="_journals/", inputs=lambda _doc: [],
)
