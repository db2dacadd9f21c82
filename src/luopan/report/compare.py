"""The part of the report that compares runs: every metric's curves of all runs overlaid in one chart (every step
the runs journaled, checkpoints marked), the runs' configs side by side with the keys that differ first and
highlighted, and per run a table of each checkpoint's metrics and eval logs with the best of each marked."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from .gather import NOT_A_SCORE, RunData, lower_is_better
from .html import figure, metric_text, para, section, slug, table
from .logged import thin
from .svg import Point, Series, line_chart

HALF = 540
RUN_COLOURS = 8  # CSS classes r0 … r7 (luopan.report.page), reused in turn past that


def run_class(i: int) -> str:
    return f"r{i % RUN_COLOURS}"


def _legend(runs: list[RunData]) -> str:
    return '<ul class="legend">' + "".join(
        f'<li data-run="{escape(r.name, quote=True)}"><span class="sw {run_class(i)}"></span>{escape(r.name)}</li>'
        for i, r in enumerate(runs)) + "</ul>"


def _curve(run: RunData, metric: str) -> tuple[list[tuple[int, float]], bool]:
    """(step, value) of ``metric`` in ``run``: every journaled step, plus checkpoints and eval logs at steps the
    journal lacks; and whether the journal had it."""
    points = dict(run.logged.get(metric, []))
    journaled = bool(points)
    for c in run.checkpoints:
        if metric in c.metrics:
            points.setdefault(c.step, c.metrics[metric])
    for step, m in run.evals.items():
        if metric in m:
            points.setdefault(step, m[metric])
    return sorted(points.items()), journaled


def overlay_names(runs: list[RunData]) -> list[str]:
    names: dict[str, None] = {}
    for r in runs:
        names.update(dict.fromkeys(r.logged))
        names.update(dict.fromkeys(r.metric_names))
    return list(names)


def _overlay_chart(runs: list[RunData], metric: str) -> str:
    series = []
    ticks = []
    by_step: dict[int, dict[str, float]] = {}
    journaled = 0
    for i, run in enumerate(runs):
        points, logged = _curve(run, metric)
        journaled += logged
        if not points:
            continue
        ckpt = {c.step for c in run.checkpoints}
        shown = thin(points, ckpt)
        pts = []
        for step, value in shown:
            mark = step in ckpt
            text = f"{run.name} step {step} · {metric} = {metric_text(value)}" + (" · checkpoint" if mark else "")
            pts.append(Point(step, value, text, "ckpt" if mark else "",
                             {"data-run": run.name, "data-step": step, "data-value": repr(value),
                              **({"data-ckpt": 1} if mark else {})}, r=4.0 if mark else 1.8))
        for step, value in points:
            by_step.setdefault(step, {})[run.name] = value
        series.append(Series(run.name, run_class(i), pts,
                             attrs={"data-run": run.name, "data-points": len(pts)}))
        ticks += [Point(c.step, 0, f"{run.name} step {c.step} · checkpoint", run_class(i),
                        {"data-run": run.name, "data-step": c.step}) for c in run.checkpoints]
    if not series:
        return ""
    svg = line_chart({"data-chart": f"overlay-{slug(metric)}", "data-metric": metric}, series, ticks=ticks,
                     y_label=metric, height=250, width=HALF,
                     aria=f"{metric} of {', '.join(s.name for s in series)} against step")
    names = [s.name for s in series]
    rows = [(step, *(metric_text(v[n]) if n in v else "" for n in names)) for step, v in sorted(by_step.items())]
    alt = table(("step", *names), rows, caption=f"{metric} per step")
    note = "" if journaled else "From checkpoints and eval logs: no run journaled this metric per step."
    return figure(metric, svg, alt, note=note)


def overlay_section(runs: list[RunData]) -> str:
    """Each metric's curves of every run in one chart (the runs' metrics journals: every logged step)."""
    with_metrics = [r for r in runs if r.logged or r.metric_names]
    if not with_metrics or (len(with_metrics) < 2 and not any(r.logged for r in with_metrics)):
        return ""
    charts = "".join(_overlay_chart(with_metrics, m) for m in overlay_names(with_metrics))
    intro = para("Every step each run journaled (CheckpointManager.log / maybe_save), one colour per run; the "
                 "larger points and the marks along the axis are checkpoints. Hover a point for its run, step "
                 "and value.", "muted")
    return section("Metrics across runs", intro + _legend(with_metrics) + f'<div class="pair">{charts}</div>',
                   cls="compare", attrs=' id="compare" data-section="overlay"')


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def _config_rows(keys: list[str], runs: list[RunData], cls: str) -> str:
    out = []
    for k in keys:
        cells = "".join(f'<td data-run="{escape(r.name, quote=True)}">'
                        + (escape(_text(r.config[k])) if k in r.config else '<span class="muted">—</span>') + "</td>"
                        for r in runs)
        out.append(f'<tr class="{cls}" data-key="{escape(k, quote=True)}"><th>{escape(k)}</th>{cells}</tr>')
    return "".join(out)


def config_section(runs: list[RunData]) -> str:
    """The runs' configs side by side: the keys whose values differ (or that some runs lack) first, highlighted;
    the keys all runs share with one value folded under them."""
    have = [r for r in runs if r.config]
    if not have:
        return ""
    keys = sorted({k for r in have for k in r.config})
    differ = [k for k in keys if len({_text(r.config[k]) if k in r.config else "\0absent" for r in have}) > 1]
    same = [k for k in keys if k not in differ]
    head = "<tr><th>key</th>" + "".join(f'<th class="{run_class(i)}">{escape(r.name)}</th>'
                                        for i, r in enumerate(have)) + "</tr>"
    where = para("From each run's record (CheckpointManager(config=…)), its latest checkpoint's metadata and the "
                 "settings its state holds (Lightning hyper_parameters, HF training_args).", "muted")
    if len(have) == 1:
        body = (f'<div class="tablewrap"><table class="config" data-runs="1"><thead>{head}</thead><tbody>'
                f'{_config_rows(keys, have, "same")}</tbody></table></div>')
        return section("Config", where + body, cls="compare", attrs=' id="config" data-section="config"')
    summary = para(f"{len(differ)} key(s) differ between the runs, {len(same)} are the same.")
    body = (f'<div class="tablewrap"><table class="config" data-runs="{len(have)}"><thead>{head}</thead><tbody>'
            f'{_config_rows(differ, have, "differs")}</tbody></table></div>')
    if same:
        body += (f'<details class="same"><summary>{len(same)} key(s) the same in every run</summary>'
                 f'<div class="tablewrap"><table class="config same"><thead>{head}</thead><tbody>'
                 f'{_config_rows(same, have, "same")}</tbody></table></div></details>')
    return section("Config", where + summary + body, cls="compare", attrs=' id="config" data-section="config"')


def eval_table(run: RunData) -> str:
    """Checkpoint × metric: what each checkpoint's manifest recorded and what its eval log holds (the eval log's
    value where both have a metric), the best of each score highlighted; pruned steps known from eval logs too."""
    rows: dict[int, dict[str, tuple[float, str]]] = {}
    for c in run.checkpoints:
        rows[c.step] = {k: (v, "checkpoint") for k, v in c.metrics.items()}
    for step, m in run.evals.items():
        rows.setdefault(step, {}).update({k: (v, "eval log") for k, v in m.items()})
    names: dict[str, None] = {}
    for m in rows.values():
        names.update(dict.fromkeys(m))
    if not names:
        return ""
    best: dict[str, int] = {}
    for name in names:
        have = [(s, m[name][0]) for s, m in rows.items() if name in m]
        if name.lower() in NOT_A_SCORE or len({v for _s, v in have}) < 2:
            continue
        pick = min if lower_is_better(name) else max
        best[name] = pick(have, key=lambda sv: sv[1])[0]
    kept = {c.step for c in run.checkpoints}
    head = "<tr><th>checkpoint</th>" + "".join(f"<th>{escape(n)}</th>" for n in names) + "</tr>"
    body = []
    for step in sorted(rows):
        label = f"{run.name}@{step}" + ("" if step in kept else " (pruned)")
        cells = []
        for n in names:
            if n not in rows[step]:
                cells.append("<td></td>")
                continue
            v, src = rows[step][n]
            is_best = best.get(n) == step
            cls = " ".join(x for x in ("best" if is_best else "", "from-eval" if src == "eval log" else "") if x)
            cells.append(f'<td class="{cls}" data-metric="{escape(n, quote=True)}" title="{escape(src, quote=True)}'
                         f'{" · best" if is_best else ""}">{escape(metric_text(v))}{" ★" if is_best else ""}</td>')
        body.append(f'<tr data-step="{step}"><th>{escape(label)}</th>{"".join(cells)}</tr>')
    return (f'<figure><figcaption>Evals per checkpoint</figcaption><p class="note">Metrics saved with each checkpoint '
            f'and its eval log (in italics where the eval log gave it); ★ the best of each score.</p>'
            f'<div class="tablewrap"><table class="evals" data-run="{escape(run.name, quote=True)}">'
            f'<thead>{head}</thead><tbody>{"".join(body)}</tbody></table></div></figure>')
