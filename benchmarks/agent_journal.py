"""LangGraph checkpointing: `luopan.langgraph.LuopanSaver` vs `langgraph-checkpoint-sqlite`'s `SqliteSaver`.

J1.sqlite_bytes_over_luopan: a synthetic agent loop (one ~2 KiB message appended to each thread's message list per
step, one `put` per step, the checkpoint built with LangGraph's `empty_checkpoint`/`create_checkpoint`, as the pregel
loop does) saved by both savers: bytes on disk of SqliteSaver / bytes of luopan's repository. Goal >= 10.

J2.put_p99_vs_sqlite: p99 latency of a durable `put` (SqliteSaver in its default mode: WAL, synchronous=FULL, one
commit per put; LuopanSaver(fsync="always"): one fdatasync per put), the two savers alternating put by put on the
same checkpoints: SqliteSaver p99 / luopan p99. Goal >= 1.0.

    .venv/bin/python benchmarks/agent_journal.py [--quick] [--json OUT] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import luopan  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dir_bytes  # noqa: E402

MSG_BYTES = 2048
WORDS = ["agent", "tool", "call", "search", "result", "the", "of", "and", "a", "to", "in", "is", "plan", "observe", "answer", "model", "token", "context", "memory", "retrieve", "document", "step", "reason", "final", "user", "assistant", "system", "function", "json", "value", "error", "retry"]


def _text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _message(thread: int, step: int, rng: random.Random) -> Any:
    body = f"[{thread}/{step}] " + _text(rng, MSG_BYTES)
    try:
        from langchain_core.messages import AIMessage, HumanMessage
    except ImportError:  # pragma: no cover  (langgraph depends on langchain-core)
        return {"role": "assistant" if step % 2 else "user", "content": body, "id": f"{thread}-{step}"}
    cls = AIMessage if step % 2 else HumanMessage
    return cls(content=body, id=f"{thread}-{step}")


def workload(threads: int, steps: int, seed: int = 0) -> Iterator[tuple[int, int, dict, dict, dict, dict]]:
    """(thread, step, config, checkpoint, metadata, new_versions) in round-robin order, as `threads` agents stepping
    together would put them; the config names the parent checkpoint."""
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint
    from langgraph.checkpoint.sqlite import SqliteSaver
    versions = SqliteSaver.get_next_version  # the same version strings for both savers
    rng = random.Random(seed)
    state = [{"messages": [], "ck": empty_checkpoint(), "parent": None} for _ in range(threads)]
    for step in range(steps):
        for t in range(threads):
            st = state[t]
            st["messages"] = st["messages"] + [_message(t, step, rng)]
            ck = st["ck"]
            ver = versions(None, ck["channel_versions"].get("messages"), None)
            ck["channel_versions"] = {**ck["channel_versions"], "messages": ver}
            ck["channel_values"] = {"messages": st["messages"]}
            new = {"messages": ver}
            if step == 0:
                ck["channel_versions"]["__start__"] = new["__start__"] = versions(None, None, None)
                ck["channel_values"]["__start__"] = {"messages": [st["messages"][0]]}
            ck = create_checkpoint(ck, None, step)
            st["ck"] = ck
            conf: dict = {"configurable": {"thread_id": f"thread-{t}", "checkpoint_ns": ""}}
            if st["parent"]:
                conf["configurable"]["checkpoint_id"] = st["parent"]
            st["parent"] = ck["id"]
            yield t, step, conf, ck, {"source": "loop", "step": step, "parents": {}, "run_id": f"run-{t}"}, new


def _sqlite_files(db: str) -> int:
    return sum(os.path.getsize(db + s) for s in ("", "-wal", "-shm", "-journal") if os.path.exists(db + s))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def run_j1(threads: int, steps: int, work: str, say: Callable[[str], Any]) -> dict[str, Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from luopan.langgraph import LuopanSaver
    db = os.path.join(work, "j1.sqlite")
    conn = sqlite3.connect(db, check_same_thread=False)
    sq = SqliteSaver(conn)
    sq.setup()
    conn.execute("PRAGMA synchronous=OFF")  # J1 counts bytes, not time: skip the fsyncs on both sides
    lp = LuopanSaver(os.path.join(work, "j1-luopan"), fsync="off")
    t_sq = t_lp = 0.0
    n = 0
    last = time.perf_counter()
    for t, step, conf, ck, meta, new in workload(threads, steps):
        t0 = time.perf_counter()
        sq.put(conf, ck, meta, new)
        t1 = time.perf_counter()
        lp.put(conf, ck, meta, new)
        t_lp += time.perf_counter() - t1
        t_sq += t1 - t0
        n += 1
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            say(f"J1: step {step}/{steps}, sqlite {_sqlite_files(db) / 2**20:.0f} MiB, "
                f"luopan {dir_bytes(lp.journal.directory) / 2**20:.1f} MiB")
    final = lp.get_tuple({"configurable": {"thread_id": "thread-0"}}).checkpoint["channel_values"]["messages"]
    same = final == sq.get_tuple({"configurable": {"thread_id": "thread-0"}}).checkpoint["channel_values"]["messages"]
    lp.close()
    conn.close()
    sq_bytes, lp_bytes = _sqlite_files(db), dir_bytes(os.path.join(work, "j1-luopan"))
    value = sq_bytes / lp_bytes
    payload = threads * steps * MSG_BYTES
    say(f"J1: sqlite {sq_bytes} bytes, luopan {lp_bytes} bytes: {value:.1f}x")
    return {"id": "J1.sqlite_bytes_over_luopan", "value": round(value, 2), "ratio": round(value, 2), "goal": 10,
            "goal_op": ">=", "met": value >= 10 and same, "unit": "bytes on disk, SqliteSaver / luopan",
            "sqlite_bytes": sq_bytes, "luopan_bytes": lp_bytes, "message_payload_bytes": payload,
            "luopan_bytes_over_payload": round(lp_bytes / payload, 3), "threads": threads, "steps": steps,
            "n": n, "sqlite_put_s": round(t_sq, 2), "luopan_put_s": round(t_lp, 2), "same_final_state": same,
            "notes": f"{threads} threads x {steps} steps, one ~{MSG_BYTES} B LangChain message appended per step, one "
                     "put per step (no put_writes); bytes after closing both (SQLite: db + WAL files, the WAL "
                     "checkpointed by close; luopan: the whole repository directory). Sync off on both sides "
                     "(bytes do not depend on it). SqliteSaver stores the whole list in every checkpoint; luopan "
                     "stores each message once plus per-step bookkeeping."}


def run_j2(threads: int, steps: int, work: str, say: Callable[[str], Any]) -> dict[str, Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from luopan.langgraph import LuopanSaver
    db = os.path.join(work, "j2.sqlite")
    conn = sqlite3.connect(db, check_same_thread=False)
    sq = SqliteSaver(conn)  # default mode, as its docs set it up
    sq.setup()
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0], conn.execute("PRAGMA synchronous").fetchone()[0]
    lp = LuopanSaver(os.path.join(work, "j2-luopan"), fsync="always")
    lat: dict[str, list[float]] = {"sqlite": [], "luopan": []}
    sides = [("sqlite", sq), ("luopan", lp)]
    warm = min(20, steps // 4) * threads
    gc.collect()
    gc.disable()  # collected between puts every 200 steps instead, untimed
    try:
        for i, (_t, _step, conf, ck, meta, new) in enumerate(workload(threads, steps, seed=1)):
            if i % 200 == 199:
                gc.collect()
            order = sides if i % 2 == 0 else sides[::-1]  # alternate who goes first
            for name, saver in order:
                t0 = time.perf_counter()
                saver.put(conf, ck, meta, new)
                dt = time.perf_counter() - t0
                if i >= warm:
                    lat[name].append(dt)
    finally:
        gc.enable()
    lp.close()
    conn.close()
    p = {k: {"p50_ms": round(_pct(v, 50) * 1e3, 3), "p99_ms": round(_pct(v, 99) * 1e3, 3),
             "max_ms": round(max(v) * 1e3, 3)} for k, v in lat.items()}
    value = p["sqlite"]["p99_ms"] / p["luopan"]["p99_ms"]
    say(f"J2: sqlite p50 {p['sqlite']['p50_ms']} ms p99 {p['sqlite']['p99_ms']} ms; luopan p50 "
        f"{p['luopan']['p50_ms']} ms p99 {p['luopan']['p99_ms']} ms: {value:.2f}x")
    return {"id": "J2.put_p99_vs_sqlite", "value": round(value, 3), "ratio": round(value, 3), "goal": 1.0,
            "goal_op": ">=", "met": value >= 1.0, "unit": "p99 put latency, SqliteSaver / luopan",
            "sqlite_p50_ms": p["sqlite"]["p50_ms"], "sqlite_p99_ms": p["sqlite"]["p99_ms"],
            "sqlite_max_ms": p["sqlite"]["max_ms"], "luopan_p50_ms": p["luopan"]["p50_ms"],
            "luopan_p99_ms": p["luopan"]["p99_ms"], "luopan_max_ms": p["luopan"]["max_ms"],
            "n": len(lat["luopan"]), "threads": threads, "steps": steps, "sqlite_mode": list(mode),
            "notes": f"{threads} threads x {steps} steps of the J1 loop (the list reaches {steps} messages), "
                     f"the first {warm} puts of each untimed; every put timed alone, the cyclic GC paused (collected "
                     f"untimed every 200 puts), the two "
                     f"savers alternating put by put (who goes first flips each time). SqliteSaver(sqlite3.connect("
                     f"path, check_same_thread=False)) with its own setup: journal_mode={mode[0]}, synchronous="
                     f"{mode[1]} (2 = FULL: the WAL is synced at each commit); LuopanSaver(fsync='always'): one "
                     "fdatasync per put. Both serialize the whole message list at each put (luopan message by "
                     "message, to find the new ones)."}


def run_journal(quick: bool, workdir: str | None = None, log: Any = None) -> list[dict[str, Any]]:
    """J1 and J2 (quick: 4 threads x 200 steps and 10 x 250; full: 20 x 1000 and 20 x 250)."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    j1 = (4, 200) if quick else (20, 1000)
    j2 = (10, 250) if quick else (20, 250)
    work = tempfile.mkdtemp(prefix="luopan-j-", dir=workdir)
    try:
        need = j1[0] * MSG_BYTES * j1[1] * (j1[1] + 1) // 2 * 1.3
        free = shutil.disk_usage(work).free
        if free < need:
            raise RuntimeError(f"J1 needs about {need / 2**30:.1f} GiB free in {work} for SqliteSaver "
                               f"(it has {free / 2**30:.1f}); use --workdir or --quick")
        say(f"J1: {j1[0]} threads x {j1[1]} steps (SqliteSaver needs ~{need / 1.3 / 2**30:.1f} GiB)")
        r1 = run_j1(*j1, work, say)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        say(f"J2: {j2[0]} threads x {j2[1]} steps")
        r2 = run_j2(*j2, work, say)
        return [r1, r2]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="J1 on 4 threads x 200 steps, J2 on 10 x 250")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    ap.add_argument("--workdir", metavar="DIR", help="parent of the temporary directory")
    args = ap.parse_args(argv)
    results = run_journal(args.quick, args.workdir)
    for r in results:
        print(f"{r['id']}: {r['value']} (goal {r['goal_op']} {r['goal']}: {'met' if r['met'] else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
