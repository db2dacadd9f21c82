"""Pins (docs/format.md §9.1): a pinned manifest of any kind is never removed by prune, retention or eviction.

A pin is a small sealed file at ``kind.pin_key(series, number)`` holding ``{"run": series, "step": number, "tag",
"created"}`` (the field names are the checkpoint kind's; for an artifact ``run`` is its name, ``step`` its version).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Protocol

from ..errors import CorruptRepoError, StorageError, UnreadableError
from ..format import BASE_FORMAT_VERSION
from ..format.canonical import seal, unseal_file
from ..format.limits import MAX_SMALL_BYTES
from ..format.names import MAX_STEP, check_step, check_tag
from ..store.base import KeyNotFound, Store
from .kinds import Kind, TierLike
from .locks import locked


class Pinner(Protocol):
    """What pinning needs of an open repository."""

    store: Store
    lock_timeout: float | None
    tier: TierLike | None


def require_members(doc: dict[str, Any], where: str, **fields: Any) -> None:
    """CorruptRepoError unless each named member has the given type (a tuple of types; int excludes bool)."""
    for name, types in fields.items():
        value = doc.get(name)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise CorruptRepoError(f"{where} is damaged: member {name!r} is missing or of the wrong type")


def check_step_field(doc: dict[str, Any], where: str, step: int | None) -> None:
    value = doc.get("step")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP or \
            (step is not None and value != step):
        raise CorruptRepoError(f"{where} is damaged: it names step {value!r}" + (f", not {step}" if step is not None
                                                                                 else ""))


def parse_pin(data: bytes, where: str, run: str | None = None, step: int | None = None) -> dict[str, Any]:
    """A pin (docs/format.md §9.1), checked."""
    doc = unseal_file(data, where)
    require_members(doc, where, run=(str,), created=(str,), tag=(str, type(None)))
    check_step_field(doc, where, step)
    if run is not None and doc["run"] != run:
        raise CorruptRepoError(f"{where} is damaged: it pins {doc['run']!r}, not {run!r}")
    return doc


def pin_prefix(kind: Kind, series: str) -> str:
    return kind.pin_key(series, 0).rsplit("/", 1)[0] + "/"


def numbered_files(store: Store, prefix: str) -> list[tuple[str, int]]:
    """(key, number) of the ``<number:08d>.json`` files directly under ``prefix`` (other names are not luopan's)."""
    out = []
    for key in store.list(prefix):
        stem = key[len(prefix):].removesuffix(".json")
        if key.endswith(".json") and stem.isascii() and stem.isdigit() and len(stem) == 8:
            out.append((key, int(stem)))
    return sorted(out, key=lambda kv: kv[1])


def read_pins(store: Store, kind: Kind, series: str) -> dict[int, dict[str, Any]]:
    """number -> {"tag", "created"} of every pinned manifest of a series. A pin that cannot be read raises
    (CorruptRepoError, StorageError): prune must never proceed without knowing every pin."""
    prefix = pin_prefix(kind, series)
    for stray in store.strays(prefix):
        if stray.unreadable:
            raise StorageError(5, f"the pins of {kind.series_noun} {series!r} cannot all be read ({stray}): restore "
                                  "access to them before pruning")
    out = {}
    for key, number in numbered_files(store, prefix):
        try:
            doc = parse_pin(store.get_limited(key, MAX_SMALL_BYTES), key, series, number)
        except KeyNotFound:
            continue
        out[number] = {"tag": doc.get("tag"), "created": doc.get("created")}
    return dict(sorted(out.items()))


def add_pin(repo: Pinner, kind: Kind, series: str, number: int, tag: str | None,
            missing: type[Exception]) -> None:
    """Pin ``number`` of ``series`` (``missing`` is the error raised when it does not exist)."""
    number = check_step(number)
    if tag is not None:
        check_tag(tag)
    key = kind.manifest_key(series, number)
    if not repo.store.exists(key):
        raise missing(f"{kind.series_noun} {series!r} has no {kind.name} at {kind.number_noun} {number} to pin")
    doc = {"format_version": BASE_FORMAT_VERSION, "run": series, "step": number, "tag": tag,
           "created": datetime.now(timezone.utc).isoformat()}
    # Shared lock: a prune in progress finishes first (it read the pins), then the manifest must still exist.
    with locked(repo.store, "shared", f"pin of {kind.label(series, number)}", timeout=repo.lock_timeout):
        if not repo.store.exists(key):
            raise missing(f"{kind.label(series, number)} was pruned before it could be pinned")
        repo.store.put(kind.pin_key(series, number), seal(doc))
    if repo.tier is not None:  # a tiered repository: the remote copy gets the pin too
        repo.tier.pinned(kind, series, number, seal(doc))


def remove_pin(store: Store, kind: Kind, series: str, number: int) -> bool:
    """Remove the pin of ``number``; returns whether there was one."""
    key = kind.pin_key(series, check_step(number))
    if not store.exists(key):
        return False
    store.delete(key)
    return True


def pin_problems(store: Store, kind: Kind, series: str) -> list[Exception]:
    """Every damaged or unreadable pin of a series (for ``verify``)."""
    prefix = pin_prefix(kind, series)
    found: list[Exception] = []
    for key, number in numbered_files(store, prefix):
        try:
            parse_pin(store.get_limited(key, MAX_SMALL_BYTES), key, series, number)
        except KeyNotFound:
            continue
        except StorageError as exc:
            found.append(UnreadableError(str(exc)))
        except CorruptRepoError as exc:
            found.append(exc)
    for stray in store.strays(prefix):
        if stray.unreadable:
            found.append(UnreadableError(f"cannot read the pins of {kind.series_noun} {series!r}: {stray}"))
    return found
