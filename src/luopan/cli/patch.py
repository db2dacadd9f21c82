"""``luopan patch create|apply``: ship the change between two checkpoints as one signed file (docs/format.md §13),
and apply it on a device that has only the base as a safetensors file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import UsageError
from ..patch import apply, create
from ..repo import Repo
from ..units import parse_bytes
from .app import MARKUP, JsonOpt, RepoOpt, app, emit_json, err, handles_errors, human, open_repo, opens_repo, out, \
    repo_location
from .grammar import RUN_REF, checkpoint_ref, deprecated, parse_ref


@contextmanager
def bar(what: str, total: int | None) -> Iterator[tuple[Callable[[int], Any], Callable[[int], Any]]]:
    """A transfer bar on stderr while the work lasts: (advance by n bytes, set the total)."""
    with Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield (lambda n: progress.advance(task, n)), (lambda n: progress.update(task, total=n))

patch_app = typer.Typer(help="Portable patches: the change between two checkpoints as one signed file, applied to a "
                             "safetensors base without a repository.", no_args_is_help=True, rich_markup_mode=MARKUP)
app.add_typer(patch_app, name="patch")


@patch_app.command("create")
@opens_repo
def create_cmd(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar=RUN_REF, show_default=False, help="The target checkpoint, what the "
                                       "device will have: RUN@STEP, or RUN alone for its latest step.")],
    from_step: Annotated[Optional[int], typer.Option("--from", metavar="STEP", help="Step of RUN that is the base: "
                                                     "the checkpoint the device already has (or give --from-file).")]
    = None,
    output: Annotated[str, typer.Option("--output", "-o", help="Patch file to write, e.g. update.lpatch.")],
    subtree: Annotated[Optional[str], typer.Option(help="Only the tensors under this key path (e.g. model), named "
                                                   "as `luopan export --subtree` names them.")] = None,
    sign: Annotated[Optional[str], typer.Option("--sign", help="Private key file (luopan key gen) to sign the "
                                                "patch with.")] = None,
    from_file: Annotated[Optional[str], typer.Option("--from-file", help="The base is this safetensors file, not a "
                                                     "checkpoint: its unchanged tensors are not carried.")] = None,
    legacy_to: Annotated[Optional[int], typer.Option("--to", hidden=True, help="Deprecated: give RUN@STEP.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a patch from step --from of RUN (or the safetensors file --from-file) to checkpoint RUN@STEP: the
    target's tensor list, both content fingerprints and only the chunks the base lacks, compressed. Apply it with
    `luopan patch apply`."""
    run, to_step = checkpoint_ref(ref, legacy_to, "patch create", old="RUN --to STEP", quiet=as_json)
    target = r.manifest(run, to_step)
    total = None if subtree else target.stats["logical_bytes"]
    with bar("creating", total) as (advance, _total):
        info = create(r, run, from_step, target.step, output, subtree=subtree, sign_key=sign, from_file=from_file,
                      progress=advance)
    if as_json:
        emit_json(info)
        return
    out.print(f"wrote {info['path']} ({human(info['bytes'])}): {info['tensors']} tensors, "
              f"{info['carried_chunks']} of {info['chunks']} chunks carried ({human(info['carried_bytes'])} raw, "
              f"{info['changed_tensors']} tensors changed); "
              + (f"signed by {info['signed_by']}" if info["signed_by"] else "unsigned"), highlight=False, markup=False)
    out.print(f"base fingerprint   {info['base_fingerprint']}\ntarget fingerprint {info['target_fingerprint']}",
              highlight=False)


@patch_app.command("apply")
@handles_errors
def apply_cmd(
    *,
    patch: Annotated[str, typer.Argument(help="Patch file (luopan patch create).")],
    base: Annotated[str, typer.Option("--base", help="The base the patch was made for, as a safetensors file.")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="safetensors file to write (appears "
                                                  "atomically; an existing one is replaced only on success).")] = None,
    repo: RepoOpt = None,
    into: Annotated[Optional[str], typer.Option("--into", metavar=RUN_REF, help="With -r: the checkpoint to commit, "
                                                "RUN@STEP (the patch's target run and step by default; RUN alone: "
                                                "the patch's target step).")] = None,
    legacy_run: Annotated[Optional[str], typer.Option("--run", hidden=True, help="Deprecated: --into RUN.")] = None,
    legacy_step: Annotated[Optional[int], typer.Option("--step", hidden=True, help="Deprecated: --into RUN@STEP.")]
    = None,
    trusted_keys: Annotated[Optional[str], typer.Option("--trusted-keys", help="Directory of trusted public keys "
                                                        "(*.pub): the patch must be signed by one of them. Default: "
                                                        "$LUOPAN_TRUSTED_KEYS.")] = None,
    require_signature: Annotated[Optional[bool], typer.Option(
        "--require-signature/--allow-unsigned",
        help="Refuse an unsigned patch (needs trusted keys) / accept one even with trusted keys. Default: required "
             "exactly when trusted keys are given.")] = None,
    expect_target: Annotated[Optional[str], typer.Option("--expect-target", metavar="FP", help="Refuse the patch "
                                                         "unless its target has this content fingerprint "
                                                         "(blake3:…), before the base is read.")] = None,
    max_output: Annotated[Optional[str], typer.Option("--max-output", metavar="SIZE", help="With -o: refuse a patch "
                                                      "whose output file would be larger (e.g. 20GiB), before the "
                                                      "base is read.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply a patch to the base it was made for and write the target as a safetensors file (-o), or commit it as a
    checkpoint (-r REPO) — no repository is needed for -o. The signature, the header and the base's content
    fingerprint are checked before anything is written; every chunk is verified. With -o memory stays small whatever
    the model's size; -r holds the whole target in memory (refused when it does not fit)."""
    if output is not None and repo is not None:
        raise UsageError("give -o FILE (write a safetensors file) or -r REPO (commit a checkpoint), not both")
    if max_output is not None and output is None:
        raise UsageError("--max-output limits the file -o writes: give -o FILE")
    limit = parse_bytes(max_output) if max_output is not None else None
    run, step = _commit_target(into, legacy_run, legacy_step, as_json)
    target: dict[str, Any] = {"out_path": output} if output is not None else {"repo": open_repo(repo_location(repo))}
    with bar("applying", None) as (advance, set_total):
        info = apply(patch, base, trusted_keys=trusted_keys, require_signature=require_signature, run=run, step=step,
                     expect_target=expect_target, max_output_bytes=limit, progress=advance, on_total=set_total,
                     **target)
    if as_json:
        emit_json(info)
        return
    where = info["path"] if "path" in info else f"{info['run']} step {info['step']}"
    out.print(f"wrote {where}: {info['tensors']} tensors, {human(info['bytes'])} "
              f"({human(info['bytes_from_base'])} from the base, {human(info['bytes_from_patch'])} from the patch), "
              f"every chunk verified; target fingerprint {info['target_fingerprint']}", highlight=False, markup=False)
    if info["signed_by"]:
        out.print(f"signed by trusted key {info['signed_by']}", highlight=False, markup=False)
    elif info["signed"]:
        err.print("[yellow]note:[/] the patch is signed, but no trusted keys were given (--trusted-keys DIR or "
                  "$LUOPAN_TRUSTED_KEYS), so its signature was not checked", highlight=False)
    else:
        err.print("[yellow]note:[/] the patch is not signed", highlight=False)


def _commit_target(into: Optional[str], legacy_run: Optional[str], legacy_step: Optional[int],
                   quiet: bool) -> tuple[Optional[str], Optional[int]]:
    """``--into RUN[@STEP]``, or the deprecated ``--run RUN --step STEP`` (either alone) with a note."""
    if legacy_run is None and legacy_step is None:
        return parse_ref(into) if into is not None else (None, None)
    if into is not None:
        raise UsageError("--run and --step are the old spelling of --into RUN@STEP: give --into alone")
    old = " ".join(f for f, v in (("--run RUN", legacy_run), ("--step STEP", legacy_step)) if v is not None)
    new = f"{legacy_run or 'RUN'}" + (f"@{legacy_step}" if legacy_step is not None else "")
    deprecated(old, f"--into {new}", quiet)
    return legacy_run, legacy_step
