"""The open repository as the core knows it: store, config, the chunk index saves deduplicate against, locks'
timeout, the space margin, tiering, gc and du over every kind (docs/format.md §2a). Kinds add their verbs by
subclassing ``RepositoryCore`` (luopan.checkpoint.api.Checkpoints, luopan.artifact.api.Artifacts)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .._compat import deprecated_alias
from ..errors import (
    IntegrityError,
    InvalidNameError,
    LuopanError,
    ManifestNotFoundError,
    StorageError,
    UnsupportedFormatError,
)
from ..format.config import RepoConfig
from ..format.index import parse_index
from ..format.limits import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from ..format.names import CONFIG_KEY, is_index_key, parse_ref_text
from ..format.pack import BlobLocation
from ..store.base import KeyNotFound, Store
from .gc import DEFAULT_GRACE, DEFAULT_REPACK_BELOW, collect
from .gcreport import GcReport
from .kinds import Kind, TierLike
from .kinds import TierLike as Tier  # _tiered()'s annotation: the protocol too (no import of tier.py)
from .lineage import Lineage, lineage
from .locks import DEFAULT_TIMEOUT
from .preflight import DEFAULT_SPACE_MARGIN


class RepositoryCore:
    """A luopan repository, kind-agnostic part. Not safe for concurrent writes from several threads of one process."""

    kinds: tuple[Kind, ...] = ()  # set by the class that combines the kinds (luopan.repo.Repo)

    def __init__(self, store: Store, config: RepoConfig) -> None:
        self.store = store
        self.config = config
        self.lock_timeout: float | None = DEFAULT_TIMEOUT  # how long a write waits for prune/gc (None: forever)
        self.space_margin: float = DEFAULT_SPACE_MARGIN  # preflight: free space needed / estimated bytes (0: off)
        self.tier: TierLike | None = None  # the tiering of a tiered repository (docs/format.md §10.2)
        self._known: dict[str, BlobLocation] | None = None
        self._indexes_seen: set[str] = set()
        self._intact_packs: dict[str, tuple[int, ...]] = {}  # pack id -> store signature when its trailer checked

    def __repr__(self) -> str:
        return f"luopan.Repo({self.store.describe()!r})"

    def __enter__(self) -> RepositoryCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def where(self) -> str:
        return self.store.describe()

    def drain(self) -> None:
        """Wait for work of this process in flight (a kind's background save); raise its unseen error."""

    def _release(self) -> None:
        """Free what the kinds hold (background threads, buffers) once nothing is in flight."""

    def close(self) -> None:
        """Wait for work in flight (raising its error if nobody saw it) and stop background threads."""
        try:
            self.drain()
        finally:
            self._release()
            if self.tier is not None:  # stops after the pack in progress; the rest stays pending for the next open
                self.tier.close()

    # -- the chunk index (docs/format.md §7) -----------------------------------------------------------------------
    def chunk_index(self) -> dict[str, BlobLocation]:
        """Chunk hash → location from all index files (refreshed with index files new since the last call)."""
        keys = [k for k in self.store.list("index/") if is_index_key(k)]
        if self._known is None or not self._indexes_seen.issubset(keys):
            # First use, or gc consolidated/removed index files (and maybe moved or deleted packs): forget every
            # location this process remembers, so no write references a chunk where it no longer is.
            self._known = {}
            self._indexes_seen = set()
            self._intact_packs.clear()
        for key in keys:
            if key in self._indexes_seen:
                continue
            try:
                self._known.update(parse_index(self.store.get_limited(key, MAX_INDEX_BYTES), key))
            except KeyNotFound:
                continue
            except (IntegrityError, StorageError) as exc:  # only deduplication is lost: writes store those chunks
                warnings.warn(f"{exc}; skipping it", stacklevel=3)
            self._indexes_seen.add(key)
        return self._known

    def learned(self, locations: dict[str, BlobLocation], index_key: str | None) -> None:
        """Remember the chunks a write of this process just stored (and the index file naming them)."""
        self.chunk_index().update(locations)
        if index_key is not None:
            self._indexes_seen.add(index_key)  # already known; re-reading it would undo verify's drops

    def forget_damaged(self, problems: list[LuopanError]) -> None:
        """Never deduplicate against a chunk verify found damaged: the next write stores it again."""
        self._intact_packs.clear()
        if self._known is None:
            return
        for p in problems:
            ref = getattr(p, "chunk", None)
            loc = self._known.get(ref.hash) if ref is not None else None
            if loc is not None and (loc.pack, loc.offset) == (ref.pack, ref.offset):
                del self._known[ref.hash]

    def require_format(self, version: int) -> None:
        """Raise the config's format_version to ``version`` (docs/format.md §1): a kind whose manifests an older luopan
        would not see (its gc would collect their chunks) first makes older luopan refuse the repository."""
        if self.config.format_version >= version:
            return
        config = dataclasses.replace(self.config, format_version=version)
        self.store.put(CONFIG_KEY, config.to_bytes())
        self.config = config

    # -- references across kinds ---------------------------------------------------------------------------------
    def resolve(self, text: str, what: str = "input") -> tuple[Kind, str, int]:
        """'NAME@N' -> (kind, series, number) of a committed manifest (artifact versions first, then checkpoints).
        InvalidNameError for a malformed one, FileNotFoundError-based errors for one that does not exist."""
        name, number = parse_ref_text(text, what)
        valid = False
        for kind in self.kinds:
            try:
                kind.check_series(name)
            except InvalidNameError:
                continue
            valid = True
            if self.store.exists(kind.manifest_key(name, number)):
                return kind, name, number
        if not valid:
            raise InvalidNameError(f"invalid {what} {text!r}: {name!r} is neither an artifact nor a run name")
        raise ManifestNotFoundError(f"{what} {text!r} does not exist: no artifact version or checkpoint has that "
                                    "name and number (see `luopan artifact ls` and `luopan ls`)")

    def lineage(self, ref: str) -> Lineage:
        """What ``ref`` ("datasets/train@2", "run-a@100") was made from, up the graph, and what names it (checkpoints
        saved with ``inputs=[ref]``, artifact versions committed with ``parents=[ref]``)."""
        return lineage(self, ref)

    def read_manifest(self, kind: Kind, series: str, number: int) -> dict[str, Any]:
        key = kind.manifest_key(series, number)
        return kind.parse(self.store.get_limited(key, MAX_MANIFEST_BYTES), key, series, number, self.store)

    # -- maintenance ----------------------------------------------------------------------------------------------
    def gc(self, *, grace: float | None = None, repack_below: float | None = None, dry_run: bool = False,
           log: Callable[[str], Any] | None = None, progress: Callable[[str], Any] | None = None) -> GcReport:
        """Delete packs no manifest of any kind needs and repack mostly-dead ones (docs/format.md §10.3).

        Two-phase: unreferenced packs are first condemned, and deleted by a gc run at least ``grace`` seconds
        (default 1 h) later if still unreferenced; ``grace=0`` condemns and deletes in one run (use it when nothing
        else reads the repository). Packs whose live blobs fill less than ``repack_below`` (default 0.5) are
        rewritten. Takes the exclusive lock (writes wait). A tiered repository collects its local tier. ``log(msg)``
        is called with a line as each phase starts (``progress=`` is its old name: every other ``progress`` callback
        of luopan takes a number of bytes done). Returns a GcReport.
        """
        log = deprecated_alias(log, progress, "log", "progress")
        return collect(self, grace=DEFAULT_GRACE if grace is None else grace,
                       repack_below=DEFAULT_REPACK_BELOW if repack_below is None else repack_below,
                       dry_run=dry_run, log=log)

    def du(self) -> dict[str, int]:
        """Logical bytes over every manifest of every kind vs physical bytes in the store (``checkpoints``,
        ``artifacts``: how many of each; ``damaged_manifests``: ones that could not be read)."""
        out: dict[str, int] = {k.count_key: 0 for k in self.kinds}
        logical = damaged = 0
        for kind in self.kinds:
            for series, number in kind.scan(self.store, None, False).pairs():
                try:
                    logical += self.read_manifest(kind, series, number)["stats"]["logical_bytes"]
                except (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound):
                    damaged += 1  # counted, not fatal: `verify` names it
                    continue
                out[kind.count_key] += 1
        sizes = {"packs": 0, "index": 0, "refs": 0, **{k.root.rstrip("/"): 0 for k in self.kinds}}
        for top in sizes:
            for key in self.store.list(top + "/"):
                try:
                    sizes[top] += self.store.size(key)
                except (KeyNotFound, StorageError):
                    pass
        manifests = sum(sizes[k.root.rstrip("/")] for k in self.kinds)
        out.update({"damaged_manifests": damaged, "logical_bytes": logical, "physical_bytes": sum(sizes.values()),
                    "pack_bytes": sizes["packs"], "index_bytes": sizes["index"], "manifest_bytes": manifests,
                    "ref_bytes": sizes["refs"]})
        return out

    # -- tiered storage (docs/format.md §10.2) -------------------------------------------------------------------
    def _tiered(self) -> Tier:
        if self.tier is None:
            raise LuopanError(f"{self.where} is not a tiered repository: open it with replicate_to=URL")
        return self.tier

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Block until every manifest queued for replication is confirmed on the remote (True), or ``timeout``
        seconds pass (False). ReplicationError names the ones that cannot be replicated."""
        return self._tiered().wait(timeout)

    def apply_cold_policy(self, now: datetime | None = None, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Move manifests older than the cold policy's threshold (not pinned, already replicated) to the cold
        store; returns the (series, number) moved."""
        return self._tiered().apply_cold_policy(now, dry_run=dry_run)
