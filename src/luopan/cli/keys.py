"""``luopan key gen`` and ``luopan sign``: Ed25519 keys and signed checkpoints (docs/format.md §14)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..signing import generate_key
from .app import RepoOpt, app, handles_errors, open_repo, out, repo_location

key_app = typer.Typer(help="Ed25519 signing keys for checkpoints and patches.", no_args_is_help=True)
app.add_typer(key_app, name="key")


@key_app.command("gen")
@handles_errors
def gen(
    output: Annotated[str, typer.Option("--output", "-o", help="Directory to write NAME.key and NAME.pub into.")],
    name: Annotated[str, typer.Option(help="File name of the key pair.")] = "luopan",
) -> None:
    """Make a new Ed25519 key pair: NAME.key (private, mode 0600: keep it secret, sign with it) and NAME.pub (give it
    to whoever checks signatures: put it in their --trusted-keys directory). An existing key is never overwritten."""
    private, public = generate_key(output, name)
    from ..signing import load_signing_key

    out.print(f"wrote {private} (private) and {public} (public); key id {load_signing_key(private).key_id}")


@app.command()
@handles_errors
def sign(
    *,
    repo: RepoOpt = None,
    run: Annotated[str, typer.Argument(help="Run name.")],
    step: Annotated[Optional[int], typer.Argument(help="Step; the latest when omitted.")] = None,
    key: Annotated[str, typer.Option("--key", "-k", help="Private key file (luopan key gen).")],
) -> None:
    """Sign a checkpoint's content (its tree, metrics and every chunk's BLAKE3 address) with an Ed25519 key;
    `luopan verify --trusted-keys DIR` then checks it with the hashes."""
    r = open_repo(repo_location(repo))
    doc = r.sign(run, step, key)
    out.print(f"signed {run} step {doc['step']} with {doc['signature']['key_id']} (content {doc['content'][:23]}…)")
