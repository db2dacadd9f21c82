"""``luopan ls``, ``show``, ``diff`` and ``du``: looking at what a repository holds."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ..checkpoint.info import CheckpointInfo
from ..repo import Repo
from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..format.names import manifest_key
from .artifact import is_artifact_target, log as artifact_log
from .app import (
    JsonOpt,
    RepoOpt,
    app,
    emit_json,
    err,
    escape,
    handles_errors,
    human,
    json_ratio,
    json_safe,
    metrics_text,
    not_found,
    open_repo,
    out,
    ratio,
    repo_location,
    report_strays,
)

@app.command("ls")
@handles_errors
def ls(
    *,
    repo: RepoOpt = None,
    run: Annotated[Optional[str], typer.Argument(help="Run to list checkpoints of; all runs when omitted.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs (and artifacts), or the checkpoints of RUN with sizes, bytes newly written and dedup ratio. An
    artifact name lists its versions (as `luopan artifact log NAME`)."""
    repo = repo_location(repo)
    r = open_repo(repo)
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
        artifacts = [{"artifact": n, "versions": len(r.artifact(n).numbers())} for n in r.artifact_names()]
        if as_json:
            emit_json({"runs": rows, "artifacts": artifacts})
            return
        if artifacts:
            out.print(f"{len(artifacts)} artifact(s): "
                      + ", ".join(f"{a['artifact']} ({a['versions']} version(s))" for a in artifacts[:20])
                      + (" …" if len(artifacts) > 20 else "") + " — `luopan artifact ls` for details",
                      highlight=False)
        if not rows:
            out.print("no checkpoints yet")
            return
        t = Table(title=f"runs in {r.store.describe()}")
        for col in ("run", "checkpoints", "latest step", "latest time", "logical", "stored"):
            t.add_column(col, justify="right" if col not in ("run", "latest time") else "left")
        for row in rows:
            count = str(row["checkpoints"]) + (f" (+{row['damaged']} damaged)" if row["damaged"] else "")
            t.add_row(row["run"], count, str(row["latest_step"]), row["latest_time"][:19],
                      human(row["logical_bytes"]), human(row["stored_bytes"]))
        out.print(t)
        return
    if is_artifact_target(r, run):
        artifact_log(repo=repo, name=run, as_json=as_json)
        return
    cps, damaged = _checkpoints(r, run)
    if not cps and not damaged:
        raise typer.Exit(not_found(f"run {run!r} has no checkpoints"))
    for step, why in damaged:
        err.print(f"[bold red]DAMAGED[/] step {step}: {escape(why)}", highlight=False)
    tiers = r.replication_status(run) if r.tier is not None else None  # tiered: local/replicating/replicated/…
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
    t = Table(title=f"checkpoints of {run}")
    for col in ("step", "time", "metrics", "logical", "written", "dedup") + (("tier",) if tiers is not None else ()):
        t.add_column(col, justify="left" if col in ("time", "metrics", "tier") else "right")
    for c in cps:
        t.add_row(str(c.step), c.created[:19], metrics_text(c.metrics), human(c.logical_bytes),
                  human(c.stored_bytes), ratio(c.dedup_ratio), *((tiers.get(c.step, "?"),) if tiers is not None
                                                                   else ()))
    out.print(t)
    if damaged:
        err.print(f"[bold red]{len(damaged)} damaged checkpoint(s)[/]; run `luopan verify -r {escape(repo)} "
                  f"{escape(run)}` for details")
        raise typer.Exit(3)


def _checkpoints(r: Repo, run: str) -> tuple[list[CheckpointInfo], list[tuple[int, str]]]:
    """A run's readable checkpoints, and (step, reason) for each whose manifest is damaged (listed, not fatal)."""
    infos, damaged = [], []
    for step in r.steps(run):
        try:
            infos.append(CheckpointInfo.from_manifest(r.manifest(run, step), manifest_key(run, step)))
        except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
            damaged.append((step, str(exc)))
    return infos, damaged


@app.command()
@handles_errors
def show(
    *,
    repo: RepoOpt = None,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[Optional[int], typer.Argument(help="Step; the latest when omitted.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one checkpoint: metadata, environment, code version and every entry. Without STEP, also the run's
    record (config, command line, packages, git commit and diff, environment with secrets redacted) and evals."""
    repo = repo_location(repo)
    r = open_repo(repo)
    m = r.manifest(run, step)
    doc = m.doc
    record = r.run(run).record() if step is None else None
    evals = r.run(run).evals() if step is None else []
    if as_json:
        emit_json({"run": m.run, "step": m.step, "created": m.created, "metrics": json_safe(m.metrics),
                    **({"record": record, "evals": evals} if step is None else {}),
                    "metadata": doc["metadata"], "environment": doc["environment"], "code": doc.get("code"),
                    "fingerprint": doc["fingerprint"], "stats": doc["stats"], "packs": len(m.packs),
                    "entries": [{k: e[k] for k in ("path", "kind", "dtype", "shape", "nbytes")}
                                | ({"chunks": len(e["chunks"])} if "chunks" in e else {"alias_of":
                                   m.entries[e["alias_of"]]["path"]})
                                | ({"delta": {"base_step": e["delta"]["base_step"], "rows": e["delta"]["rows"]}}
                                   if "delta" in e else {})
                                | ({"xor": {"base_step": e["xor"]["base_step"]}} if "xor" in e else {})
                                for e in m.entries]})
        return
    s = doc["stats"]
    if record is not None:
        _print_record(record, evals)
    out.print(f"[bold]{m.run}[/] step [bold]{m.step}[/]  created {m.created}")
    if m.metrics:
        out.print(f"metrics      {metrics_text(m.metrics)}")
    if doc["metadata"]:
        out.print(f"metadata     {json.dumps(doc['metadata'])}")
    env = doc["environment"]
    out.print("environment  " + " ".join(f"{k}={v}" for k, v in env.items()))
    if "code" in doc:
        out.print(f"code         {doc['code']['commit'][:12]}{' (dirty)' if doc['code']['dirty'] else ''}")
    out.print(f"fingerprint  {doc['fingerprint']}")
    out.print(f"size         {human(s['logical_bytes'])} logical, {human(s['stored_bytes'])} written by this save "
              f"({s['new_chunks']} of {s['chunks']} chunks new, {len(m.packs)} packs referenced)")
    t = Table()
    for col in ("entry", "kind", "dtype", "shape", "bytes", "chunks"):
        t.add_column(col, justify="right" if col in ("bytes", "chunks") else "left")
    for e in m.entries:
        chunks = str(len(e["chunks"])) if "chunks" in e else f"= {m.entries[e['alias_of']]['path']}"
        if "delta" in e:  # docs/format.md §5.2
            chunks += f" + {e['delta']['rows']} rows over step {e['delta']['base_step']}"
        elif "xor" in e:  # docs/format.md §5.4
            chunks += f" XOR over step {e['xor']['base_step']}"
        t.add_row(e["path"], e["kind"], e["dtype"], str(tuple(e["shape"])), human(e["nbytes"]), chunks)
    out.print(t)


def _print_record(rec: dict[str, Any], evals: list[int]) -> None:
    out.print(f"[bold]run {rec['run']}[/]  started {rec['created']}")
    out.print(f"command      {' '.join(rec['argv'])}  (in {rec['cwd']})")
    out.print(f"python       {rec['python']} on {rec['platform']}")
    out.print("packages     " + " ".join(f"{k}={v}" for k, v in rec["packages"].items()))
    git = rec.get("git")
    if git:
        diff_lines = git["diff"].count("\n")
        state = f"dirty: {diff_lines} diff lines recorded" if git["dirty"] else "clean"
        out.print(f"git          {git['commit'][:12]} ({state}"
                  + (f", {len(git['untracked_files'])} untracked files" if git["untracked_files"] else "") + ")")
    if rec.get("config") is not None:
        out.print("config       " + json.dumps(rec["config"], sort_keys=True))
    redacted = sorted(k for k, v in rec["environment"].items() if v == "<redacted>")
    out.print(f"environment  {len(rec['environment'])} variables" + (f" ({', '.join(redacted)} redacted)"
                                                                    if redacted else ""))
    if evals:
        out.print(f"evals        steps {', '.join(map(str, evals))}")
    out.print("")


@app.command()
@handles_errors
def diff(
    *,
    repo: RepoOpt = None,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step_a: Annotated[int, typer.Argument(help="Older step.")],
    step_b: Annotated[int, typer.Argument(help="Newer step.")],
    as_json: JsonOpt = False,
) -> None:
    """List the entries that changed between two checkpoints of RUN, and how many bytes differ."""
    repo = repo_location(repo)
    r = open_repo(repo)
    d = r.diff(run, step_a, step_b)
    if as_json:
        emit_json(json_safe(d))
        return
    t = Table(title=f"{run}: step {step_a} -> {step_b}")
    for col in ("change", "entry", "dtype", "shape", "bytes differing"):
        t.add_column(col, justify="right" if col == "bytes differing" else "left")
    for c in d["changed"]:
        what = "changed" if c["was"] is None else f"changed (was {c['was']['dtype']}{tuple(c['was']['shape'])})"
        size = f"= {c['tied_to']}" if c["tied_to"] else f"{human(c['changed_bytes'])} of {human(c['nbytes'])}"
        t.add_row(what, c["path"], c["dtype"], str(tuple(c["shape"])), size)
    for kind in ("added", "removed"):
        for c in d[kind]:
            t.add_row(kind, c["path"], c["dtype"], str(tuple(c["shape"])), human(c["nbytes"]))
    out.print(t)
    out.print(f"{len(d['changed'])} changed, {len(d['added'])} added, {len(d['removed'])} removed, "
              f"{d['unchanged']} unchanged; {human(d['changed_bytes'])} differ")


@app.command()
@handles_errors
def du(*, repo: RepoOpt = None, as_json: JsonOpt = False) -> None:
    """Logical size of all checkpoints and artifact versions vs physical size on storage."""
    repo = repo_location(repo)
    r = open_repo(repo)
    report_strays(r)
    d = r.du()
    ratio = d["logical_bytes"] / d["physical_bytes"] if d["physical_bytes"] else 0.0
    if as_json:
        emit_json({**d, "dedup_ratio": round(ratio, 4)})
        return
    arts = f" and {d['artifacts']} artifact version(s)" if d.get("artifacts") else ""
    out.print(f"{d['checkpoints']} checkpoint(s){arts}: {human(d['logical_bytes'])} logical, "
              f"{human(d['physical_bytes'])} on storage ({ratio:.1f}× dedup)")
    out.print(f"  packs {human(d['pack_bytes'])}, index {human(d['index_bytes'])}, "
              f"manifests {human(d['manifest_bytes'])}, refs {human(d['ref_bytes'])}")
