"""The journal kind as the repository core sees it (docs/format.md §2a, §16): snapshot manifests at
``journals/<name>/_v/<seq:08d>.json``, numbered by the seq they cover up to; the live log's segments under
``journals/<name>/log/`` belong to the journal and are neither manifests nor strays."""

from __future__ import annotations

from typing import Any

from ..format.limits import MAX_SMALL_BYTES
from ..repository.kinds import Catalog, Kind, log_sizes, scan_numbered
from ..store.base import Store
from .manifest import parse_snapshot_manifest
from .names import (
    JOURNALS,
    LOG_DIR,
    check_journal,
    is_journal_name,
    snapshot_key,
    snapshot_pin_key,
)




def _in_log(parts: list[str]) -> bool:
    """A file of a journal's live log (``journals/<name>/log/…``: segments, LOCK): the journal's own."""
    return len(parts) == 4 and is_journal_name(parts[1]) and parts[2] == LOG_DIR


def scan(store: Store, name: str | None, strays: bool) -> Catalog:
    """Committed snapshots by journal name (or of one ``name``, already checked); with ``strays``, what else lies
    under ``journals/`` that is neither a snapshot manifest nor a file of a journal's log directory."""
    return scan_numbered(store, JOURNALS, name, strays, is_series=is_journal_name, first=0, own=_in_log,
                         what="a journal snapshot manifest (journals/<name>/_v/<seq:08d>.json) or log file")


def _logs(store: Store) -> dict[str, int]:
    """journal name -> bytes of its live log's files (segments, LOCK, DURABLE)."""
    return log_sizes(store, JOURNALS, lambda parts: parts[1] if _in_log(parts) else None)


def _parse(data: bytes, key: str, name: str | None, seq: int | None, _store: object = None) -> dict[str, Any]:
    return parse_snapshot_manifest(data, key, name, seq)


def _companions(name: str, seq: int) -> list[tuple[str, int]]:
    return [(snapshot_pin_key(name, seq), MAX_SMALL_BYTES)]


JOURNAL_KIND = Kind(
    name="journal", root=JOURNALS, series_noun="journal", number_noun="seq",
    manifest_key=snapshot_key, scan=scan, parse=_parse, pin_key=snapshot_pin_key,
    check_series=check_journal, companions=_companions, marker="_journals/", inputs=lambda _doc: [],
    manifest_noun="snapshot", logs=_logs,
)
