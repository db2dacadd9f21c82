"""Patch segments (docs/format.md §5.2, format_version 7): a row delta keeps the patch the previous save stored, by
reference, and appends the rows changed since that save as one more segment; segments apply in order."""

import os

import numpy as np
import pytest

import luopan
import luopan.format
from luopan.checkpoint.rowdelta import WRITER_SEGMENTS, decode_patch
from luopan.format.canonical import inflate_json, seal, unseal
from luopan.format.names import manifest_key
from luopan.retention import KeepLast

from .helpers import assert_refused_as_newer

ROWS, DIM = 8192, 64  # 2 MiB fp32 table, 256-byte rows
ROW_COST = DIM * 4 + 8  # values + 8 bytes of index: what a patch row costs
POLICY = luopan.DeltaPolicy(min_bytes=1 << 20, rebase_fraction=0.08, xor=False)


def open_repo(path, policy=POLICY, **kw):
    return luopan.open(path, chunk_size=64 << 10, delta_policy=policy, **kw)


def file_doc(root, run, step):
    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        return unseal(inflate_json(f.read()))


def reseal(root, run, step, edit):
    doc = file_doc(root, run, step)
    edit(doc)
    with open(os.path.join(root, manifest_key(run, step)), "wb") as f:
        f.write(seal(doc))


class Run:
    """A table whose rows change a few at a time, with a hot set that changes at every save (stale copies)."""

    def __init__(self, root, seed=0, **kw):
        self.root = str(root)
        self.repo = open_repo(self.root, **kw)
        self.rng = np.random.default_rng(seed)
        self.emb = self.rng.standard_normal((ROWS, DIM), dtype=np.float32)
        self.hot = self.rng.choice(ROWS, 8, replace=False)
        self.saved = {}
        self.changed = {}
        self.infos = {}
        self.step = 0

    def save(self, rows=None, hints=False):
        if self.saved:
            if rows is None:
                rows = np.union1d(self.rng.choice(ROWS, 40, replace=False), self.hot)
            self.emb[rows] += 1
            self.changed[self.step] = np.unique(rows)
        extra = {"touched_rows": {"emb": rows}} if hints and rows is not None and self.saved else {}
        self.infos[self.step] = self.repo.save("run", self.step, {"emb": self.emb}, **extra)
        self.saved[self.step] = self.emb.copy()
        self.step += 1
        return self.repo.manifest("run", self.step - 1).entry("emb")

    def check(self, repo=None):
        repo = repo or self.repo
        for step, expected in self.saved.items():
            assert repo.load("run", step)["emb"].tobytes() == expected.tobytes(), step
            target = {"emb": np.zeros_like(expected)}
            repo.load_into("run", target, step)
            assert target["emb"].tobytes() == expected.tobytes(), step


def test_each_save_appends_the_rows_changed_since_the_previous_one(tmp_path):
    r = Run(tmp_path / "r")
    assert r.repo.config.format_version == luopan.format.FORMAT_VERSION == 8
    assert "delta" not in r.save()  # the base
    for s in range(1, 6):
        e = r.save()
        d = e["delta"]
        assert d["base_step"] == 0
        assert d.get("segments", [d["rows"]]) == [len(r.changed[k]) for k in range(1, s + 1)]
        # this save's own rows, not every row changed since the base (the hot rows are stale copies in the earlier
        # segments): the earlier segments' chunks are the previous save's, deduplicated
        assert r.infos[s].new_bytes <= len(r.changed[s]) * ROW_COST + 64, (s, r.infos[s].new_bytes)
        prev = r.repo.manifest("run", s - 1).entry("emb").get("delta")
        if prev is not None:
            assert [c[0] for c in d["index"][: len(prev["index"])]] == [c[0] for c in prev["index"]]
            assert [c[0] for c in d["values"][: len(prev["values"])]] == [c[0] for c in prev["values"]]
        assert file_doc(r.root, "run", s)["format_version"] == (7 if "segments" in d else 5)
    r.check()
    r.repo.close()
    fresh = luopan.open(r.root)
    r.check(fresh)
    assert fresh.verify().ok
    fresh.close()


def test_a_row_takes_its_values_from_the_last_segment_that_lists_it(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    for v in range(4):  # the same rows every save: each segment holds them again, the last one wins
        r.emb[[5, 6, 4000]] = v
        r.save(rows=np.array([5, 6, 4000]))
    e = r.repo.manifest("run", 4).entry("emb")
    assert e["delta"]["segments"] == [3, 3, 3, 3]
    out = r.repo.load("run", 4)["emb"]
    assert (out[[5, 6, 4000]] == 4).all() and out.tobytes() == r.saved[4].tobytes()  # 3, then +1 by save()
    r.check()


def test_the_read_cap_counts_stale_copies_and_compacts_then_rebases(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    budget = POLICY.rebase_fraction * ROWS * DIM * 4
    forms = []
    for _ in range(40):
        e = r.save()
        d = e.get("delta")
        if d is None:
            forms.append("full")
            continue
        forms.append(len(d.get("segments", [0])))
        assert d["rows"] * ROW_COST <= budget  # a restore reads at most the cap on top of the base
    assert "full" in forms  # the patch grew past the cap: a new base
    # compactions: a delta of one segment right after a delta of several
    assert any(a != "full" and a > 1 and b == 1 for a, b in zip(forms, forms[1:])), forms
    r.check()


def test_at_most_sixteen_segments_then_one(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    counts = []
    for s in range(WRITER_SEGMENTS + 3):
        counts.append(len(r.save(rows=np.array([s]))["delta"].get("segments", [0])))
    assert max(counts) == WRITER_SEGMENTS and counts[WRITER_SEGMENTS] == 1, counts
    r.check()


def test_an_unchanged_resave_names_the_same_segments(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    r.save()
    e2 = r.save()
    e3 = r.save(rows=np.array([], dtype=np.int64))  # nothing changed
    assert e3["delta"] == {**e2["delta"], "cycle": e3["delta"]["cycle"]}
    assert r.infos[3].new_bytes == 0
    r.check()


def test_touched_rows_hints_with_segments(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    for _ in range(4):
        e = r.save(hints=True)
    assert len(e["delta"]["segments"]) == 4
    r.check()


def test_a_new_process_keeps_the_segments_on_disk_after_checking_them(tmp_path):
    r = Run(tmp_path / "r")
    for _ in range(4):
        r.save()
    before = r.repo.manifest("run", 3).entry("emb")["delta"]
    r.repo.close()
    r.repo = open_repo(r.root)
    e = r.save()  # the segments on disk are read back, verified and compared with the live rows (§5.5)
    assert e["delta"]["segments"] == [*before["segments"], len(r.changed[4])]
    assert [c[0] for c in e["delta"]["values"][: len(before["values"])]] == [c[0] for c in before["values"]]
    assert r.infos[4].new_bytes <= len(r.changed[4]) * ROW_COST + 64
    e = r.save()
    assert e["delta"]["segments"] == [*before["segments"], len(r.changed[4]), len(r.changed[5])]
    r.check()


def test_a_new_process_stores_rows_reverted_to_the_base_and_catches_lies(tmp_path):
    r = Run(tmp_path / "r")
    r.save()
    base = r.emb.copy()
    r.save(rows=np.array([10, 20, 30]))
    r.save(rows=np.array([20, 40]))
    r.repo.close()
    r.repo = open_repo(r.root)
    r.emb[20] = base[20]  # back to the base's bytes: the segments still name it, so the new one must hold it
    r.emb[30] = base[30]
    r.changed[3] = np.array([20, 30])
    r.infos[3] = r.repo.save("run", 3, {"emb": r.emb})
    r.saved[3] = r.emb.copy()
    r.step = 4
    e = r.repo.manifest("run", 3).entry("emb")
    assert e["delta"]["segments"] == [3, 2, 2]
    r.check()
    # A crafted newest manifest (resealed, valid) whose patch is step 1's: it names rows 10, 20, 30 with step 1's
    # values. A new process keeps that segment only after comparing those rows with the live bytes, so the rows it
    # holds wrongly (20, 30) are stored again in the new segment, with 40 (off the base, named by no segment) and 50.
    one = file_doc(r.root, "run", 1)

    def lie(doc):
        shift = len(doc["packs"])
        doc["packs"] += one["packs"]
        d = dict(one["entries"][0]["delta"])
        for part in ("index", "values"):
            d[part] = [[c[0], c[1] + shift, *c[2:]] for c in d[part]]
        doc["entries"][0]["delta"] = d
    reseal(r.root, "run", 3, lie)
    r.repo.close()
    r.repo = open_repo(r.root)
    r.saved[3] = r.repo.load("run", 3)["emb"]  # what the crafted manifest reads as
    assert not np.array_equal(r.saved[3], r.emb)
    e = r.save(rows=np.array([50]))
    assert e["delta"]["segments"] == [3, 4]
    assert e["delta"]["index"][0][0] == one["entries"][0]["delta"]["index"][0][0]
    assert r.repo.load("run", 4)["emb"].tobytes() == r.emb.tobytes()
    r.check()


def test_a_damaged_segment_on_disk_is_not_kept(tmp_path):
    r = Run(tmp_path / "r")
    for _ in range(3):
        r.save()
    m = r.repo.manifest("run", 2)
    _h, p, off = m.entry("emb")["delta"]["values"][0][:3]
    with open(os.path.join(r.root, "packs", m.packs[p][:2], m.packs[p] + ".pack"), "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 1]))
    r.repo.close()
    r.repo = open_repo(r.root)
    with pytest.warns(UserWarning, match="storing the entry in full|damaged|hash mismatch"):
        e = r.save()
    assert "values" not in e.get("delta", {}) or all(c[0] != _h for c in e["delta"]["values"])
    assert r.repo.load("run", 3)["emb"].tobytes() == r.saved[3].tobytes()


def test_gc_after_pruning_keeps_the_segments_a_checkpoint_shares(tmp_path):
    r = Run(tmp_path / "r")
    for _ in range(6):
        r.save()
    assert len(r.repo.manifest("run", 5).entry("emb")["delta"]["segments"]) == 5
    r.repo.prune("run", KeepLast(1))
    report = r.repo.gc(grace=0, repack_below=0.99)
    assert report.repacked_packs and report.manifests_rewritten
    r.saved = {5: r.saved[5]}
    r.check()
    assert r.repo.verify().ok
    r.save()  # and saving on: the track's kept chunks moved (repack) or are still there
    r.check()


def test_export_and_diff_read_segmented_patches(tmp_path):
    from safetensors.numpy import load_file

    r = Run(tmp_path / "r")
    for _ in range(4):
        r.save()
    out = tmp_path / "x.safetensors"
    r.repo.export("run", out, 3)
    assert load_file(str(out))["emb"].tobytes() == r.saved[3].tobytes()
    diff = r.repo.diff("run", 2, 3)  # step 3 keeps step 2's segments and adds one: the entry changed
    assert [c["path"] for c in diff["changed"]] == ["emb"] and diff["same_structure"]


def test_format_6_repositories_keep_one_cumulative_patch(tmp_path):
    import dataclasses

    from luopan.format.config import RepoConfig

    # a repository created before format 7 (config 6, as `luopan upgrade` left it): no manifest may use segments
    root = str(tmp_path / "r")
    open_repo(root).close()
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        cfg = RepoConfig.from_bytes(f.read(), root)
    with open(os.path.join(root, "luopan.json"), "wb") as f:
        f.write(dataclasses.replace(cfg, format_version=6).to_bytes())
    r = Run(tmp_path / "r")
    assert r.repo.config.format_version == 6
    r.save()
    for s in range(1, 4):
        d = r.save()["delta"]
        assert "segments" not in d
        assert d["rows"] == len(np.unique(np.concatenate([r.changed[k] for k in range(1, s + 1)])))
    r.check()


def test_readers_refuse_bad_segments(tmp_path, monkeypatch):
    r = Run(tmp_path / "r")
    for _ in range(3):
        r.save()
    r.repo.close()
    root = r.root
    assert file_doc(root, "run", 2)["format_version"] == 7

    def entry(doc):
        return doc["entries"][0]["delta"]

    original = file_doc(root, "run", 2)
    cases = [
        (lambda d: entry(d).update(segments=[entry(d)["rows"]]), "does not match the schema"),  # one segment
        (lambda d: entry(d).update(segments=[1] * 65), "does not match the schema"),
        (lambda d: entry(d).update(segments=[entry(d)["rows"] - 1, 2]), "do not add up"),
        (lambda d: entry(d).update(segments=[entry(d)["rows"] - 1, 1]), "within a segment"),  # a run not sorted
        (lambda d: d.update(format_version=6), "format_version 6 lacks"),
    ]
    for edit, message in cases:
        with open(os.path.join(root, manifest_key("run", 2)), "wb") as f:
            f.write(seal(original))
        reseal(root, "run", 2, edit)
        with luopan.open(root) as reader:
            with pytest.raises(luopan.CorruptManifestError, match=message):
                reader.load("run", 2)
    with open(os.path.join(root, manifest_key("run", 2)), "wb") as f:
        f.write(seal(original))
    with luopan.open(root) as reader:
        assert reader.load("run", 2)["emb"].tobytes() == r.saved[2].tobytes()
    assert_refused_as_newer(monkeypatch, root, "run", 2, 6)  # a version-6 luopan: the repository and the manifest


def test_decode_patch_checks_each_segment():
    e = {"path": "t", "shape": [4, 2], "nbytes": 32, "delta": {"segments": [2, 2]}}
    vals = memoryview(bytes(range(32)))
    idx = memoryview(np.array([1, 3, 0, 3], dtype="<i8").tobytes())  # row 3 twice, in two segments: fine
    segments, row_bytes = decode_patch(e, idx, vals, "here")
    assert row_bytes == 8 and [s[0].tolist() for s in segments] == [[1, 3], [0, 3]]
    for bad in ([3, 1, 0, 2], [1, 1, 0, 2], [0, 4, 0, 1], [0, 1, -1, 2]):
        with pytest.raises(luopan.CorruptManifestError, match="within a segment"):
            decode_patch(e, memoryview(np.array(bad, dtype="<i8").tobytes()), vals, "here")


def test_the_cli_shows_and_verifies_segmented_patches(tmp_path):
    import json

    from typer.testing import CliRunner

    from luopan.cli.main import app

    r = Run(tmp_path / "r")
    for _ in range(4):
        r.save()
    r.repo.close()
    runner = CliRunner()
    shown = runner.invoke(app, ["show", "-r", r.root, "run", "3", "--json"])
    assert shown.exit_code == 0, shown.output
    delta = json.loads(shown.output)["entries"][0]["delta"]
    assert delta["segments"] == [len(r.changed[k]) for k in (1, 2, 3)] and delta["rows"] == sum(delta["segments"])
    text = runner.invoke(app, ["show", "-r", r.root, "run", "3"])
    assert text.exit_code == 0 and "in 3 segments" in text.output, text.output
    verified = runner.invoke(app, ["verify", "-r", r.root])
    assert verified.exit_code == 0, verified.output
    checked = runner.invoke(app, ["check", "-r", r.root, "--read-data", "--json"])
    assert checked.exit_code == 0, checked.output


def test_an_unchanged_table_whose_segments_were_collected_is_stored_as_one_segment(tmp_path):
    """The newest checkpoint deleted and collected: the kept segments' chunks are gone, so an unchanged table's patch
    is gathered again from the live rows (one segment), not the whole table (found by review)."""
    r = Run(tmp_path / "r")
    for _ in range(3):
        r.save()
    r.repo.delete("run", 2)
    r.repo.gc(grace=0)
    del r.saved[2]
    e = r.save(rows=np.array([], dtype=np.int64))
    rows = len(np.union1d(r.changed[1], r.changed[2]))
    assert e["delta"]["rows"] == rows and "segments" not in e["delta"]
    assert r.infos[3].new_bytes <= rows * ROW_COST + 64
    r.check()
