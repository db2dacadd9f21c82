"""``luopan stats``, ``check``, ``rm`` and ``latest`` (restic's stats/check/forget habits): what a repository holds
and costs, whether its structure (and some or all of its data) is sound, removing a run or one checkpoint, and a
run's newest step for scripts."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..checkpoint import ALL, CHECKPOINTS, Subset, remove
from ..checkpoint import check as check_repo
from ..errors import IntegrityError, StorageError, UnsupportedFormatError, UsageError
from ..format.names import check_run
from ..repo import Repo
from ..listing import dedup_words, describe, kind_counts, series_json
from ..repository.verify import manifest_chunk_refs
from .app import (
    DEDUP_DEFINITION,
    JsonOpt,
    app,
    dedup_ratio,
    dedup_text,
    emit_json,
    err,
    escape,
    human,
    not_found,
    opens_repo,
    out,
    report_strays,
    table,
)
from .grammar import RUN_REF, checkpoint_ref
from .kinds import other_kinds_table, print_kinds, print_storage


@app.command(help="What the repository holds, every kind (checkpoints, artifact versions, journals with a LangGraph "
             "saver's threads and checkpoints, index versions): logical size (what restoring them all would write), "
             "stored size (the distinct chunks they reference, as stored: compressed), dedup ratio — the totals "
             "`luopan du` shows —, a per-kind and a per-run breakdown (with the bytes only that run references: what "
             "`luopan rm RUN` then `luopan gc` would free), the other kinds' series, and the largest entries of each "
             "run's newest checkpoint. With RUN, that run's checkpoints only. " + DEDUP_DEFINITION)
@opens_repo
def stats(
    *,
    r: Repo,
    run: Annotated[Optional[str], typer.Argument(help="Run to count; every run when omitted.")] = None,
    top: Annotated[int, typer.Option("--top", min=0, max=1000, help="How many of the largest entries to list.")]
    = 10,
    as_json: JsonOpt = False,
) -> None:
    if run is not None:
        check_run(run)
    report_strays(r, run)
    runs = [run] if run is not None else r.runs()
    if run is not None and not r.steps(run):
        raise typer.Exit(not_found(f"run {run!r} has no checkpoints"))
    chunk_runs: dict[str, set[str]] = {}  # stored chunk -> runs referencing it
    chunk_len: dict[str, int] = {}
    per_run: list[dict[str, Any]] = []
    largest: list[dict[str, Any]] = []
    damaged: list[str] = []
    for name in (r.runs() if run is not None else runs):  # exclusive bytes need every run's chunks
        counted = name in runs
        row = {"run": name, "checkpoints": 0, "logical_bytes": 0, "latest_step": None}
        newest = None
        for step in r.steps(name):
            try:
                m = r.manifest(name, step)
                refs = list(manifest_chunk_refs(CHECKPOINTS, name, step, m.doc))
            except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
                if counted:
                    damaged.append(str(exc))
                continue
            for ref in refs:
                key = f"{ref.hash}/{ref.pack}/{ref.offset}"
                chunk_runs.setdefault(key, set()).add(name)
                chunk_len[key] = ref.length
            if counted:
                row["checkpoints"] += 1
                row["logical_bytes"] += m.stats["logical_bytes"]
                row["latest_step"] = step
                newest = m
        if counted:
            per_run.append(row)
            if newest is not None:
                largest += [{"run": name, "step": newest.step, "path": e["path"], "dtype": e["dtype"],
                             "shape": list(e["shape"]), "nbytes": e["nbytes"]}
                            for e in newest.entries if "alias_of" not in e]
    for row in per_run:
        mine = [k for k, users in chunk_runs.items() if row["run"] in users]
        row["stored_bytes"] = sum(chunk_len[k] for k in mine)
        row["exclusive_bytes"] = sum(chunk_len[k] for k in mine if len(chunk_runs[k]) == 1)
        row["dedup_ratio"] = dedup_ratio(row["logical_bytes"], row["stored_bytes"])
    selected = [k for k, users in chunk_runs.items() if users & set(runs)]
    logical = sum(row["logical_bytes"] for row in per_run)
    stored = sum(chunk_len[k] for k in selected)
    largest = sorted(largest, key=lambda e: (-e["nbytes"], e["run"], e["path"]))[:top]
    doc: dict[str, Any] = {"run": run, "checkpoints": sum(row["checkpoints"] for row in per_run),
                           "logical_bytes": logical, "stored_bytes": stored, "chunks": len(selected),
                           "dedup_ratio": dedup_ratio(logical, stored),
                           "runs": per_run, "largest_entries": largest, "damaged": damaged}
    if run is None:  # the whole repository: every kind, the totals `du` shows (one walk, repository.usage)
        h = describe(r)
        d = h.totals
        doc.update({"logical_bytes": d["logical_bytes"], "stored_bytes": d["stored_bytes"], "chunks": d["chunks"],
                    "dedup_ratio": dedup_ratio(d["logical_bytes"], d["stored_bytes"]), "kinds": h.kinds,
                    "series": [series_json(s) for s in h.series if s.kind != "checkpoint"]})
        doc["repository"] = {**d, "dedup_ratio": doc["dedup_ratio"]}
        only = {s.series: s.exclusive_bytes for s in h.series if s.kind == "checkpoint"}
        for row in per_run:  # what `rm RUN` then `gc` frees: chunks no other series of any kind references
            row["exclusive_bytes"] = only.get(row["run"], row["exclusive_bytes"])
        logical, stored, selected = d["logical_bytes"], d["stored_bytes"], range(d["chunks"])
    if as_json:
        emit_json(doc)
        if damaged:
            raise typer.Exit(3)
        return
    what = f"run {run}: {doc['checkpoints']} checkpoint(s)" if run is not None else \
        f"{r.store.describe()}: {kind_counts(h)}"
    out.print(f"{what}, {human(logical)} logical, {human(stored)} stored in {len(selected)} distinct chunk(s) "
              f"({dedup_words(logical, stored)})", highlight=False, markup=False)
    if run is None:
        print_storage(doc["repository"])
        if len(h.kinds) > 1:
            print_kinds(h)
    if per_run:
        t = table(title="per run")
        for col in ("run", "checkpoints", "latest step", "logical", "stored", "only this run", "dedup"):
            t.add_column(col, justify="left" if col == "run" else "right")
        for row in per_run:
            t.add_row(row["run"], str(row["checkpoints"]), str(row["latest_step"]),
                      human(row["logical_bytes"]), human(row["stored_bytes"]), human(row["exclusive_bytes"]),
                      dedup_text(row["dedup_ratio"]))
        out.print(t)
    others = [s for s in h.series if s.kind != "checkpoint"] if run is None else []
    if others:
        other_kinds_table(others, "artifacts, journals and indexes")
    if largest:
        t = table(title="largest entries (newest checkpoint of each run)")
        for col in ("run", "step", "entry", "dtype", "shape", "bytes"):
            t.add_column(col, justify="right" if col in ("step", "bytes") else "left")
        for e in largest:
            t.add_row(e["run"], str(e["step"]), e["path"], e["dtype"], str(tuple(e["shape"])),
                      human(e["nbytes"]))
        out.print(t)
    if damaged:
        for why in damaged:
            err.print(f"[bold red]DAMAGED[/] {escape(why)}", highlight=False)
        err.print(f"[bold red]{len(damaged)} damaged checkpoint(s)[/] not counted; `luopan check` for details")
        raise typer.Exit(3)


@app.command()
@opens_repo
def check(
    *,
    r: Repo,
    read_data_subset: Annotated[Optional[str], typer.Option(
        "--read-data-subset", metavar="PCT|N/M",
        help="Also read and hash-check part of the data: a random percentage of the chunks (10%, 0.5%), or group N "
             "of M groups of packs (1/5 … 5/5 together cover everything).")] = None,
    read_data: Annotated[bool, typer.Option("--read-data", help="Also read and hash-check every chunk (as "
                                            "`luopan verify`).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the repository's structure: every manifest parses and validates, every pack it names exists with an
    intact trailer listing its chunks, index files parse and name existing packs, records, refs and pins parse and
    point at committed manifests. Data is read only when asked. Exit 3 naming every problem."""
    if read_data and read_data_subset is not None:
        raise UsageError("give --read-data (everything) or --read-data-subset (a part), not both")
    subset = ALL if read_data else Subset.parse(read_data_subset) if read_data_subset is not None else None
    if subset is None or as_json or not err.is_terminal:  # a bar only where someone watches it
        rep = check_repo(r.checkpointing, subset)
    else:
        with Progress(TextColumn("reading data"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err, transient=True) as bar:
            task = bar.add_task("check", total=None)
            rep = check_repo(r.checkpointing, subset, progress=lambda n: bar.advance(task, n),
                             on_total=lambda n: bar.update(task, total=n))
    if as_json:
        emit_json(rep.to_json())
    else:
        for p in rep.problems:
            err.print(f"[bold red]DAMAGED[/] {escape(str(p))}", highlight=False)
        for note in rep.notes:
            out.print(f"note: {escape(note)}", highlight=False)
        data = ("structure only (--read-data-subset 10% or --read-data also reads the data)" if subset is None else
                f"{rep.chunks_read} of {rep.chunks} chunk(s) read and hash-checked ({human(rep.bytes_read)}, "
                f"{'all' if subset is ALL else subset.text})")
        summary = (f"{rep.manifests} manifest(s), {rep.packs} pack(s), {rep.chunks} chunk(s), {rep.index_files} "
                   f"index file(s); {data}")
        if rep.problems:
            err.print(f"[bold red]{len(rep.problems)} problem(s) found[/] in {summary}", highlight=False)
        else:
            out.print(f"[green]ok[/]: {summary}", highlight=False)
    if rep.problems:
        raise typer.Exit(3)


@app.command("rm")
@opens_repo
def rm(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar=RUN_REF, help="The run to remove (every checkpoint, its record and "
                                                             "evals), or one checkpoint of it as RUN@STEP.")],
    legacy_step: Annotated[Optional[int], typer.Option("--step", min=0, hidden=True,
                                                       help="Deprecated: give RUN@STEP.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove pinned checkpoints too (and their pins).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove a run, or one checkpoint of it (RUN@STEP). Pinned checkpoints are refused unless --force. Removal
    deletes manifests (the run's `latest` ref stays pointing at a checkpoint that exists); the data only they used
    is freed by a later `luopan gc`. Safe to interrupt: run it again to finish."""
    run, step = checkpoint_ref(ref, legacy_step, "rm", old="RUN --step STEP", quiet=as_json)
    done = remove(r.checkpointing, run, step, force=force, dry_run=dry_run)
    if as_json:
        emit_json(done.to_json())
        return
    verb = "would remove" if dry_run else "removed"
    steps = ", ".join(map(str, done.steps[:20])) + (" …" if len(done.steps) > 20 else "")
    what = (f"run {run} ({len(done.steps)} checkpoint(s){': steps ' + steps if done.steps else ''})"
            if done.whole_run else f"{run} step {step}")
    pinned = f", {len(done.pinned)} of them pinned (--force)" if done.pinned else ""
    out.print(f"{verb} {what}{pinned}", highlight=False, markup=False)
    if dry_run:
        out.print("dry run: nothing removed", highlight=False)
    else:
        out.print("the data only they used is freed by a later `luopan gc`", highlight=False)


@app.command()
@opens_repo
def latest(
    *,
    r: Repo,
    run: Annotated[str, typer.Argument(help="Run name.")],
    as_json: JsonOpt = False,
) -> None:
    """Print the newest committed step of RUN (for scripts: STEP=$(luopan latest RUN)); exit 4 if it has none."""
    steps = r.steps(run)
    if not steps:
        raise typer.Exit(not_found(r.checkpointing._no_checkpoint(run)))
    if as_json:
        emit_json({"run": run, "step": steps[-1], "checkpoints": len(steps)})
        return
    out.print(str(steps[-1]), highlight=False)
