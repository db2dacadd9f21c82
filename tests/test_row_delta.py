"""Row deltas (docs/format.md §5.2): sparse table updates stored as base chunks + changed rows, depth 1."""

import dataclasses
import json
import os
import threading

import numpy as np
import pytest
import torch

import luopan
from luopan.checkpoint.rowdelta import apply_patch, decode_patch
from luopan.format.canonical import inflate_json, seal, unseal

ROWS, DIM = 4096, 64  # 1 MiB fp32 table, 256-byte rows; 64 KiB chunks hold 256 rows, so 16 chunks
POLICY = luopan.DeltaPolicy(min_bytes=1 << 20, rebase_fraction=0.25)


def open_repo(path, policy=POLICY, **kw):
    return luopan.open(path, chunk_size=64 << 10, delta_policy=policy, **kw)


def table(seed=0):
    return np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)


def scattered(n, seed):
    return np.random.default_rng(seed).choice(ROWS, n, replace=False)


def sparse_saves(repo, emb, steps=3, **extra):
    """Saves 0..steps-1 of run "run", 10 scattered rows of ``emb`` changed before each: the last ones are deltas."""
    for step in range(steps):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb, **extra})


def flip_values_byte(root, repo, step, at=0, mask=0xFF):
    """Damage byte ``at`` of the first values chunk of entry "emb"'s row delta at ``step``, in its pack."""
    m = repo.manifest("run", step)
    _h, p, off = m.entry("emb")["delta"]["values"][-1][:3]  # the newest segment's (§5.2): this save's own
    with open(os.path.join(root, "packs", m.packs[p][:2], m.packs[p] + ".pack"), "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ mask]))


def manifest_json(root, run, step):
    with open(os.path.join(root, "runs", run, "ckpt", f"{step:08d}.json"), "rb") as f:
        return unseal(inflate_json(f.read()))  # manifests may be zstd frames (§4)


def test_scattered_rows_become_a_delta_and_load_exactly(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    state = {"emb": emb, "step": 0}
    saved = {}
    infos = []
    for step in range(6):
        if step:
            emb[scattered(20, step)] += 1  # every chunk-sized block of rows is likely touched
        infos.append(repo.save("run", step, state))
        saved[step] = emb.copy()
    kinds = ["delta" in repo.manifest("run", s).entry("emb") for s in range(6)]
    # step 0: first save (the base); from the first change on, deltas: the changed chunks are compared with the
    # base's bytes read back from the repository, then row digests take over
    assert kinds == [False, True, True, True, True, True]
    for s in range(1, 6):
        d = repo.manifest("run", s).entry("emb")["delta"]
        assert d["base_step"] == 0
        # format 7 (§5.2): the patch is kept in segments, one per save, each the rows changed since the save before
        assert d.get("segments", [d["rows"]]) == [20] * s
        assert infos[s].new_bytes <= 20 * (DIM * 4 + 8) + 64  # this save's changed rows: not the table, nor the patch
        assert repo.manifest("run", s).doc["format_version"] == (7 if s > 1 else 5)  # 5: the writer's cycle hint
        assert d["cycle"][1] == s + 1  # the base and s deltas
    assert repo.manifest("run", 0).doc["format_version"] in (1, 5)  # 5 only where a format-5 codec was used
    for s, expected in saved.items():
        assert np.array_equal(repo.load("run", s)["emb"], expected)
        target = {"emb": np.zeros_like(emb), "step": 0}
        repo.load_into("run", target, s)
        assert np.array_equal(target["emb"], expected)
    assert repo.verify().ok
    assert repo.verify().chunks > 16  # the delta chunks are verified too
    # a fresh process (no tracking state) reads every checkpoint the same
    repo.close()
    again = luopan.open(tmp_path / "r")
    assert all(np.array_equal(again.load("run", s)["emb"], e) for s, e in saved.items())


def test_hint_skips_detection_from_the_first_change(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    repo.save("run", 0, {"emb": emb})
    rows = scattered(30, 1)
    emb[rows] *= 2
    info = repo.save("run", 1, {"emb": emb}, touched_rows={"emb": torch.as_tensor(rows)})
    e = repo.manifest("run", 1).entry("emb")
    assert e["delta"]["rows"] == 30 and e["delta"]["base_step"] == 0
    assert info.new_bytes < 30 * (DIM * 4 + 8) + 64
    assert np.array_equal(repo.load("run", 1)["emb"], emb)


def test_hint_rows_that_did_not_change_are_harmless(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    repo.save("run", 0, {"emb": emb})
    emb[5] += 1
    repo.save("run", 1, {"emb": emb}, touched_rows={"emb": [5, 6, 7, 4000]})  # 6, 7, 4000 unchanged
    assert np.array_equal(repo.load("run", 1)["emb"], emb)


def test_incomplete_hint_is_caught_when_a_changed_chunk_has_no_touched_row(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    repo.save("run", 0, {"emb": emb})
    emb[3] += 1
    emb[3000] += 1  # another chunk, not named in the hint
    repo.save("run", 1, {"emb": emb}, touched_rows={"emb": [3]})
    assert np.array_equal(repo.load("run", 1)["emb"], emb)


def test_bad_hints_are_refused_before_anything_is_written(tmp_path):
    repo = open_repo(tmp_path / "r")
    state = {"emb": table(), "bias": np.zeros(8, np.float32)}
    cases = [
        ({"nope": [1]}, "not a key path.*tables in the state: emb"),
        ({"bias": [1]}, "not a table"),
        ({"emb": [ROWS]}, f"row {ROWS}, but the table has {ROWS} rows"),
        ({"emb": [-1]}, "row -1"),
        ({"emb": [0.5]}, "integer row numbers"),
        ({"emb": [True]}, "integer row numbers"),
        (["emb"], "must be a dict"),
    ]
    for hint, message in cases:
        with pytest.raises(luopan.UnsupportedValueError, match=message):
            repo.save("run", 0, state, touched_rows=hint)
    assert repo.steps("run") == []
    assert not [f for _d, _s, files in os.walk(tmp_path / "r" / "packs") for f in files]


def test_patch_past_the_rebase_fraction_writes_a_new_base(tmp_path):
    repo = open_repo(tmp_path / "r", luopan.DeltaPolicy(min_bytes=1 << 20, rebase_fraction=0.05))
    emb = table()
    budget_rows = int(0.05 * emb.nbytes / (DIM * 4 + 8))  # 198 rows
    repo.save("run", 0, {"emb": emb})
    steps = []
    for step in range(1, 8):
        emb[scattered(60, step)] += 1
        repo.save("run", step, {"emb": emb})
        e = repo.manifest("run", step).entry("emb")
        steps.append(e["delta"]["base_step"] if "delta" in e else None)
        assert "delta" not in e or e["delta"]["rows"] <= budget_rows
        assert np.array_equal(repo.load("run", step)["emb"], emb)
    # 1-3: deltas on base 0 (60, ~119, ~177 rows); 4: over budget, rebase; 5-7 on base 4
    assert steps == [0, 0, 0, None, 4, 4, 4]


def test_dense_update_stores_in_full_and_pauses_detection(tmp_path):
    repo = open_repo(tmp_path / "r", dataclasses.replace(POLICY, xor=False))  # row deltas alone
    emb = table()
    repo.save("run", 0, {"emb": emb})
    emb[scattered(10, 1)] += 1
    repo.save("run", 1, {"emb": emb})  # a delta against step 0
    emb += 1  # dense
    repo.save("run", 2, {"emb": emb})  # full: the new base
    emb[scattered(10, 3)] += 1
    repo.save("run", 3, {"emb": emb})  # detection paused for one save: full
    emb[scattered(10, 4)] += 1
    repo.save("run", 4, {"emb": emb})  # compared with its base (step 3) again: a delta
    emb[scattered(10, 5)] += 1
    repo.save("run", 5, {"emb": emb})
    kinds = ["delta" in repo.manifest("run", s).entry("emb") for s in range(6)]
    assert kinds == [False, True, False, False, True, True]
    assert repo.manifest("run", 4).entry("emb")["delta"]["rows"] == 10
    assert repo.manifest("run", 5).entry("emb")["delta"]["rows"] == len(np.union1d(scattered(10, 4), scattered(10, 5)))
    assert np.array_equal(repo.load("run", 5)["emb"], emb)


def test_unchanged_table_keeps_its_delta(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    for step in range(3):
        if step:
            emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb})
    info = repo.save("run", 3, {"emb": emb})  # nothing changed
    e2, e3 = repo.manifest("run", 2).entry("emb"), repo.manifest("run", 3).entry("emb")
    assert e3["delta"] == e2["delta"] and e3["chunks"] == e2["chunks"]
    assert info.new_bytes == 0
    assert np.array_equal(repo.load("run", 3)["emb"], emb)


def test_version_counter_skip_reuses_a_delta_entry(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = torch.from_numpy(table())
    frozen = torch.ones(10)
    for step in range(3):
        if step:
            emb[torch.as_tensor(scattered(10, step))] += 1
        repo.save("run", step, {"emb": emb, "frozen": frozen}, trust_versions=True)
    info = repo.save("run", 3, {"emb": emb, "frozen": frozen}, trust_versions=True)  # emb skipped unread
    assert repo.manifest("run", 3).entry("emb")["delta"] == repo.manifest("run", 2).entry("emb")["delta"]
    assert info.new_bytes == 0
    assert torch.equal(repo.load("run", 3)["emb"], emb)


def test_async_delta_saves_keep_the_values_at_the_call(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = torch.from_numpy(table())
    expected = {}
    for step in range(5):
        rows = torch.as_tensor(scattered(15, step))
        if step:
            emb[rows] += 1
        expected[step] = emb.clone()
        handle = repo.save_async("run", step, {"emb": emb}, touched_rows={"emb": rows} if step % 2 else None)
        emb[rows] -= 100  # mutate right after the call returns: must not leak into the checkpoint
        handle.wait()
        emb[rows] += 100
    assert any("delta" in repo.manifest("run", s).entry("emb") for s in range(5))
    for step, exp in expected.items():
        assert torch.equal(repo.load("run", step)["emb"], exp)


def test_missing_base_chunk_forces_a_full_save(tmp_path):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    for step in range(2):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb})
    base = repo.manifest("run", 1)
    victim = base.packs[base.entry("emb")["chunks"][3][1]]
    os.remove(os.path.join(root, "packs", victim[:2], victim + ".pack"))
    emb[scattered(10, 2)] += 1
    repo.save("run", 2, {"emb": emb})
    assert "delta" not in repo.manifest("run", 2).entry("emb")  # never a delta on a base that is gone
    assert np.array_equal(repo.load("run", 2)["emb"], emb)


def test_damaged_delta_values_are_detected(tmp_path):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    copies = []
    for step in range(3):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb})
        copies.append(emb.copy())
    flip_values_byte(root, repo, 2, at=7, mask=1)
    with pytest.raises(luopan.IntegrityError, match=r"entry 'emb \(row delta values\)'"):
        repo.load("run", 2)
    with pytest.raises(luopan.IntegrityError, match="row delta values"):
        repo.verify("run", 2)
    assert np.array_equal(repo.load("run", 1)["emb"], copies[1])  # the base checkpoint is unaffected


def _reseal(root, step, edit):
    path = os.path.join(root, "runs", "run", "ckpt", f"{step:08d}.json")
    with open(path, "rb") as f:
        doc = unseal(inflate_json(f.read()))
    edit(doc)
    with open(path, "wb") as f:
        f.write(seal(doc))


@pytest.mark.parametrize("edit, message", [
    (lambda e, d: d.update(rows=d["rows"] + 1), "delta index is not|do not add up"),
    (lambda e, d: d.pop("segments") and d.update(rows=d["rows"] + 1), "delta index is not"),
    (lambda e, d: d.update(segments=[d["rows"] - 1, 1]), "not sorted, unique and below"),
    (lambda e, d: d.update(segments=[ROWS + 1, 1], rows=ROWS + 2), "in one segment"),
    (lambda e, d: d.update(rows=ROWS + 1), "delta names|do not add up"),
    (lambda e, d: d["values"].pop(), "delta values are not"),
    (lambda e, d: d["index"][0].__setitem__(1, 99), "names pack #99"),
    (lambda e, d: e.update(shape=[], nbytes=4, dtype="float32") or e["chunks"].clear(), "no rows|chunks hold"),
])
def test_lying_delta_manifests_are_refused(tmp_path, edit, message):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    sparse_saves(repo, emb)
    _reseal(root, 2, lambda doc: edit(doc["entries"][0], doc["entries"][0]["delta"]))
    reader = luopan.open(root)
    with pytest.raises(luopan.CorruptManifestError, match=message):
        reader.load("run", 2)


def test_delta_in_a_version_1_manifest_is_refused(tmp_path):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    sparse_saves(repo, emb)
    _reseal(root, 2, lambda doc: doc.update(format_version=1))
    with pytest.raises(luopan.CorruptManifestError, match="format_version 1 lacks"):
        luopan.open(root).load("run", 2)


def test_row_numbers_are_checked_before_they_are_used():
    e = {"path": "t", "shape": [4, 2], "nbytes": 32}
    vals = memoryview(bytes(16))
    for bad in ([1, 1], [2, 1], [4, 0], [-1, 0]):
        idx = memoryview(np.array(sorted(bad) if bad == [4, 0] else bad, dtype="<i8").tobytes())
        with pytest.raises(luopan.CorruptManifestError, match="not sorted, unique and below 4"):
            decode_patch(e, idx, vals, "here")


@pytest.mark.parametrize("row_bytes, pos, length", [(8, 0, 64), (8, 12, 30), (24, 5, 17), (24, 0, 240), (7, 3, 50)])
def test_apply_patch_on_any_span_matches_patching_the_whole(row_bytes, pos, length):
    rng = np.random.default_rng(row_bytes + pos)
    nrows = 10
    whole = rng.integers(0, 256, nrows * row_bytes, dtype=np.uint8)
    index = np.array([0, 3, 4, 9])
    values = rng.integers(0, 256, (4, row_bytes), dtype=np.uint8)
    expected = whole.copy()
    expected.reshape(nrows, row_bytes)[index] = values
    span = whole[pos : pos + length].copy()
    apply_patch(memoryview(span), pos, index, values, row_bytes)
    assert np.array_equal(span, expected[pos : pos + length])


def test_export_and_diff_of_a_delta_checkpoint(tmp_path):
    from safetensors.numpy import load_file

    repo = open_repo(tmp_path / "r")
    emb = table()
    for step in range(3):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb, "w": np.ones((2, 2), np.float32)})
    assert "delta" in repo.manifest("run", 2).entry("emb")
    out = tmp_path / "x.safetensors"
    repo.export("run", out, 2)
    assert np.array_equal(load_file(str(out))["emb"], emb)
    d = repo.diff("run", 1, 2)
    assert [c["path"] for c in d["changed"]] == ["emb"]
    assert 0 < d["changed_bytes"] < 100 * (DIM * 4 + 8)


def test_small_and_one_dimensional_entries_are_never_deltas(tmp_path):
    repo = open_repo(tmp_path / "r")
    vec = np.zeros(ROWS * DIM, np.float32)  # 1 MiB but 1-D
    small = np.zeros((64, 64), np.float32)  # 2-D but under min_bytes
    for step in range(4):
        vec[step * 1000] += 1
        small[step] += 1
        repo.save("run", step, {"vec": vec, "small": small})
    m = repo.manifest("run", 3)
    assert not {"delta", "xor"} & (set(m.entry("vec")) | set(m.entry("small")))
    repo = open_repo(tmp_path / "plain", compression="none")
    for step in range(2):
        vec[step * 1000] += 1
        repo.save("run", step, {"vec": vec, "small": small})
    assert repo.manifest("run", 1).doc["format_version"] == 1  # nothing of format 5 was used


def test_disabled_policy_stores_plain_chunks(tmp_path):
    repo = open_repo(tmp_path / "r", luopan.DeltaPolicy(enabled=False))
    emb = table()
    for step in range(4):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb})
    assert all("delta" not in repo.manifest("run", s).entry("emb") for s in range(4))


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="rebase_fraction"):
        luopan.DeltaPolicy(rebase_fraction=1.5)
    with pytest.raises(ValueError, match="min_bytes"):
        luopan.DeltaPolicy(min_bytes=0)


def test_cli_show_marks_delta_entries(tmp_path):
    from typer.testing import CliRunner

    from luopan.cli.main import app

    repo = open_repo(tmp_path / "r")
    emb = table()
    sparse_saves(repo, emb)
    r = CliRunner().invoke(app, ["show", "-r", str(tmp_path / "r"), "run", "2", "--json"])
    assert r.exit_code == 0, r.output
    entry = json.loads(r.stdout)["entries"][0]
    d = repo.manifest("run", 2).entry("emb")["delta"]
    assert entry["delta"] == {"base_step": 0, "rows": d["rows"], "segments": d["segments"]} and d["segments"] == [10, 10]


def test_rebase_comes_when_another_delta_would_raise_the_average_bytes_per_save(tmp_path):
    repo = open_repo(tmp_path / "r", luopan.DeltaPolicy(min_bytes=1 << 20, rebase_fraction=0.9))
    emb = table()
    row_cost = DIM * 4 + 8
    written, kinds = [repo.save("run", 0, {"emb": emb}).new_bytes], [False]
    for step in range(1, 9):
        emb[scattered(600, step)] += 1  # ~15% of the rows per save: the cumulative patch grows fast
        info = repo.save("run", step, {"emb": emb})
        e = repo.manifest("run", step).entry("emb")
        kinds.append("delta" in e)
        written.append(info.new_bytes)
        assert np.array_equal(repo.load("run", step)["emb"], emb)
    first_delta = kinds.index(True)
    rebase = kinds.index(False, first_delta)  # the cap (90%) is never reached: the average rule rebases
    cycle = written[first_delta - 1 : rebase]  # the base and its deltas
    patch_rows_at_rebase = len(np.unique(np.concatenate([scattered(600, s) for s in range(first_delta,
                                                                                          rebase + 1)])))
    assert patch_rows_at_rebase * row_cost < 0.9 * emb.nbytes
    assert patch_rows_at_rebase * row_cost * len(cycle) > sum(cycle) - 4096 * len(cycle)  # over the average


def test_a_row_a_hint_missed_is_caught_by_the_next_save_without_hint(tmp_path):
    repo = open_repo(tmp_path / "r")
    emb = table()
    for step in range(2):  # step 1: a delta of 10 rows against step 0
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb})
    emb[100] += 1
    emb[101] += 1  # same row block and chunk as row 100, left out of the hint
    repo.save("run", 2, {"emb": emb}, touched_rows={"emb": [100]})
    emb[3000] += 1
    repo.save("run", 3, {"emb": emb})  # no hint: the block the hint updated is re-examined row by row
    e = repo.manifest("run", 3).entry("emb")
    assert e["delta"]["rows"] == len(np.union1d(scattered(10, 1), [100, 101, 3000]))
    assert np.array_equal(repo.load("run", 3)["emb"], emb)


def test_block_level_detection_finds_single_changed_rows(tmp_path):
    from luopan.checkpoint.rowdelta import RowDigests

    rng = np.random.default_rng(0)
    for row_bytes in (8, 100, 256, 4096, 5000):
        data = bytearray(rng.integers(0, 256, 64 * row_bytes, dtype=np.uint8).tobytes())
        d = RowDigests.of(memoryview(data), row_bytes)
        for r in (0, 17, 63):
            data[r * row_bytes + row_bytes // 2] ^= 1
        touched, d2 = d.detect(memoryview(data), row_bytes, np.arange(64))
        assert touched.tolist() == [0, 17, 63], row_bytes
        assert d2.detect(memoryview(data), row_bytes, np.arange(64))[0].size == 0


def test_content_back_at_its_base_never_makes_an_empty_delta(tmp_path):
    """Found in review: after a hinted rebase, a save with nothing changed wrote a 0-row delta that no reader
    accepts. Content equal to its base is stored plainly."""
    repo = luopan.open(tmp_path / "r", delta_policy=luopan.DeltaPolicy(min_bytes=1))
    emb = np.zeros((1000, 64), np.float32)
    repo.save("r", 1, {"emb": emb})
    emb[0:10] += 1
    repo.save("r", 2, {"emb": emb})
    emb[10:60] += 1
    repo.save("r", 3, {"emb": emb}, touched_rows={"emb": np.arange(10, 60)})
    emb[60:90] += 1
    repo.save("r", 4, {"emb": emb}, touched_rows={"emb": np.arange(60, 90)})
    repo.save("r", 5, {"emb": emb})
    for s in (4, 5):
        assert np.array_equal(luopan.open(tmp_path / "r").load("r", s)["emb"], emb)
    assert repo.manifest("r", 5).entry("emb").get("delta", {"rows": 1})["rows"] >= 1


def test_an_alias_with_a_delta_is_refused(tmp_path):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    for step in range(3):
        emb[scattered(10, step)] += 1
        repo.save("run", step, {"emb": emb, "tied": emb})
    delta = repo.manifest("run", 2).entry("emb")["delta"]
    _reseal(root, 2, lambda doc: doc["entries"][1].update(delta=delta))
    with pytest.raises(luopan.CorruptManifestError, match="is an alias and cannot have chunks or a delta"):
        luopan.open(root).load("run", 2)


def _delta_jobs_without_patch_jobs(repo, step):
    """The read jobs of entry "emb" of ``step`` with the patch's own jobs dropped, as when a failed batch cancels
    them before they run: the base chunks' workers must then read the patch themselves (never wait forever)."""
    from luopan.checkpoint.chunkplan import check_rows, entry_jobs

    m = repo.manifest("run", step)
    e = m.entry("emb")
    assert "delta" in e
    out = np.empty(ROWS * DIM, dtype=np.float32)
    sizes = check_rows(repo.store, m)
    jobs = entry_jobs(repo.store, m, 0, memoryview(out).cast("B"), sizes)
    patch_jobs = [j for j in jobs if callable(j)]
    assert len(patch_jobs) == len(e["delta"]["index"]) + len(e["delta"]["values"])
    assert jobs[: len(patch_jobs)] == patch_jobs  # queued ahead of the base chunks
    return [j for j in jobs if not callable(j)], out.reshape(ROWS, DIM), sizes


def test_base_chunks_read_the_patch_themselves_when_its_jobs_never_run(tmp_path):
    from luopan.repository.chunkio import read_chunks

    repo = open_repo(tmp_path / "r")
    emb = table()
    sparse_saves(repo, emb)
    jobs, out, sizes = _delta_jobs_without_patch_jobs(repo, 2)
    reader = threading.Thread(target=read_chunks, args=(repo.store, jobs), kwargs={"sizes": sizes}, daemon=True)
    reader.start()
    reader.join(120)
    assert not reader.is_alive(), "the base chunks waited for patch reads that never ran"
    assert np.array_equal(out, emb)


def test_a_damaged_patch_fails_every_base_chunk_with_its_typed_error(tmp_path):
    from luopan.repository.chunkio import read_chunks

    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    sparse_saves(repo, emb)
    flip_values_byte(root, repo, 2)
    jobs, _out, sizes = _delta_jobs_without_patch_jobs(repo, 2)
    with pytest.raises(luopan.IntegrityError, match=r"row delta values"):
        read_chunks(repo.store, jobs, sizes=sizes)
    for job in jobs[:3]:  # each one alone, on this thread: the stored failure, re-raised, not a hang
        with pytest.raises(luopan.IntegrityError, match=r"row delta values"):
            read_chunks(repo.store, [job], sizes=sizes)
    with pytest.raises(luopan.IntegrityError, match=r"row delta values"):
        repo.load("run", 2)  # patch jobs and base jobs together


def test_load_into_with_a_damaged_patch_leaves_the_target_untouched(tmp_path):
    root = tmp_path / "r"
    repo = open_repo(root)
    emb = table()
    sparse_saves(repo, emb, other=np.arange(1000.0))
    flip_values_byte(root, repo, 2)
    target = {"emb": np.zeros((ROWS, DIM), np.float32), "other": np.zeros(1000)}
    with pytest.raises(luopan.IntegrityError, match=r"row delta values"):
        repo.load_into("run", target, step=2)
    assert not target["emb"].any()  # no base rows without their patch: scratch is patched before the copy
