"""The `stacks` suite: luopan against each stack's own storage, on the same tiny runs as the tests.

E1.lightning_bytes_over_default: a tiny Lightning ``Trainer.fit`` with ``ModelCheckpoint(save_top_k, save_last)``,
once with Lightning's own ``.ckpt`` files and once through ``LuopanCheckpointIO``: bytes on disk of luopan / bytes
of Lightning's default at the end of the run. Goal <= 1.0 (lower is better). (benchmarks/stacks_lightning.py)

E2.sqlite_bytes_over_luopan_two_workers: two worker processes run a tiny LangGraph loop at the same time against
one repository's ``LuopanSaver`` and against one ``SqliteSaver`` file: bytes on disk of SqliteSaver / luopan.
Goal >= 10. (benchmarks/stacks_langgraph.py)

E3.write_index_over_luopan_with_deletes: a FAISS index changed by 1% deletions per version: bytes
``faiss.write_index`` writes per version / bytes luopan's snapshot adds per version. Goal >= 5.
(benchmarks/stacks_faiss.py)

Each result also carries the time per save (E2: per step, a put and its put_writes; E3: per version) of luopan and of
the peer, measured in the same run. E1 and E2 bytes are on disk at the end; E3 bytes are per version.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import traceback
from typing import Any

from common import fmt, loadavg, machine_info, print_footer, print_tables

# (module, the ids it reports): each area is its own module, so one failing stack does not hide the others
AREAS = [
    ("stacks_lightning", ["E1.lightning_bytes_over_default"]),
    ("stacks_langgraph", ["E2.sqlite_bytes_over_luopan_two_workers"]),
    ("stacks_faiss", ["E3.write_index_over_luopan_with_deletes"]),
]
IDS = [rid for _, ids in AREAS for rid in ids]


def run_stacks(quick: bool, workdir: str | None, log: Any, only: list[str] | None = None) -> dict[str, Any]:
    """Every area's results (``only``: module names to run); an area that fails reports its ids with the error."""
    where = tempfile.mkdtemp(prefix="luopan-stacks-", dir=workdir)
    report: dict[str, Any] = {"suite": "stacks", "quick": quick, "machine": machine_info(where), "results": [],
                              "problems": []}
    report["machine"]["loadavg_start"] = loadavg()
    os.environ.setdefault("LUOPAN_PROGRESS", "0")
    for name, ids in AREAS:
        if only is not None and name not in only:
            continue
        log(f"stacks: {name}")
        area_dir = os.path.join(where, name)
        os.makedirs(area_dir, exist_ok=True)
        try:
            results = importlib.import_module(name).run(quick, area_dir, log)
        except Exception as exc:  # noqa: BLE001 - reported as a failed area, the others still run
            report["problems"].append(f"{name}: {type(exc).__name__}: {exc}")
            log(traceback.format_exc())
            results = [{"id": rid, "value": None, "ratio": None, "goal": None, "goal_op": None, "met": None,
                        "error": f"{type(exc).__name__}: {exc}"} for rid in ids]
        missing = [rid for rid in ids if rid not in {r["id"] for r in results}]
        if missing:
            report["problems"].append(f"{name} did not report {', '.join(missing)}")
        report["results"] += [_common_fields(r) for r in results]
    report["machine"]["loadavg_end"] = loadavg()
    import shutil

    shutil.rmtree(where, ignore_errors=True)
    return report


def _mean(x: Any) -> float | None:
    return sum(x) / len(x) if isinstance(x, list) and x else None


def _common_fields(r: dict[str, Any]) -> dict[str, Any]:
    """Each stack's own figures, also under the names the table reads: ``peer``, ``peer_bytes`` and
    ``luopan_bytes`` (bytes on disk, or per version for E3), ``peer_s_per_save`` and ``luopan_s_per_save``."""
    rid = r["id"].split(".")[0]
    if rid == "E1":
        extra = {"peer": "Lightning .ckpt files", "peer_bytes": r.get("default_bytes"),
                 "peer_s_per_save": r.get("default_seconds_per_save"),
                 "luopan_s_per_save": r.get("luopan_seconds_per_save")}
    elif rid == "E2":
        extra = {"peer": "SqliteSaver", "peer_bytes": r.get("sqlite_bytes"),
                 "peer_s_per_save": r.get("sqlite_seconds_per_step"),
                 "luopan_s_per_save": r.get("luopan_seconds_per_step")}
    elif rid == "E3":
        peer, ours = _mean(r.get("faiss_bytes_per_version")), _mean(r.get("luopan_bytes_per_version"))
        extra = {"peer": "faiss.write_index", "peer_bytes": None if peer is None else round(peer),
                 "luopan_bytes": None if ours is None else round(ours),
                 "peer_s_per_save": r.get("faiss_seconds_median"), "luopan_s_per_save": r.get("luopan_seconds_median")}
    else:
        extra = {}
    return {**{k: v for k, v in extra.items() if v is not None}, **r}


def _per_save(r: dict[str, Any], who: str) -> str:
    s = r.get(f"{who}_s_per_save")
    return "-" if s is None else f"{s * 1000:.1f} ms"


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer bytes", "luopan bytes", "value", "goal", "status"]
    rows, xrows = [], []
    for r in report["results"]:
        status = "FAILED" if "error" in r else ("met" if r["met"] else "MISSED")
        rows.append([r["id"], str(r.get("peer", "-")), fmt(r.get("peer_bytes"), ",d") if r.get("peer_bytes")
                     is not None else "-", fmt(r.get("luopan_bytes"), ",d") if r.get("luopan_bytes") is not None
                     else "-", fmt(r.get("value"), ".3f"), f"{r.get('goal_op')} {r.get('goal')}", status])
        xrows.append([r["id"], f"per save: peer {_per_save(r, 'peer')}, luopan {_per_save(r, 'luopan')}; "
                      + str(r.get("error") or r.get("notes", ""))[:200]])
    print_tables("stacks suite" + (" (quick)" if report["quick"] else ""), head, rows, ["notes", "text"], xrows)
    print_footer(report, "E1: luopan bytes / Lightning default bytes (lower is better); E2, E3: peer bytes / luopan "
                         "bytes (higher is better).")
