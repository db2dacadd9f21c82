"""Ed25519 keys, trusted-key lists and signed checkpoints (luopan.signing, repo.sign, verify --trusted-keys)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.signing import TrustedKeys, generate_key, load_signing_key


@pytest.fixture()
def keys(tmp_path):
    """A trusted key (its .pub in trusted/) and an untrusted one."""
    generate_key(tmp_path / "keys", "release")
    generate_key(tmp_path / "other", "rogue")
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted" / "release.pub").write_bytes((tmp_path / "keys" / "release.pub").read_bytes())
    return tmp_path


def test_keys_are_made_once_and_verify_only_what_they_signed(keys, monkeypatch):
    key_path = keys / "keys" / "release.key"
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    with pytest.raises(luopan.OutputPathError, match="never overwritten"):
        generate_key(keys / "keys", "release")
    key = load_signing_key(key_path)
    assert key.key_id.startswith("ed25519:") and len(key.key_id) == len("ed25519:") + 32
    trusted = TrustedKeys.load(keys / "trusted")
    sig = key.sign(b"payload")
    assert trusted.verify(b"payload", sig, "x") == key.key_id
    with pytest.raises(luopan.SignatureError, match="does not verify"):
        trusted.verify(b"payload!", sig, "x")
    with pytest.raises(luopan.SignatureError, match="does not verify"):
        trusted.verify(b"payload", {**sig, "sig": sig["sig"][:-4] + "AAA="}, "x")
    rogue = load_signing_key(keys / "other" / "rogue.key")
    with pytest.raises(luopan.UntrustedKeyError, match="not among the trusted keys"):
        trusted.verify(b"payload", rogue.sign(b"payload"), "x")
    with pytest.raises(luopan.UnsignedError):
        trusted.verify(b"payload", None, "x")
    with pytest.raises(luopan.SignatureError, match="malformed"):
        trusted.verify(b"payload", {"alg": "rsa"}, "x")
    monkeypatch.delenv("LUOPAN_TRUSTED_KEYS", raising=False)
    assert TrustedKeys.load() is None
    monkeypatch.setenv("LUOPAN_TRUSTED_KEYS", str(keys / "trusted"))
    assert set(TrustedKeys.load().keys) == {key.key_id}
    (keys / "empty").mkdir()
    with pytest.raises(luopan.UsageError, match="no \\*.pub"):
        TrustedKeys.load(keys / "empty")
    (keys / "bad.key").write_text("not a key")
    with pytest.raises(luopan.UsageError, match="luopan key gen"):
        load_signing_key(keys / "bad.key")


def test_signed_checkpoints_verify_and_every_failure_is_named(keys):
    repo = luopan.open(keys / "repo")
    for step in (1, 2, 3):
        repo.save("run", step, {"w": np.full(1000, step, np.float32), "note": "x"}, metrics={"loss": 1.0 / step})
    repo.sign("run", 1, keys / "keys" / "release.key")
    repo.sign("run", 2, keys / "other" / "rogue.key")  # signed, but not by a trusted key
    assert repo.verify("run", 1, trusted_keys=keys / "trusted").checkpoints == 1
    with pytest.raises(luopan.IntegrityError) as err:
        repo.verify("run", trusted_keys=keys / "trusted")
    kinds = sorted(type(p).__name__ for p in err.value.problems)
    assert kinds == ["UnsignedError", "UntrustedKeyError"], err.value.problems
    repo.verify("run")  # without trusted keys, signatures are not required

    # a forged signature file (right content digest, bytes signed by the rogue key under the trusted key's id)
    sig_dir = keys / "repo" / "refs" / "signatures" / "run" / "00000001"
    (sig_file,) = sig_dir.iterdir()
    doc = json.loads(sig_file.read_text())
    forged = load_signing_key(keys / "other" / "rogue.key").sign(b"something else")
    doc["signature"]["sig"] = forged["sig"]
    sig_file.write_text(json.dumps(doc))
    with pytest.raises(luopan.IntegrityError) as err:
        repo.verify("run", 1, trusted_keys=keys / "trusted")
    assert isinstance(err.value.problems[0], luopan.SignatureError)

    # a step deleted and saved again: the old signature is stale and covers nothing
    repo.sign("run", 3, keys / "keys" / "release.key")
    repo.delete("run", 3)
    assert not (keys / "repo" / "refs" / "signatures" / "run" / "00000003").exists() or \
        not list((keys / "repo" / "refs" / "signatures" / "run" / "00000003").iterdir())
    repo.save("run", 3, {"w": np.zeros(1000, np.float32), "note": "y"})
    repo.sign("run", 3, keys / "keys" / "release.key")
    repo.verify("run", 3, trusted_keys=keys / "trusted")
    other = json.loads(next(sig_dir.iterdir()).read_text())
    other["step"], other["content"] = 3, "blake3:" + "0" * 64  # a copy of another step's signature: stale
    (keys / "repo" / "refs" / "signatures" / "run" / "00000003" / sig_file.name).write_text(json.dumps(other))
    with pytest.raises(luopan.IntegrityError) as err:
        repo.verify("run", 3, trusted_keys=keys / "trusted")
    assert "other content" in str(err.value.problems[0])


def test_cli_key_gen_sign_and_verify(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["key", "gen", "-o", str(tmp_path / "k"), "--name", "ci"])
    assert r.exit_code == 0, r.output
    assert "ed25519:" in r.output
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted" / "ci.pub").write_bytes((tmp_path / "k" / "ci.pub").read_bytes())
    repo = luopan.open(tmp_path / "repo")
    repo.save("run", 5, {"w": np.ones(10)})
    repo.close()
    verify = ["verify", "-r", str(tmp_path / "repo"), "run", "--trusted-keys", str(tmp_path / "trusted")]
    r = runner.invoke(app, verify)
    assert r.exit_code == 3 and "no signature by a trusted key" in " ".join(r.output.split()), r.output
    r = runner.invoke(app, ["sign", "-r", str(tmp_path / "repo"), "run", "--key", str(tmp_path / "k" / "ci.key")])
    assert r.exit_code == 0 and "signed run step 5" in r.output, r.output
    r = runner.invoke(app, verify)
    assert r.exit_code == 0 and "signed by a trusted key" in " ".join(r.output.split()), r.output
    r = runner.invoke(app, ["key", "gen", "-o", str(tmp_path / "k"), "--name", "ci"])
    assert r.exit_code == 1 and "never overwritten" in r.output
