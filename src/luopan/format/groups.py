"""Entry groups (docs/format.md §8.5, format_version 6): a checkpoint manifest's entries stored as content-addressed
blobs in packs, so the entries that did not change since the previous save are not stored again.

A grouped manifest lists ``groups`` (chunk rows of group blobs) besides the ``entries`` it keeps inline. A group
blob is the canonical JSON ``{"entries": [[index, entry], ...], "packs": [pack id, ...]}`` whose entries' chunk rows name packs by index
into the group's own ``packs``: a group depends only on its entries, not on the manifest around it, so the next
save that has the same entries at the same indices produces the same bytes, the same BLAKE3 address, and finds it
already stored. Readers expand the groups when they parse a manifest (:func:`expand`), so everything after parsing
sees the entries inline.

Writers (:func:`plan_groups`) group the entries that did not change since the previous save, cut at entries whose
path hashes to a cut point (content-defined), so a change to one entry rewrites one small group, not the ones after
it; the changed entries stay inline.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import blake3

from ..errors import CorruptManifestError
from .canonical import SealError, canonical, parse_object
from .kindmanifest import chunk_row_ok
from .limits import MAX_MANIFEST_BYTES

GROUPS_FORMAT_VERSION = 6
GROUP_MIN_ENTRIES = 32  # a manifest with fewer entries stays inline: its groups would save little
GROUP_MAX_ENTRIES = 256  # a group ends after this many entries even without a cut point
CUT_MODULUS = 32  # a group also ends after an entry whose path's BLAKE3 is 0 modulo this: ~32 entries a group
MAX_GROUP_BYTES = 64 << 20  # the largest group blob (raw JSON) a reader accepts
# A group also ends before its estimated JSON would pass this, and an entry estimated larger stays inline, so no blob a
# writer makes comes near MAX_GROUP_BYTES (a frozen 7B base with small chunks has entries of megabytes of rows).
GROUP_TARGET_BYTES = 16 << 20

# (pack id, chunk row) -> the blob's raw bytes, verified against the row's BLAKE3 address (repository.chunkio)
ReadBlob = Callable[[str, list[Any]], bytes]

_ROW_MEMBERS = (("chunks",), ("delta", "index"), ("delta", "values"), ("xor", "chunks"))


def map_rows(entry: dict[str, Any], pack: Callable[[Any], int]) -> dict[str, Any]:
    """A copy of ``entry`` whose chunk rows (its chunks, row delta and XOR delta) name pack ``pack(old index)``.
    The entry itself is not changed. TypeError/KeyError/IndexError on a malformed entry."""
    out = dict(entry)
    for path in _ROW_MEMBERS:
        holder: Any = out
        if len(path) == 2:
            if path[0] not in out:
                continue
            if not isinstance(out[path[0]], dict):
                raise TypeError(f"{path[0]} is not an object")
            holder = out[path[0]] = dict(out[path[0]])
        rows = holder.get(path[-1])
        if rows is None:
            continue
        holder[path[-1]] = [[r[0], pack(r[1]), *r[2:]] for r in rows]
    return out


def group_blob(members: list[tuple[int, dict[str, Any]]], packs: list[str]) -> bytes:
    """The raw bytes of one group: ``members`` are (index, entry) with rows naming ``packs`` (the manifest's) by
    index, or naming pack ids (an entry carried from the previous save: luopan.checkpoint.carry)."""
    return group_blob_packs(members, packs)[0]


def group_blob_packs(members: list[tuple[int, dict[str, Any]]], packs: list[str]) -> tuple[bytes, list[str]]:
    """:func:`group_blob`, and the pack ids its rows name (the group's own ``packs``)."""
    local: dict[str, int] = {}

    def pack(p: Any) -> int:
        return local.setdefault(p if isinstance(p, str) else packs[p], len(local))

    rows = [[i, map_rows(e, pack)] for i, e in members]
    return canonical({"entries": rows, "packs": list(local)}), list(local)


def estimated_bytes(entry: dict[str, Any]) -> int:
    """An upper bound of ``entry``'s bytes in a group blob: a chunk row's JSON is at most ~230 bytes (64 + 32 hex
    digits, five integers below 2^62, a codec), a path character at most 4 bytes of UTF-8, the rest (dtype, up to 64
    dimensions, members' names) well under 2 KiB."""
    rows = 0
    for path in _ROW_MEMBERS:
        holder = entry.get(path[0]) if len(path) == 2 else entry
        if isinstance(holder, dict):
            rows += len(holder.get(path[-1]) or ())
    return 2048 + 4 * len(entry["path"]) + 240 * rows


def _cut_after(path: str) -> bool:
    return blake3.blake3(path.encode("utf-8", "surrogatepass")).digest()[0] % CUT_MODULUS == 0


def plan_groups(entries: list[dict[str, Any]], packs: list[str], previous: dict[str, dict[str, Any]],
                same: Callable[[int], bool] | None = None) -> list[list[int]]:
    """Entry indices of each group to write for ``entries`` (rows naming ``packs``, the manifest's): the entries
    equal to the previous save's entry of the same path (``previous``: path -> entry with rows naming pack ids, see
    :func:`with_pack_ids`), cut at content-defined points. The others stay inline in the manifest: they changed, so
    a group of them would most likely not be named again, and inline they compress with the whole manifest.
    Deterministic: the same unchanged entries give the same groups, and so the same blobs. Which group an entry
    lands in never changes what a reader gets, only what the next save can share. ``same(i)``: entry ``i`` is known
    equal to the previous one without comparing (carried: its rows already name pack ids)."""
    out: list[list[int]] = []
    group: list[int] = []
    size = 0
    for i, e in enumerate(entries):
        if not (same is not None and same(i)):
            before = previous.get(e["path"])
            if before is None or map_rows(e, packs.__getitem__) != before:
                continue
        n = estimated_bytes(e)
        if n > GROUP_TARGET_BYTES:
            continue  # too large for any group: inline
        if group and size + n > GROUP_TARGET_BYTES:
            out.append(group)
            group, size = [], 0
        group.append(i)
        size += n
        if len(group) >= GROUP_MAX_ENTRIES or _cut_after(e["path"]):
            out.append(group)
            group, size = [], 0
    if group:
        out.append(group)
    return out


def with_pack_ids(entry: dict[str, Any], packs: list[str]) -> dict[str, Any]:
    """``entry`` with its rows naming pack ids instead of indices (how :func:`plan_groups` compares entries)."""
    return map_rows(entry, packs.__getitem__)


class _Cache:
    """Verified group blobs by BLAKE3 address: a run's manifests share most of their groups, so listing or
    collecting many of them reads each group once. Content-addressed, so safe across repositories."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.blobs: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, h: str) -> bytes | None:
        with self.lock:
            data = self.blobs.get(h)
            if data is not None:
                self.blobs.move_to_end(h)
            return data

    def put(self, h: str, data: bytes) -> None:
        with self.lock:
            if h in self.blobs or len(data) > self.limit:
                return
            self.blobs[h] = data
            self.size += len(data)
            while self.size > self.limit:
                _h, old = self.blobs.popitem(last=False)
                self.size -= len(old)


CACHE = _Cache(64 << 20)


def expand(doc: dict[str, Any], read: ReadBlob | None, where: str) -> None:
    """Rebuild a grouped manifest document's full ``entries`` in place: the groups' entries at their indices, the
    manifest's own (inline) ``entries`` in the indices left, in order (``groups`` stays, as the rows gc and
    replication follow). Checks everything about the groups that the schema cannot see once they are inline:
    well-formed rows and blobs, no index given twice or out of range, every pack a group names listed by the
    manifest. CorruptManifestError otherwise; the reader's own typed errors (a missing or damaged pack) pass."""
    groups = doc.get("groups")
    if groups is None:
        return

    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"manifest {where}: {msg}")

    if read is None:
        raise bad("names entry groups, which only a reader with the repository can expand")
    packs, inline = doc.get("packs"), doc.get("entries", [])
    if not isinstance(groups, list) or not isinstance(packs, list) or not isinstance(inline, list):
        raise bad("its groups, entries or packs are not lists")
    index = {p: i for i, p in enumerate(packs) if isinstance(p, str)}
    total = 0
    for row in groups:
        if not (chunk_row_ok(row, 1 << 48) and row[1] < len(packs) and isinstance(packs[row[1]], str)
                and row[5] in ("none", "zstd") and 0 < row[3] and 0 < row[4] <= MAX_GROUP_BYTES
                and (row[3] == row[4] if row[5] == "none" else row[3] <= row[4])):
            raise bad(f"entry group row {str(row)[:120]} is malformed (or its group exceeds {MAX_GROUP_BYTES} bytes)")
        total += row[4]
        if total > MAX_MANIFEST_BYTES:
            raise bad(f"its entry groups hold more than {MAX_MANIFEST_BYTES} bytes")
    blobs = {row[0]: CACHE.get(row[0]) for row in groups}
    todo = {row[0]: row for row in groups if blobs[row[0]] is None}

    def fetch(row: list[Any]) -> tuple[str, bytes]:
        data = read(packs[row[1]], row)  # type: ignore[misc]
        if blake3.blake3(data).hexdigest() != row[0]:  # the reader checks too: never trust one that forgot
            raise bad(f"entry group {row[0][:16]}… does not hash to its address")
        return row[0], data

    if len(todo) > 1:  # several round trips on an object store: in parallel
        with ThreadPoolExecutor(min(8, len(todo)), "luopan-groups") as pool:
            fetched = list(pool.map(fetch, todo.values()))
    else:
        fetched = [fetch(row) for row in todo.values()]
    entries: dict[int, dict[str, Any]] = {}
    for h, data in fetched:
        try:
            blob = parse_object(data)
            if canonical(blob) != data:
                raise ValueError("not canonical JSON")
        except (SealError, ValueError, RecursionError) as exc:
            raise bad(f"entry group {h[:16]}… is malformed ({type(exc).__name__}: {str(exc)[:80]})") from None
        blobs[h] = data
        CACHE.put(h, data)
    for row in groups:
        try:
            blob = json.loads(blobs[row[0]])
            local = blob["packs"]
            if set(blob) != {"entries", "packs"} or not isinstance(local, list) or not isinstance(blob["entries"], list):
                raise TypeError("not a group")
            to_manifest = [index[p] for p in local]

            def pack(i: Any, to_manifest: list[int] = to_manifest) -> int:
                if type(i) is not int or not 0 <= i < len(to_manifest):
                    raise IndexError(i)
                return to_manifest[i]

            for i, e in blob["entries"]:
                if type(i) is not int or not isinstance(e, dict) or i in entries or not 0 <= i < (1 << 40):
                    raise TypeError(f"entry index {str(i)[:20]} repeated or invalid")
                entries[i] = map_rows(e, pack)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise bad(f"entry group {row[0][:16]}… is malformed ({type(exc).__name__}: {str(exc)[:80]})") from None
    n = len(entries) + len(inline)
    if entries and max(entries) >= n:
        raise bad(f"its entry groups name entry {max(entries)} of {n}")
    rest = iter(inline)
    doc["entries"] = [entries[i] if i in entries else next(rest) for i in range(n)]


def parse_group(data: bytes, h: str, where: str) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """(members as (entry index, entry whose rows name the group's own packs by index), the group's pack ids) of a
    group blob's raw bytes, already checked against its address ``h``. CorruptManifestError when it is not the
    canonical JSON of a group, or gives an entry index twice."""
    try:
        blob = parse_object(data)
        if canonical(blob) != data:
            raise ValueError("not canonical JSON")
        if set(blob) != {"entries", "packs"}:
            raise TypeError("not a group")
        local, members = blob["packs"], blob["entries"]
        if not isinstance(local, list) or not isinstance(members, list) or not all(isinstance(p, str) for p in local):
            raise TypeError("not a group")
        out: list[tuple[int, dict[str, Any]]] = []
        seen: set[int] = set()
        for m in members:
            i, e = m
            if type(i) is not int or not isinstance(e, dict) or i in seen or not 0 <= i < (1 << 40):
                raise TypeError(f"entry index {str(i)[:20]} repeated or invalid")
            seen.add(i)
            out.append((i, e))
    except (SealError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise CorruptManifestError(f"manifest {where}: entry group {h[:16]}… is malformed "
                                   f"({type(exc).__name__}: {str(exc)[:80]})") from None
    return out, local


Rows = dict[str, dict[str, tuple[int, int, int, str]]]  # pack id -> chunk hash -> (offset, length, size, codec)


class Group(NamedTuple):
    """One entry group as operations over many manifests see it (:class:`GroupMemo`)."""

    hash: str
    indices: frozenset[int]  # the manifest entry indices it holds
    packs: tuple[str, ...]  # the pack ids its rows name
    rows: Rows  # its entries' chunk rows by pack id
    structure: tuple[tuple[int, tuple[Any, ...]], ...]  # (entry index, (path, kind, dtype, shape)) of its entries


class GroupMemo:
    """Entry groups read and checked once each, by content address, for operations over many manifests (gc
    marking, ``verify --structure``): a run's manifests name the same groups save after save, so reading every
    manifest's groups whole would cost every checkpoint's chunk rows again. ``check(members, packs, where)`` (optional)
    validates a group's entries further the first time it is read."""

    def __init__(self, check: Callable[[list[tuple[int, dict[str, Any]]], list[str], str], None] | None = None) -> None:
        self.groups: dict[str, Group] = {}
        self.check = check

    def of(self, doc: dict[str, Any], read: ReadBlob, where: str) -> list[Group]:
        """The groups of a manifest document parsed without expanding them (its ``entries`` the inline ones): each
        read once, checked against its address, well-formed, every pack it names listed by the manifest, no entry
        index given twice or beyond the manifest's entries. CorruptManifestError otherwise (a missing or damaged
        pack: the reader's typed errors)."""
        out: list[Group] = []
        packs, n_inline = doc["packs"], len(doc.get("entries", []))
        listed = set(packs)
        taken = 0
        held: set[int] = set()
        for row in doc.get("groups", []):
            g = self.groups.get(row[0])
            if g is None:
                g = self._read(row, packs, read, where)
                self.groups[row[0]] = g
            if not listed.issuperset(g.packs):
                raise CorruptManifestError(f"manifest {where}: entry group {row[0][:16]}… names a pack the manifest "
                                           "does not list")
            if held & g.indices:
                raise CorruptManifestError(f"manifest {where}: two entry groups hold entry {min(held & g.indices)}")
            held |= g.indices
            taken += len(g.indices)
            out.append(g)
        if held and max(held) >= taken + n_inline:
            raise CorruptManifestError(f"manifest {where}: its entry groups name entry {max(held)} of "
                                       f"{taken + n_inline}")
        return out

    def _read(self, row: list[Any], packs: list[str], read: ReadBlob, where: str) -> Group:
        if not (chunk_row_ok(row, 1 << 48) and 0 < row[4] <= MAX_GROUP_BYTES and row[5] in ("none", "zstd")
                and row[1] < len(packs)):
            raise CorruptManifestError(f"manifest {where}: entry group row {str(row)[:120]} is malformed")
        data = read(packs[row[1]], row)
        if blake3.blake3(data).hexdigest() != row[0]:  # the reader checks too: never trust one that forgot
            raise CorruptManifestError(f"manifest {where}: entry group {row[0][:16]}… does not hash to its address")
        members, local = parse_group(data, row[0], where)
        rows: Rows = {}
        for _i, e in members:
            for path in _ROW_MEMBERS:
                holder = e.get(path[0]) if len(path) == 2 else e
                found = holder.get(path[-1]) if isinstance(holder, dict) else None
                for r in found if isinstance(found, list) else ():
                    if not (chunk_row_ok(r, 1 << 48) and r[1] < len(local)):
                        raise CorruptManifestError(f"manifest {where}: entry group {row[0][:16]}… has a malformed "
                                                   f"chunk row {str(r)[:120]}")
                    rows.setdefault(local[r[1]], {})[r[0]] = (r[2], r[3], r[4], r[5])
        if self.check is not None:
            self.check(members, local, where)
        try:
            structure = tuple((i, (e["path"], e["kind"], e["dtype"], list(e["shape"]))) for i, e in members)
        except (KeyError, TypeError) as exc:
            raise CorruptManifestError(f"manifest {where}: entry group {row[0][:16]}… has a malformed entry "
                                       f"({type(exc).__name__}: {str(exc)[:80]})") from None
        return Group(row[0], frozenset(i for i, _e in members), tuple(local), rows, structure)


def group_rows(doc: dict[str, Any]) -> list[list[Any]]:
    """The chunk rows of a parsed manifest's entry groups (empty for an inline one)."""
    return doc.get("groups", [])
