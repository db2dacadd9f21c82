"""Tier-2 change detection: chunks whose XXH3-128 matches the previous save's reuse its BLAKE3 address."""

import numpy as np
import pytest

import luopan
from luopan.checkpoint import deltaplan as plan_mod
from luopan.repository import chunkwriter as writer_mod


def count_calls(monkeypatch, module_name, func_name):
    """Replace <module_name>.<func_name> in the save pipeline (the chunk writer, luopan.repository.chunkwriter, and
    the delta planner, which hashes delta candidates) with a wrapper recording the size of each call's data."""
    calls = []
    real = getattr(getattr(writer_mod, module_name), func_name)

    def counting(data):
        calls.append(len(data))
        return real(data)

    for mod in (writer_mod, plan_mod):
        monkeypatch.setattr(mod, module_name, type("Counting", (), {func_name: staticmethod(counting)}))
    return calls


@pytest.fixture
def blake3_calls(monkeypatch):
    return count_calls(monkeypatch, "blake3", "blake3")


def state(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((256, 1024), dtype=np.float32), "b": rng.standard_normal(1000)}


def test_unchanged_resave_computes_no_content_hash(tmp_path, blake3_calls):
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    s = state()
    first = repo.save("r", 1, s)
    assert len(blake3_calls) == first.chunks  # a first save hashes every chunk
    blake3_calls.clear()
    second = repo.save("r", 2, s)
    assert blake3_calls == [] and second.new_bytes == 0
    s["w"][100, 5] += 1.0  # one 64-row chunk changes
    third = repo.save("r", 3, s)
    assert blake3_calls == [64 * 1024] and third.new_chunks == 1
    np.testing.assert_array_equal(repo.load("r", 3)["w"], s["w"])
    assert repo.load("r", 2)["w"][100, 5] != s["w"][100, 5]
    assert repo.verify().ok


def test_a_new_process_does_not_trust_rows_read_from_disk(tmp_path, blake3_calls):
    """Rows in a manifest on disk could be crafted (XXH3 of public weights -> BLAKE3 of other bytes): a process's
    first save of a run hashes everything, and only its own rows steer later saves."""
    luopan.open(tmp_path / "r", chunk_size=64 * 1024).save("r", 1, state())
    blake3_calls.clear()
    repo = luopan.open(tmp_path / "r")
    info = repo.save("r", 2, state())
    assert len(blake3_calls) == info.chunks and info.new_bytes == 0  # hashed, then deduplicated
    blake3_calls.clear()
    assert repo.save("r", 3, state()).new_bytes == 0 and blake3_calls == []  # now its own rows are used


def test_crafted_manifest_rows_cannot_poison_a_save(tmp_path):
    from luopan.format.canonical import inflate_json, seal, unseal

    rng = np.random.default_rng(1)
    public = {"w": rng.standard_normal((64, 1024), dtype=np.float32)}
    evil = {"w": public["w"] + 1}
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    repo.save("evil", 1, evil)
    repo.save("r", 1, public)
    m_evil = unseal(inflate_json(next(repo.store.get(k) for k in repo.store.list("runs/evil/ckpt/"))))
    key = next(repo.store.list("runs/r/ckpt/"))
    doc = unseal(inflate_json(repo.store.get(key)))
    for row, bad in zip(doc["entries"][0]["chunks"], m_evil["entries"][0]["chunks"]):
        row[0], row[1:6] = bad[0], [0, *bad[2:6]]  # keep the public XXH3, point at the evil chunk
    doc["packs"] = m_evil["packs"]
    repo.store.put(key, seal(doc))
    victim = luopan.open(tmp_path / "r")
    victim.save("r", 2, public)
    np.testing.assert_array_equal(victim.load("r", 2)["w"], public["w"])


def test_changed_shape_or_dtype_is_rehashed(tmp_path, blake3_calls):
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    s = state()
    repo.save("r", 1, s)
    blake3_calls.clear()
    s["w"] = s["w"].view(np.int32)  # same bytes, other dtype: same chunk contents, so addresses may be reused
    s["b"] = s["b"][:500].copy()  # shorter: its one chunk differs in size
    info = repo.save("r", 2, s)
    assert blake3_calls == [4000]
    out = repo.load("r", 2)
    assert out["w"].dtype == np.int32 and np.array_equal(out["w"], s["w"]) and np.array_equal(out["b"], s["b"])


def test_tier1_trusted_versions_skip_reading_frozen_tensors(tmp_path, monkeypatch):
    import torch

    reads = count_calls(monkeypatch, "xxhash", "xxh3_128_hexdigest")
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    base = torch.randn(512, 512)  # 1 MiB frozen
    lora = torch.zeros(8, 512)
    state = {"base": base, "lora": lora}
    repo.save("r", 1, state, trust_versions=True)
    reads.clear()
    lora.add_(1.0)  # an in-place op moves the version counter
    info = repo.save("r", 2, state, trust_versions=True)
    assert reads == [lora.numel() * 4] and info.new_bytes == lora.numel() * 4  # the base was not even read
    assert sum(reads) == lora.numel() * 4
    repo.save("r", 25, {"base": base.detach(), "lora": lora.detach()}, trust_versions=True)  # fresh state_dict
    assert sum(reads) == lora.numel() * 4  # detach() shares the version counter: nothing read
    state["base"] = base.clone()  # another storage, same values: not trusted, read (and deduplicated)
    reads.clear()
    info = repo.save("r", 3, state, trust_versions=True)
    assert sum(reads) == base.numel() * 4 and info.new_bytes == 0  # lora: same object, same version: skipped
    out = repo.load("r", 2)
    assert torch.equal(out["base"], base) and torch.equal(out["lora"], lora)


def test_tier1_caveat_writes_bypassing_the_version_counter(tmp_path):
    """Documented contract: with trust_versions, a write through .data is not seen; without it, it is."""
    import torch

    repo = luopan.open(tmp_path / "r")
    t = torch.zeros(1000)
    repo.save("r", 1, {"t": t}, trust_versions=True)
    t.data[0] = 5.0  # bypasses t._version
    repo.save("r", 2, {"t": t}, trust_versions=True)
    assert repo.load("r", 2)["t"][0] == 0.0  # missed: the caveat
    repo.save("r", 3, {"t": t})  # the default looks at the bytes
    assert repo.load("r", 3)["t"][0] == 5.0


def test_load_into_moves_version_counters_so_trust_versions_sees_the_restore(tmp_path):
    """load_into writes through a byte view torch does not track; without a version bump the next trust_versions
    save would reuse the pre-restore chunks."""
    import torch

    import luopan

    repo = luopan.open(tmp_path / "r")
    w = torch.full((256,), 1.0)
    repo.save("run", 1, {"w": w}, trust_versions=True)
    w.fill_(2.0)
    repo.save("run", 2, {"w": w}, trust_versions=True)
    repo.load_into("run", {"w": w}, step=1)
    assert torch.equal(w, torch.full((256,), 1.0))
    repo.save("run", 3, {"w": w}, trust_versions=True)
    assert torch.equal(repo.load("run", 3)["w"], torch.full((256,), 1.0))
