"""The repository-wide part of the report: overview, cumulative size against full saves, deduplication across
runs, artifacts with their lineage graph, journals and index snapshots."""

from __future__ import annotations

from html import escape

from .html import figure, legend, para, section, size, table
from .gather import ReportData
from .storage import Storage, cumulative
from .svg import WIDTH, Group, Part, Point, Series, attr, bar_chart, line_chart, title

KIND_NOUN = {"run": "run", "artifact": "artifact", "journal": "journal", "index": "index"}


def overview(data: ReportData, storage: Storage) -> str:
    cps = sum(len(r.checkpoints) for r in data.runs)
    bits = [f"{len(data.runs)} run(s), {cps} checkpoint(s)"]
    if data.artifacts:
        bits.append(f"{len(data.artifacts)} artifact(s), {sum(len(v) for v in data.artifacts.values())} version(s)")
    held = {(h["kind"], h["name"]): h for h in data.holdings}
    journals = sorted(set(data.journals) | {n for k, n in held if k == "journal"})
    indexes = sorted(set(data.indexes) | {n for k, n in held if k == "index"})
    if journals:
        graphs = [held[("journal", n)] for n in journals if "threads" in held.get(("journal", n), {}).get("contents", {})]
        threads = sum(h["contents"]["threads"] for h in graphs)
        agents = sum(h["contents"].get("checkpoints", 0) for h in graphs)
        bits.append(f"{len(journals)} journal(s)" + (f" ({len(graphs)} LangGraph: {threads} thread(s), {agents} "
                                                     "checkpoint(s))" if graphs else ""))
    if indexes:
        bits.append(f"{len(indexes)} vector index(es)")
    out = para(", ".join(bits) + "." if data.runs or data.artifacts or journals or indexes or data.selected
               else "Nothing stored yet: no runs, artifacts, journals or indexes.")
    logical = sum(s.logical for s in storage.saves)
    written = sum(s.stored for s in storage.saves)
    if storage.saves:
        ratio = (f"{logical / written:.1f}× smaller than full saves" if written else
                 "every byte reused from earlier saves" if logical else "nothing to store")
        out += para(f"Saves shown: {size(logical)} logical, {size(written)} written ({ratio}).")
    if data.du:
        d = data.du
        out += para(f"On storage now: {size(d['physical_bytes'])} (packs {size(d['pack_bytes'])}, index "
                      f"{size(d['index_bytes'])}, manifests {size(d['manifest_bytes'])}"
                      + (f", journal and index logs {size(d['log_bytes'])}" if d.get("log_bytes") else "")
                      + f", refs {size(d['ref_bytes'])}).")
    out += holdings_table(data)
    if data.selected:
        out += para("This report covers the runs and artifacts named on the command line only.", "muted")
    return section("Repository", out, cls="overview")


def holdings_table(data: ReportData) -> str:
    """Every series of every kind in its own words, with its sizes (luopan.listing)."""
    if not data.holdings:
        return ""
    rows = [(h["type"], h["name"], h["holds"], "" if h["latest"] is None else h["latest"], size(h["logical_bytes"]),
             size(h["stored_bytes"]), size(h["exclusive_bytes"]), size(h["log_bytes"]) if h["log_bytes"] else "")
            for h in data.holdings]
    return table(("kind", "name", "holds", "latest", "logical", "stored", "only this", "log"), rows,
                 caption="what the repository holds", cls="holdings", collapsed=False)


def cumulative_chart(storage: Storage) -> str:
    points = cumulative(storage.saves)
    if not points:
        return ""
    written, full, rows = [], [], []
    for i, (s, w, f) in enumerate(points):
        a = {"data-ref": s.ref, "data-kind": s.kind, "data-index": i}
        written.append(Point(i + 1, w, f"{s.label} · repository {size(w)} written so far", "", a, r=3))
        full.append(Point(i + 1, f, f"{s.label} · {size(f)} if every save had been full", "", a, r=3))
        rows.append((i + 1, s.label, s.created[:19].replace("T", " "), size(s.stored), size(w), size(f)))
    svg = line_chart({"data-chart": "cumulative"}, [Series("written", "s-written", written),
                                                     Series("full", "s-full", full)],
                     x_label="saves, oldest first", y_label="bytes", y_fmt=size, binary=True, zero=True,
                     aria="cumulative bytes written against full saves")
    alt = table(("#", "save", "created", "written by it", "written so far", "full saves so far"), rows,
                  caption="cumulative repository size")
    lg = legend((("s-written", "bytes written (incremental, deduplicated)"), ("s-full", "full saves")))
    return figure("Cumulative size: written vs what full saves would have cost", svg, alt, legend_html=lg)


def dedup_chart(storage: Storage) -> str:
    if not storage.shared:
        return ""
    groups, rows = [], []
    for kind, series, from_kind, from_series, n in storage.shared:
        label = f"{series} ← {from_series}"
        text = f"{KIND_NOUN[kind]} {series} reuses {size(n)} first stored by {KIND_NOUN[from_kind]} {from_series}"
        groups.append(Group(label, [[Part("shared", n, "p-shared", text)]],
                            {"data-series": series, "data-from": from_series}))
        rows.append((f"{kind} {series}", f"{from_kind} {from_series}", size(n)))
    svg = bar_chart({"data-chart": "dedup"}, groups, y_label="bytes", y_fmt=size, binary=True, height=210,
                    aria="bytes shared across runs and artifacts")
    alt = table(("uses", "first stored by", "shared bytes"), rows, caption="deduplication across series")
    return figure("Deduplication across runs sharing a base", svg, alt,
                    note="Bytes of chunks a run (or artifact) uses that another one stored first: stored once.")


def storage_section(storage: Storage) -> str:
    body = cumulative_chart(storage) + dedup_chart(storage)
    return section("Storage", body, cls="storage") if body else ""


def _layers(nodes: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Depth of each node: the longest path from a node without parents (cycles, which lineage cannot form, are cut)."""
    parents: dict[str, list[str]] = {n: [] for n in nodes}
    for p, c in edges:
        parents.setdefault(c, []).append(p)
    depth: dict[str, int] = {}

    def walk(n: str, seen: frozenset[str]) -> int:
        if n in depth:
            return depth[n]
        ps = [p for p in parents.get(n, []) if p not in seen]
        d = 0 if not ps else 1 + max(walk(p, seen | {n}) for p in ps)
        depth[n] = d
        return d

    for n in nodes:
        walk(n, frozenset())
    return depth


def lineage_graph(data: ReportData, limit: int = 300) -> str:
    """Artifact versions (parents → children) and the runs whose checkpoints used them (one node per run)."""
    def node_of(ref: str) -> str:
        series, _, number = ref.rpartition("@")
        return ref if series in data.artifacts else f"run {series}"

    edges: dict[tuple[str, str], None] = {}
    for p, c in data.edges:
        a, b = node_of(p), node_of(c)
        if a != b:
            edges[(a, b)] = None
    nodes: dict[str, None] = {}
    for versions in data.artifacts.values():
        nodes.update(dict.fromkeys(v.ref for v in versions))
    for a, b in edges:
        nodes.update(dict.fromkeys((a, b)))
    if not edges and not nodes:
        return ""
    names = list(nodes)[:limit]
    keep = set(names)
    edge_list = [(a, b) for a, b in edges if a in keep and b in keep]
    depth = _layers(names, edge_list)
    columns: dict[int, list[str]] = {}
    for n in names:
        columns.setdefault(depth[n], []).append(n)
    ncol = max(columns) + 1
    col_w = min(260.0, (WIDTH - 40) / ncol)
    box_w, box_h, gap = min(col_w - 30, 220.0), 26, 12
    height = 30 + max(len(c) for c in columns.values()) * (box_h + gap)
    pos = {}
    for d, col in columns.items():
        for i, n in enumerate(sorted(col)):
            pos[n] = (20 + d * col_w, 20 + i * (box_h + gap))
    known = {v.ref for vs in data.artifacts.values() for v in vs}
    out = [f'<svg class="chart lineage" viewBox="0 0 {WIDTH} {height}" role="img" data-chart="lineage" '
           'aria-label="lineage graph: parents to children to runs">']
    rows = []
    for a, b in edge_list:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        sx, sy, ex, ey = x1 + box_w, y1 + box_h / 2, x2, y2 + box_h / 2
        mid = (sx + ex) / 2
        out.append(f'<path class="edge"{attr({"data-from": a, "data-to": b})} d="M{sx:.1f},{sy:.1f} '
                   f'C{mid:.1f},{sy:.1f} {mid:.1f},{ey:.1f} {ex:.1f},{ey:.1f}">{title(f"{a} → {b}")}</path>')
        rows.append((a, b))
    for n in names:
        x, y = pos[n]
        kind = "run" if n.startswith("run ") else ("artifact" if n in known else "missing")
        hover = {"run": f"{n}: checkpoints made from what points here",
                 "artifact": f"artifact version {n}", "missing": f"{n} (not in this report or no longer stored)"}[kind]
        text = n if len(n) <= 30 else n[:29] + "…"
        out.append(f'<g class="node n-{kind}"{attr({"data-node": n, "data-kind": kind})}>{title(hover)}'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{box_w:.1f}" height="{box_h}" rx="5"/>'
                   f'<text x="{x + 8:.1f}" y="{y + 17:.1f}">{escape(text)}</text></g>')
    out.append("</svg>")
    note = f"Showing the first {limit} of {len(nodes)} nodes." if len(nodes) > limit else ""
    alt = table(("from", "to"), rows or [("(no lineage edges)", "")], caption="lineage edges")
    return figure("Lineage: parents → children → runs that used them", "".join(out), alt, note=note)


def artifacts_section(data: ReportData) -> str:
    if not data.artifacts:
        return ""
    body = [lineage_graph(data)]
    for name, versions in data.artifacts.items():
        rows = [(v.version, v.created[:19].replace("T", " "), v.files, size(v.stats.get("logical_bytes", 0)),
                 size(v.stats.get("stored_bytes", 0)), ", ".join(v.parents), v.tier,
                 "pinned" + (f" ({v.pin['tag']})" if v.pin.get("tag") else "") if v.pin else "")
                for v in versions]
        body.append(f'<h3>{escape(name)}</h3>' + table(
            ("version", "created", "files", "size", "written", "parents", "tier", "pin"), rows,
            caption=f"versions of {name}", collapsed=False))
    return section("Artifacts", "".join(body), cls="artifacts", attrs=' id="artifacts"')


def snapshots_section(title_text: str, groups: dict, live_word: str, cls: str) -> str:
    if not groups:
        return ""
    body = []
    for name, snaps in groups.items():
        rows = [(s.number, s.created[:19].replace("T", " "), s.detail, size(s.stats.get("logical_bytes", 0)),
                 size(s.stats.get("stored_bytes", 0)), live_word if s.live else "",
                 "pinned" + (f" ({s.pin['tag']})" if s.pin.get("tag") else "") if s.pin else "") for s in snaps]
        body.append(f"<h3>{escape(name)}</h3>" + (table(
            ("number", "created", "what", "size", "written", "state", "pin"), rows, caption=name, collapsed=False)
            if rows else para("no snapshot yet", "muted")))
    return section(title_text, "".join(body), cls=cls)
