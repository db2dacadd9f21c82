"""Garbage collection: delete packs no checkpoint needs, repack mostly-dead ones (docs/format.md §10.3).

``collect(repo)`` runs under the repository's exclusive lock (saves wait; they never see a half-done gc) in phases,
each of which leaves the repository valid if the process dies right after it:

1. **mark** — read every manifest; a pack is *live* if some manifest row (base chunks and row-delta index/values,
   ``stored_rows``) names it. A damaged manifest stops gc: it cannot tell what that checkpoint needs.
2. **repack** — a live pack whose live blobs fill less than ``repack_below`` of it (default 0.5) has its live blobs
   read, verified and written to new packs; then every manifest naming it is rewritten (atomic replace, same chunks,
   new locations). Until a manifest is rewritten it still points at the old pack, which still exists.
3. **index** — one new index file listing every pack that stays (old index rows, plus trailers of live packs no index
   names) is written, then the old index files are deleted: no index file ever names a pack that is about to go.
4. **condemn** — packs no manifest needs (including the ones just repacked) are recorded in ``gc/condemned.json``
   with the time they were first found unreferenced. Packs younger than the grace period are left alone: a save in
   progress (one whose lock was broken) may be about to commit a manifest naming them.
5. **sweep** — packs condemned at least ``grace`` seconds ago *and still unreferenced now* are deleted, then the
   record is rewritten without them. So data is deleted only after two gc runs a grace period apart agreed it is
   garbage (``grace=0`` does both in one run: for when nothing else reads the repository).

A crash between phases leaves at worst unreferenced packs or a stale condemn record, which the next run handles;
never a manifest naming a missing pack. Crash points (``LUOPAN_CRASH_AT``): ``gc.marked``, ``gc.repack.packs``,
``gc.repack.manifest`` (after the first manifest rewrite), ``gc.index.written``, ``gc.index.replaced``,
``gc.condemned``, ``gc.sweep.pack`` (after the first pack deletion), ``gc.done``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._crash import crashpoint
from ..errors import CorruptRepoError, IntegrityError, StorageError, UsageError
from ..format import BASE_FORMAT_VERSION, ENGINE2_FORMAT_VERSION
from ..format.canonical import SealError, seal, unseal
from ..format.manifest import seal_manifest
from ..format.index import build_index, parse_index
from ..format.limits import MAX_CONDEMNED_BYTES, MAX_INDEX_BYTES
from ..format.names import (
    CONDEMNED_KEY,
    index_key,
    is_hex64,
    is_index_key,
    pack_key,
)
from ..format.pack import HEADER_SIZE
from ..store.base import KeyNotFound, Store
from .gcreport import GcReport
from .kinds import Opened
from .marking import Marked, Marks, Rows, full_doc, live_rows, mark
from .links import stale_links
from .locks import locked
from .repack import relocated, repack, trailer_blobs

DEFAULT_GRACE = 3600.0
DEFAULT_REPACK_BELOW = 0.5


def parse_condemned(data: bytes, where: str = CONDEMNED_KEY) -> dict[str, float]:
    """pack id -> unix time it was first found unreferenced; CorruptRepoError on damage."""
    try:
        doc = unseal(data)
        packs = doc["packs"]
        out = {p: float(t) for p, t in packs.items()}
        if not all(is_hex64(p) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                   and 0 <= t for p, t in packs.items()):
            raise ValueError("a pack id or time is invalid")
        return out
    except (SealError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise CorruptRepoError(f"{where} is damaged: {str(exc)[:200]}") from None


def _read_condemned(store: Store) -> dict[str, float]:
    try:
        return parse_condemned(store.get_limited(CONDEMNED_KEY, MAX_CONDEMNED_BYTES))
    except KeyNotFound:
        return {}
    except IntegrityError:
        return {}  # damaged: start the grace period afresh (it only ever delays deletion)


def _write_condemned(store: Store, packs: dict[str, float]) -> None:
    if not packs:
        store.delete(CONDEMNED_KEY)
        return
    store.put(CONDEMNED_KEY, seal({"format_version": BASE_FORMAT_VERSION, "packs": dict(sorted(packs.items()))}))


def collect(
    repo: Opened,
    *,
    grace: float = DEFAULT_GRACE,
    repack_below: float = DEFAULT_REPACK_BELOW,
    dry_run: bool = False,
    now: float | None = None,
    log: Callable[[str], Any] | None = None,
) -> GcReport:
    """Run garbage collection on ``repo`` (see the module docstring); returns a GcReport.

    ``grace`` (seconds) is how long a pack stays condemned before it is deleted, and how old an unreferenced pack
    must be to be condemned at all. ``repack_below`` (0 disables repacking) is the live fraction under which a pack
    is rewritten. ``dry_run`` computes the same plan and changes nothing (it does not take the lock either).
    """
    if grace < 0:
        raise UsageError(f"grace must be >= 0 seconds, got {grace}")
    if not 0 <= repack_below <= 1:
        raise UsageError(f"repack_below must be a fraction from 0 to 1, got {repack_below}")
    repo.drain()
    # A tiered repository collects its local tier only: marking from local manifests frees what eviction left
    # behind, and nothing on the remote (a repository of its own: `luopan gc -r <remote URL>`) is touched. A manifest
    # the repack rewrites locally needs no new copy: the remote's copy names the remote's own packs; one still pending
    # replication is read afresh when its turn comes.
    store = repo.tier.local if repo.tier is not None else repo.store
    if dry_run:
        return _collect(store, repo, grace, repack_below, True, now, log)
    with locked(store, "exclusive", "gc", timeout=repo.lock_timeout, where=store.describe()):
        return _collect(store, repo, grace, repack_below, False, now, log)


class _Clock:
    """Adds the seconds each phase took to ``report.seconds``."""

    def __init__(self, report: GcReport) -> None:
        self.report = report
        self.last = time.perf_counter()

    def phase(self, name: str) -> None:
        t = time.perf_counter()
        self.report.seconds[name] = self.report.seconds.get(name, 0.0) + t - self.last
        self.last = t


def _collect(store: Store, repo: Opened, grace: float, repack_below: float, dry_run: bool, now: float | None,
             log: Callable[[str], Any] | None) -> GcReport:
    say = log or (lambda _msg: None)
    report = GcReport(dry_run=dry_run, grace=grace)
    clock = _Clock(report)
    if not dry_run:
        store.cleanup_temporaries()
    # -- 1. mark --------------------------------------------------------------------------------------------------
    say("mark: reading manifests")
    marks = mark(store, repo.kinds, report)
    for problem in report.unloadable_manifests:
        warnings.warn(f"gc keeps everything this manifest references: {problem}", stacklevel=3)  # at collect()
    clock.phase("mark")
    crashpoint("gc.marked")
    # -- 2. repack ------------------------------------------------------------------------------------------------
    sparse, new_packs = _repack_sparse(store, repo, marks, repack_below, dry_run, report, say, clock)
    # -- 4 (planned now). which packs are garbage -----------------------------------------------------------------
    previous, condemned, due = _plan_garbage(store, marks, sparse, grace, now, report)
    clock.phase("plan")
    # -- 3. index -------------------------------------------------------------------------------------------------
    _replace_index(store, repo, marks, previous, condemned, new_packs, dry_run, report, say)
    clock.phase("index")
    # -- 4. condemn -----------------------------------------------------------------------------------------------
    if not dry_run and condemned != previous:
        _write_condemned(store, condemned)
    crashpoint("gc.condemned")
    # -- 5. sweep -------------------------------------------------------------------------------------------------
    _sweep(store, marks, condemned, due, grace, dry_run, report, say)
    clock.phase("sweep")
    # -- 6. lineage links of removed manifests (§9.4): under the exclusive lock, so no link is being added --------
    for key in stale_links(repo):
        if not dry_run:
            store.delete(key)
        report.dropped_links += 1
    crashpoint("gc.done")
    return report


def _repack_sparse(store: Store, repo: Opened, marks: Marks, repack_below: float, dry_run: bool, report: GcReport,
                   say: Callable[[str], Any], clock: _Clock) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """Phase 2: copy the live blobs of packs under ``repack_below`` live to new packs and rewrite the manifests naming
    them (a dry run only counts). Returns the sparse packs and the new packs' index rows."""
    live, sizes = marks.live, marks.sizes
    sparse = sorted(p for p in marks.packs if p in live and p not in marks.kept and repack_below > 0
                    and sum(v[1] for v in live[p].values()) < repack_below * (sizes[p] - HEADER_SIZE))
    new_packs: dict[str, list[dict[str, Any]]] = {}
    if sparse:
        say(f"repack: {len(sparse)} pack(s) under {repack_below:.0%} live")
    if sparse and not dry_run:
        moved, new_packs = repack(store, repo.config.pack_size, sparse, live, report)
        clock.phase("repack.copy")
        crashpoint("gc.repack.packs")
        report.manifests_rewritten = _rewrite_manifests(store, repo, marks, sparse, moved)
        marks.live = live_rows(store, marks)
        marks.packs.update({p: pack_key(p) for p in new_packs})
        for p in new_packs:
            sizes[p] = store.size(pack_key(p))
        clock.phase("repack.manifests")
    elif sparse:
        report.repacked_packs = len(sparse)
        report.repacked_bytes = sum(sizes[p] for p in sparse)
        report.copied_bytes = sum(v[1] for p in sparse for v in live[p].values())
        marks.live = {p: rows for p, rows in live.items() if p not in sparse}  # as they will be after the rewrite
    return sparse, new_packs


def _rewrite_manifests(store: Store, repo: Opened, marks: Marks, sparse: list[str],
                       moved: dict[tuple[str, str], tuple[str, int, int, int, str]]) -> int:
    """Rewrite each manifest naming a repacked pack with its blobs' new locations (``moved``: (old pack, hash) -> new
    location); returns how many were rewritten."""
    rewritten = 0
    touched = sorted({i for p in sparse for i in marks.users.get(p, [])})
    for i in touched:
        m = marks.manifests[i]
        doc = relocated(full_doc(store, m), moved)
        if doc is None:
            continue
        # checkpoint manifests of format_version 5 repositories are stored compressed (docs/format.md §4)
        data = seal_manifest(doc, compress=m.kind.name == "checkpoint"
                             and repo.config.format_version >= ENGINE2_FORMAT_VERSION)
        store.put(m.key, data)
        marks.manifests[i] = Marked(m.kind, m.series, m.number, m.key, doc)
        if m.kind.rewritten is not None:
            m.kind.rewritten(store, m.series, m.number, data)
        rewritten += 1
        if rewritten == 1:
            crashpoint("gc.repack.manifest")
    return rewritten


def _plan_garbage(store: Store, marks: Marks, sparse: list[str], grace: float, now: float | None,
                  report: GcReport) -> tuple[dict[str, float], dict[str, float], set[str]]:
    """Which packs no manifest needs: (the condemn record as found, the one to write, the packs due for deletion).
    An unreferenced pack younger than ``grace`` (not one just repacked) is not even condemned yet."""
    t_now = time.time() if now is None else now
    previous = _read_condemned(store)
    condemned: dict[str, float] = {}
    for p in marks.packs:
        if p in marks.live or p in marks.kept:
            continue
        if p in previous:
            condemned[p] = previous[p]
            continue
        try:
            stamp = store.modified(marks.packs[p])
        except KeyNotFound:
            continue
        if stamp is not None and t_now - stamp < grace and p not in sparse:
            report.young_packs += 1  # maybe a save in progress: not even condemned yet
            continue
        condemned[p] = t_now
    due = {p for p, t in condemned.items() if t_now - t >= grace}
    return previous, condemned, due


def _replace_index(store: Store, repo: Opened, marks: Marks, previous: dict[str, float],
                   condemned: dict[str, float], new_packs: dict[str, list[dict[str, Any]]], dry_run: bool,
                   report: GcReport, say: Callable[[str], Any]) -> None:
    """Phase 3: one new index file for every pack that stays (old rows, new packs' rows, trailers of live packs no
    index names), then the old index files deleted; nothing written when the index files are already that."""
    index_keys = [k for k in store.list("index/") if is_index_key(k)]
    report.index_files_before = len(index_keys)
    keep = {p for p in marks.packs if p not in condemned}
    rows = _index_rows(store, index_keys, keep, marks.live, new_packs)
    changed = bool(condemned.keys() - previous.keys()) or bool(new_packs) or len(index_keys) != 1 or any(
        p not in keep for key in index_keys for p in _index_packs(store, key))
    if not dry_run and changed and (rows or index_keys):
        say("index: writing one index file for the packs that stay")
        new_key = None
        if rows:
            index_id, index_bytes = build_index({p: rows[p] for p in sorted(rows)},
                                                compress=repo.config.format_version >= ENGINE2_FORMAT_VERSION)
            new_key = index_key(index_id)
            store.put_if_absent(new_key, index_bytes)
        crashpoint("gc.index.written")
        for key in index_keys:
            if key != new_key:
                store.delete(key)
        crashpoint("gc.index.replaced")
        report.index_files_after = 1 if new_key else 0
    else:
        report.index_files_after = len(index_keys)


def _index_rows(store: Store, index_keys: list[str], keep: set[str], live: Rows,
                new_packs: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """pack -> index rows, of the packs in ``keep``: from the index files, the new packs, and the trailers of live
    packs no readable index file names."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key in index_keys:
        try:
            for h, loc in parse_index(store.get_limited(key, MAX_INDEX_BYTES), key).items():
                if loc.pack in keep:
                    rows.setdefault(loc.pack, []).append(
                        {"hash": h, "offset": loc.offset, "length": loc.length, "size": loc.size, "codec": loc.codec})
        except (IntegrityError, KeyNotFound, StorageError):
            continue  # damaged, vanished or unreadable: rebuilt from trailers below where it matters
    for p, blobs in new_packs.items():
        rows[p] = [dict(b) for b in blobs]
    for p in sorted(keep):
        if p not in rows and p in live:  # a live pack no index names (index lost, or condemned then revived)
            blobs = trailer_blobs(store, p)
            if blobs:
                rows[p] = blobs
    return rows


def _sweep(store: Store, marks: Marks, condemned: dict[str, float], due: set[str], grace: float, dry_run: bool,
           report: GcReport, say: Callable[[str], Any]) -> None:
    """Phase 5: delete the packs condemned at least ``grace`` ago, then record the rest as still condemned."""
    if due:
        say(f"sweep: deleting {len(due)} pack(s)")
    for n, p in enumerate(sorted(due)):
        if not dry_run:
            store.delete(marks.packs[p])
            if n == 0:
                crashpoint("gc.sweep.pack")
        report.deleted_packs += 1
        report.deleted_bytes += marks.sizes.get(p, 0)
    remaining = {p: t for p, t in condemned.items() if p not in due}
    if not dry_run and due:
        _write_condemned(store, remaining)
    report.condemned_packs = len(remaining)
    report.condemned_bytes = sum(marks.sizes.get(p, 0) for p in remaining)
    report.next_sweep_after = min(remaining.values()) + grace if remaining else None


def _index_packs(store: Store, key: str) -> list[str]:
    try:
        return sorted({loc.pack for loc in parse_index(store.get_limited(key, MAX_INDEX_BYTES), key).values()})
    except (IntegrityError, KeyNotFound, StorageError):
        return []
