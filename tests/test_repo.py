"""The public API: save/load/load_into/checkpoints/verify, incrementality, errors for bad input."""

import json
import math
import os

import numpy as np
import pytest
import torch

import luopan
from luopan.format.canonical import inflate_json
from luopan.format import FORMAT_VERSION

NEWER = FORMAT_VERSION + 1  # a format this luopan does not read
from luopan.format.canonical import seal, unseal


def make_state(seed=0, n=4, rows=256, cols=256):
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"l{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)},
            "step": seed, "np": np.arange(1000, dtype=np.float32) + seed}


def test_open_creates_and_reopens(repo_path):
    r = luopan.open(repo_path)
    assert (repo_path / "luopan.json").exists()
    r2 = luopan.open(repo_path)
    assert r2.config.repo_id == r.config.repo_id


def test_open_refuses_conflicting_options_and_non_repo_dirs(tmp_path):
    p = tmp_path / "r"
    luopan.open(p, compression="zstd")
    with pytest.raises(luopan.ConfigConflictError, match="compression"):
        luopan.open(p, compression="none")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(luopan.NotARepositoryError, match="not empty"):
        luopan.open(junk)
    assert (junk / "notes.txt").read_text() == "mine"
    with pytest.raises(luopan.RepoNotFoundError, match="luopan init"):
        luopan.open(tmp_path / "absent", create=False)
    with pytest.raises(luopan.RepoExistsError):
        luopan.init(p)


def test_save_load_latest_and_by_step(repo):
    a, b = make_state(1), make_state(2)
    repo.save("run-a", 100, a, metrics={"loss": 0.52})
    repo.save("run-a", 200, b, metrics={"loss": 0.41})
    latest = repo.load("run-a")
    assert latest["step"] == 2 and torch.equal(latest["model"]["l0.weight"], b["model"]["l0.weight"])
    first = repo.load("run-a", step=100)
    assert first["step"] == 1 and np.array_equal(first["np"], a["np"])
    infos = repo.checkpoints("run-a")
    assert [i.step for i in infos] == [100, 200]
    assert [i.metrics["loss"] for i in infos] == [0.52, 0.41]
    assert repo.runs() == ["run-a"]


def test_second_save_writes_only_new_chunks(tmp_path):
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    s = make_state(0)
    first = repo.save("r", 1, s)
    assert first.new_bytes == first.logical_bytes
    s["model"]["l2.weight"][10, 3] += 1.0  # one row of one tensor changes: one 64 KiB chunk
    second = repo.save("r", 2, s)
    # exactly the changed 64-row chunk of one weight; the "step" scalar lives in the manifest, not in a chunk
    assert second.new_chunks == 1
    assert second.new_bytes == 64 * 1024
    assert second.stored_bytes < 70 * 1024
    assert torch.equal(repo.load("r")["model"]["l2.weight"], s["model"]["l2.weight"])
    # a pack file count of O(new bytes / pack size): one pack for this save
    assert second.chunks == first.chunks


def test_saving_existing_step_needs_overwrite(repo):
    repo.save("r", 5, {"x": np.zeros(3)})
    with pytest.raises(luopan.CheckpointExistsError, match="overwrite=True"):
        repo.save("r", 5, {"x": np.ones(3)})
    assert np.array_equal(repo.load("r", 5)["x"], np.zeros(3))
    repo.save("r", 5, {"x": np.ones(3)}, overwrite=True)
    assert np.array_equal(repo.load("r", 5)["x"], np.ones(3))


@pytest.mark.parametrize("run", ["", "../x", "a/b", "-lead", "x" * 129, "spa ce", None])
def test_invalid_run_names(repo, run):
    with pytest.raises(luopan.InvalidNameError, match="invalid run name"):
        repo.save(run, 0, {})


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, 10**15])
def test_invalid_steps(repo, step):
    with pytest.raises(luopan.InvalidNameError, match="invalid step"):
        repo.save("r", step, {})


def test_bad_metrics_and_metadata_refused_before_writing(repo):
    with pytest.raises(luopan.UnsupportedValueError, match="metadata"):
        repo.save("r", 0, {"x": np.zeros(3)}, metadata={"when": object()})
    with pytest.raises(luopan.UnsupportedValueError, match="metrics"):
        repo.save("r", 0, {"x": np.zeros(3)}, metrics={"loss": [1, 2]})
    assert repo.steps("r") == [] and list(repo.store.list("packs/")) == []


def test_metrics_accept_tensors_and_nonfinite(repo):
    repo.save("r", 0, {}, metrics={"loss": torch.tensor(0.25), "acc": np.float32(0.5), "div": float("inf")})
    m = repo.checkpoints("r")[0].metrics
    assert m["loss"] == 0.25 and m["acc"] == 0.5 and math.isinf(m["div"])


def test_missing_checkpoint_errors_name_what_exists(repo):
    with pytest.raises(luopan.CheckpointNotFoundError, match="no checkpoints yet"):
        repo.load("nope")
    repo.save("r", 3, {})
    with pytest.raises(luopan.CheckpointNotFoundError, match="committed steps: 3"):
        repo.load("r", 4)
    with pytest.raises(KeyError):  # the matching built-in
        repo.load("r", 4)


def test_load_into_updates_in_place(repo):
    s = make_state(3)
    s["opt"] = {"lr": 0.1}
    repo.save("r", 1, s)
    target = make_state(9)
    target["opt"] = {"lr": 0.5}
    w = target["model"]["l0.weight"]
    tt = torch.zeros(256, 256).t()  # non-contiguous target
    target["model"]["l1.weight"] = tt
    out = repo.load_into("r", target)
    assert out is target
    assert target["model"]["l0.weight"] is w and torch.equal(w, s["model"]["l0.weight"])
    assert torch.equal(tt, s["model"]["l1.weight"])
    assert np.array_equal(target["np"], s["np"])


def test_load_into_reports_every_mismatch_before_touching_anything(repo):
    repo.save("r", 1, {"a": torch.ones(4), "b": torch.ones(2, 2), "c": torch.ones(3), "extra": torch.ones(1)})
    target = {"a": torch.zeros(5), "b": torch.zeros(2, 2, dtype=torch.float64), "c": torch.zeros(3),
              "new": torch.zeros(1)}
    with pytest.raises(luopan.StateMismatchError) as exc:
        repo.load_into("r", target)
    msg = str(exc.value)
    for needle in ["'a'", "(4,)", "(5,)", "'b'", "float64", "missing in checkpoint: 'new'", "unexpected", "'extra'",
                   "strict=False"]:
        assert needle in msg
    assert torch.equal(target["c"], torch.zeros(3))  # untouched: checks come first
    with pytest.raises(ValueError):
        repo.load_into("r", target)
    ok = {"c": torch.zeros(3), "new": torch.zeros(1)}
    repo.load_into("r", ok, strict=False)
    assert torch.equal(ok["c"], torch.ones(3)) and torch.equal(ok["new"], torch.zeros(1))


def test_verify_reports_ok_and_counts(repo):
    repo.save("a", 1, make_state(1))
    repo.save("a", 2, make_state(1))
    repo.save("b", 1, make_state(2))
    rep = repo.verify()
    assert rep.ok and rep.checkpoints == 3
    assert repo.verify("a", 2).checkpoints == 1
    with pytest.raises(luopan.CheckpointNotFoundError):
        repo.verify("zzz")


def test_manifest_contents(repo, tmp_path, monkeypatch):
    import subprocess

    from luopan.checkpoint import environment

    work = tmp_path / "work"  # a git work tree of its own, so the test does not depend on where it runs
    work.mkdir()
    git = ["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=work, check=True)
    (work / "f").write_text("1")
    subprocess.run([*git, "add", "f"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=work, check=True)
    (work / "f").write_text("2")  # dirty
    monkeypatch.chdir(work)
    environment._code_version.cache_clear()
    repo.save("r", 7, make_state(1), metrics={"loss": 1.5}, metadata={"note": "hi"})
    environment._code_version.cache_clear()
    raw = next(repo.store.list("runs/r/ckpt/"))
    assert raw == "runs/r/ckpt/00000007.json"
    doc = unseal(inflate_json(repo.store.get(raw)))
    # version 1, or 5 where compression="auto" (the default) stored a chunk with the float codec (docs/format.md §6.1)
    assert doc["format_version"] == (5 if '"bytegroup"' in json.dumps(doc["entries"]) else 1)
    assert doc["run"] == "r" and doc["step"] == 7
    assert doc["metrics"] == {"loss": 1.5} and doc["metadata"] == {"note": "hi"}
    assert {"python", "numpy", "torch", "host"} <= doc["environment"].keys()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    assert doc["code"] == {"commit": head, "dirty": True}
    e = doc["entries"][0]
    assert e["path"] == "model/l0.weight" and e["dtype"] == "float32" and e["shape"] == [256, 256]
    assert e["chunking"] == "rows" and len(e["chunks"][0]) == 7
    assert doc["fingerprint"].startswith("blake3:")
    # same structure, different values -> same fingerprint; different shape -> different
    repo.save("r", 8, make_state(2))
    repo.save("r", 9, make_state(2, rows=128))
    fp = [c.fingerprint for c in repo.checkpoints("r")]
    assert fp[0] == fp[1] != fp[2]
    ref = json.loads(repo.store.get("refs/runs/r/latest.json"))
    assert ref["step"] == 9 and ref["manifest"] == "runs/r/ckpt/00000009.json"
    assert ref["manifest_checksum"] == json.loads(inflate_json(repo.store.get(ref["manifest"])))["checksum"]


def test_code_version_absent_outside_git(tmp_path, monkeypatch):
    from luopan.checkpoint import environment

    environment._code_version.cache_clear()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    r = luopan.open(tmp_path / "r")
    r.save("r", 0, {})
    assert "code" not in r.manifest("r").doc
    environment._code_version.cache_clear()


def test_chunks_are_row_aligned_and_packs_bounded(tmp_path):
    repo = luopan.open(tmp_path / "r", chunk_size=10_000, pack_size=64 * 1024)
    emb = torch.randn(1000, 30)  # 120-byte rows: 83 rows per chunk
    info = repo.save("r", 0, {"emb": emb})
    m = repo.manifest("r")
    sizes = [c[4] for c in m.entries[0]["chunks"]]
    assert all(s % 120 == 0 for s in sizes) and sizes[0] == 83 * 120
    packs = list(repo.store.list("packs/"))
    assert len(packs) == math.ceil(info.new_bytes / (64 * 1024)) == len(m.packs)


def test_zstd_repository_roundtrip_and_smaller(tmp_path):
    repo = luopan.open(tmp_path / "z", compression="zstd:3")
    state = {"ids": torch.arange(200_000) % 17, "w": torch.randn(100, 100)}
    info = repo.save("r", 0, state)
    assert info.stored_bytes < info.logical_bytes / 4
    out = repo.load("r")
    assert torch.equal(out["ids"], state["ids"]) and torch.equal(out["w"], state["w"])
    assert repo.verify().ok


def test_memory_repository():
    repo = luopan.open("memory://")
    repo.save("r", 0, {"x": torch.ones(10)})
    assert torch.equal(repo.load("r")["x"], torch.ones(10))


def test_newer_repo_format_refused(repo_path):
    luopan.open(repo_path)
    doc = unseal((repo_path / "luopan.json").read_bytes())
    doc["format_version"] = NEWER
    (repo_path / "luopan.json").write_bytes(seal(doc))
    with pytest.raises(luopan.UnsupportedFormatError, match=f"format_version {NEWER}.*upgrade luopan"):
        luopan.open(repo_path)


def test_temp_leftovers_cleaned_on_open(repo_path):
    from luopan.store.local import TMP_MARK, _HOST

    repo = luopan.open(repo_path)
    repo.save("r", 1, {"x": np.zeros(10)})
    leftover = repo_path / "runs" / "r" / "ckpt" / f"00000002.json{TMP_MARK}{_HOST}-999999999-dead"
    leftover.write_bytes(b"partial")
    assert repo.steps("r") == [1]  # never listed
    luopan.open(repo_path)
    assert not leftover.exists()
    assert sorted(os.listdir(repo_path / "runs" / "r" / "ckpt")) == ["00000001.json"]


def test_export_subtree_and_unsupported_dtype(repo, tmp_path):
    from safetensors import safe_open

    state = {"model": {"emb": torch.randn(300, 64).to(torch.bfloat16), "fp8": torch.randn(5).to(torch.float8_e4m3fn)},
             "extra": {"c": torch.ones(2, dtype=torch.complex128)}, "step": 4}
    repo.save("r", 4, state, metrics={"loss": 1.0})
    info = repo.export("r", tmp_path / "model.safetensors", subtree="model")
    assert info["tensors"] == 2
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["emb", "fp8"]
        assert f.metadata()["luopan.step"] == "4"
        assert torch.equal(f.get_tensor("emb").view(torch.int16), state["model"]["emb"].view(torch.int16))
        assert torch.equal(f.get_tensor("fp8").view(torch.uint8), state["model"]["fp8"].view(torch.uint8))
    with pytest.raises(luopan.UnsupportedValueError, match="complex128.*--subtree"):
        repo.export("r", tmp_path / "all.safetensors")
    assert not (tmp_path / "all.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_only_canonical_manifest_names_count_as_steps(repo, repo_path):
    repo.save("r", 100, {"x": np.zeros(2)})
    ckpt = repo_path / "runs" / "r" / "ckpt"
    (ckpt / "000000100.json").write_bytes((ckpt / "00000100.json").read_bytes())  # a stray 9-digit copy
    (ckpt / "0000010٠.json").write_bytes(b"{}")  # non-ASCII digit
    assert repo.steps("r") == [100]
    assert [c.step for c in repo.checkpoints("r")] == [100]


def test_export_refuses_the_reserved_metadata_name(repo, tmp_path):
    repo.save("r", 1, {"model": {"__metadata__": torch.ones(2)}})
    with pytest.raises(luopan.UnsupportedValueError, match="__metadata__"):
        repo.export("r", tmp_path / "m.safetensors", subtree="model")


def test_diff_counts_an_entry_newly_tied_to_an_unchanged_one(repo):
    a, b = torch.ones(1000), torch.zeros(1000)
    repo.save("r", 1, {"a": a, "b": b})
    repo.save("r", 2, {"a": a, "b": a})
    d = repo.diff("r", 1, 2)
    assert [c["path"] for c in d["changed"]] == ["b"] and d["changed_bytes"] == 4000


def test_save_async_of_non_contiguous_tensors(repo):
    base = torch.randn(300, 200)
    s = {"t": base.t(), "c": torch.randn(10, dtype=torch.complex64).conj()}
    expected = {"t": base.t().clone(), "c": s["c"].resolve_conj().clone()}
    h = repo.save_async("r", 1, s)
    base.zero_()
    h.wait()
    out = repo.load("r", 1)
    assert torch.equal(out["t"], expected["t"]) and torch.equal(out["c"], expected["c"])


def test_creating_where_another_process_just_created_the_repository_opens_it(tmp_path):
    """Ranks opening one new path at once: a rank that found no config, then sees the directory filled by another
    rank's creation, opens that repository instead of refusing a 'non-empty directory'."""
    from luopan.repository.opening import create_config
    from luopan.store import open_store

    first = luopan.open(tmp_path / "r")
    first.save("r", 1, {"x": np.ones(3)})
    config = create_config(open_store(str(tmp_path / "r")), None, None, None)
    assert config.repo_id == first.config.repo_id
