"""Lineage links (docs/format.md §9.4): an input named for a manifest after it was committed (``luopan lineage link
RUN@STEP NAME@V``), recorded beside it — a manifest's content is never rewritten.

A link is one small sealed file per (manifest, input), at ``refs/links/<marker><series>/<number:08d>/<id>.json``
(``id``: 32 hex digits of BLAKE3 of the input reference), written create-only: adding the same link again changes
nothing. It names the manifest's ``created`` time, so a link outlives neither its manifest nor a later manifest saved
under the same number after a removal: such a link is ignored by readers and deleted by the next ``gc``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from blake3 import blake3

from ..errors import CorruptRepoError, IntegrityError, LuopanError, ManifestNotFoundError, StorageError, UsageError
from ..format import BASE_FORMAT_VERSION
from ..format.canonical import seal, unseal_file
from ..format.limits import MAX_SMALL_BYTES
from ..format.names import check_step
from ..store.base import KeyNotFound, Store
from .kinds import Kind, Opened
from .locks import locked
from .pins import require_members

LINKS = "refs/links/"


def link_prefix(kind: Kind, series: str, number: int) -> str:
    """The directory of the links of one manifest."""
    return f"{LINKS}{kind.marker}{series}/{number:08d}/"


def link_key(kind: Kind, series: str, number: int, input_ref: str) -> str:
    return link_prefix(kind, series, number) + blake3(input_ref.encode()).hexdigest()[:32] + ".json"


def parse_link(data: bytes, where: str) -> dict[str, Any]:
    """A link file (docs/format.md §9.4), checked: CorruptRepoError naming ``where`` on any damage."""
    doc = unseal_file(data, where)
    require_members(doc, where, kind=(str,), ref=(str,), input=(str,), of=(str,), created=(str,))
    return doc


def _created(repo: Opened, kind: Kind, series: str, number: int) -> str:
    return str(repo.read_manifest(kind, series, number).get("created", ""))


def add_links(repo: Opened, kind: Kind, series: str, number: int, inputs: Iterable[str]) -> list[str]:
    """Record each of ``inputs`` ("NAME@V") as an input of ``number`` of ``series``; returns the inputs newly linked
    (one already in the manifest's own inputs or linked before is left as it is). Every input must name a committed
    manifest (ManifestNotFoundError otherwise, nothing written), and so must the target. Each link is one create-only
    put: an interrupted call leaves some links whole and the rest absent; run it again to finish."""
    number = check_step(number)
    if isinstance(inputs, str):
        raise UsageError(f"inputs is a list of 'NAME@V' references, not the string {inputs!r}: pass [{inputs!r}]")
    target = kind.ref(series, number)
    if not repo.store.exists(kind.manifest_key(series, number)):
        raise ManifestNotFoundError(f"{kind.label(series, number)} does not exist, so no input can be linked to it "
                                    f"(see `luopan ls {series}`)")
    wanted: list[str] = []
    for text in inputs:
        if not isinstance(text, str):
            raise UsageError(f"an input is a 'NAME@V' reference string, not {type(text).__name__}")
        k, s, n = repo.resolve(text, "input")  # InvalidNameError / ManifestNotFoundError naming what exists
        ref = k.ref(s, n)
        if (k.name, s, n) == (kind.name, series, number):
            raise UsageError(f"{target} cannot be an input of itself")
        if ref not in wanted:
            wanted.append(ref)
    doc = repo.read_manifest(kind, series, number)
    have = set(kind.inputs(doc)) | set(linked_inputs(repo, kind, series, number, doc))
    created = str(doc.get("created", ""))
    added = []
    # Shared lock: a removal (exclusive) finishes first; then the manifest must still be the one we read.
    with locked(repo.store, "shared", f"lineage link to {target}", timeout=repo.lock_timeout):
        if _created(repo, kind, series, number) != created:
            raise ManifestNotFoundError(f"{kind.label(series, number)} was removed or replaced meanwhile; nothing "
                                        "linked (run the command again)")
        for ref in wanted:
            if ref in have:
                continue
            link = {"format_version": BASE_FORMAT_VERSION, "kind": kind.name, "ref": target, "input": ref,
                    "of": created, "created": datetime.now(timezone.utc).isoformat()}
            if repo.store.put_if_absent(link_key(kind, series, number, ref), seal(link)):
                added.append(ref)
    return added


def linked_inputs(repo: Opened, kind: Kind, series: str, number: int, doc: dict[str, Any] | None = None) -> list[str]:
    """The inputs linked to ``number`` of ``series`` (oldest link first), for the manifest ``doc`` (read when not
    given): links made for an earlier manifest of that number are ignored. A damaged link file is skipped (``luopan
    verify`` and ``gc`` name and remove nothing of it; `lineage` shows what can be read)."""
    if doc is None:
        doc = repo.read_manifest(kind, series, number)
    return [d["input"] for d in _read(repo.store, link_prefix(kind, series, number))
            if d["of"] == doc.get("created", "") and d["kind"] == kind.name and d["ref"] == kind.ref(series, number)]


def _read(store: Store, prefix: str) -> list[dict[str, Any]]:
    out = []
    for key in store.list(prefix):
        if not key.endswith(".json") or key.count("/") != prefix.count("/"):
            continue
        try:
            doc = parse_link(store.get_limited(key, MAX_SMALL_BYTES), key)
        except (KeyNotFound, IntegrityError, StorageError):
            continue
        if key.endswith(link_key_tail(doc["input"])):
            out.append(doc)
    return sorted(out, key=lambda d: (d["created"], d["input"]))


def link_key_tail(input_ref: str) -> str:
    return "/" + blake3(input_ref.encode()).hexdigest()[:32] + ".json"


def all_links(repo: Opened) -> dict[tuple[str, str, int], list[tuple[str, str]]]:
    """(kind name, series, number) -> [(of, input)] of every readable link in the repository (one listing)."""
    out: dict[tuple[str, str, int], list[tuple[str, str]]] = {}
    by_name = {k.name: k for k in repo.kinds}
    for key in repo.store.list(LINKS):
        try:
            doc = parse_link(repo.store.get_limited(key, MAX_SMALL_BYTES), key)
        except (KeyNotFound, IntegrityError, StorageError):
            continue
        kind = by_name.get(doc["kind"])
        series, _, num = doc["ref"].rpartition("@")
        if kind is None or not num.isdigit() or key != link_key(kind, series, int(num), doc["input"]):
            continue  # a file that is not where its content says: not a link
        out.setdefault((kind.name, series, int(num)), []).append((doc["of"], doc["input"]))
    return out


def stale_links(repo: Opened) -> list[str]:
    """Keys of link files whose manifest is gone or was replaced (another ``created``), and of damaged ones: what
    ``gc`` deletes. A manifest that cannot be read keeps its links (``verify`` names it)."""
    by_name = {k.name: k for k in repo.kinds}
    stale = []
    created: dict[tuple[str, str, int], str | None] = {}
    for key in repo.store.list(LINKS):
        try:
            doc = parse_link(repo.store.get_limited(key, MAX_SMALL_BYTES), key)
        except KeyNotFound:
            continue
        except StorageError:
            continue  # unreadable now (permissions, a remote error): not known to be stale
        except (CorruptRepoError, IntegrityError, LuopanError):
            stale.append(key)
            continue
        kind = by_name.get(doc["kind"])
        series, _, num = doc["ref"].rpartition("@")
        if kind is None or not num.isdigit():
            stale.append(key)
            continue
        at = (kind.name, series, int(num))
        if at not in created:
            try:
                created[at] = _created(repo, kind, series, int(num))
            except KeyNotFound:
                created[at] = ""
            except (LuopanError, OSError):
                created[at] = None
            except (KeyError, ValueError):
                created[at] = ""
        if created[at] is not None and created[at] != doc["of"]:
            stale.append(key)
    return stale
