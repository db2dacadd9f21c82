"""``luopan doctor``: check a repository for what commonly makes checkpoints fail (luopan.doctor), one line per
finding with what to do. Registered on the app by importing this module (luopan.cli.main does).

The repository is opened read-only by luopan.doctor, not with ``open_repo``: opening for use removes temp files of
dead writers, and doctor reports them instead of changing anything.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..doctor import exit_code, run_checks
from .app import RepoOpt, app, emit_json, escape, handles_errors, out, repo_location

_LABELS = {"ok": "[green]ok  [/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]"}


@app.command()
@handles_errors
def doctor(
    *,
    repo: RepoOpt = None,
    full: Annotated[bool, typer.Option("--full", help="Read every chunk of each newest checkpoint, not a sample.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON: [{check, status, message, "
                                                         "fix}, …].")] = False,
) -> None:
    """Check the repository for what commonly makes checkpoints fail: free space for the next checkpoint, stale or
    damaged locks, a newest checkpoint that does not verify (sampled), checkpoints not yet replicated, temp files of
    interrupted writes, a filesystem where rename or fsync is not durable, the format version, clock skew. Only
    reads. Exit 0 when every check passes, 1 on a warning, 3 when a newest checkpoint is damaged, 4 when there is
    no repository."""
    findings = run_checks(repo_location(repo), full=full)
    if as_json:
        emit_json([f.to_json() for f in findings])
    else:
        for f in findings:
            out.print(f"{_LABELS[f.status]} {f.check}: {escape(f.line())}", highlight=False, soft_wrap=True)
        problems = [f for f in findings if f.status != "ok"]
        out.print(f"{len(findings) - len(problems)} ok, {len(problems)} to fix" if problems
                  else f"all {len(findings)} checks passed", highlight=False)
    raise typer.Exit(exit_code(findings))
