"""Saving checkpoints: ``save`` and ``save_async`` around one SaveRequest, the space preflight, the commit under the
shared lock (docs/format.md §9.2, §10)."""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    LuopanError,
    UnsupportedFormatError,
    UnsupportedValueError,
    UsageError,
)
from ..format.canonical import canonical
from ..format.chunking import chunk_spans
from ..format.manifest import Manifest, Row, encode_metrics
from ..format.names import check_run, check_step, manifest_key
from .base import CheckpointBase
from ..repository.transaction import Transaction
from ..repository.preflight import fits, refuse
from ..tree import flatten
from .info import CheckpointInfo, SaveHandle
from .progress import SaveProgress
from .kind import CHECKPOINTS
from .request import SaveRequest, check_json, entries_by_path, same_version, tensor_versions, touched_hints
from .rowdelta import DeltaPolicy, RowTrack
from .runs.record import RecordWriter, Run
from .deltaplan import disk_tracks
from .carry import Basis
from .grouping import basis as grouping_basis, wants_groups
from ..format.groups import GROUPS_FORMAT_VERSION
from .pipeline import write_checkpoint
from .writectx import WriteContext
from .staging import Staging


class Saving(CheckpointBase):
    """The save verbs of a repository (part of luopan.Repo)."""

    def _init_saving(self, delta_policy: DeltaPolicy | None) -> None:
        self.delta_policy = delta_policy or DeltaPolicy()
        self._previous: dict[str, dict[str, dict[str, Any]]] = {}  # run -> path -> entry of its last save
        self._grouping: dict[str, Basis] = {}  # run -> what its next save groups by and carries (§8.5, carry.py)
        self._tracks: dict[str, dict[str, RowTrack]] = {}  # run -> path -> row-delta state (docs/format.md §5.2)
        self._bad_bases: set[str] = set()  # chunks found damaged when read back as a delta base (§5.5)
        self._checked_groups: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # entry groups read back intact
        self._recorded: set[str] = set()  # runs whose record this process has written or found
        self._versions: dict[str, dict[str, tuple[Any, ...]]] = {}  # run -> path -> tensor version record
        # key path -> (hash, size, xxh3) per chunk this process last stored there in parts (store_entries)
        self._parts_rows: dict[str, list[tuple[str, int, str]]] = {}
        # key path -> the entry this process last stored there in parts (its rows' codecs: stored_plainly)
        self._parts_entries: dict[str, dict[str, Any]] = {}
        self._parts_saves = 0  # store_entries calls of this process (spreads the codec's rechecks over them)
        self._staging = Staging()  # host buffer sets and the save_asyncs in flight (luopan.checkpoint.staging)
        self._worker: ThreadPoolExecutor | None = None
        self.progress = True  # report long saves on stderr (luopan.checkpoint.progress); luopan.open(progress=)

    @property
    def _inflight(self) -> SaveHandle | None:
        """The newest save_async in flight: one worker commits them in order, so once it is done all are."""
        return self._staging.newest()

    def _release(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._staging.release()
        self._versions.clear()
        self._tracks.clear()
        self._grouping.clear()
        self._parts_rows.clear()
        self._parts_entries.clear()
        super()._release()

    def check_inputs(self, inputs: list[str] | None) -> list[str]:
        """``inputs`` of a save checked: a list of ``NAME@N`` references to committed manifests (lineage)."""
        if inputs is None:
            return []
        if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)):
            raise UnsupportedValueError(f"inputs must be a list of 'NAME@N' strings, got {type(inputs).__name__}")
        out = []
        for text in inputs:
            kind, series, number = self.resolve(text)
            out.append(kind.ref(series, number))
        return sorted(set(out))

    def run(self, name: str) -> Run:
        """A run's record (written by its first save) and eval logs: ``repo.run("a").log_eval(step, metrics,
        samples=[…])``."""
        return Run(self, name)

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
        inputs: list[str] | None = None,
        progress: bool | None = None,
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

        ``inputs=["datasets/train@2"]`` names what the checkpoint was made from (artifact versions or other
        checkpoints, ``NAME@N``; each must exist): recorded in the manifest, shown by ``repo.lineage``.

        ``progress`` (default: the repository's, ``luopan.open(progress=)``, on): a save that runs longer than two
        seconds reports on stderr (a bar on a terminal, one line once committed); ``False`` keeps it silent. Every
        committed save also logs one INFO record to the ``luopan`` logger (luopan.checkpoint.progress). The manifest
        records the save's duration and stall (``stats.save_us``, ``stats.stall_us``: microseconds).
        """
        started = time.monotonic()
        self.drain()
        return self._commit(self._prepare(run, step, state, metrics, metadata, overwrite, trust_versions,
                                          touched_rows, inputs), (started, None, progress))

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
        inputs: list[str] | None = None,
        overlap: bool = True,
        progress: bool | None = None,
    ) -> SaveHandle:
        """Like ``save``, but returns as soon as the state is copied into reusable host buffers (CUDA tensors:
        pinned buffers, asynchronous copies on a side stream); hashing, packing and writing happen on a background
        thread. The caller may change the state right after this returns.

        ``overlap=True`` (default): the copy may run while the previous save is still writing, into a second buffer
        set; saves still commit one at a time, in call order. At most two are in flight: a third call waits for the
        first to finish. This costs up to twice the state in host memory, the second set allocated only once a call
        finds the previous save still writing; ``overlap=False`` waits for the saves in flight first and keeps one
        set. A trust_versions call that could skip a tensor also waits for them (it reuses committed chunks).
        ``handle.wait()`` returns the CheckpointInfo or raises the save's error; an error nobody waited for is raised
        by the next ``save``/``save_async``/``close`` instead, never dropped. Bad input is still raised here,
        synchronously. A process killed mid-persist leaves no visible checkpoint (the manifest is written last).
        ``progress`` as for ``save`` (a background save prints its line, never a bar); the manifest's
        ``stats.stall_us`` is the time this call blocked.
        """
        started = time.monotonic()
        staging = self._staging
        target = staging.acquire(overlap)  # raises a finished save's unseen error; waits while both sets are read
        plan = self._prepare(run, step, state, metrics, metadata, overwrite, trust_versions, touched_rows, inputs)
        # The only stall: one copy into reused host memory of everything tier 1 (trust_versions) cannot reuse for
        # certain. Reusability is decided now, while the caller waits: the background save never reads live state.
        if plan.unchanged:  # never while a save is in flight (_prepare): it decides against committed saves only
            checker = self.pack_checker()
            known = self.chunk_index()
            previous = self._previous_rows(run)
            basis, generation = self._grouping.get(run), self.index_generation

            def reusable(leaf: Any) -> bool:
                if basis is not None:  # pack by pack (carry.py), not row by row
                    shape = {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype, "shape": list(leaf.shape),
                             "nbytes": leaf.nbytes, **({"scalar": True} if leaf.scalar else {})}
                    if basis.carried(shape, checker, generation, self._bad_bases) is not None:
                        return True
                return checker.entry_reusable(previous.get(leaf.path), known)
            plan.unchanged = frozenset(i for i in plan.unchanged if reusable(plan.leaves[i]))
        plan.leaves = staging.sets[target].freeze(plan.leaves, plan.unchanged)
        plan.snapshot = True
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, "luopan-save")
            drain_at_exit(self)
        timing = (started, time.monotonic() - started, progress)
        future = self._worker.submit(self._commit_async, plan, staging.prior(plan.run), timing)
        handle = SaveHandle(future, plan.run, plan.step)
        staging.submitted(handle, target, plan.versions, _logical(plan))
        return handle

    def _commit_async(self, plan: SaveRequest, prior: Future[CheckpointInfo] | None,
                      timing: _Timing) -> CheckpointInfo:
        """The background half of save_async, on the one worker: ``prior`` (the run's save before it) is done."""
        if plan.hints and prior is not None and (not prior.done() or prior.exception() is not None):
            plan.hints = {}  # they name rows touched since a save that did not commit: detect changes instead
        return self._commit(plan, timing)

    def drain(self) -> None:
        """Wait for the saves in flight; raise an error no caller has observed (naming any other)."""
        self._staging.drain()

    def _prepare(self, run: str, step: int, state: Any, metrics: dict[str, Any] | None,
                 metadata: dict[str, Any] | None, overwrite: bool, trust_versions: bool = False,
                 touched_rows: dict[str, Any] | None = None, inputs: list[str] | None = None) -> SaveRequest:
        """Check everything about a save before any byte is written; snapshot metrics and metadata."""
        check_run(run)
        step = check_step(step)
        staging = self._staging  # busy only for save_async: save drains first
        if staging.holds(run, step) or (inputs and staging.busy()):
            self.drain()  # a save of this step in flight decides whether it exists; inputs may name one in flight
        if not overwrite and self.store.exists(manifest_key(run, step)):
            raise CheckpointExistsError(
                f"run {run!r} already has a checkpoint at step {step}; pass overwrite=True to replace it"
            )
        if overwrite:
            refuse_pinned(self, run, step)
        check_json("metadata", metadata, dict)
        try:
            encoded_metrics = encode_metrics(metrics)
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: .item() of a multi-element tensor
            raise UnsupportedValueError(f"bad metrics: {exc}; pass numbers, str, bool or None") from None
        check_json("metrics", encoded_metrics, dict)
        skeleton, leaves = flatten(state)
        # Everything that goes into the manifest is checked before any pack is written.
        check_json("state", skeleton, dict)
        metadata_copy = json.loads(canonical(metadata)) if metadata else None
        versions = tensor_versions(leaves) if trust_versions else {}
        if versions and staging.busy() and staging.could_reuse(run, versions, self._versions.get(run, {})):
            self.drain()  # reuse needs the previous save's records, rows and chunks committed (see .staging)
        seen = {} if staging.busy() else self._versions.get(run, {})  # in flight: reuse nothing, copy everything
        unchanged = frozenset(i for i, (path, rec) in versions.items()
                              if path in seen and same_version(seen[path], rec))
        plan = SaveRequest(run, step, skeleton, leaves, encoded_metrics, metadata_copy, overwrite,
                           {path: rec for path, rec in versions.values()}, unchanged, touched_hints(touched_rows, leaves),
                           inputs=self.check_inputs(inputs))
        self._preflight(plan)
        return plan

    def _preflight(self, plan: SaveRequest) -> None:
        """Refuse a save, before anything is written, when the store has less free space than ``space_margin`` times
        the bytes it is expected to write (docs/format.md §10.4).

        The estimate is an upper bound first — the state's bytes, minus tensors known unchanged (trust_versions) —
        and only when that does not fit is it refined: each chunk's XXH3-128 is compared with the same chunk of the
        run's previous checkpoint (this process's last save, else the newest on disk), and only chunks that differ
        count. A save that writes more than estimated still fails cleanly when the disk fills.
        """
        logical = _logical(plan)
        if fits(self, self.space_margin, logical + self._staging.pending_bytes()):  # + what saves in flight write
            return
        if self._staging.busy():
            self.drain()  # refine or refuse against committed saves only
            if fits(self, self.space_margin, logical):
                return
        refuse(self, self.space_margin, self._changed_bytes(plan), f"save run {plan.run!r} step {plan.step}")

    def _changed_bytes(self, plan: SaveRequest) -> int:
        """Bytes of the chunks of ``plan`` whose XXH3-128 differs from the same chunk of the run's previous
        checkpoint (an estimate for the preflight; rows read from disk are fine for that, never for dedup)."""
        previous = self._previous_rows(plan.run)
        if not previous:
            try:
                previous = entries_by_path(self.manifest(plan.run).doc)
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

    def _commit(self, plan: SaveRequest, timing: _Timing | None = None) -> CheckpointInfo:
        started, stall, show = timing if timing is not None else (time.monotonic(), None, None)
        progress = SaveProgress(plan.run, plan.step, _logical(plan), started=started, background=stall is not None,
                                enabled=self.progress if show is None else bool(show))
        try:
            # The write transaction: a shared lock (saves run side by side, prune/gc wait for them, §9.2), the
            # chunk writers, the manifest put, then the commit listeners (tiering queues the replication). The
            # space preflight ran when the save was requested (_prepare): save_async refuses before it returns.
            with self.transaction(CHECKPOINTS, plan.run, plan.step, what=f"save of {plan.run} step {plan.step}") as tx:
                info = self._commit_locked(plan, started, stall, progress, tx)
        finally:
            progress.close()
        progress.finish(info)
        return info

    def _commit_locked(self, plan: SaveRequest, started: float, stall: float | None,
                       progress: SaveProgress, tx: Transaction) -> CheckpointInfo:
        # The run's record, once (docs/format.md §8.1): built while the chunks are written, written after them
        # (also when the save fails, as before). A record is context: it never fails or masks a save.
        record = self._start_record(plan.run) if plan.run not in self._recorded else None
        try:
            newest = self._newest_on_disk(plan.run)
            known = self.chunk_index()  # read once: every attempt's chunk writer shares it
            context = WriteContext(self.store, self.config, known,
                                   lambda: tx.chunks(progress=progress.advance, known=known),
                                   lambda data, overwrite: tx.put_manifest(data, overwrite=overwrite),
                                   self._previous_rows(plan.run), self._delta_tracks(plan.run, newest),
                                   self.delta_policy, self._bad_bases, started, stall, progress.advance,
                                   basis=self._grouping_basis(plan.run, newest), generation=self.index_generation,
                                   checked_groups=self._checked_groups)
            result = write_checkpoint(context, plan)
        except BaseException:
            self._finish_record(plan.run, record)
            raise
        assert result.basis is not None
        # The next save compares with this one (carry.Basis: rows naming pack ids; XXH3s and carrying need this
        # process's own rows, §5.5), and keeps its unchanged entries in the same groups.
        self._previous[plan.run] = result.basis.entries
        self._grouping[plan.run] = result.basis
        self._tracks[plan.run] = result.tracks
        self._versions[plan.run] = plan.versions  # only after a commit: they describe what is now the previous save
        self._finish_record(plan.run, record)
        return CheckpointInfo.from_manifest(Manifest(result.doc), result.manifest_key)

    def _start_record(self, run: str) -> RecordWriter | None:
        try:
            return RecordWriter(Run(self, run))
        except Exception as exc:  # noqa: BLE001 - e.g. no thread could be started: the save goes on without it
            warnings.warn(f"run {run!r}: the run record could not be written ({exc})", stacklevel=4)
            self._recorded.add(run)
            return None

    def _finish_record(self, run: str, record: RecordWriter | None) -> None:
        if record is None:
            return
        try:
            record.write()
        except Exception as exc:  # noqa: BLE001 - whatever building or writing it raised, the save stands
            warnings.warn(f"run {run!r}: the run record could not be written ({exc})", stacklevel=4)
        self._recorded.add(run)

    def _newest_on_disk(self, run: str) -> Callable[[], dict[str, Any] | None]:
        """The document of the run's newest checkpoint on disk, read once when first asked for (a process's first
        save of a run: delta bases and entry groups both start from it); None if there is none or it is unreadable."""
        cache: list[dict[str, Any] | None] = []

        def newest() -> dict[str, Any] | None:
            if not cache:
                try:
                    cache.append(self.manifest(run).doc)
                except (LuopanError, OSError):
                    cache.append(None)  # no checkpoint yet, or an unreadable one
            return cache[0]
        return newest

    def _delta_tracks(self, run: str, newest: Callable[[], dict[str, Any] | None]) -> dict[str, RowTrack]:
        """This process's delta state of the run; for its first save of the run, the bases the run's newest
        checkpoint on disk names (only their BLAKE3 addresses are used, checked against the bytes: §5.4)."""
        if run in self._tracks:
            return self._tracks[run]
        doc = newest()
        try:
            return {} if doc is None else disk_tracks(doc, self.delta_policy)
        except (LuopanError, OSError):
            return {}  # this save stores in full

    def _grouping_basis(self, run: str, newest: Callable[[], dict[str, Any] | None]) -> Basis | None:
        """The run's previous save (§8.5): this process's last save (its entries may be carried), else the newest on
        disk for grouping only (a new process then shares the groups the last one wrote), else None."""
        if run not in self._grouping and self.config.format_version >= GROUPS_FORMAT_VERSION:
            doc = newest()
            if doc is not None and wants_groups(self.config, doc):
                self._grouping[run] = grouping_basis(doc)
        return self._grouping.get(run)

    def _previous_rows(self, run: str) -> dict[str, dict[str, Any]]:
        """Chunk rows this process wrote for the run's last save, for XXH3 change detection. Rows read from disk
        are never used: a crafted manifest could map a public chunk's XXH3 to another chunk's BLAKE3 and poison
        this process's saves, so the first save of a run in a process hashes everything."""
        return self._previous.get(run, {})


_Timing = tuple[float, "float | None", "bool | None"]  # (monotonic start of the call, stall of save_async, progress)


def refuse_pinned(repo: Saving, run: str, step: int) -> None:
    """A pinned checkpoint is never replaced (overwrite=True): a pin promises that content."""
    if repo.store.exists(manifest_key(run, step)) and step in repo.run(run).pins():
        raise UsageError(f"run {run!r} step {step} is pinned, so it is not replaced: unpin it first "
                         f"(luopan unpin {run} {step}) or save to another step")


def _logical(plan: SaveRequest) -> int:
    """Bytes of the state a save may write: tied tensors once, tensors known unchanged (trust_versions) not."""
    return sum(leaf.nbytes for i, leaf in enumerate(plan.leaves) if leaf.alias_of is None and i not in plan.unchanged)


def drain_at_exit(repo: Saving) -> None:
    """Finish the save_asyncs in flight when the interpreter exits without close().

    Registered with threading's exit hooks, which run (newest first) before concurrent.futures refuses new work at
    shutdown; a plain atexit hook would run too late and the background commit would fail unseen. An error is
    printed (the process is exiting) rather than lost.
    """
    ref = weakref.ref(repo)

    def drain() -> None:
        r = ref()
        if r is None or not r._staging.busy():
            return
        try:
            r.drain()
        except BaseException as exc:  # noqa: BLE001 - exiting: report, never swallow silently
            notes = "".join(f"\n  {n}" for n in getattr(exc, "__notes__", ()))  # the other failed saves, if any
            sys.stderr.write(f"luopan: a background save failed at exit: {exc!r}{notes}\n")

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)
