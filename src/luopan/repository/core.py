"""The open repository as the core knows it (docs/format.md §2a): store, config, the kind registry, the chunk index
writes deduplicate against, the commit listeners (tiering is one), locks' timeout and the space margin; open/close.
It has no verbs of any kind: each kind is a façade composed with a ``Repository`` (luopan.checkpoint.Checkpoints,
luopan.artifact.Artifact, luopan.journal.Journal, luopan.index.IndexStore), and luopan.Repo composes them. Every
write goes through ``transaction()`` (luopan.repository.transaction) and its chunk writer."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import (
    IntegrityError,
    InvalidNameError,
    LuopanError,
    ManifestNotFoundError,
    StorageError,
)
from ..format.config import RepoConfig
from ..format.index import parse_index
from ..format.limits import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from ..format.names import CONFIG_KEY, is_index_key, parse_ref_text
from ..format.pack import BlobLocation
from ..store.base import KeyNotFound, Store
from .kinds import Kind, TierLike
from .lineage import Lineage, lineage
from .links import add_links
from .locks import DEFAULT_TIMEOUT
from .preflight import DEFAULT_SPACE_MARGIN
from .chunkwriter import ChunkWriter
from .packwriter import PackChecker
from .transaction import Transaction
from .reclaim import PackUsers, Reclaimed


class Repository:
    """A luopan repository, kind-agnostic part. Not safe for concurrent writes from several threads of one process."""

    def __init__(self, store: Store, config: RepoConfig, kinds: tuple[Kind, ...] = ()) -> None:
        self.store = store
        self.config = config
        self.kinds = kinds  # the kind registry: resolve() tries them in this order
        # What the kinds composed with this repository hold in flight (a background save): drain() waits for it,
        # close() then frees it (background threads, buffers).
        self.drainers: list[Callable[[], None]] = []
        self.releasers: list[Callable[[], None]] = []
        self.lock_timeout: float | None = DEFAULT_TIMEOUT  # how long a write waits for prune/gc (None: forever)
        self.space_margin: float = DEFAULT_SPACE_MARGIN  # preflight: free space needed / estimated bytes (0: off)
        self.listeners: list[Any] = []  # commit listeners: told of every write and commit (tiering is one)
        self._tier: TierLike | None = None
        self._known: dict[str, BlobLocation] | None = None
        self.pack_users = PackUsers()  # which packs each manifest content / index file names (reclaim, §10.3.1)
        self.last_reclaim: Reclaimed | None = None  # what the last delete(reclaim=True) of this process freed
        self._indexes_seen: set[str] = set()
        self._intact_packs: dict[str, tuple[int, ...]] = {}  # pack id -> store signature when its trailer checked
        # Bumped whenever the locations this process remembers are forgotten (gc replaced the index files, verify
        # found damage): what a save carried forward unread from an older generation is not carried again.
        self.index_generation = 0

    def __repr__(self) -> str:
        return f"luopan.Repo({self.store.describe()!r})"

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tier(self) -> TierLike | None:
        """The tiering of a tiered repository (docs/format.md §10.2): a commit listener of it."""
        return self._tier

    @tier.setter
    def tier(self, tier: TierLike | None) -> None:
        if self._tier is not None:
            self.listeners.remove(self._tier)
        self._tier = tier
        if tier is not None:
            self.listeners.append(tier)

    @property
    def where(self) -> str:
        return self.store.describe()

    def drain(self) -> None:
        """Wait for work of this process in flight (a kind's background save); raise its unseen error."""
        for drain in self.drainers:
            drain()

    def close(self) -> None:
        """Wait for work in flight (raising its error if nobody saw it) and stop background threads."""
        try:
            self.drain()
        finally:
            try:
                for release in self.releasers:
                    release()
            finally:
                if self.tier is not None:  # stops after the pack in progress; the rest stays pending for next open
                    self.tier.close()

    # -- writing: the one transaction and chunk writer every kind commits through ------------------------------
    def transaction(self, kind: Kind, series: str, number: int | None, *, what: str, estimate: int | None = None,
                    purpose: str | None = None, format_version: int | None = None, lock: bool = True) -> Transaction:
        """``with repo.transaction(kind, series, number, what=...) as tx:`` — preflight, format bump, shared lock,
        chunk writer (``tx.chunks()``), manifest put, commit listeners (luopan.repository.transaction)."""
        return Transaction(self, kind, series, number, what=what, estimate=estimate, purpose=purpose,
                           format_version=format_version, lock=lock)

    def chunk_writer(self, *, known: dict[str, BlobLocation] | None = None, **options: Any) -> ChunkWriter:
        """A chunk writer against this repository's chunk index (``known``: that index, already read), with this
        process's memory of intact packs (prefer ``transaction(...).chunks()``)."""
        return ChunkWriter(self.store, self.config, self.chunk_index() if known is None else known,
                           self._intact_packs, **options)

    def pack_checker(self) -> PackChecker:
        """Which stored chunks a write may reference (their pack present and intact), with this process's memory of
        packs already found intact."""
        return PackChecker(self.store, self._intact_packs)

    def notify_committed(self, kind: Kind, series: str, number: int | None) -> None:
        """Tell every commit listener that a manifest was committed (or replaced)."""
        if number is None:
            return
        for listener in self.listeners:
            listener.committed(kind, series, number)

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
            self.index_generation += 1
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
        """Remember the chunks a write of this process just stored (and the index file naming them). Lists nothing:
        before this process's first ``chunk_index()`` there is nothing to add to (that call reads every index file)."""
        if self._known is None:
            return
        self._known.update(locations)
        if index_key is not None:
            self._indexes_seen.add(index_key)  # already known; re-reading it would undo verify's drops

    def forget_damaged(self, problems: list[LuopanError]) -> None:
        """Never deduplicate against a chunk verify found damaged: the next write stores it again."""
        self._intact_packs.clear()
        if problems:
            self.index_generation += 1
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

    def link_inputs(self, kind: Kind, series: str, number: int, inputs: list[str]) -> list[str]:
        """Record ``inputs`` ("NAME@V") as inputs of ``number`` of ``series`` afterwards, never rewriting its
        manifest (docs/format.md §9.4); returns those newly linked (idempotent). See luopan.repository.links."""
        return add_links(self, kind, series, number, inputs)

    def read_manifest(self, kind: Kind, series: str, number: int) -> dict[str, Any]:
        key = kind.manifest_key(series, number)
        return kind.parse(self.store.get_limited(key, MAX_MANIFEST_BYTES), key, series, number, self.store)

    # -- tiered storage (docs/format.md §10.2) -------------------------------------------------------------------
    def tiered(self) -> TierLike:
        """The tiering of this repository; LuopanError when it is not tiered."""
        if self.tier is None:
            raise LuopanError(f"{self.where} is not a tiered repository: open it with replicate_to=URL")
        return self.tier


def repository_of(repo: Any) -> Repository:
    """The Repository of ``repo``: itself, or what a composition of kinds (luopan.Repo) holds as ``.repository``."""
    if isinstance(repo, Repository):
        return repo
    inner = getattr(repo, "repository", None)
    if isinstance(inner, Repository):
        return inner
    raise TypeError(f"expected a luopan repository (luopan.open(...)), got {type(repo).__name__}")
