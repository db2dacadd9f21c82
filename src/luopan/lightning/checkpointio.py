"""PyTorch Lightning through luopan: ``Trainer(plugins=[LuopanCheckpointIO("ckpts", "run-a")])``.

Every checkpoint Lightning saves (ModelCheckpoint's top-k, ``last``, ``trainer.save_checkpoint``) becomes a luopan
checkpoint of ``run`` at the trainer's global step: written atomically, deduplicated, verified on load, never
pickled (its hyper-parameters, callback states and loop states are typed JSON values, docs/format.md §8.3). Lightning
keeps addressing checkpoints by file path, so the plugin also writes, at that path, a small JSON *pointer* naming the
repository, run and step; ``trainer.fit(ckpt_path=path)`` and ``ckpt_path="last"`` resolve through it. Each
checkpoint records the metrics the dict tells (luopan.lightning.metrics: the monitored one, every logged scalar with
ExactResume). ``remove_checkpoint`` (top-k rotation) deletes the pointer and that checkpoint, unless another pointer
(``last``) still names the same step, and frees the packs only it needed at once (``reclaim=True``, the default;
docs/format.md §10.3.1); so does a save that replaces the checkpoint of the same step (top-k, then ``last``). ``LightningModule.load_from_checkpoint(path)`` reads the path with ``torch.load``, which
cannot read a pointer: use ``luopan.lightning.load_from_checkpoint(ModuleClass, path_or_repo, run, step)``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.core.saving import _load_state

from .._files import write_atomic, write_error
from ..errors import CheckpointExistsError, CorruptRepoError
from ..format.names import check_run, check_step
from ..repo import Repo, open as open_repo
from .metrics import checkpoint_metrics

POINTER_FORMAT = "luopan-lightning-pointer"


def _location(repo_or_url: Repo | str | os.PathLike[str]) -> str:
    if isinstance(repo_or_url, Repo):
        root = getattr(repo_or_url.store, "root", None)
        return os.path.abspath(root) if root is not None else repo_or_url.where
    text = os.fspath(repo_or_url)
    return text if "://" in text else os.path.abspath(text)


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The repository, run and step a pointer file names; CorruptRepoError when it is not one."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 16))
        if doc.get("format") != POINTER_FORMAT:
            raise ValueError("not a luopan pointer")
        return {"repo": str(doc["repo"]), "run": check_run(doc["run"]), "step": check_step(doc["step"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRepoError(f"{path} is not a luopan checkpoint pointer ({exc}): it was not written by "
                               "luopan.lightning.LuopanCheckpointIO") from None


class LuopanCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` storing every checkpoint in luopan repository ``repo_or_url`` under ``run``."""

    def __init__(self, repo_or_url: Repo | str | os.PathLike[str], run: str, *,
                 inputs: list[str] | None = None, reclaim: bool = True) -> None:
        self.reclaim = reclaim  # free a rotated-out checkpoint's own packs at once (docs/format.md §10.3.1)
        self.location = _location(repo_or_url)
        self.inputs = list(inputs) if inputs else None  # lineage: "NAME@V" each checkpoint was trained on (§8)
        self.run = check_run(run)
        self._repo = repo_or_url if isinstance(repo_or_url, Repo) else None
        self._pointers: dict[str, int] = {}  # pointer path -> step, every pointer this plugin wrote

    @property
    def repo(self) -> Repo:
        if self._repo is None:
            self._repo = open_repo(self.location)
        return self._repo

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = int(checkpoint.get("global_step", 0))
        metrics = checkpoint_metrics(checkpoint)
        path = os.path.abspath(os.fspath(path))
        try:
            before = read_pointer(path) if os.path.exists(path) else None
        except CorruptRepoError:
            before = None
        if step in self.repo.steps(self.run) and step not in self._pointers.values():
            # Not written by this fit: a pointer elsewhere may name it (training again after resuming from an
            # earlier checkpoint reaches steps that exist). Replacing it would change what that pointer loads.
            raise CheckpointExistsError(
                f"run {self.run!r} already has a checkpoint at step {step} from an earlier fit: give this branch of "
                "training its own run (LuopanCheckpointIO(repo, 'new-run')), or delete that step first")
        # Top-k and `last` may save at one global step: the later save replaces the earlier (same trainer state);
        # the packs only the replaced one named (callback states that differ) are freed with it.
        replaced = self.repo.checkpointing.packs(self.run, step) \
            if self.reclaim and step in self._pointers.values() else frozenset()
        self.repo.save(self.run, step, checkpoint, metrics=metrics or None, overwrite=True,
                       metadata={"lightning_path": path}, inputs=self.inputs)
        if replaced:
            self.repo.checkpointing.reclaim(replaced - self.repo.checkpointing.packs(self.run, step))
        self._write_pointer(path, step)
        self._pointers[path] = step
        if before is not None and before["step"] != step and self._owns(before):
            self._forget(before, os.path.dirname(path))  # `last` moved on: its old step may be nobody's now

    def _write_pointer(self, path: str, step: int) -> None:
        doc = {"format": POINTER_FORMAT, "repo": self.location, "run": self.run, "step": step}
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, path) from None
        write_atomic(path, json.dumps(doc).encode())

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        ptr = read_pointer(path)
        repo = self.repo if ptr["repo"] == self.location else open_repo(ptr["repo"], create=False)
        return repo.load(ptr["run"], ptr["step"])

    def remove_checkpoint(self, path: Any) -> None:
        path = os.path.abspath(os.fspath(path))
        try:
            ptr = read_pointer(path)
        except CorruptRepoError:
            return
        os.unlink(path)
        self._pointers.pop(path, None)
        if self._owns(ptr):  # a pointer into another repository or run is only unlinked
            self._forget(ptr, os.path.dirname(path))

    def _owns(self, ptr: dict[str, Any]) -> bool:
        return (ptr["repo"], ptr["run"]) == (self.location, self.run)

    def _forget(self, ptr: dict[str, Any], directory: str) -> None:
        """Delete the checkpoint a removed or moved pointer named, unless another pointer still names it (one this
        plugin wrote anywhere, or any in the same directory)."""
        if ptr["step"] in self._pointers.values() or _named_elsewhere(directory, ptr):
            return
        self.repo.delete(ptr["run"], ptr["step"], reclaim=self.reclaim)

    def teardown(self) -> None:
        if self._repo is not None:
            self._repo.close()
            self._repo = None


def _named_elsewhere(directory: str, ptr: dict[str, Any]) -> bool:
    """Whether another pointer in ``directory`` (e.g. ``last.ckpt``) names the same checkpoint."""
    try:
        names = os.listdir(directory)
    except OSError:
        return True  # cannot tell: keep the checkpoint
    for name in names:
        if name.startswith(".") or ".tmp-" in name:
            continue
        try:
            other = read_pointer(os.path.join(directory, name))
        except CorruptRepoError:
            continue
        if (other["repo"], other["run"], other["step"]) == (ptr["repo"], ptr["run"], ptr["step"]):
            return True
    return False


def load_from_checkpoint(module_cls: Any, source: Repo | str | os.PathLike[str], run: str | None = None,
                         step: int | None = None, *, strict: bool | None = None, **kwargs: Any) -> Any:
    """``ModuleClass.load_from_checkpoint`` for luopan: ``source`` is a pointer file written by the plugin, or a
    repository (then ``run`` and ``step``, the latest when None). Hyper-parameters are restored as Lightning does."""
    if run is None:
        ptr = read_pointer(source)  # type: ignore[arg-type]
        repo, run, step = open_repo(ptr["repo"], create=False), ptr["run"], ptr["step"]
    else:
        repo = source if isinstance(source, Repo) else open_repo(source, create=False)
    checkpoint = repo.load(run, step)
    return _load_state(module_cls, checkpoint, strict=strict, **kwargs)
