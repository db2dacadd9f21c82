"""Space preflight (docs/format.md §10.4): refuse a write, before anything is written, when the store has less free
space than a margin times the bytes it is expected to write; say what gc and prune would free."""

from __future__ import annotations

import math

from ..errors import InsufficientSpaceError, LuopanError
from ..format.names import is_pack_key
from ..store.base import KeyNotFound
from ..units import format_bytes
from .marking import all_manifests
from .kinds import Opened
from .pins import read_pins

DEFAULT_SPACE_MARGIN = 1.5
OVERHEAD = 64 << 10  # manifest, index file, ref


def reclaimable(repo: Opened) -> tuple[int, int]:
    """(bytes gc would free now, bytes pruning every manifest but the newest and pinned ones of each series would free
    on top), at pack granularity, without changing anything (no lock: an estimate for error messages)."""
    store = repo.store
    manifests = all_manifests(store, repo.kinds)
    newest: dict[tuple[str, str], int] = {}
    for m in manifests:
        newest[(m.kind.name, m.series)] = max(newest.get((m.kind.name, m.series), -1), m.number)
    pinned = {(m.kind.name, m.series, n) for m in manifests for n in read_pins(store, m.kind, m.series)}
    live_all: set[str] = set()
    live_min: set[str] = set()
    for m in manifests:
        packs = set(m.doc["packs"])
        live_all |= packs
        if m.number == newest[(m.kind.name, m.series)] or (m.kind.name, m.series, m.number) in pinned:
            live_min |= packs
    gc_bytes = prune_bytes = 0
    for key in store.list("packs/"):
        if not is_pack_key(key):
            continue
        try:
            size = store.size(key)
        except KeyNotFound:
            continue
        pack = key.rsplit("/", 1)[-1][:-5]
        if pack not in live_all:
            gc_bytes += size
        elif pack not in live_min:
            prune_bytes += size
    return gc_bytes, prune_bytes


def fits(repo: Opened, margin: float, estimate: int) -> bool:
    """Whether ``estimate`` bytes (plus overhead) fit ``margin`` times over (True when the store cannot tell)."""
    if not margin:
        return True
    free = repo.store.free_bytes()
    return free is None or free >= (estimate + OVERHEAD) * margin


def freeing_hints(gc_frees: int | None, prune_frees: int | None, where: str) -> list[str]:
    """What ``gc`` and ``prune`` would free (from ``reclaimable``), as sentences naming the commands; empty when
    neither would free anything or it is not known. Shared by the save preflight and ``luopan doctor``."""
    hints = []
    if gc_frees:
        hints.append(f"`luopan gc --grace 0 -r {where}` would free {format_bytes(gc_frees)} now")
    if prune_frees:
        hints.append(f"pruning every checkpoint except the newest (and pinned) of each run, then gc, would free up "
                     f"to {format_bytes(prune_frees)} more (`luopan prune RUN --keep-last N`)")
    return hints


def refuse(repo: Opened, margin: float, estimate: int, what: str) -> None:
    """Raise InsufficientSpaceError for ``what`` (e.g. "save run 'a' step 3") unless ``estimate`` bytes fit."""
    if fits(repo, margin, estimate):
        return
    free = repo.store.free_bytes() or 0
    estimate += OVERHEAD
    needed = math.ceil(estimate * margin)
    where = repo.store.describe()
    try:
        gc_frees, prune_frees = reclaimable(repo)
    except LuopanError:
        gc_frees = prune_frees = None
    help_text = freeing_hints(gc_frees, prune_frees, where) or [
        "gc and prune would free nothing here: free space elsewhere on that disk"]
    err = InsufficientSpaceError(
        28, f"not enough free space to {what}: about {format_bytes(estimate)} to write, needing "
        f"{format_bytes(needed)} with the {margin:g}x margin, but only {format_bytes(free)} is free on {where}; nothing "
        "was written. " + "; ".join(help_text)
        + ". (Lower the margin with luopan.open(..., space_margin=1.0), or 0 to turn the check off.)")
    err.needed, err.free, err.estimate, err.gc_frees, err.prune_frees = needed, free, estimate, gc_frees, prune_frees
    raise err
