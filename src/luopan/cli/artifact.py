"""``luopan artifact commit|ls|log|checkout|verify|pin|unpin|prune``: versioned files and directories (datasets,
eval outputs) in the same repository as the checkpoints (``artifact status|diff``: luopan.cli.folders; ``luopan
lineage``: luopan.cli.lineage)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..artifact import Artifact, ArtifactVersion, artifact_names
from ..repo import Repo
from ..errors import IntegrityError, UsageError
from ..format.names import check_artifact, check_version, is_artifact_name, is_run_name
from ..retention import rules_from_flags
from .app import (
    MARKUP,
    JsonOpt,
    app,
    creates_repo,
    emit_json,
    err,
    escape,
    human,
    opens_repo,
    out,
    print_plan,
    table,
    usage_errors,
)
from .grammar import checkpoint_ref, parse_ref

artifact_app = typer.Typer(help="Versioned files and directories (datasets, eval outputs) with lineage.",
                           no_args_is_help=True, rich_markup_mode=MARKUP)
app.add_typer(artifact_app, name="artifact")


KIND_CHOICES = ("run", "artifact")
KindOpt = Annotated[Optional[str], typer.Option(
    "--kind", metavar="run|artifact",
    help="What NAME is, when a run and an artifact share it (otherwise it is found by name).")]


def is_artifact_target(r: Any, name: str, kind: str | None = None) -> bool:
    """Whether NAME given to a checkpoint command (ls, pin, unpin, prune, verify) means an artifact: ``--kind`` when
    given; else a name with '/' (never a run), or one with committed versions and no run of that name. A name with
    both is ambiguous: UsageError (exit 2) naming both and how to choose, rather than quietly acting on the run."""
    if kind is not None:
        if kind not in KIND_CHOICES:
            raise UsageError(f"--kind takes run or artifact, got {kind!r}")
        return kind == "artifact"
    if not is_artifact_name(name):
        return False
    if not is_run_name(name):
        return True
    versions = r.artifact(name).numbers()
    if not versions:
        return False
    steps = r.steps(name)
    if steps:
        raise UsageError(f"{name!r} names both a run ({len(steps)} checkpoint(s)) and an artifact ({len(versions)} "
                         "version(s)): add --kind run or --kind artifact to say which (or use `luopan artifact "
                         "log|pin|unpin|prune|verify` for the artifact)")
    return True


def name_and_number(ref: str, legacy_number: int | None, command: str, quiet: bool = False
                    ) -> tuple[str, int]:
    """RUN@STEP or NAME@V (pin, unpin); the deprecated RUN STEP with a note."""
    name, number = checkpoint_ref(ref, legacy_number, command, quiet=quiet)
    if number is None:
        raise UsageError(f"a step (or version) is needed: {name}@N")
    return name, number


def split_ref(text: str) -> tuple[str, int | None]:
    """'NAME' -> (NAME, None); 'NAME@V' -> (NAME, V). A bad name or version (ds@0) is a usage error: exit 2."""
    with usage_errors():
        name, version = parse_ref(text, "artifact reference")
        return check_artifact(name), None if version is None else check_version(version)


@contextmanager
def bar(what: str, total: int | None) -> Iterator[Any]:
    """A transfer bar on stderr (shown while the work lasts; nothing is left behind)."""
    with Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def version_json(v: ArtifactVersion) -> dict[str, Any]:
    return {"name": v.name, "version": v.version, "ref": v.ref, "created": v.created, "root": v.root,
            "files": len(v.files), "dirs": len(v.dirs), "logical_bytes": v.logical_bytes,
            "stored_bytes": v.stored_bytes, "new_bytes": v.new_bytes, "chunks": v.chunks,
            "new_chunks": v.new_chunks, "parents": v.parents, "metadata": v.metadata}


def _meta(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--meta takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


@artifact_app.command("commit")
@creates_repo
def commit(
    *,
    r: Repo,
    name: Annotated[str, typer.Argument(help="Artifact name, e.g. datasets/clean (parts joined by '/').")],
    path: Annotated[str, typer.Argument(help="Directory or file to commit.")],
    parent: Annotated[list[str], typer.Option("--parent", metavar="NAME@V",
                                              help="What this version was made from (repeatable).")] = [],  # noqa: B006
    meta: Annotated[list[str], typer.Option("--meta", metavar="K=V",
                                            help="Metadata to record (repeatable; numbers stay numbers).")] = [],  # noqa: B006
    as_json: JsonOpt = False,
) -> None:
    """Commit PATH as the next version of artifact NAME; writes only chunks the repository lacks. A missing
    repository is created (as luopan.open does; `luopan init` creates one with other options)."""
    with bar("committing", None) as advance:
        v = r.artifact(name).commit(path, parents=parent or None, metadata=_meta(meta), progress=advance)
    if as_json:
        emit_json(version_json(v))
        return
    out.print(f"committed {v.ref}: {len(v.files)} file(s), {human(v.logical_bytes)}; wrote {human(v.stored_bytes)}",
              highlight=False, markup=False)


@artifact_app.command("ls")
@opens_repo
def ls(
    *,
    r: Repo,
    name: Annotated[Optional[str], typer.Argument(metavar="[NAME[@V]]", show_default=False,
                                                  help="Artifact to list the files of (NAME or NAME@V); all "
                                                       "artifacts when omitted.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List artifacts with their latest version, or the files of one version."""
    if name is None:
        rows = [(n, r.artifact(n).get()) for n in artifact_names(r)]
        if as_json:
            emit_json({"artifacts": [{**version_json(v), "versions": len(r.artifact(n).numbers())}
                                     for n, v in rows]})
            return
        if not rows:
            out.print("no artifacts yet")
            return
        t = table(title=f"artifacts in {r.where}")
        for col in ("artifact", "latest", "files", "size", "created"):
            t.add_column(col, justify="right" if col in ("latest", "files", "size") else "left")
        for n, v in rows:
            t.add_row(n, str(v.version), str(len(v.files)), human(v.logical_bytes), v.created[:19])
        out.print(t)
        return
    artifact_name, version = split_ref(name)
    art = r.artifact(artifact_name)
    v = art.get(version)
    files = [(e["path"], e["mode"], e["size"]) for e in art.listing(v.version) if e["type"] == "file"]
    if as_json:
        emit_json({**version_json(v), "files": [{"path": p, "mode": oct(m), "size": s} for p, m, s in files]})
        return
    t = table(title=f"{v.ref}")
    for col in ("path", "mode", "size"):
        t.add_column(col, justify="right" if col == "size" else "left")
    for p, m, s in files:
        t.add_row(p, oct(m), human(s))
    out.print(t)


@artifact_app.command("log")
@opens_repo
def log(
    *,
    r: Repo,
    name: Annotated[str, typer.Argument(help="Artifact name.")],
    as_json: JsonOpt = False,
) -> None:
    """Every version of artifact NAME, oldest first, with what each wrote and its parents."""
    print_log(r, name, as_json)


def print_log(r: Repo, name: str, as_json: bool) -> None:
    """`luopan artifact log NAME` (and `luopan ls NAME` of an artifact)."""
    art = r.artifact(name)
    versions = art.versions()
    if not versions:
        raise typer.Exit(_missing(art))
    pins = art.pins()
    if as_json:
        emit_json({"name": art.name, "versions": [{**version_json(v), "pinned": v.version in pins}
                                                  for v in versions]})
        return
    t = table(title=f"versions of {art.name}")
    for col in ("version", "created", "files", "size", "written", "parents", "metadata"):
        t.add_column(col, justify="right" if col in ("version", "files", "size", "written") else "left")
    for v in versions:
        t.add_row(str(v.version) + (" (pinned)" if v.version in pins else ""), v.created[:19], str(len(v.files)),
                  human(v.logical_bytes), human(v.stored_bytes), ", ".join(v.parents),
                  " ".join(f"{k}={val}" for k, val in v.metadata.items()))
    out.print(t)


def _missing(art: Artifact) -> int:
    err.print(f"[bold red]error:[/] {escape(art._missing())}")
    return 4


@artifact_app.command("checkout")
@opens_repo
def checkout(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME[@V]", help="Artifact (latest version) or NAME@V.")],
    dest: Annotated[str, typer.Argument(help="Folder to write: a new one, or one to update in place.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite or remove local changes in DEST.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a version into DEST, every chunk verified. A new DEST appears whole. An existing folder is updated in
    place: only files that differ are written, files of the previous checkout the version lacks are removed, files
    luopan did not write are left alone; it refuses to overwrite or remove local changes (edited files, files in the
    way) unless --force. DEST/.luopan-checkout.json records what was checked out (`luopan artifact status`)."""
    name, version = split_ref(ref)
    art = r.artifact(name)
    v = art.get(version)
    with bar("checking out", v.logical_bytes) as advance:
        path = art.checkout(dest, v.version, force=force, progress=advance)
    if as_json:
        emit_json({**version_json(v), "path": str(path)})
        return
    out.print(f"checked out {v.ref} ({len(v.files)} file(s), {human(v.logical_bytes)}) to {path}", highlight=False,
              markup=False)


@artifact_app.command("verify")
@opens_repo
def verify(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME[@V]", help="Artifact (every version) or NAME@V.")],
    as_json: JsonOpt = False,
) -> None:
    """Read every chunk of an artifact's versions (or of NAME@V) and check it. Exit 3 and name the damage if any."""
    verify_artifact(r, ref, as_json)


def verify_artifact(r: Repo, ref: str, as_json: bool) -> None:
    """`luopan artifact verify NAME[@V]` (and `luopan verify NAME@V`)."""
    name, version = split_ref(ref)
    with bar("verifying", None) as advance:
        try:
            checked = r.artifact(name).verify(version, progress=advance)
        except IntegrityError as exc:
            if not as_json:
                raise
            problems = getattr(exc, "problems", None) or [exc]
            emit_json({"ok": False, "ref": ref, "problems": [{"type": type(p).__name__, "message": str(p)}
                                                             for p in problems]})
            raise typer.Exit(3) from None
    if as_json:
        emit_json({"ok": True, "ref": ref, "bytes": checked, "problems": []})
        return
    out.print(f"[green]ok[/]: {escape(ref)}: {human(checked)} read and verified")


@artifact_app.command("pin")
@opens_repo
def pin(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME@V", help="The version to protect.")],
    tag: Annotated[Optional[str], typer.Option("--tag", help="A name for the pin, e.g. release-1.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Protect an artifact version: prune never removes a pinned version."""
    name, version = split_ref(ref)
    if version is None:
        raise UsageError(f"pin needs a version: NAME@V, e.g. {name}@1")
    r.artifact(name).pin(version, tag)
    if as_json:
        emit_json({"artifact": name, "version": version, "tag": tag, "pinned": True})
        return
    out.print(f"pinned {name}@{version}" + (f" as {tag!r}" if tag else ""), highlight=False, markup=False)


@artifact_app.command("unpin")
@opens_repo
def unpin(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME@V", help="The version to unpin.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove a version's pin (the version stays until a prune removes it)."""
    name, version = split_ref(ref)
    if version is None:
        raise UsageError(f"unpin needs a version: NAME@V, e.g. {name}@1")
    if not r.artifact(name).unpin(version):
        err.print(f"[bold red]error:[/] {escape(ref)} is not pinned")
        raise typer.Exit(4)
    if as_json:
        emit_json({"artifact": name, "version": version, "pinned": False})
        return
    out.print(f"unpinned {name}@{version}", highlight=False, markup=False)


@artifact_app.command("prune")
@opens_repo
def prune(
    *,
    r: Repo,
    name: Annotated[str, typer.Argument(help="Artifact to prune.")],
    keep_last: Annotated[Optional[str], typer.Option("--keep-last", metavar="N",
                                                     help="Keep the N newest versions.")] = None,
    keep_every: Annotated[list[str], typer.Option("--keep-every", metavar="DURATION",
                                                  help="Keep the newest version of each period, e.g. 7d.")] = [],  # noqa: B006
    keep_tag: Annotated[list[str], typer.Option("--keep-tag", metavar="TAG",
                                                help="Keep versions pinned with this tag.")] = [],  # noqa: B006
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove versions a retention policy does not keep (the newest and pinned ones always stay); `luopan gc` then
    frees the chunks no other version or checkpoint uses."""
    rules = rules_from_flags(keep_last=keep_last, keep_every=keep_every, keep_tag=keep_tag)
    decided = r.artifact(name).prune(rules, dry_run=dry_run)
    print_plan(decided, "artifact", name, dry_run, as_json)
