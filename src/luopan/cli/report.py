"""``luopan report``: one self-contained HTML page about a repository (luopan.report), written to a file or served
on 127.0.0.1 while runs save."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..report import ReportServer, build_report, write_report
from .app import JsonOpt, RepoOpt, app, emit_json, escape, handles_errors, open_repo, out, repo_location


def _local_root(r: object) -> str | None:
    store = getattr(r, "store", None)
    root = getattr(getattr(store, "local", store), "root", None)
    return os.path.realpath(root) if isinstance(root, str) else None


@app.command("report")
@handles_errors
def report(
    *,
    repo: RepoOpt = None,
    targets: Annotated[Optional[list[str]], typer.Argument(
        help="Runs and artifacts to report on (names); the whole repository when omitted.", show_default=False)]
    = None,
    output: Annotated[str, typer.Option("--output", "-o", help="HTML file to write.")] = "report.html",
    serve: Annotated[bool, typer.Option("--serve", help="Serve the page on 127.0.0.1 instead, regenerated per "
                                                        "request; it reloads itself while runs save.")] = False,
    port: Annotated[int, typer.Option("--port", help="Port for --serve (0: a free one).", min=0, max=65535)]
    = 8765,
    as_json: JsonOpt = False,
) -> None:
    """Write a self-contained HTML report (no network needed to view it): per run, metric curves with every
    checkpoint marked (pinned, best, latest; pruned ones as gone), bytes per save (new chunks, deltas, reused),
    save and stall times, restores and tiers; cumulative size vs full saves, dedup across runs, artifacts and their
    lineage, journals and index snapshots. The repository is only read."""
    location = repo_location(repo)
    r = open_repo(location)
    try:
        if serve:
            build_report(r, targets)  # a bad name fails now, with its exit code, not in the browser
        else:
            root = _local_root(r)
            dest = os.path.realpath(os.path.abspath(output))
            if root is not None and (dest == root or dest.startswith(root + os.sep)):
                raise UsageError(f"-o {output} is inside the repository: luopan report never writes into it; "
                                 "choose a path outside")
            if os.path.isdir(dest):
                raise UsageError(f"-o {output} is a directory: give a file name (report.html)")
            summary = write_report(r, dest, targets)
    finally:
        r.close()
    if not serve:
        if as_json:
            emit_json(summary)
            return
        out.print(f"wrote {escape(summary['path'])}: {summary['runs']} run(s), {summary['checkpoints']} "
                  f"checkpoint(s), {summary['pruned']} pruned, {summary['artifact_versions']} artifact version(s), "
                  f"{summary['journals']} journal(s), {summary['indexes']} index(es), {summary['charts']} chart(s)",
                  highlight=False)
        return
    server = ReportServer(lambda: open_repo(location), targets, port=port)  # opened once, at the first request
    if as_json:
        emit_json({"url": server.url, "serving": True})
    else:
        out.print(f"serving the report of {escape(location)} at {server.url} (Ctrl-C to stop)", highlight=False)
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
