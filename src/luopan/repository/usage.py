"""What a repository holds and costs, every kind alike: the one walk ``du``, ``stats``, ``ls`` and the report share
(docs/format.md §2a). Logical bytes over every manifest of every kind vs the bytes their distinct chunks take as
stored (the dedup ratio), per series and in total, and the physical bytes in the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..format.groups import GroupMemo
from ..format.limits import MAX_MANIFEST_BYTES
from ..store.base import KeyNotFound
from .chunkio import blob_reader
from .kinds import Kind, Opened, rows_by_pack


@dataclass
class SeriesUsage:
    """One series of one kind (a run, an artifact, a journal, an index) as listings show it."""

    kind: str  # the kind's name: "checkpoint", "artifact", "journal", "index"
    series: str
    numbers: list[int]  # its committed manifests (steps, versions, seqs), ascending
    damaged: list[int] = field(default_factory=list)  # manifests that could not be read (not counted)
    logical_bytes: int = 0  # what restoring every readable manifest of it would write
    stored_bytes: int = 0  # the distinct chunks those manifests reference, as stored
    exclusive_bytes: int = 0  # of those, the ones no other series references (what removing it and gc free)
    log_bytes: int = 0  # bytes it keeps outside manifests (a journal's or an index's log)
    created: str = ""  # when its newest readable manifest was made
    # What it holds in its kind's own words, counted by what knows them (a LangGraph journal's threads and
    # checkpoints: luopan.listing); word -> count
    contents: dict[str, int] = field(default_factory=dict)

    @property
    def latest(self) -> int | None:
        return self.numbers[-1] if self.numbers else None


@dataclass
class Holdings:
    """Every series of every kind (``series``, by kind then name), each kind's totals (``kinds``: kind name ->
    ``series``, ``manifests``, ``logical_bytes``, ``stored_bytes`` of the distinct chunks its manifests reference,
    ``log_bytes``) and the repository's (``totals``, as ``usage``)."""

    series: list[SeriesUsage]
    totals: dict[str, int]
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)


def holdings(repo: Opened, kinds: tuple[Kind, ...] | None = None) -> Holdings:
    """Read every manifest of every kind once (shallow where the kind can; each distinct entry group once,
    format.groups.GroupMemo) and every kind's logs. See :func:`usage` for the totals. ``kinds``: only those (their
    series' ``exclusive_bytes`` and the totals then leave the other kinds out)."""
    memo = GroupMemo()
    users: dict[str, set[int]] = {}  # "hash/pack/offset" -> indices into ``found`` of the series naming it
    length: dict[str, int] = {}
    found: list[SeriesUsage] = []
    counts: dict[str, int] = {k.count_key: 0 for k in repo.kinds}
    for kind in repo.kinds if kinds is None else kinds:
        logs = kind.logs(repo.store) if kind.logs is not None else {}
        catalog = kind.scan(repo.store, None, False)
        for series in sorted(set(catalog.steps) | set(logs)):
            s = SeriesUsage(kind.name, series, list(catalog.steps.get(series, [])), log_bytes=logs.get(series, 0))
            index = len(found)
            found.append(s)
            for number in s.numbers:
                try:
                    doc, rows = _rows(repo, kind, series, number, memo)
                except (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound):
                    s.damaged.append(number)  # counted, not fatal: `verify` names it
                    continue
                s.logical_bytes += doc["stats"]["logical_bytes"]
                s.created = str(doc.get("created", s.created))
                counts[kind.count_key] += 1
                for key, n in rows.items():
                    length[key] = n
                    users.setdefault(key, set()).add(index)
    for key, who in users.items():
        for i in who:
            found[i].stored_bytes += length[key]
            if len(who) == 1:
                found[i].exclusive_bytes += length[key]
    sizes = {"packs": 0, "index": 0, "refs": 0, **{k.root.rstrip("/"): 0 for k in repo.kinds}}
    for top in sizes:
        for key in repo.store.list(top + "/"):
            try:
                sizes[top] += repo.store.size(key)
            except (KeyNotFound, StorageError):
                pass
    by_kind: dict[str, dict[str, int]] = {}
    for s in found:
        k = by_kind.setdefault(s.kind, {"series": 0, "manifests": 0, "damaged": 0, "logical_bytes": 0,
                                        "stored_bytes": 0, "log_bytes": 0})
        k["series"] += 1
        k["manifests"] += len(s.numbers) - len(s.damaged)
        k["damaged"] += len(s.damaged)
        k["logical_bytes"] += s.logical_bytes
        k["log_bytes"] += s.log_bytes
    for key, who in users.items():
        for name in {found[i].kind for i in who}:
            by_kind[name]["stored_bytes"] += length[key]
    logs_total = sum(s.log_bytes for s in found)
    manifests = sum(sizes[k.root.rstrip("/")] for k in repo.kinds) - logs_total
    totals = {**counts, "damaged_manifests": sum(len(s.damaged) for s in found),
              "logical_bytes": sum(s.logical_bytes for s in found), "stored_bytes": sum(length.values()),
              "chunks": len(length), "physical_bytes": sum(sizes.values()), "pack_bytes": sizes["packs"],
              "index_bytes": sizes["index"], "manifest_bytes": manifests, "log_bytes": logs_total,
              "ref_bytes": sizes["refs"]}
    return Holdings(found, totals, by_kind)


def _rows(repo: Opened, kind: Kind, series: str, number: int, memo: GroupMemo) -> tuple[dict[str, Any], dict[str, int]]:
    """A manifest's document (shallow where its kind can) and every chunk it needs: "hash/pack/offset" -> stored
    length (its inline entries, its entry groups' blobs and, read once per distinct group, their rows)."""
    key = kind.manifest_key(series, number)
    if kind.shallow is None:
        doc = repo.read_manifest(kind, series, number)
    else:
        doc = kind.shallow(repo.store.get_limited(key, MAX_MANIFEST_BYTES), key, series, number)
    by_pack = rows_by_pack(doc)
    if "groups" in doc:
        for g in memo.of(doc, blob_reader(repo.store, f"manifest {key}"), key):
            for pack, rows in g.rows.items():
                by_pack.setdefault(pack, {}).update(rows)
    out = {f"{h}/{pack}/{offset}": n for pack, rows in by_pack.items() for h, (offset, n, _s, _c) in rows.items()}
    return doc, out


def usage(repo: Opened) -> dict[str, int]:
    """What the repository holds and costs (``checkpoints``, ``artifacts``, ``journals``, ``indexes``: how many
    manifests of each kind; ``damaged_manifests``: ones that could not be read, not counted):

    * ``logical_bytes``: what restoring every manifest of every kind would write (their ``stats.logical_bytes``);
    * ``stored_bytes``, ``chunks``: the distinct chunks those manifests reference, as stored (compressed): the dedup
      ratio is ``logical_bytes / stored_bytes``, the one definition ``luopan du`` and ``luopan stats`` share;
    * ``physical_bytes``: every byte in the store (``pack_bytes``, ``index_bytes``, ``manifest_bytes``,
      ``log_bytes`` — journals' and indexes' logs, not yet in any manifest — and ``ref_bytes``): the stored chunks
      plus metadata and pack bytes no manifest references (what ``gc`` frees)."""
    return holdings(repo).totals
