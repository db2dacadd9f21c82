"""Removing a whole run, or one checkpoint of it, now (``luopan rm``): manifests, their pins and signatures, the
run's ``latest`` ref kept pointing at a checkpoint that exists, and for a whole run its record and eval logs. The
chunks only they used stay until the next ``gc`` (like prune, docs/format.md §9.1).

Crash-safe by order, under the repository's exclusive lock (saves, prune and gc wait): a step's pin and signatures go
before its manifest, the ``latest`` ref is moved to (or, for the last checkpoint, removed before) the manifest it
would otherwise dangle from, and a run's record and eval logs go after its last manifest. Interrupted at any point,
every checkpoint left is whole and loadable, and running the same removal again finishes it (a run with no
checkpoint left but files of its own is still removed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, IntegrityError, PinnedError, StorageError
from ..format.canonical import sealed_checksum
from ..format.limits import MAX_MANIFEST_BYTES, MAX_SMALL_BYTES
from ..format.names import (
    check_run,
    check_step,
    eval_prefix,
    latest_ref_key,
    manifest_key,
    pin_key,
    record_key,
    signatures_prefix,
)
from ..format.refs import build_ref, parse_ref
from ..repository.locks import locked
from ..store.base import KeyNotFound
from .runs.journals import METRICS, RESUMES, journal_name


@dataclass
class Removal:
    """What ``remove`` removed (or, with ``dry_run``, would remove)."""

    run: str
    steps: list[int]  # the checkpoints removed
    pinned: dict[int, Any] = field(default_factory=dict)  # step -> pin tag of those that were pinned (force)
    whole_run: bool = False
    remaining: list[int] = field(default_factory=list)  # the run's checkpoints left afterwards
    dry_run: bool = False
    files: int = 0  # other files of the run removed (record, evals, ref, signatures, pins)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "steps": self.steps, "whole_run": self.whole_run, "dry_run": self.dry_run,
                "pinned": sorted(self.pinned), "remaining": self.remaining, "files": self.files}


def remove(repo: Any, run: str, step: int | None = None, *, force: bool = False, dry_run: bool = False) -> Removal:
    """Remove checkpoint ``step`` of ``run``, or (``step=None``) the whole run. A pinned checkpoint is refused
    (PinnedError, nothing removed) unless ``force`` (its pin goes too). ``dry_run`` says what would go and removes
    nothing (it takes no lock). CheckpointNotFoundError when there is nothing to remove."""
    check_run(run)
    if step is not None:
        step = check_step(step)
    repo.drain()
    if dry_run:
        return _remove(repo, run, step, force, True)
    what = f"{run} step {step}" if step is not None else f"run {run}"
    with locked(repo.store, "exclusive", f"removal of {what}", timeout=repo.lock_timeout, where=repo.where):
        return _remove(repo, run, step, force, False)


def _run_files(store: Any, run: str) -> list[str]:
    """Keys of the run's own files besides its manifests and pins: record, eval logs, ref, signatures, and the
    files of its metrics and resumes journals (the resume check's)."""
    keys = [k for k in (record_key(run), latest_ref_key(run)) if store.exists(k)]
    keys += list(store.list(eval_prefix(run)))
    keys += list(store.list(f"refs/signatures/{run}/"))
    for prefix in (METRICS, RESUMES):  # the resume check's journals of the run (luopan.checkpoint.runs.resumes)
        keys += list(store.list(f"journals/{journal_name(prefix, run)}/"))
    return keys


def _remove(repo: Any, run: str, step: int | None, force: bool, dry_run: bool) -> Removal:
    store = repo.store
    steps = repo.steps(run)
    pins = repo.run(run).pins()
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(repo._no_checkpoint(run, step))
        targets = [step]
    else:
        targets = list(steps)
        leftovers = _run_files(store, run) + [k for k in store.list(f"refs/pins/{run}/")]
        if not targets and not leftovers:
            raise CheckpointNotFoundError(repo._no_checkpoint(run))
    pinned = {s: pins[s].get("tag") for s in targets if s in pins}
    if pinned and not force:
        shown = ", ".join(f"{s}" + (f" ({tag!r})" if tag else "") for s, tag in pinned.items())
        first = next(iter(pinned))
        raise PinnedError(f"run {run!r}: step{'s' if len(pinned) > 1 else ''} {shown} "
                          f"{'are' if len(pinned) > 1 else 'is'} pinned; nothing removed. Unpin first "
                          f"(luopan unpin {run} {first}) or pass --force to remove pinned checkpoints too")
    remaining = [s for s in steps if s not in targets]
    result = Removal(run, targets, pinned, step is None, remaining, dry_run)
    if dry_run:
        result.files = len(_run_files(store, run)) if step is None else 0
        return result
    if step is not None:
        _remove_step(repo, run, step, remaining)
        return result
    planned = len(_run_files(store, run))  # counted as the dry run counts them (the ref goes before the rest)
    for s in sorted(pins):  # every pin of the run, also of steps whose manifest is already gone
        _delete(store, pin_key(run, s))
    for s in targets[:-1]:  # oldest first; the ref names the newest, which goes last
        _remove_step(repo, run, s, None)
    _delete(store, latest_ref_key(run))
    if targets:
        _remove_step(repo, run, targets[-1], None)
    files = _run_files(store, run)
    for key in files:  # the record and eval logs last: while they exist, `rm RUN` again finds the run
        _delete(store, key)
    result.files = planned
    return result


def _remove_step(repo: Any, run: str, step: int, remaining: list[int] | None) -> None:
    """Remove one checkpoint: its pin and signatures, then (the ref moved off it first) its manifest."""
    store = repo.store
    _delete(store, pin_key(run, step))
    for sig in list(store.list(signatures_prefix(run, step))):  # they sign content that is going
        _delete(store, sig)
    if remaining is not None:
        move_latest_ref(store, run, step, remaining)
    _delete(store, manifest_key(run, step))


def move_latest_ref(store: Any, run: str, step: int, remaining: list[int]) -> None:
    """If the run's latest ref names ``step``, point it at the newest remaining checkpoint (or remove it)."""
    key = latest_ref_key(run)
    try:
        ref = parse_ref(store.get_limited(key, MAX_SMALL_BYTES), key)
    except KeyNotFound:
        ref = None
    except (IntegrityError, StorageError):
        ref = {"step": step}  # a damaged ref is replaced
    if ref is None or (ref.get("step") != step and ref.get("step") in remaining):
        return
    if not remaining:
        _delete(store, key)
        return
    newest = remaining[-1]
    data = store.get_limited(manifest_key(run, newest), MAX_MANIFEST_BYTES)
    store.put(key, build_ref(run, newest, sealed_checksum(data)))


def _delete(store: Any, key: str) -> None:
    try:
        store.delete(key)
    except KeyNotFound:
        pass
