"""``luopan key gen`` and ``luopan sign``: Ed25519 keys and signed checkpoints (docs/format.md §14); ECDSA P-256 keys
for ``luopan export --sign`` (the OpenSSF model_signing tool, luopan.interop)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..repo import Repo
from ..signing import generate_key
from .app import MARKUP, JsonOpt, app, emit_json, handles_errors, opens_repo, out
from .grammar import LegacyStep, RunRef, checkpoint_ref

key_app = typer.Typer(help="Signing keys: Ed25519 for checkpoints and patches, ECDSA P-256 for model_signing.",
                      no_args_is_help=True, rich_markup_mode=MARKUP)
app.add_typer(key_app, name="key")


@key_app.command("gen")
@handles_errors
def gen(
    output: Annotated[str, typer.Option("--output", "-o", help="Directory to write NAME.key and NAME.pub into.")],
    name: Annotated[str, typer.Option(help="File name of the key pair.")] = "luopan",
    kind: Annotated[str, typer.Option("--type", help="ed25519 (luopan sign, patches, indexes) or ecdsa-p256 (only "
                                      "for `luopan export --sign`: the OpenSSF model_signing tool accepts only "
                                      "EC keys).")] = "ed25519",
    as_json: JsonOpt = False,
) -> None:
    """Make a new key pair: NAME.key (private, mode 0600: keep it secret, sign with it) and NAME.pub (give it to whoever
    checks signatures: put it in their --trusted-keys directory, or pass it to `model_signing verify key
    --public_key`). An existing key is never overwritten."""
    private, public = generate_key(output, name, kind)
    if kind == "ed25519":
        from ..signing import load_signing_key

        key_id = load_signing_key(private).key_id
        if as_json:
            emit_json({"type": kind, "private": str(private), "public": str(public), "key_id": key_id})
            return
        out.print(f"wrote {private} (private) and {public} (public); key id {key_id}", markup=False)
    elif as_json:
        emit_json({"type": kind, "private": str(private), "public": str(public), "key_id": None})
    else:
        out.print(f"wrote {private} (private) and {public} (public), an ECDSA P-256 pair for model_signing "
                  f"interop only: `luopan export ... --sign {private}`", markup=False)


@app.command()
@opens_repo
def sign(
    *,
    r: Repo,
    ref: RunRef,
    legacy_step: LegacyStep = None,
    key: Annotated[str, typer.Option("--key", "-k", help="Private key file (luopan key gen).")],
    as_json: JsonOpt = False,
) -> None:
    """Sign a checkpoint's content (its tree, metrics and every chunk's BLAKE3 address) with an Ed25519 key;
    `luopan verify --trusted-keys DIR` then checks it with the hashes."""
    run, step = checkpoint_ref(ref, legacy_step, "sign", quiet=as_json)
    doc = r.checkpointing.sign(run, step, key)
    if as_json:
        emit_json({"run": run, "step": doc["step"], "key_id": doc["signature"]["key_id"], "content": doc["content"]})
        return
    out.print(f"signed {run} step {doc['step']} with {doc['signature']['key_id']} (content {doc['content'][:23]}…)",
              markup=False)
