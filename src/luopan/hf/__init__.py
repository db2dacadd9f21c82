"""The Hugging Face ``Trainer`` through luopan: ``Trainer(..., callbacks=[LuopanCallback("ckpts", "run-a")])``
(luopan.hf.callback)."""

from .callback import LuopanCallback
from .state import rng_state, set_rng_state

__all__ = ["LuopanCallback", "rng_state", "set_rng_state"]
