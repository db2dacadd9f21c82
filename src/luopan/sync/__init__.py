"""Live weight sync (docs/format.md §19): ship each training step's weights to running inference workers as small,
signed, verified deltas, applied in place.

    pub = luopan.sync.Publisher("/shared/sync", key="keys/luopan.key", keep=8)
    pub.publish(step, model)                       # after optimizer.step()

    sub = luopan.sync.Subscriber("/shared/sync", trusted_keys="trusted/")
    sub.update(model)                              # -> the version applied, or None; sub.version
"""

from typing import Any

from .helpers import StepPublisher, WeightLoader, publish_on_step
from .publisher import Publisher
from .subscriber import Subscriber

__all__ = ["Publisher", "StepPublisher", "Subscriber", "SyncCallback", "WeightLoader", "publish_on_step"]


def __getattr__(name: str) -> Any:
    if name == "SyncCallback":  # imports transformers: only when asked for
        from .hf import SyncCallback

        return SyncCallback
    raise AttributeError(f"module 'luopan.sync' has no attribute {name!r}")
