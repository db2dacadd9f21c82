"""The `agent` suite: agent state (LangGraph saver on luopan's journal) and vector-index snapshots (FAISS).

J1.sqlite_bytes_over_luopan: a synthetic agent loop (1,000 steps on 20 threads; --quick 200 x 4), the message list
growing by one ~2 KiB message per step, saved with langgraph-checkpoint-sqlite's SqliteSaver and with LuopanSaver:
bytes on disk of SqliteSaver / luopan. Goal >= 10. (benchmarks/agent_journal.py)

J2.put_p99_vs_sqlite: p99 latency of `put` with durable writes, SqliteSaver in its default mode (WAL, synchronous
FULL) vs LuopanSaver(fsync="always"), puts alternated between the two: SqliteSaver p99 / luopan p99. Goal >= 1.0.

I1.full_over_written: a 1,000,000 x 128 float32 IVF-flat index (--quick 200,000), 1% more vectors added and
snapshotted again: bytes of faiss.write_index of the grown index / bytes the second snapshot added to the
repository. Goal >= 20. (benchmarks/agent_index.py)

I2.load_vs_faiss: faiss.read_index seconds / IndexStore.load() seconds for the same index (medians of alternating
repetitions, warm page cache; luopan verifies every chunk's BLAKE3 as it reads). Goal >= 0.8.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from agent_index import run_index
from agent_journal import run_journal
from common import fmt, loadavg, machine_info, print_footer, print_tables


def run_agent(quick: bool, reps: int, workdir: str | None, log: Any) -> dict[str, Any]:
    where = workdir or tempfile.gettempdir()
    os.makedirs(where, exist_ok=True)
    report: dict[str, Any] = {"suite": "agent", "quick": quick, "machine": machine_info(where), "results": [],
                              "problems": []}
    report["machine"]["loadavg_start"] = loadavg()
    report["results"] += run_journal(quick, workdir, log)
    report["results"] += run_index(quick, workdir, log, reps=reps)
    report["machine"]["loadavg_end"] = loadavg()
    return report


def _peer_luopan(r: dict[str, Any]) -> tuple[str, str, str]:
    rid = r["id"]
    if rid.startswith("J1"):
        return "SqliteSaver", f"{r['sqlite_bytes'] / 2**20:.1f} MiB", f"{r['luopan_bytes'] / 2**20:.2f} MiB"
    if rid.startswith("J2"):
        return "SqliteSaver p99", f"{fmt(r.get('sqlite_p99_ms'), '.2f')} ms", f"{fmt(r.get('luopan_p99_ms'), '.2f')} ms"
    if rid.startswith("I1"):
        return "faiss.write_index", f"{r['full_bytes'] / 2**20:.1f} MiB", f"{r['written_bytes'] / 2**20:.2f} MiB"
    return "faiss.read_index", f"{r['faiss_seconds']:.3f} s", f"{r['luopan_seconds']:.3f} s"


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer", "luopan", "value", "goal", "status"]
    rows, xrows = [], []
    for r in report["results"]:
        peer, p, lp = _peer_luopan(r)
        rows.append([r["id"], peer, p, lp, fmt(r["value"], ".3f"), f"{r['goal_op']} {r['goal']}",
                     "met" if r["met"] else "MISSED"])
        xrows.append([r["id"], r.get("notes", "")[:200]])
    print_tables("agent suite" + (" (quick)" if report["quick"] else ""), head, rows, ["notes", "text"], xrows)
    print_footer(report, "J1, I1: bytes of the peer / bytes of luopan; J2: peer p99 / luopan p99; I2: peer seconds / "
                         "luopan seconds (> 1: luopan better).")
