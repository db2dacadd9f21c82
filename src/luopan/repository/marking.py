"""gc's mark phase (docs/format.md §10.3): every committed manifest of every kind read, and which packs they need.

Manifests are read *shallow* where their kind can (``Kind.shallow``: a checkpoint manifest without its entry groups
expanded), and each distinct entry group is read and checked once (``GroupMemo``): a run of a thousand checkpoints
names the same groups save after save, so marking costs the distinct chunk rows, not every checkpoint's rows again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GcError, IntegrityError, ManifestNameError, StorageError, UnsupportedFormatError
from ..format.groups import GroupMemo
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.names import is_pack_key
from ..store.base import KeyNotFound, Store
from .chunkio import blob_reader
from .gcreport import GcReport
from .kinds import Kind, rows_by_pack

Rows = dict[str, dict[str, tuple[int, int, int, str]]]  # pack -> hash -> (offset, length, size, codec)


@dataclass
class Marked:
    """One committed manifest gc read: its kind, series, number, key and document (shallow: a checkpoint
    manifest's ``entries`` are its inline ones; :func:`full_doc` reads it whole)."""

    kind: Kind
    series: str
    number: int
    key: str
    doc: dict[str, Any]


@dataclass
class Marks:
    """What the mark phase found; the repack phase updates it as live blobs move to new packs."""

    manifests: list[Marked]
    users: dict[str, list[int]]  # pack -> indices into manifests
    live: Rows  # packs committed manifests name
    kept: Rows  # packs stray manifests name: live, never repacked
    packs: dict[str, str]  # pack id -> key, of the packs in the store
    sizes: dict[str, int]  # pack id -> bytes
    memo: GroupMemo  # the entry groups read so far


def live_rows(store: Store, marks: Marks) -> Rows:
    """The live rows of ``marks.manifests`` as they are now (after a repack rewrote some of them)."""
    live: Rows = {}
    seen: set[str] = set()
    for m in marks.manifests:
        for pack, rows in rows_by_pack(m.doc).items():
            live.setdefault(pack, {}).update(rows)
        for g in marks.memo.of(m.doc, blob_reader(store, f"manifest {m.key}"), m.key) if "groups" in m.doc else ():
            if g.hash not in seen:
                seen.add(g.hash)
                for pack, rows in g.rows.items():
                    live.setdefault(pack, {}).update(rows)
    return live


def _parse(kind: Kind, store: Store, key: str, series: str | None, number: int | None) -> dict[str, Any]:
    data = store.get_limited(key, MAX_MANIFEST_BYTES)
    if kind.shallow is not None:
        return kind.shallow(data, key, series, number)
    return kind.parse(data, key, series, number, store)


def full_doc(store: Store, m: Marked) -> dict[str, Any]:
    """``m``'s whole document (entry groups expanded), for rewriting it."""
    if "groups" not in m.doc:
        return m.doc
    return m.kind.parse(store.get_limited(m.key, MAX_MANIFEST_BYTES), m.key, m.series, m.number, store)


def all_manifests(store: Store, kinds: tuple[Kind, ...]) -> list[Marked]:
    return mark_sources(store, kinds)[0]


def mark_sources(store: Store, kinds: tuple[Kind, ...], unloadable: list[str] | None = None
                 ) -> tuple[list[Marked], list[dict[str, Any]]]:
    """Every committed manifest of every kind, parsed (shallow where the kind can), from each kind's catalog walk;
    and the readable manifests found under stray series directories (``runs/a copy/``: not committed, but someone
    may rename them back, so what they reference is kept and never repacked). A committed manifest whose only fault
    is a name the name rule refuses (ManifestNameError: its references are known) joins the second list, and its
    message ``unloadable``. GcError, before anything changes, when a walk could not see the whole repository (a
    dangling link or unreadable directory may hold manifests) or a manifest cannot be read: gc would otherwise delete
    data they need."""
    out: list[Marked] = []
    shadows: list[dict[str, Any]] = []
    for kind in kinds:
        cat = kind.scan(store, None, True)
        if cat.incomplete:
            shown = "; ".join(str(s) for s in cat.incomplete[:5])
            raise GcError(f"gc stopped before deleting anything: part of {kind.root} cannot be read ({shown}), so gc "
                          f"cannot tell which data the {kind.name}s there need; mount or restore it (or remove the "
                          "link), then run gc again")
        for series, number in cat.pairs():
            key = kind.manifest_key(series, number)
            try:
                out.append(Marked(kind, series, number, key, _parse(kind, store, key, series, number)))
            except KeyNotFound:
                continue  # pruned since the listing
            except ManifestNameError as exc:  # loads nowhere, but what it needs is known: kept, never repacked
                shadows.append(exc.doc)
                if unloadable is not None:
                    unloadable.append(str(exc))
            except (IntegrityError, StorageError, UnsupportedFormatError) as exc:
                raise _unreadable(exc, kind, key) from None
        for key in cat.shadows:
            try:
                shadows.append(_parse(kind, store, key, None, None))
            except (IntegrityError, StorageError, UnsupportedFormatError, KeyNotFound):
                continue  # not a readable manifest: it references nothing
    return out, shadows


def _unreadable(exc: Exception, kind: Kind, key: str) -> GcError:
    return GcError(f"gc stopped before deleting anything: {exc}\ngc cannot tell which data a damaged or unreadable "
                   f"{kind.name} needs; restore that manifest (or its permissions), or remove it (`luopan prune`, or "
                   f"delete {key}), then run gc again")


def list_packs(store: Store) -> dict[str, str]:
    return {key.rsplit("/", 1)[-1][:-5]: key for key in store.list("packs/") if is_pack_key(key)}


def mark(store: Store, kinds: tuple[Kind, ...], report: GcReport) -> Marks:
    """Phase 1: read every manifest (mark_sources), note which packs they need and list the packs there are. Each
    distinct entry group's rows join the live set once; every manifest naming it counts as a user of its packs (a
    repack rewrites those manifests)."""
    manifests, shadows = mark_sources(store, kinds, report.unloadable_manifests)
    report.manifests = len(manifests)
    report.stray_manifests = len(shadows) - len(report.unloadable_manifests)
    memo = GroupMemo()
    live: Rows = {}
    users: dict[str, set[int]] = {}
    seen: set[str] = set()
    for i, m in enumerate(manifests):
        for pack, rows in rows_by_pack(m.doc).items():  # inline entries, and the group blobs themselves
            live.setdefault(pack, {}).update(rows)
            users.setdefault(pack, set()).add(i)
        try:
            groups = memo.of(m.doc, blob_reader(store, f"manifest {m.key}"), m.key) if "groups" in m.doc else []
        except (IntegrityError, StorageError, UnsupportedFormatError) as exc:
            raise _unreadable(exc, m.kind, m.key) from None
        for g in groups:
            for pack in g.packs:
                users.setdefault(pack, set()).add(i)
            if g.hash not in seen:
                seen.add(g.hash)
                for pack, rows in g.rows.items():
                    live.setdefault(pack, {}).update(rows)
    kept: Rows = {}
    for doc in shadows:
        for pack, rows in _rows_whole(store, doc, memo).items():
            kept.setdefault(pack, {}).update(rows)
    packs = list_packs(store)
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
    return Marks(manifests, {p: sorted(u) for p, u in users.items()}, live, kept, packs, sizes, memo)


def _rows_whole(store: Store, doc: dict[str, Any], memo: GroupMemo) -> Rows:
    """Every row a (stray) manifest document names, its groups' too when they can be read (a stray whose groups
    cannot be read keeps what its own file names)."""
    out: Rows = {p: dict(r) for p, r in rows_by_pack(doc).items()}
    if "groups" in doc:
        try:
            for g in memo.of(doc, blob_reader(store, "a stray manifest"), "a stray manifest"):
                for pack, rows in g.rows.items():
                    out.setdefault(pack, {}).update(rows)
        except (IntegrityError, StorageError, UnsupportedFormatError, KeyError, TypeError):
            pass
    return out
