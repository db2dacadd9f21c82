"""Patch files (docs/format.md §13): create → apply round trips bit-exact against ``repo.export``, a plain safetensors
base (--from-file), row-delta entries, a wrong base refused naming both fingerprints, signatures and trust, atomic
output, bounded memory, apply into a repository, and the CLI."""

from __future__ import annotations

import json
import os
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import luopan
import luopan.patch
from luopan.cli.main import app
from luopan.patch import files as patch_files
from luopan.patch.container import PREFIX
from luopan.repository import parallel
from luopan.signing import generate_key

CHUNK = 64 * 1024
runner = CliRunner()


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = {f"layers.{i}.weight": torch.randn(256, 128, generator=g) for i in range(6)}
    m["emb"] = torch.randn(700, 64, generator=g).to(torch.bfloat16)
    m["bias"] = torch.zeros(10)
    m["empty"] = torch.zeros(0, 4)
    m["steps"] = torch.arange(5, dtype=torch.int64)
    m["nested/part"] = torch.ones(3, 3)  # a "/" in a key: escaped in key paths, kept in names
    return m


class Made:
    """A repository with two checkpoints of run "a" (step 2 changes one layer and adds an adapter), their exports,
    and a patch from step 1 to step 2 of the subtree "model"."""

    def __init__(self, root: os.PathLike[str]) -> None:
        self.root = str(root)
        self.repo = luopan.open(os.path.join(self.root, "repo"), chunk_size=CHUNK)
        self.m1 = model()
        self.repo.save("a", 1, {"model": self.m1, "optim": {"lr": 0.1, "m": torch.ones(4)}})
        self.m2 = {k: v.clone() for k, v in self.m1.items()}
        self.m2["layers.3.weight"][7] += 1
        self.m2["lora_A"] = torch.randn(4, 128)
        self.repo.save("a", 2, {"model": self.m2, "optim": {"lr": 0.1, "m": torch.ones(4)}})
        self.base = self.path("base.safetensors")
        self.target = self.path("target.safetensors")
        self.repo.export("a", self.base, 1, subtree="model")
        self.repo.export("a", self.target, 2, subtree="model")
        self.patch = self.path("update.lpatch")
        self.info = luopan.patch.create(self.repo, "a", 1, 2, self.patch, subtree="model")

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def target_bytes(self) -> bytes:
        return open(self.target, "rb").read()


@pytest.fixture
def made(tmp_path):
    m = Made(tmp_path)
    yield m
    m.repo.close()


def leftovers(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if ".tmp-" in n]


def test_round_trip_is_the_export_of_the_target_byte_for_byte(made):
    info = made.info
    assert info["tensors"] == len(made.m2) and info["changed_tensors"] == 2
    # only the changed chunk of layer 3 and the new adapter travel (one chunk each at 64 KiB)
    assert info["carried_chunks"] == 2 and info["carried_bytes"] == CHUNK + 4 * 128 * 4
    assert os.path.getsize(made.patch) < 2 * CHUNK
    out = made.path("new.safetensors")
    done = luopan.patch.apply(made.patch, made.base, out)
    assert open(out, "rb").read() == made.target_bytes()
    assert done["bytes"] == os.path.getsize(out) and done["bytes_from_patch"] == info["carried_bytes"]
    assert done["target_fingerprint"] == info["target_fingerprint"] == luopan.patch.fingerprint_file(out, CHUNK)
    assert done["base_fingerprint"] == luopan.patch.fingerprint_file(made.base, CHUNK)
    assert done["signed"] is False and done["signed_by"] is None
    assert leftovers(made.root) == []


def test_whole_checkpoint_and_patch_to_the_same_step(made):
    full = made.path("full.safetensors")
    made.repo.export("a", full, 2)
    base = made.path("base-full.safetensors")
    made.repo.export("a", base, 1)
    p = made.path("full.lpatch")
    luopan.patch.create(made.repo, "a", 1, 2, p)
    luopan.patch.apply(p, base, made.path("out.safetensors"))
    assert open(made.path("out.safetensors"), "rb").read() == open(full, "rb").read()
    same = luopan.patch.create(made.repo, "a", 2, 2, made.path("same.lpatch"), subtree="model")
    assert same["carried_chunks"] == 0 and same["base_fingerprint"] == same["target_fingerprint"]


def test_from_file_base_matches_unchanged_tensors_by_hash(made):
    p = made.path("from-file.lpatch")
    info = luopan.patch.create(made.repo, "a", None, 2, p, subtree="model", from_file=made.base)
    assert info["base_fingerprint"] == made.info["base_fingerprint"]  # file and checkpoint: the same fingerprint
    assert info["carried_chunks"] == made.info["carried_chunks"]
    # a base file written by safetensors itself (other tensor order, other header) has the same fingerprint
    from safetensors.torch import save_file

    other = made.path("other.safetensors")
    # (names as luopan export writes them: key paths, "/" in a key escaped as "~1")
    save_file({k.replace("/", "~1"): v.contiguous() for k, v in reversed(made.m1.items())}, other,
              metadata={"x": "y"})
    assert luopan.patch.fingerprint_file(other, CHUNK) == info["base_fingerprint"]
    out = made.path("new.safetensors")
    luopan.patch.apply(p, other, out)
    assert open(out, "rb").read() == made.target_bytes()
    with pytest.raises(luopan.UsageError, match="exactly one base"):
        luopan.patch.create(made.repo, "a", 1, 2, p, from_file=made.base)


def test_row_delta_entries_and_a_different_chunking_are_cut_again(tmp_path):
    repo = luopan.open(tmp_path / "repo", chunk_size=CHUNK,
                       delta_policy=luopan.DeltaPolicy(min_bytes=CHUNK, rebase_fraction=0.5))
    emb = torch.randn(4096, 32)
    repo.save("r", 1, {"emb": emb, "w": torch.randn(64, 64)})
    emb[[3, 900]] += 1
    repo.save("r", 2, {"emb": emb, "w": torch.randn(64, 64)})  # the first change is stored in full
    emb[[4000]] += 1
    repo.save("r", 3, {"emb": emb, "w": torch.randn(64, 64)})
    assert "delta" in repo.manifest("r", 3).entries[0]  # stored as a row delta: its chunks are not its bytes
    repo.export("r", tmp_path / "base.st", 1)
    repo.export("r", tmp_path / "target.st", 3)
    info = luopan.patch.create(repo, "r", 1, 3, tmp_path / "p.lpatch")
    assert info["carried_chunks"] == 3 + 1  # three emb chunks with a changed row, and w
    luopan.patch.apply(tmp_path / "p.lpatch", tmp_path / "base.st", tmp_path / "out.st")
    assert (tmp_path / "out.st").read_bytes() == (tmp_path / "target.st").read_bytes()
    back = luopan.patch.create(repo, "r", 3, 1, tmp_path / "back.lpatch")  # the delta entry as the base
    luopan.patch.apply(tmp_path / "back.lpatch", tmp_path / "target.st", tmp_path / "back.st")
    assert (tmp_path / "back.st").read_bytes() == (tmp_path / "base.st").read_bytes()
    assert back["base_fingerprint"] == info["target_fingerprint"]
    repo.close()


def test_wrong_base_is_refused_naming_both_fingerprints_and_nothing_is_written(made):
    out = made.path("new.safetensors")
    with open(out, "wb") as f:
        f.write(b"previous model")
    with pytest.raises(luopan.BaseMismatchError) as caught:
        luopan.patch.apply(made.patch, made.target, out)
    e = caught.value
    assert e.expected == made.info["base_fingerprint"] and e.actual == made.info["target_fingerprint"]
    assert e.expected in str(e) and e.actual in str(e) and "nothing was written" in str(e)
    assert open(out, "rb").read() == b"previous model" and leftovers(made.root) == []
    assert isinstance(e, luopan.StateMismatchError)


@pytest.fixture
def keys(tmp_path):
    priv, pub = generate_key(tmp_path / "keys", "release")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "release.pub").write_bytes(pub.read_bytes())
    other, other_pub = generate_key(tmp_path / "keys", "other")
    only_other = tmp_path / "trusted-other"
    only_other.mkdir()
    (only_other / "other.pub").write_bytes(other_pub.read_bytes())
    return {"key": priv, "trusted": trusted, "other": other, "only_other": only_other}


def test_signatures_and_trust(made, keys, monkeypatch):
    signed = made.path("signed.lpatch")
    info = luopan.patch.create(made.repo, "a", 1, 2, signed, subtree="model", sign_key=keys["key"])
    out = made.path("new.safetensors")
    done = luopan.patch.apply(signed, made.base, out, trusted_keys=keys["trusted"])
    assert done["signed_by"] == info["signed_by"] and info["signed_by"].startswith("ed25519:")
    assert open(out, "rb").read() == made.target_bytes()
    os.unlink(out)
    with pytest.raises(luopan.UnsignedError, match="not signed"):
        luopan.patch.apply(made.patch, made.base, out, trusted_keys=keys["trusted"])
    with pytest.raises(luopan.UntrustedKeyError, match="not among the trusted keys"):
        luopan.patch.apply(signed, made.base, out, trusted_keys=keys["only_other"])
    with pytest.raises(luopan.UnsignedError, match="no trusted keys"):
        luopan.patch.apply(made.patch, made.base, out, require_signature=True)
    monkeypatch.setenv("LUOPAN_TRUSTED_KEYS", str(keys["trusted"]))  # trust from the environment
    with pytest.raises(luopan.UnsignedError):
        luopan.patch.apply(made.patch, made.base, out)
    assert luopan.patch.apply(made.patch, made.base, out, require_signature=False)["signed_by"] is None
    os.unlink(out)
    # a changed header (here: one blob's hash, as if swapping in other content) breaks the signature
    data = bytearray(open(signed, "rb").read())
    at = data.index(b'"blobs":[["') + 11
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    tampered = made.path("tampered.lpatch")
    open(tampered, "wb").write(bytes(data))
    with pytest.raises(luopan.SignatureError, match="does not verify"):
        luopan.patch.apply(tampered, made.base, out)
    assert not os.path.exists(out) and leftovers(made.root) == []
    monkeypatch.delenv("LUOPAN_TRUSTED_KEYS")
    luopan.patch.apply(signed, made.base, out)  # without trusted keys a signature is not checked
    assert open(out, "rb").read() == made.target_bytes()


def test_damage_found_while_writing_leaves_the_existing_output_untouched(made):
    data = bytearray(open(made.patch, "rb").read())
    data[-10] ^= 0xFF  # inside the last blob: found only when that chunk is read
    bad = made.path("bad.lpatch")
    open(bad, "wb").write(bytes(data))
    out = made.path("new.safetensors")
    open(out, "wb").write(b"keep me")
    with pytest.raises(luopan.CorruptPatchError, match="nothing was written"):
        luopan.patch.apply(bad, made.base, out)
    assert open(out, "rb").read() == b"keep me" and leftovers(made.root) == []


def test_output_errors_before_any_work(made):
    with pytest.raises(luopan.OutputPathError, match="does not exist"):
        luopan.patch.apply(made.patch, made.base, made.path("missing/new.safetensors"))
    with pytest.raises(luopan.OutputPathError, match="is a directory"):
        luopan.patch.apply(made.patch, made.base, made.root)
    with pytest.raises(luopan.UsageError, match="exactly one destination"):
        luopan.patch.apply(made.patch, made.base)


def test_a_disk_without_room_fails_before_writing(made, monkeypatch):
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 10

    monkeypatch.setattr(patch_files.os, "statvfs", lambda p: Full(real(p)))
    out = made.path("new.safetensors")
    with pytest.raises(luopan.StorageFullError, match="nothing was written"):
        luopan.patch.apply(made.patch, made.base, out)
    assert not os.path.exists(out) and leftovers(made.root) == []


def test_memory_stays_bounded_whatever_the_model_size(tmp_path, monkeypatch):
    """A 24 MiB base and target (64 KiB chunks) applied with a 256 KiB buffer budget: Python allocations stay far
    below the model's size, and no read is larger than a chunk."""
    repo = luopan.open(tmp_path / "repo", chunk_size=CHUNK)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(12)}  # 12 x 2 MiB
    repo.save("big", 1, state)
    state["w5"][100] += 1
    state["w9"].mul_(2)
    repo.save("big", 2, state)
    repo.export("big", tmp_path / "base.st", 1)
    repo.export("big", tmp_path / "target.st", 2)
    luopan.patch.create(repo, "big", 1, 2, tmp_path / "p.lpatch")
    reads: list[int] = []
    real = patch_files.read_exact

    def recording(fd, out, offset):
        reads.append(len(out))
        return real(fd, out, offset)

    monkeypatch.setattr(patch_files, "BUFFER_BUDGET", 4 * CHUNK)
    monkeypatch.setattr("luopan.patch.prepare.read_exact", recording)
    monkeypatch.setattr("luopan.patch.basefile.read_exact", recording)
    tracemalloc.start()
    try:
        luopan.patch.apply(tmp_path / "p.lpatch", tmp_path / "base.st", tmp_path / "out.st")
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (tmp_path / "out.st").read_bytes() == (tmp_path / "target.st").read_bytes()
    # the base is read once, in chunks: hashed for its fingerprint and written from the same buffer
    assert max(reads) <= CHUNK and len(reads) >= 24 * 1024 * 1024 // CHUNK
    assert peak < 2 * 1024 * 1024, peak  # a 24 MiB model: buffers of a few chunks, never the model
    assert patch_files.workers_for(CHUNK) == min(parallel.WORKERS, 4) and patch_files.workers_for(1 << 30) == 1
    repo.close()


def test_writeback_starts_behind_the_written_prefix_on_whole_pages(made, monkeypatch):
    """Writeback is started only for finished whole pages, in order and never twice: no page is written to again
    while under writeback."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(patch_files, "WRITE_BEHIND", 4096)
    monkeypatch.setattr(patch_files.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n)))
    out = made.path("new.safetensors")
    luopan.patch.apply(made.patch, made.base, out)
    size = os.path.getsize(out)
    assert calls and calls[0][0] == 0
    assert all(off % patch_files.PAGE == 0 and (off + n) % patch_files.PAGE == 0 for off, n in calls)
    assert all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))  # contiguous, increasing, no overlap
    assert size - patch_files.PAGE - 4096 < calls[-1][0] + calls[-1][1] <= size
    assert open(out, "rb").read() == made.target_bytes()


def test_apply_into_a_repository_commits_a_checkpoint(made, tmp_path):
    other = luopan.open(tmp_path / "device-repo", chunk_size=CHUNK)
    done = luopan.patch.apply(made.patch, made.base, repo=other)
    assert (done["run"], done["step"]) == ("a", 2)
    got = other.load("a", 2)["model"]
    assert set(got) == set(made.m2) and all(torch.equal(got[k], made.m2[k]) for k in made.m2)
    again = luopan.patch.apply(made.patch, made.base, repo=other, run="copy", step=7)
    assert again["new_bytes"] == 0  # everything already in the repository
    assert isinstance(patch_files.available_memory(), int) and patch_files.available_memory() > 0
    monkey = pytest.MonkeyPatch()
    import luopan.patch.commit as patch_commit

    monkey.setattr(patch_commit, "available_memory", lambda: 1000)  # -r holds the whole target: refused up front
    try:
        with pytest.raises(luopan.UsageError, match="holds its whole target in memory.*-o FILE"):
            luopan.patch.apply(made.patch, made.path("no-such-base.st"), repo=other, run="big", step=1)
    finally:
        monkey.undo()
    other.export("copy", tmp_path / "exported.st", 7, subtree="model")
    assert luopan.patch.fingerprint_file(tmp_path / "exported.st", CHUNK) == made.info["target_fingerprint"]
    with pytest.raises(luopan.CheckpointExistsError):
        luopan.patch.apply(made.patch, made.base, repo=other)
    other.close()


class Ran:
    """A CLI run: exit code, and its output with rich's line wrapping undone (``json`` keeps it as printed)."""

    def __init__(self, result) -> None:
        self.exit_code = result.exit_code
        self.json = result.output
        self.output = " ".join(result.output.split())


@pytest.mark.parametrize("subtree,paths", [("model/", ["model/w", "model/x/y"]), ("model/w", ["model/w"]),
                                            ("model/x", ["model/x/y"])])
def test_subtrees_commit_back_under_their_key_paths(tmp_path, subtree, paths):
    r = luopan.open(tmp_path / "repo", chunk_size=CHUNK)
    r.save("a", 1, {"model": {"w": torch.ones(10), "x": {"y": torch.zeros(3)}}, "opt": torch.ones(2)})
    r.save("a", 2, {"model": {"w": torch.ones(10) * 2, "x": {"y": torch.zeros(3)}}, "opt": torch.ones(2)})
    r.export("a", tmp_path / "base.st", 1, subtree=subtree)
    luopan.patch.create(r, "a", 1, 2, tmp_path / "p.lpatch", subtree=subtree)
    device = luopan.open(tmp_path / "device", chunk_size=CHUNK)
    luopan.patch.apply(tmp_path / "p.lpatch", tmp_path / "base.st", repo=device)
    assert [e["path"] for e in device.manifest("a", 2).entries] == paths
    r.close()
    device.close()


def cli(*args: str) -> Ran:
    return Ran(runner.invoke(app, list(args), catch_exceptions=False))


def test_cli_create_and_apply(made, keys):
    p = made.path("cli.lpatch")
    r = cli("patch", "create", "-r", os.path.join(made.root, "repo"), "a", "--from", "1", "--to", "2", "-o", p,
            "--subtree", "model", "--sign", str(keys["key"]), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.json)
    assert info["carried_chunks"] == 2 and info["signed_by"].startswith("ed25519:")
    out = made.path("cli.safetensors")
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "--trusted-keys", str(keys["trusted"]))
    assert r.exit_code == 0, r.output
    assert "every chunk verified" in r.output and "signed by trusted key" in r.output
    assert open(out, "rb").read() == made.target_bytes()
    r = cli("patch", "apply", p, "--base", made.target, "-o", out)
    assert r.exit_code == 1 and "not the base this patch was made for" in r.output
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "--trusted-keys", str(keys["only_other"]))
    assert r.exit_code == 3 and "not among the trusted keys" in r.output
    r = cli("patch", "create", "-r", os.path.join(made.root, "repo"), "a", "--to", "2", "-o", made.path("f.lpatch"),
            "--subtree", "model", "--from-file", made.base)
    assert r.exit_code == 0 and "2 of" in r.output and "unsigned" in r.output
    r = cli("patch", "apply", made.path("f.lpatch"), "--base", made.base, "-o", out, "--json")
    assert r.exit_code == 0 and json.loads(r.json[r.json.index("{"):])["bytes_from_patch"] == info["carried_bytes"]
    device = os.path.join(made.root, "device")
    luopan.open(device).close()
    r = cli("patch", "apply", p, "--base", made.base, "-r", device, "--run", "dev", "--step", "3")
    assert r.exit_code == 0 and "dev step 3" in r.output
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "-r", device)
    assert r.exit_code == 2 and "not both" in r.output
    r = cli("patch", "apply", made.base, "--base", made.base, "-o", out)
    assert r.exit_code == 3 and "not a luopan patch" in r.output
    size = os.path.getsize(out)
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "--max-output", str(size - 1))
    assert r.exit_code == 2 and "over the limit" in r.output
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "--max-output", str(size),
            "--expect-target", info["target_fingerprint"])
    assert r.exit_code == 0, r.output
    r = cli("patch", "apply", p, "--base", made.base, "-o", out, "--expect-target", info["base_fingerprint"])
    assert r.exit_code != 0 and "not the expected" in r.output


def test_read_header_says_what_a_patch_makes_before_it_is_applied(made, keys):
    h = luopan.patch.read_header(made.patch)
    assert (h["base_fingerprint"], h["target_fingerprint"]) == (made.info["base_fingerprint"],
                                                              made.info["target_fingerprint"])
    assert (h["chunk_size"], h["target_tensors"], h["run"], h["step"], h["subtree"]) == (CHUNK, len(made.m2), "a", 2,
                                                                                        "model")
    assert h["target_bytes"] == sum(v.numel() * v.element_size() for v in made.m2.values())
    assert h["patch_bytes"] == os.path.getsize(made.patch) and (h["signed"], h["signed_by"]) == (False, None)
    signed = made.path("signed.lpatch")
    info = luopan.patch.create(made.repo, "a", 1, 2, signed, subtree="model", sign_key=keys["key"])
    assert luopan.patch.read_header(signed, trusted_keys=keys["trusted"])["signed_by"] == info["signed_by"]
    assert luopan.patch.read_header(signed)["signed"] and luopan.patch.read_header(signed)["signed_by"] is None
    with pytest.raises(luopan.UnsignedError):
        luopan.patch.read_header(made.patch, trusted_keys=keys["trusted"])
    with pytest.raises(luopan.UntrustedKeyError):
        luopan.patch.read_header(signed, trusted_keys=keys["only_other"])


def test_expect_target_and_max_output_are_refused_before_the_base_is_read(made):
    out = made.path("new.safetensors")
    missing = made.path("no-such-base.st")  # never opened: each refusal comes first
    with pytest.raises(luopan.StateMismatchError, match="not the expected") as caught:
        luopan.patch.apply(made.patch, missing, out, expect_target=made.info["base_fingerprint"])
    assert (caught.value.expected, caught.value.actual) == (made.info["base_fingerprint"],
                                                             made.info["target_fingerprint"])
    size = len(made.target_bytes())
    with pytest.raises(luopan.UsageError, match="over the limit"):
        luopan.patch.apply(made.patch, missing, out, max_output_bytes=size - 1)
    with pytest.raises(luopan.UsageError, match="needs out_path"):
        luopan.patch.apply(made.patch, missing, repo=made.repo, max_output_bytes=size)
    assert not os.path.exists(out) and leftovers(made.root) == []
    done = luopan.patch.apply(made.patch, made.base, out, expect_target=made.info["target_fingerprint"],
                              max_output_bytes=size)
    assert done["bytes"] == size and open(out, "rb").read() == made.target_bytes()


def test_create_refuses_a_header_readers_would_refuse(made, monkeypatch):
    monkeypatch.setattr(sys.modules["luopan.patch.creating"], "MAX_HEADER_BYTES", 100)
    with pytest.raises(luopan.UsageError, match="over the 100-byte limit readers enforce"):
        luopan.patch.create(made.repo, "a", 1, 2, made.path("big.lpatch"), subtree="model")
    assert not os.path.exists(made.path("big.lpatch")) and leftovers(made.root) == []


def test_prefix_layout(made):
    head = open(made.patch, "rb").read(PREFIX.size)
    magic, version, hlen, slen, reserved = PREFIX.unpack(head)
    assert (magic, version, slen, reserved) == (b"LUOPANPT", 1, 0, 0)
    header = json.loads(open(made.patch, "rb").read()[PREFIX.size : PREFIX.size + hlen])
    assert header["format"] == "luopan-patch" and header["subtree"] == "model" and header["chunk_size"] == CHUNK
    assert os.path.getsize(made.patch) == PREFIX.size + hlen + header["body_bytes"]
    assert np.isclose(header["target"]["bytes"], sum(v.numel() * v.element_size() for v in made.m2.values()))
