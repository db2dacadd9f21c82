"""Cold moves (docs/format.md §10.2, ``repo.apply_cold_policy()``, ``luopan cold``), for manifests of every kind.

Every manifest that is not pinned, not waiting for replication and whose ``created`` is older than the cold policy's
threshold is copied to the cold repository by the replication steps (replication.copy_manifest, under a shared lock
there), then its manifest is deleted from the local and remote tiers (under the local shared lock) with its
``tier/`` records; a ``cold`` record says where it went. It stays listed and readable through the cold tier.
The policy is a ``ColdPolicy`` (``luopan.ColdPolicy``); the moves need of the tiering only what ``ColdTiers`` lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from ..errors import ConfigConflictError, UsageError
from ..format.limits import MAX_MANIFEST_BYTES
from ..retention import parse_time
from ..store.base import Store
from ..store.tiered import HotView, TieredStore
from ..units import parse_duration
from .kinds import Kind, Opened
from .locks import locked
from .pins import read_pins
from .replication import IndexMap, copy_manifest, ensure_repository
from .tiermarks import Item, Records

WAITING = ("local", "replicating", "cold")  # statuses that keep a manifest where it is


@dataclass(frozen=True)
class ColdPolicy:
    """Move manifests that are not pinned and older than ``older_than`` (``"7d"``, ``"36h"``, seconds) to ``url``.

    Applied by ``repo.apply_cold_policy()`` (or ``luopan cold``): each is copied and verified like a replication,
    then removed from the hot tiers (local and remote manifests); reads fall back to the cold store.
    """

    url: str
    older_than: str | float = "7d"
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        if isinstance(self.older_than, (int, float)) and not isinstance(self.older_than, bool):
            if not self.older_than > 0:
                raise UsageError(f"ColdPolicy.older_than must be > 0, got {self.older_than!r}")
            return float(self.older_than)
        return parse_duration(self.older_than)


class ColdTiers(Protocol):
    """What cold moves need of the repository's tiering (tier.Tier): its tiers, records and replication status."""

    repo: Opened
    store: TieredStore  # the tiers as one store (reads fall back local -> remote -> cold)
    local: Store
    remote: Store | None
    cold_store: Store | None
    cold: ColdPolicy | None
    lock_timeout: float | None
    records: Records

    def status(self, kind: Kind, series: str) -> dict[int, str]:
        """number -> replication status ("local", "replicating", "replicated", "remote", "cold")."""


def move_cold(tier: ColdTiers, now: datetime | None = None, *, dry_run: bool = False) -> list[Item]:
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


def _move(tier: ColdTiers, item: Item, now: datetime, dry_run: bool) -> bool:
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
