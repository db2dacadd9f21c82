"""The tiering of one open repository (``repo.tier``, docs/format.md §10.2): background replication of every
committed manifest of every kind, replication status, local eviction and cold moves.

* A daemon thread copies each committed manifest to the remote (replication.copy_manifest: packs, index files,
  companions, the manifest last, each verified); transient errors are retried with exponential backoff. Local
  records under ``tier/<state>/<kind marker><series>/<number:08d>.json`` (``pending``, ``replicated``, ``cold``)
  record what is pending and what is confirmed, so a killed process resumes where it stopped.
* Local eviction (``local_retention``) removes local manifests only of those confirmed on the remote; a cold policy
  moves old, unpinned ones to a cold store.

Items are ``(kind, series, number)``: a checkpoint is (CHECKPOINTS, run, step), an artifact version (ARTIFACTS,
name, version). Nothing here imports a kind: the repository's ``kinds`` say where their manifests live.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from ..errors import LuopanError, ReplicationError
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import decode_metrics
from ..format.names import pack_key
from ..retention import Checkpoint, parse_time, plan
from ..store.base import KeyNotFound
from ..store.tiered import Markers, TieredStore
from .coldmoves import ColdPolicy, move_cold
from .kinds import Kind, Opened
from .locks import DEFAULT_TIMEOUT, locked
from .pins import read_pins
from .replication import IndexMap, copy_manifest, copy_pin, ensure_repository, publish_packs
from .tiermarks import Item, Records, manifest_item

BACKOFF_INITIAL = 0.5  # seconds before the first retry of a failed copy; doubles up to BACKOFF_MAX
BACKOFF_MAX = 60.0
CLOSE_TIMEOUT = 30.0  # how long Repo.close() waits for the copy in progress before leaving it pending


class _Stopped(Exception):
    """The replicator was asked to stop (Repo.close): the manifest stays pending."""


class Tier:
    """The tiering of one open repository (``repo.tier``): replication thread, status, eviction, cold moves."""

    def __init__(self, repo: Opened, store: TieredStore, *, replicate_to: str | None,
                 local_retention: Any = None, cold: ColdPolicy | None = None) -> None:
        self.repo = repo
        self.store = store
        self.local = store.local
        self.remote = store.remote
        self.cold_store = store.cold
        self.url = replicate_to
        self.local_retention = local_retention
        self.cold = cold
        self.backoff_initial = BACKOFF_INITIAL
        self.backoff_max = BACKOFF_MAX
        self.lock_timeout: float | None = DEFAULT_TIMEOUT
        self.last_error: BaseException | None = None
        self.failed: dict[Item, str] = {}  # permanent failures of this process
        self.sent_packs = 0  # packs uploaded by this process (skipped ones not counted)
        self.sent_bytes = 0
        self._cv = threading.Condition()
        self._queue: deque[Item] = deque()
        self._queued: set[Item] = set()
        self._current: Item | None = None
        self._again: set[Item] = set()
        self._saving = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._indexes = IndexMap()
        self._published: set[str] = set()  # pack ids this process saw verified on the remote (publish)
        self._remote_ready = False
        self.records = Records(self.local)

    def markers_of(self, key: str) -> Markers | None:
        """The local records of the manifest ``key`` names, or None when it names none (TieredStore.markers_of)."""
        item = manifest_item(self.repo.kinds, key)
        return None if item is None else item.markers()

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the replication thread and queue every local manifest, of every kind, not yet confirmed on the
        remote (those a killed process left pending, and ones written before tiering)."""
        if self.remote is None or (self._thread is not None and self._thread.is_alive()):
            return
        for item in self._unreplicated():
            self._enqueue(item)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="luopan-replicate", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = -1.0) -> None:
        """Stop the thread after the pack in progress, waiting at most ``timeout`` seconds (default
        CLOSE_TIMEOUT); what is left stays pending for the next open."""
        if timeout is not None and timeout < 0:
            timeout = CLOSE_TIMEOUT
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- hooks from the repository ------------------------------------------------------------------------------
    @contextmanager
    def saving(self) -> Iterator[None]:
        """Held while a save writes: the replicator starts no new pack upload meanwhile, so background replication
        does not compete with the training loop for CPU and disk."""
        with self._cv:
            self._saving += 1
        try:
            yield
        finally:
            with self._cv:
                self._saving -= 1
                self._cv.notify_all()

    def committed(self, kind: Kind, series: str, number: int) -> None:
        """A manifest was committed (or replaced, overwrite=True) locally: mark it pending (a small local file) and
        queue it. The one notification of a commit: the store itself fires none."""
        if self.remote is None:
            return
        item = Item(kind, series, number)
        try:
            self.records.pending(item)  # replaced after replication too: replicate it again
        except OSError as exc:  # the manifest is committed: never fail its save for a status record
            warnings.warn(f"could not record {item.label()} as pending replication ({exc}); it is replicated anyway "
                          "(every open queues manifests not confirmed on the remote)", stacklevel=3)
        self._enqueue(item)

    def pinned(self, kind: Kind, series: str, number: int, data: bytes) -> None:
        """A pin was added locally: copy it to the remote now if the manifest is there already (otherwise its
        replication copies it). Unpinning needs nothing here: a delete reaches every tier."""
        if self.remote is None:
            return
        try:
            if self.remote.exists(kind.manifest_key(series, number)):
                self.remote.put(kind.pin_key(series, number), data)
        except OSError as exc:
            warnings.warn(f"{kind.label(series, number)} is pinned here, but the pin could not be copied to the "
                          f"remote ({exc}); pin it again once the remote can be reached", stacklevel=3)

    def _enqueue(self, item: Item) -> None:
        with self._cv:
            if self._current == item:
                self._again.add(item)  # changed while being copied (overwrite=True): copy it once more
            if item not in self._queued:
                self._queued.add(item)
                self._queue.append(item)
                self._cv.notify_all()

    # -- status -------------------------------------------------------------------------------------------------
    def _local_numbers(self, kind: Kind, series: str) -> set[int]:
        return set(kind.scan(self.local, series, False).steps.get(series, []))

    def _unreplicated(self) -> list[Item]:
        return [Item(kind, series, n) for kind in self.repo.kinds
                for series, n in kind.scan(self.local, None, False).pairs()
                if not self.records.confirmed(Item(kind, series, n))]

    def status(self, kind: Kind, series: str) -> dict[int, str]:
        """number -> "local" (only here, replication queued or not started), "replicating" (being copied now),
        "replicated" (confirmed on the remote, still here), "remote" (evicted here, on the remote), "cold"."""
        kind.check_series(series)
        local = self._local_numbers(kind, series)
        done = self.records.numbers("replicated", kind, series)
        pending = self.records.numbers("pending", kind, series)
        with self._cv:
            current = self._current
        out: dict[int, str] = {}
        for n in local:
            item = Item(kind, series, n)
            if n in done and n not in pending and self.records.confirmed(item):
                out[n] = "replicated"
            elif current == item or (n in pending and self.records.pending_elsewhere(item)):
                out[n] = "replicating"
            else:
                out[n] = "local"
        for tier, name in ((self.remote, "remote"), (self.cold_store, "cold")):
            if tier is None:
                continue
            for n in self.store.best_effort(tier, lambda t=tier: kind.scan(t, series, False).steps.get(series, []),
                                            []):
                out.setdefault(n, name)
        return dict(sorted(out.items()))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued manifest is replicated (True) or ``timeout`` passes (False). Raises
        ReplicationError naming manifests that failed for good (e.g. a damaged local manifest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._current is not None:
                if not self.running:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            idle = not self._queue and self._current is None
        if self.failed:
            raise ReplicationError("could not replicate: " + "; ".join(
                f"{item.label()}: {why}" for item, why in sorted(self.failed.items(), key=lambda kv: kv[0][1:])))
        return idle

    def publish(self, packs: list[str], index_keys: list[str]) -> int:
        """Put ``packs`` and then ``index_keys`` on the remote now, each verified (those already there are left):
        the part of a collective save whose ranks have local tiers of their own (docs/format.md §10.5), so the
        manifest that rank 0 commits names packs the remote holds. Returns the number of packs sent."""
        assert self.remote is not None
        if not self._remote_ready:
            ensure_repository(self.local, self.remote)
            self._remote_ready = True
        sent = publish_packs(self.local, self.remote, packs, index_keys, self._published)
        self.sent_packs += sent
        return sent

    def vouch(self, packs: list[str]) -> None:
        """``packs`` were verified on the remote by the ranks that put them there (``publish`` in another process):
        replicating a manifest that names them only checks that they still exist."""
        self._published.update(packs)

    def wait_for(self, kind: Kind, series: str, number: int, timeout: float | None) -> bool:
        """Block until the replicator is done with this one manifest (True when it is confirmed on the remote), or
        ``timeout`` seconds pass (False)."""
        item = Item(kind, series, number)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while item in self._queued and self.running and item not in self.failed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(min(left, 1.0) if left is not None else 1.0)
        return self.records.confirmed(item)

    # -- the thread ---------------------------------------------------------------------------------------------
    def _gate(self) -> None:
        with self._cv:
            while self._saving and not self._stop:
                self._cv.wait(0.5)
            if self._stop:
                raise _Stopped()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                item = self._queue[0]
                self._current = item
            try:
                done = self._replicate_with_retries(item)
            except _Stopped:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()
                return
            if done:  # before the item counts as done, so wait_replicated() returns after eviction too
                try:
                    self.evict(item.kind, item.series)
                except Exception as exc:  # noqa: BLE001 - eviction is housekeeping: report, keep replicating
                    warnings.warn(f"local eviction of {item.kind.series_noun} {item.series!r} failed: {exc}",
                                  stacklevel=1)
            with self._cv:
                self._queue.popleft()
                if item in self._again:
                    self._again.discard(item)
                    self._queue.append(item)
                else:
                    self._queued.discard(item)
                self._current = None
                self._cv.notify_all()

    def _replicate_with_retries(self, item: Item) -> bool:
        pause = self.backoff_initial
        while True:
            self._gate()
            try:
                return self.replicate(*item)
            except _Stopped:
                raise
            except (OSError, ReplicationError) as exc:  # network, server, a pack that did not land or verify:
                self.last_error = exc  # transient, the copy is sent again
            except Exception as exc:  # noqa: BLE001 - a damaged local manifest, a foreign remote, a bug: retrying
                self.last_error = exc  # will not help; reported by wait_replicated(), never lost with the thread
                self.failed[item] = str(exc)
                warnings.warn(f"{item.label()} will not be replicated: {exc}", stacklevel=1)
                return False
            with self._cv:
                self._cv.wait(pause * (0.75 + 0.5 * random.random()))
                if self._stop:
                    raise _Stopped()
            pause = min(pause * 2, self.backoff_max)

    def replicate(self, kind: Kind, series: str, number: int) -> bool:
        """Copy one manifest to the remote now (the thread's work; callable directly). True when confirmed."""
        assert self.remote is not None
        item = Item(kind, series, number)
        if not self._remote_ready:
            ensure_repository(self.local, self.remote)
            self._remote_ready = True
        self.records.started(item)

        def on_pack(pack_id: str, sent: bool) -> None:
            if sent:
                self.sent_packs += 1
                try:
                    self.sent_bytes += self.local.size(pack_key(pack_id))
                except KeyNotFound:
                    pass

        def commit(put_manifest: Callable[[], None]) -> None:
            # The local shared lock orders this against a prune of the same manifest (which deletes it on both
            # tiers under the exclusive lock): a pruned manifest is never brought back on the remote.
            with locked(self.local, "shared", f"replication of {item.label()}", timeout=self.lock_timeout):
                if self.local.exists(item.key):
                    put_manifest()

        with locked(self.remote, "shared", f"replication of {item.label()}", timeout=self.lock_timeout):
            data = copy_manifest(self.store, self.remote, kind, series, number, indexes=self._indexes,
                                 gate=self._gate, on_pack=on_pack, commit=commit, vouched=self._published)
        try:
            now_local = self.local.get_limited(item.key, MAX_MANIFEST_BYTES) if data is not None else None
        except KeyNotFound:
            now_local = None
        if now_local is None:
            self.records.forget(item, "pending")  # pruned meanwhile: nothing to replicate
            return False
        if now_local != data:  # saved again (overwrite=True) while we copied: copy the new one
            raise ReplicationError(f"{item.label()} changed during replication; copying it again")
        copy_pin(self.local, self.remote, kind, series, number)  # a pin added after the copy looked for it
        # The record names the manifest it confirms: if an overwrite lands after this point, eviction and the next
        # open see that the local manifest is no longer the one confirmed (Records.confirmed).
        self.records.replicated(item, data, self.remote.describe())
        return True

    # -- eviction and cold moves ----------------------------------------------------------------------------------
    def _retention_input(self, item: Item, pins: dict[int, dict[str, Any]]) -> Checkpoint | None:
        """The manifest as retention rules see it (any kind: ``created``, maybe ``metrics``); None if unreadable."""
        try:
            doc = item.kind.parse(self.local.get_limited(item.key, MAX_MANIFEST_BYTES), item.key, *item[1:], self.store)
            tag = pins.get(item.number, {}).get("tag")
            return Checkpoint(step=item.number, created=parse_time(doc["created"]),
                              metrics=decode_metrics(doc.get("metrics") or {}), pinned=item.number in pins,
                              tags=(tag,) if tag else ())
        except (KeyNotFound, LuopanError, KeyError, TypeError, AttributeError):
            return None  # kept: never evict what cannot be read

    def evict(self, kind: Kind, series: str, rules: Any = None) -> list[int]:
        """Apply ``rules`` (default: the repository's ``local_retention``) to the local manifests of ``series`` and
        remove the local manifests of those the rules drop — only ones confirmed on the remote. Their packs become
        local garbage for gc; reads fall back to the remote. Returns the evicted numbers."""
        rules = rules if rules is not None else self.local_retention
        if rules is None or self.remote is None:
            return []
        pins = read_pins(self.store, kind, series)
        found = [self._retention_input(Item(kind, series, n), pins) for n in sorted(self._local_numbers(kind, series))]
        items = [c for c in found if c is not None]
        if not items:
            return []
        decided = plan(items, rules)
        if not any(self.records.confirmed(Item(kind, series, n)) for n in decided.remove):
            return []
        # Under the exclusive local lock, like a prune: an overwrite=True save of a number cannot land between the
        # check that the remote holds this very manifest and the local delete.
        with locked(self.local, "exclusive", f"eviction of {kind.series_noun} {series!r}",
                    timeout=self.lock_timeout):
            return self._evict_locked([Item(kind, series, n) for n in decided.remove])

    def _evict_locked(self, items: list[Item]) -> list[int]:
        assert self.remote is not None
        evicted = []
        for item in items:
            if not self.records.confirmed(item):
                continue  # never evict what the remote has not confirmed (or an older version of it)
            if not self.remote.exists(item.key):
                self.records.forget(item, "replicated")  # the remote lost it: replicate it again
                self._enqueue(item)
                continue
            self.store.evict(item.key)
            evicted.append(item.number)
        return evicted

    def apply_cold_policy(self, now: datetime | None = None, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """``move_cold``, as (series, number) pairs (Repo.apply_cold_policy's answer)."""
        return [(item.series, item.number) for item in self.move_cold(now, dry_run=dry_run)]

    def move_cold(self, now: datetime | None = None, *, dry_run: bool = False) -> list[Item]:
        """Move old, unpinned, replicated manifests of every kind to the cold store (coldmoves.move_cold)."""
        return move_cold(self, now, dry_run=dry_run)
