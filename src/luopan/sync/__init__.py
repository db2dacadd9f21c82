"""Live weight sync (docs/format.md §19): ship each training step's weights to running inference workers as small,
signed, verified deltas, applied in place.

    pub = luopan.sync.Publisher("/shared/sync", key="keys/luopan.key", keep=8)
    pub.publish(step, model)                       # after optimizer.step()

    sub = luopan.sync.Subscriber("/shared/sync", trusted_keys="trusted/")
    sub.update(model)                              # -> the version applied, or None; sub.version
"""

from .publisher import Publisher
from .subscriber import Subscriber

__all__ = ["Publisher", "Subscriber"]
