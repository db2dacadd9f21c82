"""A save does not ask the codec again about an entry it did not pay for last time (issue 29): asking costs a sample
of every chunk, which was most of a LoRA re-save. It asks again about one save in RECHECK_EVERY per entry, so content
that starts compressing is noticed, and it always asks about entries that compressed."""

from __future__ import annotations

import numpy as np

import luopan
import luopan.repository.chunkwriter as chunkwriter
from luopan.repository.chunkwriter import RECHECK_EVERY, stored_plainly


def _codecs(repo, step, path="w"):
    doc = repo.manifest("r", step).doc
    entry = next(e for e in doc["entries"] if e["path"] == path)
    return {row[5] for row in entry["chunks"]}


def _steps(path, recheck, n=1):
    """Steps whose save asks the codec again about ``path`` (recheck=True), or does not."""
    prev = {"chunks": [["h", 0, 0, 1, 1, "none", "x"]]}
    return [s for s in range(1, 10 * RECHECK_EVERY) if stored_plainly(prev, path, s) != recheck][:n]


def test_an_entry_that_did_not_compress_is_not_sampled_again(tmp_path, monkeypatch):
    repo = luopan.open(tmp_path / "r", chunk_size=64 << 10)
    rng = np.random.default_rng(0)
    repo.save("r", 0, {"w": rng.standard_normal(64 << 10).astype(np.float32)})
    assert _codecs(repo, 0) == {"none"}  # random fp32: "auto" found it does not pay
    calls = []
    real = chunkwriter.encode_blob
    monkeypatch.setattr(chunkwriter, "encode_blob", lambda *a, **k: calls.append(1) or real(*a, **k))
    quiet = _steps("w", recheck=False, n=3)
    for s in quiet:
        repo.save("r", s, {"w": rng.standard_normal(64 << 10).astype(np.float32)})
    assert calls == []
    [again] = _steps("w", recheck=True)
    repo.save("r", again, {"w": rng.standard_normal(64 << 10).astype(np.float32)})
    assert len(calls) == 4  # 256 KiB in 64 KiB chunks: every chunk asked on a recheck save
    for s in [*quiet, again]:
        assert _codecs(repo, s) == {"none"}
        repo.load("r", s)  # verified


def test_content_that_starts_compressing_is_compressed_at_the_next_recheck(tmp_path):
    repo = luopan.open(tmp_path / "r", chunk_size=64 << 10)
    rng = np.random.default_rng(1)
    repo.save("r", 0, {"w": rng.standard_normal(64 << 10).astype(np.float32)})
    [again] = _steps("w", recheck=True)
    quiet = [s for s in _steps("w", recheck=False, n=RECHECK_EVERY) if s < again][:1]
    compressible = np.zeros(64 << 10, dtype=np.float32)
    compressible[::7] = 1.0
    for s in quiet:
        repo.save("r", s, {"w": compressible + s})
        assert _codecs(repo, s) == {"none"}  # not asked: stored raw, and loads back exactly
        np.testing.assert_array_equal(repo.load("r", s)["w"], compressible + s)
    repo.save("r", again, {"w": compressible + again})
    assert _codecs(repo, again) != {"none"}
    np.testing.assert_array_equal(repo.load("r", again)["w"], compressible + again)


def test_an_entry_that_compressed_is_always_asked(tmp_path):
    repo = luopan.open(tmp_path / "r", chunk_size=64 << 10)
    compressible = np.zeros(64 << 10, dtype=np.float32)
    compressible[::5] = 2.0
    for s in _steps("w", recheck=False, n=3):
        repo.save("r", s, {"w": compressible + s})
        assert "none" not in _codecs(repo, s)
