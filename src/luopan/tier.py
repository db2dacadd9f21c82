"""Tiered repositories (docs/format.md §10.2): write locally, replicate each committed checkpoint in the background.

    repo = luopan.open("ckpts", replicate_to="s3://bucket/ckpts", local_retention=luopan.retention.KeepLast(2),
                       cold=luopan.ColdPolicy("s3://archive/ckpts", older_than="7d"))

* ``TieredStore`` is the Store a tiered repository uses: writes go to the local tier; reads of a key the local tier
  lacks fall back to the remote tier, then to the cold tier; ``list`` is the union; ``delete`` deletes everywhere (a
  logical delete, e.g. prune); ``evict`` deletes locally only. ``locks/`` and ``tier/`` are local-only keys.
* ``Tier`` (``repo.tier``) owns a daemon thread that copies each committed checkpoint to the remote: its packs
  (skipping packs the remote already has), the index files naming them, the run record and pin, then the manifest
  last, each verified; transient errors are retried with exponential backoff. Local files under ``tier/`` record
  what is pending and what is confirmed, so a killed process resumes where it stopped.
* Local eviction (``local_retention``) removes local manifests only of checkpoints confirmed on the remote; a cold
  policy moves old, unpinned checkpoints to a cold store.
"""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from . import catalog
from ._crash import crashpoint
from ._process import pid_alive
from .errors import (
    ArgumentTypeError,
    ConfigConflictError,
    CorruptRepoError,
    IntegrityError,
    InvalidNameError,
    LuopanError,
    ReplicationError,
    StorageError,
    UsageError,
)
from .format import BASE_FORMAT_VERSION
from .format.canonical import SealError, seal, sealed_checksum, unseal, unseal_file
from .format.config import CONFIG_KEY, RepoConfig
from .format.index import parse_index
from .format.limits import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, MAX_SMALL_BYTES
from .format.manifest import parse_manifest
from .format.names import check_run, is_index_key, manifest_key, pack_key, step_from_manifest_key
from .locks import DEFAULT_TIMEOUT, locked
from .store import Store, is_object_url, open_store
from .store.base import Data, KeyNotFound, Stray

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint.repo import Repo

TIER_CONFIG_KEY = "tier/config.json"
LOCAL_ONLY = ("locks/", "tier/")  # per-store keys: never read from, written to or listed on another tier
# Listed on the local tier only: index files steer the deduplication of saves, and a save must depend on the local
# tier alone (a chunk found only in a remote pack would make the save read the remote). Reads still fall back.
LOCAL_LISTING = ("index/",)
UPLOAD_PART = 5 << 20  # object-store uploads of larger packs go in parts of this size, pausing between parts
BACKOFF_INITIAL = 0.5  # seconds before the first retry of a failed copy; doubles up to BACKOFF_MAX
BACKOFF_MAX = 60.0
CLOSE_TIMEOUT = 30.0  # how long Repo.close() waits for the copy in progress before leaving it pending


def pending_key(run: str, step: int) -> str:
    return f"tier/pending/{run}/{step:08d}.json"


def replicated_key(run: str, step: int) -> str:
    return f"tier/replicated/{run}/{step:08d}.json"


def cold_key(run: str, step: int) -> str:
    return f"tier/cold/{run}/{step:08d}.json"


def _manifest_of(key: str) -> tuple[str, int] | None:
    """(run, step) when ``key`` is a manifest key (docs/format.md §2), else None."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "runs" and parts[2] == "ckpt":
        step = step_from_manifest_key(key)
        if step is not None:
            return parts[1], step
    return None


def _local_only(key: str) -> bool:
    return key.startswith(LOCAL_ONLY)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


# -- the store --------------------------------------------------------------------------------------------------
class TieredStore(Store):
    """A local store in front of a remote (and optionally a cold) store. See the module docstring.

    The remote and cold tiers are best-effort for ``exists`` and ``list``: when one cannot be reached, they answer
    from the tiers that can (with a warning), so saves and listings keep working on the local tier while the remote
    is down. Reads of a key the local tier lacks raise the remote's error.
    """

    def __init__(self, local: Store, remote: Store | None, cold: Store | None = None) -> None:
        if isinstance(local, TieredStore):
            raise UsageError("the local tier of a TieredStore cannot itself be tiered")
        self.local = local
        self.remote = remote
        self.cold = cold
        self.remote_error: BaseException | None = None  # the last error of a best-effort remote call
        self._warned = 0.0
        # Called with (run, step) when a manifest is replaced in place (gc's repack, overwrite=True): the Tier
        # queues it again, so the remote gets the new manifest and the packs it names.
        self.on_manifest_replaced: Callable[[str, int], None] | None = None
        # Set by a Tier: the local tier records every checkpoint of its own that lives only on another tier
        # (tier/replicated/… without a local manifest: evicted; tier/cold/…: moved), so whether a manifest exists is
        # answered locally and a save never waits for the remote.
        self.manifests_known_locally = False

    @property
    def fallbacks(self) -> list[Store]:
        return [s for s in (self.remote, self.cold) if s is not None]

    def _soft(self, tier: Store, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except KeyNotFound:
            return default
        except OSError as exc:
            self.remote_error = exc
            if time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                warnings.warn(f"{tier.describe()} cannot be reached ({exc}); answering from the other tiers",
                              stacklevel=4)
            return default

    def _read(self, key: str, fn: Callable[[Store], Any]) -> Any:
        try:
            return fn(self.local)
        except KeyNotFound:
            if _local_only(key):
                raise
        for tier in self.fallbacks:
            try:
                return fn(tier)
            except KeyNotFound:
                continue
        raise KeyNotFound(key)

    def get(self, key: str) -> bytes:
        return self._read(key, lambda s: s.get(key))

    def get_limited(self, key: str, limit: int) -> bytes:
        return self._read(key, lambda s: s.get_limited(key, limit))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._read(key, lambda s: s.get_range(key, offset, length))

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        return self._read(key, lambda s: s.read_into(key, offset, out))

    def size(self, key: str) -> int:
        return self._read(key, lambda s: s.size(key))

    def signature(self, key: str) -> tuple[int, ...] | None:
        return self._read(key, lambda s: s.signature(key))

    def modified(self, key: str) -> float | None:
        return self._read(key, lambda s: s.modified(key))

    def put(self, key: str, data: Data) -> None:
        self.local.put(key, data)
        hook = self.on_manifest_replaced
        if hook is not None and key.startswith("runs/") and key.count("/") == 3 and "/ckpt/" in key:
            step = step_from_manifest_key(key)
            if step is not None:
                hook(key.split("/")[1], step)

    def put_if_absent(self, key: str, data: Data) -> bool:
        return self.local.put_if_absent(key, data)

    def delete(self, key: str) -> None:
        """A logical delete: the key is removed from every tier (``evict`` removes the local copy only)."""
        self.local.delete(key)
        if not _local_only(key):
            for tier in self.fallbacks:
                tier.delete(key)
        ckpt = _manifest_of(key)
        if ckpt is not None and self.manifests_known_locally:  # a pruned checkpoint: forget where it was
            for record in (replicated_key(*ckpt), cold_key(*ckpt), pending_key(*ckpt)):
                self.local.delete(record)

    def evict(self, key: str) -> None:
        self.local.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        keys = set(self.local.list(prefix))
        if prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            return iter(keys)
        for tier in self.fallbacks:
            keys.update(k for k in self._soft(tier, lambda t=tier: list(t.list(prefix)), []) if not _local_only(k))
        if not prefix:
            keys = {k for k in keys if not _local_only(k) or self.local.exists(k)}
        return iter(keys)

    def list_flat(self, prefix: str) -> list[str]:
        if prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            return self.local.list_flat(prefix)
        return super().list_flat(prefix)

    def strays(self, prefix: str = "") -> list[Stray]:
        out = list(self.local.strays(prefix))
        if not prefix.startswith(LOCAL_LISTING + LOCAL_ONLY):
            for tier in self.fallbacks:
                out += self._soft(tier, lambda t=tier: t.strays(prefix), [])
        return out

    def exists(self, key: str) -> bool:
        if self.local.exists(key):
            return True
        if _local_only(key):
            return False
        ckpt = _manifest_of(key) if self.manifests_known_locally else None
        if ckpt is not None:
            return self.local.exists(replicated_key(*ckpt)) or self.local.exists(cold_key(*ckpt))
        return any(self._soft(t, lambda t=t: t.exists(key), False) for t in self.fallbacks)

    def cleanup_temporaries(self) -> int:
        return self.local.cleanup_temporaries()

    def free_bytes(self) -> int | None:
        return self.local.free_bytes()  # saves write to the local tier only

    def describe(self) -> str:
        return self.local.describe()


# -- copying one checkpoint --------------------------------------------------------------------------------------
def _verify_small(dst: Store, key: str, data: bytes) -> None:
    try:
        got = dst.get_limited(key, len(data))
    except IntegrityError as exc:  # larger than what was written
        raise ReplicationError(f"{key} on {dst.describe()} differs from what was written: {exc}") from None
    if got != data:
        raise ReplicationError(f"{key} on {dst.describe()} differs from what was written ({len(got)} bytes read "
                               f"back, {len(data)} written)")


def _get_or_none(store: Store, key: str, limit: int) -> bytes | None:
    """The object, or None when it is missing or larger than ``limit`` (then it differs from anything we write)."""
    try:
        return store.get_limited(key, limit)
    except (KeyNotFound, IntegrityError):
        return None


def _verify_pack(dst: Store, pack_id: str, size: int) -> None:
    from .checkpoint.read import check_pack_trailer

    key = pack_key(pack_id)
    got = dst.size(key)  # KeyNotFound when it did not land: retried
    if got != size:
        raise ReplicationError(f"{key} on {dst.describe()} has {got} bytes, not {size}")
    problem = check_pack_trailer(dst, pack_id)
    if problem is not None:
        raise ReplicationError(f"{key} on {dst.describe()} did not land intact: {problem}")


def _put_pack(src: Store, dst: Store, key: str, gate: Callable[[], None] | None) -> int:
    """Copy a pack from ``src`` to ``dst``; returns its size. On an object store a pack larger than UPLOAD_PART goes
    up as a multipart upload (visible only when completed, docs/format.md §10.1), read and sent part by part with
    ``gate()`` before each, so a save that starts while a pack is being sent competes with one part at most."""
    from .store import FsspecStore

    size = src.size(key)
    if gate is None or not isinstance(dst, FsspecStore) or size <= UPLOAD_PART:
        blob = src.get(key)
        dst.put_if_absent(key, blob)
        return len(blob)
    f = dst._call("put", key, dst._fs.open, dst._path(key), "wb", block_size=UPLOAD_PART)
    try:
        for off in range(0, size, UPLOAD_PART):
            gate()
            part = src.get_range(key, off, UPLOAD_PART)
            if len(part) != min(UPLOAD_PART, size - off):
                raise ReplicationError(f"{key} changed size while it was being sent")
            dst._call("put", key, f.write, part)
        gate()  # completing the upload costs the server a pass over the object too
        dst._call("put", key, f.close)
    except BaseException:
        try:
            f.discard()  # abort the multipart upload: nothing becomes visible
        except Exception:  # noqa: BLE001 - the bucket's lifecycle rule removes abandoned parts
            pass
        f.closed = True
        raise
    return size


class _IndexMap:
    """pack id -> index files naming it, in a source store (index files are write-once: parsed once each)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._packs: dict[str, dict[str, set[str]]] = {}  # index key -> {pack ids}
        self._by_pack: dict[str, set[str]] = {}

    def lookup(self, src: Store, packs: set[str]) -> dict[str, set[str]]:
        if any(p not in self._by_pack for p in packs) or self._seen:
            keys = [k for k in src.list("index/") if is_index_key(k)]
            if not self._seen.issubset(keys):  # gc consolidated the index files: forget what they said
                self._seen.clear()
                self._packs.clear()
                self._by_pack.clear()
            if all(p in self._by_pack for p in packs):
                keys = []
            for key in keys:
                if key in self._seen or not key.endswith(".json"):
                    continue
                try:
                    ids = _index_packs(src, key)
                except (IntegrityError, KeyNotFound, StorageError):
                    continue
                self._seen.add(key)
                self._packs[key] = ids
                for p in ids:
                    self._by_pack.setdefault(p, set()).add(key)
        out: dict[str, set[str]] = {}
        for p in packs:
            for key in self._by_pack.get(p, ()):
                out[key] = self._packs[key]
        return out


def _index_packs(src: Store, key: str) -> set[str]:
    """The pack ids an index file names (docs/format.md §7)."""
    return {loc.pack for loc in parse_index(src.get_limited(key, MAX_INDEX_BYTES), key).values()}


def copy_checkpoint(src: Store, dst: Store, run: str, step: int, *, indexes: _IndexMap | None = None,
                    gate: Callable[[], None] | None = None, on_pack: Callable[[str, bool], None] | None = None,
                    commit: Callable[[Callable[[], None]], None] | None = None) -> bytes | None:
    """Copy checkpoint ``run``/``step`` from ``src`` to ``dst`` and verify it there; returns the manifest bytes, or
    None when ``src`` no longer has the checkpoint (pruned meanwhile).

    Order (docs/format.md §10.2): packs the manifest references that ``dst`` lacks (each verified: size and
    trailer hash == pack id), the index files naming them once all their packs are on ``dst``, the run record and
    the checkpoint's pin, then the manifest (read back and compared) — the commit point on ``dst``. ``gate()`` is
    called before each pack (it may block while a save runs); ``commit(fn)`` runs the manifest step (to take a
    lock around it).
    """
    from .checkpoint.runrecord import pin_key, record_key

    mkey = manifest_key(run, step)
    try:
        data = src.get_limited(mkey, MAX_MANIFEST_BYTES)
    except KeyNotFound:
        return None
    m = parse_manifest(data, mkey, run, step)  # never copy a damaged manifest
    packs = list(dict.fromkeys(m.doc["packs"]))
    for pack_id in packs:
        if gate is not None:
            gate()
        key = pack_key(pack_id)
        if dst.exists(key):  # landed before (an earlier attempt, a killed process, another checkpoint)
            try:
                _verify_pack(dst, pack_id, src.size(key))  # three small ranged reads, nothing re-sent
            except ReplicationError:
                dst.delete(key)  # damaged there: send it again below
            else:
                if on_pack is not None:
                    on_pack(pack_id, False)
                continue
        size = _put_pack(src, dst, key, gate)
        try:
            _verify_pack(dst, pack_id, size)
        except ReplicationError:
            dst.delete(key)  # never leave a damaged pack where a later attempt would take it as landed
            raise
        if on_pack is not None:
            on_pack(pack_id, True)
        crashpoint("tier.pack.landed")
    on_dst = set(packs)
    for ikey, named in sorted((indexes or _IndexMap()).lookup(src, set(packs)).items()):
        if dst.exists(ikey):
            continue
        if all(p in on_dst or dst.exists(pack_key(p)) for p in named):  # rule 1: packs before their index
            try:
                idata = src.get_limited(ikey, MAX_INDEX_BYTES)
            except KeyNotFound:  # gc replaced it meanwhile: index files only steer dedup, skip it
                continue
            dst.put_if_absent(ikey, idata)
            _verify_small(dst, ikey, idata)
    for key, limit in ((record_key(run), MAX_RECORD_BYTES), (pin_key(run, step), MAX_SMALL_BYTES)):
        try:
            extra = src.get_limited(key, limit)
        except KeyNotFound:
            continue
        if key.startswith("refs/"):
            dst.put(key, extra)
        elif not dst.put_if_absent(key, extra):
            continue
        _verify_small(dst, key, extra)

    def put_manifest() -> None:
        if not dst.put_if_absent(mkey, data) and _get_or_none(dst, mkey, MAX_MANIFEST_BYTES) != data:
            dst.put(mkey, data)  # the checkpoint was saved again with overwrite=True: the source is authoritative
        _verify_small(dst, mkey, data)

    if commit is not None:
        commit(put_manifest)
    else:
        put_manifest()
    return data


def ensure_repository(local: Store, dst: Store) -> None:
    """Make ``dst`` a repository with the local config (same repo_id), or check that it is one."""
    config = local.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
    mine = RepoConfig.from_bytes(config, local.describe())
    try:
        theirs = RepoConfig.from_bytes(dst.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), dst.describe())
    except KeyNotFound:
        if dst.put_if_absent(CONFIG_KEY, config):
            return
        theirs = RepoConfig.from_bytes(dst.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), dst.describe())
    if theirs.repo_id != mine.repo_id:
        raise ConfigConflictError(
            f"{dst.describe()} holds another luopan repository (repo_id {theirs.repo_id}, not {mine.repo_id}); "
            "replicate to an empty prefix or to a replica of this repository"
        )


# -- policies ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColdPolicy:
    """Move checkpoints that are not pinned and older than ``older_than`` (``"7d"``, ``"36h"``, seconds) to ``url``.

    Applied by ``repo.apply_cold_policy()`` (or ``luopan cold``): each is copied and verified like a replication,
    then removed from the hot tiers (local and remote manifests); loads fall back to the cold store.
    """

    url: str
    older_than: str | float = "7d"
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        from .retention import parse_duration

        if isinstance(self.older_than, (int, float)) and not isinstance(self.older_than, bool):
            if not self.older_than > 0:
                raise UsageError(f"ColdPolicy.older_than must be > 0, got {self.older_than!r}")
            return float(self.older_than)
        return parse_duration(self.older_than)


def _open_tier(location: str | os.PathLike[str] | Store, options: dict[str, Any] | None, what: str) -> Store:
    if isinstance(location, Store):
        return location
    loc = os.fspath(location)
    if not loc:
        raise InvalidNameError(f"{what} must be a path or URL, got an empty string")
    if options and is_object_url(loc):
        from .store import FsspecStore

        return FsspecStore(loc, **options)
    return open_store(loc)


def _same_place(a: Store, b: Store) -> bool:
    if a is b:
        return True
    ra, rb = getattr(a, "root", None), getattr(b, "root", None)
    if ra is not None and rb is not None:
        return os.path.realpath(ra) == os.path.realpath(rb) or os.path.realpath(rb).startswith(
            os.path.realpath(ra) + os.sep) or os.path.realpath(ra).startswith(os.path.realpath(rb) + os.sep)
    return a.describe() == b.describe() and not a.describe().startswith("memory")


def parse_tier_config(data: bytes, where: str) -> dict[str, Any]:
    """``tier/config.json``: ``replicate_to`` (a URL or path) and ``cold`` ({"url", "older_than"}), both optional.
    CorruptRepoError on any damage."""
    doc = unseal_file(data, where)
    cold = doc.get("cold")
    if not isinstance(doc.get("replicate_to", ""), str) or (cold is not None and not (
            isinstance(cold, dict) and isinstance(cold.get("url"), str) and isinstance(cold.get("older_than", ""),
                                                                                        str))):
        raise CorruptRepoError(f"{where} is damaged: replicate_to must be a URL and cold {{url, older_than}}")
    return doc


def read_tier_config(local: Store) -> dict[str, Any] | None:
    try:
        data = local.get_limited(TIER_CONFIG_KEY, MAX_SMALL_BYTES)
    except KeyNotFound:
        return None
    return parse_tier_config(data, f"{TIER_CONFIG_KEY} in {local.describe()}")


# -- the replicator ---------------------------------------------------------------------------------------------
class Tier:
    """The tiering of one open repository (``repo.tier``): replication thread, status, eviction, cold moves."""

    def __init__(self, repo: Repo, store: TieredStore, *, replicate_to: str | None,
                 local_retention: Any = None, cold: ColdPolicy | None = None) -> None:
        self.repo = repo
        self.store = store
        self.local = store.local
        self.remote = store.remote
        self.cold_store = store.cold
        self.url = replicate_to
        self.local_retention = local_retention
        self.cold = cold
        self.backoff_initial = BACKOFF_INITIAL
        self.backoff_max = BACKOFF_MAX
        self.lock_timeout: float | None = DEFAULT_TIMEOUT
        self.last_error: BaseException | None = None
        self.failed: dict[tuple[str, int], str] = {}  # permanent failures of this process
        self.sent_packs = 0  # packs uploaded by this process (skipped ones not counted)
        self.sent_bytes = 0
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, int]] = deque()
        self._queued: set[tuple[str, int]] = set()
        self._current: tuple[str, int] | None = None
        self._again: set[tuple[str, int]] = set()
        self._saving = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._indexes = _IndexMap()
        self._remote_ready = False

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the replication thread and queue every local checkpoint not yet confirmed on the remote (those a
        killed process left pending, and ones saved before tiering)."""
        if self.remote is None or (self._thread is not None and self._thread.is_alive()):
            return
        for run, step in self._unreplicated():
            self._enqueue(run, step)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="luopan-replicate", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = -1.0) -> None:
        """Stop the thread after the pack in progress, waiting at most ``timeout`` seconds (default
        CLOSE_TIMEOUT); what is left stays pending for the next open."""
        if timeout is not None and timeout < 0:
            timeout = CLOSE_TIMEOUT
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- hooks from the repository ------------------------------------------------------------------------------
    @contextmanager
    def saving(self) -> Iterator[None]:
        """Held while a save writes: the replicator starts no new pack upload meanwhile, so background replication
        does not compete with the training loop for CPU and disk."""
        with self._cv:
            self._saving += 1
        try:
            yield
        finally:
            with self._cv:
                self._saving -= 1
                self._cv.notify_all()

    def committed(self, run: str, step: int) -> None:
        """A checkpoint was committed locally: mark it pending (a small local file) and queue it."""
        if self.remote is None:
            return
        try:
            self.local.delete(replicated_key(run, step))  # overwrite=True of a replicated step: replicate it again
            self.local.put(pending_key(run, step), seal({"format_version": BASE_FORMAT_VERSION, "run": run,
                                                         "step": step, "created": _now()}))
        except OSError as exc:  # the checkpoint is committed: never fail its save for a status record
            warnings.warn(f"could not record run {run!r} step {step} as pending replication ({exc}); it is "
                          "replicated anyway (every open queues checkpoints not confirmed on the remote)",
                          stacklevel=3)
        self._enqueue(run, step)

    def _copy_pin(self, run: str, step: int) -> None:
        from .checkpoint.runrecord import pin_key

        assert self.remote is not None
        try:
            pin = self.local.get_limited(pin_key(run, step), MAX_SMALL_BYTES)
        except KeyNotFound:
            return
        try:
            there = _get_or_none(self.remote, pin_key(run, step), MAX_SMALL_BYTES)
        except KeyNotFound:
            there = None
        if there != pin:
            self.remote.put(pin_key(run, step), pin)

    def pinned(self, run: str, step: int, data: bytes) -> None:
        """A pin was added locally: copy it to the remote now if the checkpoint is there already (otherwise its
        replication copies it). Unpinning needs nothing here: a delete reaches every tier."""
        from .checkpoint.runrecord import pin_key

        if self.remote is None:
            return
        try:
            if self.remote.exists(manifest_key(run, step)):
                self.remote.put(pin_key(run, step), data)
        except OSError as exc:
            warnings.warn(f"run {run!r} step {step} is pinned here, but the pin could not be copied to the remote "
                          f"({exc}); pin it again once the remote can be reached", stacklevel=3)

    def _enqueue(self, run: str, step: int) -> None:
        with self._cv:
            if self._current == (run, step):
                self._again.add((run, step))  # changed while being copied (overwrite=True): copy it once more
            if (run, step) not in self._queued:
                self._queued.add((run, step))
                self._queue.append((run, step))
                self._cv.notify_all()

    # -- status -------------------------------------------------------------------------------------------------
    def _local_steps(self, run: str) -> set[int]:
        return set(catalog.scan(self.local, run).steps.get(run, []))

    def _marked(self, kind: str, run: str) -> set[int]:
        out = set()
        for key in self.local.list(f"tier/{kind}/{run}/"):
            stem = key.rsplit("/", 1)[-1].removesuffix(".json")
            if stem.isdigit():
                out.add(int(stem))
        return out

    def _unreplicated(self) -> list[tuple[str, int]]:
        return [(run, s) for run, s in catalog.scan(self.local).pairs() if not self._confirmed(run, s)]

    def status(self, run: str) -> dict[int, str]:
        """step -> "local" (only here, replication queued or not started), "replicating" (being copied now),
        "replicated" (confirmed on the remote, still here), "remote" (evicted here, on the remote), "cold"."""
        check_run(run)
        local = self._local_steps(run)
        done = self._marked("replicated", run)
        pending = self._marked("pending", run)
        with self._cv:
            current = self._current
        out: dict[int, str] = {}
        for step in local:
            if step in done and step not in pending and self._confirmed(run, step):
                out[step] = "replicated"
            elif current == (run, step) or (step in pending and self._pending_elsewhere(run, step)):
                out[step] = "replicating"
            else:
                out[step] = "local"
        for tier, name in ((self.remote, "remote"), (self.cold_store, "cold")):
            if tier is None:
                continue
            steps = self.store._soft(tier, lambda t=tier: catalog.scan(t, run).steps.get(run, []), [])
            for s in steps:
                if s not in out:
                    out[s] = name
        return dict(sorted(out.items()))

    def _pending_elsewhere(self, run: str, step: int) -> bool:
        """Another live process on this host is copying it (its pending marker says so)."""
        try:
            doc = unseal(self.local.get_limited(pending_key(run, step), MAX_SMALL_BYTES))
        except (KeyNotFound, SealError, IntegrityError):
            return False
        pid = doc.get("replicating_pid")
        return pid != os.getpid() and pid_alive(pid)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued checkpoint is replicated (True) or ``timeout`` passes (False). Raises
        ReplicationError naming checkpoints that failed for good (e.g. a damaged local manifest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._current is not None:
                if not self.running:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            idle = not self._queue and self._current is None
        if self.failed:
            raise ReplicationError("could not replicate: " + "; ".join(
                f"run {r!r} step {s}: {why}" for (r, s), why in sorted(self.failed.items())))
        return idle

    # -- the thread ---------------------------------------------------------------------------------------------
    def _gate(self) -> None:
        with self._cv:
            while self._saving and not self._stop:
                self._cv.wait(0.5)
            if self._stop:
                raise _Stopped()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                item = self._queue[0]
                self._current = item
            try:
                done = self._replicate_with_retries(*item)
            except _Stopped:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()
                return
            if done:  # before the item counts as done, so wait_replicated() returns after eviction too
                try:
                    self.evict(item[0])
                except Exception as exc:  # noqa: BLE001 - eviction is housekeeping: report, keep replicating
                    warnings.warn(f"local eviction of run {item[0]!r} failed: {exc}", stacklevel=1)
            with self._cv:
                self._queue.popleft()
                if item in self._again:
                    self._again.discard(item)
                    self._queue.append(item)
                else:
                    self._queued.discard(item)
                self._current = None
                self._cv.notify_all()

    def _replicate_with_retries(self, run: str, step: int) -> bool:
        pause = self.backoff_initial
        while True:
            self._gate()
            try:
                return self.replicate(run, step)
            except _Stopped:
                raise
            except OSError as exc:  # network, server, a pack that did not land: transient, try again
                self.last_error = exc
            except ReplicationError as exc:  # verification failed: the copy is resent
                self.last_error = exc
            except Exception as exc:  # noqa: BLE001 - a damaged local manifest, a foreign remote, a bug: retrying
                self.last_error = exc  # will not help; reported by wait_replicated(), never lost with the thread
                self.failed[(run, step)] = str(exc)
                warnings.warn(f"run {run!r} step {step} will not be replicated: {exc}", stacklevel=1)
                return False
            with self._cv:
                self._cv.wait(pause * (0.75 + 0.5 * random.random()))
                if self._stop:
                    raise _Stopped()
            pause = min(pause * 2, self.backoff_max)

    def replicate(self, run: str, step: int) -> bool:
        """Copy one checkpoint to the remote now (the thread's work; callable directly). True when confirmed."""
        assert self.remote is not None
        if not self._remote_ready:
            ensure_repository(self.local, self.remote)
            self._remote_ready = True
        self._mark_started(run, step)

        def on_pack(pack_id: str, sent: bool) -> None:
            if sent:
                self.sent_packs += 1
                try:
                    self.sent_bytes += self.local.size(pack_key(pack_id))
                except KeyNotFound:
                    pass

        def commit(put_manifest: Callable[[], None]) -> None:
            # The local shared lock orders this against a prune of the same checkpoint (which deletes it on both
            # tiers under the exclusive lock): a pruned checkpoint is never brought back on the remote.
            with locked(self.local, "shared", f"replication of {run} step {step}", timeout=self.lock_timeout):
                if self.local.exists(manifest_key(run, step)):
                    put_manifest()

        with locked(self.remote, "shared", f"replication of {run} step {step}", timeout=self.lock_timeout):
            data = copy_checkpoint(self.store, self.remote, run, step, indexes=self._indexes, gate=self._gate,
                                   on_pack=on_pack, commit=commit)
        if data is None or not self.local.exists(manifest_key(run, step)):
            self.local.delete(pending_key(run, step))  # pruned meanwhile: nothing to replicate
            return False
        try:
            now_local = self.local.get_limited(manifest_key(run, step), MAX_MANIFEST_BYTES)
        except KeyNotFound:
            self.local.delete(pending_key(run, step))
            return False
        if now_local != data:  # saved again (overwrite=True) while we copied: copy the new one
            raise ReplicationError(f"run {run!r} step {step} changed during replication; copying it again")
        self._copy_pin(run, step)  # a pin added after copy_checkpoint looked for it, before the manifest landed
        # The marker names the manifest it confirms: if an overwrite lands after this point, eviction and the next
        # open see that the local manifest is no longer the one confirmed (_confirmed).
        self.local.put(replicated_key(run, step), seal({"format_version": BASE_FORMAT_VERSION, "run": run,
                                                        "step": step, "replicated": _now(),
                                                        "remote": self.remote.describe(),
                                                        "manifest_checksum": sealed_checksum(data)}))
        self.local.delete(pending_key(run, step))
        return True

    def _confirmed(self, run: str, step: int) -> bool:
        """Whether the remote holds exactly the local manifest of ``step`` (its replicated marker names it)."""
        try:
            marker = unseal(self.local.get_limited(replicated_key(run, step), MAX_SMALL_BYTES))
        except (KeyNotFound, SealError, IntegrityError):
            return False
        try:
            local = self.local.get_limited(manifest_key(run, step), MAX_MANIFEST_BYTES)
        except KeyNotFound:
            return True  # evicted: only the remote has it, as confirmed
        return marker.get("manifest_checksum") == sealed_checksum(local)

    def _mark_started(self, run: str, step: int) -> None:
        try:
            doc = unseal(self.local.get_limited(pending_key(run, step), MAX_SMALL_BYTES))
        except (KeyNotFound, SealError, IntegrityError):
            doc = {"format_version": BASE_FORMAT_VERSION, "run": run, "step": step, "created": _now()}
        doc.pop("checksum", None)
        doc.update(replicating_pid=os.getpid(), started=_now())
        self.local.put(pending_key(run, step), seal(doc))

    # -- eviction and cold moves ----------------------------------------------------------------------------------
    def evict(self, run: str, rules: Any = None) -> list[int]:
        """Apply ``rules`` (default: the repository's ``local_retention``) to the local copies of ``run``'s
        checkpoints and remove the local manifests of those the rules drop — only ones confirmed on the remote.
        Their packs become local garbage for gc; loads fall back to the remote. Returns the evicted steps."""
        from .checkpoint.repo import CheckpointInfo
        from .retention import Checkpoint, plan

        rules = rules if rules is not None else self.local_retention
        if rules is None or self.remote is None:
            return []
        pins = self.repo.run(run).pins()
        items = []
        for step in sorted(self._local_steps(run)):
            key = manifest_key(run, step)
            try:
                m = parse_manifest(self.local.get_limited(key, MAX_MANIFEST_BYTES), key, run, step)
            except (KeyNotFound, LuopanError):
                continue
            tag = pins.get(step, {}).get("tag")
            items.append(Checkpoint.from_info(CheckpointInfo.from_manifest(m, key), pinned=step in pins,
                                              tags=(tag,) if tag else ()))
        if not items:
            return []
        decided = plan(items, rules)
        if not any(self._confirmed(run, step) for step in decided.remove):
            return []
        # Under the exclusive local lock, like a prune: an overwrite=True save of a step cannot land between the
        # check that the remote holds this very manifest and the local delete.
        with locked(self.local, "exclusive", f"eviction of {run}", timeout=self.lock_timeout):
            return self._evict_locked(run, decided.remove)

    def _evict_locked(self, run: str, steps: list[int]) -> list[int]:
        evicted = []
        for step in steps:
            if not self._confirmed(run, step):
                continue  # never evict what the remote has not confirmed (or an older version of it)
            if not self.remote.exists(manifest_key(run, step)):
                self.local.delete(replicated_key(run, step))  # the remote lost it: replicate it again
                self._enqueue(run, step)
                continue
            self.store.evict(manifest_key(run, step))
            evicted.append(step)
        return evicted

    def apply_cold_policy(self, now: datetime | None = None, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Move every checkpoint that is not pinned, not waiting for replication and older than the policy's
        threshold (by its manifest's ``created``) to the cold store: copy, verify, then delete its manifest from
        the local and remote tiers. Returns the (run, step) moved (or that would be, with ``dry_run``)."""
        from .retention import parse_time

        if self.cold is None or self.cold_store is None:
            raise ConfigConflictError("this repository has no cold policy: open it with cold=ColdPolicy(url, ...)")
        now = now or datetime.now(timezone.utc)
        limit = self.cold.seconds
        cold = self.cold_store
        moved = []
        for run, steps in catalog.scan(self.repo.store).steps.items():
            pins = self.repo.run(run).pins()
            status = self.status(run) if self.remote is not None else {}
            for step in steps:
                if step in pins or status.get(step) in ("local", "replicating", "cold"):
                    continue
                hot = [t for t in (self.local, self.remote) if t is not None and t.exists(manifest_key(run, step))]
                if not hot:
                    continue
                m = self.repo.manifest(run, step)
                if (now - parse_time(m.created)).total_seconds() < limit:
                    continue
                moved.append((run, step))
                if dry_run:
                    continue
                ensure_repository(self.local, cold)
                with locked(cold, "shared", f"cold move of {run} step {step}", timeout=self.lock_timeout):
                    data = copy_checkpoint(_HotView(self.store), cold, run, step, indexes=_IndexMap())
                if data is None:
                    moved.pop()
                    continue
                with locked(self.local, "shared", f"cold move of {run} step {step}", timeout=self.lock_timeout):
                    self.local.put(cold_key(run, step), seal({"format_version": BASE_FORMAT_VERSION, "run": run,
                                                              "step": step, "moved": _now(), "cold": cold.describe()}))
                    for t in hot:
                        t.delete(manifest_key(run, step))
                    self.local.delete(replicated_key(run, step))
                    self.local.delete(pending_key(run, step))
        return moved


class _HotView(TieredStore):
    """The local and remote tiers of a TieredStore, without its cold tier (the source of a cold move)."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store.local, store.remote, None)


class _Stopped(Exception):
    """The replicator was asked to stop (Repo.close): the checkpoint stays pending."""


@dataclass
class TierSetup:
    store: TieredStore
    settings: dict[str, Any]
    url: str | None
    local_retention: Any
    cold: ColdPolicy | None


def setup(location: Store, *, replicate_to: Any, local_retention: Any, cold: ColdPolicy | None,
          storage_options: dict[str, Any] | None) -> TierSetup | None:
    """The TieredStore for ``open(location, replicate_to=…, cold=…)``, or None for an untiered repository.

    ``replicate_to=None`` uses the remote recorded in ``tier/config.json`` by an earlier tiered open; a URL given
    is recorded there (a different one than recorded is refused). Returns (store, settings to record).
    """
    if local_retention is not None:
        from .retention import Retention, RetentionRule, _rule_list

        try:
            rules = local_retention if isinstance(local_retention, RetentionRule) else Retention(
                *_rule_list(local_retention))
            if isinstance(rules, Retention) and not rules.rules:
                raise UsageError("no rule given")
        except (TypeError, ValueError) as exc:
            raise InvalidNameError(
                f"local_retention must be luopan.retention rules, e.g. KeepLast(2) | KeepBest(1, 'loss'): {exc}"
            ) from None
    if isinstance(location, TieredStore):
        return TierSetup(location, {}, None, local_retention, cold)
    recorded = read_tier_config(location) or {}
    settings: dict[str, Any] = {}
    url = replicate_to
    if url is None:
        url = recorded.get("replicate_to")
    elif not isinstance(url, Store):
        url = os.fspath(url)
        if recorded.get("replicate_to") not in (None, url):
            raise ConfigConflictError(
                f"{location.describe()} replicates to {recorded['replicate_to']}, not {url}; to change the remote, "
                f"delete {TIER_CONFIG_KEY} there (checkpoints are then replicated again to the new remote)")
        settings["replicate_to"] = url
    if cold is None and recorded.get("cold"):
        c = recorded["cold"]
        cold = ColdPolicy(c["url"], c.get("older_than", "7d"))
    elif cold is not None:
        if not isinstance(cold, ColdPolicy):
            raise ArgumentTypeError(f"cold must be a luopan.ColdPolicy, got {type(cold).__name__}")
        cold.seconds  # noqa: B018 - validates the threshold now
        if isinstance(cold.url, str):
            settings["cold"] = {"url": cold.url, "older_than": cold.older_than}
    if local_retention is not None and url is None:
        raise ConfigConflictError("local_retention needs replicate_to: local copies are evicted only once the "
                                  "remote has them")
    if url is None and cold is None:
        return None
    remote = _open_tier(url, storage_options, "replicate_to") if url is not None else None
    cold_store = None
    if cold is not None:
        cold_store = _open_tier(cold.url, cold.storage_options or storage_options, "the cold URL")
    for tier, what in ((remote, "replicate_to"), (cold_store, "the cold URL")):
        if tier is not None and _same_place(location, tier):
            raise ConfigConflictError(f"{what} ({tier.describe()}) is the repository itself or inside it "
                                      f"({location.describe()}): replicate to another place")
    if remote is not None and cold_store is not None and _same_place(remote, cold_store):
        raise ConfigConflictError(f"the cold URL ({cold_store.describe()}) is the replication target itself")
    shown = url if isinstance(url, str) else (remote.describe() if remote is not None else None)
    return TierSetup(TieredStore(location, remote, cold_store), settings, shown, local_retention, cold)


def attach(repo: Repo, tiering: TierSetup, *, start: bool = True) -> Repo:
    """Give an opened repository its Tier: check (or create) the remote repository where it can be reached now,
    record the settings in ``tier/config.json``, and start replication (``start``)."""
    store = tiering.store
    if store.remote is not None:
        try:
            ensure_repository(store.local, store.remote)
        except ConfigConflictError:
            raise
        except OSError as exc:  # unreachable now: the replication thread keeps trying
            warnings.warn(f"the remote {store.remote.describe()} cannot be reached ({exc}); checkpoints are kept "
                          "locally and replicated once it can", stacklevel=3)
    record_settings(store.local, tiering.settings)
    tier = Tier(repo, store, replicate_to=tiering.url, local_retention=tiering.local_retention, cold=tiering.cold)
    repo.tier = tier
    store.on_manifest_replaced = tier.committed
    store.manifests_known_locally = True
    if start:
        tier.start()
    return repo


def record_settings(local: Store, settings: dict[str, Any]) -> None:
    if not settings:
        return
    recorded = read_tier_config(local) or {}
    recorded.pop("checksum", None)
    new = {**recorded, **settings, "format_version": BASE_FORMAT_VERSION}
    if new != recorded:
        local.put(TIER_CONFIG_KEY, seal(new))
