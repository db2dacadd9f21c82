"""LangGraph with two worker processes on one store (issue 31), for the ``stacks`` suite.

E2.sqlite_bytes_over_luopan_two_workers: two worker processes, each running a tiny graph loop (one node appending a
~300-byte message to a growing message list per step, ``steps`` steps per thread, several threads per worker,
``durability="sync"``) against ONE ``LuopanSaver`` repository at the same time, then the same against ONE
``SqliteSaver`` file (langgraph-checkpoint-sqlite, its default mode: WAL). Value: bytes on disk of the SQLite file(s)
/ bytes of luopan's repository. Goal >= 10. Raw figures: bytes, checkpoints, seconds per step (a put and a
put_writes) of each.

Also measured (not a goal): how many steps a ``kill -9`` loses under each LangGraph durability mode, with a worker
looping in one ``invoke`` killed once it has run ``kill_after`` steps: the steps it had run minus the newest
checkpoint's step that a new saver finds.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
from typing import Any

from common import ROOT, dir_bytes

WORKER = r"""
import json, os, sqlite3, sys, time
from typing import Annotated, TypedDict
from langchain_core.messages import AIMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

kind, path, me, threads, steps, durability = sys.argv[1:7]
threads, steps = int(threads), int(steps)
hold_at = int(sys.argv[7]) if len(sys.argv) > 7 else 0  # "exit" kill runs: wait there for the kill (see below)

class State(TypedDict):
    messages: Annotated[list, add_messages]
    n: int

def agent(state):
    n = state["n"] + 1
    if durability != "none":
        print(n, flush=True) if kind == "kill" else None
    if n == hold_at:  # durability="exit" writes nothing until invoke returns, so waiting here changes nothing it
        time.sleep(3600)  # saves; without it a fast loop may finish before a loaded parent reads this step's line
    return {"messages": [AIMessage(content=f"{me} step {n}: " + "m" * 300)], "n": n}

g = StateGraph(State)
g.add_node("agent", agent)
g.add_edge(START, "agent")
g.add_conditional_edges("agent", lambda s: END if s["n"] >= steps else "agent")
if kind == "sqlite":
    from langgraph.checkpoint.sqlite import SqliteSaver
    saver = SqliteSaver(sqlite3.connect(path, check_same_thread=False, timeout=300))
else:
    from luopan.langgraph import LuopanSaver
    saver = LuopanSaver(path)
app = g.compile(checkpointer=saver)
t0 = time.perf_counter()
for t in range(threads):
    app.invoke({"messages": [], "n": 0}, {"configurable": {"thread_id": f"{me}-t{t}"}, "recursion_limit": steps + 10},
               durability=durability)
print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _two_workers(kind: str, path: str, threads: int, steps: int) -> float:
    """Run the two workers at once; the seconds the slower one took."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, kind, path, f"w{w}", str(threads), str(steps), "sync"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
             for w in range(2)]
    took = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{kind} worker failed: {err[-3000:]}")
        took.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    return max(took)


def _sqlite_bytes(db: str) -> int:
    return sum(os.path.getsize(db + s) for s in ("", "-wal", "-shm", "-journal") if os.path.exists(db + s))


def _count_luopan(repo: str) -> int:
    from luopan.langgraph import LuopanSaver

    with LuopanSaver(repo) as saver:
        return sum(1 for _ in saver.list(None))


def _count_sqlite(db: str) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("select count(*) from checkpoints").fetchone()[0]


def steps_lost_to_kill(work: str, durability: str, steps: int, kill_after: int) -> dict[str, Any]:
    """A worker loops ``steps`` steps in one invoke; SIGKILL once it has run ``kill_after``; how many of the steps
    it had run are not in the saver afterwards."""
    from luopan.langgraph import LuopanSaver

    repo = os.path.join(work, f"kill-{durability}")
    hold = kill_after if durability == "exit" else 0  # "sync"/"async": killed while running, wherever it is
    p = subprocess.Popen([sys.executable, "-c", WORKER, "kill", repo, "k", "1", str(steps), durability, str(hold)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
    ran = 0
    assert p.stdout is not None
    for line in p.stdout:
        if line.strip().isdigit():
            ran = int(line)
            if ran >= kill_after:
                os.kill(p.pid, signal.SIGKILL)
                break
    p.wait()
    ran = max([ran] + [int(x) for x in p.stdout.read().split() if x.isdigit()])  # printed before it died
    with LuopanSaver(repo) as saver:
        tup = saver.get_tuple({"configurable": {"thread_id": "k-t0"}})
        saved = tup.checkpoint["channel_values"].get("n", 0) if tup is not None else 0
    return {"durability": durability, "steps_run": ran, "steps_saved": saved, "steps_lost": ran - saved}


def run(quick: bool, workdir: str | None, log: Any) -> list[dict[str, Any]]:
    threads, steps = (2, 160) if quick else (3, 300)  # quick: the ratio grows with the steps (10.5 at 100)
    work = tempfile.mkdtemp(prefix="stacks-langgraph-", dir=workdir)
    repo, db = os.path.join(work, "luopan-repo"), os.path.join(work, "checkpoints.sqlite")
    log(f"E2: 2 workers x {threads} threads x {steps} steps, LuopanSaver then SqliteSaver")
    lp_s = _two_workers("luopan", repo, threads, steps)
    sq_s = _two_workers("sqlite", db, threads, steps)
    lp_bytes, sq_bytes = dir_bytes(repo), _sqlite_bytes(db)
    lp_n, sq_n = _count_luopan(repo), _count_sqlite(db)
    value = sq_bytes / lp_bytes
    kills = [steps_lost_to_kill(work, d, 300 if quick else 2000, 150 if quick else 1000)
             for d in ("async", "sync", "exit")]
    for k in kills:
        log(f"kill -9 under durability={k['durability']!r}: {k['steps_lost']} of {k['steps_run']} steps lost")
    return [{
        "id": "E2.sqlite_bytes_over_luopan_two_workers", "value": value, "ratio": value, "goal": 10.0,
        "goal_op": ">=", "met": value >= 10 and lp_n == sq_n, "unit": "x",
        "notes": (f"2 worker processes at once, each {threads} threads x {steps} steps of a growing message list "
                  f"(durability='sync'), on one store: SqliteSaver {sq_bytes / 2**20:.2f} MiB vs luopan "
                  f"{lp_bytes / 2**20:.3f} MiB ({sq_n} and {lp_n} checkpoints); seconds per step "
                  f"(put + put_writes) luopan {lp_s / (threads * steps):.4f}, SqliteSaver "
                  f"{sq_s / (threads * steps):.4f}. kill -9 loses: "
                  + ", ".join(f"{k['durability']} {k['steps_lost']}/{k['steps_run']}" for k in kills)),
        "luopan_bytes": lp_bytes, "sqlite_bytes": sq_bytes, "luopan_checkpoints": lp_n, "sqlite_checkpoints": sq_n,
        "luopan_seconds_per_step": lp_s / (threads * steps), "sqlite_seconds_per_step": sq_s / (threads * steps),
        "steps_lost_to_kill": {k["durability"]: k for k in kills},
    }]


if __name__ == "__main__":
    for r in run("--quick" in sys.argv, None, print):
        print(json.dumps(r, indent=1))
