"""Storage engine v2 (docs/format.md §5.2, §5.4, §5.5): row deltas from the first re-save and across restarts, XOR
deltas for dense updates, and what a new process may trust from disk."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import luopan
from luopan.format.canonical import seal, unseal

ROWS, DIM = 16384, 128  # 8 MiB fp32 table of 512-byte rows
POLICY = luopan.DeltaPolicy(min_bytes=1 << 20)


def table(seed=0):
    return np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)


def scattered(n, seed):
    return np.sort(np.random.default_rng(1000 + seed).choice(ROWS, n, replace=False))


def test_first_resave_after_the_base_writes_only_the_changed_rows(tmp_path):
    repo = luopan.open(tmp_path / "r", compression="none", delta_policy=POLICY)
    emb = table()
    repo.save("run", 0, {"emb": emb})
    rows = scattered(ROWS // 100, 1)
    emb[rows] += 1
    info = repo.save("run", 1, {"emb": emb})
    assert info.new_bytes <= 1.05 * rows.size * (DIM * 4 + 8)
    assert repo.manifest("run", 1).entry("emb")["delta"]["base_step"] == 0
    assert np.array_equal(repo.load("run", 1)["emb"], emb)


def test_a_new_process_writes_only_the_changed_rows(tmp_path):
    path = tmp_path / "r"
    repo = luopan.open(path, compression="none", delta_policy=POLICY)
    emb = table()
    repo.save("run", 0, {"emb": emb})
    repo.close()
    script = textwrap.dedent(f"""
        import numpy as np, luopan, json
        repo = luopan.open({str(path)!r}, delta_policy=luopan.DeltaPolicy(min_bytes=1 << 20))
        emb = repo.load("run", 0)["emb"]
        rows = np.sort(np.random.default_rng(7).choice({ROWS}, {ROWS // 100}, replace=False))
        emb[rows] += 1
        info = repo.save("run", 1, {{"emb": emb}})
        print(json.dumps({{"new_bytes": info.new_bytes, "rows": int(rows.size)}}))
        np.save({str(tmp_path / "emb.npy")!r}, emb)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    import json

    got = json.loads(out)
    assert got["new_bytes"] <= 1.05 * got["rows"] * (DIM * 4 + 8)
    again = luopan.open(path)
    assert np.array_equal(again.load("run", 1)["emb"], np.load(tmp_path / "emb.npy"))
    assert again.manifest("run", 1).entry("emb")["delta"]["cycle"] == [ROWS * DIM * 4 + got["rows"] * (DIM * 4 + 8),
                                                                       2]


def test_new_process_continues_the_delta_cycle_of_the_run(tmp_path):
    path = tmp_path / "r"
    emb = table()
    luopan.open(path, compression="none", delta_policy=POLICY).save("run", 0, {"emb": emb})
    for step in range(1, 4):  # each save in a new repository object: no state carried in memory
        emb[scattered(50, step)] += 1
        repo = luopan.open(path, delta_policy=POLICY)
        repo.save("run", step, {"emb": emb})
        d = repo.manifest("run", step).entry("emb")["delta"]
        assert d["base_step"] == 0
        assert d["rows"] == len(np.unique(np.concatenate([scattered(50, s) for s in range(1, step + 1)])))
        repo.close()
    assert np.array_equal(luopan.open(path).load("run", 3)["emb"], emb)


def test_xxh3_read_from_disk_never_decides_what_is_unchanged(tmp_path):
    """A crafted manifest that claims the base chunks have the XXH3s of the new content cannot make a new process
    skip rows: only BLAKE3 addresses (checked against the bytes) count."""
    path = tmp_path / "r"
    emb = table()
    luopan.open(path, compression="none", delta_policy=POLICY).save("run", 0, {"emb": emb})
    emb[scattered(100, 1)] += 1
    import xxhash

    from luopan.format.chunking import chunk_spans

    data = emb.reshape(-1).view(np.uint8)
    spans = chunk_spans(emb.nbytes, emb.shape, luopan.open(path).config.chunk_size)[1]
    mpath = os.path.join(path, "runs", "run", "ckpt", f"{0:08d}.json")
    doc = unseal(open(mpath, "rb").read())
    for row, (off, n) in zip(doc["entries"][0]["chunks"], spans):
        row[6] = xxhash.xxh3_128_hexdigest(data[off : off + n])  # lie: "the base already holds the new bytes"
    with open(mpath, "wb") as f:
        f.write(seal(doc))
    repo = luopan.open(path, delta_policy=POLICY)
    repo.save("run", 1, {"emb": emb})
    assert np.array_equal(repo.load("run", 1)["emb"], emb)
    assert repo.manifest("run", 1).entry("emb")["delta"]["rows"] == 100


def test_a_damaged_base_makes_the_save_store_in_full(tmp_path):
    path = tmp_path / "r"
    emb = table()
    luopan.open(path, compression="none", delta_policy=POLICY).save("run", 0, {"emb": emb})
    packs = [os.path.join(d, f) for d, _s, fs in os.walk(path / "packs") for f in fs]
    with open(packs[0], "r+b") as f:  # flip a byte inside the first blob
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    emb[scattered(10, 1)] += 1
    repo = luopan.open(path, delta_policy=POLICY)
    with pytest.warns(UserWarning, match="storing the entry (in full|without that chunk)"):
        repo.save("run", 1, {"emb": emb})
    e = repo.manifest("run", 1).entry("emb")
    assert "delta" not in e
    assert np.array_equal(repo.load("run", 1)["emb"], emb)


def bf16_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}.weight": (torch.randn(1024, 512, generator=g) * 0.02).to(torch.bfloat16) for i in range(3)}


def nudge(state, seed):
    g = torch.Generator().manual_seed(seed)
    # A small dense update: most values move by up to one bf16 ulp. (With 2e-4, up to two, the zstd repository's
    # third delta stores just over half the entry, and XOR deltas pause: DeltaPolicy.xor_fraction.)
    for t in state.values():
        t.add_((torch.randn(t.shape, generator=g) * 1e-4).to(torch.bfloat16))


@pytest.mark.parametrize("compression", ["zstd", "auto"])
def test_dense_small_updates_become_xor_deltas_that_load_exactly(tmp_path, compression):
    repo = luopan.open(tmp_path / "r", compression=compression, chunk_size=256 << 10)
    state = bf16_model()
    saved, stored = {}, []
    for step in range(5):
        if step:
            nudge(state, step)
        stored.append(repo.save("ft", step, state).stored_bytes)
        saved[step] = {k: v.clone() for k, v in state.items()}
    forms = ["xor" in repo.manifest("ft", s).entry("l0.weight") for s in range(5)]
    assert forms[0] is False and all(forms[1:]), forms
    assert all(repo.manifest("ft", s).entry("l0.weight")["xor"]["base_step"] == 0 for s in range(1, 5))
    assert repo.manifest("ft", 1).doc["format_version"] == 5
    assert sum(stored[1:]) < 0.6 * len(stored[1:]) * sum(t.nbytes for t in state.values())
    fresh = luopan.open(tmp_path / "r")
    for s, want in saved.items():
        got = fresh.load("ft", s)
        assert all(torch.equal(got[k], want[k]) for k in want)
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        fresh.load_into("ft", target, s)
        assert all(torch.equal(target[k], want[k]) for k in want)
    assert fresh.verify().ok


def test_xor_deltas_survive_pruning_their_base_and_gc(tmp_path):
    repo = luopan.open(tmp_path / "r", compression="zstd", chunk_size=256 << 10)
    state = bf16_model(1)
    for step in range(4):
        if step:
            nudge(state, 10 + step)
        repo.save("ft", step, state)
    assert "xor" in repo.manifest("ft", 3).entry("l1.weight")
    from luopan.retention import KeepLast

    repo.prune("ft", KeepLast(1))
    repo.gc(grace=0)
    repo.gc(grace=0)  # condemned packs go on the second run
    assert repo.steps("ft") == [3]
    got = luopan.open(tmp_path / "r").load("ft", 3)
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert repo.verify().ok


def test_xor_deltas_need_compression_and_can_be_turned_off(tmp_path):
    for name, kw in (("plain", {"compression": "none"}),
                     ("off", {"compression": "zstd", "delta_policy": luopan.DeltaPolicy(xor=False)})):
        repo = luopan.open(tmp_path / name, chunk_size=256 << 10, **kw)
        state = bf16_model()
        for step in range(3):
            if step:
                nudge(state, step)
            repo.save("ft", step, state)
        assert all("xor" not in repo.manifest("ft", s).entry("l0.weight") for s in range(3))


def test_export_and_signatures_cover_xor_deltas(tmp_path):
    from safetensors.torch import load_file

    repo = luopan.open(tmp_path / "r", compression="zstd", chunk_size=256 << 10)
    state = bf16_model(2)
    repo.save("ft", 0, state)
    nudge(state, 5)
    repo.save("ft", 1, state)
    assert "xor" in repo.manifest("ft", 1).entry("l2.weight")
    out = tmp_path / "m.safetensors"
    repo.export("ft", out, 1)
    got = load_file(str(out))
    assert all(torch.equal(got[k], state[k]) for k in state)
    from luopan.checkpoint.signatures import content_digest

    m = repo.manifest("ft", 1)
    doc = m.doc
    before = content_digest(m)
    doc["entries"][2]["xor"]["chunks"][0][0] = "0" * 64  # another XOR chunk: another content
    assert content_digest(type(m)(doc)) != before


def test_a_version_4_reader_refuses_a_version_5_manifest(tmp_path, monkeypatch):
    repo = luopan.open(tmp_path / "r", compression="none", delta_policy=POLICY)
    emb = table()
    repo.save("run", 0, {"emb": emb})
    emb[scattered(10, 1)] += 1
    repo.save("run", 1, {"emb": emb})
    assert repo.manifest("run", 1).doc["format_version"] == 5
    import luopan.format as fmt

    monkeypatch.setattr(fmt, "FORMAT_VERSION", 4)
    with pytest.raises(luopan.UnsupportedFormatError, match="newer"):
        luopan.open(tmp_path / "r").load("run", 1)


def _reseal(path, step, edit):
    mpath = os.path.join(path, "runs", "run", "ckpt", f"{step:08d}.json")
    from luopan.format.canonical import inflate_json

    doc = unseal(inflate_json(open(mpath, "rb").read()))
    edit(doc)
    with open(mpath, "wb") as f:
        f.write(seal(doc))


def test_xxh3_of_disk_base_rows_decides_nothing_at_the_next_save_either(tmp_path):
    """Review finding: base rows taken from disk into this process's delta manifest must not steer its next save."""
    import xxhash

    from luopan.format.chunking import chunk_spans

    path = tmp_path / "r"
    emb = table()
    luopan.open(path, compression="none", delta_policy=POLICY).save("run", 0, {"emb": emb})
    future = np.zeros_like(emb)  # what chunk 1 will hold at step 2 (predictable content, e.g. a reset)
    off, n = chunk_spans(emb.nbytes, emb.shape, luopan.open(path).config.chunk_size)[1][1]
    lie = xxhash.xxh3_128_hexdigest(future.reshape(-1).view(np.uint8)[off : off + n])
    _reseal(path, 0, lambda d: d["entries"][0]["chunks"][1].__setitem__(6, lie))
    repo = luopan.open(path, delta_policy=POLICY)
    emb1 = emb.copy()
    emb1[:50] += 1
    repo.save("run", 1, {"emb": emb1})
    assert "delta" in repo.manifest("run", 1).entry("emb")
    repo.save("run", 2, {"emb": future})  # same process, stored in full
    assert np.array_equal(luopan.open(path).load("run", 2)["emb"], future)


def test_many_damaged_bases_never_fail_a_save(tmp_path):
    path = tmp_path / "r"
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.standard_normal((2048, 128), dtype=np.float32) for i in range(10)}
    repo = luopan.open(path, compression="none", delta_policy=POLICY)
    repo.save("run", 0, state)
    m = repo.manifest("run", 0)
    for e in m.entries:  # one flipped byte in every table's chunk
        r = e["chunks"][0]
        pack = m.packs[r[1]]
        with open(os.path.join(path, "packs", pack[:2], pack + ".pack"), "r+b") as f:
            f.seek(r[2] + 10)
            b = f.read(1)
            f.seek(r[2] + 10)
            f.write(bytes([b[0] ^ 1]))
    for t in state.values():
        t[:4] += 1
    repo = luopan.open(path, delta_policy=POLICY)
    with pytest.warns(UserWarning, match="storing the entry (in full|without that chunk)"):
        repo.save("run", 1, state)
    got = repo.load("run", 1)
    assert all(np.array_equal(got[k], v) and "delta" not in repo.manifest("run", 1).entry(k) for k, v in state.items())


def test_a_base_row_of_the_wrong_size_is_not_used(tmp_path):
    path = tmp_path / "r"
    a, z = np.zeros((ROWS, DIM), dtype=np.float32), np.zeros(2, dtype=np.float32)
    luopan.open(path, compression="none", delta_policy=POLICY).save("run", 0, {"A": a, "Z": z})

    def edit(doc):  # A's chunk 0 points at Z's 8-byte chunk, its chunk 1 claims the rest
        ents = {e["path"]: e for e in doc["entries"]}
        a1 = list(ents["A"]["chunks"][1])
        a1[3] = a1[4] = a.nbytes - 8
        ents["A"]["chunks"] = [list(ents["Z"]["chunks"][0]), a1]

    _reseal(path, 0, edit)
    a[:10] = 1
    repo = luopan.open(path, delta_policy=POLICY)
    repo.save("run", 1, {"A": a, "Z": z})
    assert np.array_equal(luopan.open(path).load("run", 1)["A"], a)


def test_diff_counts_the_content_of_xor_entries(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 1024, generator=g) * 0.02).to(torch.bfloat16)  # two 4 MiB chunks
    repo = luopan.open(tmp_path / "r", compression="zstd")
    repo.save("run", 0, {"w": w})
    w1 = w.clone()
    w1[2048:] += (torch.randn(2048, 1024, generator=g) * 2e-4).to(torch.bfloat16)  # chunk 1 moves densely
    repo.save("run", 1, {"w": w1})
    assert "xor" in repo.manifest("run", 1).entry("w")
    repo.save("run", 2, {"w": w})  # the base's bytes again: stored as its chunks, no XOR to read
    assert "xor" not in repo.manifest("run", 2).entry("w")
    assert repo.diff("run", 0, 1)["changed_bytes"] == 4 << 20
    assert repo.diff("run", 1, 2)["changed_bytes"] == 4 << 20
    assert repo.diff("run", 0, 2)["changed_bytes"] == 0


def test_read_check_xxh3_is_an_opt_in_that_still_catches_damage(tmp_path, monkeypatch):
    from luopan.repository import chunkio

    path = tmp_path / "r"
    emb = table()
    luopan.open(path, compression="none").save("run", 0, {"emb": emb})
    with pytest.raises(luopan.UsageError, match="read_check"):
        luopan.open(path, read_check="md5")
    calls = []
    real = chunkio.blake3.blake3

    def counting(data=b"", **kw):
        if len(data) >= 1 << 20:  # a chunk (pack trailers are hashed too, and stay so)
            calls.append(len(data))
        return real(data, **kw)

    monkeypatch.setattr(chunkio, "blake3", type("B", (), {"blake3": staticmethod(counting)}))
    fast = luopan.open(path, read_check="xxh3")
    assert np.array_equal(fast.load("run", 0)["emb"], emb) and calls == []  # checked by XXH3 only
    target = {"emb": np.zeros_like(emb)}
    fast.load_into("run", target, 0)
    assert np.array_equal(target["emb"], emb) and calls == []
    m = fast.manifest("run", 0)
    pack = m.packs[m.entry("emb")["chunks"][1][1]]
    with open(os.path.join(path, "packs", pack[:2], pack + ".pack"), "r+b") as f:
        f.seek(m.entry("emb")["chunks"][1][2] + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 4]))
    with pytest.raises(luopan.IntegrityError, match="XXH3 mismatch"):
        fast.load("run", 0)
    monkeypatch.undo()
    with pytest.raises(luopan.IntegrityError, match="hash mismatch"):  # verify stays BLAKE3
        luopan.open(path, read_check="xxh3").verify()
