"""``luopan init``, ``upgrade``, ``prune``, ``pin``/``unpin``, ``gc``, ``locks`` and ``unlock``: creating and maintaining a repository."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.text import Text

from ..errors import LuopanError
from ..repo import Repo
from ..repo import init as repo_init
from ..format import FORMAT_VERSION
from ..repository.locks import break_locks, list_locks, locked
from ..retention import rules_from_flags
from ..units import parse_duration
from .artifact import KindOpt, is_artifact_target, name_and_number
from .app import (
    JsonOpt,
    RepoOpt,
    app,
    emit_json,
    err,
    escape,
    handles_errors,
    human,
    not_found,
    opens_repo,
    out,
    print_plan,
    repo_location,
    report_strays,
)
from .grammar import LegacyStep


@app.command()
@handles_errors
def init(
    *,
    repo: RepoOpt = None,
    compression: Annotated[str, typer.Option(
        help="Blob compression: auto (the default: a float codec or zstd where a sample says it pays, docs/format.md "
             "§6.1), none, zstd or zstd:LEVEL.")] = "auto",
    chunk_size: Annotated[Optional[int], typer.Option(help="Chunk size in bytes (default 4 MiB).")] = None,
    pack_size: Annotated[Optional[int], typer.Option(help="Target pack size in bytes (default 64 MiB).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a new, empty repository."""
    repo = repo_location(repo)
    r = repo_init(repo, compression=compression, chunk_size=chunk_size, pack_size=pack_size)
    c = r.config
    if as_json:
        emit_json({"repository": r.store.describe(), "format_version": c.format_version, "chunk_size": c.chunk_size,
                   "pack_size": c.pack_size, "compression": c.compression.codec})
        return
    out.print(f"created luopan repository at [bold]{escape(r.store.describe())}[/] "
              f"(format {c.format_version}, chunks {human(c.chunk_size)}, packs {human(c.pack_size)}, "
              f"compression {c.compression.codec})")


@app.command()
@opens_repo
def upgrade(
    *,
    r: Repo,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the change; change nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Raise the repository's format version to this luopan's, so later saves use what it adds: at version 6,
    checkpoint manifests keep the entries that did not change since the previous checkpoint in shared entry groups
    (docs/format.md §8.5); at version 7, a row delta keeps the part of its patch stored by the previous checkpoint
    and adds only the rows changed since (patch segments, §5.2); at version 8, an index snapshot after remove_ids
    stores what changed as a row map (§17.7). Nothing stored is rewritten, and every checkpoint
    loads as before; but luopan of an older format refuses the repository afterwards (upgrade it first). Takes the
    exclusive lock, so saves in flight finish first."""
    before = r.config.format_version
    after = max(before, FORMAT_VERSION)
    if after != before and not dry_run:
        with locked(r.store, "exclusive", "format upgrade", timeout=r.lock_timeout):
            r.repository.require_format(after)
    if as_json:
        emit_json({"repository": r.store.describe(), "format_version_before": before, "format_version": after,
                   "changed": after != before and not dry_run, "dry_run": dry_run})
    elif after == before:
        out.print(f"{r.store.describe()} is already at format {before}, this luopan's: nothing to do", markup=False)
    else:
        verb = "would raise" if dry_run else "raised"
        out.print(f"{verb} {r.store.describe()} from format {before} to {after}: later checkpoint manifests keep "
                  f"unchanged entries in entry groups and row deltas in segments; luopan reading only format "
                  f"{before} or older now refuses it", markup=False)


@app.command()
@opens_repo
def prune(
    *,
    r: Repo,
    run: Annotated[str, typer.Argument(help="Run (or artifact) to prune.")],
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
    kind: KindOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove checkpoints a retention policy does not keep. The newest and pinned checkpoints always stay.

    Categories are separate, each with its own count (restic-style): a checkpoint stays if any rule keeps it.
    Removing deletes manifests only; run `luopan gc` to free the space of data nothing references any more.
    """
    try:
        rules = rules_from_flags(keep_last=keep_last, keep_best=keep_best, keep_every=keep_every,
                                 keep_every_steps=keep_every_steps, keep_tag=keep_tag)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    artifact = is_artifact_target(r, run, kind)
    try:
        if artifact:
            decided = r.artifact(run).prune(rules, dry_run=dry_run)
        else:
            decided = r.prune(run, rules, dry_run=dry_run)
    except ValueError as exc:
        if isinstance(exc, LuopanError):
            raise
        raise typer.BadParameter(str(exc)) from None
    print_plan(decided, "artifact" if artifact else "run", run, dry_run, as_json)


@app.command()
@opens_repo
def pin(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="RUN@STEP", help="The checkpoint (or artifact version, NAME@V) "
                                                                "to protect.")],
    legacy_step: LegacyStep = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="A name for the pin, e.g. release-1.")] = None,
    kind: KindOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Protect a checkpoint (or artifact version): `luopan prune` never removes a pinned one."""
    run, step = name_and_number(ref, legacy_step, "pin", as_json)
    artifact = is_artifact_target(r, run, kind)
    (r.artifact(run) if artifact else r.run(run)).pin(step, tag)
    if as_json:
        emit_json({"artifact" if artifact else "run": run, "version" if artifact else "step": step, "tag": tag,
                   "pinned": True})
        return
    out.print(f"pinned {run} step {step}" + (f" as {tag!r}" if tag else ""), markup=False)


@app.command()
@opens_repo
def unpin(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="RUN@STEP", help="The checkpoint (or artifact version, NAME@V) "
                                                                "to unpin.")],
    legacy_step: LegacyStep = None,
    kind: KindOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a pin (the checkpoint or artifact version itself stays until a prune removes it)."""
    run, step = name_and_number(ref, legacy_step, "unpin", as_json)
    artifact = is_artifact_target(r, run, kind)
    if (r.artifact(run) if artifact else r.run(run)).unpin(step):
        if as_json:
            emit_json({"artifact" if artifact else "run": run, "version" if artifact else "step": step,
                       "pinned": False})
            return
        out.print(f"unpinned {run} step {step}", markup=False)
    else:
        raise typer.Exit(not_found(f"run {run!r} step {step} is not pinned"))


def _grace(text: str) -> float:
    """``--grace``: a duration (luopan.units grammar), or zero, with a unit or without (0, 0.0, 0s, 0h)."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    try:
        return parse_duration(text, allow_zero=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
@opens_repo
def gc(
    *,
    r: Repo,
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
    report_strays(r)
    if as_json:
        rep = r.gc(grace=seconds, repack_below=repack_below, dry_run=dry_run)
        emit_json(rep.to_json())
        return
    with err.status("gc: marking") as status:
        rep = r.gc(grace=seconds, repack_below=repack_below, dry_run=dry_run,
                   log=lambda msg: status.update(Text(f"gc: {msg}")))
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
        out.print(f"[yellow]not repacked[/] (damaged; run `luopan verify`): {escape(str(skipped))}", highlight=False)
    if dry_run:
        out.print("dry run: nothing changed")


@app.command()
@opens_repo
def locks(*, r: Repo, as_json: JsonOpt = False) -> None:
    """List the repository's locks: saves hold shared ones, prune and gc an exclusive one."""
    recs = list_locks(r.store)
    if as_json:
        emit_json([r.to_json() for r in recs])
        return
    if not recs:
        out.print("no locks")
    for rec in recs:
        reason = rec.stale_reason()
        out.print(escape(rec.describe()) + (f" [yellow](stale: {escape(reason)})[/]" if reason else ""),
                  highlight=False)


@app.command()
@opens_repo
def unlock(
    *,
    r: Repo,
    remove_all: Annotated[bool, typer.Option("--all", help="Remove every lock, not only stale ones: only when you "
                                                           "know no luopan process uses the repository.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove stale locks (their process is gone, or they were not refreshed for 30 min)."""
    removed = break_locks(r.store, stale_only=not remove_all)
    if as_json:
        emit_json({"removed": [rec.to_json() for rec in removed]})
        return
    for rec in removed:
        out.print(f"removed {rec.describe()}", highlight=False, markup=False)
    out.print(f"{len(removed)} lock(s) removed")
