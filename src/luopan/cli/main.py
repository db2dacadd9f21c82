"""``luopan`` CLI: init, ls, show, verify, du, export, diff, prune, pin, gc, locks, unlock, plan. The repository comes from ``-r/--repo`` or ``LUOPAN_REPO``.

Exit codes: 0 ok, 1 user error, 2 usage (bad flags), 3 damaged data found, 4 not found, 5 newer format.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .. import checkpoint as _checkpoint  # noqa: F401  (package import order)
from .. import plan as _plan
from ..checkpoint.repo import CheckpointInfo, Repo, init as repo_init, open as repo_open
from ..format import FORMAT_VERSION
from ..format.names import manifest_key
from ..errors import IntegrityError, LuopanError, StorageError, UnsupportedFormatError

app = typer.Typer(
    name="luopan",
    help="luopan (落盘): atomic, verified, incremental checkpoints for AI runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True, soft_wrap=True)

RepoOpt = Annotated[
    str,
    typer.Option("--repo", "-r", envvar="LUOPAN_REPO", help="Repository path or URL (or set LUOPAN_REPO).",
                 show_envvar=True),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]

F = TypeVar("F", bound=Callable[..., Any])


def _handles_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LuopanError as exc:
            err.print(f"[bold red]error:[/] {_escape(str(exc))}", highlight=False, markup=True)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:  # a system error no luopan type names (e.g. writing the output): one line, exit 1
            err.print(f"[bold red]error:[/] {_escape(str(exc))}", highlight=False, markup=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _open(repo: str) -> Repo:
    return repo_open(repo, create=False, replicate=False)  # a tiered repo: reads fall back, no replication here


def _escape(text: str) -> str:
    """Text for rich markup: user-controlled names must not be read as [style] tags."""
    from rich.markup import escape

    return escape(text)


def _report_strays(r: Repo, run: str | None = None) -> None:
    """A line on stderr when the repository holds entries that are not luopan's (skipped by every command), and one
    when part of it cannot be read (a dangling link, an unreadable directory: checkpoints there are not seen)."""
    strays = r.strays(run)
    for unreadable, what in ((True, "cannot be read (checkpoints there are not listed, and gc will not run)"),
                             (False, "are not luopan's and were skipped")):
        group = [s for s in strays if s.unreadable == unreadable]
        if group:
            shown = "; ".join(str(s) for s in group[:3]) + (f"; … {len(group) - 3} more" if len(group) > 3 else "")
            err.print(f"[yellow]note:[/] {len(group)} entr{'y' if len(group) == 1 else 'ies'} {what}: "
                      f"{_escape(shown)} (`luopan verify` lists them)", highlight=False)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.1f}×"


def _json_ratio(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 4)


def _metrics_text(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return None
    raise TypeError(type(o).__name__)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


@app.command()
@_handles_errors
def init(
    repo: RepoOpt,
    compression: Annotated[str, typer.Option(help="Blob compression: none, zstd or zstd:LEVEL.")] = "none",
    chunk_size: Annotated[Optional[int], typer.Option(help="Chunk size in bytes (default 4 MiB).")] = None,
    pack_size: Annotated[Optional[int], typer.Option(help="Target pack size in bytes (default 64 MiB).")] = None,
) -> None:
    """Create a new, empty repository."""
    r = repo_init(repo, compression=compression, chunk_size=chunk_size, pack_size=pack_size)
    c = r.config
    out.print(f"created luopan repository at [bold]{r.store.describe()}[/] "
              f"(format {c.format_version}, chunks {human(c.chunk_size)}, packs {human(c.pack_size)}, "
              f"compression {c.compression.codec})")


@app.command("ls")
@_handles_errors
def ls(
    repo: RepoOpt,
    run: Annotated[Optional[str], typer.Argument(help="Run to list checkpoints of; all runs when omitted.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, or the checkpoints of RUN with sizes, bytes newly written and dedup ratio."""
    r = _open(repo)
    if run is None:
        _report_strays(r)
        rows = []
        for name in r.runs():
            cps, damaged = _checkpoints(r, name)
            last = cps[-1] if cps else None
            rows.append({"run": name, "checkpoints": len(cps), "damaged": len(damaged),
                         "latest_step": last.step if last else None, "latest_time": last.created if last else "",
                         "logical_bytes": sum(c.logical_bytes for c in cps),
                         "stored_bytes": sum(c.stored_bytes for c in cps)})
        if as_json:
            _emit_json({"runs": rows})
            return
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
    cps, damaged = _checkpoints(r, run)
    if not cps and not damaged:
        raise typer.Exit(_not_found(f"run {run!r} has no checkpoints"))
    for step, why in damaged:
        err.print(f"[bold red]DAMAGED[/] step {step}: {_escape(why)}", highlight=False)
    tiers = r.replication_status(run) if r.tier is not None else None  # tiered: local/replicating/replicated/…
    if as_json:
        _emit_json({"run": run, "damaged": [{"step": s, "error": w} for s, w in damaged], "checkpoints": [
            {"step": c.step, "created": c.created, "metrics": _json_safe(c.metrics),
             "logical_bytes": c.logical_bytes, "new_bytes": c.new_bytes, "stored_bytes": c.stored_bytes,
             "chunks": c.chunks, "new_chunks": c.new_chunks, "dedup_ratio": _json_ratio(c.dedup_ratio),
             "fingerprint": c.fingerprint, **({"tier": tiers.get(c.step)} if tiers is not None else {})}
            for c in cps]})
        if damaged:
            raise typer.Exit(3)
        return
    t = Table(title=f"checkpoints of {run}")
    for col in ("step", "time", "metrics", "logical", "written", "dedup") + (("tier",) if tiers is not None else ()):
        t.add_column(col, justify="left" if col in ("time", "metrics", "tier") else "right")
    for c in cps:
        t.add_row(str(c.step), c.created[:19], _metrics_text(c.metrics), human(c.logical_bytes),
                  human(c.stored_bytes), _ratio(c.dedup_ratio), *((tiers.get(c.step, "?"),) if tiers is not None
                                                                   else ()))
    out.print(t)
    if damaged:
        err.print(f"[bold red]{len(damaged)} damaged checkpoint(s)[/]; run `luopan verify -r {_escape(repo)} "
                  f"{_escape(run)}` for details")
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


def _not_found(msg: str) -> int:
    err.print(f"[bold red]error:[/] {msg}")
    return 4


@app.command()
@_handles_errors
def show(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[Optional[int], typer.Argument(help="Step; the latest when omitted.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one checkpoint: metadata, environment, code version and every entry. Without STEP, also the run's
    record (config, command line, packages, git commit and diff, environment with secrets redacted) and evals."""
    r = _open(repo)
    m = r.manifest(run, step)
    doc = m.doc
    record = r.run(run).record() if step is None else None
    evals = r.run(run).evals() if step is None else []
    if as_json:
        _emit_json({"run": m.run, "step": m.step, "created": m.created, "metrics": _json_safe(m.metrics),
                    **({"record": record, "evals": evals} if step is None else {}),
                    "metadata": doc["metadata"], "environment": doc["environment"], "code": doc.get("code"),
                    "fingerprint": doc["fingerprint"], "stats": doc["stats"], "packs": len(m.packs),
                    "entries": [{k: e[k] for k in ("path", "kind", "dtype", "shape", "nbytes")}
                                | ({"chunks": len(e["chunks"])} if "chunks" in e else {"alias_of":
                                   m.entries[e["alias_of"]]["path"]})
                                | ({"delta": {"base_step": e["delta"]["base_step"], "rows": e["delta"]["rows"]}}
                                   if "delta" in e else {}) for e in m.entries]})
        return
    s = doc["stats"]
    if record is not None:
        _print_record(record, evals)
    out.print(f"[bold]{m.run}[/] step [bold]{m.step}[/]  created {m.created}")
    if m.metrics:
        out.print(f"metrics      {_metrics_text(m.metrics)}")
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
@_handles_errors
def verify(
    repo: RepoOpt,
    run: Annotated[Optional[str], typer.Argument(help="Run to verify; all runs when omitted.")] = None,
    step: Annotated[Optional[int], typer.Argument(help="Step to verify; all steps of RUN when omitted.")] = None,
) -> None:
    """Read every byte of the selected checkpoints and check every hash. Exit 3 and name the damage if any."""
    r = _open(repo)
    with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task("verify", total=None)
        try:
            report = r.verify(run, step, progress=lambda n: bar.advance(task, n),
                              on_total=lambda n: bar.update(task, total=n))
        except IntegrityError as exc:
            bar.stop()
            problems = getattr(exc, "problems", [exc])
            report = getattr(exc, "report", None)
            for s in (report.strays if report is not None else []):
                err.print(f"[yellow]not luopan's[/] (skipped) {_escape(str(s))}", highlight=False)
            for p in problems:
                err.print(f"[bold red]DAMAGED[/] {_escape(str(p))}", highlight=False)
            err.print(f"[bold red]{len(problems)} problem(s) found[/]; undamaged checkpoints stay loadable "
                      "(run `luopan verify RUN STEP` to check one)")
            raise typer.Exit(3) from None
    for s in report.strays:
        err.print(f"[yellow]not luopan's[/] (skipped) {_escape(str(s))}", highlight=False)
    out.print(f"[green]ok[/]: {report.checkpoints} checkpoint(s), {report.chunks} chunks, "
              f"{human(report.bytes)} read and verified"
              + (f"; {len(report.strays)} entr{'y' if len(report.strays) == 1 else 'ies'} that "
                 f"{'is' if len(report.strays) == 1 else 'are'} not luopan's skipped" if report.strays else ""))


@app.command()
@_handles_errors
def export(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[Optional[int], typer.Argument(help="Step; the latest when omitted.")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="safetensors file to write.")] = "model.safetensors",
    subtree: Annotated[Optional[str], typer.Option(help="Export only the tensors under this key path, e.g. model.")]
    = None,
) -> None:
    """Write a checkpoint (or one subtree, e.g. the model weights) to a single safetensors file."""
    r = _open(repo)
    m = r.manifest(run, step)
    with Progress(TextColumn("exporting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task("export", total=m.stats["logical_bytes"])
        info = r.export(run, output, m.step, subtree=subtree, progress=lambda n: bar.advance(task, n))
    out.print(f"wrote {info['tensors']} tensors ({human(info['bytes'])}) of {run} step {m.step} to {info['path']}")


@app.command()
@_handles_errors
def diff(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step_a: Annotated[int, typer.Argument(help="Older step.")],
    step_b: Annotated[int, typer.Argument(help="Newer step.")],
    as_json: JsonOpt = False,
) -> None:
    """List the entries that changed between two checkpoints of RUN, and how many bytes differ."""
    r = _open(repo)
    d = r.diff(run, step_a, step_b)
    if as_json:
        _emit_json(_json_safe(d))
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
@_handles_errors
def du(repo: RepoOpt, as_json: JsonOpt = False) -> None:
    """Logical size of all checkpoints vs physical size on storage."""
    r = _open(repo)
    _report_strays(r)
    d = r.du()
    ratio = d["logical_bytes"] / d["physical_bytes"] if d["physical_bytes"] else 0.0
    if as_json:
        _emit_json({**d, "dedup_ratio": round(ratio, 4)})
        return
    out.print(f"{d['checkpoints']} checkpoint(s): {human(d['logical_bytes'])} logical, "
              f"{human(d['physical_bytes'])} on storage ({ratio:.1f}× dedup)")
    out.print(f"  packs {human(d['pack_bytes'])}, index {human(d['index_bytes'])}, "
              f"manifests {human(d['manifest_bytes'])}, refs {human(d['ref_bytes'])}")


@app.command()
@_handles_errors
def prune(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run to prune.")],
    keep_last: Annotated[Optional[str], typer.Option("--keep-last", metavar="N",
                                                     help="Keep the N newest checkpoints.")] = None,
    keep_best: Annotated[list[str], typer.Option("--keep-best", metavar="N:METRIC[:min|max]",
                                                 help="Keep the N best by a metric (repeatable), e.g. 3:loss:min.")] = [],  # noqa: B006
    keep_every: Annotated[list[str], typer.Option("--keep-every", metavar="DURATION",
                                                  help="Keep the newest checkpoint of each period, e.g. 24h, 7d "
                                                       "(UTC-aligned buckets; repeatable).")] = [],  # noqa: B006
    keep_every_steps: Annotated[list[str], typer.Option("--keep-every-steps", metavar="N",
                                                        help="Keep the newest checkpoint of each N steps.")] = [],  # noqa: B006
    keep_tag: Annotated[list[str], typer.Option("--keep-tag", metavar="TAG",
                                                help="Keep checkpoints pinned with this tag (repeatable).")] = [],  # noqa: B006
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove checkpoints a retention policy does not keep. The newest and pinned checkpoints always stay.

    Categories are separate, each with its own count (restic-style): a checkpoint stays if any rule keeps it.
    Removing deletes manifests only; run `luopan gc` to free the space of data nothing references any more.
    """
    from ..retention import rules_from_flags

    try:
        rules = rules_from_flags(keep_last=keep_last, keep_best=keep_best, keep_every=keep_every,
                                 keep_every_steps=keep_every_steps, keep_tag=keep_tag)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        decided = _open(repo).prune(run, rules, dry_run=dry_run)
    except ValueError as exc:
        if isinstance(exc, LuopanError):
            raise
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        _emit_json({"run": run, "dry_run": dry_run, "keep": {str(k): v for k, v in decided.keep.items()},
                    "remove": decided.remove})
        return
    for line in decided.describe():
        out.print(line, highlight=False)
    if dry_run:
        out.print("dry run: nothing removed")


@app.command()
@_handles_errors
def pin(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[int, typer.Argument(help="Step of the checkpoint to protect.")],
    tag: Annotated[Optional[str], typer.Option("--tag", help="A name for the pin, e.g. release-1.")] = None,
) -> None:
    """Protect a checkpoint: `luopan prune` never removes a pinned checkpoint."""
    _open(repo).run(run).pin(step, tag)
    out.print(f"pinned {run} step {step}" + (f" as {tag!r}" if tag else ""))


@app.command()
@_handles_errors
def unpin(
    repo: RepoOpt,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[int, typer.Argument(help="Step to unpin.")],
) -> None:
    """Remove a checkpoint's pin (the checkpoint itself stays until a prune removes it)."""
    if _open(repo).run(run).unpin(step):
        out.print(f"unpinned {run} step {step}")
    else:
        raise typer.Exit(_not_found(f"run {run!r} step {step} is not pinned"))


def _grace(text: str) -> float:
    from ..retention import parse_duration

    zero = text.strip().lower().rstrip("smhdw")
    try:
        if zero and float(zero) == 0:
            return 0.0
    except ValueError:
        pass
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
@_handles_errors
def gc(
    repo: RepoOpt,
    grace: Annotated[str, typer.Option("--grace", metavar="DURATION",
                                       help="How long unreferenced data is kept condemned before it is deleted "
                                            "(e.g. 1h, 30m; 0 deletes in this run: only when nothing else is "
                                            "reading the repository).")] = "1h",
    repack_below: Annotated[float, typer.Option("--repack-below", min=0.0, max=1.0, metavar="FRACTION",
                                                help="Rewrite packs whose live data fills less than this fraction "
                                                     "(0 disables repacking).")] = 0.5,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what gc would do; change nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Free the space of data no checkpoint references (after `luopan prune`), and repack mostly-dead packs.

    Two-phase, like restic prune: unreferenced packs are first condemned, then deleted by a later gc run once the
    grace period has passed and they are still unreferenced (so a process reading an old checkpoint is not cut
    off). Takes the repository's exclusive lock: saves wait for gc to finish. Safe to interrupt at any point.
    """
    seconds = _grace(grace)
    r = _open(repo)
    _report_strays(r)
    if as_json:
        rep = r.gc(grace=seconds, repack_below=repack_below, dry_run=dry_run)
        _emit_json(rep.to_json())
        return
    with err.status("gc: marking") as status:
        rep = r.gc(grace=seconds, repack_below=repack_below, dry_run=dry_run,
                   progress=lambda msg: status.update(f"gc: {msg}"))
    would = "would " if dry_run else ""
    out.print(f"{rep.manifests} checkpoint(s) reference {rep.live_packs} of {rep.packs} pack(s) "
              f"({human(rep.live_bytes)} live of {human(rep.pack_bytes)})", highlight=False)
    if rep.stray_manifests:
        out.print(f"{rep.stray_manifests} manifest(s) in run directories that are not luopan's (see `luopan verify`): "
                  "the data they name is kept", highlight=False)
    if rep.repacked_packs:
        out.print(f"{would}repack {rep.repacked_packs} pack(s) ({human(rep.repacked_bytes)}): copied "
                  f"{human(rep.copied_bytes)} live data, rewrote {rep.manifests_rewritten} manifest(s)",
                  highlight=False)
    out.print(f"{would}delete {rep.deleted_packs} pack(s), freeing {human(rep.deleted_bytes)}", highlight=False)
    if rep.condemned_packs:
        from datetime import datetime, timezone

        when = datetime.fromtimestamp(rep.next_sweep_after or 0, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        out.print(f"{rep.condemned_packs} unreferenced pack(s) ({human(rep.condemned_bytes)}) {would}wait for the "
                  f"grace period: a gc run after {when} deletes them (or --grace 0 when nothing else reads the "
                  "repository)", highlight=False)
    if rep.young_packs:
        out.print(f"{rep.young_packs} unreferenced pack(s) younger than the grace period left alone (a save may "
                  "be writing them)", highlight=False)
    for skipped in rep.skipped_repacks:
        out.print(f"[yellow]not repacked[/] (damaged; run `luopan verify`): {skipped}", highlight=False)
    if dry_run:
        out.print("dry run: nothing changed")


@app.command()
@_handles_errors
def locks(repo: RepoOpt, as_json: JsonOpt = False) -> None:
    """List the repository's locks: saves hold shared ones, prune and gc an exclusive one."""
    from ..locks import list_locks

    recs = list_locks(_open(repo).store)
    if as_json:
        _emit_json([r.to_json() for r in recs])
        return
    if not recs:
        out.print("no locks")
    for rec in recs:
        reason = rec.stale_reason()
        out.print(rec.describe() + (f" [yellow](stale: {reason})[/]" if reason else ""), highlight=False)


@app.command()
@_handles_errors
def unlock(
    repo: RepoOpt,
    remove_all: Annotated[bool, typer.Option("--all", help="Remove every lock, not only stale ones: only when you "
                                                           "know no luopan process uses the repository.")] = False,
) -> None:
    """Remove stale locks (their process is gone, or they were not refreshed for 30 min)."""
    from ..locks import break_locks

    removed = break_locks(_open(repo).store, stale_only=not remove_all)
    for rec in removed:
        out.print(f"removed {rec.describe()}", highlight=False)
    out.print(f"{len(removed)} lock(s) removed")


def _plan_arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a `luopan.plan` parser so its PlanInputError becomes a usage error (exit 2) with its message."""
    def convert(text: Any) -> Any:
        if not isinstance(text, str):  # already converted (defaults, repeated conversion)
            return text
        try:
            return parse(text)
        except _plan.PlanInputError as exc:
            raise typer.BadParameter(str(exc)) from None
    return convert


@app.command(help="\n\n".join((
    "Checkpoint cost table: size, time per save, overhead at intervals, Young/Daly interval; full vs incremental.",
    "Decimal units like the reference article (1 GB = 10^9 bytes, 1 MB/s = 10^6 bytes/s). Size = parameters × "
    "(weight bytes + fp32 master copy if --master-weights fp32 + fp32 optimizer state); gradients are not counted. "
    "Time per save C = size / bandwidth; save overhead at interval T = C/T. With --mtbf M: Young/Daly interval "
    "T* = sqrt(2·C·M) and the expected overhead C/T + T/(2·M) (save time + half an interval of work lost per "
    "failure). Incremental (--lora-fraction f): each save rewrites only the f × params trainable weights and their "
    "optimizer state; the frozen base weights are written once.",
    "The defaults (bf16 weights + two fp32 Adam moments, no master copy: 10 B/param) are the article's "
    "configuration: `luopan plan --params 7B --params 70B --bandwidth 500MB/s --interval 2h --interval 4h` gives "
    "70 GB / 140 s / 1.9% for 7B (the article itemises 14 + 56 GB, then rounds up to ~80 GB / ~160 s / ~2.2% for "
    "unquantified \"gradients and misc\") and 700 GB / 1,400 s for 70B, as the article.")))
@_handles_errors
def plan(
    params: Annotated[list[float], typer.Option(
        "--params", parser=_plan_arg(_plan.parse_count), metavar="N", show_default=False,
        help="Model size; repeat for several: --params 7B --params 70B (also 350M, 1.5e9).")],
    weights: Annotated[Literal["bf16", "fp16", "fp32"], typer.Option(
        help="Weight dtype: bf16/fp16 2 B, fp32 4 B per parameter.")] = "bf16",
    optimizer: Annotated[Literal["adam", "sgd-momentum", "sgd", "none"], typer.Option(
        help="Optimizer state, fp32: adam 2 moments (8 B), sgd-momentum 1 buffer (4 B), sgd/none 0 B.")] = "adam",
    master_weights: Annotated[Literal["none", "fp32"], typer.Option(
        help="fp32 master copy of bf16/fp16 weights (4 B), as DeepSpeed/Megatron keep. The article does not "
             "count one: leave it at none to reproduce it.")] = "none",
    bandwidth: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_rate), metavar="RATE", show_default=False,
        help="Write bandwidth, e.g. 500MB/s or 1GB/s (decimal; MiB/s, GiB/s binary).")] = None,
    probe: Annotated[Optional[str], typer.Option(
        metavar="DIR", help="Measure the bandwidth instead: an fsync'd write of a temporary file in DIR "
                            "(removed afterwards).")] = None,
    probe_size: Annotated[int, typer.Option(parser=_plan_arg(_plan.parse_bytes), metavar="SIZE",
                                            help="Bytes the probe writes, e.g. 256MiB or 1GB.")]
    = "256MiB",  # type: ignore[assignment]  (parsed by the parser, like a typed value)
    interval: Annotated[Optional[list[float]], typer.Option(
        parser=_plan_arg(_plan.parse_duration), metavar="DURATION", show_default=False,
        help="Save interval; repeat for several: --interval 2h --interval 30m (s, m, h, d). Default 2h.")] = None,
    mtbf: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_duration), metavar="DURATION", show_default=False,
        help="Mean time between failures, e.g. 24h: adds the Young/Daly interval sqrt(2*C*MTBF).")] = None,
    lora_fraction: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_fraction), metavar="FRACTION", show_default=False,
        help="Trainable fraction of the parameters (LoRA), e.g. 0.01 or 1%: adds the incremental column.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Checkpoint cost table (the help text is above; the arithmetic lives in `luopan.plan`)."""
    if (bandwidth is None) == (probe is None):
        raise typer.BadParameter("give --bandwidth RATE (e.g. 500MB/s) or --probe DIR"
                                 + (", not both" if probe else ""), param_hint="--bandwidth / --probe")
    intervals = interval or [7200.0]
    accounting = _plan.Accounting(weights, optimizer, master_weights)
    measured = None
    if probe is not None:
        _plan.check_probe_dir(probe)  # before the progress bar starts
        with Progress(TextColumn(f"probing {probe}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("probe", total=probe_size)
            measured = _plan.probe_bandwidth(probe, probe_size, progress=lambda n: bar.advance(task, n))
        bandwidth = measured.bytes_per_second
    assert bandwidth is not None
    plans = [_plan.plan_model(p, accounting, bandwidth, intervals, mtbf, lora_fraction) for p in params]
    source = ("given" if measured is None else
              f"measured: {human(measured.nbytes)} written + fsync'd in {measured.path} "
              f"in {measured.seconds:.2f} s")
    if as_json:
        _emit_json({"units": "decimal: 1 GB = 1e9 bytes, 1 MB/s = 1e6 bytes/s",
                    "accounting": {"weights": weights, "optimizer": optimizer, "master_weights": master_weights,
                                   "bytes_per_param": accounting.bytes_per_param(), "gradients": False},
                    "bandwidth_bytes_per_s": bandwidth,
                    "probe": None if measured is None else {"path": measured.path, "bytes": measured.nbytes,
                                                             "seconds": measured.seconds},
                    "intervals_s": intervals, "mtbf_s": mtbf, "lora_fraction": lora_fraction,
                    "models": [p.to_json() for p in plans]})
        return
    out.print("units: decimal (1 GB = 10^9 B, 1 MB/s = 10^6 B/s), as in the reference article")
    out.print(f"per parameter: {accounting.describe()}; gradients not counted", highlight=False)
    out.print(f"bandwidth: {bandwidth / 1e6:,.0f} MB/s ({source})", highlight=False)
    for p in plans:
        t = Table(title=f"{_plan.format_count(p.params)} parameters", title_justify="left")
        t.add_column("")
        for header in p.columns():
            t.add_column(header, justify="right")
        for label, cells in p.rows():
            t.add_row(label, *cells)
        out.print(t)
    out.print("save overhead = C/T (C = time per save, T = interval)"
              + ("; expected overhead = C/T + T/(2·MTBF), save time plus half an interval of work lost per "
                 "failure; Young/Daly T = sqrt(2·C·MTBF)" if mtbf is not None else ""), style="dim")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        out.print(f"luopan {__version__} (reads repository formats 1-{FORMAT_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """luopan (落盘): atomic, verified, incremental checkpoints for AI runs.

    Exit codes: 0 ok, 1 error, 2 usage, 3 damaged data, 4 not found, 5 repository newer than this luopan.
    """
    warnings.showwarning = _show_warning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """Warnings as one line on stderr (``warning: …``), not Python's two-line form with a source line."""
    err.print(f"[yellow]warning:[/] {_escape(str(message))}", highlight=False)


def main() -> None:
    app()


from . import tier as _tier_commands  # noqa: E402,F401  (registers `replicate` and `cold` on app)

if __name__ == "__main__":
    main()
