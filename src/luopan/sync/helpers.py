"""Live sync in the training stacks: publish from a plain torch loop (an optimizer step hook), and feed a
vLLM-style worker — one that takes ``(name, tensor)`` pairs (``model.load_weights``) — without depending on vLLM.
The Hugging Face Trainer callback is luopan.sync.hf.SyncCallback."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import UsageError
from .publisher import Publisher
from .subscriber import Subscriber


class StepPublisher:
    """Publish ``model`` after every ``every``-th optimizer step: ``luopan.sync.publish_on_step(opt, pub, model)``
    hooks it into ``optimizer.step()``; or call it yourself after ``optimizer.step()`` (``hook(step)``)."""

    def __init__(self, publisher: Publisher, model: Any, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"every={every!r} is not a positive number of steps")
        self.publisher, self.model, self.every = publisher, model, every
        self.steps = 0

    def __call__(self, step: int | None = None, *_hook_args: Any) -> int | None:
        """Count one optimizer step; publish on every ``every``-th (the version, else None). ``step``: the
        training step to record (default: the count of steps seen)."""
        self.steps += 1
        if self.steps % self.every:
            return None
        return self.publisher.publish(self.steps if not isinstance(step, int) else step, self.model)


def publish_on_step(optimizer: Any, publisher: Publisher, model: Any, every: int = 1) -> Any:
    """Publish ``model`` after every ``every``-th ``optimizer.step()`` (a post-step hook); returns the hook's handle
    (``.remove()`` stops it)."""
    hook = StepPublisher(publisher, model, every)
    return optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: hook())


class WeightLoader:
    """Keep a vLLM-style worker in sync: a Subscriber applies each version to ``state`` (a state dict of tensors
    with the published names and shapes: the worker's own parameters when the names match, else a CPU shadow copy),
    then the tensors that changed go to ``load_weights`` as ``(name, tensor)`` pairs — what
    ``vllm``'s ``model.load_weights(weights)`` takes (it maps names to its fused layers itself).

        loader = luopan.sync.WeightLoader(sub, model.load_weights, shadow_state)
        loader.update()        # the version applied (and loaded), or None
    """

    def __init__(self, subscriber: Subscriber, load_weights: Callable[[Iterable[tuple[str, Any]]], Any],
                 state: dict[str, Any]) -> None:
        self.subscriber, self.load_weights, self.state = subscriber, load_weights, state

    @property
    def version(self) -> int | None:
        return self.subscriber.version

    def update(self) -> int | None:
        version = self.subscriber.update(self.state)
        if version is not None:
            changed = self.subscriber.changed
            self.load_weights((name, self.state[name]) for name in changed)
        return version
