"""Listing and reading checkpoints: runs, steps, manifests, ``load``, ``load_into``, ``export``, ``diff``."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, StateMismatchError
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import Manifest, parse_manifest
from ..format.manifestread import parse_manifest_header
from ..format.names import check_run, check_step, manifest_key
from ..repository.chunkio import blob_reader, read_chunks
from .base import CheckpointBase
from ..store.base import KeyNotFound, Stray
from ..tree import flatten, new_array, unflatten
from . import catalog
from .changes import add_changes, config_diff, read_record, run_config
from .export import diff_manifests, export_safetensors
from .info import CheckpointInfo
from .chunkplan import check_rows, entry_jobs
from .destinations import fresh_arrays


class Reading(CheckpointBase):
    """The listing and reading verbs of a repository (part of luopan.Repo)."""

    # "blake3": every chunk a load reads is hashed and checked against its BLAKE3 address (the default). "xxh3"
    # (luopan.open(read_check="xxh3")): against the XXH3-128 its manifest row lists, for a repository that never
    # leaves this machine: it catches damage as surely, ~10x cheaper, but not a crafted repository (§5.1).
    read_check = "blake3"

    # -- listing ------------------------------------------------------------------------------------------------
    def runs(self) -> list[str]:
        """Runs with at least one committed checkpoint (the checkpoint catalog: the walk every command shares)."""
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
        if everywhere:  # every kind's own strays, then a walk of every key: packs/ too (a full listing on S3)
            for kind in self.kinds:
                if kind.root != catalog.RUNS:
                    for s in kind.scan(self.store, None, True).strays:
                        seen.setdefault(s.key, s)
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
        key, data = self._manifest_file(run, step)
        m = parse_manifest(data, key, run, step, blob_reader(self.store, f"manifest {key}"))
        return dataclasses.replace(m, xxh3_reads=True) if self.read_check == "xxh3" else m

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
        return [self.info(run, step) for step in self.steps(run)]

    def info(self, run: str, step: int) -> CheckpointInfo:
        """What listing reports of one committed checkpoint, read from its manifest's own file alone (sealed, so
        any damage to it is found; its entry groups are not read: ``verify`` and loads check them). Listing a
        thousand checkpoints costs their manifests' bytes, not their chunk rows. CheckpointNotFoundError when there
        is none; CorruptManifestError when it is damaged."""
        check_run(run)
        step = check_step(step)
        key, data = self._manifest_file(run, step)
        return CheckpointInfo.from_manifest(Manifest(parse_manifest_header(data, key, run, step)), key)

    def _manifest_file(self, run: str, step: int) -> tuple[str, bytes]:
        """(key, bytes) of a checkpoint's manifest file; CheckpointNotFoundError naming the steps there are."""
        key = manifest_key(run, step)
        try:
            return key, self.store.get_limited(key, MAX_MANIFEST_BYTES)
        except KeyNotFound:
            raise CheckpointNotFoundError(self._no_checkpoint(run, step)) from None

    # -- loading ------------------------------------------------------------------------------------------------
    def load(self, run: str, step: int | None = None) -> Any:
        """The state tree of a checkpoint (latest when ``step`` is None), every chunk verified as it is read."""
        return self._load_manifest(self.manifest(run, step))

    def _load_manifest(self, m: Manifest) -> Any:
        """``load`` of a manifest already read (from ``repo.manifest``)."""
        sizes = check_rows(self.store, m)  # every row within its pack before any buffer is sized by the manifest
        objs: list[Any] = [None] * len(m.entries)
        jobs: list[Any] = []
        own = [i for i, e in enumerate(m.entries) if "alias_of" not in e]
        fresh = fresh_arrays([(m.entries[i]["kind"], m.entries[i]["dtype"], m.entries[i]["shape"]) for i in own])
        for i, (obj, view) in zip(own, fresh):
            objs[i] = obj
            jobs += entry_jobs(self.store, m, i, view, sizes)  # row deltas: each base chunk patched as it is read
        read_chunks(self.store, jobs, sizes=sizes)  # each chunk read and verified where it ends, the new tensor
        for i, e in enumerate(m.entries):
            if "alias_of" in e:
                objs[i] = objs[e["alias_of"]]
            elif e.get("scalar"):
                objs[i] = objs[i][()]
        return unflatten(m.tree, objs.__getitem__, f"run {m.run!r} step {m.step}")

    def load_entry(self, m: Manifest, index: int) -> Any:
        """Entry ``index`` of manifest ``m`` (from ``repo.manifest``) as a new tensor or array, every chunk verified
        (an alias reads the entry it names)."""
        e = m.entries[index]
        if "alias_of" in e:
            return self.load_entry(m, e["alias_of"])
        sizes = check_rows(self.store, m, [index])
        [(obj, view)] = fresh_arrays([(e["kind"], e["dtype"], e["shape"])])
        read_chunks(self.store, entry_jobs(self.store, m, index, view, sizes), sizes=sizes)
        return obj[()] if e.get("scalar") else obj

    def load_into(self, run: str, target: Any, step: int | None = None, *, strict: bool = True) -> Any:
        """Restore checkpoint ``step`` of ``run`` (latest when None) into an existing state tree ``target``, in place
        (tensors are written, not replaced).

        Every mismatch (missing/unexpected keys, shapes, dtypes) is checked and reported together before any
        tensor is touched. Each chunk is verified before it is copied into the target, so a damaged chunk is
        never written into it (an IntegrityError can still leave earlier tensors updated). With
        ``strict=False``, keys present on only one side are skipped. Returns ``target``.
        """
        return self._load_manifest_into(self.manifest(run, step), target, strict=strict)

    def _load_manifest_into(self, m: Manifest, target: Any, *, strict: bool = True) -> Any:
        """``load_into`` from a manifest already read (from ``repo.manifest``)."""
        run = m.run
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
            dest = writable_bytes(leaf)
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

    def export(
        self,
        run: str,
        path: str | os.PathLike[str],
        step: int | None = None,
        *,
        subtree: str | None = None,
        progress: Callable[[int], Any] | None = None,
        pieces: bool = False,
    ) -> dict[str, Any]:
        """Write checkpoint ``step`` of ``run`` (latest when None), or the tensors under key path ``subtree`` (e.g.
        ``"model"``), to one safetensors file at ``path``.

        Streams verified chunks, so it needs little memory; the file appears atomically. Tied tensors are written
        under each name. Non-tensor leaves are not exported. A sharded tensor (a DCP checkpoint's, a collective
        save's) is written whole under its path — streamed when its shards are runs of rows, else assembled in memory
        one tensor at a time; ``pieces=True`` writes each shard as stored, named ``<path>/shard-<offsets>``.
        ``progress(n)`` is called with the bytes of each chunk written. Returns {"path", "tensors", "bytes"}.
        """
        return export_safetensors(self.store, self.manifest(run, step), path, subtree, progress, pieces=pieces)

    def diff(self, run: str, step: int, to_step: int, *, to_run: str | None = None,
             values: bool = True) -> dict[str, Any]:
        """Entries changed, added and removed from checkpoint ``step`` of ``run`` to ``to_step`` of ``to_run`` (the
        same run when None), with the bytes that differ, the config diff (``config``: luopan.checkpoint.changes) and,
        with ``values``, per changed tensor the size of the change (``rel_l2``, ``max_abs``, ``differing``), read one
        tensor of each checkpoint at a time."""
        a, b = self.manifest(run, step), self.manifest(run if to_run is None else to_run, to_step)
        d = {"from_run": run, **diff_manifests(a, b)}
        if values:
            add_changes(d, a, b, self.load_entry)
        d["config"] = config_diff(run_config(read_record(self, a.run), a), run_config(read_record(self, b.run), b))
        return d


def writable_bytes(leaf: Any) -> memoryview | None:
    """A flat writable byte view of a target tensor/array's memory, or None when it has none (then copy)."""
    dest = leaf.obj
    if leaf.nbytes == 0:
        return memoryview(bytearray())
    if leaf.kind == "numpy":
        if dest.flags.c_contiguous and dest.flags.writeable and dest.dtype.byteorder != ">":
            return memoryview(dest.reshape(-1).view(np.uint8))
        return None
    if dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
        torch = sys.modules["torch"]
        if not dest.is_inference():  # written through a view torch does not see: move the version counter, or a
            torch.autograd.graph.increment_version(dest)  # later trust_versions save would think it unchanged
        return memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
    return None
