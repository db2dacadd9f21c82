"""The store of a tiered repository (docs/format.md §10.2): a local store in front of a remote and a cold store.

Writes go to the local tier; reads of a key the local tier lacks fall back to the remote tier, then to the cold tier;
``list`` is the union; ``delete`` deletes everywhere (a logical delete, e.g. prune); ``evict`` deletes locally only.
``locks/`` and ``tier/`` are local-only keys. The store knows nothing of kinds or manifests: the repository's Tier
(luopan.repository.tier) tells it which keys are manifests through ``markers_of``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..errors import UsageError
from .base import Data, KeyNotFound, Store, Stray

LOCAL_ONLY = ("locks/", "tier/")  # per-store keys: never read from, written to or listed on another tier
# Listed on the local tier only: index files steer the deduplication of saves, and a save must depend on the local
# tier alone (a chunk found only in a remote pack would make the save read the remote). Reads still fall back.
LOCAL_LISTING = ("index/",)
WARN_EVERY = 60.0  # seconds between two warnings that a fallback tier cannot be reached


class Markers(NamedTuple):
    """The local tier records of one manifest (docs/format.md §10.2: ``tier/<state>/…``)."""

    pending: str
    replicated: str
    cold: str


def local_only(key: str) -> bool:
    return key.startswith(LOCAL_ONLY)


class TieredStore(Store):
    """A local store in front of a remote (and optionally a cold) store. See the module docstring.

    The remote and cold tiers are best-effort for ``exists`` and ``list``: when one cannot be reached, they answer
    from the tiers that can (with a warning), so saves and listings keep working on the local tier while the remote
    is down. Reads of a key the local tier lacks raise the remote's error.
    """

    def __init__(self, local: Store, remote: Store | None, cold: Store | None = None) -> None:
        if isinstance(local, TieredStore):
            raise UsageError("the local tier of a TieredStore cannot itself be tiered")
        self.local = local
        self.remote = remote
        self.cold = cold
        self.remote_error: BaseException | None = None  # the last error of a best-effort remote call
        self._warned = 0.0
        # Set by a Tier: the local records of the manifest a key names (None: the key is not a manifest). The local
        # tier then records every manifest of its own that lives only on another tier (tier/replicated/… without a
        # local manifest: evicted; tier/cold/…: moved), so whether a manifest exists is answered locally and a save
        # never waits for the remote; a deleted (pruned) manifest loses its records with it.
        self.markers_of: Callable[[str], Markers | None] | None = None

    @property
    def fallbacks(self) -> list[Store]:
        return [s for s in (self.remote, self.cold) if s is not None]

    def best_effort(self, tier: Store, fn: Callable[[], Any], default: Any) -> Any:
        """``fn()``, or ``default`` when the key is missing or ``tier`` cannot be reached (warned once a minute)."""
        try:
            return fn()
        except KeyNotFound:
            return default
        except OSError as exc:
            self.remote_error = exc
            if time.monotonic() - self._warned > WARN_EVERY:
                self._warned = time.monotonic()
                warnings.warn(f"{tier.describe()} cannot be reached ({exc}); answering from the other tiers",
                              stacklevel=4)
            return default

    def _read(self, key: str, fn: Callable[[Store], Any]) -> Any:
        try:
            return fn(self.local)
        except KeyNotFound:
            if local_only(key):
                raise
        for tier in self.fallbacks:
            try:
                return fn(tier)
            except KeyNotFound:
                continue
        raise KeyNotFound(key)

    def _markers(self, key: str) -> Markers | None:
        return self.markers_of(key) if self.markers_of is not None else None

    def get(self, key: str) -> bytes:
        return self._read(key, lambda s: s.get(key))

    def get_limited(self, key: str, limit: int) -> bytes:
        return self._read(key, lambda s: s.get_limited(key, limit))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._read(key, lambda s: s.get_range(key, offset, length))

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        return self._read(key, lambda s: s.read_into(key, offset, out))

    def size(self, key: str) -> int:
        return self._read(key, lambda s: s.size(key))

    def signature(self, key: str) -> tuple[int, ...] | None:
        return self._read(key, lambda s: s.signature(key))

    def modified(self, key: str) -> float | None:
        return self._read(key, lambda s: s.modified(key))

    def put(self, key: str, data: Data) -> None:
        # No replication hook here: the repository tells its Tier of each commit (tier.committed), overwrites too.
        self.local.put(key, data)

    def put_if_absent(self, key: str, data: Data) -> bool:
        return self.local.put_if_absent(key, data)

    def delete(self, key: str) -> None:
        """A logical delete: the key is removed from every tier (``evict`` removes the local copy only)."""
        self.local.delete(key)
        if not local_only(key):
            for tier in self.fallbacks:
                tier.delete(key)
        markers = self._markers(key)
        if markers is not None:  # a pruned manifest: forget where it was
            for record in (markers.replicated, markers.cold, markers.pending):
                self.local.delete(record)

    def evict(self, key: str) -> None:
        self.local.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        keys = set(self.local.list(prefix))
        if prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            return iter(keys)
        for tier in self.fallbacks:
            keys.update(k for k in self.best_effort(tier, lambda t=tier: list(t.list(prefix)), [])
                        if not local_only(k))
        if not prefix:
            keys = {k for k in keys if not local_only(k) or self.local.exists(k)}
        return iter(keys)

    def list_flat(self, prefix: str) -> list[str]:
        if prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            return self.local.list_flat(prefix)
        return super().list_flat(prefix)

    def strays(self, prefix: str = "") -> list[Stray]:
        out = list(self.local.strays(prefix))
        if not prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            for tier in self.fallbacks:
                out += self.best_effort(tier, lambda t=tier: t.strays(prefix), [])
        return out

    def exists(self, key: str) -> bool:
        if self.local.exists(key):
            return True
        if local_only(key):
            return False
        markers = self._markers(key)
        if markers is not None:
            return self.local.exists(markers.replicated) or self.local.exists(markers.cold)
        return any(self.best_effort(t, lambda t=t: t.exists(key), False) for t in self.fallbacks)

    def cleanup_temporaries(self) -> int:
        return self.local.cleanup_temporaries()

    def free_bytes(self) -> int | None:
        return self.local.free_bytes()  # saves write to the local tier only

    def describe(self) -> str:
        return self.local.describe()


class HotView(TieredStore):
    """The local and remote tiers of a TieredStore, without its cold tier (the source of a cold move)."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store.local, store.remote, None)
