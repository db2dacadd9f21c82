"""Damage does not spread through deduplication, and saving again repairs it."""

import os

import numpy as np
import pytest

import luopan


def state():
    return {"w": np.random.default_rng(3).standard_normal((64, 1024), dtype=np.float32)}


def pack_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "packs")) for f in fs)


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "r")
    repo = luopan.open(root, chunk_size=16 * 1024, pack_size=64 * 1024)
    repo.save("r", 1, state())
    return root, repo


def test_missing_pack_is_not_deduplicated_against(saved):
    root, _ = saved
    os.unlink(pack_files(root)[0])
    repo = luopan.open(root)  # a new process: knows the chunks only from index files
    info = repo.save("r", 2, state())
    assert info.new_chunks > 0  # the lost chunks were stored again
    assert repo.verify("r", 2).ok
    with pytest.raises(luopan.IntegrityError) as exc:
        repo.verify("r", 1)
    assert exc.value.problems and all(isinstance(p, luopan.MissingPackError) for p in exc.value.problems)


def test_truncated_pack_is_not_deduplicated_against(saved):
    root, _ = saved
    p = pack_files(root)[-1]
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    repo = luopan.open(root)
    repo.save("r", 2, state())
    assert repo.verify("r", 2).ok


def test_chunk_found_damaged_by_verify_is_rewritten_by_the_next_save(saved):
    root, repo = saved
    m = repo.manifest("r", 1)
    h, p, off, *_ = m.entries[0]["chunks"][1]
    path = os.path.join(root, "packs", m.packs[p][:2], m.packs[p] + ".pack")
    with open(path, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(luopan.IntegrityError, match="chunk 1"):
        repo.verify()
    info = repo.save("r", 2, state())
    assert info.new_chunks == 1
    assert repo.verify("r", 2).ok
    np.testing.assert_array_equal(repo.load("r", 2)["w"], state()["w"])


def test_verify_checks_pack_trailers_and_index_files(saved):
    root, repo = saved
    p = pack_files(root)[0]
    data = bytearray(open(p, "rb").read())
    data[-20] ^= 0xFF  # inside the trailer index, not in any chunk
    open(p, "wb").write(bytes(data))
    with pytest.raises(luopan.IntegrityError) as exc:
        repo.verify("r")
    assert any(isinstance(x, luopan.CorruptPackError) and "trailer" in str(x) for x in exc.value.problems)
    open(p, "wb").write(bytes(data[:-20]) + bytes([data[-20] ^ 0xFF]) + bytes(data[-19:]))  # restore
    assert repo.verify().ok
    idx = os.path.join(root, "index", os.listdir(os.path.join(root, "index"))[0])
    open(idx, "ab").write(b"x")
    with pytest.raises(luopan.IntegrityError) as exc:
        repo.verify()
    assert any(isinstance(x, luopan.CorruptRepoError) and "index file" in str(x) for x in exc.value.problems)
