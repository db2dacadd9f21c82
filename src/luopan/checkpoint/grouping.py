"""A save's entry groups (docs/format.md §8.5): which group blobs its manifest names, and the manifest file that
names them instead of listing its entries inline."""

from __future__ import annotations

from typing import Any, NamedTuple

import blake3
import xxhash

from ..format.config import RepoConfig
from ..format.groups import (GROUP_MIN_ENTRIES, GROUPS_FORMAT_VERSION, MAX_GROUP_BYTES, group_blob,
                             group_blob_packs, map_rows, plan_groups, with_pack_ids)
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.pack import BlobLocation
from ..errors import LuopanError
from ..format.codecs import zstd_blob
from ..repository.chunkio import ChunkRef, read_chunk
from ..repository.chunkwriter import ChunkWriter
from .carry import Basis, StoredGroup
from .writectx import WriteContext

GROUP_LEVEL = 9  # zstd level of group blobs: a few KiB each, coded once and named by many manifests (as manifests: §4)


def wants_groups(config: RepoConfig, doc: dict[str, Any]) -> bool:
    """Whether this manifest is stored grouped: a repository of format_version 6 or later, and enough entries that
    what repeats outweighs the group rows (small manifests stay inline, as before)."""
    return config.format_version >= GROUPS_FORMAT_VERSION and len(doc["entries"]) >= GROUP_MIN_ENTRIES


class Blob(NamedTuple):
    """One group blob of a save: address, raw bytes (None: named again as the previous save stored it, built only if
    it must be stored again), XXH3-128, entry indices, raw size, the pack ids its rows name."""

    hash: str
    raw: bytes | None
    xxh3: str
    members: list[int]
    size: int
    packs: tuple[str, ...]


def group_blobs(doc: dict[str, Any], previous: Basis | None, carried: dict[int, dict[str, Any]] | None = None
                ) -> list[Blob]:
    """The group blobs of ``doc`` (an inline manifest document; entries in ``carried`` have rows naming pack ids), in
    order. ``previous``: the run's previous save (its entries by path, rows naming pack ids, and its groups). A
    group whose members are all carried, at the indices the previous save grouped them at, is that save's blob
    again: named by its address without being built."""
    entries, packs = doc["entries"], doc["packs"]
    carried = carried or {}
    before = previous.entries if previous is not None else {}
    stored = previous.groups if previous is not None else {}
    out = []
    for group in plan_groups(entries, packs, before, carried.__contains__):
        old = stored.get(tuple(group))
        if old is not None and all(carried.get(i) is m for i, m in zip(group, old.members)):
            out.append(Blob(old.hash, None, old.xxh3, group, old.size, old.packs))
            continue
        raw, local = group_blob_packs([(i, entries[i]) for i in group], packs)
        out.append(Blob(blake3.blake3(raw).hexdigest(), raw, xxhash.xxh3_128_hexdigest(raw), group, len(raw),
                        tuple(local)))
    return out


def place(doc: dict[str, Any], indices: Any) -> None:
    """Rewrite the carried entries at ``indices`` with rows naming ``doc``'s packs by index (adding packs it lacks):
    entries a manifest keeps inline."""
    packs, entries = doc["packs"], doc["entries"]
    index = {p: k for k, p in enumerate(packs)}

    def pos(p: str) -> int:
        k = index.get(p)
        if k is None:
            k = index[p] = len(packs)
            packs.append(p)
        return k

    for i in indices:
        entries[i] = map_rows(entries[i], pos)


def apply_groups(doc: dict[str, Any], rows: list[tuple[str, BlobLocation, str]],
                 grouped: set[int]) -> dict[str, Any]:
    """Make ``doc`` name its groups (``rows``: hash, location, XXH3-128 of each blob, in order; ``grouped``: the
    entry indices they hold) and return the document to seal: the same with only the other entries inline. ``doc``
    keeps all its entries, as a parsed grouped manifest does."""
    packs = doc["packs"]
    index = {p: i for i, p in enumerate(packs)}
    groups = []
    for h, loc, x in rows:
        p = index.setdefault(loc.pack, len(index))
        if p == len(packs):
            packs.append(loc.pack)
        groups.append([h, p, loc.offset, loc.length, loc.size, loc.codec, x])
    doc["groups"] = groups
    doc["format_version"] = max(doc["format_version"], GROUPS_FORMAT_VERSION)
    return {**doc, "entries": [e for i, e in enumerate(doc["entries"]) if i not in grouped]}


def basis(doc: dict[str, Any]) -> Basis:
    """What the next save compares its entries with to keep unchanged ones in shared groups, from a manifest read
    from disk: ``doc``'s entries by path, rows naming pack ids. Only the grouping depends on it, never what a reader
    gets, so one read from disk is as good as one this process wrote (nothing is carried from it)."""
    return Basis.from_doc(doc)


class GroupStore:
    """The save pipeline's step that stores a manifest's entry groups (part of save._CheckpointWriter)."""

    ctx: WriteContext
    chunks: ChunkWriter
    carried: dict[int, dict[str, Any]]  # entry index -> the previous save's entry, named again unread (carry.py)

    def _intact(self, h: str, loc: BlobLocation) -> bool:
        """Whether a stored group blob may be named again: its pack intact, and the blob itself read back and checked
        (a few KiB; a damaged group would make every manifest naming it unreadable, not just one entry)."""
        if not self.chunks.checker.reusable(loc):
            return False
        signature = self.chunks.checker.intact.get(loc.pack)
        if signature is not None and self.ctx.checked_groups.get(h) == (loc.pack, loc.offset, signature):
            return True  # read back by an earlier save of this process, and its pack has not changed since
        try:
            read_chunk(self.ctx.store, ChunkRef("entry group", "(entry group)", 0, h, loc.pack, loc.offset, loc.length,
                                                loc.size, loc.codec), memoryview(bytearray(loc.size)))
        except (LuopanError, OSError):
            return False  # stored again, in this save's pack
        if signature is not None:
            self.ctx.checked_groups[h] = (loc.pack, loc.offset, signature)
        return True

    def store_groups(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Write the group blobs of ``doc`` the store lacks (into a pack after the data packs: their rows name those)
        and return the document to seal; ``doc`` itself when it is not grouped. Counts them in ``doc``'s stats.
        Carried entries (rows naming pack ids) end up in groups, or placed inline with rows naming ``doc``'s packs."""
        carried = self.carried
        blobs = group_blobs(doc, self.ctx.basis, carried) if wants_groups(self.ctx.config, doc) else []
        sizes = [b.size for b in blobs]
        if not blobs or max(sizes) > MAX_GROUP_BYTES or sum(sizes) > MAX_MANIFEST_BYTES:
            place(doc, sorted(carried))
            return doc  # none, or what a reader would refuse (plan_groups keeps far below): inline, as before
        grouped = {i for b in blobs for i in b.members}
        place(doc, sorted(set(carried) - grouped))
        packs = doc["packs"]
        listed = set(packs)
        for b in blobs:  # every pack a group names is the manifest's too (§8.5)
            for p in b.packs:
                if p not in listed:
                    listed.add(p)
                    packs.append(p)
        for b in blobs:
            loc = self.chunks.new_locations.get(b.hash) or self.ctx.known.get(b.hash)
            if loc is None or (b.hash not in self.chunks.new_locations and not self._intact(b.hash, loc)):
                raw = b.raw if b.raw is not None else group_blob([(i, doc["entries"][i]) for i in b.members], packs)
                codec, stored = zstd_blob(raw, GROUP_LEVEL)
                self.chunks.add(b.hash, memoryview(stored), len(raw), codec)
        self.chunks.flush()
        rows = [(b.hash, self.chunks.location(b.hash), b.xxh3) for b in blobs]
        self.blobs = blobs
        file_doc = apply_groups(doc, rows, grouped)
        doc["stats"].update(chunks=doc["stats"]["chunks"] + len(rows), new_chunks=self.chunks.new_chunks,
                            new_bytes=self.chunks.new_bytes, stored_bytes=self.chunks.stored_bytes,
                            new_packs=self.chunks.new_packs)
        return file_doc

    def basis_after(self, doc: dict[str, Any]) -> Basis:
        """What this save leaves for the run's next save (carry.Basis): carried entries as they were, the others
        with rows naming pack ids, and the groups this save named."""
        entries: dict[str, dict[str, Any]] = {}
        packs = doc["packs"]
        for i, e in enumerate(doc["entries"]):
            entries[e["path"]] = self.carried[i] if i in self.carried else with_pack_ids(e, packs)
        out = Basis(entries, own=True, generation=self.ctx.generation)
        for b in getattr(self, "blobs", ()):
            out.groups[tuple(b.members)] = StoredGroup(tuple(entries[doc["entries"][i]["path"]] for i in b.members),
                                                       b.hash, b.xxh3, b.size, b.packs)
        if self.ctx.basis is not None:
            out.inherit(self.ctx.basis)
        return out
