"""The repository: the public verbs over a store (save, load, load_into, checkpoints, verify)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .. import catalog
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigConflictError,
    InsufficientSpaceError,
    IntegrityError,
    InvalidNameError,
    LuopanError,
    NotARepositoryError,
    RepoExistsError,
    RepoNotFoundError,
    StateMismatchError,
    StorageError,
    UnreadableError,
    UnsupportedFormatError,
    UnsupportedValueError,
    UsageError,
)
from ..format.canonical import canonical, json_culprit
from ..format.config import CONFIG_KEY, Compression, RepoConfig
from ..format.index import parse_index
from ..format.limits import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES
from ..format.manifest import Manifest, Row, encode_metrics, parse_manifest
from ..format.names import check_run, check_step, is_index_key, manifest_key
from ..format.chunking import chunk_spans
from ..format.pack import BlobLocation
from ..locks import DEFAULT_TIMEOUT, locked

DEFAULT_SPACE_MARGIN = 1.5
from ..store import FsspecStore, MemoryStore, Store, is_object_url, open_store
from ..store.base import KeyNotFound, Stray
from ..store.local import TMP_MARK, LocalStore
from ..tree import Leaf, flatten, new_array, unflatten
from .buffers import HostBuffers
from .export import diff_manifests, export_safetensors
from .read import ChunkRef, all_chunk_refs, check_pack_trailer, check_rows, entry_jobs, read_chunks, verify_chunks
from .rowdelta import DeltaPolicy, RowTrack, normalise_hint
from .runrecord import Run, as_problem
from .save import PackChecker, write_checkpoint


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``Repo.checkpoints`` and ``Repo.save`` report about one committed checkpoint."""

    run: str
    step: int
    created: str
    metrics: dict[str, Any]
    logical_bytes: int  # bytes of the state (tied tensors counted once)
    new_bytes: int  # raw bytes of chunks this save added to the repository
    stored_bytes: int  # bytes of pack files this save wrote (after compression, with framing)
    chunks: int
    new_chunks: int
    fingerprint: str
    manifest: str = field(repr=False)

    @property
    def dedup_ratio(self) -> float:
        """logical bytes / bytes this save stored (inf when it stored nothing new)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @classmethod
    def from_manifest(cls, m: Manifest, key: str) -> CheckpointInfo:
        s = m.stats
        return cls(m.run, m.step, m.created, m.metrics, s["logical_bytes"], s["new_bytes"], s["stored_bytes"],
                   s["chunks"], s["new_chunks"], m.doc["fingerprint"], key)


def open(  # noqa: A001  (the public verb is luopan.open)
    location: str | os.PathLike[str] | Store,
    *,
    create: bool = True,
    chunk_size: int | None = None,
    pack_size: int | None = None,
    compression: str | Compression | None = None,
    delta_policy: DeltaPolicy | None = None,
    replicate_to: str | os.PathLike[str] | Store | None = None,
    local_retention: Any = None,
    cold: Any = None,
    storage_options: dict[str, Any] | None = None,
    replicate: bool = True,
    lock_timeout: float | None = DEFAULT_TIMEOUT,
    space_margin: float = DEFAULT_SPACE_MARGIN,
) -> Repo:
    """Open the repository at a path/URL, creating it (with the given options) when missing and ``create``.

    Options apply at creation; on an existing repository, an option that differs from its config is an error.
    ``delta_policy`` (not stored: it steers this process's saves) says which tables are stored as row deltas.

    Tiered storage (docs/format.md §10.2, luopan.tier): ``replicate_to`` (a URL or path, recorded in the local
    ``tier/config.json`` so later opens need not repeat it) gets every committed checkpoint copied in the
    background; ``local_retention`` (luopan.retention rules) evicts local copies once the remote has them;
    ``cold=luopan.ColdPolicy(url, older_than="7d")`` names where ``repo.apply_cold_policy()`` moves old checkpoints.
    ``lock_timeout`` (seconds, default 600; None waits forever) is how long a save waits for a prune/gc holding the
    exclusive lock, and prune/gc for saves (docs/format.md §9.2). ``space_margin`` (default 1.5; 0 turns it off):
    a save first checks that the disk has this many times its estimated new bytes free (§10.4).
    ``storage_options`` go to the object-store filesystem of the repository's URL and of those URLs (e.g.
    ``{"endpoint_url": …, "key": …, "secret": …}`` for S3). ``replicate=False`` opens a tiered
    repository without starting replication (reads still fall back to the remote; used by the CLI).
    """
    if sys.byteorder != "little":  # docs/format.md §5: entries are stored little-endian, as in host memory
        raise LuopanError("luopan repositories are little-endian; this big-endian host cannot read or write them")
    if lock_timeout is not None and not (_is_number(lock_timeout) and lock_timeout >= 0):
        raise UsageError(f"lock_timeout must be a number of seconds >= 0 (or None to wait forever), got "
                         f"{lock_timeout!r}")
    if not (_is_number(space_margin) and 0 <= space_margin < math.inf):
        raise UsageError(f"space_margin must be a finite number >= 0 (0 turns the free-space check off), got "
                         f"{space_margin!r}")
    store = open_store(location, **(storage_options or {}) if is_object_url(location) else {})
    _check_local_root(store, create)
    from .. import tier as _tier

    tiering = _tier.setup(store, replicate_to=replicate_to, local_retention=local_retention, cold=cold,
                          storage_options=storage_options)
    tiers = [] if tiering is None else [t for t in (tiering.store.remote, tiering.store.cold) if t is not None]
    if storage_options and not is_object_url(location) and not any(isinstance(t, FsspecStore) for t in tiers):
        raise UsageError(f"storage_options apply to object-store URLs (s3://…), and neither {location!r} nor a "
                         "replicate_to/cold URL (given or recorded) is one")
    try:
        config = RepoConfig.from_bytes(store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), _where(store))
    except KeyNotFound:
        if not create:
            raise RepoNotFoundError(
                f"no luopan repository at {_where(store)}: create one with `luopan init -r {_where(store)}` "
                "or luopan.open(path)"
            ) from None
        config = _create(store, chunk_size, pack_size, compression)
    else:
        wanted = {"chunk_size": chunk_size, "pack_size": pack_size,
                  "compression": Compression.parse(compression) if compression is not None else None}
        for name, value in wanted.items():
            if value is not None and value != getattr(config, name):
                raise ConfigConflictError(
                    f"repository {_where(store)} has {name}={getattr(config, name)}, not {value}; "
                    "options apply only when a repository is created"
                )
    store.cleanup_temporaries()
    repo = Repo(tiering.store if tiering is not None else store, config, delta_policy)
    repo.lock_timeout = lock_timeout
    repo.space_margin = space_margin
    if tiering is not None:
        return _tier.attach(repo, tiering, start=replicate)
    return repo


def _check_local_root(store: Store, create: bool) -> None:
    """A local repository path must be a directory (or not exist yet, when creating): a regular file there is a
    clear error, not a traceback from deep inside the store."""
    if not isinstance(store, LocalStore):
        return
    root = store.root
    if os.path.exists(root) and not os.path.isdir(root):
        raise (NotARepositoryError if create else RepoNotFoundError)(
            f"{root} is a file, not a luopan repository (a directory): pass the repository's directory with -r, "
            "or a new path to create one there")
    if not os.path.exists(root) and os.path.lexists(root):
        raise RepoNotFoundError(f"{root} is a dangling symbolic link (to {os.readlink(root)}): mount or restore "
                                "what it points to, or remove the link")


def _is_number(x: Any) -> bool:
    """A real number (NumPy scalars too), not a bool, not NaN."""
    import numbers

    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


def init(location: str | os.PathLike[str] | Store, **options: Any) -> Repo:
    """Create a new repository; RepoExistsError if one is already there."""
    store = open_store(location)
    _check_local_root(store, True)
    if store.exists(CONFIG_KEY):
        raise RepoExistsError(f"a luopan repository already exists at {_where(store)}")
    return open(store, **options)


def _where(store: Store) -> str:
    return store.describe()


def _create(store: Store, chunk_size: int | None, pack_size: int | None,
            compression: str | Compression | None) -> RepoConfig:
    store.cleanup_temporaries()  # e.g. the config's own temp file from a creation that crashed
    root = getattr(store, "root", None)
    if root is not None and os.path.isdir(root) and any(TMP_MARK not in e.name for e in os.scandir(root)):
        raise NotARepositoryError(
            f"{root} exists, is not empty and is not a luopan repository: refusing to create one there; "
            "choose an empty or new directory"
        )
    if root is None and not isinstance(store, MemoryStore):  # an object-store prefix (or another backend)
        stray = next(iter(store.list("")), None)
        if stray is not None:
            raise NotARepositoryError(
                f"{_where(store)} already holds objects (e.g. {stray!r}) and is not a luopan repository: refusing "
                "to create one there; choose an empty prefix (e.g. s3://bucket/new-prefix)"
            )
    kwargs: dict[str, Any] = {"compression": Compression.parse(compression)}
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    if pack_size is not None:
        kwargs["pack_size"] = pack_size
    config = RepoConfig(**kwargs)
    if not store.put_if_absent(CONFIG_KEY, config.to_bytes()):  # another process created it first
        config = RepoConfig.from_bytes(store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), _where(store))
    return config


class Repo:
    """A luopan repository. Not safe for concurrent saves from several threads of one process."""

    def __init__(self, store: Store, config: RepoConfig, delta_policy: DeltaPolicy | None = None) -> None:
        self.store = store
        self.config = config
        self.delta_policy = delta_policy or DeltaPolicy()
        self._known: dict[str, BlobLocation] | None = None
        self._indexes_seen: set[str] = set()
        self._previous: dict[str, dict[str, dict[str, Any]]] = {}  # run -> path -> entry of its last save
        self._tracks: dict[str, dict[str, RowTrack]] = {}  # run -> path -> row-delta state (docs/format.md §5.2)
        self._recorded: set[str] = set()  # runs whose record this process has written or found
        self._intact_packs: dict[str, tuple[int, ...]] = {}  # pack id -> store signature when its trailer checked
        self._versions: dict[str, dict[str, tuple[Any, ...]]] = {}  # run -> path -> tensor version record
        self._buffers = HostBuffers()
        self._worker: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self.lock_timeout: float | None = DEFAULT_TIMEOUT  # how long a save waits for prune/gc (None: forever)
        self.space_margin: float = DEFAULT_SPACE_MARGIN  # preflight: free space needed / estimated bytes (0: off)
        self.tier: Any = None  # luopan.tier.Tier of a tiered repository (docs/format.md §10.2)

    def __repr__(self) -> str:
        return f"luopan.Repo({self.store.describe()!r})"

    def __enter__(self) -> Repo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for a save_async in flight (raising its error if nobody saw it) and stop the background thread."""
        try:
            self._drain()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._buffers.clear()
            self._versions.clear()
            self._tracks.clear()
            if self.tier is not None:  # stops after the pack in progress; the rest stays pending for the next open
                self.tier.close()

    # -- tiered storage (luopan.tier, docs/format.md §10.2) ------------------------------------------------------
    def replication_status(self, run: str) -> dict[int, str]:
        """step -> "local" | "replicating" | "replicated" | "remote" (evicted locally) | "cold" of a tiered repo."""
        return self._tiered().status(run)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint queued for replication is confirmed on the remote (True), or ``timeout``
        seconds pass (False). ReplicationError names checkpoints that cannot be replicated."""
        return self._tiered().wait(timeout)

    def apply_cold_policy(self, now: Any = None, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Move checkpoints older than the cold policy's threshold (not pinned, already replicated) to the cold
        store; returns the (run, step) moved."""
        return self._tiered().apply_cold_policy(now, dry_run=dry_run)

    def _tiered(self) -> Any:
        if self.tier is None:
            raise LuopanError(f"{_where(self.store)} is not a tiered repository: open it with replicate_to=URL")
        return self.tier

    # -- saving -------------------------------------------------------------------------------------------------
    def save(
        self,
        run: str,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        trust_versions: bool = False,
        touched_rows: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Commit ``state`` as checkpoint ``step`` of ``run``; writes only chunks the repository lacks.

        The checkpoint becomes visible atomically when its manifest is durable. Raises CheckpointExistsError if
        the step exists (unless ``overwrite``), UnsupportedValueError for state luopan cannot store (naming the key
        path), StorageFullError when the disk fills (nothing committed). Waits for a save_async in flight first
        (and raises its error if nobody has seen it yet).

        ``trust_versions=True`` (opt-in) skips reading torch tensors whose version counter has not moved since
        this process saved the same tensor object for this run: free for frozen weights. Writes that bypass the
        counter are then missed — silently stale data: ``t.data[...] = …``, writes through ``t.numpy()`` or DLPack
        views, custom kernels, and **fused optimizers** (``torch.optim.AdamW(fused=True)``, HF
        ``adamw_torch_fused``), which update weights and moments in place without moving it. Saving
        ``{k: p.data}`` also defeats it (each ``.data`` has a fresh counter). Use it for state changed only by
        ordinary (non-fused) in-place ops, e.g. a frozen base model next to a trained adapter.

        Large tables (``repo.delta_policy``) whose rows change sparsely are stored as a row delta against an
        earlier full version (docs/format.md §5.2); changed rows are found automatically. ``touched_rows={"emb.weight":
        ids}`` (key paths as in ``luopan show``) names the rows the training loop changed since the previous save
        of this run and skips that detection. A hint that misses a changed row in a chunk that also holds a
        touched row stores that row stale in this checkpoint (the next save without a hint stores it), so pass
        every row the optimizer wrote; a chunk that changed without any touched row is detected and handled
        without the hint.
        """
        self._drain()
        return self._commit(self._prepare(run, step, state, metrics, metadata, overwrite, trust_versions,
                                          touched_rows))

    def save_async(
        self,
        run: str,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        trust_versions: bool = False,
        touched_rows: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Like ``save``, but returns as soon as the state is copied into reusable host buffers; hashing, packing
        and writing happen on a background thread. The caller may change the state right after this returns.

        One save is in flight at a time: this call first waits for the previous one. ``handle.wait()`` returns
        the CheckpointInfo or raises the save's error; an error nobody waited for is raised by the next
        ``save``/``save_async``/``close`` instead, never dropped. Bad input is still raised here, synchronously.
        A process killed mid-persist leaves no visible checkpoint (the manifest is written last).
        """
        self._drain()
        plan = self._prepare(run, step, state, metrics, metadata, overwrite, trust_versions, touched_rows)
        # The only stall: one copy into reused host memory of everything tier 1 (trust_versions) cannot reuse for
        # certain. Reusability is decided now, while the caller waits: the background save never reads live state.
        if plan.unchanged:
            checker = PackChecker(self.store, self._intact_packs)
            known = self._chunk_index()
            previous = self._previous_rows(run)
            plan.unchanged = frozenset(i for i in plan.unchanged
                                       if checker.entry_reusable(previous.get(plan.leaves[i].path), known))
        plan.leaves = self._buffers.freeze(plan.leaves, plan.unchanged)
        plan.snapshot = True
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, "luopan-save")
            _drain_at_exit(self)
        handle = SaveHandle(self._worker.submit(self._commit, plan), plan.run, plan.step)
        self._inflight = handle
        return handle

    def _drain(self) -> None:
        """Wait for the save in flight; raise its error if no caller has observed it."""
        handle = self._inflight
        if handle is None:
            return
        exc = handle._future.exception()  # wait first: if this is interrupted the save stays in flight
        self._inflight = None
        if exc is not None and not handle._observed:
            handle._observed = True
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised by the background save_async of run {handle.run!r} step {handle.step})")
            raise exc

    def _prepare(self, run: str, step: int, state: Any, metrics: dict[str, Any] | None,
                 metadata: dict[str, Any] | None, overwrite: bool, trust_versions: bool = False,
                 touched_rows: dict[str, Any] | None = None) -> _SavePlan:
        """Check everything about a save before any byte is written; snapshot metrics and metadata."""
        check_run(run)
        step = check_step(step)
        if not overwrite and self.store.exists(manifest_key(run, step)):
            raise CheckpointExistsError(
                f"run {run!r} already has a checkpoint at step {step}; pass overwrite=True to replace it"
            )
        _check_json("metadata", metadata, dict)
        try:
            encoded_metrics = encode_metrics(metrics)
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: .item() of a multi-element tensor
            raise UnsupportedValueError(f"bad metrics: {exc}; pass numbers, str, bool or None") from None
        _check_json("metrics", encoded_metrics, dict)
        skeleton, leaves = flatten(state)
        # Everything that goes into the manifest is checked before any pack is written.
        _check_json("state", skeleton, dict)
        metadata_copy = json.loads(canonical(metadata)) if metadata else None
        versions = _tensor_versions(leaves) if trust_versions else {}
        seen = self._versions.get(run, {})
        unchanged = frozenset(i for i, (path, rec) in versions.items()
                              if path in seen and _same_version(seen[path], rec))
        plan = _SavePlan(run, step, skeleton, leaves, encoded_metrics, metadata_copy, overwrite,
                         {path: rec for path, rec in versions.values()}, unchanged, _hints(touched_rows, leaves))
        self._preflight(plan)
        return plan

    def _preflight(self, plan: _SavePlan) -> None:
        """Refuse a save, before anything is written, when the store has less free space than ``space_margin`` times
        the bytes it is expected to write (docs/format.md §10.4).

        The estimate is an upper bound first — the state's bytes, minus tensors known unchanged (trust_versions) —
        and only when that does not fit is it refined: each chunk's XXH3-128 is compared with the same chunk of the
        run's previous checkpoint (this process's last save, else the newest on disk), and only chunks that differ
        count. A save that writes more than estimated still fails cleanly when the disk fills.
        """
        margin = self.space_margin
        if not margin:
            return
        free = self.store.free_bytes()
        if free is None:
            return
        logical = sum(leaf.nbytes for i, leaf in enumerate(plan.leaves)
                      if leaf.alias_of is None and i not in plan.unchanged)
        estimate = logical + (64 << 10)  # + manifest, index file, ref
        if free >= estimate * margin:
            return
        estimate = self._changed_bytes(plan) + (64 << 10)
        needed = math.ceil(estimate * margin)
        if free >= needed:
            return
        from ..gc import reclaimable

        try:
            gc_frees, prune_frees = reclaimable(self)
        except LuopanError:
            gc_frees = prune_frees = None
        help_text = []
        if gc_frees:
            help_text.append(f"`luopan gc --grace 0 -r {_where(self.store)}` would free {_human(gc_frees)} now")
        if prune_frees:
            help_text.append(f"pruning every checkpoint except the newest (and pinned) of each run, then gc, would "
                             f"free up to {_human(prune_frees)} more (`luopan prune RUN --keep-last N`)")
        if not help_text:
            help_text.append("gc and prune would free nothing here: free space elsewhere on that disk")
        err = InsufficientSpaceError(
            28, f"not enough free space to save run {plan.run!r} step {plan.step}: about {_human(estimate)} to write, "
            f"needing {_human(needed)} with the {margin:g}x margin, but only {_human(free)} is free on "
            f"{_where(self.store)}; nothing was written. " + "; ".join(help_text)
            + ". (Lower the margin with luopan.open(..., space_margin=1.0), or 0 to turn the check off.)")
        err.needed, err.free, err.estimate = needed, free, estimate  # type: ignore[attr-defined]
        err.gc_frees, err.prune_frees = gc_frees, prune_frees  # type: ignore[attr-defined]
        raise err

    def _changed_bytes(self, plan: _SavePlan) -> int:
        """Bytes of the chunks of ``plan`` whose XXH3-128 differs from the same chunk of the run's previous
        checkpoint (an estimate for the preflight; rows read from disk are fine for that, never for dedup)."""
        previous = self._previous_rows(plan.run)
        if not previous:
            try:
                previous = _entries_by_path(self.manifest(plan.run).doc)
            except (CheckpointNotFoundError, IntegrityError, UnsupportedFormatError):
                previous = {}
        total = 0
        for i, leaf in enumerate(plan.leaves):
            if leaf.alias_of is not None or i in plan.unchanged or leaf.nbytes == 0:
                continue
            prev = previous.get(leaf.path, {})
            rows = prev.get("chunks", [])
            on_host = leaf.kind != "torch" or leaf.frozen is not None or leaf.obj.is_cpu
            if not rows or not on_host:  # new entry, or on a device (copying it here would cost a transfer)
                total += leaf.nbytes
                continue
            data = leaf.host_bytes()
            changed = 0
            for k, (off, length) in enumerate(chunk_spans(leaf.nbytes, leaf.shape, self.config.chunk_size)[1]):
                row = Row._make(rows[k]) if k < len(rows) else None
                if row is None or row.size != length or row.xxh3 != xxhash.xxh3_128_hexdigest(data[off:off + length]):
                    changed += length
            if "delta" in prev:  # rows of a row delta's *base*: a sparse change touches most of them, but the save
                changed = min(changed, int(self.delta_policy.rebase_fraction * leaf.nbytes))  # writes only rows
            total += changed
        return total

    def run(self, name: str) -> Run:
        """A run's record (written by its first save) and eval logs: ``repo.run("a").log_eval(step, metrics,
        samples=[…])``."""
        return Run(self, name)

    def _commit(self, plan: _SavePlan) -> CheckpointInfo:
        # A shared lock: saves run side by side, prune/gc wait for them (and they for prune/gc), docs/format.md §9.2.
        with locked(self.store, "shared", f"save of {plan.run} step {plan.step}", timeout=self.lock_timeout,
                    where=_where(self.store)):
            return self._commit_locked(plan)

    def _commit_locked(self, plan: _SavePlan) -> CheckpointInfo:
        if plan.run not in self._recorded:  # the run's record, once (docs/format.md §8.1)
            try:
                Run(self, plan.run).write_record()
            except (OSError, ValueError, LuopanError) as exc:  # a record is context: never fail the save for it
                warnings.warn(f"run {plan.run!r}: the run record could not be written ({exc})", stacklevel=3)
            self._recorded.add(plan.run)
        known = self._chunk_index()
        with self.tier.saving() if self.tier is not None else contextlib.nullcontext():  # replication pauses
            result = write_checkpoint(self.store, self.config, known, plan.run, plan.step, plan.skeleton,
                                      plan.leaves, plan.metrics, plan.metadata, plan.overwrite,
                                      self._previous_rows(plan.run), plan.unchanged, self._tracks.get(plan.run),
                                      plan.hints, self.delta_policy, plan.snapshot, self._intact_packs)
        known.update(result.new_locations)
        self._previous[plan.run] = _entries_by_path(result.doc)
        self._tracks[plan.run] = result.tracks
        self._versions[plan.run] = plan.versions  # only after a commit: they describe what is now the previous save
        if result.index_key is not None:
            self._indexes_seen.add(result.index_key)  # already in `known`; re-reading it would undo verify's drops
        if self.tier is not None:
            self.tier.committed(plan.run, plan.step)  # queue it for background replication
        return CheckpointInfo.from_manifest(Manifest(result.doc), result.manifest_key)

    def _previous_rows(self, run: str) -> dict[str, dict[str, Any]]:
        """Chunk rows this process wrote for the run's last save, for XXH3 change detection. Rows read from disk
        are never used: a crafted manifest could map a public chunk's XXH3 to another chunk's BLAKE3 and poison
        this process's saves, so the first save of a run in a process hashes everything."""
        return self._previous.get(run, {})

    def _chunk_index(self) -> dict[str, BlobLocation]:
        """Chunk hash → location from all index files (refreshed with index files new since the last call)."""
        keys = [k for k in self.store.list("index/") if is_index_key(k)]
        if self._known is None or not self._indexes_seen.issubset(keys):
            # First use, or gc consolidated/removed index files (and maybe moved or deleted packs): forget every
            # location this process remembers, so no save references a chunk where it no longer is. (Rows kept for
            # change detection hold hashes, not locations; they are looked up here again.)
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
            except (IntegrityError, StorageError) as exc:  # only deduplication is lost: saves store those chunks
                warnings.warn(f"{exc}; skipping it", stacklevel=3)
            self._indexes_seen.add(key)
        return self._known

    # -- listing ------------------------------------------------------------------------------------------------
    def runs(self) -> list[str]:
        """Runs with at least one committed checkpoint (luopan.catalog: the walk every command shares)."""
        return catalog.scan(self.store).runs

    def steps(self, run: str) -> list[int]:
        """Committed steps of ``run``, ascending (a checkpoint exists iff its manifest exists)."""
        check_run(run)
        return catalog.scan(self.store, run).steps.get(run, [])

    def strays(self, run: str | None = None, *, everywhere: bool = False) -> list[Stray]:
        """What lies under ``runs/`` (or ``run``'s directory; with ``everywhere``, anywhere in the repository) that is
        not luopan's, each with the reason: skipped by every command, reported by ``luopan verify`` (docs/format.md
        §2). A stray with ``unreadable`` set (a dangling link, a directory that cannot be read) may hide
        checkpoints: gc refuses to run past it."""
        if run is not None:
            check_run(run)
            return catalog.scan(self.store, run, strays=True).strays
        seen = {s.key: s for s in catalog.scan(self.store, strays=True).strays}
        if everywhere:  # a walk of every key: packs/ too (a full listing on an object store)
            for s in self.store.strays(""):
                if not s.key.startswith(catalog.RUNS):  # runs/ as the catalog sees it (its walk starts there)
                    seen.setdefault(s.key, s)
        return sorted(seen.values(), key=lambda s: s.key)

    def manifest(self, run: str, step: int | None = None) -> Manifest:
        """The parsed, verified manifest of a checkpoint (latest = highest committed step when ``step`` is None)."""
        check_run(run)
        if step is None:
            steps = self.steps(run)
            if not steps:
                raise CheckpointNotFoundError(self._no_checkpoint(run))
            step = steps[-1]
        step = check_step(step)
        key = manifest_key(run, step)
        try:
            data = self.store.get_limited(key, MAX_MANIFEST_BYTES)
        except KeyNotFound:
            raise CheckpointNotFoundError(self._no_checkpoint(run, step)) from None
        return parse_manifest(data, key, run, step)

    def _no_checkpoint(self, run: str, step: int | None = None) -> str:
        steps = self.steps(run)
        if not steps:
            runs = self.runs()
            have = f"runs here: {', '.join(runs)}" if runs else "the repository has no checkpoints yet"
            return f"run {run!r} has no committed checkpoint ({have})"
        shown = ", ".join(map(str, steps[-10:]))
        return f"run {run!r} has no checkpoint at step {step}; committed steps: {shown}"

    def checkpoints(self, run: str) -> list[CheckpointInfo]:
        """Committed checkpoints of ``run``, oldest step first. A damaged manifest raises CorruptManifestError."""
        out = []
        for step in self.steps(run):
            m = self.manifest(run, step)
            out.append(CheckpointInfo.from_manifest(m, manifest_key(run, step)))
        return out

    # -- loading ------------------------------------------------------------------------------------------------
    def load(self, run: str, step: int | None = None) -> Any:
        """The state tree of a checkpoint (latest when ``step`` is None), every chunk verified as it is read."""
        m = self.manifest(run, step)
        sizes = check_rows(self.store, m)  # every row within its pack before any buffer is sized by the manifest
        objs: list[Any] = [None] * len(m.entries)
        jobs: list[Any] = []
        for i, e in enumerate(m.entries):
            if "alias_of" in e:
                continue
            obj, view = new_array(e["kind"], e["dtype"], e["shape"])
            objs[i] = obj
            jobs += entry_jobs(self.store, m, i, view, sizes)  # row deltas: each base chunk patched as it is read
        read_chunks(self.store, jobs, sizes=sizes)
        for i, e in enumerate(m.entries):
            if "alias_of" in e:
                objs[i] = objs[e["alias_of"]]
            elif e.get("scalar"):
                objs[i] = objs[i][()]
        return unflatten(m.tree, objs.__getitem__)

    def load_into(self, run: str, target: Any, step: int | None = None, *, strict: bool = True) -> Any:
        """Restore a checkpoint into an existing state tree, in place (tensors are written, not replaced).

        Every mismatch (missing/unexpected keys, shapes, dtypes) is checked and reported together before any
        tensor is touched. Each chunk is verified before it is copied into the target, so a damaged chunk is
        never written into it (an IntegrityError can still leave earlier tensors updated). With
        ``strict=False``, keys present on only one side are skipped. Returns ``target``.
        """
        m = self.manifest(run, step)
        stored = {e["path"]: (i, e) for i, e in enumerate(m.entries)}
        _, leaves = flatten(target)
        problems = []
        plan = []
        target_paths = set()
        for leaf in leaves:
            target_paths.add(leaf.path)
            hit = stored.get(leaf.path)
            if hit is None:
                if strict:
                    problems.append(f"missing in checkpoint: {leaf.path!r}")
                continue
            i, e = hit
            if e["kind"] != leaf.kind or e["dtype"] != leaf.dtype or list(e["shape"]) != list(leaf.shape):
                problems.append(
                    f"{leaf.path!r}: checkpoint has {e['kind']} {e['dtype']}{tuple(e['shape'])}, "
                    f"target has {leaf.kind} {leaf.dtype}{tuple(leaf.shape)}"
                )
                continue
            if leaf.scalar:
                problems.append(f"{leaf.path!r}: a NumPy scalar cannot be updated in place; use load()")
                continue
            plan.append((leaf, e.get("alias_of", i)))
        if strict:
            problems += [f"unexpected in checkpoint (not in target): {p!r}" for p in stored if p not in target_paths]
        if problems:
            raise StateMismatchError(
                f"cannot load run {run!r} step {m.step} into the target ({len(problems)} problem(s)):\n  "
                + "\n  ".join(problems)
                + "\nfix the target, or pass strict=False to load only the keys both sides have"
            )
        jobs: list[Any] = []
        copies = []
        sizes = check_rows(self.store, m, [i for _leaf, i in plan])
        for leaf, i in plan:
            dest = _writable_bytes(leaf)
            if dest is None:  # non-contiguous / device / conj target: read fresh, then copy_ into it
                e = m.entries[i]
                fresh, dest = new_array(e["kind"], e["dtype"], e["shape"])
                copies.append((leaf, fresh))
            jobs += entry_jobs(self.store, m, i, dest, sizes)
        read_chunks(self.store, jobs, via_scratch=True, sizes=sizes)  # one batch on both cores; verified before copying
        for leaf, fresh in copies:
            if leaf.kind == "torch":
                with sys.modules["torch"].no_grad():
                    leaf.obj.copy_(fresh)
            else:
                leaf.obj[...] = fresh
        return target

    # -- verification -------------------------------------------------------------------------------------------
    def verify(
        self,
        run: str | None = None,
        step: int | None = None,
        *,
        progress: Callable[[int], Any] | None = None,
        on_total: Callable[[int], Any] | None = None,
    ) -> VerifyReport:
        """Read every byte of the selected checkpoints and check every hash.

        ``run=None``: all runs; ``step=None``: all checkpoints of the run. Each distinct chunk is read once. Raises
        IntegrityError naming every damaged manifest, entry and chunk (``.problems`` lists them); returns a
        VerifyReport when all is well.
        """
        if run is None and step is not None:
            raise InvalidNameError("verify: a step needs a run")
        if self._inflight is not None:  # let a background save finish before we touch the dedup map
            self._inflight._future.exception()
        if run is not None:
            check_run(run)
        if step is not None:
            step = check_step(step)
        strays = self.strays(run, everywhere=run is None)
        problems: list[LuopanError] = [UnreadableError(f"cannot verify {s}: checkpoints there cannot be seen")
                                       for s in strays if s.unreadable]
        targets = [(r, s) for r in ([run] if run else self.runs()) for s in ([step] if step is not None
                                                                             else self.steps(r))]
        if run is not None and not targets and not problems:
            raise CheckpointNotFoundError(self._no_checkpoint(run))
        refs: dict[str, ChunkRef] = {}
        for r, s in targets:
            try:
                m = self.manifest(r, s)
            except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
                problems.append(as_problem(exc))
                continue
            for i in range(len(m.entries)):
                for ref in all_chunk_refs(m, i):
                    refs.setdefault(f"{ref.hash}/{ref.pack}/{ref.offset}", ref)
        if on_total is not None:
            on_total(sum(r.size for r in refs.values()))
        for pack in sorted({r.pack for r in refs.values()}):
            trailer_problem = check_pack_trailer(self.store, pack)
            if trailer_problem is not None:
                problems.append(trailer_problem)
        chunk_problems = verify_chunks(self.store, list(refs.values()), progress)
        problems += chunk_problems
        self._intact_packs.clear()  # verify re-reads everything; dedup re-checks pack trailers afterwards
        if self._known is not None:  # never deduplicate against a chunk found damaged: the next save rewrites it
            for p in chunk_problems:
                ref = getattr(p, "chunk", None)
                loc = self._known.get(ref.hash) if ref is not None else None
                if loc is not None and (loc.pack, loc.offset) == (ref.pack, ref.offset):
                    del self._known[ref.hash]
        if step is None:  # the runs' other files: record, eval logs, pins, latest ref
            for r in sorted({r for r, _s in targets} | ({run} if run else set())):
                problems += self.run(r).problems()
        if run is None:  # whole repository: the index files too (they steer deduplication)
            for key in self.store.list("index/"):
                if not is_index_key(key):
                    continue
                try:
                    parse_index(self.store.get_limited(key, MAX_INDEX_BYTES), key)
                except KeyNotFound:
                    continue
                except (IntegrityError, StorageError) as exc:
                    problems.append(as_problem(exc))
        report = VerifyReport(len(targets), len(refs), sum(r.size for r in refs.values()), problems,
                              [s for s in strays if not s.unreadable])
        if problems:
            shown = "\n  ".join(str(p) for p in problems[:20])
            more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
            err = IntegrityError(f"{len(problems)} problem(s) found:\n  {shown}{more}")
            err.problems = problems  # type: ignore[attr-defined]
            err.report = report  # type: ignore[attr-defined]
            raise err
        return report

    def export(
        self,
        run: str,
        path: str | os.PathLike[str],
        step: int | None = None,
        *,
        subtree: str | None = None,
        progress: Callable[[int], Any] | None = None,
    ) -> dict[str, Any]:
        """Write a checkpoint (or the tensors under key path ``subtree``, e.g. ``"model"``) to one safetensors file.

        Streams verified chunks, so it needs little memory; the file appears atomically. Tied tensors are written
        under each name. Non-tensor leaves are not exported. Returns {"path", "tensors", "bytes"}.
        """
        return export_safetensors(self.store, self.manifest(run, step), path, subtree, progress)

    def diff(self, run: str, step_a: int, step_b: int) -> dict[str, Any]:
        """Entries changed, added and removed between two checkpoints of a run, with the bytes that differ."""
        return diff_manifests(self.manifest(run, step_a), self.manifest(run, step_b))

    def prune(self, run: str, rules: Any, *, dry_run: bool = False, missing_metrics: str = "error") -> Any:
        """Remove the checkpoints of ``run`` that ``rules`` (luopan.retention) do not keep; returns the Plan.

        The newest checkpoint and pinned ones are always kept. A checkpoint is removed by deleting its manifest
        (atomic: it exists until then, and is gone after); the chunks it alone used stay until `luopan gc`.
        ``dry_run`` computes exactly the same plan and removes nothing (it takes no lock, so it needs no write
        access and never waits). A `KeepBest` metric that no checkpoint of the run records as a number (a typo
        such as ``Loss`` for ``loss``) is an error naming the metrics they do record, before anything is removed;
        ``missing_metrics="ignore"`` lets such a rule keep nothing (CheckpointManager uses it while a metric has
        not been logged yet).
        """
        self._drain()
        check_run(run)
        if missing_metrics not in ("error", "ignore"):
            raise UsageError(f"missing_metrics must be 'error' or 'ignore', got {missing_metrics!r}")
        if dry_run:
            return self._prune_locked(run, rules, True, missing_metrics)
        with locked(self.store, "exclusive", f"prune of {run}", timeout=self.lock_timeout, where=_where(self.store)):
            return self._prune_locked(run, rules, False, missing_metrics)

    def _prune_locked(self, run: str, rules: Any, dry_run: bool, missing_metrics: str = "error") -> Any:
        from ..retention import Checkpoint, check_metrics, plan as retention_plan

        pins = self.run(run).pins()
        tags = {step: ((p["tag"],) if p["tag"] else ()) for step, p in pins.items()}
        infos = self.checkpoints(run)
        if not infos:
            raise CheckpointNotFoundError(self._no_checkpoint(run))
        checkpoints = [Checkpoint.from_info(i, pinned=i.step in pins, tags=tags.get(i.step, ())) for i in infos]
        if missing_metrics == "error":
            check_metrics(checkpoints, rules, f"run {run!r}")
        decided = retention_plan(checkpoints, rules)
        if not dry_run:
            for step in decided.remove:  # oldest first; the newest is never among them, so `latest` stays valid
                self.store.delete(manifest_key(run, step))
        return decided

    def gc(self, *, grace: float | None = None, repack_below: float | None = None, dry_run: bool = False,
           progress: Callable[[str], Any] | None = None) -> Any:
        """Delete packs no checkpoint needs and repack mostly-dead ones (luopan.gc.collect; docs/format.md §10.3).

        Two-phase: unreferenced packs are first condemned, and deleted by a gc run at least ``grace`` seconds
        (default 1 h) later if still unreferenced; ``grace=0`` condemns and deletes in one run (use it when nothing
        else reads the repository). Packs whose live blobs fill less than ``repack_below`` (default 0.5) are
        rewritten. Takes the exclusive lock (saves wait). Returns a GcReport.
        """
        from ..gc import DEFAULT_GRACE, DEFAULT_REPACK_BELOW, collect

        target: Repo = self
        if self.tier is not None:
            # A tiered repository collects its local tier only: marking from local manifests frees what eviction
            # left behind, and nothing on the remote (a repository of its own: `luopan gc -r <remote URL>`) is
            # touched. A manifest the repack rewrites locally needs no new copy: the remote's copy names the
            # remote's own packs; one still pending replication is read afresh when its turn comes.
            self._drain()
            target = Repo(self.tier.local, self.config, self.delta_policy)
            target.lock_timeout = self.lock_timeout
        return collect(target, grace=DEFAULT_GRACE if grace is None else grace,
                       repack_below=DEFAULT_REPACK_BELOW if repack_below is None else repack_below,
                       dry_run=dry_run, progress=progress)

    def du(self) -> dict[str, int]:
        """Logical bytes over all checkpoints vs physical bytes in the store."""
        logical = 0
        checkpoints = 0
        damaged = 0
        for r, s in catalog.scan(self.store).pairs():
            try:
                logical += self.manifest(r, s).stats["logical_bytes"]
            except (IntegrityError, UnsupportedFormatError, StorageError):
                damaged += 1  # counted, not fatal: `verify` names it
                continue
            checkpoints += 1
        sizes = {"packs": 0, "index": 0, "runs": 0, "refs": 0}
        for top in sizes:
            for key in self.store.list(top + "/"):
                try:
                    sizes[top] += self.store.size(key)
                except (KeyNotFound, StorageError):
                    pass
        physical = sum(sizes.values())
        return {"checkpoints": checkpoints, "damaged_manifests": damaged, "logical_bytes": logical, "physical_bytes": physical,
                "pack_bytes": sizes["packs"], "index_bytes": sizes["index"], "manifest_bytes": sizes["runs"],
                "ref_bytes": sizes["refs"]}


@dataclass
class _SavePlan:
    run: str
    step: int
    skeleton: dict[str, Any]
    leaves: list[Leaf]
    metrics: dict[str, Any]
    metadata: dict[str, Any] | None
    overwrite: bool
    versions: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    unchanged: frozenset[int] = frozenset()
    hints: dict[str, Any] = field(default_factory=dict)  # touched rows per table path
    snapshot: bool = False  # save_async: leaves were copied, except the ones in ``unchanged``



def _tensor_versions(leaves: list[Leaf]) -> dict[int, tuple[str, tuple[Any, ...]]]:
    """leaf index -> (path, record) for torch tensor leaves: the tier-1 change-detection record of one save
    (weak reference to the storage, version counter, address, layout, dtype, device, conj/neg bits).

    The version counter is shared by a tensor, its views and ``detach()``, so a fresh ``state_dict()`` of the same
    parameters still matches; torch returns the same storage object on every call, so a weak reference to it
    tells a live storage from a freed one whose address was reused. Tensors without a version counter
    (inference mode) get no record and are always read.
    """
    out = {}
    for i, leaf in enumerate(leaves):
        t = leaf.obj
        if leaf.kind != "torch" or leaf.alias_of is not None or leaf.nbytes == 0 or t.is_inference():
            continue
        storage = t.untyped_storage()
        try:
            ref = weakref.ref(storage)
        except TypeError:
            continue
        out[i] = (leaf.path, (ref, t._version, storage.data_ptr(), t.storage_offset(), leaf.shape, t.stride(),
                              t.dtype, "cpu" if t.is_cpu else str(t.device), t.is_conj(), t.is_neg()))
    return out


def _same_version(seen: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    storage = seen[0]()
    return storage is not None and storage is now[0]() and seen[1:] == now[1:]


def _drain_at_exit(repo: Repo) -> None:
    """Finish a save_async in flight when the interpreter exits without close().

    Registered with threading's exit hooks, which run (newest first) before concurrent.futures refuses new work at
    shutdown; a plain atexit hook would run too late and the background commit would fail unseen. An error is
    printed (the process is exiting) rather than lost.
    """
    ref = weakref.ref(repo)

    def drain() -> None:
        r = ref()
        if r is None or r._inflight is None:
            return
        try:
            r._drain()
        except BaseException as exc:  # noqa: BLE001 - exiting: report, never swallow silently
            sys.stderr.write(f"luopan: a background save failed at exit: {exc!r}\n")

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)


class SaveHandle:
    """A save_async in flight. ``wait()`` returns its CheckpointInfo or raises its error."""

    def __init__(self, future: Future[CheckpointInfo], run: str, step: int) -> None:
        self._future = future
        self._observed = False
        self.run = run
        self.step = step

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the checkpoint is committed (or the save failed: then raise its error)."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():  # a timeout does not count as having seen the outcome
                self._observed = True

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<luopan.SaveHandle run={self.run!r} step={self.step} {state}>"


@dataclass(frozen=True)
class VerifyReport:
    checkpoints: int
    chunks: int
    bytes: int
    problems: list[IntegrityError]
    strays: list[Stray] = field(default_factory=list)  # entries that are not luopan's, skipped (not damage)

    @property
    def ok(self) -> bool:
        return not self.problems


def _entries_by_path(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in doc["entries"] if "chunks" in e}


def _hints(touched_rows: dict[str, Any] | None, leaves: list[Leaf]) -> dict[str, Any]:
    """touched_rows checked against the state: each key a table entry, each value valid row numbers (copied)."""
    if not touched_rows:
        return {}
    if not isinstance(touched_rows, dict):
        raise UnsupportedValueError(
            f"touched_rows must be a dict of key path -> row numbers, got {type(touched_rows).__name__}")
    by_path = {leaf.path: leaf for leaf in leaves}
    out = {}
    for path, ids in touched_rows.items():
        leaf = by_path.get(path)
        if leaf is None:
            near = sorted(p for p in by_path if len(by_path[p].shape) >= 2)[:10]
            raise UnsupportedValueError(
                f"touched_rows names {path!r}, which is not a key path of the state; tables in the state: "
                f"{', '.join(near) or 'none'}")
        if len(leaf.shape) < 2 or leaf.alias_of is not None:
            raise UnsupportedValueError(
                f"touched_rows names {path!r}, which is not a table (a tensor with at least 2 dimensions stored "
                "under its own key)")
        out[path] = normalise_hint(path, ids, leaf.shape[0])
    return out


def _writable_bytes(leaf: Any) -> memoryview | None:
    """A flat writable byte view of a target tensor/array's memory, or None when it has none (then copy)."""
    import numpy as np

    dest = leaf.obj
    if leaf.nbytes == 0:
        return memoryview(bytearray())
    if leaf.kind == "numpy":
        if dest.flags.c_contiguous and dest.flags.writeable and dest.dtype.byteorder != ">":
            return memoryview(dest.reshape(-1).view(np.uint8))
        return None
    if dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
        torch = sys.modules["torch"]
        return memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
    return None


def _check_json(name: str, value: Any, kind: type) -> None:
    if value is None:
        return
    if not isinstance(value, kind):
        raise UnsupportedValueError(f"{name} must be a {kind.__name__} of JSON values, got {type(value).__name__}")
    try:
        canonical(value)
    except (TypeError, ValueError, RecursionError) as exc:  # ValueError: NaN, ints > 4300 digits, lone surrogates
        where = json_culprit(value, name)
        raise UnsupportedValueError(
            f"{name} must hold only JSON-storable values (str without lone surrogates, finite numbers, ints under "
            f"4300 digits, bool, None, lists, dicts with str keys){' — ' + where if where else ''}: {exc}"
        ) from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
