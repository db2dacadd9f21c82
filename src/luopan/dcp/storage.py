"""PyTorch Distributed Checkpoint storage on luopan (docs/format.md §8.4).

    import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, storage_writer=luopan.dcp.Writer("ckpts", "run-a", step=100))
    dcp.load(state_dict, storage_reader=luopan.dcp.Reader("ckpts", "run-a"))      # latest; reshards on load

Every rank stores the chunks of the items DCP's planner gives it (deduplicated against the whole repository, each
verified on read); the coordinator commits one manifest after every rank's packs are durable — DCP gathers the
ranks' results first, and a rank that failed makes every rank raise before the commit — so a save that dies leaves
no checkpoint. DCP's metadata is kept as JSON in the manifest, never pickled. DCP serialises non-tensor values with
``torch.save``: the writer reads them back with ``weights_only=True`` and stores them as typed JSON values
(§8.3); the reader rebuilds them from JSON and hands DCP's planner a payload it serialised itself.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..errors import CheckpointExistsError, CorruptManifestError, UnsupportedValueError, UsageError
from ..format.names import check_run, check_step, escape_key, join_path, manifest_key
from ..repo import Repo, open as open_repo
from ..tree import flatten, unflatten
from .layout import check_storage, decode_metadata, encode_metadata, index_json
from .opened import acquire, release
from .reuse import Reuse


def _repo(repo_or_url: Repo | str | os.PathLike[str], create: bool) -> Repo:
    return repo_or_url if isinstance(repo_or_url, Repo) else open_repo(repo_or_url, create=create)


def _shard_name(index: MetadataIndex) -> str:
    return "shard-" + "_".join(map(str, index.offset or ()))


def _item_path(index: MetadataIndex, whole: bool) -> str:
    """The entry key path of one DCP item: the tensor's name, or name/shard-<offsets> for a shard."""
    if whole or index.offset is None:
        return escape_key(index.fqn)
    return join_path(escape_key(index.fqn), _shard_name(index))


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` committing one luopan checkpoint ``run``/``step`` (every rank passes the same).

    ``trust_versions=True`` (opt-in) skips reading tensors whose torch version counter (and storage, address, layout,
    dtype, device) has not moved since this process last saved the same item of ``run`` into this repository through
    a Writer: their previous chunks are referenced again (when their packs are still there), so a re-save after a
    step that changed a few tensors reads only those. Writes that bypass the counter are then missed — silently
    stale data: ``t.data[...] = …``, writes through ``t.numpy()`` or DLPack views, custom kernels, and **fused
    optimizers** (``torch.optim.AdamW(fused=True)``), which update weights and moments in place without moving it.
    A state dict of ``{k: p.data}`` gets no reuse (each ``.data`` has a fresh counter), nor does ``dcp.async_save``
    (it stages copies). Use it for state changed only by ordinary (non-fused) in-place ops, as ``repo.save``'s.
    """

    def __init__(self, repo_or_url: Repo | str | os.PathLike[str], run: str, step: int, *,
                 metrics: dict[str, Any] | None = None, overwrite: bool = False, trust_versions: bool = False,
                 inputs: list[str] | None = None) -> None:
        super().__init__()
        self.inputs = list(inputs) if inputs else None  # lineage: "NAME@V" the checkpoint was trained on (§8)
        self.location = repo_or_url
        self.run = check_run(run)
        self.step = check_step(step)
        self.metrics = metrics
        self.overwrite = overwrite
        self.trust_versions = trust_versions
        self.is_coordinator = True
        self.info: Any = None  # the CheckpointInfo, on the coordinator once committed
        self._repo: Repo | None = None

    def _open(self) -> Repo:
        """The repository; one given as a path or URL stays open for this process's next save (luopan.dcp.opened)."""
        if self._repo is None:
            self._repo = acquire(self.location)
        return self._repo

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # On the coordinator, before any rank writes: a step that exists is refused now, not after the writes.
        if not self.overwrite and self._open().store.exists(manifest_key(self.run, self.step)):
            release(self._open())  # this save ends here: the next may have the repository
            raise CheckpointExistsError(f"run {self.run!r} already has a checkpoint at step {self.step}; pass "
                                        "overwrite=True to luopan.dcp.Writer to replace it")
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.run}@{self.step}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # a luopan checkpoint is named by its Writer's arguments, not by a checkpoint_id

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        repo = self._open()
        try:
            out = self._write(repo, plan, planner)
        finally:
            release(repo)  # the next save may store through it (this one's finish only commits)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut

    def _write(self, repo: Repo, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        reuse = Reuse(repo, self.run) if self.trust_versions else None
        tensors: list[tuple[str, Any]] = []
        results: list[WriteResult] = []
        kept: dict[str, dict[str, Any]] = {}  # path -> previous entry reused (trust_versions)
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, len(data.getbuffer()), {"value": _value_node(item, data)}))
                continue
            t = data.detach()
            whole = item.tensor_data is None or list(item.tensor_data.chunk.sizes) == list(item.tensor_data.size)
            path = _item_path(item.index, whole)
            results.append(WriteResult(item.index, t.numel() * t.element_size(), {"path": path}))
            previous = reuse.previous(path, t) if reuse is not None else None
            if previous is not None:
                kept[path] = previous
                continue
            tensors.append((path, t.cpu() if t.device.type != "cpu" else t))
        stored = repo.checkpointing.store_entries(tensors) if tensors else None
        entries = {e["path"]: e for e in stored.entries} if stored else {}
        if reuse is not None:
            for path, e in entries.items():
                reuse.stored(path, e)
            reuse.keep()
        entries.update(kept)
        out = [WriteResult(r.index, r.size_in_bytes, {**r.storage_data, "entry": entries[r.storage_data["path"]]})
               if "path" in r.storage_data else r for r in results]
        if out and stored is not None:  # what this rank wrote travels with its first result
            out[0] = WriteResult(out[0].index, out[0].size_in_bytes, {**out[0].storage_data, "written": stored.written})
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        repo = self._open()
        entries: list[dict[str, Any]] = []
        storage: list[list[Any]] = []
        nodes: dict[str, dict[str, Any]] = {}  # fqn -> a value's node, or a whole tensor's entry node
        shards: dict[str, dict[str, dict[str, Any]]] = {}  # fqn -> shard name -> entry node
        written: dict[str, int] = {}
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                for k, v in sd.get("written", {}).items():
                    written[k] = written.get(k, 0) + v
                if "value" in sd:
                    storage.append([index_json(r.index), {"value": sd["value"]}])
                    nodes[r.index.fqn] = sd["value"]
                    continue
                storage.append([index_json(r.index), {"entry": len(entries)}])
                if sd["path"] == escape_key(r.index.fqn):
                    nodes[r.index.fqn] = {"entry": len(entries)}
                else:
                    shards.setdefault(r.index.fqn, {})[_shard_name(r.index)] = {"entry": len(entries)}
                entries.append(sd["entry"])
        for fqn, parts in shards.items():
            nodes[fqn] = {"dict": [[name, node] for name, node in sorted(parts.items())]}
        tree = {"dict": [[fqn, node] for fqn, node in sorted(nodes.items())]}
        self.info = repo.checkpointing.commit_entries(self.run, self.step, entries, tree, metrics=self.metrics,
                                        extra={"dcp": encode_metadata(metadata, storage)}, overwrite=self.overwrite,
                                        written=written, inputs=self.inputs)


def _value_node(item: Any, data: io.BytesIO) -> dict[str, Any]:
    """A non-tensor value DCP serialised with torch.save, as a typed JSON node (read back without pickle's code)."""
    data.seek(0)
    try:
        value = torch.load(data, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the restricted unpickler refuses
        raise UnsupportedValueError(
            f"DCP value {item.index.fqn!r} holds an object luopan will not store ({type(exc).__name__}: it is not "
            f"made of plain values: {_last_line(exc)}); keep plain "
            "values (numbers, str, lists, dicts, typed values) in the state dict") from None
    skeleton, leaves = flatten(value)
    if leaves:
        raise UnsupportedValueError(f"DCP value {item.index.fqn!r} holds tensors inside a non-tensor value; make "
                                    "them entries of the state dict")
    return skeleton


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:200]


class Reader(StorageReader):
    """A DCP ``StorageReader`` of luopan checkpoint ``run``/``step`` (the latest when ``step`` is None); DCP's planner
    reshards on load (saved at one world size, loaded at another). Every chunk is verified as it is read."""

    def __init__(self, repo_or_url: Repo | str | os.PathLike[str], run: str, step: int | None = None) -> None:
        super().__init__()
        self.location = repo_or_url
        self.run = check_run(run)
        self.step = None if step is None else check_step(step)
        self._storage: dict[MetadataIndex, Any] = {}
        self._manifest: Any = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def _load_manifest(self) -> Any:
        if self._manifest is None:
            m = _repo(self.location, create=False).manifest(self.run, self.step)
            if "dcp" not in m.doc:
                raise CorruptManifestError(f"run {self.run!r} step {m.step} was not written through luopan.dcp: "
                                           "load it with repo.load / repo.load_into")
            self._manifest = m
        return self._manifest

    def read_metadata(self) -> Metadata:  # no rank=: every rank must take part in the plan exchange (step check)
        m = self._load_manifest()
        where = f"run {self.run!r} step {m.step}"
        metadata, self._storage = decode_metadata(m.doc["dcp"], where)
        check_storage(metadata, self._storage, m.entries, where)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data or self._storage

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The step this rank read (with step=None, each rank resolves "latest" itself): checked on the coordinator.
        if plan.storage_data is not None and not isinstance(plan.storage_data, dict):
            return plan  # a storage_data this reader did not make: leave it alone
        m = self._load_manifest()  # the step and its commit time: an overwrite of the same step differs too
        return dataclasses.replace(plan, storage_data={**(plan.storage_data or {}), "luopan_step": m.step,
                                                       "luopan_created": m.created})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        read = {(p.storage_data.get("luopan_step"), p.storage_data.get("luopan_created")) for p in plans
                 if isinstance(p.storage_data, dict) and "luopan_step" in p.storage_data}
        steps = sorted({step for step, _created in read}, key=str)
        if len(read) > 1:  # a save committed between two ranks' reads of "latest": never load a mix of steps
            raise UsageError(f"the ranks loading run {self.run!r} found different latest checkpoints (steps "
                             f"{', '.join(map(str, steps))}: one was committed while they read); nothing was loaded "
                             "— pass step= to luopan.dcp.Reader")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        repo = _repo(self.location, create=False)
        m = self._load_manifest()
        where = f"run {self.run!r} step {m.step}"
        cache: dict[int, torch.Tensor] = {}
        for item in plan.items:
            info = self._storage.get(item.storage_index)
            if info is None:
                raise CorruptManifestError(f"{where}: DCP asked for {item.storage_index.fqn!r}, which the checkpoint "
                                           "does not list")
            if item.type == LoadItemType.BYTE_IO:
                value = unflatten(info["value"], _no_entries(where), where)
                buf = io.BytesIO()
                torch.save(value, buf)  # a payload serialised here, from verified JSON: DCP's planner reads it
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            i = info["entry"]
            if i not in cache:
                cache[i] = repo.checkpointing.load_entry(m, i)
            src_part = cache[i]
            try:
                for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src_part = src_part.narrow(dim, off, length)
            except (IndexError, RuntimeError) as exc:
                raise CorruptManifestError(f"{where}: DCP asked for a region of {item.storage_index.fqn!r} outside "
                                           f"its stored chunk ({exc})") from None
            target = planner.resolve_tensor(item).detach()
            if target.shape != src_part.shape:
                raise CorruptManifestError(f"{where}: {item.storage_index.fqn!r} is {tuple(src_part.shape)} here, "
                                           f"DCP expects {tuple(target.shape)}")
            target.copy_(src_part)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _no_entries(where: str) -> Any:
    def entry(i: int) -> Any:
        raise CorruptManifestError(f"{where}: a DCP value names entry {i}")
    return entry
