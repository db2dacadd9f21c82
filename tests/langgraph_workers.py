"""Worker processes for tests/test_langgraph_processes.py (run as ``python -m tests.langgraph_workers KIND ...`` or
by path): real LangGraph graphs, and a writer that keeps putting while another process runs the conformance suite."""

from __future__ import annotations

import json
import operator
import os
import sys
import time
from typing import Annotated, TypedDict


class State(TypedDict):
    messages: Annotated[list, operator.add]
    turns: int


def build(saver):
    from langgraph.graph import END, START, StateGraph

    def agent(state: State) -> dict:
        return {"messages": [f"reply {state['turns']}: " + "r" * 120], "turns": state["turns"] + 1}

    g = StateGraph(State)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    return g.compile(checkpointer=saver)


def cfg(thread: str) -> dict:
    return {"configurable": {"thread_id": thread}}


def turn(app, thread: str, i: int, durability: str = "sync") -> None:
    app.invoke({"messages": [f"{thread} says {i}: " + "u" * 80], "turns": i}, cfg(thread), durability=durability)


def graph_worker(repo: str, me: str, workers: int, threads: int, turns: int, barrier: str) -> None:
    """Run ``turns`` turns on each of ``threads`` threads of this worker, then (once every worker is done) report
    what this same saver sees of every worker's threads."""
    from luopan.langgraph import LuopanSaver

    with LuopanSaver(repo) as saver:
        app = build(saver)
        for i in range(turns):
            for t in range(threads):
                turn(app, f"{me}-t{t}", i)
        open(os.path.join(barrier, me), "w").close()
        deadline = time.monotonic() + 300
        while len(os.listdir(barrier)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = {}
        for w in range(workers):
            for t in range(threads):
                thread = f"w{w}-t{t}"
                state = app.get_state(cfg(thread))
                history = list(app.get_state_history(cfg(thread)))
                seen[thread] = [len(state.values.get("messages", [])), len(history)]
        listed = sorted({tup.config["configurable"]["thread_id"] for tup in saver.list(None)})
    print(json.dumps({"seen": seen, "listed": listed}), flush=True)


def noise_writer(repo: str, stop: str) -> None:
    """Puts, pending writes and deletes on threads ``noise-*`` until the file ``stop`` exists; compacts often
    (a low ``compact_min_dead_bytes``, small segments). Prints how many checkpoints it left on each thread."""
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

    from luopan.langgraph import LuopanSaver

    left: dict[str, int] = {}
    puts = 0
    with LuopanSaver(repo, compact_min_dead_bytes=1, segment_bytes=1 << 16) as saver:
        while not os.path.exists(stop):
            thread = f"noise-{puts % 4}"
            if left.get(thread, 0) >= 12:
                saver.delete_thread(thread)
                left[thread] = 0
            parent = saver.get_tuple(cfg(thread))
            ck = parent.checkpoint if parent is not None else empty_checkpoint()
            version = saver.get_next_version(ck["channel_versions"].get("items"), None)
            items = (parent.checkpoint["channel_values"].get("items", []) if parent else []) + ["n" * 200]
            ck = create_checkpoint({**ck, "channel_values": {"items": items},
                                    "channel_versions": {**ck["channel_versions"], "items": version}}, None, puts)
            conf = cfg(thread)
            conf["configurable"]["checkpoint_ns"] = ""
            if parent is not None:
                conf["configurable"]["checkpoint_id"] = parent.checkpoint["id"]
            stored = saver.put(conf, ck, {"source": "loop", "step": puts}, {"items": version})
            saver.put_writes(stored, [("items", "w")], f"task-{puts}")
            left[thread] = left.get(thread, 0) + 1
            puts += 1
        snapshots = len(saver.journal.snapshots())
    print(json.dumps({"puts": puts, "left": left, "snapshots": snapshots}), flush=True)


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    if kind == "graph":
        graph_worker(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), args[5])
    elif kind == "noise":
        noise_writer(args[0], args[1])
    else:
        raise SystemExit(f"unknown worker {kind!r}")
