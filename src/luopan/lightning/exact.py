"""``ExactResume``: a Lightning callback that makes ``trainer.fit(ckpt_path=…)`` continue bit for bit.

Lightning's checkpoints hold weights, optimizer, schedulers and loop counters, but not the random streams: after a
resume, dropout masks and a shuffled ``DataLoader``'s order (its ``RandomSampler`` seeds each epoch from torch's
global RNG) differ from the run that was interrupted. ``ExactResume`` stores, in its callback state of every
checkpoint, the global RNG states (Python ``random``, NumPy, torch CPU, CUDA when initialized:
``luopan.torch.state.rng_state``) and puts them back when the checkpoint is loaded, before Lightning builds the
loaders' iterators. It also records every scalar the module logged (``trainer.callback_metrics``), which
``LuopanCheckpointIO`` stores as the checkpoint's metrics.

Exact for checkpoints written at an epoch's end (ModelCheckpoint's default) with loaders that draw from the global
streams (``DataLoader(shuffle=True)``). A loader given its own ``generator=``, or a checkpoint written mid-epoch,
needs a loader with a ``state_dict`` of its own (``luopan.torch.ResumableLoader``, torchdata's
``StatefulDataLoader``), which Lightning saves and restores itself. Works with any CheckpointIO (its state is tensors
and numbers)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from ..torch.state import rng_state, set_rng_state
from .metrics import EXACT_RESUME_KEY, scalars


class ExactResume(Callback):
    """``Trainer(callbacks=[ExactResume()])``: RNG states saved with every checkpoint and
    restored on resume, so a resumed ``fit`` gives bitwise the weights of an uninterrupted one (module docstring)."""

    def __init__(self) -> None:
        self._trainer: Any = None

    @property
    def state_key(self) -> str:
        return EXACT_RESUME_KEY

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {"rng": rng_state()}
        if trainer is not None:
            state["metrics"] = scalars(trainer.callback_metrics)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loads callback states before it builds the loaders' iterators, which draw from these streams
        # (the sampler's seed for the epoch, the loader's base seed), and before any training step.
        set_rng_state(state_dict["rng"])
