"""``luopan.open`` and ``luopan.Repo``: one repository holding every kind (checkpoints, artifacts, journals, index
snapshots), composed on the kind-agnostic core (luopan.repository)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._compat import deprecated_alias
from ._moved import given as _given, moved, step_second as _step_second
from .artifact import ARTIFACTS_KIND, Artifact
from .checkpoint import CHECKPOINTS, CheckpointInfo, Checkpoints, DeltaPolicy, Run, SaveHandle, VerifyReport
from .errors import UsageError
from .format.config import Compression, RepoConfig
from .format.manifest import Manifest
from .index import INDEX_KIND, IndexStore
from .journal import JOURNAL_KIND, Journal
from .repository.wal import DEFAULT_SEGMENT_BYTES
from .repository.core import Repository
from .repository.gc import DEFAULT_GRACE, DEFAULT_REPACK_BELOW, collect
from .repository.gcreport import GcReport
from .repository.locks import DEFAULT_TIMEOUT
from .repository.opening import check_new, check_open_options, connect
from .repository.preflight import DEFAULT_SPACE_MARGIN
from .repository.tiersetup import attach
from .repository.usage import usage
from .retention import Plan, Rules
from .store import Store

def _through(part: str, name: str) -> property:
    """A settable attribute of Repo kept by one of its parts (``repository`` or ``checkpointing``)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


KINDS = (ARTIFACTS_KIND, CHECKPOINTS, JOURNAL_KIND, INDEX_KIND)  # the kind registry, in resolve() order


class Repo:
    """A luopan repository: checkpoints of runs, versioned artifacts, journals and vector-index snapshots, sharing one
    content-addressed store. A thin composition (docs/architecture.md): ``repository`` is the kind-agnostic core
    (luopan.repository.core.Repository), ``checkpointing`` the checkpoint kind (luopan.checkpoint.Checkpoints);
    ``artifact``, ``journal`` and ``index`` open the other kinds' façades. Not safe for concurrent writes from several
    threads of one process."""

    kinds = KINDS  # resolve() tries them in this order

    def __init__(self, store: Store, config: RepoConfig, delta_policy: DeltaPolicy | None = None) -> None:
        self.repository = Repository(store, config, KINDS)
        self.checkpointing = Checkpoints(self.repository, delta_policy)

    def __repr__(self) -> str:
        return f"luopan.Repo({self.repository.where!r})"

    def __enter__(self) -> Repo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return moved(self, name)  # a name that moved off the public face: still works, with a DeprecationWarning

    # -- what the repository is ---------------------------------------------------------------------------------
    store = property(lambda self: self.repository.store)
    config = property(lambda self: self.repository.config)
    where = property(lambda self: self.repository.where)
    tier = property(lambda self: self.repository.tier)  # the tiering of a tiered repository, else None
    delta_policy = _through("checkpointing", "delta_policy")
    lock_timeout = _through("repository", "lock_timeout")
    space_margin = _through("repository", "space_margin")
    read_check = _through("checkpointing", "read_check")
    progress = _through("checkpointing", "progress")

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def save(self, run: str, step: int, state: Any, *, metrics: dict[str, Any] | None = None,
             metadata: dict[str, Any] | None = None, overwrite: bool = False, trust_versions: bool = False,
             touched_rows: dict[str, Any] | None = None, inputs: list[str] | None = None,
             progress: bool | None = None, group: Any = None) -> CheckpointInfo:
        """Save ``state`` (a nested dict/list of tensors, arrays and JSON values) as checkpoint ``step`` of ``run``:
        only the chunks the repository lacks are written, and the checkpoint appears atomically (docs/format.md §10).
        ``group`` (a process group, or True): every rank calls it, one checkpoint (luopan.checkpoint.distributed.collective).
        See ``luopan.checkpoint.Checkpoints.save`` for every keyword."""
        options = _given(metrics=metrics, metadata=metadata, overwrite=overwrite, trust_versions=trust_versions,
                         touched_rows=touched_rows, inputs=inputs, progress=progress)
        return self.checkpointing.save(run, step, state, group=group, **options)

    def save_async(self, run: str, step: int, state: Any, *, metrics: dict[str, Any] | None = None,
                   metadata: dict[str, Any] | None = None, overwrite: bool = False, trust_versions: bool = False,
                   touched_rows: dict[str, Any] | None = None, inputs: list[str] | None = None,
                   overlap: bool = True, progress: bool | None = None) -> SaveHandle:
        """Copy ``state`` to host memory now and save it in the background; returns a SaveHandle (``.wait()``).
        See ``luopan.checkpoint.Checkpoints.save_async``."""
        return self.checkpointing.save_async(run, step, state, metrics=metrics, metadata=metadata,
                                             overwrite=overwrite, trust_versions=trust_versions,
                                             touched_rows=touched_rows, inputs=inputs, overlap=overlap,
                                             progress=progress)

    def load(self, run: str, step: int | None = None, *, group: Any = None, pieces: bool = False) -> Any:
        """The state of checkpoint ``step`` of ``run`` (the latest when None), every chunk verified. Sharded tensors
        (a collective save's, a DCP checkpoint's) come back assembled whole; ``pieces=True``: each shard as stored,
        under ``<path>/shard-<offsets>``."""
        return self.checkpointing.load(run, step, group=group, pieces=pieces)

    @_step_second("target")
    def load_into(self, run: str, step: int | None = None, target: Any = None, *, strict: bool = True,
                  group: Any = None, pieces: bool = False) -> Any:
        """Load checkpoint ``step`` (the latest when None) of ``run`` into ``target`` (a module, optimizer or
        state dict) in place; a full-size tensor is filled from a sharded tensor's shards (``pieces=True``: the
        target is keyed by the shards as stored). ``load_into(run, target, step)`` (the old order) still works,
        with a warning."""
        return self.checkpointing.load_into(run, target, step, strict=strict, group=group, pieces=pieces)

    @_step_second("path")
    def export(self, run: str, step: int | None = None, path: str | os.PathLike[str] | None = None, *,
               subtree: str | None = None, progress: Callable[[int], Any] | None = None,
               pieces: bool = False) -> dict[str, Any]:
        """Write checkpoint ``step`` (the latest when None) of ``run`` as one safetensors file at ``path``, sharded
        tensors (DCP's, a collective save's) assembled into one tensor each (``pieces=True``: each shard as stored,
        named ``<path>/shard-<offsets>``). ``export(run, path, step)`` (the old order) still works, with a warning."""
        return self.checkpointing.export(run, path, step, subtree=subtree, progress=progress, pieces=pieces)

    def diff(self, run: str, step: int, to_step: int, *, to_run: str | None = None,
             values: bool = True) -> dict[str, Any]:
        """Entries added, removed and changed from ``step`` of ``run`` to ``to_step`` of ``to_run`` (the same run when
        None); per changed tensor the size of the change (``rel_l2`` = ||b-a||/||a||, ``max_abs``, ``differing``
        elements; ``values=False``: only the bytes that differ, no tensor read) and the config diff (``config``)."""
        return self.checkpointing.diff(run, step, to_step, to_run=to_run, values=values)

    def verify(self, run: str | None = None, step: int | None = None, *,
               progress: Callable[[int], Any] | None = None, on_total: Callable[[int], Any] | None = None,
               trusted_keys: Any = None, structure: bool = False) -> VerifyReport:
        """Read back and check every chunk of every manifest (of ``run``, of ``step``); ``structure=True``: the
        manifests and every row against its pack, no chunk read. See ``luopan.checkpoint.Checkpoints.verify``."""
        return self.checkpointing.verify(run, step, progress=progress, on_total=on_total, trusted_keys=trusted_keys,
                                         structure=structure)

    def checkpoints(self, run: str) -> list[CheckpointInfo]:
        """The committed checkpoints of ``run``, oldest first."""
        return self.checkpointing.checkpoints(run)

    def steps(self, run: str) -> list[int]:
        """The committed steps of ``run``, ascending."""
        return self.checkpointing.steps(run)

    def runs(self) -> list[str]:
        """The runs with at least one committed checkpoint, sorted."""
        return self.checkpointing.runs()

    def manifest(self, run: str, step: int | None = None) -> Manifest:
        """The verified manifest of checkpoint ``step`` of ``run`` (the latest when None)."""
        return self.checkpointing.manifest(run, step)

    def run(self, name: str) -> Run:
        """A run: its record, eval logs, pins and signatures (luopan.checkpoint.runs.record.Run)."""
        return self.checkpointing.run(name)

    def delete(self, run: str, step: int, *, reclaim: bool = False) -> bool:
        """Remove checkpoint ``step`` of ``run`` now (pinned ones are refused); returns whether it existed.
        ``reclaim=True`` also frees at once the packs only it needed (else the next ``gc`` does)."""
        return self.checkpointing.delete(run, step, reclaim=reclaim)

    def prune(self, run: str, retention: Rules | None = None, *, dry_run: bool = False,
              missing_metrics: str = "error", rules: Rules | None = None) -> Plan:
        """Remove the checkpoints of ``run`` that ``retention`` does not keep; see
        ``luopan.checkpoint.Checkpoints.prune``."""
        return self.checkpointing.prune(run, retention, dry_run=dry_run, missing_metrics=missing_metrics,
                                        rules=rules)

    # -- the other kinds --------------------------------------------------------------------------------------------
    def artifact(self, name: str) -> Artifact:
        """The artifact ``name`` ("datasets/clean": run names joined by '/'); it exists once committed."""
        return Artifact(self.repository, name)

    def journal(self, name: str = "main", fsync: str = "always", *, batch_records: int = 64,
                batch_ms: float = 10.0, segment_bytes: int = DEFAULT_SEGMENT_BYTES, read_only: bool = False) -> Journal:
        """The journal ``name`` of this repository, opened for appending (docs/format.md §16); see
        ``luopan.journal.Journal`` for ``fsync`` and the other options."""
        return Journal(self.repository, fsync, name=name, batch_records=batch_records, batch_ms=batch_ms,
                       segment_bytes=segment_bytes, read_only=read_only)

    def index(self, name: str, *, fsync: str = "always") -> IndexStore:
        """The vector index ``name`` of this repository (FAISS snapshots, docs/format.md §17)."""
        return IndexStore(self.repository, name, fsync=fsync)

    # -- the whole repository ---------------------------------------------------------------------------------------
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
        return collect(self.repository, grace=DEFAULT_GRACE if grace is None else grace,
                       repack_below=DEFAULT_REPACK_BELOW if repack_below is None else repack_below,
                       dry_run=dry_run, log=log)

    def du(self) -> dict[str, int]:
        """Logical bytes over every manifest of every kind, the bytes their distinct chunks take as stored
        (``stored_bytes``: logical / stored is the dedup ratio ``luopan du`` and ``luopan stats`` show) and physical
        bytes in the store (``checkpoints``, ``artifacts``: how many of each; ``damaged_manifests``: ones that could
        not be read). See luopan.repository.usage."""
        return usage(self.repository)

    def close(self) -> None:
        """Wait for work in flight (raising its error if nobody saw it) and stop background threads."""
        self.repository.close()


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
    read_check: str = "blake3",
    progress: bool = True,
) -> Repo:
    """Open the repository at a path/URL, creating it (with the given options) when missing and ``create``.

    Options apply at creation; on an existing repository, an option that differs from its config is an error.
    ``delta_policy`` (not stored: it steers this process's saves) says which tables are stored as row deltas.

    Tiered storage (docs/format.md §10.2): ``replicate_to`` (a URL or path, recorded in the local
    ``tier/config.json`` so later opens need not repeat it) gets every committed checkpoint and artifact version
    copied in the background; ``local_retention`` (luopan.retention rules) evicts local copies once the remote has
    them; ``cold=luopan.ColdPolicy(url, older_than="7d")`` names where ``repo.tier.apply_cold_policy()`` moves old ones.
    ``lock_timeout`` (seconds, default 600; None waits forever) is how long a write waits for a prune/gc holding the
    exclusive lock, and prune/gc for writes (docs/format.md §9.2). ``space_margin`` (default 1.5; 0 turns it off):
    a write first checks that the disk has this many times its estimated new bytes free (§10.4). ``read_check``:
    loads check every chunk against its BLAKE3 address ("blake3", the default); "xxh3" (opt-in, for a repository
    that never leaves this machine) checks it against the XXH3-128 its manifest row lists instead: damage is caught
    as surely, for ~10x less CPU, but a crafted repository is not (docs/format.md §5.1). `verify` always uses BLAKE3.
    ``storage_options`` go to the object-store filesystem of the repository's URL and of those URLs (e.g.
    ``{"endpoint_url": …, "key": …, "secret": …}`` for S3). ``replicate=False`` opens a tiered
    repository without starting replication (reads still fall back to the remote; used by the CLI).
    ``progress=False``: saves never report on stderr (by default one that runs longer than two seconds shows a bar on
    a terminal and one line once committed; luopan.checkpoint.progress). The ``luopan`` logger's records stay.
    """
    check_open_options(lock_timeout, space_margin)
    if read_check not in ("blake3", "xxh3"):
        raise UsageError(f"read_check must be 'blake3' (the default) or 'xxh3', got {read_check!r}")
    store, config, tiering = connect(location, create=create, chunk_size=chunk_size, pack_size=pack_size,
                                     compression=compression, replicate_to=replicate_to,
                                     local_retention=local_retention, cold=cold, storage_options=storage_options)
    repo = Repo(store, config, delta_policy)
    repo.lock_timeout = lock_timeout
    repo.space_margin = space_margin
    repo.read_check = read_check
    repo.progress = bool(progress)
    if tiering is not None:
        attach(repo.repository, tiering, start=replicate)
    return repo


def init(location: str | os.PathLike[str] | Store, **options: Any) -> Repo:
    """Create a new repository; RepoExistsError if one is already there."""
    return open(check_new(location), **options)
