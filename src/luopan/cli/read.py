"""``luopan verify`` and ``export``: reading every byte back, checked."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import IntegrityError, UsageError
from ..repo import Repo
from .artifact import KindOpt, is_artifact_target, verify_artifact
from .app import JsonOpt, app, emit_json, err, escape, human, opens_repo, out
from .grammar import LegacyStep, RunRef, checkpoint_ref, renamed

@app.command()
@opens_repo
def verify(
    *,
    r: Repo,
    ref: Annotated[Optional[str], typer.Argument(
        metavar="[RUN[@STEP]]", show_default=False,
        help="What to verify: RUN@STEP, RUN (every step), or an artifact NAME[@V]; the whole repository when "
             "omitted.")] = None,
    legacy_step: LegacyStep = None,
    trusted_keys: Annotated[Optional[str], typer.Option(
        "--trusted-keys", envvar="LUOPAN_TRUSTED_KEYS",
        help="Directory of trusted public keys (*.pub): every checkpoint must also be signed by one (luopan sign).")]
    = None,
    structure: Annotated[bool, typer.Option(
        "--structure", help="Read no chunk: check every manifest as a load parses it and every chunk row against its "
                            "pack (there, trailer intact, long enough). Seconds instead of minutes on many large "
                            "checkpoints; a flipped bit inside a chunk needs the full verify.")] = False,
    kind: KindOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Read every byte of the selected checkpoints (or artifact versions) and check every hash; without RUN, the whole
    repository: every checkpoint and artifact version, records, pins and index files. Exit 3 and name the damage."""
    run, step = checkpoint_ref(ref, legacy_step, "verify", quiet=as_json) if ref is not None else (None, None)
    if run is not None and is_artifact_target(r, run, kind):
        if trusted_keys:
            raise UsageError("--trusted-keys checks checkpoint signatures; artifact versions are not signed")
        verify_artifact(r, run if step is None else f"{run}@{step}", as_json)
        return
    with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=as_json) as bar:
        task = bar.add_task("verify", total=None)
        try:
            report = r.verify(run, step, progress=lambda n: bar.advance(task, n),
                              on_total=lambda n: bar.update(task, total=n), trusted_keys=trusted_keys,
                              structure=structure)
        except IntegrityError as exc:
            bar.stop()
            problems = getattr(exc, "problems", None) or [exc]
            report = getattr(exc, "report", None)
            if as_json:
                emit_json(_verify_json(report, problems))
                raise typer.Exit(3) from None
            for s in (report.strays if report is not None else []):
                err.print(f"[yellow]not luopan's[/] (skipped) {escape(str(s))}", highlight=False)
            for p in problems:
                err.print(f"[bold red]DAMAGED[/] {escape(str(p))}", highlight=False)
            err.print(f"[bold red]{len(problems)} problem(s) found[/]; undamaged checkpoints stay loadable "
                      "(run `luopan verify RUN@STEP` to check one)")
            raise typer.Exit(3) from None
    if as_json:
        emit_json(_verify_json(report, []))
        return
    for s in report.strays:
        err.print(f"[yellow]not luopan's[/] (skipped) {escape(str(s))}", highlight=False)
    out.print(f"[green]ok[/]: {report.checkpoints} checkpoint(s), {report.chunks} chunks, "
              + ("structure checked (manifests, groups and packs; no chunk read)" if structure
                 else f"{human(report.bytes)} read and verified") + (", every checkpoint signed by a trusted key"
                                                             if trusted_keys else "")
              + (f"; {len(report.strays)} entr{'y' if len(report.strays) == 1 else 'ies'} that "
                 f"{'is' if len(report.strays) == 1 else 'are'} not luopan's skipped" if report.strays else ""))


def _verify_json(report: Any, problems: list[Any]) -> dict[str, Any]:
    return {"ok": not problems, "checkpoints": getattr(report, "checkpoints", None),
            "chunks": getattr(report, "chunks", None), "bytes": getattr(report, "bytes", None),
            "strays": [str(s) for s in getattr(report, "strays", [])],
            "problems": [{"type": type(p).__name__, "message": str(p)} for p in problems]}


@app.command()
@opens_repo
def export(
    *,
    r: Repo,
    ref: RunRef,
    legacy_step: LegacyStep = None,
    output: Annotated[str, typer.Option("--output", "-o", help="safetensors file to write.")] = "model.safetensors",
    subtree: Annotated[Optional[str], typer.Option(help="Export only the tensors under this key path, e.g. model.")]
    = None,
    pieces: Annotated[bool, typer.Option("--pieces", help="Write each shard of a sharded tensor (DCP, collective "
                                         "saves) as stored, named PATH/shard-OFFSETS, instead of the whole "
                                         "tensor.")] = False,
    adapter: Annotated[bool, typer.Option("--adapter", help="The checkpoint is a PEFT adapter (luopan.peft or "
                                          "luopan.hf): write a directory PeftModel.from_pretrained loads "
                                          "(adapter_model.safetensors + adapter_config.json) at --output, ./adapter by "
                                          "default.")] = False,
    model_signing_key: Annotated[Optional[str], typer.Option(
        "--model-signing-key", metavar="KEY", help="EC private key (luopan key gen --type ecdsa-p256): also write OUTPUT.sig, a signature the "
                       "OpenSSF model_signing tool verifies offline: model_signing verify key OUTPUT --signature "
                       "OUTPUT.sig --public_key KEY.pub. Needs pip install \"luopan[interop]\".")] = None,
    old_sign: Annotated[Optional[str], typer.Option("--sign", hidden=True, help="Deprecated: --model-signing-key.")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint (or one subtree, e.g. the model weights) to a single safetensors file; with --adapter, a PEFT
    adapter directory. With --model-signing-key KEY, also sign what was written for the model_signing tool
    (OUTPUT.sig)."""
    run, step = checkpoint_ref(ref, legacy_step, "export", quiet=as_json)
    sign = renamed(model_signing_key, old_sign, "--sign", "--model-signing-key", as_json)
    if sign is not None:  # before the export: a wrong key or a missing package fails fast, nothing written
        from ..interop import check_key, require_model_signing

        check_key(sign)
        require_model_signing()
    if adapter:
        from ..peft import export_adapter  # imports torch: only for adapters

        done = export_adapter(r, run, "adapter" if output == "model.safetensors" else output, step)
        if as_json:
            emit_json({"run": run, **done, "signature": _sign_export(done["path"], sign, quiet=True)})
            return
        out.print(f"wrote adapter of {run} ({done['tensors']} tensors, {human(done['bytes'])}) to {done['path']}; "
                  f"base fingerprint {done['base_fingerprint']}", markup=False)
        _sign_export(done["path"], sign)
        return
    m = r.manifest(run, step)
    with Progress(TextColumn("exporting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=as_json) as bar:
        task = bar.add_task("export", total=m.stats["logical_bytes"])
        info = r.export(run, m.step, output, subtree=subtree, progress=lambda n: bar.advance(task, n),
                        pieces=pieces)
    if as_json:
        emit_json({"run": run, "step": m.step, **info, "signature": _sign_export(info["path"], sign, quiet=True)})
        return
    out.print(f"wrote {info['tensors']} tensors ({human(info['bytes'])}) of {run} step {m.step} to {info['path']}",
              markup=False)
    _sign_export(info["path"], sign)


def _sign_export(path: str, key: Optional[str], quiet: bool = False) -> Optional[str]:
    if key is None:
        return None
    from ..interop import sign_for_model_signing

    sig = sign_for_model_signing(path, key)
    if quiet:
        return str(sig)
    pub = key[:-4] + ".pub" if key.endswith(".key") else "KEY.pub"
    out.print(f"signed for model_signing: {sig}; verify with: model_signing verify key {path} --signature {sig} "
              f"--public_key {pub}", markup=False, highlight=False, soft_wrap=True)
    return str(sig)
