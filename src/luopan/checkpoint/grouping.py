"""A save's entry groups (docs/format.md §8.5): which group blobs its manifest names, and the manifest file that
names them instead of listing its entries inline."""

from __future__ import annotations

from typing import Any

import blake3
import xxhash

from ..format.config import RepoConfig
from ..format.groups import (GROUP_MIN_ENTRIES, GROUPS_FORMAT_VERSION, MAX_GROUP_BYTES, group_blob, plan_groups,
                             with_pack_ids)
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.pack import BlobLocation
from ..errors import LuopanError
from ..format.codecs import zstd_blob
from ..repository.chunkio import ChunkRef, read_chunk
from ..repository.chunkwriter import ChunkWriter
from .writectx import WriteContext

GROUP_LEVEL = 9  # zstd level of group blobs: a few KiB each, coded once and named by many manifests (as manifests: §4)


def wants_groups(config: RepoConfig, doc: dict[str, Any]) -> bool:
    """Whether this manifest is stored grouped: a repository of format_version 6 or later, and enough entries that
    what repeats outweighs the group rows (small manifests stay inline, as before)."""
    return config.format_version >= GROUPS_FORMAT_VERSION and len(doc["entries"]) >= GROUP_MIN_ENTRIES


def group_blobs(doc: dict[str, Any], previous: dict[str, dict[str, Any]]) -> list[tuple[str, bytes, str, list[int]]]:
    """(BLAKE3, raw bytes, XXH3-128, entry indices) of each group blob of ``doc`` (an inline manifest document), in
    order; ``previous`` is the run's previous save's entries by path with rows naming pack ids (:func:`basis`)."""
    entries, packs = doc["entries"], doc["packs"]
    out = []
    for group in plan_groups(entries, packs, previous):
        raw = group_blob([(i, entries[i]) for i in group], packs)
        out.append((blake3.blake3(raw).hexdigest(), raw, xxhash.xxh3_128_hexdigest(raw), group))
    return out


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


def basis(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What the next save compares its entries with to keep unchanged ones in shared groups: ``doc``'s entries by
    path, rows naming pack ids. Only the grouping depends on it, never what a reader gets, so one read from disk
    is as good as one this process wrote."""
    packs = doc["packs"]
    return {e["path"]: with_pack_ids(e, packs) for e in doc["entries"]}


class GroupStore:
    """The save pipeline's step that stores a manifest's entry groups (part of save._CheckpointWriter)."""

    ctx: WriteContext
    chunks: ChunkWriter

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
        and return the document to seal; ``doc`` itself when it is not grouped. Counts them in ``doc``'s stats."""
        blobs = group_blobs(doc, self.ctx.grouping) if wants_groups(self.ctx.config, doc) else []
        sizes = [len(b[1]) for b in blobs]
        if not blobs or max(sizes) > MAX_GROUP_BYTES or sum(sizes) > MAX_MANIFEST_BYTES:
            return doc  # none, or what a reader would refuse (plan_groups keeps far below): inline, as before
        for h, raw, _x, _members in blobs:
            loc = self.chunks.new_locations.get(h) or self.ctx.known.get(h)
            if loc is None or (h not in self.chunks.new_locations and not self._intact(h, loc)):
                codec, stored = zstd_blob(raw, GROUP_LEVEL)
                self.chunks.add(h, memoryview(stored), len(raw), codec)
        self.chunks.flush()
        rows = [(h, self.chunks.location(h), x) for h, _raw, x, _m in blobs]
        file_doc = apply_groups(doc, rows, {i for b in blobs for i in b[3]})
        doc["stats"].update(chunks=doc["stats"]["chunks"] + len(rows), new_chunks=self.chunks.new_chunks,
                            new_bytes=self.chunks.new_bytes, stored_bytes=self.chunks.stored_bytes,
                            new_packs=self.chunks.new_packs)
        return file_doc
