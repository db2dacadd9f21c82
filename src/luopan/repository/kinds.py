"""What the core knows of a kind: where its manifests live, how to read them, and which chunks they need.

Every kind stores *series* of numbered manifests: a checkpoint run is a series of steps, an artifact a series of
versions. The core (catalog, gc, verify, du, pins, retention, tiering) works on ``(series, number)`` pairs and
manifest bytes through a ``Kind``; only the kind knows what its manifests mean. Every kind's manifest is a sealed JSON
object with ``packs`` (pack ids) and ``entries`` whose ``chunks`` rows (and a row delta's ``index``/``values``) are
chunk rows of docs/format.md §8: that contract is what gc marks from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from ..format.config import RepoConfig
from ..format.manifest import manifest_rows
from ..format.names import step_from_manifest_key
from ..store.base import KeyNotFound, Store, Stray


@dataclass
class Catalog:
    """Committed numbers by series (ascending), and the strays found on the way (when asked for)."""

    steps: dict[str, list[int]] = field(default_factory=dict)
    strays: list[Stray] = field(default_factory=list)
    # Manifest-named files under stray series directories (``runs/a copy/ckpt/00000100.json``): not committed, but
    # whoever copied or renamed that directory may want it back, so gc keeps what they reference (strays only).
    shadows: list[str] = field(default_factory=list)

    @property
    def runs(self) -> list[str]:
        """The series (runs, artifact names) with at least one committed manifest, sorted."""
        return sorted(self.steps)

    @property
    def incomplete(self) -> list[Stray]:
        """Strays that may hide manifests (a dangling link, a directory that cannot be read): a walk that found
        any did not see the whole repository."""
        return [s for s in self.strays if s.unreadable]

    def pairs(self) -> list[tuple[str, int]]:
        return [(series, n) for series in self.runs for n in self.steps[series]]


@dataclass(frozen=True)
class Kind:
    """One kind of manifest, as the core sees it (docs/format.md §2a)."""

    name: str  # "checkpoint", "artifact": the manifest's kind in messages and tier markers
    root: str  # the top-level key prefix of its manifests ("runs/", "artifacts/")
    series_noun: str  # "run", "artifact"
    number_noun: str  # "step", "version"
    manifest_key: Callable[[str, int], str]
    # (store, series or None, strays) -> Catalog: the one walk that finds committed manifests of this kind
    scan: Callable[[Store, str | None, bool], Catalog]
    # (data, key, series, number, store) -> parsed manifest document (sealed, validated; raises IntegrityError
    # kinds). ``store`` (optional) is where the manifest lives: a grouped checkpoint manifest (§8.5) reads its entry
    # groups from there; without it such a manifest is refused.
    parse: Callable[..., dict[str, Any]]
    pin_key: Callable[[str, int], str]
    check_series: Callable[[str], str]  # raises InvalidNameError for a bad series name
    # Other small files replicated with a manifest, before it: (key, size cap) (a run's record, the pin)
    companions: Callable[[str, int], list[tuple[str, int]]] = lambda _s, _n: []
    # Called after gc rewrote a manifest in place (a repack moved its chunks): refresh what names its bytes
    rewritten: Callable[[Store, str, int, bytes], None] | None = None
    marker: str = ""  # tier markers: tier/<state>/<marker><series>/<number>.json ("" for checkpoints)
    # The "NAME@N" references a manifest names as what it was made from (lineage, docs/format.md §8.2)
    inputs: Callable[[dict[str, Any]], list[str]] = lambda doc: list(doc.get("inputs", []))
    # (store, series) -> numbers retention must keep besides pins and the newest (an index's live version, §17)
    protected: Callable[[Store, str], set[int]] = lambda _store, _series: set()
    plural: str = ""  # "indexes"; default name + "s" (du's counts)
    # (data, key, series, number) -> the document without reading what it stores apart (a checkpoint manifest's
    # entry groups, §8.5: its ``entries`` are then the inline ones; format.groups.GroupMemo reads the groups once
    # each): how gc marks many manifests. None: ``parse`` (the kind stores nothing apart).
    shallow: Callable[..., dict[str, Any]] | None = None
    # What one manifest is called in listings ("checkpoint", "version", "snapshot"); default: the kind's name
    manifest_noun: str = ""
    # (store) -> series -> bytes it keeps outside its manifests (a journal's or an index's log, §16.1, §17.5): a
    # series with a log and no manifest yet (a journal never compacted) is listed too. None: the kind has no logs.
    logs: Callable[[Store], dict[str, int]] | None = None

    @property
    def count_key(self) -> str:
        """du's key for how many manifests of this kind there are ("checkpoints", "artifacts", "indexes")."""
        return self.plural or f"{self.name}s"

    @property
    def noun(self) -> str:
        """What one manifest of this kind is called in listings."""
        return self.manifest_noun or self.name

    def label(self, series: str, number: int) -> str:
        return f"{self.series_noun} {series!r} {self.number_noun} {number}"

    def ref(self, series: str, number: int) -> str:
        return f"{series}@{number}"


def scan_numbered(store: Store, root: str, name: str | None, strays: bool, *, is_series: Callable[[str], bool],
                  what: str, first: int = 1, own: Callable[[list[str]], bool] = lambda _parts: False) -> Catalog:
    """The catalog of a kind whose manifests are ``<root><series>/_v/<number:08d>.json`` (artifacts, journals,
    indexes): committed numbers (>= ``first``) by series, or of one ``name`` (already checked). With ``strays``, what
    else lies under ``root`` (or the name's directory) — except keys ``own(parts)`` claims for the kind (a log
    directory) — is listed as a stray (``what`` says what was expected), and manifest-named files under invalid
    series names are kept as shadows for gc."""
    prefix = root if name is None else f"{root}{name}/"
    cat = Catalog()
    if strays:
        keys, found = store.list_with_strays(prefix)
    else:
        keys, found = list(store.list(prefix)), []
    for key in keys:
        parts = key.split("/")
        number = step_from_manifest_key(key) if len(parts) >= 4 and parts[-2] == "_v" else None
        numbered = number is not None and number >= first
        series = "/".join(parts[1:-2])
        if numbered and is_series(series):
            if name is None or series == name:  # else a deeper series under this name's directory
                cat.steps.setdefault(series, []).append(number)
            continue
        if not strays or own(parts):
            continue
        if numbered:
            cat.shadows.append(key)  # a manifest under an invalid name: kept by gc, never listed
        cat.strays.append(Stray(key, f"not {what}"))
    for numbers in cat.steps.values():
        numbers.sort()
    if strays:
        cat.strays.extend(s for s in found if not own(s.key.split("/")))
        cat.strays.sort(key=lambda s: s.key)
    return cat


def log_sizes(store: Store, root: str, series_of: Callable[[list[str]], str | None]) -> dict[str, int]:
    """series -> bytes of the files under ``root`` that ``series_of(key parts)`` says are that series' log."""
    out: dict[str, int] = {}
    for key in store.list(root):
        series = series_of(key.split("/"))
        if series is None:
            continue
        try:
            out[series] = out.get(series, 0) + store.size(key)
        except (KeyNotFound, OSError):
            continue  # gone since the listing (a compaction), or unreadable: `verify` names what matters
    return out


def rows_by_pack(doc: dict[str, Any]) -> dict[str, dict[str, tuple[int, int, int, str]]]:
    """pack id -> chunk hash -> (offset, length, size, codec) of every chunk row a manifest document names."""
    packs = doc["packs"]
    out: dict[str, dict[str, tuple[int, int, int, str]]] = {}
    for r in manifest_rows(doc):  # entries' rows and entry groups' (§8.5)
        out.setdefault(packs[r.pack], {})[r.hash] = (r.offset, r.length, r.size, r.codec)
    return out


def all_series(store: Store, kinds: tuple[Kind, ...], *, strays: bool = False) -> Iterator[tuple[Kind, Catalog]]:
    for kind in kinds:
        yield kind, kind.scan(store, None, strays)


class TierLike(Protocol):
    """What the core and the kinds know of a repository's tiering (``repo.tier``, tier.Tier, docs/format.md §10.2): a
    commit listener. Kinds tell it of each commit and hold ``saving()`` while they write; pins tell it of a pin; gc
    collects its ``local`` tier; the repository waits on it, applies its cold policy and closes it."""

    local: Store  # the local tier: the repository's own directory

    def saving(self) -> AbstractContextManager[None]:
        """Held while a save writes (replication starts no new upload meanwhile)."""

    def committed(self, kind: Kind, series: str, number: int) -> None:
        """``number`` of ``series`` was committed (or replaced) locally: replicate it."""

    def pinned(self, kind: Kind, series: str, number: int, data: bytes) -> None:
        """A pin (sealed ``data``) was added locally."""

    def status(self, kind: Kind, series: str) -> dict[int, str]:
        """number -> "local", "replicating", "replicated", "remote" or "cold"."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued manifest is replicated (True) or ``timeout`` seconds pass (False)."""

    def apply_cold_policy(self, now: datetime | None = None, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Move manifests older than the cold policy's threshold to the cold store; the (series, number) moved."""

    def close(self) -> None:
        """Stop replication after the pack in progress; what is left stays pending for the next open."""


class Opened(Protocol):
    """What the core's operations (gc, pins, preflight, tiering) need of an open repository."""

    store: Store
    config: RepoConfig
    lock_timeout: float | None
    tier: TierLike | None
    kinds: tuple[Kind, ...]

    def drain(self) -> None:
        """Wait for work of this process in flight (a background save) before the repository changes under it."""

    def read_manifest(self, kind: Kind, series: str, number: int) -> dict[str, Any]:
        """The parsed, verified manifest document of ``number`` of ``series``."""

    def resolve(self, text: str, what: str = "input") -> tuple[Kind, str, int]:
        """'NAME@N' -> (kind, series, number) of a committed manifest."""
