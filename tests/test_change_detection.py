"""Tier-2 change detection: chunks whose XXH3-128 matches the previous save's reuse its BLAKE3 address."""

import numpy as np
import pytest

import luopan
from luopan.checkpoint import save as save_mod


@pytest.fixture
def blake3_calls(monkeypatch):
    calls = []
    real = save_mod.blake3.blake3

    class Counting:
        @staticmethod
        def blake3(data):
            calls.append(len(data))
            return real(data)

    monkeypatch.setattr(save_mod, "blake3", Counting)
    return calls


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


def test_a_new_process_uses_the_latest_manifest(tmp_path, blake3_calls):
    luopan.open(tmp_path / "r", chunk_size=64 * 1024).save("r", 1, state())
    blake3_calls.clear()
    repo = luopan.open(tmp_path / "r")
    info = repo.save("r", 2, state())
    assert blake3_calls == [] and info.new_bytes == 0
    other_run = repo.save("other", 1, state())  # another run has no previous save: hashes, then dedups
    assert len(blake3_calls) == other_run.chunks and other_run.new_bytes == 0


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
