"""Cold moves (docs/format.md §10.2, ``repo.apply_cold_policy()``, ``luopan cold``), for manifests of every kind.

Every manifest that is not pinned, not waiting for replication and whose ``created`` is older than the cold policy's
threshold is copied to the cold repository by the replication steps (replication.copy_manifest, under a shared lock
there), then its manifest is deleted from the local and remote tiers (under the local shared lock) with its
``tier/`` records; a ``cold`` record says where it went. It stays listed and readable through the cold tier.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

from ..errors import ConfigConflictError
from ..format.limits import MAX_MANIFEST_BYTES
from ..retention import parse_time
from ..store.base import Store
from ..store.tiered import HotView
from .locks import locked
from .pins import read_pins
from .replication import IndexMap, copy_manifest, ensure_repository
from .tiermarks import Item

if TYPE_CHECKING:  # pragma: no cover
    from .tier import Tier

WAITING = ("local", "replicating", "cold")  # statuses that keep a manifest where it is


def move_cold(tier: Tier, now: datetime | None = None, *, dry_run: bool = False) -> list[Item]:
    """Move what the policy selects (see the module docstring); returns the items moved (or that would be, with
    ``dry_run``). ConfigConflictError when the repository has no cold policy."""
    if tier.cold is None or tier.cold_store is None:
        raise ConfigConflictError("this repository has no cold policy: open it with cold=ColdPolicy(url, ...)")
    now = now or datetime.now(timezone.utc)
    moved = []
    for kind in tier.repo.kinds:
        for series, numbers in kind.scan(tier.store, None, False).steps.items():
            pins = read_pins(tier.store, kind, series)
            status = tier.status(kind, series) if tier.remote is not None else {}
            for n in numbers:
                if n in pins or status.get(n) in WAITING:
                    continue
                if _move(tier, Item(kind, series, n), now, dry_run):
                    moved.append(Item(kind, series, n))
    return moved


def _move(tier: Tier, item: Item, now: datetime, dry_run: bool) -> bool:
    assert tier.cold is not None and tier.cold_store is not None
    hot: list[Store] = [t for t in (tier.local, tier.remote) if t is not None and t.exists(item.key)]
    if not hot:
        return False
    doc = item.kind.parse(tier.store.get_limited(item.key, MAX_MANIFEST_BYTES), item.key, item.series, item.number,
                          tier.store)
    if (now - parse_time(doc["created"])).total_seconds() < tier.cold.seconds:
        return False
    if dry_run:
        return True
    cold = tier.cold_store
    ensure_repository(tier.local, cold)
    with locked(cold, "shared", f"cold move of {item.label()}", timeout=tier.lock_timeout):
        data = copy_manifest(HotView(tier.store), cold, item.kind, item.series, item.number, indexes=IndexMap())
    if data is None:
        return False  # pruned meanwhile
    with locked(tier.local, "shared", f"cold move of {item.label()}", timeout=tier.lock_timeout):
        tier.records.moved_cold(item, cold.describe())
        for t in hot:
            t.delete(item.key)
        tier.records.forget(item, "replicated", "pending")
    return True
