"""``luopan export --sign KEY``: a signature the OpenSSF model_signing tool verifies, offline (luopan.interop)."""

from __future__ import annotations

import os
import socket
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.signing import generate_key, load_signing_key, sign_for_model_signing

model_signing = pytest.importorskip("model_signing")

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network: signing and verifying with keys is meant to work offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    r = luopan.open(path, chunk_size=64 * 1024)
    rng = np.random.default_rng(0)
    r.save("run", 10, {"model": {"w": rng.standard_normal((256, 64)).astype(np.float32), "b": np.zeros(64)},
                       "optim": {"m": np.ones(8)}})
    return path


def verify(path, sig, pub):
    """model_signing's own verifier, the library form of `model_signing verify key PATH --signature SIG
    --public_key PUB`: raises ValueError on a mismatch."""
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(path, sig)


def test_ecdsa_keys_are_for_interop_only(tmp_path):
    key, pub = generate_key(tmp_path / "keys", "release", kind="ecdsa-p256")
    assert (key.name, pub.name) == ("release.key", "release.pub")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp256r1"
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    with pytest.raises(luopan.UsageError, match="model_signing interop only"):
        load_signing_key(key)
    with pytest.raises(luopan.UsageError, match="unknown key type"):
        generate_key(tmp_path / "keys", "x", kind="rsa")
    with pytest.raises(luopan.OutputPathError, match="never overwritten"):
        generate_key(tmp_path / "keys", "release", kind="ecdsa-p256")


def test_export_signed_verifies_with_model_signing_and_tampering_fails(repo, tmp_path):
    key, pub = generate_key(tmp_path / "keys", "ms", kind="ecdsa-p256")
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    luopan.open(repo).export("run", str(out), subtree="model")
    sig = sign_for_model_signing(out, key)
    assert sig == f"{out}.sig" and sorted(os.listdir(out.parent)) == ["model.safetensors", "model.safetensors.sig"]
    verify(out, sig, pub)  # success, offline

    _, other_pub = generate_key(tmp_path / "keys", "other", kind="ecdsa-p256")
    with pytest.raises(ValueError, match="Key mismatch"):
        verify(out, sig, other_pub)

    data = bytearray(out.read_bytes())
    data[-1] ^= 1
    out.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="Signature mismatch"):
        verify(out, sig, pub)


def test_a_directory_is_signed_with_the_signature_beside_it(tmp_path):
    key, pub = generate_key(tmp_path, "ms", kind="ecdsa-p256")
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"weights")
    (d / "adapter_config.json").write_text("{}")
    sig = sign_for_model_signing(d, key)
    assert sig == str(tmp_path / "adapter.sig")
    verify(d, sig, pub)
    (d / "adapter_config.json").write_text('{"r": 8}')
    with pytest.raises(ValueError, match="Signature mismatch"):
        verify(d, sig, pub)
    with pytest.raises(luopan.UsageError, match="inside the signed directory"):
        sign_for_model_signing(d, key, d / "model.sig")


def test_ed25519_and_other_keys_are_refused(repo, tmp_path):
    key, _ = generate_key(tmp_path / "keys", "luopan")  # Ed25519: luopan's own
    target = tmp_path / "f.bin"
    target.write_bytes(b"x")
    with pytest.raises(luopan.UsageError, match=r"accepts only elliptic-curve keys \(secp256r1, secp384r1, "
                                                r"secp521r1\).*luopan key gen .*--type ecdsa-p256"):
        sign_for_model_signing(target, key)
    k384 = ec.generate_private_key(ec.SECP256K1())
    bad = tmp_path / "k1.key"
    bad.write_bytes(k384.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    with pytest.raises(luopan.UsageError, match="secp256k1 key"):
        sign_for_model_signing(target, bad)
    assert not (tmp_path / "f.bin.sig").exists()

    out = tmp_path / "m.safetensors"
    r = cli("export", "-r", str(repo), "run", "-o", str(out), "--sign", str(key))
    assert r.exit_code == 2 and "Ed25519" in r.output and "ecdsa-p256" in r.output
    assert not out.exists() and not (tmp_path / "m.safetensors.sig").exists()  # refused before writing anything


def test_missing_model_signing_names_the_extra(tmp_path, monkeypatch):
    import sys

    key, _ = generate_key(tmp_path, "ms", kind="ecdsa-p256")
    target = tmp_path / "f.bin"
    target.write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "model_signing", None)
    monkeypatch.setitem(sys.modules, "model_signing.signing", None)
    with pytest.raises(luopan.MissingDependencyError, match=r'pip install "luopan\[interop\]"'):
        sign_for_model_signing(target, key)


def test_cli_key_gen_export_sign_then_model_signing_cli_verifies(repo, tmp_path):
    from click.testing import CliRunner as ClickRunner
    from model_signing._cli import main as model_signing_main

    r = cli("key", "gen", "-o", str(tmp_path / "keys"), "--name", "ms", "--type", "ecdsa-p256")
    assert r.exit_code == 0 and "model_signing" in r.output
    key, pub = tmp_path / "keys" / "ms.key", tmp_path / "keys" / "ms.pub"
    out = tmp_path / "dist" / "model.safetensors"
    out.parent.mkdir()
    r = cli("export", "-r", str(repo), "run", "10", "-o", str(out), "--subtree", "model", "--sign", str(key))
    assert r.exit_code == 0, r.output
    sig = f"{out}.sig"
    assert "wrote 2 tensors" in r.output
    assert f"model_signing verify key {out} --signature {sig} --public_key {pub}" in r.output

    # the documented command, through model_signing's own command line
    ms = ClickRunner()
    res = ms.invoke(model_signing_main, ["verify", "key", str(out), "--signature", sig, "--public_key", str(pub)])
    assert res.exit_code == 0 and "Verification succeeded" in res.output, res.output
    out.write_bytes(out.read_bytes()[:-1] + b" ")
    res = ms.invoke(model_signing_main, ["verify", "key", str(out), "--signature", sig, "--public_key", str(pub)])
    assert res.exit_code == 1 and "Verification failed" in res.output

    r = cli("key", "gen", "-o", str(tmp_path / "keys"), "--name", "x", "--type", "rsa")
    assert r.exit_code == 2 and "unknown key type" in r.output
