"""Reclaiming, at once, the packs a just-deleted manifest alone needed (docs/format.md §10.3.1).

``gc`` frees space only after a full mark and a grace period; a retention loop that deletes one checkpoint per save
(Lightning's top-k rotation) would otherwise keep every rotated-out checkpoint's bytes until someone runs it. Here
the candidates are only the packs the deleted manifest named, and they go when no other manifest names them:

1. (the caller, under the exclusive lock) read the manifest's ``packs``, delete the manifest (durably);
2. **check** — every other committed manifest of every kind, and every readable stray one, is read and its
   ``packs`` (which lists every pack it needs, entry groups' too, §8.5) struck from the candidates. Each distinct
   manifest content is parsed once per process (``PackUsers``, keyed by the BLAKE3 of its bytes): a run of many
   checkpoints costs one small read per manifest, never a read of their groups or a listing of the packs;
3. **repack** — a candidate another manifest still names, but for less than half of its bytes (a 4-byte score
   tensor that deduplicated into an old checkpoint's pack), has those live blobs copied to a new pack (verified),
   an index file written for it, and each manifest naming it rewritten with the new locations (atomic replace, same
   chunks: gc's repack of §10.3 for these packs only); then it is a candidate no manifest names;
4. **index** — each index file naming a candidate (index files are write-once and content-named: which packs one
   names is remembered by key) is replaced by one without the candidates' rows (written first, the old one deleted
   after), so no save deduplicates against a pack about to go;
5. **delete** the candidate packs, each deletion synced into its directory.

A crash after any step leaves a valid repository: at worst packs no manifest needs (gc frees them), never an index
file or a manifest naming a missing pack, because each deletion above is durable before the next step starts. Any
doubt (a part of the repository that cannot be read, a damaged manifest) reclaims nothing and leaves it to gc.
Crash points (``LUOPAN_CRASH_AT``): ``reclaim.repack.manifest`` (after the first manifest rewrite),
``reclaim.index.written``, ``reclaim.index.replaced``, ``reclaim.pack`` (after
the first pack deletion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._crash import crashpoint
from ..errors import IntegrityError, ManifestNameError, StorageError, UnsupportedFormatError
from ..format import ENGINE2_FORMAT_VERSION
from ..format.canonical import digest, inflate_json, unseal
from ..format.manifest import seal_manifest
from ..format.index import build_index, parse_index
from ..format.limits import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from ..format.names import index_key, is_index_key, pack_key
from ..store.base import KeyNotFound, Store
from .gc import DEFAULT_REPACK_BELOW
from .gcreport import GcReport
from .kinds import Kind, rows_by_pack
from .repack import relocated, repack

_UNREADABLE = (IntegrityError, StorageError, UnsupportedFormatError)


@dataclass
class Reclaimed:
    """What a reclaim freed; ``skipped`` says why it freed nothing when it could not tell (gc will)."""

    packs: int = 0
    bytes: int = 0
    kept: int = 0  # candidate packs another manifest still needs
    repacked: int = 0  # candidate packs whose few live blobs were moved so they could go
    manifests_rewritten: int = 0
    index_files: int = 0  # index files rewritten without the freed packs
    skipped: str | None = None
    freed: list[str] = field(default_factory=list)


class PackUsers:
    """This process's memory of which packs a manifest content and an index file name (both read once each)."""

    def __init__(self) -> None:
        self.manifests: dict[str, frozenset[str]] = {}  # BLAKE3 of the manifest's bytes -> its packs
        self.indexes: dict[str, frozenset[str]] = {}  # index key (write-once, content-named) -> packs it names

    def manifest_packs(self, kind: Kind, store: Store, key: str, series: str | None, number: int | None,
                       data: bytes) -> frozenset[str]:
        address = digest(data)
        packs = self.manifests.get(address)
        if packs is None:
            try:
                doc = kind.shallow(data, key, series, number) if kind.shallow is not None else \
                    kind.parse(data, key, series, number, store)
            except ManifestNameError as exc:  # loads nowhere, but what it needs is known (gc keeps it too)
                doc = exc.doc
            packs = self.manifests[address] = frozenset(doc["packs"])
        return packs

    def index_packs(self, store: Store, key: str) -> frozenset[str] | None:
        """The packs index file ``key`` names; None when it cannot be read (readers skip it: no save trusts it)."""
        packs = self.indexes.get(key)
        if packs is None:
            try:
                packs = frozenset(loc.pack for loc in parse_index(store.get_limited(key, MAX_INDEX_BYTES), key).values())
            except (KeyNotFound, *_UNREADABLE):
                return None
            self.indexes[key] = packs
        return packs


def manifest_packs(kind: Kind, store: Store, series: str, number: int, users: PackUsers) -> frozenset[str]:
    """The packs committed manifest ``number`` of ``series`` names (read before deleting it)."""
    key = kind.manifest_key(series, number)
    return users.manifest_packs(kind, store, key, series, number, store.get_limited(key, MAX_MANIFEST_BYTES))


def reclaim(store: Store, kinds: tuple[Kind, ...], candidates: set[str] | frozenset[str], users: PackUsers,
            *, format_version: int, pack_size: int) -> Reclaimed:
    """Delete those of ``candidates`` (the packs of a manifest just deleted) that no manifest names now, moving the
    few live blobs out of those other manifests barely need; the caller holds the repository's exclusive lock."""
    result = Reclaimed()
    left = set(candidates)
    if not left:
        return result
    namers: dict[str, list[_Namer]] = {}
    try:
        left = _unreferenced(store, kinds, left, users, namers)
    except _Doubt as exc:
        result.skipped = str(exc)
        return result
    compress_index = format_version >= ENGINE2_FORMAT_VERSION
    dropped: set[str] = set()
    left |= _repack_sparse(store, namers, users, result, format_version, pack_size, dropped)
    if dropped - left:  # packs a rewritten manifest listed without naming a chunk in them: free them too
        try:
            left |= _unreferenced(store, kinds, dropped - left, users, {})
        except _Doubt:
            pass
    result.kept = len(candidates) - len(left)
    if not left:
        return result
    result.index_files = _drop_from_index(store, left, users, compress_index)
    for n, p in enumerate(sorted(left)):
        key = pack_key(p)
        try:
            size = store.size(key)
            store.delete(key)  # synced into its directory before the next one goes
        except KeyNotFound:
            continue
        result.packs += 1
        result.bytes += size
        result.freed.append(p)
        if n == 0:
            crashpoint("reclaim.pack")
    return result


@dataclass
class _Namer:
    """A manifest that names a candidate pack."""

    kind: Kind
    series: str
    number: int
    key: str
    data: bytes


def _repack_sparse(store: Store, namers: dict[str, list[_Namer]], users: PackUsers, result: Reclaimed,
                   format_version: int, pack_size: int, dropped: set[str]) -> set[str]:
    """Move the live blobs out of candidate packs other manifests need for under half of their bytes; returns the
    packs no manifest names afterwards. ``dropped`` gets the packs a rewritten manifest listed and no longer lists
    (a rewrite lists only the packs its rows name)."""
    docs: dict[str, dict[str, Any]] = {}
    live: dict[str, dict[str, tuple[int, int, int, str]]] = {}
    for pack, who in namers.items():
        rows: dict[str, tuple[int, int, int, str]] = {}
        try:
            for m in who:
                if m.key not in docs:
                    docs[m.key] = m.kind.parse(m.data, m.key, m.series, m.number, store)
                rows.update(rows_by_pack(docs[m.key]).get(pack, {}))
            size = store.size(pack_key(pack))
        except (KeyNotFound, *_UNREADABLE):
            continue
        if rows and sum(r[1] for r in rows.values()) < DEFAULT_REPACK_BELOW * size:
            live[pack] = rows
    if not live:
        return set()
    report = GcReport(dry_run=False, grace=0)
    moved, new_packs = repack(store, pack_size, sorted(live), live, report)
    if not moved:
        return set()
    new_id, data = build_index(new_packs, compress=format_version >= ENGINE2_FORMAT_VERSION)
    store.put_if_absent(index_key(new_id), data)  # before any manifest names the new packs (§10 rule 1)
    users.indexes[index_key(new_id)] = frozenset(new_packs)
    done = {old for old, _h in moved}
    rewritten: set[str] = set()
    for pack in sorted(done):
        for m in namers[pack]:
            if m.key in rewritten:
                continue
            doc = relocated(docs[m.key], moved)
            if doc is None:
                continue
            sealed = seal_manifest(doc, compress=m.kind.name == "checkpoint" and format_version >= ENGINE2_FORMAT_VERSION)
            store.put(m.key, sealed)  # atomic replace, synced: same chunks at their new locations
            dropped.update(set(docs[m.key]["packs"]) - set(doc["packs"]))
            if m.kind.rewritten is not None:
                m.kind.rewritten(store, m.series, m.number, sealed)
            rewritten.add(m.key)
            if len(rewritten) == 1:
                crashpoint("reclaim.repack.manifest")
    result.repacked += len(done)
    result.manifests_rewritten += len(rewritten)
    return done


class _Doubt(Exception):
    """Something that may name a candidate could not be read: reclaim nothing."""


def _unreferenced(store: Store, kinds: tuple[Kind, ...], left: set[str], users: PackUsers,
                  namers: dict[str, list[_Namer]]) -> set[str]:
    """The candidates no manifest names; ``namers`` gets, for each other one, the committed manifests naming it."""
    shadowed: set[str] = set()
    for kind in kinds:
        cat = kind.scan(store, None, True)
        if cat.incomplete:
            raise _Doubt(f"part of {kind.root} cannot be read ({cat.incomplete[0]})")
        for series, number in cat.pairs():
            key = kind.manifest_key(series, number)
            try:
                data = store.get_limited(key, MAX_MANIFEST_BYTES)
                named = left & users.manifest_packs(kind, store, key, series, number, data)
            except KeyNotFound:
                continue
            except _UNREADABLE as exc:
                raise _Doubt(f"{key} cannot be read ({str(exc)[:200]})") from None
            for pack in named:
                namers.setdefault(pack, []).append(_Namer(kind, series, number, key, data))
        for key in cat.shadows:  # a stray copy someone may rename back: what it names stays (as gc keeps it)
            try:
                shadowed |= users.manifest_packs(kind, store, key, None, None,
                                                 store.get_limited(key, MAX_MANIFEST_BYTES))
            except (KeyNotFound, *_UNREADABLE):
                continue  # not a readable manifest: it references nothing
    for pack in shadowed:  # kept, never repacked (as gc keeps them)
        namers.pop(pack, None)
    return left - shadowed - set(namers)


def _drop_from_index(store: Store, gone: set[str], users: PackUsers, compress: bool) -> int:
    """Replace every index file naming a pack in ``gone`` by one without those rows; returns how many."""
    replaced = 0
    for key in sorted(k for k in store.list("index/") if is_index_key(k)):
        packs = users.index_packs(store, key)
        if packs is None or not packs & gone:
            continue
        try:
            doc = unseal(inflate_json(store.get_limited(key, MAX_INDEX_BYTES), MAX_INDEX_BYTES))
        except KeyNotFound:
            continue
        rows = {p: [{"hash": h, "offset": o, "length": n, "size": s, "codec": c} for h, o, n, s, c in r]
                for p, r in doc["packs"].items() if p not in gone}
        if rows:
            new_id, data = build_index(rows, compress=compress)
            store.put_if_absent(index_key(new_id), data)
            users.indexes[index_key(new_id)] = frozenset(rows)
            crashpoint("reclaim.index.written")
        store.delete(key)  # synced: no index names a pack before it is deleted below
        users.indexes.pop(key, None)
        replaced += 1
        crashpoint("reclaim.index.replaced")
    return replaced
