"""LangGraph checkpointing on a luopan journal.

    from luopan.langgraph import LuopanSaver
    graph = builder.compile(checkpointer=LuopanSaver("ckpts"))

Needs ``langgraph-checkpoint`` (installed with ``langgraph``). See `LuopanSaver` and docs/format.md §18.
"""

from .saver import LuopanSaver
from .serde import PickledPayloadError

__all__ = ["LuopanSaver", "PickledPayloadError"]
