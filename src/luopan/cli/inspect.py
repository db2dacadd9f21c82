"""``luopan ls``, ``show``, ``diff`` and ``du``: looking at what a repository holds."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from ..checkpoint import CheckpointInfo, list_resumes
from ..repo import Repo
from ..errors import IntegrityError, StorageError, UnsupportedFormatError, UsageError
from ..listing import PLURAL, WORDS, describe, dedup_words, kind_counts, series_json
from .artifact import KindOpt, is_artifact_target, print_log
from .app import (
    DEDUP_DEFINITION,
    JsonOpt,
    app,
    dedup_ratio,
    emit_json,
    err,
    escape,
    human,
    json_ratio,
    json_safe,
    metrics_text,
    not_found,
    opens_repo,
    out,
    ratio,
    ref_argument,
    report_strays,
    table,
)
from .diffview import print_diff
from .grammar import LegacyStep, RunRef, checkpoint_ref, deprecated
from .kinds import other_kinds_table, other_target, print_kinds, print_storage, show_other

@app.command("ls")
@opens_repo
def ls(
    *,
    r: Repo,
    run: Annotated[Optional[str], typer.Argument(help="Run to list checkpoints of; all runs when omitted.")] = None,
    best: Annotated[Optional[str], typer.Option(
        "--best", metavar="METRIC[:min|max]",
        help="Only the best checkpoint of RUN by a recorded metric, one line (lowest by default; METRIC:max for "
             "the highest): STEP METRICS TIME.")] = None,
    kind: KindOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, artifacts, journals (a LangGraph saver's threads and checkpoints) and indexes with their sizes, or
    the checkpoints of RUN with sizes, bytes newly written and dedup ratio. An artifact name lists its versions (as
    `luopan artifact log NAME`); `luopan show NAME` shows a journal or index. With --best METRIC, only RUN's best
    checkpoint."""
    if best is not None and run is None:
        raise UsageError("--best needs a run: luopan ls RUN --best METRIC[:min|max]")
    if best is not None:
        _best(r, run, best, as_json)
        return
    if run is None:
        report_strays(r)
        rows = []
        for name in r.runs():
            cps, damaged = _checkpoints(r, name)
            last = cps[-1] if cps else None
            rows.append({"run": name, "checkpoints": len(cps), "damaged": len(damaged),
                         "latest_step": last.step if last else None, "latest_time": last.created if last else "",
                         "logical_bytes": sum(c.logical_bytes for c in cps),
                         "stored_bytes": sum(c.stored_bytes for c in cps)})
        others = describe(r, tuple(k for k in r.kinds if k.name != "checkpoint")).series
        if as_json:
            by_kind: dict[str, list[dict[str, Any]]] = {"artifacts": [], "journals": [], "indexes": []}
            for s in others:
                noun, word = WORDS[s.kind]
                by_kind[PLURAL[noun]].append({noun: s.series, PLURAL[word]: len(s.numbers), **series_json(s)})
            emit_json({"runs": rows, **by_kind})
            return
        if not rows and not others:
            out.print("nothing stored yet: no checkpoints, artifacts, journals or indexes")
            return
        t = table(title=f"runs in {r.store.describe()}")
        for col in ("run", "checkpoints", "latest step", "latest time", "logical", "stored"):
            t.add_column(col, justify="right" if col not in ("run", "latest time") else "left")
        for row in rows:
            count = str(row["checkpoints"]) + (f" (+{row['damaged']} damaged)" if row["damaged"] else "")
            t.add_row(row["run"], count, str(row["latest_step"]), row["latest_time"][:19],
                      human(row["logical_bytes"]), human(row["stored_bytes"]))
        if rows:
            out.print(t)
        if others:
            other_kinds_table(others, f"artifacts, journals and indexes in {r.store.describe()}")
        return
    if is_artifact_target(r, run, kind):
        print_log(r, run, as_json)
        return
    cps, damaged = _checkpoints(r, run)
    if not cps and not damaged:
        raise typer.Exit(not_found(f"run {run!r} has no checkpoints"))
    for step, why in damaged:
        err.print(f"[bold red]DAMAGED[/] step {step}: {escape(why)}", highlight=False)
    tiers = r.checkpointing.replication_status(run) if r.tier is not None else None  # tiered: local/replicating/replicated/…
    if as_json:
        emit_json({"run": run, "damaged": [{"step": s, "error": w} for s, w in damaged], "checkpoints": [
            {"step": c.step, "created": c.created, "metrics": json_safe(c.metrics),
             "logical_bytes": c.logical_bytes, "new_bytes": c.new_bytes, "stored_bytes": c.stored_bytes,
             "chunks": c.chunks, "new_chunks": c.new_chunks, "dedup_ratio": json_ratio(c.dedup_ratio),
             "fingerprint": c.fingerprint, **({"tier": tiers.get(c.step)} if tiers is not None else {})}
            for c in cps]})
        if damaged:
            raise typer.Exit(3)
        return
    t = table(title=f"checkpoints of {run}")
    for col in ("step", "time", "metrics", "logical", "written", "dedup") + (("tier",) if tiers is not None else ()):
        t.add_column(col, justify="left" if col in ("time", "metrics", "tier") else "right")
    for c in cps:
        t.add_row(str(c.step), c.created[:19], metrics_text(c.metrics), human(c.logical_bytes),
                  human(c.stored_bytes), ratio(c.dedup_ratio) if c.stored_bytes else "all reused",
                  *((tiers.get(c.step, "?"),) if tiers is not None else ()))
    out.print(t)
    if damaged:
        err.print(f"[bold red]{len(damaged)} damaged checkpoint(s)[/]; run `luopan verify -r {escape(r.where)} "
                  f"{escape(run)}` for details")
        raise typer.Exit(3)


def _best(r: Repo, run: str, best: str, as_json: bool) -> None:
    """`ls RUN --best METRIC[:min|max]`: the checkpoint with the lowest (highest) numeric value of METRIC, the
    newest among equals; a metric no checkpoint records is a usage error listing those recorded."""
    metric, sep, order = best.rpartition(":")  # a metric name may hold colons (eval:loss); the order ends it
    if not sep or order not in ("min", "max"):
        metric, order = best, ""
    if not metric:
        raise UsageError(f"--best takes METRIC, METRIC:min or METRIC:max (e.g. loss, accuracy:max), got {best!r}")
    cps, damaged = _checkpoints(r, run)
    if not cps and not damaged:
        raise typer.Exit(not_found(f"run {run!r} has no checkpoints"))
    for step, why in damaged:
        err.print(f"[bold red]DAMAGED[/] step {step} (not considered): {escape(why)}", highlight=False)
    scored = [(c.metrics[metric], c) for c in cps if isinstance(c.metrics.get(metric), (int, float))
              and not isinstance(c.metrics.get(metric), bool) and c.metrics[metric] == c.metrics[metric]]
    if not scored:
        recorded = sorted({k for c in cps for k, v in c.metrics.items() if isinstance(v, (int, float))})
        raise UsageError(f"no checkpoint of run {run!r} records metric {metric!r} as a number; recorded: "
                         + (", ".join(recorded) if recorded else "none"))
    sign = -1 if order == "max" else 1
    value, c = min(scored, key=lambda vc: (sign * vc[0], -vc[1].step))
    if as_json:
        emit_json({"run": run, "metric": metric, "order": order or "min", "value": json_safe(value), "step": c.step,
                   "created": c.created, "metrics": json_safe(c.metrics), "candidates": len(scored)})
    else:
        out.print(f"{c.step} {metrics_text(c.metrics)} {c.created[:19]}", highlight=False, markup=False)
    if damaged:
        raise typer.Exit(3)


def _checkpoints(r: Repo, run: str) -> tuple[list[CheckpointInfo], list[tuple[int, str]]]:
    """A run's readable checkpoints, and (step, reason) for each whose manifest is damaged (listed, not fatal)."""
    infos, damaged = [], []
    for step in r.steps(run):
        try:
            infos.append(r.checkpointing.info(run, step))  # the manifest's own file: its groups are not read
        except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
            damaged.append((step, str(exc)))
    return infos, damaged


@app.command()
@opens_repo
def show(
    *,
    r: Repo,
    ref: RunRef,
    legacy_step: LegacyStep = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one checkpoint: metadata, environment, code version and every entry. Without @STEP, also the run's
    record (config, command line, packages, git commit and diff, environment with secrets redacted) and evals. An
    artifact, journal or index NAME[@V] (no run of that name) is shown in its own words: what it holds (a LangGraph
    journal's threads and checkpoints), its sizes and its versions or snapshots."""
    other = other_target(r, ref) if legacy_step is None else None
    if other is not None:  # an artifact, journal or index: shown in its own words
        show_other(r, *other, as_json)
        return
    run, step = checkpoint_ref(ref, legacy_step, "show", quiet=as_json)
    m = r.manifest(run, step)
    doc = m.doc
    record = r.run(run).record() if step is None else None
    evals = r.run(run).evals() if step is None else []
    resumes = list_resumes(r, run) if step is None else []
    if as_json:
        emit_json({"run": m.run, "step": m.step, "created": m.created, "metrics": json_safe(m.metrics),
                    **({"record": record, "evals": evals, "resumes": json_safe(resumes)} if step is None else {}),
                    "metadata": doc["metadata"], "environment": doc["environment"], "code": doc.get("code"),
                    "fingerprint": doc["fingerprint"], "stats": doc["stats"], "packs": len(m.packs),
                    "entries": [{k: e[k] for k in ("path", "kind", "dtype", "shape", "nbytes")}
                                | ({"chunks": len(e["chunks"])} if "chunks" in e else {"alias_of":
                                   m.entries[e["alias_of"]]["path"]})
                                | ({"delta": {"base_step": e["delta"]["base_step"], "rows": e["delta"]["rows"],
                                             "segments": e["delta"].get("segments", [e["delta"]["rows"]])}}
                                   if "delta" in e else {})
                                | ({"xor": {"base_step": e["xor"]["base_step"]}} if "xor" in e else {})
                                for e in m.entries]})
        return
    s = doc["stats"]
    if record is not None:
        _print_record(record, evals)
    for res in resumes:
        out.print(f"resume       {resume_text(res)}", markup=False)
    if resumes:
        out.print("")
    out.print(f"[bold]{escape(m.run)}[/] step [bold]{m.step}[/]  created {escape(m.created)}")
    if m.metrics:  # user text from here on (metric names, metadata, ...): printed as written, never as markup
        out.print(f"metrics      {metrics_text(m.metrics)}", markup=False)
    if doc["metadata"]:
        out.print(f"metadata     {json.dumps(doc['metadata'])}", markup=False)
    env = doc["environment"]
    out.print("environment  " + " ".join(f"{k}={v}" for k, v in env.items()), markup=False)
    if "code" in doc:
        out.print(f"code         {doc['code']['commit'][:12]}{' (dirty)' if doc['code']['dirty'] else ''}",
                  markup=False)
    out.print(f"fingerprint  {doc['fingerprint']}", markup=False)
    out.print(f"size         {human(s['logical_bytes'])} logical, {human(s['stored_bytes'])} written by this save "
              f"({s['new_chunks']} of {s['chunks']} chunks new, {len(m.packs)} packs referenced)")
    t = table()
    for col in ("entry", "kind", "dtype", "shape", "bytes", "chunks"):
        t.add_column(col, justify="right" if col in ("bytes", "chunks") else "left")
    for e in m.entries:
        chunks = str(len(e["chunks"])) if "chunks" in e else f"= {m.entries[e['alias_of']]['path']}"
        if "delta" in e:  # docs/format.md §5.2
            chunks += f" + {e['delta']['rows']} rows over step {e['delta']['base_step']}"
            if "segments" in e["delta"]:
                chunks += f" in {len(e['delta']['segments'])} segments"
        elif "xor" in e:  # docs/format.md §5.4
            chunks += f" XOR over step {e['xor']['base_step']}"
        t.add_row(e["path"], e["kind"], e["dtype"], str(tuple(e["shape"])), human(e["nbytes"]), chunks)
    out.print(t)


def resume_text(res: dict[str, Any]) -> str:
    """One line for a resume of the run (CheckpointManager's resume check, luopan.checkpoint.runs.resumes)."""
    took = res.get("restore_seconds")
    head = f"from step {res['step']} at {res.get('time') or '?'}" + (f", restore {took:.2f}s" if took else "")
    if res.get("matched") is True:
        return f"{head}: matched the interrupted run over {res.get('steps_compared', 0)} steps"
    if res.get("matched") is False:
        detail = f" ({res['detail']})" if res.get("detail") else ""
        return f"{head}: DIVERGED from the interrupted run at step {res.get('first_divergent_step')}{detail}"
    return f"{head}: not decided ({res.get('steps_compared', 0)} steps compared)"


def _print_record(rec: dict[str, Any], evals: list[int]) -> None:
    out.print(f"[bold]run {escape(rec['run'])}[/]  started {escape(rec['created'])}")
    out.print(f"command      {' '.join(rec['argv'])}  (in {rec['cwd']})", markup=False)  # user text: as written
    out.print(f"python       {rec['python']} on {rec['platform']}", markup=False)
    out.print("packages     " + " ".join(f"{k}={v}" for k, v in rec["packages"].items()), markup=False)
    git = rec.get("git")
    if git:
        diff_lines = git["diff"].count("\n")
        state = f"dirty: {diff_lines} diff lines recorded" if git["dirty"] else "clean"
        out.print(f"git          {git['commit'][:12]} ({state}"
                  + (f", {len(git['untracked_files'])} untracked files" if git["untracked_files"] else "") + ")",
                  markup=False)
    if rec.get("config") is not None:
        out.print("config       " + json.dumps(rec["config"], sort_keys=True), markup=False)
    redacted = sorted(k for k, v in rec["environment"].items() if v == "<redacted>")
    out.print(f"environment  {len(rec['environment'])} variables" + (f" ({', '.join(redacted)} redacted)"
                                                                    if redacted else ""), markup=False)
    if evals:
        out.print(f"evals        steps {', '.join(map(str, evals))}")
    out.print("")


@app.command()
@opens_repo
def diff(
    *,
    r: Repo,
    first: Annotated[str, typer.Argument(metavar="RUN_A@STEP", help="The older checkpoint.")],
    second: Annotated[str, typer.Argument(metavar="RUN_B@STEP", help="The newer checkpoint (of the same run or "
                                                                      "another).")],
    third: Annotated[Optional[str], typer.Argument(hidden=True, help="Deprecated: diff RUN STEP_A STEP_B.")] = None,
    bytes_only: Annotated[bool, typer.Option("--bytes-only", help="Only which chunks differ: read no tensor (no "
                                                                    "relative L2 norm or max abs difference).")]
    = False,
    as_json: JsonOpt = False,
) -> None:
    """List the entries that changed between two checkpoints, how many bytes differ and by how much each tensor
    changed (relative L2 norm ||b-a||/||a||, max abs difference, elements differing; read one tensor of each at a
    time), and the config diff (run record config, manifest metadata, hyper_parameters/training_args): diff
    RUN@STEP_A RUN@STEP_B (two steps of one run) or diff RUN_A@STEP RUN_B@STEP (checkpoints of two runs)."""
    if third is not None:  # the deprecated RUN STEP_A STEP_B
        if "@" in first or "@" in second:
            raise UsageError("give two checkpoints as RUN@STEP: luopan diff RUN_A@STEP RUN_B@STEP")
        old_a, old_b = _step(second), _step(third)
        deprecated("luopan diff RUN STEP_A STEP_B", f"luopan diff {first}@{old_a} {first}@{old_b}", as_json)
        (run_a, step_a), (run_b, step_b) = (first, old_a), (first, old_b)
    elif "@" not in first or "@" not in second:
        raise UsageError("give two checkpoints as RUN@STEP: luopan diff RUN@STEP_A RUN@STEP_B (one run) or luopan "
                         "diff RUN_A@STEP RUN_B@STEP")
    else:
        (run_a, step_a), (run_b, step_b) = (ref_argument(x, "checkpoint (RUN@STEP)") for x in (first, second))
    d = r.diff(run_a, step_a, step_b, to_run=run_b, values=not bytes_only)
    if as_json:
        emit_json(json_safe(d))
        return
    print_diff(d, f"{run_a}: step {step_a} -> {step_b}" if run_a == run_b else f"{run_a}@{step_a} -> {run_b}@{step_b}",
               not bytes_only)


def _step(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"a step is a number, got {text!r}") from None


@app.command(help="Logical size of every kind of manifest (checkpoints, artifact versions, journal snapshots, index "
             "versions) vs the bytes they take as stored, each kind's share, and the size on storage (journals' and "
             "indexes' logs apart). " + DEDUP_DEFINITION + " `luopan stats` shows the same totals.")
@opens_repo
def du(*, r: Repo, as_json: JsonOpt = False) -> None:
    report_strays(r)
    h = describe(r)
    d = h.totals
    ratio = dedup_ratio(d["logical_bytes"], d["stored_bytes"])
    if as_json:
        emit_json({**d, "dedup_ratio": ratio, "kinds": h.kinds, "series": [series_json(s) for s in h.series]})
        return
    out.print(f"{kind_counts(h)}: {human(d['logical_bytes'])} logical, {human(d['stored_bytes'])} stored in "
              f"{d['chunks']} distinct chunk(s) ({dedup_words(d['logical_bytes'], d['stored_bytes'])})",
              highlight=False, markup=False)
    print_storage(d)
    if len(h.kinds) > 1:
        print_kinds(h)
