"""Where the bytes of a repository went: each save split into new chunks, row/XOR deltas and reused bytes, the
cumulative size of the repository against what full saves would have cost, and deduplication across runs.

Every manifest lists every chunk row it needs (docs/format.md §8), so replaying the manifests in the order they were
created tells which save first stored each chunk. The split is scaled to each manifest's own ``stats.new_bytes`` (a
pruned manifest may have stored a chunk first; the stats are what the save itself recorded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from .gather import ReportData


@dataclass
class Save:
    """One manifest of any kind, as the storage charts show it (raw bytes unless named stored)."""

    kind: str  # "run", "artifact", "journal", "index"
    series: str
    number: int
    created: str
    logical: int  # logical bytes of the state
    stored: int  # bytes of pack files the save wrote (compressed, with framing)
    new_plain: int = 0  # raw bytes of plain chunks the save added
    new_delta: int = 0  # raw bytes of row-delta / XOR-delta chunks the save added
    reused: int = 0  # logical bytes the save did not write again

    @property
    def ref(self) -> str:
        return f"{self.series}@{self.number}"

    @property
    def label(self) -> str:
        what = {"run": "step", "artifact": "version", "journal": "snapshot seq", "index": "version"}[self.kind]
        return f"{self.series} {what} {self.number}" if self.kind == "run" else \
            f"{self.kind} {self.series} {what} {self.number}"


@dataclass
class Storage:
    saves: list[Save]  # every manifest read, oldest first
    by_ref: dict[tuple[str, str, int], Save]  # (kind, series, number) -> Save
    shared: list[tuple[str, str, str, str, int]] = field(default_factory=list)  # (kind, series, from kind, from
    # series, raw bytes of chunks series uses that from-series stored first)


def _when(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def analyse(data: ReportData) -> Storage:
    """Replay every manifest read, oldest first: which save stored each chunk first, and what it reused."""
    items = []
    for r in data.runs:
        items += [("run", c.run, c.step, c.created, c.stats, c.rows) for c in r.checkpoints]
    for name, versions in data.artifacts.items():
        items += [("artifact", name, v.version, v.created, v.stats, v.rows) for v in versions]
    for kind, group in (("journal", data.journals), ("index", data.indexes)):
        for name, snaps in group.items():
            items += [(kind, name, s.number, s.created, s.stats, s.rows) for s in snaps]
    items.sort(key=lambda it: (_when(it[3]), it[1], it[2]))
    first: dict[str, tuple[str, str]] = {}  # chunk hash -> (kind, series) of the save that stored it first
    seen_by: dict[tuple[str, str], set[str]] = {}
    shared: dict[tuple[str, str, str, str], int] = {}
    saves: list[Save] = []
    for kind, series, number, created, stats, rows in items:
        owner = (kind, series)
        mine = seen_by.setdefault(owner, set())
        plain = delta = 0
        for h, size, is_delta in rows:
            if h not in first:
                first[h] = owner
                if is_delta:
                    delta += size
                else:
                    plain += size
            if h not in mine:
                mine.add(h)
                if first[h] != owner:
                    key = (kind, series, *first[h])
                    shared[key] = shared.get(key, 0) + size
        logical = int(stats.get("logical_bytes", 0))
        new = int(stats.get("new_bytes", plain + delta))
        new_delta = min(delta, new)
        new_plain = new - new_delta
        saves.append(Save(kind, series, number, created, logical, int(stats.get("stored_bytes", 0)), new_plain,
                          new_delta, max(0, logical - new_plain)))
    return Storage(saves, {(s.kind, s.series, s.number): s for s in saves},
                   [(*k, v) for k, v in sorted(shared.items()) if v > 0])


def cumulative(saves: list[Save]) -> list[tuple[Save, int, int]]:
    """(save, bytes written so far, bytes full saves would have written so far), oldest first."""
    out = []
    written = full = 0
    for s in saves:
        written += s.stored
        full += s.logical
        out.append((s, written, full))
    return out
