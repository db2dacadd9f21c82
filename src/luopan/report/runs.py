"""The per-run part of the report: metric curves with every checkpoint marked (pinned, best, latest highlighted,
pruned ones shown as gone), bytes per save, save and stall times, restore times, and where each checkpoint lives."""

from __future__ import annotations

from html import escape

from .html import NOT_RECORDED, figure, legend, metric_text, para, seconds, section, size, slug, table
from .compare import eval_table
from .gather import Checkpoint, RunData
from .storage import Storage
from .svg import Cell, Group, Part, Point, Series, bar_chart, line_chart, strip

HALF = 540  # metric charts: two to a row (viewBox units, drawn at about that many pixels)
TIER_TEXT = {"local": "local only", "replicating": "replicating", "replicated": "local + remote",
             "remote": "remote (evicted locally)", "cold": "cold"}


def states(c: Checkpoint, metric: str | None = None) -> list[str]:
    """pinned / best (of ``metric`` when given, else of any metric) / latest."""
    out = []
    if c.pin is not None:
        out.append("pinned")
    if (metric in c.best) if metric is not None else c.best:
        out.append("best")
    if c.latest:
        out.append("latest")
    return out


def describe(c: Checkpoint, metric: str | None = None) -> str:
    """Hover text naming the checkpoint: ``run-a step 100 · loss 0.5 · pinned (release-1) · best loss · latest``."""
    parts = [f"{c.run} step {c.step}"]
    if metric is not None and metric in c.metrics:
        parts.append(f"{metric} {metric_text(c.metrics[metric])}")
    if c.pin is not None:
        parts.append("pinned" + (f" ({c.pin['tag']})" if c.pin.get("tag") else ""))
    if c.best:
        parts.append("best " + ", ".join(c.best))
    if c.latest:
        parts.append("latest")
    parts.append(f"tier {TIER_TEXT.get(c.tier, c.tier)}")
    parts.append(c.created[:19].replace("T", " "))
    return " · ".join(parts)


def _metric_chart(run: RunData, metric: str) -> str:
    chart = {"data-chart": f"metric-{slug(metric)}", "data-run": run.name, "data-metric": metric}
    points, rows = [], []
    have = {c.step for c in run.checkpoints}
    for c in run.checkpoints:
        value, source = c.metrics.get(metric), "checkpoint"
        if value is None and metric in run.evals.get(c.step, {}):
            value, source = run.evals[c.step][metric], "eval log"
        if value is None:
            continue
        st = states(c, metric)
        cls = " ".join(["ckpt", *st] + (["eval"] if source == "eval log" else []))
        points.append(Point(c.step, value, describe(c, metric) if source == "checkpoint" else
                            f"{describe(c)} · {metric} {metric_text(value)} (eval log)", cls,
                            {"data-step": c.step, "data-run": run.name, "data-state": " ".join(st) or "kept"},
                            r=6 if st else 4))
        rows.append((c.step, metric_text(value), source, ", ".join(st) or "kept"))
    for step, metrics in run.pruned.items():
        if metric in metrics and step not in have:
            points.append(Point(step, metrics[metric], f"{run.name} step {step} · {metric} "
                                f"{metric_text(metrics[metric])} · pruned (manifest gone; value from its eval log)",
                                "pruned", {"data-step": step, "data-run": run.name, "data-state": "pruned"}))
            rows.append((step, metric_text(metrics[metric]), "eval log", "pruned"))
    rows.sort(key=lambda r: r[0])
    ticks = [Point(c.step, 0, describe(c), "tick-ckpt " + " ".join(states(c, metric)),
                   {"data-step": c.step, "data-state": " ".join(states(c, metric)) or "kept"})
             for c in run.checkpoints]
    ticks += [Point(s, 0, f"{run.name} step {s} · pruned (manifest gone)", "tick-pruned",
                    {"data-step": s, "data-state": "pruned"}) for s in run.pruned]
    svg = line_chart(chart, [Series(metric, "s-metric", points)], ticks=ticks, y_label=metric, height=230,
                     width=HALF, aria=f"{metric} of run {run.name} against step")
    alt = table(("step", metric, "from", "state"), rows, caption=f"{metric} of {run.name}")
    return figure(f"{metric}", svg, alt)


def metric_legend() -> str:
    return legend((("sw-ckpt", "checkpoint"), ("sw-pinned", "pinned"), ("sw-best", "best"),
                     ("sw-latest", "latest"), ("sw-eval", "value from the eval log"),
                     ("sw-pruned", "pruned (manifest gone)")))


def _storage_chart(run: RunData, storage: Storage) -> str:
    groups, rows = [], []
    for c in run.checkpoints:
        s = storage.by_ref.get(("run", c.run, c.step))
        if s is None:
            continue
        who = f"{c.run} step {c.step}"
        written = Part("written", s.stored, "p-written", f"{who} · {size(s.stored)} written to packs (compressed)")
        groups.append(Group(str(c.step), [[
            Part("reused", s.reused, "p-reused", f"{who} · {size(s.reused)} reused (not written again)"),
            Part("new", s.new_plain, "p-new", f"{who} · {size(s.new_plain)} of new chunks"),
            Part("delta", s.new_delta, "p-delta", f"{who} · {size(s.new_delta)} of row/XOR deltas "
                 f"({c.delta_entries} row-delta, {c.xor_entries} XOR entries)")], [written]],
            {"data-step": c.step, "data-run": c.run}))
        rows.append((c.step, size(s.logical), size(s.new_plain), size(s.new_delta), size(s.reused),
                     size(s.stored), c.delta_entries + c.xor_entries))
    if not groups:
        return ""
    svg = bar_chart({"data-chart": "storage", "data-run": run.name}, groups, x_label="step", y_label="bytes",
                    y_fmt=size, binary=True, aria=f"bytes per save of run {run.name}")
    alt = table(("step", "logical", "new chunks", "row/XOR deltas", "reused", "written", "delta entries"), rows,
                  caption=f"bytes per save of {run.name}")
    lg = legend((("p-reused", "reused"), ("p-new", "new chunks"), ("p-delta", "row/XOR deltas"),
                   ("p-written", "written (after compression)")))
    return figure("Bytes per save: logical (stacked) vs written", svg, alt, legend_html=lg,
                    note="Left bar: the state's logical bytes split into chunks reused from earlier saves, new chunks "
                         "and delta chunks; right bar: bytes of pack files the save wrote.")


def _timing_chart(run: RunData) -> str:
    recorded = [c for c in run.checkpoints if c.save_seconds is not None or c.stall_seconds is not None]
    rows = [(c.step, seconds(c.save_seconds), seconds(c.stall_seconds)) for c in run.checkpoints]
    alt = table(("step", "save time", "stall"), rows, caption=f"save times of {run.name}")
    if not recorded:
        return ('<figure><figcaption>Save time and stall</figcaption><p class="note" data-chart="timing" '
                f'data-run="{escape(run.name, quote=True)}">{NOT_RECORDED}: these checkpoints were saved by a '
                f"luopan that did not record save times.</p>{alt}</figure>")
    groups = []
    for c in run.checkpoints:
        who = f"{c.run} step {c.step}"
        groups.append(Group(str(c.step), [
            [Part("save", c.save_seconds or 0.0, "p-save", f"{who} · save {seconds(c.save_seconds)}")],
            [Part("stall", c.stall_seconds or 0.0, "p-stall", f"{who} · training blocked "
                  f"{seconds(c.stall_seconds)}")]], {"data-step": c.step, "data-run": c.run}))
    svg = bar_chart({"data-chart": "timing", "data-run": run.name}, groups, x_label="step", y_label="seconds",
                    y_fmt=lambda v: f"{v:.3g} s", height=210, aria=f"save and stall times of run {run.name}")
    missing = len(run.checkpoints) - len(recorded)
    note = f"{missing} checkpoint(s): {NOT_RECORDED}." if missing else ""
    lg = legend((("p-save", "total save time"), ("p-stall", "stall (training loop blocked)")))
    return figure("Save time and stall per checkpoint", svg, alt, note=note, legend_html=lg)


def _restore_chart(run: RunData) -> str:
    recs = [r for r in run.resumes if isinstance(r.get("step"), int)]
    if not recs:
        return ""
    groups, rows = [], []
    for i, r in enumerate(recs):
        secs = r.get("restore_seconds")
        secs = float(secs) if isinstance(secs, (int, float)) and not isinstance(secs, bool) else None
        matched = r.get("matched")
        match = "not checked" if matched is None else ("matched" if matched else
                                                       f"diverged at step {r.get('first_divergent_step')}")
        who = f"{run.name} step {r['step']}"
        groups.append(Group(str(r["step"]), [[Part("restore", secs or 0.0, "p-restore" if matched is not False
                                                   else "p-diverged", f"{who} · restored in {seconds(secs)} · "
                                                   f"{match}")]], {"data-step": r["step"], "data-resume": i}))
        rows.append((r["step"], str(r.get("time", ""))[:19], seconds(secs), match))
    svg = bar_chart({"data-chart": "restore", "data-run": run.name}, groups, x_label="resumed from step",
                    y_label="seconds", y_fmt=lambda v: f"{v:.3g} s", height=200,
                    aria=f"restore times of run {run.name}")
    alt = table(("step", "time", "restore time", "resumed run"), rows, caption=f"restores of {run.name}")
    return figure("Restores: time to restore, and whether the resumed run matched", svg, alt)


def _tier_chart(run: RunData, tiered: bool) -> str:
    cells = [Cell(str(c.step), f"t-{c.tier}", describe(c), {"data-step": c.step, "data-tier": c.tier})
             for c in run.checkpoints]
    cells += [Cell(str(s), "t-pruned", f"{run.name} step {s} · pruned (manifest gone)",
                   {"data-step": s, "data-tier": "pruned"}) for s in run.pruned]
    cells.sort(key=lambda c: int(c.label))
    if not cells:
        return ""
    svg = strip({"data-chart": "tiers", "data-run": run.name}, cells, aria=f"where each checkpoint of {run.name} lives")
    rows = [(c.label, c.attrs["data-tier"]) for c in cells]
    alt = table(("step", "tier"), rows, caption=f"tiers of {run.name}")
    lg = legend((("t-local", "local"), ("t-replicating", "replicating"), ("t-replicated", "local + remote"),
                   ("t-remote", "remote"), ("t-cold", "cold"), ("t-pruned", "pruned")))
    note = "" if tiered else "This repository is not tiered: every checkpoint lives in it."
    return figure("Where each checkpoint lives", svg, alt, legend_html=lg, note=note)


def _summary(run: RunData) -> str:
    cps = run.checkpoints
    pinned = [c for c in cps if c.pin is not None]
    bits = [f"{len(cps)} checkpoint(s)"]
    if cps:
        bits.append(f"steps {cps[0].step}–{cps[-1].step}, latest {cps[-1].step} ({cps[-1].created[:19]})")
    if pinned:
        bits.append("pinned: " + ", ".join(str(c.step) + (f" ({c.pin['tag']})" if c.pin and c.pin.get("tag")
                                                            else "") for c in pinned))
    if run.pruned:
        bits.append(f"{len(run.pruned)} pruned: " + ", ".join(map(str, run.pruned)))
    if run.evals:
        bits.append(f"{len(run.evals)} eval log(s)")
    out = para("; ".join(bits) + ".")
    if run.damaged:
        out += para(f"{len(run.damaged)} damaged manifest(s), not shown: steps "
                      + ", ".join(str(s) for s, _ in run.damaged) + " (luopan verify names the damage).", "warn")
    rec = run.record
    if rec:
        git = rec.get("git") or {}
        line = f"started {str(rec.get('created', ''))[:19]} · {' '.join(map(str, rec.get('argv', [])))[:200]}"
        if git.get("commit"):
            line += f" · git {git['commit'][:12]}{' (dirty)' if git.get('dirty') else ''}"
        out += para(line, "muted")
    return out


def checkpoint_table(run: RunData) -> str:
    rows = [(c.step, c.created[:19].replace("T", " "), " ".join(f"{k}={metric_text(v)}" for k, v in c.metrics.items()),
             ", ".join(states(c)) or "", (c.pin or {}).get("tag") or "", TIER_TEXT.get(c.tier, c.tier),
             size(c.stats.get("logical_bytes", 0)), size(c.stats.get("stored_bytes", 0)))
            for c in run.checkpoints]
    rows += [(s, "", " ".join(f"{k}={metric_text(v)}" for k, v in m.items()), "pruned", "", "gone", "", "")
             for s, m in run.pruned.items()]
    rows.sort(key=lambda r: int(r[0]))
    return table(("step", "created", "metrics", "state", "pin tag", "tier", "logical", "written"), rows,
                   caption=f"checkpoints of {run.name}")


def run_section(run: RunData, storage: Storage, tiered: bool) -> str:
    body = [_summary(run)]
    names = run.metric_names
    if names:
        body.append(metric_legend())
        body.append('<div class="pair">' + "".join(_metric_chart(run, m) for m in names) + "</div>")
        body.append(eval_table(run))
    else:
        body.append(para("No numeric metrics recorded for this run.", "muted"))
    body += [_storage_chart(run, storage), _timing_chart(run), _restore_chart(run), _tier_chart(run, tiered),
             checkpoint_table(run)]
    return section(f"Run {run.name}", "".join(body), cls="run",
                     attrs=f' id="run-{escape(slug(run.name), quote=True)}" data-run="{escape(run.name, quote=True)}"')
