"""The report page: one self-contained HTML file (inline CSS and SVG; a few lines of inline script only when
served, to reload when the repository changes). Nothing is fetched from the network when it is opened."""

from __future__ import annotations

import hashlib
import os
import tempfile
from datetime import datetime, timezone
from html import escape
from typing import Any

from .. import __version__
from ..errors import UsageError
from .gather import ReportData, gather
from .html import slug
from .repository import artifacts_section, overview, snapshots_section, storage_section
from .compare import config_section, overlay_section
from .runs import run_section
from .storage import analyse

CSS = """
:root{color-scheme:light dark;--bg:#ffffff;--fg:#1c2230;--muted:#5d6678;--line:#d9dde5;--grid:#eceef2;
--card:#f6f7f9;--accent:#2563eb;--metric:#2563eb;--pinned:#d97706;--best:#16a34a;--latest:#7c3aed;
--pruned:#9aa3b2;--eval:#0891b2;--reused:#c7d2e4;--new:#2563eb;--delta:#f59e0b;--written:#dc2626;
--save:#0ea5e9;--stall:#e11d48;--shared:#14b8a6;--local:#64748b;--replicating:#f59e0b;--replicated:#22c55e;
--remote:#3b82f6;--cold:#06b6d4;--warn:#b45309;
--run0:#2563eb;--run1:#dc2626;--run2:#16a34a;--run3:#d97706;--run4:#7c3aed;--run5:#0891b2;--run6:#db2777;
--run7:#4b5563;--differs:#fef3c7}
@media (prefers-color-scheme: dark){:root{--run0:#60a5fa;--run1:#f87171;--run2:#4ade80;--run3:#fbbf24;
--run4:#c4b5fd;--run5:#22d3ee;--run6:#f472b6;--run7:#9ca3af;--differs:#3f3413}}
.r0{--rc:var(--run0)}.r1{--rc:var(--run1)}.r2{--rc:var(--run2)}.r3{--rc:var(--run3)}.r4{--rc:var(--run4)}
.r5{--rc:var(--run5)}.r6{--rc:var(--run6)}.r7{--rc:var(--run7)}
.line.r0,.line.r1,.line.r2,.line.r3,.line.r4,.line.r5,.line.r6,.line.r7{stroke:var(--rc);stroke-width:1.4}
.pt.r0,.pt.r1,.pt.r2,.pt.r3,.pt.r4,.pt.r5,.pt.r6,.pt.r7{fill:var(--rc);stroke-width:0.6}
.pt.ckpt{stroke:var(--fg);stroke-width:1.2}
.tick.r0 rect,.tick.r1 rect,.tick.r2 rect,.tick.r3 rect,.tick.r4 rect,.tick.r5 rect,.tick.r6 rect,.tick.r7 rect{
fill:var(--rc)}
.sw.r0,.sw.r1,.sw.r2,.sw.r3,.sw.r4,.sw.r5,.sw.r6,.sw.r7{background:var(--rc)}
th.r0,th.r1,th.r2,th.r3,th.r4,th.r5,th.r6,th.r7{border-bottom:3px solid var(--rc)}
table.config tr.differs>*{background:var(--differs)}table.config tbody th{font-weight:500;font-family:monospace}
details.same{margin:6px 0;font-size:12px}details.same summary{cursor:pointer;color:var(--muted)}
table.evals td.best{color:var(--best);font-weight:700}table.evals td.from-eval{font-style:italic}
@media (prefers-color-scheme: dark){:root{--bg:#101318;--fg:#e4e7ee;--muted:#9aa3b5;--line:#343b49;
--grid:#232936;--card:#181c24;--accent:#60a5fa;--metric:#60a5fa;--pinned:#fbbf24;--best:#4ade80;
--latest:#c4b5fd;--pruned:#6b7280;--eval:#22d3ee;--reused:#3a4558;--new:#60a5fa;--delta:#fbbf24;
--written:#f87171;--save:#38bdf8;--stall:#fb7185;--shared:#2dd4bf;--local:#94a3b8;--remote:#60a5fa;
--warn:#fbbf24}}
*{box-sizing:border-box}
html,body{margin:0;padding:0;background:var(--bg);color:var(--fg)}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
main{max-width:1200px;margin:0 auto;padding:12px 24px 40px}
header{margin-bottom:4px}
h1{font-size:22px;margin:10px 0 2px}h2{font-size:18px;margin:28px 0 6px;padding-top:8px;border-top:1px solid var(--line)}
h3{font-size:15px;margin:16px 0 4px}
nav{font-size:13px;margin:6px 0 10px}nav a{color:var(--accent);margin-right:12px;text-decoration:none}
.muted,.note{color:var(--muted)}.note{font-size:12px;margin:2px 0}.warn{color:var(--warn)}
figure{margin:14px 0;padding:8px 12px;background:var(--card);border:1px solid var(--line);border-radius:8px}
figcaption{font-weight:600;margin-bottom:4px}
.pair{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:0 14px}
@media (max-width:900px){.pair{grid-template-columns:minmax(0,1fr)}}
.pair figure{min-width:0}
svg.chart{display:block;width:100%;height:auto;max-width:100%;overflow:visible}
svg text{fill:var(--muted);font-size:11px}svg .label{font-size:12px}
.grid line{stroke:var(--grid);stroke-width:1}.axis line{stroke:var(--line);stroke-width:1}
.line{fill:none;stroke-width:1.8}.s-metric.line{stroke:var(--metric)}.s-written.line{stroke:var(--new)}
.s-full.line{stroke:var(--written);stroke-dasharray:5 4}
.pt{stroke:var(--bg);stroke-width:1.2}.pt.s-metric{fill:var(--metric)}.pt.s-written{fill:var(--new)}
.pt.s-full{fill:var(--written)}.pt.eval{fill:var(--eval)}
.pt.latest{fill:var(--latest)}.pt.best{fill:var(--best)}.pt.pinned{stroke:var(--pinned);stroke-width:3}
.pt.pruned{fill:none;stroke:var(--pruned);stroke-width:1.6;stroke-dasharray:2 2}
.tick rect{fill:var(--muted)}.tick.pinned rect{fill:var(--pinned)}.tick.latest rect{fill:var(--latest)}
.tick.best rect{fill:var(--best)}.tick.tick-pruned rect{fill:none;stroke:var(--pruned);stroke-dasharray:2 1}
.bar{stroke:none}.p-reused{fill:var(--reused)}.p-new{fill:var(--new)}.p-delta{fill:var(--delta)}
.p-written{fill:var(--written)}.p-save{fill:var(--save)}.p-stall{fill:var(--stall)}.p-shared{fill:var(--shared)}
.p-restore{fill:var(--best)}.p-diverged{fill:var(--written)}
.cell{stroke:var(--bg)}.t-local{fill:var(--local)}.t-replicating{fill:var(--replicating)}
.t-replicated{fill:var(--replicated)}.t-remote{fill:var(--remote)}.t-cold{fill:var(--cold)}
.t-pruned{fill:none;stroke:var(--pruned);stroke-dasharray:3 2}
.edge{fill:none;stroke:var(--muted);stroke-width:1.4}
.node rect{fill:var(--card);stroke:var(--accent);stroke-width:1.4}.node.n-run rect{stroke:var(--latest)}
.node.n-missing rect{stroke:var(--pruned);stroke-dasharray:3 2}.node text{fill:var(--fg);font-size:11px}
.legend{list-style:none;padding:0;margin:2px 0 4px;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;vertical-align:-1px;
background:var(--muted)}
.sw.sw-ckpt,.sw.s-written{background:var(--metric)}.sw.sw-pinned{background:var(--pinned)}
.sw.sw-best{background:var(--best)}.sw.sw-latest{background:var(--latest)}.sw.sw-eval{background:var(--eval)}
.sw.sw-pruned,.sw.t-pruned{background:none;border:1.5px dashed var(--pruned)}.sw.p-reused{background:var(--reused)}
.sw.p-new{background:var(--new)}.sw.p-delta{background:var(--delta)}.sw.p-written,.sw.s-full{background:var(--written)}
.sw.p-save{background:var(--save)}.sw.p-stall{background:var(--stall)}.sw.t-local{background:var(--local)}
.sw.t-replicating{background:var(--replicating)}.sw.t-replicated{background:var(--replicated)}
.sw.t-remote{background:var(--remote)}.sw.t-cold{background:var(--cold)}
details.alt{margin-top:4px;font-size:12px}details.alt summary{cursor:pointer;color:var(--muted)}
.tablewrap{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:12px;margin:4px 0;min-width:40%}
caption{text-align:left;color:var(--muted);padding:2px 0}
th,td{border-bottom:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top;
overflow-wrap:anywhere}
th{background:var(--card);font-weight:600}
footer{margin-top:30px;color:var(--muted);font-size:12px}
"""

# Served pages only: poll /state and reload when the repository changed (a save landed, a pin moved).
POLL_JS = """(function(){var t=document.body.getAttribute('data-token');function poll(){fetch('state',{cache:
'no-store'}).then(function(r){return r.ok?r.json():null}).then(function(d){if(d&&d.token&&d.token!==t){
location.reload()}}).catch(function(){})}setInterval(poll,%d)})();"""


def render(data: ReportData, *, served: bool = False, token: str = "", poll_ms: int = 3000) -> str:
    """The page for what ``gather`` read."""
    storage = analyse(data)
    runs = [run_section(r, storage, data.tiered) for r in data.runs]
    parts = [overview(data, storage), overlay_section(data.runs), config_section(data.runs), storage_section(storage),
             *runs, artifacts_section(data),
             snapshots_section("Journals", data.journals, "newest", "journals"),
             snapshots_section("Vector indexes", data.indexes, "live", "indexes")]
    links = [(f"#{a}", t) for a, t, part in (("compare", "metrics across runs", parts[1]),
                                              ("config", "config", parts[2])) if part]
    links += [("#run-" + escape(slug(r.name), quote=True), f"run {r.name}") for r in data.runs]
    if data.artifacts:
        links.append(("#artifacts", "artifacts"))
    nav = "<nav>" + "".join(f'<a href="{a}">{escape(t)}</a>' for a, t in links[:40]) + "</nav>"
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    script = f"<script>{POLL_JS % poll_ms}</script>" if served else ""
    body = "".join(p for p in parts if p)
    refresh = " · refreshes while runs are saving" if served else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta name=\"color-scheme\" content=\"light dark\">"
            "<link rel=\"icon\" href=\"data:,\">"
            f"<title>luopan report — {escape(data.where)}</title><style>{CSS}</style></head>"
            f"<body data-token=\"{escape(token, quote=True)}\"><main><header><h1>luopan report</h1>"
            f"<p class=\"muted\">{escape(data.where)} · generated {when} by luopan {__version__}{refresh}</p>"
            f"{nav}</header>{body}<footer>Generated by <code>luopan report</code>; hover a point or bar for the "
            "checkpoint it stands for. Each chart's table holds the same numbers as text.</footer></main>"
            f"{script}</body></html>\n")


def state_token(repo: Any) -> str:
    """Changes when a manifest of any kind, a pin, a ref or an eval log appears or goes: the served page reloads."""
    hsh = hashlib.blake2b(digest_size=12)
    for kind in repo.kinds:
        for series, number in kind.scan(repo.store, None, False).pairs():
            hsh.update(f"{kind.name}\0{series}\0{number}\n".encode())
    for key in sorted(repo.store.list("refs/")):
        hsh.update(key.encode() + b"\n")
        if key.endswith("/latest.json"):
            try:
                hsh.update(repo.store.get_limited(key, 1 << 16))
            except Exception:  # noqa: BLE001  (a ref being replaced: the next poll sees it)
                pass
    return hsh.hexdigest()


def build_report(repo: Any, targets: list[str] | None = None, *, served: bool = False) -> tuple[str, ReportData]:
    """The report page of an open repository (all of it, or the runs and artifacts named) and what it shows."""
    data = gather(repo, targets)
    return render(data, served=served, token=state_token(repo) if served else ""), data


def summary(data: ReportData, page: str) -> dict[str, Any]:
    return {"runs": len(data.runs), "checkpoints": sum(len(r.checkpoints) for r in data.runs),
            "pruned": sum(len(r.pruned) for r in data.runs), "damaged": sum(len(r.damaged) for r in data.runs),
            "artifacts": len(data.artifacts), "artifact_versions": sum(len(v) for v in data.artifacts.values()),
            "journals": len(set(data.journals) | {h["name"] for h in data.holdings if h["kind"] == "journal"}),
            "indexes": len(set(data.indexes) | {h["name"] for h in data.holdings if h["kind"] == "index"}),
            "charts": page.count('<svg class="chart'), "bytes": len(page.encode())}


def write_report(repo: Any, path: str | os.PathLike[str], targets: list[str] | None = None) -> dict[str, Any]:
    """Write the report of ``repo`` to ``path`` (atomically: a temporary file renamed into place); returns a summary
    (path, counts). The repository is only read."""
    path = os.path.realpath(os.path.abspath(os.fspath(path)))  # through a symlink: its target is replaced
    if os.path.exists(path) and not os.path.isfile(path):  # a directory, a device (/dev/null), a FIFO: not replaced
        raise UsageError(f"{path} exists and is not a regular file: give a file name for the report (report.html)")
    page, data = build_report(repo, targets)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".luopan-report-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.chmod(tmp, 0o644)  # a page to share, not a secret (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return {"path": path, **summary(data, page)}
