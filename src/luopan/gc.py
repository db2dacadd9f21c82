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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3
import zstandard

from ._crash import crashpoint
from . import catalog
from .errors import (
    CheckpointNotFoundError,
    CorruptPackError,
    CorruptRepoError,
    GcError,
    IntegrityError,
    StorageError,
    UnsupportedFormatError,
    UsageError,
)
from .format import BASE_FORMAT_VERSION
from .format.canonical import SealError, canonical, seal, sealed_checksum, unseal
from .format.index import build_index, parse_index
from .format.limits import MAX_CONDEMNED_BYTES, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, MAX_SMALL_BYTES
from .format.manifest import Manifest, Row, parse_manifest, rows_of, seal_manifest, stored_rows
from .format.names import index_key, is_hex64, is_index_key, is_pack_key, latest_ref_key, manifest_key, pack_key
from .format.refs import build_ref, parse_ref
from .format.pack import HEADER_SIZE, PackBuilder
from .locks import locked
from .store.base import KeyNotFound, Store

if TYPE_CHECKING:
    from .checkpoint.repo import Repo

CONDEMNED_KEY = "gc/condemned.json"
DEFAULT_GRACE = 3600.0
DEFAULT_REPACK_BELOW = 0.5
_PACK, _OFFSET, _CODEC = (Row._fields.index(f) for f in ("pack", "offset", "codec"))  # Row positions (relocation)


@dataclass
class GcReport:
    """What a gc run found and did. Bytes are pack-file bytes."""

    dry_run: bool
    grace: float
    manifests: int = 0
    stray_manifests: int = 0  # readable manifests under stray run directories: what they name is kept
    packs: int = 0
    pack_bytes: int = 0
    live_packs: int = 0
    live_bytes: int = 0  # bytes of live blobs (what the checkpoints need)
    repacked_packs: int = 0
    repacked_bytes: int = 0  # bytes of the packs repacked (they are condemned afterwards)
    copied_bytes: int = 0  # live blob bytes copied into new packs
    new_packs: int = 0
    manifests_rewritten: int = 0
    index_files_before: int = 0
    index_files_after: int = 0
    condemned_packs: int = 0  # waiting for their grace period after this run
    condemned_bytes: int = 0
    next_sweep_after: float | None = None  # unix time when the oldest waiting pack becomes deletable
    young_packs: int = 0  # unreferenced but younger than the grace period (maybe a save in progress)
    deleted_packs: int = 0
    deleted_bytes: int = 0
    skipped_repacks: list[str] = field(default_factory=list)  # packs not repacked (a damaged live blob), why
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall time

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _rows_by_pack(m: Manifest) -> dict[str, dict[str, tuple[int, int, int, str]]]:
    packs = m.doc["packs"]
    out: dict[str, dict[str, tuple[int, int, int, str]]] = {}
    for e in m.entries:
        for r in rows_of(e):
            out.setdefault(packs[r.pack], {})[r.hash] = (r.offset, r.length, r.size, r.codec)
    return out


def _all_manifests(repo: Repo) -> list[tuple[str, Manifest]]:
    return _mark_sources(repo)[0]


def _mark_sources(repo: Repo) -> tuple[list[tuple[str, Manifest]], list[Manifest]]:
    """Every committed manifest, parsed, from the catalog's walk; and the readable manifests found under stray run
    directories (``runs/a copy/``: not checkpoints, but someone may rename them back, so what they reference is kept
    and never repacked). GcError, before anything changes, when the walk could not see the whole repository (a
    dangling link or unreadable directory under runs/ may hold checkpoints) or a manifest cannot be read: gc would
    otherwise delete data those checkpoints need."""
    cat = catalog.scan(repo.store, strays=True)
    if cat.incomplete:
        shown = "; ".join(str(s) for s in cat.incomplete[:5])
        raise GcError(f"gc stopped before deleting anything: part of runs/ cannot be read ({shown}), so gc cannot "
                      "tell which data the checkpoints there need; mount or restore it (or remove the link), then "
                      "run gc again")
    out = []
    for run, step in cat.pairs():
        try:
            out.append((manifest_key(run, step), repo.manifest(run, step)))
        except (IntegrityError, StorageError) as exc:
            raise GcError(f"gc stopped before deleting anything: {exc}\ngc cannot tell which data a damaged or "
                          "unreadable checkpoint needs; restore that manifest (or its permissions), or remove the "
                          f"checkpoint (`luopan prune`, or delete {manifest_key(run, step)}), then run gc again"
                          ) from None
        except CheckpointNotFoundError:
            continue  # pruned since the listing
    shadows = []
    for key in cat.shadows:
        try:
            shadows.append(parse_manifest(repo.store.get_limited(key, MAX_MANIFEST_BYTES), key))
        except (IntegrityError, StorageError, UnsupportedFormatError, KeyNotFound):
            continue  # not a readable manifest: it references nothing
    return out, shadows


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


def _list_packs(store: Store) -> dict[str, str]:
    return {key.rsplit("/", 1)[-1][:-5]: key for key in store.list("packs/") if is_pack_key(key)}


def _verify_blob(data: bytes, h: str, size: int, codec: str) -> None:
    raw = data
    if codec != "none":
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    if len(raw) != size or blake3.blake3(raw).hexdigest() != h:
        raise CorruptPackError(f"chunk {h[:16]}… does not match its hash")


def collect(
    repo: Repo,
    *,
    grace: float = DEFAULT_GRACE,
    repack_below: float = DEFAULT_REPACK_BELOW,
    dry_run: bool = False,
    now: float | None = None,
    progress: Callable[[str], Any] | None = None,
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
    repo._drain()
    if dry_run:
        return _collect(repo, grace, repack_below, True, now, progress)
    with locked(repo.store, "exclusive", "gc", timeout=repo.lock_timeout, where=repo.store.describe()):
        return _collect(repo, grace, repack_below, False, now, progress)


def _collect(repo: Repo, grace: float, repack_below: float, dry_run: bool, now: float | None,
             progress: Callable[[str], Any] | None) -> GcReport:
    store = repo.store
    say = progress or (lambda _msg: None)
    report = GcReport(dry_run=dry_run, grace=grace)
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        t = time.perf_counter()
        report.seconds[name] = report.seconds.get(name, 0.0) + t - clock
        clock = t

    if not dry_run:
        store.cleanup_temporaries()
    # -- 1. mark --------------------------------------------------------------------------------------------------
    say("mark: reading manifests")
    manifests, shadows = _mark_sources(repo)
    report.manifests = len(manifests)
    report.stray_manifests = len(shadows)
    live: dict[str, dict[str, tuple[int, int, int, str]]] = {}  # pack -> hash -> (offset, length, size, codec)
    users: dict[str, list[int]] = {}  # pack -> indices into manifests
    for i, (_key, m) in enumerate(manifests):
        for pack, rows in _rows_by_pack(m).items():
            live.setdefault(pack, {}).update(rows)
            users.setdefault(pack, []).append(i)
    kept: dict[str, dict[str, tuple[int, int, int, str]]] = {}  # packs stray manifests name: live, never repacked
    for m in shadows:
        for pack, rows in _rows_by_pack(m).items():
            kept.setdefault(pack, {}).update(rows)
    packs = _list_packs(store)
    sizes: dict[str, int] = {}
    for pack, key in packs.items():
        try:
            sizes[pack] = store.size(key)
        except KeyNotFound:
            continue
    packs = {p: k for p, k in packs.items() if p in sizes}
    report.packs = len(packs)
    report.pack_bytes = sum(sizes.values())
    report.live_packs = sum(1 for p in packs if p in live)
    report.live_bytes = sum(length for p in live if p in packs for _o, length, _s, _c in live[p].values())
    phase("mark")
    crashpoint("gc.marked")

    # -- 2. repack ------------------------------------------------------------------------------------------------
    sparse = sorted(p for p in packs if p in live and p not in kept and repack_below > 0
                    and sum(v[1] for v in live[p].values()) < repack_below * (sizes[p] - HEADER_SIZE))
    moved: dict[tuple[str, str], tuple[str, int, int, int, str]] = {}  # (old pack, hash) -> new location
    new_packs: dict[str, list[dict[str, Any]]] = {}
    if sparse:
        say(f"repack: {len(sparse)} pack(s) under {repack_below:.0%} live")
    if sparse and not dry_run:
        moved, new_packs = _repack(store, repo.config.pack_size, sparse, live, report)
        phase("repack.copy")
        crashpoint("gc.repack.packs")
        rewritten = 0
        touched = sorted({i for p in sparse for i in users.get(p, [])})
        for i in touched:
            key, m = manifests[i]
            doc = _relocated(m.doc, moved)
            if doc is None:
                continue
            data = seal_manifest(doc)
            store.put(key, data)
            manifests[i] = (key, Manifest(doc))
            _refresh_ref(store, m.run, m.step, key, data)
            rewritten += 1
            if rewritten == 1:
                crashpoint("gc.repack.manifest")
        report.manifests_rewritten = rewritten
        live = {}
        for _key, m in manifests:
            for pack, rows in _rows_by_pack(m).items():
                live.setdefault(pack, {}).update(rows)
        packs.update({p: pack_key(p) for p in new_packs})
        for p in new_packs:
            sizes[p] = store.size(pack_key(p))
        phase("repack.manifests")
    elif sparse:
        report.repacked_packs = len(sparse)
        report.repacked_bytes = sum(sizes[p] for p in sparse)
        report.copied_bytes = sum(v[1] for p in sparse for v in live[p].values())
        live = {p: rows for p, rows in live.items() if p not in sparse}  # as they will be after the rewrite

    # -- 4 (planned now). which packs are garbage -----------------------------------------------------------------
    t_now = time.time() if now is None else now
    previous = _read_condemned(store)
    condemned: dict[str, float] = {}
    for p in packs:
        if p in live or p in kept:
            continue
        if p in previous:
            condemned[p] = previous[p]
            continue
        try:
            stamp = store.modified(packs[p])
        except KeyNotFound:
            continue
        if stamp is not None and t_now - stamp < grace and p not in sparse:
            report.young_packs += 1  # maybe a save in progress: not even condemned yet
            continue
        condemned[p] = t_now
    due = {p for p, t in condemned.items() if t_now - t >= grace}
    phase("plan")

    # -- 3. index -------------------------------------------------------------------------------------------------
    index_keys = [k for k in store.list("index/") if is_index_key(k)]
    report.index_files_before = len(index_keys)
    keep = {p for p in packs if p not in condemned}
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
            blobs = _trailer_blobs(store, p)
            if blobs:
                rows[p] = blobs
    changed = bool(condemned.keys() - previous.keys()) or bool(new_packs) or len(index_keys) != 1 or any(
        p not in keep for key in index_keys for p in _index_packs(store, key))
    if not dry_run and changed and (rows or index_keys):
        say("index: writing one index file for the packs that stay")
        new_key = None
        if rows:
            index_id, index_bytes = build_index({p: rows[p] for p in sorted(rows)})
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
    phase("index")

    # -- 4. condemn -----------------------------------------------------------------------------------------------
    if not dry_run and condemned != previous:
        _write_condemned(store, condemned)
    crashpoint("gc.condemned")

    # -- 5. sweep -------------------------------------------------------------------------------------------------
    if due:
        say(f"sweep: deleting {len(due)} pack(s)")
    for n, p in enumerate(sorted(due)):
        if not dry_run:
            store.delete(packs[p])
            if n == 0:
                crashpoint("gc.sweep.pack")
        report.deleted_packs += 1
        report.deleted_bytes += sizes.get(p, 0)
    remaining = {p: t for p, t in condemned.items() if p not in due}
    if not dry_run and due:
        _write_condemned(store, remaining)
    report.condemned_packs = len(remaining)
    report.condemned_bytes = sum(sizes.get(p, 0) for p in remaining)
    report.next_sweep_after = min(remaining.values()) + grace if remaining else None
    phase("sweep")
    crashpoint("gc.done")
    return report


def reclaimable(repo: Repo) -> tuple[int, int]:
    """(bytes gc would free now, bytes pruning every checkpoint but the newest and pinned ones of each run would free
    on top), at pack granularity, without changing anything (no lock: an estimate for error messages)."""
    store = repo.store
    manifests = _all_manifests(repo)
    newest: dict[str, int] = {}
    for _key, m in manifests:
        newest[m.run] = max(newest.get(m.run, -1), m.step)
    pinned = {(r, s) for r in newest for s in repo.run(r).pins()}
    live_all: set[str] = set()
    live_min: set[str] = set()
    for _key, m in manifests:
        packs = set(m.doc["packs"])
        live_all |= packs
        if m.step == newest[m.run] or (m.run, m.step) in pinned:
            live_min |= packs
    gc_bytes = prune_bytes = 0
    for pack, key in _list_packs(store).items():
        try:
            size = store.size(key)
        except KeyNotFound:
            continue
        if pack not in live_all:
            gc_bytes += size
        elif pack not in live_min:
            prune_bytes += size
    return gc_bytes, prune_bytes


def _index_packs(store: Store, key: str) -> list[str]:
    try:
        return sorted({loc.pack for loc in parse_index(store.get_limited(key, MAX_INDEX_BYTES), key).values()})
    except (IntegrityError, KeyNotFound, StorageError):
        return []


def _trailer_blobs(store: Store, pack: str) -> list[dict[str, Any]]:
    from .checkpoint.read import read_trailer
    from .format.pack import PackFormatError

    try:
        computed, blobs = read_trailer(store, pack)
    except (KeyNotFound, PackFormatError, StorageError):
        return []
    if computed != pack:
        return []
    return [{k: b[k] for k in ("hash", "offset", "length", "size", "codec")} for b in blobs]


def _repack(store: Store, pack_size: int, sparse: list[str], live: dict[str, dict[str, tuple[int, int, int, str]]],
            report: GcReport) -> tuple[dict[tuple[str, str], tuple[str, int, int, int, str]],
                                       dict[str, list[dict[str, Any]]]]:
    """Copy the live blobs of ``sparse`` packs into new packs (verified on the way). Returns the relocation map and
    the new packs' blob records. A pack with a damaged live blob is not repacked (it stays; `verify` names it)."""
    moved: dict[tuple[str, str], tuple[str, int, int, int, str]] = {}
    written: dict[str, list[dict[str, Any]]] = {}
    builder = PackBuilder()
    pending: list[tuple[str, str]] = []  # (old pack, hash) in the builder
    held: list[bytes] = []

    def flush() -> None:
        nonlocal builder, pending, held
        if not builder.blobs:
            return
        pack_id, parts, _total = builder.finish()
        store.put_if_absent(pack_key(pack_id), parts)
        written[pack_id] = builder.blobs
        for (old, h), blob in zip(pending, builder.blobs):
            moved[(old, h)] = (pack_id, blob["offset"], blob["length"], blob["size"], blob["codec"])
        builder, pending, held = PackBuilder(), [], []

    for old in sparse:
        key = pack_key(old)
        blobs = []
        try:
            for h, (off, length, size, codec) in sorted(live[old].items(), key=lambda kv: kv[1][0]):
                data = store.get_range(key, off, length)
                if len(data) != length:
                    raise CorruptPackError("truncated")
                _verify_blob(data, h, size, codec)
                blobs.append((h, data, size, codec))
        except (CorruptPackError, zstandard.ZstdError, KeyNotFound) as exc:
            report.skipped_repacks.append(f"{old}: {exc}")
            continue
        for h, data, size, codec in blobs:
            held.append(data)
            builder.add(h, memoryview(data), size, codec)
            pending.append((old, h))
            report.copied_bytes += len(data)
        report.repacked_packs += 1
        report.repacked_bytes += store.size(key)
        if builder.nbytes >= pack_size:
            flush()
    flush()
    report.new_packs = len(written)
    return moved, written


def _relocated(doc: dict[str, Any], moved: dict[tuple[str, str], tuple[str, int, int, int, str]]) -> dict | None:
    """A copy of manifest ``doc`` with rows in moved packs pointing at their new locations (None if none moved)."""
    old_packs = doc["packs"]
    if not any((old_packs[r.pack], r.hash) in moved for e in doc["entries"] for r in rows_of(e)):
        return None
    new = _deep_copy(doc)
    packs: dict[str, int] = {}
    for e in new["entries"]:
        for raw in stored_rows(e):  # updated in place: the positions of Row's fields
            r = Row._make(raw)
            loc = moved.get((old_packs[r.pack], r.hash))
            if loc is None:
                raw[_PACK] = packs.setdefault(old_packs[r.pack], len(packs))
            else:
                pack_id, off, length, size, codec = loc
                raw[_PACK] = packs.setdefault(pack_id, len(packs))
                raw[_OFFSET:_CODEC + 1] = [off, length, size, codec]
    new["packs"] = list(packs)
    return new


def _deep_copy(doc: dict[str, Any]) -> dict[str, Any]:
    import json

    return json.loads(canonical(doc))


def _refresh_ref(store: Store, run: str, step: int, key: str, data: bytes) -> None:
    """Point the run's `latest` ref at the rewritten manifest, if it named this one (the ref is advisory)."""
    ref_key = latest_ref_key(run)
    try:
        ref = parse_ref(store.get_limited(ref_key, MAX_SMALL_BYTES), ref_key)
    except (KeyNotFound, IntegrityError, StorageError):
        return
    if ref.get("manifest") == key:
        try:
            store.put(ref_key, build_ref(run, step, sealed_checksum(data)))
        except OSError:
            pass
