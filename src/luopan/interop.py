"""Signatures the OpenSSF ``model_signing`` tool verifies (``luopan export --sign KEY``), offline, with an EC key.

    luopan.signing.generate_key("keys", "release", kind="ecdsa-p256")  # keys/release.key + keys/release.pub
    luopan.interop.sign_for_model_signing("out/model.safetensors", "keys/release.key")  # out/model.safetensors.sig
    # then, anywhere, with only the public key (one command line):
    #   model_signing verify key out/model.safetensors --signature out/model.safetensors.sig
    #       --public_key keys/release.pub

model_signing (the ``model-signing`` package, ``pip install "luopan[interop]"``) signs with Sigstore (online) or,
offline, with an elliptic-curve private key on secp256r1, secp384r1 or secp521r1: its bundle records an ECDSA signature
over an in-toto statement of the SHA-256 of every signed file, and no transparency-log entry. Ed25519, luopan's own key
type, is not among the curves it accepts, so this bridge takes an EC key (``luopan key gen --type ecdsa-p256``), which
luopan in turn never uses for its own signatures. The signed path is the exported file itself (a single-file model);
the signature lies beside it, so it is not part of what is signed. model_signing is imported only here, on first use
(model-signing 1.1.1 imports pyOpenSSL without declaring it: the interop extra lists both).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .errors import MissingDependencyError, OutputPathError, UsageError

CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model_signing 1.1's EC signer accepts
INSTALL = 'pip install "luopan[interop]"'
MAX_KEY_FILE = 16 << 10


def require_model_signing() -> Any:
    """The model_signing package; MissingDependencyError naming the extra when it (or pyOpenSSL) is missing."""
    try:
        import model_signing.signing  # imports OpenSSL too: model-signing 1.1.1 needs pyOpenSSL, undeclared
    except ImportError as exc:
        raise MissingDependencyError(f"signing for model_signing needs the model-signing package ({exc}): "
                                     f"{INSTALL}") from exc
    import model_signing

    return model_signing


def check_key(key_path: str | os.PathLike[str]) -> Path:
    """``key_path`` if it is an unencrypted PEM private key model_signing can sign with; a UsageError saying why not
    (an Ed25519 key: how to make an EC one) otherwise."""
    p = Path(key_path)
    try:
        if p.stat().st_size > MAX_KEY_FILE:
            raise UsageError(f"{p} is not a private key: {p.stat().st_size} bytes")
        data = p.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the private key {p}: {exc.strerror or exc}") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{p} is not an unencrypted PEM private key ({exc}); make one for model_signing with "
                         "`luopan key gen --type ecdsa-p256`") from None
    make = "make one with `luopan key gen -o DIR --name NAME --type ecdsa-p256`"
    if isinstance(private, Ed25519PrivateKey):
        raise UsageError(f"{p} is an Ed25519 key: the model_signing tool accepts only elliptic-curve keys "
                         f"({', '.join(CURVES)}), so --sign needs one — {make} (luopan's own signatures, "
                         "`luopan sign`, keep using the Ed25519 key)")
    if not isinstance(private, ec.EllipticCurvePrivateKey) or private.curve.name not in CURVES:
        what = private.curve.name if isinstance(private, ec.EllipticCurvePrivateKey) else type(private).__name__
        raise UsageError(f"{p} is a {what} key: the model_signing tool accepts only elliptic-curve keys "
                         f"({', '.join(CURVES)}); {make}")
    return p


def sign_for_model_signing(path: str | os.PathLike[str], key_path: str | os.PathLike[str],
                           signature_path: str | os.PathLike[str] | None = None) -> str:
    """Sign the file (or directory) ``path`` with the EC private key ``key_path`` in model_signing's format (a
    Sigstore bundle, offline: no network, no transparency log); write it to ``signature_path`` (``<path>.sig`` by
    default, replaced atomically) and return that path. Verify with ``model_signing verify key PATH --signature SIG
    --public_key KEY.pub`` (or model_signing.verifying.Config().use_elliptic_key_verifier(...).verify(PATH, SIG))."""
    key = check_key(key_path)
    ms = require_model_signing()
    target = Path(path)
    if not target.exists():
        raise UsageError(f"cannot sign {target}: it does not exist")
    sig = Path(signature_path) if signature_path is not None else target.with_name(target.name + ".sig")
    if target.is_dir() and sig.resolve().is_relative_to(target.resolve()):
        raise UsageError(f"the signature {sig} would lie inside the signed directory {target}: put it beside it")
    tmp = sig.with_name(f".{sig.name}.tmp")
    try:
        ms.signing.Config().use_elliptic_key_signer(private_key=key).sign(target, tmp)
        os.replace(tmp, sig)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputPathError(exc.errno or 5, f"cannot write the signature {sig}: {exc.strerror or exc}") from None
    except ValueError as exc:  # model_signing's own refusals (a symlinked model, an unsupported key)
        tmp.unlink(missing_ok=True)
        raise UsageError(f"model_signing could not sign {target}: {exc}") from None
    return str(sig)
