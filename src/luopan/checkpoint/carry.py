"""What one save of a run leaves for the next (in this process): its entries with rows naming pack ids, and the entry
groups it stored (docs/format.md §8.5), so that entries a save is told are unchanged (``trust_versions``) are
*carried*: named again, with their groups, without touching their chunk rows.

A frozen 70B base saved with 4 MiB chunks has ~262,000 chunk rows; a LoRA save changes a few hundred of them. Before,
every save mapped, compared and serialized every row of every entry (~8 µs a row in Python: 2 s a save); a carried
entry now costs a few dictionary lookups, and a group whose members are all carried is named by its address without
being built again. Nothing here changes what a manifest says, only the work of writing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..format import ENGINE2_FORMAT_VERSION, SEGMENTS_FORMAT_VERSION
from ..format.groups import with_pack_ids
from ..format.manifest import stored_rows, uses_new_codecs
from ..format.pack import BlobLocation
from ..repository.packwriter import PackChecker


class StoredGroup(NamedTuple):
    """A group blob a save named: its members (entries with rows naming pack ids), address, XXH3-128, raw size and
    the pack ids its rows name."""

    members: tuple[dict[str, Any], ...]
    hash: str
    xxh3: str
    size: int
    packs: tuple[str, ...]


def level(entry: dict[str, Any]) -> int:
    """The format_version an entry's own content needs (row deltas, XOR deltas, new codecs, segments)."""
    d = entry.get("delta")
    if d is not None and "segments" in d:
        return SEGMENTS_FORMAT_VERSION
    if d is not None or "xor" in entry or uses_new_codecs([entry]):
        return ENGINE2_FORMAT_VERSION
    return 1


@dataclass
class Basis:
    """A run's previous save, as its next save compares with it. ``entries``: path -> entry whose rows name pack ids
    (never changed once made: a carried entry is the same object in every save that carries it). ``groups``: the
    group blobs that save named, by their members' entry indices. ``own``: made by this process's save (only then
    may entries be carried or their XXH3s trusted, §5.5); ``generation``: the repository's chunk index generation
    then (gc or verify since: nothing is carried)."""

    entries: dict[str, dict[str, Any]]
    groups: dict[tuple[int, ...], StoredGroup] = field(default_factory=dict)
    own: bool = False
    generation: int = -1
    _extents: dict[int, list[BlobLocation]] = field(default_factory=dict, repr=False)
    _levels: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Basis:
        """The basis of a manifest read from disk (a process's first save of a run): for grouping only."""
        packs = doc["packs"]
        return cls({e["path"]: with_pack_ids(e, packs) for e in doc["entries"]})

    def extents(self, e: dict[str, Any]) -> list[BlobLocation]:
        """One location per pack ``e``'s rows name, reaching its furthest row: what PackChecker.reusable checks."""
        out = self._extents.get(id(e))
        if out is None:
            ends: dict[str, int] = {}
            for r in stored_rows(e):
                ends[r[1]] = max(ends.get(r[1], 0), r[2] + r[3])
            out = self._extents[id(e)] = [BlobLocation(p, 0, end, end, "none") for p, end in ends.items()]
        return out

    def level(self, e: dict[str, Any]) -> int:
        v = self._levels.get(id(e))
        if v is None:
            v = self._levels[id(e)] = level(e)
        return v

    def carried(self, entry: dict[str, Any], checker: PackChecker, generation: int,
                bad: set[str]) -> dict[str, Any] | None:
        """The previous entry of ``entry``'s path (the new entry's path, kind, dtype, shape and nbytes, no rows yet),
        when it may be named again unread: this process's save, no gc or verify since, the same type and shape,
        every pack it names still there and intact, and no chunk of it found damaged. None otherwise."""
        prev = self.entries.get(entry["path"])
        if (not self.own or generation != self.generation or prev is None or "chunks" not in prev
                or "alias_of" in entry or any(prev.get(k) != entry.get(k)
                                              for k in ("kind", "dtype", "shape", "nbytes", "scalar"))):
            return None
        if bad and any(r[0] in bad for r in stored_rows(prev)):
            return None
        if not all(checker.reusable(loc) for loc in self.extents(prev)):
            return None
        return prev

    def inherit(self, previous: Basis) -> None:
        """Keep what ``previous`` computed about the entries this basis shares with it."""
        for e in self.entries.values():
            k = id(e)
            if k in previous._extents:
                self._extents[k] = previous._extents[k]
            if k in previous._levels:
                self._levels[k] = previous._levels[k]
