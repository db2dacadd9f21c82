"""The Hugging Face ``Trainer`` through luopan: ``Trainer(..., callbacks=[LuopanCallback("ckpts", "run-a")])``.

Every checkpoint the Trainer saves lands in luopan once, as one checkpoint of ``run`` at the global step: the model
(or, for a PEFT model, only its adapter with its config and the base model's content fingerprint, luopan.peft), the
optimizer, LR scheduler, AMP scaler, the RNG states (as tensors) and ``trainer_state`` (typed JSON) — no
``checkpoint-N`` directory, no pickled ``rng_state.pth``/``training_args.bin``. ``trainer.train(
resume_from_checkpoint=True)`` resumes from the latest luopan checkpoint of the run, ``=N`` (an int) from step N
(a path ``…/checkpoint-N`` that does not exist on disk also means step N; an existing directory is left to the
Trainer). ``save_total_limit`` rotates luopan checkpoints the way the Trainer rotates directories, never deleting the
best one (``load_best_model_at_end`` loads it from luopan at the end).

Why a callback that binds itself to its Trainer: the callback API cannot stop the Trainer writing its own
directory, and the Trainer reads a resumed checkpoint from files, not through callbacks. So the callback, when the
Trainer announces it was created (``on_init_end``), replaces that Trainer's checkpoint methods (save, and the model,
optimizer, scaler, RNG and best-model loads) with luopan's, on that instance only. Adding the callback after the
Trainer exists (``trainer.add_callback``) needs ``callback.attach(trainer)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import random
import re
import shutil
import tempfile
import types
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from .errors import CheckpointNotFoundError, UsageError
from .format.names import check_run, is_run_name
from .peft import adapter_state, apply_adapter, is_peft_model
from .repo import Repo, open as open_repo

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)$")


def rng_state() -> dict[str, Any]:
    """The RNG states the Trainer saves (Python, NumPy, torch CPU and CUDA), as arrays only."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": np.array(list(internal) + [version], dtype=np.uint64),
        "python_gauss": np.array([] if gauss is None else [gauss], dtype=np.float64),
        "numpy_key": np.asarray(np_state["state"]["key"], dtype=np.uint32),
        "numpy_misc": np.array([np_state["state"]["pos"], np_state["has_gauss"], np_state["gauss"]],
                               dtype=np.float64),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def set_rng_state(saved: dict[str, Any]) -> None:
    py = [int(x) for x in np.asarray(saved["python"]).tolist()]
    gauss = np.asarray(saved["python_gauss"]).tolist()
    random.setstate((py[-1], tuple(py[:-1]), gauss[0] if gauss else None))
    pos, has_gauss, cached = np.asarray(saved["numpy_misc"]).tolist()
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": np.asarray(saved["numpy_key"]),
                                                               "pos": int(pos)},
                         "has_gauss": int(has_gauss), "gauss": float(cached)})
    torch.random.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available() and len(saved["cuda"]) == torch.cuda.device_count():
        torch.cuda.random.set_rng_state_all(list(saved["cuda"]))


def _default_run(args: Any) -> str:
    name = os.path.basename(os.path.normpath(str(args.output_dir or "trainer_output")))
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-_") or "trainer"
    return name[:128] if is_run_name(name[:128]) else "trainer"


class LuopanCallback(TrainerCallback):
    """Store every checkpoint of the Trainer it is given to in luopan (module docstring). ``run`` defaults to the
    name of ``args.output_dir``."""

    def __init__(self, repo_or_url: Repo | str | os.PathLike[str], run: str | None = None) -> None:
        self.location = repo_or_url
        self.run = check_run(run) if run is not None else None
        self.trainer: Trainer | None = None
        self._repo = repo_or_url if isinstance(repo_or_url, Repo) else None
        self._resume: dict[str, Any] | None = None  # {"dir", "step", "tree"} while a resume is being loaded

    @property
    def repo(self) -> Repo:
        if self._repo is None:
            self._repo = open_repo(self.location)
        return self._repo

    # -- binding ------------------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            trainer = _calling_trainer(self)
            if trainer is not None:
                self.attach(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise UsageError("LuopanCallback was added after the Trainer was created: call "
                             "callback.attach(trainer) before trainer.train(), or pass it in Trainer(callbacks=[...])")

    def attach(self, trainer: Trainer) -> LuopanCallback:
        """Route ``trainer``'s checkpoint saves and loads through luopan (done for you when the callback is passed
        to the Trainer's constructor)."""
        if getattr(trainer.args, "world_size", 1) > 1:
            raise UsageError("LuopanCallback stores single-process Trainer runs; for several processes save through "
                             "luopan.dcp (FSDP/DCP) or repo.save(..., group=True) in your own loop")
        self.trainer = trainer
        if self.run is None:
            self.run = _default_run(trainer.args)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        original_train = trainer.train
        for name in ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
                     "_load_rng_state", "_load_best_model"):
            setattr(trainer, name, types.MethodType(getattr(LuopanCallback, "_t" + name), self))
        trainer._luopan_original = {name: getattr(type(trainer), name).__get__(trainer)  # type: ignore[attr-defined]
                                    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler",
                                                 "_load_scaler", "_load_rng_state", "_load_best_model")}

        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            return self._train(original_train, resume_from_checkpoint, *args, **kwargs)

        trainer.train = train  # type: ignore[method-assign]
        return self

    # -- resuming -----------------------------------------------------------------------------------------------
    def resolve_step(self, resume_from_checkpoint: Any) -> int | None:
        """The luopan step ``trainer.train(resume_from_checkpoint=…)`` means; None for an existing directory (the
        Trainer's own checkpoint) or no resume."""
        value = resume_from_checkpoint
        if value is None or value is False:
            return None
        steps = self.repo.steps(self.run) if self.run in self.repo.runs() else []
        if value is True:
            if not steps:
                raise CheckpointNotFoundError(f"run {self.run!r} has no checkpoint to resume from in "
                                              f"{self.repo.where}")
            return steps[-1]
        if isinstance(value, (int, np.integer)):
            step = int(value)
        elif isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if os.path.isdir(text):
                return None
            match = _CHECKPOINT_DIR.search(text.rstrip("/"))
            if match is None:
                raise UsageError(f"resume_from_checkpoint={text!r} is neither a directory nor checkpoint-N: pass a "
                                 f"step of run {self.run!r} (an int) or True for the latest")
            step = int(match.group(1))
        else:
            raise UsageError(f"resume_from_checkpoint must be True, a step or a path, not {type(value).__name__}")
        if step not in steps:
            raise CheckpointNotFoundError(f"run {self.run!r} has no checkpoint at step {step}; it has "
                                          f"{', '.join(map(str, steps[-10:])) or 'none'}")
        return step

    def _train(self, original_train: Any, resume_from_checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.resolve_step(resume_from_checkpoint)
        if step is None:
            return original_train(resume_from_checkpoint, *args, **kwargs)
        tree = self.repo.load(self.run, step)
        directory = tempfile.mkdtemp(prefix=f"luopan-resume-{step}-")
        try:  # the Trainer reads trainer_state.json from a path: give it one, and everything else from luopan
            with open(os.path.join(directory, TRAINER_STATE), "w", encoding="utf-8") as f:
                json.dump(_plain(tree["trainer_state"]), f)
            self._resume = {"dir": directory, "step": step, "tree": tree}
            return original_train(directory, *args, **kwargs)
        finally:
            self._resume = None
            shutil.rmtree(directory, ignore_errors=True)

    def _tree_for(self, checkpoint: Any) -> dict[str, Any] | None:
        r = self._resume
        if r is not None and checkpoint is not None and os.fspath(checkpoint) == r["dir"]:
            return r["tree"]
        return None

    # -- what replaces the Trainer's methods (self: this callback; trainer: self.trainer) -----------------------
    def _t_save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        args, state = trainer.args, trainer.state
        step = int(state.global_step)
        steps = set(self.repo.steps(self.run)) if self.run in self.repo.runs() else set()
        best = state.best_global_step
        if best and (best == step or best in steps):
            state.best_model_checkpoint = os.path.join(trainer._get_output_dir(trial=trial), f"checkpoint-{best}")
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                   if isinstance(c, ExportableState)]:  # as the Trainer records its stateful callbacks
            cb_state = cb.state()
            if isinstance(state.stateful_callbacks.get(type(cb).__name__), list):
                state.stateful_callbacks[type(cb).__name__].append(cb_state)
            else:
                state.stateful_callbacks[type(cb).__name__] = cb_state
        tree = self.state_tree(trainer)
        self.repo.save(self.run, step, tree, metrics=_metrics(state, step), overwrite=True,
                       metadata={"hf": {"checkpoint": f"checkpoint-{step}", "transformers_trainer": True}})
        self._rotate(args.save_total_limit, best)

    def state_tree(self, trainer: Trainer) -> dict[str, Any]:
        """What one Trainer checkpoint is in luopan."""
        model = trainer.model
        tree: dict[str, Any] = adapter_state(model) if is_peft_model(model) else {"model": model.state_dict()}
        if not trainer.args.save_only_model:
            tree["optimizer"] = trainer.optimizer.state_dict()
            if trainer.lr_scheduler is not None:
                tree["scheduler"] = trainer.lr_scheduler.state_dict()
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                tree["scaler"] = scaler.state_dict()
            tree["rng"] = rng_state()
        tree["trainer_state"] = json.loads(json.dumps(dataclasses.asdict(trainer.state)))
        tree["training_args"] = _plain(trainer.args.to_dict())
        return tree

    def _rotate(self, limit: int | None, best: int | None) -> None:
        """Keep the newest ``limit`` checkpoints of the run and the best one (the Trainer's save_total_limit)."""
        if not limit or limit <= 0:
            return
        steps = self.repo.steps(self.run)
        keep = set(steps[-limit:])
        if best in steps:
            keep.add(best)
        self._delete([s for s in steps if s not in keep])

    def _delete(self, steps: list[int]) -> None:
        pins = self.repo.run(self.run).pins()
        for s in steps:
            if s not in pins:  # a checkpoint someone pinned is theirs to remove
                self.repo.delete(self.run, s)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer deletes every checkpoint but the best at the end when save_total_limit == 1: the same here.
        best = state.best_global_step
        if args.save_total_limit == 1 and best and self.run in self.repo.runs():
            steps = self.repo.steps(self.run)
            if best in steps:
                self._delete([s for s in steps if s != best])

    def _t_load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        tree = self._tree_for(resume_from_checkpoint)
        trainer = self.trainer
        assert trainer is not None
        if tree is None:
            return trainer._luopan_original["_load_from_checkpoint"](resume_from_checkpoint, model)
        self._load_model(model if model is not None else trainer.model, tree, self._resume["step"])  # type: ignore

    def _load_model(self, model: Any, tree: dict[str, Any], step: int) -> None:
        where = f"run {self.run!r} step {step}"
        if "peft" in tree:
            apply_adapter(model, tree, where)
        else:
            model.load_state_dict(tree["model"])

    def _t_load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        tree = self._tree_for(checkpoint)
        trainer = self.trainer
        assert trainer is not None
        if tree is None:
            return trainer._luopan_original["_load_optimizer_and_scheduler"](checkpoint)
        if "optimizer" in tree:
            trainer.optimizer.load_state_dict(tree["optimizer"])
        if "scheduler" in tree and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(tree["scheduler"])
        saved = tree["trainer_state"].get("best_model_checkpoint")  # dropped by the Trainer: not a directory
        if trainer.state.best_model_checkpoint is None and saved and \
                tree["trainer_state"].get("best_global_step") in self.repo.steps(self.run):
            trainer.state.best_model_checkpoint = saved

    def _t_load_scaler(self, checkpoint: Any) -> None:
        tree = self._tree_for(checkpoint)
        trainer = self.trainer
        assert trainer is not None
        if tree is None:
            return trainer._luopan_original["_load_scaler"](checkpoint)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if "scaler" in tree and scaler is not None:
            scaler.load_state_dict(tree["scaler"])

    def _t_load_rng_state(self, checkpoint: Any) -> None:
        tree = self._tree_for(checkpoint)
        trainer = self.trainer
        assert trainer is not None
        if tree is None:
            return trainer._luopan_original["_load_rng_state"](checkpoint)
        if "rng" in tree:
            set_rng_state(tree["rng"])

    def _t_load_best_model(self) -> None:
        trainer = self.trainer
        assert trainer is not None
        best = trainer.state.best_global_step
        if not best or best not in self.repo.steps(self.run):
            return trainer._luopan_original["_load_best_model"]()
        self._load_model(trainer.model, self.repo.load(self.run, best), best)


def _calling_trainer(callback: LuopanCallback) -> Trainer | None:
    """The Trainer whose constructor is announcing ``on_init_end`` to ``callback`` (found on the call stack)."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and callback in getattr(
                    getattr(candidate, "callback_handler", None), "callbacks", ()):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def _plain(value: Any) -> Any:
    """JSON data for the Trainer's own files: sets as lists, enums as values, non-finite floats as JSON allows."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "value", str(value))


def _metrics(state: Any, step: int) -> dict[str, float] | None:
    """The numbers the Trainer logged at this step (eval metrics, loss), for `luopan ls` and retention."""
    out: dict[str, float] = {}
    for row in state.log_history:
        if row.get("step") == step:
            out.update({k: float(v) for k, v in row.items()
                        if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out or None
