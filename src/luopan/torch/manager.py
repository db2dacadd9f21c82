"""CheckpointManager: restore at start, save when a policy says so, check what was written, flush at the end.

    state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    mgr = CheckpointManager("ckpts", "run-a", state, policy=EveryNSteps(50) | LossSpike())
    start = mgr.restore()                  # step to start from (0 for a new run)
    for step in range(start, total):
        loss = train_one_step(...)
        mgr.maybe_save(step + 1, metrics={"loss": loss})   # journals the metrics; saves when the policy says so
    mgr.close()

``mgr.last_save`` (a luopan.checkpoint.progress.SaveReport) holds the figures of the last committed save, and
``on_save=callback`` receives each one (for async saves once committed, on the loop's thread, at its next
``maybe_save``/``log``/``save``/``close``). The resume check (luopan.checkpoint.runs.resumes) compares the first steps after
a ``restore()`` with the metrics the interrupted run journaled for them.
"""

from __future__ import annotations

import logging

import difflib
import os
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..checkpoint import (CheckpointInfo, ResumeCheck, RunJournal, SaveHandle, SaveReport, chunk_refs, config_json,
                          delta_jobs)
from ..errors import IntegrityError
from ..format.manifest import Manifest, manifest_rows
from ..format.names import check_run, pack_key
from ..policies import EveryNSteps
from ..repo import Repo
from ..repo import open as open_repo
from ..repository.chunkio import check_pack_trailer, read_chunks
from ..retention import KeepBest, Retention
from ..store.base import KeyNotFound
from ..tree import flatten
from .state import TrainingState, _world


logger = logging.getLogger("luopan")  # the library's logger (luopan.checkpoint.progress logs there too)

class CheckpointManager:
    """Checkpointing for a training loop. See the module docstring.

    ``policy``: when to save (luopan.policies; default every 100 steps). ``retention``: luopan.retention rules
    applied after each committed save (e.g. ``KeepLast(3) | KeepBest(1, "loss")``; pinned and newest stay). ``async_save``: saves return after a host
    copy and persist in the background (one in flight). ``trust_versions``: skip tensors whose version counter did
    not move (see Repo.save). After every save the manifest and the pack files it names are checked (sizes and
    trailer hashes); every ``verify_every`` saves, ``verify_sample`` entries are read back, their hashes checked,
    and compared byte for byte with what was saved (0 turns this off).

    ``progress``: report saves longer than two seconds on stderr (None: the repository's setting, on by default;
    False: silent); each committed save also logs an INFO record to the ``luopan`` logger. ``on_save``: called with
    each committed save's SaveReport (step, stall_seconds, duration_seconds, bytes_written, dedup_ratio, …); an
    exception it raises is a warning, the save stands. ``resume_check``: a luopan.checkpoint.runs.resumes.ResumeCheck
    (default ``ResumeCheck()``: 20 steps, exact), or False to journal no metrics and check nothing. Only rank 0 of
    a torch.distributed job journals metrics.
    """

    def __init__(self, repo: Repo | str | os.PathLike[str], run: str, state: TrainingState, *,
                 policy: Any = None, async_save: bool = False, trust_versions: bool = False,
                 verify_every: int = 10, verify_sample: int = 8, config: dict[str, Any] | None = None,
                 retention: Any = None, clock: Callable[[], float] = time.monotonic, progress: bool | None = None,
                 on_save: Callable[[SaveReport], Any] | None = None, resume_check: ResumeCheck | bool = True,
                 inputs: list[str] | None = None) -> None:
        check_run(run)  # before the repository is opened or created
        self._owns_repo = not isinstance(repo, Repo)
        self.repo = repo if isinstance(repo, Repo) else open_repo(repo)
        self.run = run
        self.state = state
        self.policy = policy if policy is not None else EveryNSteps(100)
        self.async_save = async_save
        # What the run is trained on ("NAME@V": artifact versions, other checkpoints): every save records it as its
        # manifest's ``inputs`` (lineage, docs/format.md §8); checked at the first save.
        self.inputs = list(inputs) if inputs else None
        self.trust_versions = trust_versions
        self.verify_every = verify_every
        self.verify_sample = verify_sample
        self.config = config_json(config)  # a config that is not JSON is refused now, not at the first save
        self.retention = retention  # luopan.retention rules applied after each committed save (prune)
        self.last_prune: Any = None
        self.clock = clock
        self.saves = 0
        self.last_saved_step: int | None = None
        self._pending: tuple[SaveHandle, int, float] | None = None
        self._recorded = False
        self._sampler = random.Random(0)  # never the global RNG: checkpointing must not change training's streams
        self.restore_skipped: list[tuple[int, str]] = []  # (step, why) of damaged checkpoints restore() passed over
        self._metric_names: set[str] = set()
        self._warned_metrics = False
        self.progress = progress
        self.on_save = on_save
        self.last_save: SaveReport | None = None  # the figures of the last committed save
        check = ResumeCheck() if resume_check is True else resume_check
        if check is not False and not isinstance(check, ResumeCheck):
            raise TypeError(f"resume_check must be a ResumeCheck, True or False, not {resume_check!r}")
        self._journal = RunJournal(self.repo, run, check) if check and _world()["rank"] == 0 else None

    # -- restore ------------------------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, strict: bool = True) -> int:
        """Restore the latest checkpoint of the run (or ``step``) into the training state; returns its step, or 0
        when the run has no checkpoint yet. Everything is checked before anything is changed.

        Without ``step``, a newest checkpoint that does not verify (a damaged manifest, a damaged or missing pack or
        chunk) is skipped with a warning naming it and why, and the next older one that verifies is restored
        (``restore_skipped`` lists what was passed over; the loop's next saves of those steps replace them). If none
        verifies, IntegrityError names them all. A checkpoint that cannot be *read* (permissions, an unreachable
        object store) raises instead: that is not damage, and falling back would silently lose progress. With
        ``step``, that checkpoint or an error: never a fallback to another step.

        With the resume check on, the resume is recorded (luopan.checkpoint.runs.resumes.list_resumes) and the next steps'
        metrics are compared with those the interrupted run logged.
        """
        started = time.perf_counter()
        restored = self._restore_any(step, strict)
        if self._journal is not None:
            self._journal.resumed(restored, time.perf_counter() - started)
        return restored

    def _restore_any(self, step: int | None, strict: bool) -> int:
        if step is not None:
            return self._restore(step, strict)
        self.restore_skipped = []
        steps = self.repo.steps(self.run)
        if not steps:
            return 0
        for candidate in reversed(steps):
            try:
                return self._restore(candidate, strict)
            except IntegrityError as exc:  # the state was not touched: load verifies everything first
                self.restore_skipped.append((candidate, str(exc)))
                warnings.warn(f"run {self.run!r}: skipped checkpoint step {candidate}, which does not verify "
                              f"({exc}); trying the one before it", stacklevel=3)
        raise IntegrityError(f"no checkpoint of run {self.run!r} verifies (tried steps "
                             f"{', '.join(str(s) for s, _ in self.restore_skipped)}): run `luopan verify` to see "
                             "the damage")

    def _restore(self, step: int, strict: bool) -> int:
        m = self.repo.manifest(self.run, step)
        where = f"run {self.run!r} step {m.step}"
        self.state.check_layout(m.doc["metadata"], where)
        tree = self.repo.load(self.run, m.step)
        self.state.restore(tree, m.doc["metadata"], strict=strict, where=where)
        saved_policy = m.doc["metadata"].get("luopan.policy")
        if saved_policy is not None and callable(getattr(self.policy, "load_state_dict", None)):
            try:
                self.policy.load_state_dict(saved_policy)
            except (ValueError, KeyError, TypeError) as exc:  # another policy than the run saved with: start fresh
                warnings.warn(f"{where}: the save policy's state was not restored ({exc}); it starts fresh",
                              stacklevel=2)
        self.last_saved_step = m.step
        return m.step

    # -- saving -------------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, metrics: dict[str, Any] | None = None, *, force: bool = False
                   ) -> CheckpointInfo | SaveHandle | None:
        """Save when the policy says so (or ``force``); returns the CheckpointInfo (SaveHandle when async). The
        metrics are journaled for the resume check either way (as by ``log``)."""
        metrics = dict(metrics or {})
        self.log(step, metrics)
        reason = "forced" if force else self.policy.should_save(step, _floats(metrics), self.clock())
        if not reason:
            return None
        return self._save(step, metrics, str(reason))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Journal the metrics of ``step`` (numbers, str, bool, None; tensors of one element) for the resume check,
        without saving; after a ``restore()``, compare them with the interrupted run's. A background save that has
        committed meanwhile is booked here (``last_save``, ``on_save``)."""
        if self._pending is not None and self._pending[0].done():
            self._finish_pending()
        if self._journal is not None and metrics:
            self._journal.log(step, metrics)

    def save(self, step: int, metrics: dict[str, Any] | None = None, *, reason: str = "explicit"
             ) -> CheckpointInfo | SaveHandle:
        """Save now (metrics journaled as by ``log``); returns the CheckpointInfo (SaveHandle when async)."""
        self.log(step, dict(metrics or {}))
        return self._save(step, metrics, reason)

    def _save(self, step: int, metrics: dict[str, Any] | None, reason: str) -> CheckpointInfo | SaveHandle:
        self._finish_pending()
        self._metric_names.update(k for k in (metrics or {}) if isinstance(k, str))
        if not self._recorded:  # the run record carries the config; written once, by the run's first save
            try:
                self.repo.run(self.run).write_record(self.config)
            except (OSError, ValueError) as exc:  # context, not state: never fail the save for it
                warnings.warn(f"run {self.run!r}: the run record could not be written ({exc})", stacklevel=2)
            self._recorded = True
        tree = self.state.capture()
        metadata = {**self.state.metadata(), "luopan.reason": reason}
        if callable(getattr(self.policy, "state_dict", None)):  # moving windows etc. survive a resume
            metadata["luopan.policy"] = self.policy.state_dict()
        start = self.clock()
        out: CheckpointInfo | SaveHandle
        if self.async_save:
            out = self.repo.save_async(self.run, step, tree, metrics=metrics, metadata=metadata,
                                       trust_versions=self.trust_versions, overwrite=self._replaces(step),
                                       progress=self.progress, inputs=self.inputs)
            self._pending = (out, step, self.clock() - start)  # booked once it is committed (_finish_pending)
            return out
        out = self.repo.save(self.run, step, tree, metrics=metrics, metadata=metadata,
                             trust_versions=self.trust_versions, overwrite=self._replaces(step), progress=self.progress,
                             inputs=self.inputs)
        self._booked(step, self.clock() - start)
        self._check_saved(step, tree)
        self._report(out)
        return out

    def _replaces(self, step: int) -> bool:
        """A step restore() skipped as damaged is saved again over the damaged checkpoint (never any other step)."""
        return any(s == step for s, _why in self.restore_skipped)

    def _booked(self, step: int, cost: float) -> None:
        """A committed save: the policy learns its cost (the time the loop was blocked); retention runs."""
        self.policy.saved(step, self.clock(), cost)
        self.saves += 1
        self.last_saved_step = step
        if self.retention is not None:  # the checkpoint just committed is the newest: prune never removes it
            self._warn_unlogged_metrics()
            # A KeepBest metric may be logged only later (evals every N steps): until then its rule keeps nothing.
            self.last_prune = self.repo.prune(self.run, self.retention, missing_metrics="ignore")

    def _report(self, info: CheckpointInfo) -> None:
        """A committed, checked save: ``last_save`` holds its figures, ``on_save`` gets them."""
        self.last_save = report = SaveReport.from_info(info)
        if self.on_save is None:
            return
        try:
            self.on_save(report)
        except Exception as exc:  # noqa: BLE001 - the save is committed: a failing callback must not undo that
            logger.warning("run %r step %d: the on_save callback raised %r (the checkpoint is committed)",
                           self.run, report.step, exc)
            warnings.warn(f"run {self.run!r} step {report.step}: the on_save callback raised {exc!r}; the "
                          "checkpoint is committed", stacklevel=4)

    def _warn_unlogged_metrics(self) -> None:
        """Warn once when a KeepBest rule names a metric close to, but not, one the loop logs (``Loss``/``loss``)."""
        if self._warned_metrics or not self._metric_names:
            return
        rules = self.retention.rules if isinstance(self.retention, Retention) else (self.retention,)
        for r in rules:
            if isinstance(r, KeepBest) and r.metric not in self._metric_names:
                near = difflib.get_close_matches(r.metric, sorted(self._metric_names), n=1, cutoff=0.6)
                if near:
                    self._warned_metrics = True
                    warnings.warn(f"retention keeps the best by {r.metric!r}, but the training loop logs {near[0]!r} "
                                  "(and no metric of that name): a typo?", stacklevel=3)

    def close(self) -> None:
        """Wait for a background save and check it; close the repository if the manager opened it."""
        try:
            self._finish_pending()
        finally:
            try:
                if self._journal is not None:  # a resume still undecided ends undecided (not enough steps)
                    self._journal.close()
            finally:
                if self._owns_repo:
                    self.repo.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checks -------------------------------------------------------------------------------------------------
    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        handle, step, cost = self._pending
        self._pending = None
        info = handle.wait()  # a failed background save raises here: not booked, so last_saved_step stays true
        self._booked(step, cost)
        self._check_saved(step, None)
        self._report(info)

    def _check_saved(self, step: int, tree: Any) -> None:
        """The cheap check after every save; every ``verify_every`` saves, a read-back of a sample of entries
        (compared with ``tree`` when the caller still holds the saved values, i.e. synchronous saves)."""
        m = self.repo.manifest(self.run, step)
        problems: list[Exception] = [p for p in (check_pack_trailer(self.repo.store, pack) for pack in m.packs)
                                     if p is not None]
        need = [0] * len(m.packs)  # bytes each pack must hold: the end of its last chunk this checkpoint uses
        for r in manifest_rows(m.doc):  # every entry's rows and its entry groups' (docs/format.md §8.5)
            need[r.pack] = max(need[r.pack], r.offset + r.length)
        for pack, needed in zip(m.packs, need):
            try:
                size = self.repo.store.size(pack_key(pack))
            except KeyNotFound:
                size = -1
            if size < needed:
                problems.append(IntegrityError(f"pack {pack[:16]}… is {max(size, 0)} bytes (or missing), the "
                                               f"checkpoint needs {needed}"))
        if problems:
            raise IntegrityError(f"checkpoint run {self.run!r} step {step} failed its post-save check: "
                                 + "; ".join(str(p) for p in problems))
        if self.verify_every and self.saves % self.verify_every == 0:
            self._read_back(m, tree)

    def _read_back(self, m: Manifest, tree: Any) -> None:
        candidates = [i for i, e in enumerate(m.entries) if "alias_of" not in e and e["nbytes"]]
        sample = sorted(self._sampler.sample(candidates, min(self.verify_sample, len(candidates))))
        live = {leaf.path: leaf for leaf in flatten(tree)[1]} if tree is not None else {}
        for i in sample:
            e = m.entries[i]
            buf = memoryview(bytearray(e["nbytes"]))
            jobs = [(ref, buf[pos : pos + ref.size]) for pos, ref in chunk_refs(m, i)]
            delta, more = delta_jobs(m, i, self.repo.store)
            read_chunks(self.repo.store, jobs + more)  # every chunk's hash is checked
            if delta is not None:
                delta.apply(buf)
            leaf = live.get(e["path"])
            if leaf is not None and bytes(leaf.host_bytes()) != bytes(buf):
                raise IntegrityError(f"checkpoint run {self.run!r} step {m.step} entry {e['path']!r} reads back "
                                     "different bytes from those saved")


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v.item() if hasattr(v, "item") else v)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out
