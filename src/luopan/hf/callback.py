"""The Hugging Face ``Trainer`` through luopan: ``Trainer(..., callbacks=[LuopanCallback("ckpts", "run-a")])``.

Every checkpoint the Trainer saves lands in luopan once, as one checkpoint of ``run`` at the global step: the model
(or, for a PEFT model, only its adapter with its config and the base model's content fingerprint, luopan.peft), the
optimizer, LR scheduler, AMP scaler, the RNG states (as tensors) and ``trainer_state`` (typed JSON) — no
``checkpoint-N`` directory, no pickled ``rng_state.pth``/``training_args.bin``. ``trainer.train(
resume_from_checkpoint=True)`` resumes from the latest luopan checkpoint of the run, ``=N`` (an int) from step N
(a path ``…/checkpoint-N`` that does not exist on disk also means step N; an existing directory is left to the
Trainer). ``save_total_limit`` rotates luopan checkpoints the way the Trainer rotates directories, never deleting the
best saved one, nor a pinned one (``load_best_model_at_end`` loads the best from luopan at the end). As there is no
directory, ``trainer.state.best_model_checkpoint`` is the luopan reference ``RUN@STEP`` of the best saved checkpoint
(e.g. ``"run-a@400"``, also in the saved ``trainer_state``): ``luopan export -r REPO RUN@STEP`` writes its weights,
``repo.load(run, step)`` reads it.

A training only adds steps after the one it resumed from: it refuses to start when the run already holds checkpoints
it would replace or rotate away (a fresh ``train()`` into a used run, or a resume from an earlier step of a run that
went further) — resume from the latest, use another run, or delete them. Single process only (no DeepSpeed/FSDP:
use luopan.dcp); hyperparameter-search trials are refused (they would share the run).

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
import os
import re
import shutil
import tempfile
import types
import warnings
from typing import Any

import numpy as np
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import CheckpointNotFoundError, UsageError
from ..format.names import check_run, is_run_name
from ..peft import adapter_state, apply_adapter, is_peft_model
from ..repo import Repo, open as open_repo
from .state import logged_metrics, plain, rng_state, set_rng_state

TRAINER_STATE = "trainer_state.json"
_REPLACED = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
             "_load_rng_state", "_load_best_model")
_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)$")


def _default_run(args: Any) -> str:
    name = os.path.basename(os.path.normpath(str(args.output_dir or "trainer_output")))
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-_") or "trainer"
    return name[:128] if is_run_name(name[:128]) else "trainer"


class LuopanCallback(TrainerCallback):
    """Store every checkpoint of the Trainer it is given to in luopan (module docstring). ``run`` defaults to the
    name of ``args.output_dir``."""

    def __init__(self, repo_or_url: Repo | str | os.PathLike[str], run: str | None = None, *,
                 inputs: list[str] | None = None) -> None:
        self.location = repo_or_url
        self.inputs = list(inputs) if inputs else None  # lineage: "NAME@V" each checkpoint was trained on (§8)
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
        trainer = _calling_trainer(self)
        if trainer is not None and trainer is not self.trainer:
            self.attach(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise UsageError("LuopanCallback was added after the Trainer was created: call "
                             "callback.attach(trainer) before trainer.train(), or pass it in Trainer(callbacks=[...])")
        if args is not self.trainer.args:
            raise UsageError("this LuopanCallback is bound to another Trainer: give each Trainer its own "
                             "LuopanCallback (or call callback.attach(trainer))")

    def attach(self, trainer: Trainer) -> LuopanCallback:
        """Route ``trainer``'s checkpoint saves and loads through luopan (done for you when the callback is passed
        to the Trainer's constructor)."""
        if self.trainer is not None and self.trainer is not trainer:
            raise UsageError("this LuopanCallback is already bound to another Trainer: give each Trainer its own")
        if getattr(trainer.args, "world_size", 1) > 1 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise UsageError("LuopanCallback stores single-process Trainer runs without DeepSpeed or FSDP (their "
                             "model state is sharded); for those save through luopan.dcp, or repo.save(..., "
                             "group=True) in your own loop")
        overridden = [name for name in _REPLACED if getattr(type(trainer), name) is not getattr(Trainer, name)]
        if "_save_checkpoint" in overridden:
            warnings.warn(f"{type(trainer).__name__} overrides _save_checkpoint: LuopanCallback replaces it, so that "
                          "override does not run (subclass and call luopan's state_tree instead)", stacklevel=3)
        self.trainer = trainer
        if self.run is None:
            self.run = _default_run(trainer.args)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        original_train = trainer.train
        for name in _REPLACED:
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
        steps = self.repo.steps(self.run)
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
            parent = os.path.dirname(os.path.abspath(text.rstrip("/")))
            if match is None or parent != os.path.abspath(str(self.trainer.args.output_dir)):  # type: ignore[union-attr]
                raise UsageError(f"resume_from_checkpoint={text!r} is neither a directory nor checkpoint-N of this "
                                 f"Trainer's output_dir: pass a step of run {self.run!r} (an int) or True for the "
                                 "latest")
            step = int(match.group(1))
        else:
            raise UsageError(f"resume_from_checkpoint must be True, a step or a path, not {type(value).__name__}")
        if step not in steps:
            raise CheckpointNotFoundError(f"run {self.run!r} has no checkpoint at step {step}; it has "
                                          f"{', '.join(map(str, steps[-10:])) or 'none'}")
        return step

    def _train(self, original_train: Any, resume_from_checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.resolve_step(resume_from_checkpoint)
        self._check_run_is_ours(step)
        if step is None:
            return original_train(resume_from_checkpoint, *args, **kwargs)
        tree = self.repo.load(self.run, step)
        directory = tempfile.mkdtemp(prefix=f"luopan-resume-{step}-")
        try:  # the Trainer reads trainer_state.json from a path: give it one, and everything else from luopan
            with open(os.path.join(directory, TRAINER_STATE), "w", encoding="utf-8") as f:
                # best_model_checkpoint names no directory: restored after the Trainer's own check would drop it
                json.dump({**plain(tree["trainer_state"]), "best_model_checkpoint": None}, f)
            self._resume = {"dir": directory, "step": step, "tree": tree}
            return original_train(directory, *args, **kwargs)
        finally:
            self._resume = None
            shutil.rmtree(directory, ignore_errors=True)

    def _check_run_is_ours(self, step: int | None) -> None:
        """A training writes only steps after the one it resumed from: refuse to start when the run holds
        checkpoints this training would replace or rotate away (a fresh training into a used run; a resume from
        an earlier step of a run that went further)."""
        steps = self.repo.steps(self.run)
        later = [s for s in steps if step is None or s > step]
        if later:
            shown = ", ".join(map(str, later[-8:]))
            raise UsageError(
                f"run {self.run!r} already has checkpoints at steps {shown}"
                + (f" after step {step}, from a training that went further" if step is not None else "")
                + ": this training would replace them. Resume from the latest (resume_from_checkpoint=True), give "
                "this training its own run (LuopanCallback(repo, 'new-run')), or delete them first (repo.delete)")
        args = self.trainer.args  # type: ignore[union-attr]
        if args.save_total_limit == 1 and args.metric_for_best_model and os.path.isdir(str(args.output_dir)) and \
                any(_CHECKPOINT_DIR.match(n) for n in os.listdir(str(args.output_dir))):
            raise UsageError(f"{args.output_dir} holds the Trainer's own checkpoint-N directories, which the Trainer "
                             "would compare with luopan's best checkpoint at the end (save_total_limit=1): move them "
                             "out of output_dir")

    def _tree_for(self, checkpoint: Any) -> dict[str, Any] | None:
        r = self._resume
        if r is not None and checkpoint is not None and os.fspath(checkpoint) == r["dir"]:
            return r["tree"]
        return None

    # -- what replaces the Trainer's methods (self: this callback; trainer: self.trainer) -----------------------
    def _t_save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        if trial is not None or trainer.hp_search_backend is not None:
            raise UsageError("LuopanCallback does not store hyperparameter-search trials (they would share one "
                             "run): search without it, then train the chosen configuration with it")
        trainer.store_flos()
        args, state = trainer.args, trainer.state
        step = int(state.global_step)
        steps = set(self.repo.steps(self.run))
        best = state.best_global_step
        if best and (best == step or best in steps):  # as the Trainer: only a best step that was saved counts
            state.best_model_checkpoint = f"{self.run}@{best}"  # a luopan reference: no directory holds it
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                   if isinstance(c, ExportableState)]:  # as the Trainer records its stateful callbacks
            cb_state = cb.state()
            if isinstance(state.stateful_callbacks.get(type(cb).__name__), list):
                state.stateful_callbacks[type(cb).__name__].append(cb_state)
            else:
                state.stateful_callbacks[type(cb).__name__] = cb_state
        tree = self.state_tree(trainer)
        self.repo.save(self.run, step, tree, metrics=logged_metrics(state, step), overwrite=True,
                       metadata={"hf": {"checkpoint": f"checkpoint-{step}", "transformers_trainer": True}},
                       inputs=self.inputs)
        self._rotate(args.save_total_limit, _best_step(state, self.run))

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
        tree["training_args"] = plain(trainer.args.to_dict())
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
        best = _best_step(state, self.run)
        if args.save_total_limit == 1 and best is not None:
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
        tree.pop("model", None)  # loaded: keep only what later loads need

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
        for name in ("optimizer", "scheduler"):
            tree.pop(name, None)
        saved = _ref_step(tree["trainer_state"].get("best_model_checkpoint"), self.run)  # withheld: not a directory
        if trainer.state.best_model_checkpoint is None and saved in self.repo.steps(self.run):
            trainer.state.best_model_checkpoint = f"{self.run}@{saved}"

    def _t_load_scaler(self, checkpoint: Any) -> None:
        tree = self._tree_for(checkpoint)
        trainer = self.trainer
        assert trainer is not None
        if tree is None:
            return trainer._luopan_original["_load_scaler"](checkpoint)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if "scaler" in tree and scaler is not None:
            scaler.load_state_dict(tree.pop("scaler"))

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
        best = _best_step(trainer.state, self.run)
        if best in self.repo.steps(self.run):
            self._load_model(trainer.model, self.repo.load(self.run, best), best)
        elif os.path.isdir(str(trainer.state.best_model_checkpoint)):  # a Trainer directory this run resumed from
            trainer._luopan_original["_load_best_model"]()
        else:
            warnings.warn(f"the best checkpoint ({trainer.state.best_model_checkpoint}) is neither in run "
                          f"{self.run!r} nor on disk: the final model is not the best one", stacklevel=2)


def _ref_step(value: Any, run: str) -> int | None:
    """The step ``best_model_checkpoint`` names in ``run``: ``RUN@STEP`` (what this callback sets), or a
    ``…/checkpoint-N`` path (what the Trainer sets, and what older luopan versions saved); None otherwise."""
    if not isinstance(value, str) or not value:
        return None
    name, at, number = value.rpartition("@")
    if at:
        return int(number) if name == run and number.isascii() and number.isdigit() else None
    match = _CHECKPOINT_DIR.search(value.rstrip("/"))
    return int(match.group(1)) if match else None


def _best_step(state: Any, run: str) -> int | None:
    """The step of the best checkpoint the Trainer tracks (``best_model_checkpoint``: only a saved best counts, not
    ``best_global_step``, which also moves at an evaluation that was not saved)."""
    return _ref_step(state.best_model_checkpoint, run)


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
