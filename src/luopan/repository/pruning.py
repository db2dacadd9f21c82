"""Retention applied to the manifests of one series of any kind (docs/format.md §9.1): the newest and pinned ones
always stay; the others the rules do not keep are removed by deleting their manifests (their chunks stay until gc)."""

from __future__ import annotations

from ..errors import ManifestNotFoundError, UsageError
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import decode_metrics
from ..retention import Checkpoint, Plan, Rules, check_metrics, parse_time, plan
from .kinds import Kind, Opened
from .locks import locked
from .pins import read_pins

MISSING_METRICS = ("error", "ignore")


def prune_series(repo: Opened, kind: Kind, series: str, retention: Rules | None, *, dry_run: bool = False,
                 missing_metrics: str = "error", missing: Exception | None = None) -> Plan:
    """Apply ``retention`` to ``series``; ``missing`` is raised when it has no manifest. ``dry_run`` computes the same
    plan and removes nothing (it takes no lock). ``missing_metrics="error"``: a KeepBest metric no manifest records is
    an error naming the ones they do record, before anything is removed; ``"ignore"`` lets that rule keep nothing."""
    if retention is None:
        raise UsageError("prune needs retention rules, e.g. luopan.retention.KeepLast(3)")
    if missing_metrics not in MISSING_METRICS:
        raise UsageError(f"missing_metrics must be 'error' or 'ignore', got {missing_metrics!r}")
    repo.drain()
    kind.check_series(series)
    if dry_run:
        return _prune(repo, kind, series, retention, True, missing_metrics, missing)
    with locked(repo.store, "exclusive", f"prune of {kind.series_noun} {series}", timeout=repo.lock_timeout,
                where=repo.store.describe()):
        return _prune(repo, kind, series, retention, False, missing_metrics, missing)


def _prune(repo: Opened, kind: Kind, series: str, retention: Rules | None, dry_run: bool, missing_metrics: str,
           missing: Exception | None) -> Plan:
    store = repo.store
    pins = read_pins(store, kind, series)
    live = kind.protected(store, series)
    numbers = kind.scan(store, series, False).steps.get(series, [])
    if not numbers:
        raise missing or ManifestNotFoundError(f"{kind.series_noun} {series!r} has no committed {kind.name}")
    items = []
    for n in numbers:  # its time and metrics: a grouped manifest's groups are not read (Kind.shallow)
        if kind.shallow is not None:
            key = kind.manifest_key(series, n)
            doc = kind.shallow(store.get_limited(key, MAX_MANIFEST_BYTES), key, series, n)
        else:
            doc = repo.read_manifest(kind, series, n)
        tag = pins.get(n, {}).get("tag")
        items.append(Checkpoint(n, parse_time(doc["created"]), decode_metrics(doc.get("metrics", {})),
                                n in pins or n in live, (tag,) if tag else ()))
    if missing_metrics == "error":
        check_metrics(items, retention, f"{kind.series_noun} {series!r}")
    decided = plan(items, retention)
    if not dry_run:
        for n in decided.remove:  # oldest first; the newest is never among them
            store.delete(kind.manifest_key(series, n))
    return decided
