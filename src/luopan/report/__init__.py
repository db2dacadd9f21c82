"""``luopan report``: one self-contained HTML page about a repository (inline CSS and SVG, nothing fetched when it is
opened), or the same page served on 127.0.0.1 while runs save.

    from luopan.report import write_report
    write_report(luopan.open("ckpts", create=False), "report.html")          # every run, artifact, journal, index
    write_report(repo, "a.html", ["run-a", "datasets/clean"])               # some runs and artifacts

Per run: metric curves against step with every checkpoint marked (pinned, best, latest highlighted; pruned ones,
known from eval logs, shown as gone), bytes per save (new chunks, row/XOR deltas, reused, written), save and stall
times, restore times where recorded, and where each checkpoint lives (tiers). Repository-wide: cumulative size vs
full saves, deduplication across runs, artifacts with their lineage graph, journals and index snapshots. The
repository is only read (luopan.report.gather), through its public API.
"""

from __future__ import annotations

from .gather import ReportData, gather
from .page import build_report, render, write_report
from .serve import ReportServer

__all__ = ["ReportData", "ReportServer", "build_report", "gather", "render", "write_report"]
