"""Checkpoint maintenance: ``verify``, ``prune`` (retention rules), replication status of a run."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidNameError, LuopanError, UnreadableError, UsageError
from ..format.names import check_run, check_step, manifest_key, signatures_prefix
from ..repository.locks import locked
from ..repository.pins import pin_problems
from ..repository.logcheck import log_problems
from ..repository.structure import verify_structure
from ..repository.verify import index_problems, raise_problems, verify_manifests
from ..repository.pruning import prune_series
from ..repository.reclaim import manifest_packs, reclaim as reclaim_packs
from ..retention import Plan, Rules
from .._compat import deprecated_alias
from ..signing import SigningKey, TrustedKeys, load_signing_key
from . import signatures
from .info import VerifyReport
from .kind import CHECKPOINTS
from .reading import Reading
from .removal import move_latest_ref
from .saving import Saving


class Maintaining(Saving, Reading):
    """verify, prune and replication status of checkpoints (part of luopan.Repo)."""

    def verify(
        self,
        run: str | None = None,
        step: int | None = None,
        *,
        progress: Callable[[int], Any] | None = None,
        on_total: Callable[[int], Any] | None = None,
        trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None,
        structure: bool = False,
    ) -> VerifyReport:
        """Read every byte of the selected checkpoints and check every hash.

        ``run=None``: the whole repository (every checkpoint, every artifact version, the index files);
        ``step=None``: all checkpoints of the run. Each distinct chunk is read once. Raises IntegrityError naming
        every damaged manifest, entry and chunk (``.problems`` lists them); returns a VerifyReport when all is well.
        ``progress(n)`` is called with the bytes of each chunk checked, after ``on_total(total bytes)``.
        ``trusted_keys`` (a TrustedKeys or a directory of ``*.pub`` files): every checkpoint verified must also carry
        a signature of its current content by one of them (``sign``); each one that does not is a problem.
        ``structure=True`` reads no chunk: every manifest is checked as a load parses it (each distinct entry group
        once) and every chunk row against its pack (there, trailer intact, long enough): minutes become seconds on a
        repository of many large checkpoints, at the cost of not catching a flipped bit inside a chunk.
        """
        trusted = trusted_keys if isinstance(trusted_keys, TrustedKeys) or trusted_keys is None else \
            TrustedKeys.load(trusted_keys)
        if run is None and step is not None:
            raise InvalidNameError("verify: a step needs a run")
        if self._inflight is not None:  # let a background save finish before we touch the dedup map
            self._inflight._future.exception()
        if run is not None:
            check_run(run)
        if step is not None:
            step = check_step(step)
        strays = self.strays(run, everywhere=run is None)
        problems: list[LuopanError] = [UnreadableError(f"cannot verify {s}: manifests there cannot be seen")
                                       for s in strays if s.unreadable]
        if run is None:
            targets = [(kind, s, n) for kind in self.kinds for s, n in kind.scan(self.store, None, False).pairs()]
        else:
            targets = [(CHECKPOINTS, run, s) for s in ([step] if step is not None else self.steps(run))]
        if run is not None and not targets and not problems:
            raise CheckpointNotFoundError(self._no_checkpoint(run))
        if structure:
            checked = verify_structure(self.store, targets)
        else:
            checked = verify_manifests(self.store, self.read_manifest, targets, progress=progress, on_total=on_total)
        problems += checked.problems
        self.forget_damaged(checked.chunk_problems)
        if trusted is not None:
            for kind, series, number in targets:
                if kind is not CHECKPOINTS:
                    continue
                try:
                    m = self.manifest(series, number)
                except LuopanError:
                    continue  # a damaged manifest is reported above
                try:
                    signatures.check(self.store, m, trusted)
                except LuopanError as exc:
                    problems.append(exc)
        if step is None:  # the runs' other files: record, eval logs, pins, latest ref
            runs = {s for kind, s, _n in targets if kind is CHECKPOINTS} | ({run} if run else set())
            for r in sorted(runs):
                problems += self.run(r).problems()
        if run is None:  # whole repository: other kinds' pins, and the index files (they steer deduplication)
            for kind in self.kinds:
                if kind is not CHECKPOINTS:
                    for series in kind.scan(self.store, None, False).runs:
                        problems += pin_problems(self.store, kind, series)
            problems += index_problems(self.store)
            problems += log_problems(self)  # journal and op-log segments, as opening them would
        report = VerifyReport(len(targets), checked.chunks, checked.bytes, problems,
                              [s for s in strays if not s.unreadable])
        raise_problems(problems, report)
        return report

    def sign(self, run: str, step: int | None, key: SigningKey | str | os.PathLike[str]) -> dict[str, Any]:
        """Sign checkpoint ``step`` of ``run`` (the latest when None) with an Ed25519 key (a SigningKey or a ``.key``
        file from ``luopan key gen``): a signature of its content (docs/format.md §9.3), checked by
        ``verify(trusted_keys=…)``. Returns the signature document."""
        signing_key = key if isinstance(key, SigningKey) else load_signing_key(key)
        return signatures.sign(self.store, self.manifest(run, step), signing_key)

    def delete(self, run: str, step: int, *, reclaim: bool = False) -> bool:
        """Remove checkpoint ``step`` of ``run`` now (its manifest; the chunks only it used go at the next gc, or at
        once with ``reclaim=True``: the packs it named that no other manifest names, docs/format.md §10.3.1).
        A pinned checkpoint is refused (UsageError: unpin it first). Returns whether it existed."""
        check_run(run)
        step = check_step(step)
        self.drain()
        with locked(self.store, "exclusive", f"delete of {run} step {step}", timeout=self.lock_timeout,
                    where=self.where):
            if step in self.run(run).pins():
                raise UsageError(f"run {run!r} step {step} is pinned: unpin it first (luopan unpin {run} {step})")
            key = manifest_key(run, step)
            if not self.store.exists(key):
                return False
            for sig in list(self.store.list(signatures_prefix(run, step))):  # they sign content that is going
                self.store.delete(sig)
            # packs to reclaim: read before the manifest goes (a tiered repository leaves them to gc, §10.3)
            candidates = manifest_packs(CHECKPOINTS, self.store, run, step, self.repository.pack_users) \
                if reclaim and self.tier is None else frozenset()
            # the latest ref moves off it first (to the newest remaining checkpoint, or goes): never dangling
            move_latest_ref(self.store, run, step, [s for s in self.steps(run) if s != step])
            self.store.delete(key)
            if candidates:
                self._reclaim(candidates)
            return True

    def packs(self, run: str, step: int) -> frozenset[str]:
        """The pack ids checkpoint ``step`` of ``run`` names (every pack it needs, §8.5)."""
        return manifest_packs(CHECKPOINTS, self.store, check_run(run), check_step(step), self.repository.pack_users)

    def reclaim(self, packs: frozenset[str] | set[str]) -> Any:
        """Free at once those of ``packs`` that no manifest names now (e.g. those of a checkpoint just replaced with
        ``overwrite=True``), under the exclusive lock (docs/format.md §10.3.1); returns a Reclaimed (None: nothing
        to do, or a tiered repository, which leaves them to gc)."""
        self.drain()
        if self.tier is not None or not packs:
            return None
        with locked(self.store, "exclusive", "reclaim", timeout=self.lock_timeout, where=self.where):
            return self._reclaim(frozenset(packs))

    def _reclaim(self, candidates: frozenset[str]) -> Any:
        self.repository.last_reclaim = reclaim_packs(
            self.store, self.kinds, candidates, self.repository.pack_users,
            format_version=self.config.format_version, pack_size=self.config.pack_size)
        return self.repository.last_reclaim

    def replication_status(self, run: str) -> dict[int, str]:
        """step -> "local" | "replicating" | "replicated" | "remote" (evicted locally) | "cold" of a tiered repo."""
        return self.repository.tiered().status(CHECKPOINTS, check_run(run))

    def prune(self, run: str, retention: Rules | None = None, *, dry_run: bool = False,
              missing_metrics: str = "error", rules: Rules | None = None) -> Plan:
        """Remove the checkpoints of ``run`` that ``retention`` (luopan.retention rules, e.g. ``KeepLast(3) |
        KeepBest(1, "loss")``; the same name as ``CheckpointManager(retention=…)``) does not keep; returns the Plan.
        ``rules=`` is the old name of ``retention`` (deprecated).

        The newest checkpoint and pinned ones are always kept. A checkpoint is removed by deleting its manifest
        (atomic: it exists until then, and is gone after); the chunks it alone used stay until `luopan gc`.
        ``dry_run`` computes exactly the same plan and removes nothing (it takes no lock, so it needs no write
        access and never waits). A `KeepBest` metric that no checkpoint of the run records as a number (a typo
        such as ``Loss`` for ``loss``) is an error naming the metrics they do record, before anything is removed;
        ``missing_metrics="ignore"`` lets such a rule keep nothing (CheckpointManager uses it while a metric has
        not been logged yet).
        """
        retention = deprecated_alias(retention, rules, "retention", "rules")
        check_run(run)
        return prune_series(self, CHECKPOINTS, run, retention, dry_run=dry_run, missing_metrics=missing_metrics,
                            missing=CheckpointNotFoundError(self._no_checkpoint(run)))
