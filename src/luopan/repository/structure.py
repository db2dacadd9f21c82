"""``verify --structure`` (``repo.verify(structure=True)``): every manifest checked as a load would parse it, and
every chunk row checked against its pack, without reading a chunk.

A full ``verify`` reads every distinct chunk; at a thousand checkpoints of a 70B-class state that is the whole
repository. The structure check reads each manifest's own file (shallow, ``Kind.shallow``), each distinct entry group
once (``GroupMemo``, with the entry checks a load makes), rebuilds each grouped manifest's entry list to check it
against its fingerprint, and checks every pack a row names: there, its trailer intact, and long enough for the row.
Its cost grows with the manifests and the distinct chunk rows, not with the checkpoints times their rows.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptManifestError, IntegrityError, StorageError, UnsupportedFormatError
from ..format.canonical import canonical, digest
from ..format.groups import GroupMemo
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifestread import check_entries, check_tree
from ..format.names import pack_key
from ..store.base import KeyNotFound, Store
from .chunkio import blob_reader, check_pack_trailer
from .kinds import Kind, rows_by_pack
from .verify import Checked, as_problem


def verify_structure(store: Store, targets: list[tuple[Kind, str, int]]) -> Checked:
    """Check the ``targets``' manifests and the packs their rows name (see the module docstring); problems are
    collected. ``chunks`` counts the distinct chunk rows checked; no byte of a chunk is read (``bytes`` is 0)."""
    out = Checked(manifests=len(targets))
    memo = GroupMemo(check=check_entries)
    ends: dict[str, int] = {}  # pack -> furthest end of a row naming it
    first: dict[str, str] = {}  # pack -> a manifest naming it (for messages)
    seen: set[str] = set()
    rows = 0
    for kind, series, number in targets:
        key = kind.manifest_key(series, number)
        try:
            data = store.get_limited(key, MAX_MANIFEST_BYTES)
            doc = kind.shallow(data, key, series, number) if kind.shallow is not None else None
            groups: list[Any] = []
            if doc is None or "groups" not in doc:  # all inline: the whole parse, as a load makes it
                doc = kind.parse(data, key, series, number, store)
            else:  # its tree and own entries as a load checks them, each distinct group once, the entries rebuilt
                check_tree(doc, key)
                check_entries(list(enumerate(doc["entries"])), doc["packs"], key, schema=False)
                groups = memo.of(doc, blob_reader(store, f"manifest {key}"), key)
                _check_rebuilt(doc, groups, key)
        except KeyNotFound:
            continue
        except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
            out.problems.append(as_problem(exc))
            continue
        found = [rows_by_pack(doc)] + [g.rows for g in groups if g.hash not in seen]
        seen.update(g.hash for g in groups)
        for by_pack in found:
            for pack, blobs in by_pack.items():
                rows += len(blobs)
                end = max(o + n for o, n, _s, _c in blobs.values())
                if end > ends.get(pack, -1):
                    ends[pack] = end
                first.setdefault(pack, key)
    out.chunks = rows
    for pack in sorted(ends):
        try:
            size = store.size(pack_key(pack))
        except KeyNotFound:
            out.problems.append(IntegrityError(f"pack {pack} is missing; {first[pack]} (and maybe others) needs it"))
            continue
        except StorageError as exc:
            out.problems.append(as_problem(exc))
            continue
        if size < ends[pack]:
            out.problems.append(IntegrityError(f"pack {pack} is {size} bytes, but {first[pack]} (or another "
                                               f"manifest) names a chunk ending at byte {ends[pack]}"))
            continue
        problem = check_pack_trailer(store, pack)
        if problem is not None:
            out.problems.append(problem)
    return out


def _check_rebuilt(doc: dict[str, Any], groups: list[Any], key: str) -> None:
    """A grouped manifest's entries rebuilt from its groups (by index) and inline entries must match its
    fingerprint, as a load checks (§8.5)."""
    at: dict[int, Any] = {}
    for g in groups:
        at.update(g.structure)
    inline = iter(doc["entries"])
    n = len(at) + len(doc["entries"])
    try:
        rows = [list(at[i]) if i in at else _structure(next(inline)) for i in range(n)]
    except StopIteration:
        raise CorruptManifestError(f"manifest {key}: its entry groups and inline entries do not add up") from None
    if "blake3:" + digest(canonical(rows)) != doc["fingerprint"]:
        raise CorruptManifestError(f"manifest {key}: its entries, rebuilt from its entry groups, do not match its "
                                   "fingerprint")


def _structure(e: dict[str, Any]) -> list[Any]:
    return [e["path"], e["kind"], e["dtype"], list(e["shape"])]
