"""Reading many checkpoint manifests cheaply (issue 30): what listing, prune, gc and ``verify --structure`` read
of a manifest without expanding its entry groups (docs/format.md §8.5), and the checks a load makes, applied to
parts of a manifest (a group's entries once per group, a shallow manifest's inline entries or tree)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..errors import CorruptManifestError
from . import SEGMENTS_FORMAT_VERSION
from .groups import GROUPS_FORMAT_VERSION
from .manifest import _check_consistency, _opened, _validated, manifest_rows, schema_check


def parse_manifest_header(data: bytes, where: str, run: str, step: int) -> dict[str, Any]:
    """What listing needs of a manifest (run, step, created, metrics, stats, fingerprint), checked as a load checks
    what it reads, but without reading a grouped manifest's entry groups (§8.5): its own file is checked whole (seal,
    schema, its inline entries as a load checks them), so listing many checkpoints costs their files, not every
    checkpoint's chunk rows again; ``verify`` and every read check the groups. A manifest without groups is parsed
    as by :func:`parse_manifest`. Returns the document (a grouped one's ``entries`` are its inline ones only);
    CorruptManifestError as :func:`parse_manifest`."""
    doc = _opened(data, where)
    if "groups" not in doc:
        return _validated(doc, where, run, step, None)
    doc = _shallow(doc, where, run, step)
    check_entries(list(enumerate(doc["entries"])), doc["packs"], where, schema=False)
    try:
        created = datetime.fromisoformat(doc["created"].replace("Z", "+00:00"))
    except ValueError:
        created = None
    if created is None or created.utcoffset() is None:
        raise CorruptManifestError(f"manifest {where}: created time {doc['created'][:40]!r} is not an ISO-8601 time "
                                   "with a timezone")
    return doc


def parse_manifest_shallow(data: bytes, where: str, run: str | None = None, step: int | None = None, *,
                           tree: bool = False) -> dict[str, Any]:
    """A manifest as gc, du and ``verify --structure`` read many of them: sealed (any damage to the file is found),
    every member validated by the schema (the tree only with ``tree``), its inline entries and the rows of its entry
    groups included, but the groups (§8.5) not read: ``entries`` holds the inline entries only, and the caller reads each distinct group once
    (:class:`luopan.format.groups.GroupMemo`). Never for loading: the entries are incomplete. CorruptManifestError
    as :func:`parse_manifest`."""
    return _shallow(_opened(data, where), where, run, step, tree)


def _shallow(doc: dict[str, Any], where: str, run: str | None, step: int | None, tree: bool = False
             ) -> dict[str, Any]:
    """The checks of a shallow read; the tree (as large as the state's structure, and no listing or marking needs
    it) only with ``tree``."""
    if "groups" in doc and (not isinstance(doc.get("format_version"), int)
                            or doc["format_version"] < GROUPS_FORMAT_VERSION):
        raise CorruptManifestError(f"manifest {where} has entry groups, which its format_version "
                                   f"{str(doc.get('format_version'))[:20]!r} lacks (they need 6)")
    schema_check(doc if tree else {**doc, "tree": {"dict": []}}, where)
    npacks = len(doc["packs"])
    for r in manifest_rows(doc):
        if r.pack >= npacks:
            raise CorruptManifestError(f"manifest {where}: a chunk row names pack {r.pack} of {npacks}")
    if run is not None and (doc["run"], doc["step"]) != (run, step):
        raise CorruptManifestError(
            f"manifest {where} names run {doc['run']!r} step {doc['step']}, not its location's {run!r} step {step}")
    return doc


def check_tree(doc: dict[str, Any], where: str) -> None:
    """A shallow-read manifest's tree, as the schema checks it (its nodes; what a load reads of it)."""
    schema_check({**doc, "entries": [], "groups": []}, where)


_STATS = ("logical_bytes", "chunks", "new_chunks", "new_bytes", "stored_bytes", "new_packs")


def check_entries(members: list[tuple[int, dict[str, Any]]], packs: list[str], where: str,
                  schema: bool = True) -> None:
    """What a load checks of entries, on some entries alone (an entry group's, once per group; a shallow manifest's
    inline ones): the schema (unless ``schema`` is False: the caller validated them) and the consistency checks of
    §8, rows naming ``packs`` by index. Aliases are left to the whole manifest (they name its other entries), and so
    are the checks that need its format_version. CorruptManifestError naming ``where``."""
    doc = {"format_version": SEGMENTS_FORMAT_VERSION, "run": "r", "step": 0, "created": "2000-01-01T00:00:00+00:00",
           "entries": [e for _i, e in members if "alias_of" not in e], "packs": list(packs), "tree": {"dict": []},
           "fingerprint": "blake3:" + "0" * 64, "metrics": {}, "metadata": {}, "environment": {},
           "stats": dict.fromkeys(_STATS, 0)}
    if schema:
        schema_check(doc, where, "an entry")
    _check_consistency(doc, where)
