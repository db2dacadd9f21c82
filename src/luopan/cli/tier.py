"""``luopan replicate`` and ``luopan cold``: the tiered-storage commands (docs/format.md §10.2).

A tiered repository records its remote (and cold policy) in ``<repo>/tier/config.json``, so every command opens it
as tiered without flags: ``luopan ls -r ckpts RUN`` shows each checkpoint's tier, ``luopan show``/``export`` read
evicted checkpoints from the remote. Both commands cover every kind (checkpoints and artifact versions).
Registered on the app by importing this module (luopan.cli.main does).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..repo import open as repo_open
from ..repository.tiersetup import ColdPolicy
from ..retention import KeepLast, parse_keep_last
from ..units import parse_duration
from .app import RepoOpt, app, emit_json, err, escape, handles_errors, out, repo_location


@app.command()
@handles_errors
def replicate(
    *,
    repo: RepoOpt = None,
    to: Annotated[Optional[str], typer.Option(
        "--to", help="Remote URL or path to replicate to (recorded in the repository; needed the first time).")] = None,
    keep_local: Annotated[Optional[str], typer.Option(
        "--keep-local", metavar="N",
        help="After replicating, keep only the newest N checkpoints of each run (versions of each artifact) "
             "locally, plus pinned ones; only those confirmed on the remote are evicted.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Give up waiting after this many seconds.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
) -> None:
    """Replicate every local checkpoint and artifact version the remote lacks (resuming interrupted replication) and
    wait for it."""
    repo = repo_location(repo)
    try:
        rules: KeepLast | None = parse_keep_last(keep_local) if keep_local is not None else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc).replace("--keep-last", "--keep-local")) from None
    r = repo_open(repo, create=False, replicate_to=to, replicate=False)
    try:
        if r.tier is None or r.tier.remote is None:
            err.print(f"[bold red]error:[/] {escape(repo)} has no remote yet: pass --to URL")
            raise typer.Exit(1)
        r.tier.local_retention = rules
        r.tier.start()
        done = r.repository.tiered().wait(timeout)
        if rules is not None:
            for kind in r.kinds:
                for series in kind.scan(r.tier.local, None, False).runs:
                    r.tier.evict(kind, series, rules)
        # "runs" (checkpoints), "artifacts": series -> number -> status
        status = {f"{kind.series_noun}s": {series: r.tier.status(kind, series)
                                           for series in kind.scan(r.store, None, False).runs} for kind in r.kinds}
    finally:
        r.close()
    if as_json:
        emit_json({"remote": r.tier.url, "done": done, **{group: {k: {str(s): v for s, v in st.items()}
                                                                  for k, st in by_series.items()}
                                                          for group, by_series in status.items()}})
    else:
        for group, by_series in status.items():
            for series, st in by_series.items():
                counts: dict[str, int] = {}
                for v in st.values():
                    counts[v] = counts.get(v, 0) + 1
                shown = series if group == "runs" else f"{group[:-1]} {series}"
                out.print(f"{shown}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), markup=False)
    if not done:
        err.print("[bold red]error:[/] replication did not finish in time; run `luopan replicate` again to resume "
                  f"(last error: {escape(str(r.tier.last_error))})")
        raise typer.Exit(1)


@app.command()
@handles_errors
def cold(
    *,
    repo: RepoOpt = None,
    to: Annotated[Optional[str], typer.Option(
        "--to", help="Cold store URL or path (recorded in the repository; needed the first time).")] = None,
    older_than: Annotated[Optional[str], typer.Option(
        "--older-than", help="Move checkpoints and artifact versions older than this (e.g. 7d, 36h; default: "
                             "the recorded policy, else 7d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be moved.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Move checkpoints and artifact versions that are not pinned, already replicated and older than a threshold to
    the cold store."""
    repo = repo_location(repo)
    if older_than is not None:
        try:
            parse_duration(older_than)
        except ValueError as exc:
            raise typer.BadParameter(f"--older-than: {exc}") from None
    policy = None
    if to is not None:
        policy = ColdPolicy(to, older_than or "7d")
    r = repo_open(repo, create=False, cold=policy, replicate=False)
    try:
        if r.tier is None or r.tier.cold is None:
            err.print(f"[bold red]error:[/] {escape(repo)} has no cold store yet: pass --to URL")
            raise typer.Exit(1)
        if older_than is not None and policy is None:
            r.tier.cold = ColdPolicy(r.tier.cold.url, older_than, r.tier.cold.storage_options)
        moved = r.tier.move_cold(dry_run=dry_run)
    finally:
        r.close()
    if as_json:  # {"run": …, "step": …} for a checkpoint, {"artifact": …, "version": …} for an artifact version
        emit_json({"dry_run": dry_run, "moved": [{m.kind.series_noun: m.series, m.kind.number_noun: m.number}
                                                 for m in moved]})
        return
    verb = "would move" if dry_run else "moved"
    what = "checkpoint(s)" if all(m.kind.name == "checkpoint" for m in moved) else "manifest(s)"
    out.print(f"{verb} {len(moved)} {what} to {r.tier.cold.url}"
              + "".join(f"\n  {m.series} {m.kind.number_noun} {m.number}" for m in moved), markup=False)
