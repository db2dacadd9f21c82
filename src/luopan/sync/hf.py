"""``luopan.sync.SyncCallback``: publish the model from a Hugging Face ``Trainer`` after every ``every``-th
optimizer step — ``Trainer(..., callbacks=[SyncCallback(luopan.sync.Publisher("/shared/sync"))])``."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..errors import UsageError
from .publisher import Publisher


class SyncCallback(TrainerCallback):  # type: ignore[misc]
    """Publish ``model`` (the Trainer's, unwrapped) on ``on_step_end`` of every ``every``-th global step, tagged with
    ``state.global_step``; on the main process only (``state.is_world_process_zero``)."""

    def __init__(self, publisher: Publisher, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"every={every!r} is not a positive number of steps")
        self.publisher, self.every = publisher, every
        self.versions: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None or not state.is_world_process_zero or state.global_step % self.every:
            return
        self.versions.append(self.publisher.publish(int(state.global_step), model))
