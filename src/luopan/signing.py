"""Ed25519 keys, signatures and trusted-key lists (docs/format.md §14), through ``cryptography``.

    luopan.signing.generate_key("keys")                    # keys/luopan.key (private, 0600) + keys/luopan.pub
    key = luopan.signing.load_signing_key("keys/luopan.key")
    sig = key.sign(data)                                    # {"alg": "ed25519", "key_id": "ed25519:…", "sig": "…"}
    trusted = luopan.signing.TrustedKeys.load("trusted/")  # every *.pub in the directory (or LUOPAN_TRUSTED_KEYS)
    trusted.verify(data, sig, "patch update.lpatch")       # the key id, or SignatureError / UntrustedKeyError

For the OpenSSF ``model_signing`` tool, which accepts only elliptic-curve keys, ``generate_key(dir, kind="ecdsa-p256")``
makes a P-256 pair and ``sign_for_model_signing(path, key)`` writes ``<path>.sig`` (luopan.interop). Such a key is for
that interop only: luopan's own signatures stay Ed25519.

A key id is ``ed25519:`` and the first 32 hex digits of the BLAKE3 of the raw 32-byte public key, so the same key
has the same id wherever its file lies and whatever it is called. A trusted-keys directory is an allowlist: a
signature verifies only with a key found there.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ._files import write_atomic
from .errors import (
    InvalidNameError,
    OutputPathError,
    SignatureError,
    UnsignedError,
    UntrustedKeyError,
    UsageError,
)

ALG = "ed25519"
ENV_TRUSTED = "LUOPAN_TRUSTED_KEYS"
MAX_KEY_FILE = 16 << 10  # a PEM Ed25519 key is < 200 bytes: anything this large is not one
MAX_TRUSTED = 1024
KEY_KINDS = ("ed25519", "ecdsa-p256")  # ecdsa-p256: for model_signing interop only (luopan.interop)


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALG}:{blake3.blake3(raw).hexdigest()[:32]}"


def _read_small(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > MAX_KEY_FILE:
            raise UsageError(f"{path} is not a {what}: {path.stat().st_size} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class SigningKey:
    """A private Ed25519 key and its id."""

    private: Ed25519PrivateKey
    key_id: str
    path: str = ""

    def sign(self, data: bytes) -> dict[str, str]:
        """The signature document of ``data``."""
        return {"alg": ALG, "key_id": self.key_id, "sig": base64.b64encode(self.private.sign(data)).decode()}


def generate_key(directory: str | os.PathLike[str], name: str = "luopan", kind: str = "ed25519") -> tuple[Path, Path]:
    """A new key pair in ``directory``: ``<name>.key`` (PKCS#8 PEM, mode 0600, never overwritten) and ``<name>.pub``
    (SubjectPublicKeyInfo PEM, the public key to hand out). Returns (private path, public path). ``kind`` is
    "ed25519" (luopan's signatures) or "ecdsa-p256" (``export --sign`` for the OpenSSF model_signing tool only)."""
    if kind not in KEY_KINDS:
        raise UsageError(f"unknown key type {kind!r}: use one of {', '.join(KEY_KINDS)}")
    if not name or "/" in name or name.startswith(".") or len(name) > 100 or "\x00" in name:
        raise InvalidNameError(f"invalid key name {name!r}: use letters, digits, '-', '_' (e.g. 'release')")
    out = Path(directory)
    private: Ed25519PrivateKey | ec.EllipticCurvePrivateKey = (
        Ed25519PrivateKey.generate() if kind == "ed25519" else ec.generate_private_key(ec.SECP256R1()))
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    pub = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    key_path, pub_path = out / f"{name}.key", out / f"{name}.pub"
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise OutputPathError(17, f"{key_path} exists: a key is never overwritten (choose another --name)") from None
    except OSError as exc:
        raise OutputPathError(exc.errno or 5, f"cannot write {key_path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        write_atomic(pub_path, pub)
    except OSError as exc:
        key_path.unlink(missing_ok=True)
        raise OutputPathError(exc.errno or 5, f"cannot write the key pair in {out}: {exc.strerror or exc}") from None
    return key_path, pub_path


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """The private key in a ``.key`` file written by ``generate_key`` (or any unencrypted PKCS#8 Ed25519 PEM)."""
    p = Path(path)
    data = _read_small(p, "private key")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{p} is not an unencrypted PEM private key ({exc}); make one with `luopan key gen`") \
            from None
    if isinstance(private, ec.EllipticCurvePrivateKey):
        raise UsageError(f"{p} is an elliptic-curve ({private.curve.name}) key: EC keys are for model_signing interop "
                         "only (luopan export --sign); luopan's own signatures need an Ed25519 key (`luopan key gen`)")
    if not isinstance(private, Ed25519PrivateKey):
        raise UsageError(f"{p} is a {type(private).__name__}, not an Ed25519 key; make one with `luopan key gen`")
    return SigningKey(private, key_id(private.public_key()), str(p))


def sign_for_model_signing(path: str | os.PathLike[str], key_path: str | os.PathLike[str],
                           signature_path: str | os.PathLike[str] | None = None) -> str:
    """Sign a file or directory for the OpenSSF model_signing tool with an EC private key; the signature's path
    (``<path>.sig`` by default). See luopan.interop.sign_for_model_signing."""
    from .interop import sign_for_model_signing as sign

    return sign(path, key_path, signature_path)


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    p = Path(path)
    data = _read_small(p, "public key")
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{p} is not a PEM public key ({exc})") from None
    if not isinstance(public, Ed25519PublicKey):
        raise UsageError(f"{p} is a {type(public).__name__}, not an Ed25519 public key"
                         + (" (EC keys are for model_signing interop only)"
                            if isinstance(public, ec.EllipticCurvePublicKey) else ""))
    return public


@dataclass(frozen=True)
class TrustedKeys:
    """An allowlist of public keys by id."""

    keys: dict[str, Ed25519PublicKey]
    source: str

    @classmethod
    def load(cls, directory: str | os.PathLike[str] | None = None) -> TrustedKeys | None:
        """Every ``*.pub`` file of ``directory`` (else of $LUOPAN_TRUSTED_KEYS); None when neither is given. A
        directory that is missing, unreadable or holds no key is an error: trust was asked for."""
        where = os.fspath(directory) if directory is not None else os.environ.get(ENV_TRUSTED) or None
        if where is None:
            return None
        d = Path(where)
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".pub") and not n.startswith("."))
        except OSError as exc:
            raise UsageError(f"cannot read the trusted keys directory {d}: {exc.strerror or exc}") from None
        if len(names) > MAX_TRUSTED:
            raise UsageError(f"{d} holds {len(names)} public keys; at most {MAX_TRUSTED} are read")
        keys = {}
        for n in names:
            public = load_public_key(d / n)
            keys[key_id(public)] = public
        if not keys:
            raise UsageError(f"the trusted keys directory {d} holds no *.pub file: copy the publisher's public key "
                             "there (luopan key gen writes NAME.pub)")
        return cls(keys, str(d))

    def verify(self, data: bytes, signature: Any, what: str) -> str:
        """The id of the trusted key whose signature over ``data`` this is; raises UnsignedError (no signature),
        UntrustedKeyError (a key not in the list) or SignatureError (it does not verify), naming ``what``."""
        if signature is None:
            raise UnsignedError(f"{what} is not signed, and trusted keys ({self.source}) require a signature")
        if not isinstance(signature, dict) or signature.get("alg") != ALG or \
                not isinstance(signature.get("key_id"), str) or not isinstance(signature.get("sig"), str):
            raise SignatureError(f"{what} has a malformed signature (expected alg {ALG!r}, key_id, sig)")
        public = self.keys.get(signature["key_id"])
        if public is None:
            raise UntrustedKeyError(f"{what} is signed by key {signature['key_id'][:48]}, which is not among the "
                                    f"trusted keys in {self.source}")
        try:
            raw = base64.b64decode(signature["sig"], validate=True)
            public.verify(raw, data)
        except (InvalidSignature, binascii.Error, ValueError):
            raise SignatureError(f"{what}: the signature by {signature['key_id']} does not verify — the signed "
                                 "content was changed, or it was not signed by that key") from None
        return str(signature["key_id"])


def check_signature(trusted: TrustedKeys | None, data: bytes, signature: Any, what: str, *,
                    required: bool | None = None) -> str | None:
    """Verify when trusted keys are given (or ``required``); without them a signature is not checked (None)."""
    if trusted is None:
        if required:
            raise UnsignedError(f"{what}: a signature is required but no trusted keys were given (--trusted-keys "
                                f"DIR or ${ENV_TRUSTED})")
        return None
    return trusted.verify(data, signature, what)
