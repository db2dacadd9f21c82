"""What a LangGraph journal holds, in LangGraph's words (threads and their checkpoints), for listings (``luopan ls``,
``stats``, ``show`` and the report through luopan.listing). Read only, beside a running saver: the journal's latest
snapshot plus the records after it, replayed into the saver's index (docs/format.md §18), values never read."""

from __future__ import annotations

from typing import Any

from ..errors import LuopanError
from ..journal import Journal
from .index import Index
from .records import FORMAT, SNAPSHOT_MAGIC, decode


def _is_langgraph(value: Any) -> bool:
    if not isinstance(value, (bytes, bytearray, memoryview)) or not value or value[0] != FORMAT:
        return False
    try:
        head = decode(value)
    except LuopanError:
        return False
    return isinstance(head[0], int) or head[0] == SNAPSHOT_MAGIC


def threads_of(repo: Any, name: str) -> dict[str, int] | None:
    """thread id -> its checkpoints (every namespace) in the LangGraph journal ``name`` of ``repo`` (an open
    luopan.Repo or Repository), or None when it is not a LangGraph saver's journal or cannot be read now (a listing
    shows its journal words then; ``luopan verify`` and opening the saver name any damage)."""
    try:
        with Journal(repo, name=name, read_only=True) as journal:
            snap = journal.latest_snapshot()
            index = Index()
            start = journal.first_seq
            if snap is not None:
                if not _is_langgraph(snap.value):
                    return None
                index.load_snapshot(bytes(snap.value))
                start = max(start, snap.seq)
            first = True
            for seq, raw in journal.items(start_seq=start):
                if first and snap is None and not _is_langgraph(raw):
                    return None
                first = False
                index.apply(decode(raw), seq)
            if snap is None and first:
                return None  # an empty journal: nothing says whose it is
    except (LuopanError, OSError):
        return None
    out: dict[str, int] = {}
    for thread, _ns, space in index.spaces():
        out[thread] = out.get(thread, 0) + len(space.ckpts)
    return dict(sorted(out.items()))


def describe_journal(repo: Any, name: str) -> dict[str, int] | None:
    """``{"threads": n, "checkpoints": m}`` of the LangGraph journal ``name``, or None (see threads_of)."""
    threads = threads_of(repo, name)
    return None if threads is None else {"threads": len(threads), "checkpoints": sum(threads.values())}
