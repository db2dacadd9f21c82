"""Entry groups (docs/format.md §8.5, format_version 6): a checkpoint manifest names content-addressed blobs of its
entries, so what did not change since the previous checkpoint is not stored again; readers expand them, and every
load, gc, repack, verify and replication sees the same entries as an inline manifest."""

import json
import os

import numpy as np
import pytest
import zstandard

import luopan
import luopan.format
from luopan.format.canonical import seal, unseal
from luopan.format.groups import GROUP_MIN_ENTRIES, GROUPS_FORMAT_VERSION
from luopan.format.names import manifest_key, pack_key
from luopan.retention import KeepLast

LAYERS = 40  # 40 frozen base weights + 40 adapters: 80 entries, well above GROUP_MIN_ENTRIES


def base_state():
    rng = np.random.default_rng(0)
    return {f"layer{i:02d}.weight": rng.standard_normal((32, 32), dtype=np.float32) for i in range(LAYERS)}


def adapters(step):
    rng = np.random.default_rng(1000 + step)
    return {f"layer{i:02d}.lora": rng.standard_normal((2, 32), dtype=np.float32) for i in range(LAYERS)}


def state(step, base):
    out = {}
    for i in range(LAYERS):  # interleaved, as PEFT's state dicts are
        out[f"layer{i:02d}.weight"] = base[f"layer{i:02d}.weight"]
        out[f"layer{i:02d}.lora"] = adapters(step)[f"layer{i:02d}.lora"]
    return out


def file_doc(root, run, step):
    """The manifest file's own document (groups, no entries), not the expanded one."""
    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        data = f.read()
    if data.startswith(b"\x28\xb5\x2f\xfd"):
        data = zstandard.ZstdDecompressor().decompress(data)
    return unseal(data)


def write_doc(root, run, step, doc):
    with open(os.path.join(root, manifest_key(run, step)), "wb") as f:
        f.write(seal(doc))


def assert_exact(got, expected):
    assert list(got) == list(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


@pytest.fixture
def lora(tmp_path):
    """A repository with steps 0..3 of a LoRA-like run; returns (root, repo, saved states)."""
    root = str(tmp_path / "r")
    repo = luopan.open(root)
    base = base_state()
    saved = {}
    for step in range(4):
        saved[step] = state(step, base)
        repo.save("run", step, saved[step])
    yield root, repo, saved, base
    repo.close()


def test_new_auto_repositories_are_version_6_and_group_large_manifests(lora):
    root, repo, saved, _base = lora
    assert repo.config.format_version == GROUPS_FORMAT_VERSION == luopan.format.FORMAT_VERSION
    assert "groups" not in file_doc(root, "run", 0)  # nothing to compare with: every entry inline
    doc = file_doc(root, "run", 3)
    assert doc["groups"] and doc["format_version"] == 6
    assert sorted(e["path"] for e in doc["entries"]) == sorted(adapters(3))  # the changed entries stay inline
    m = repo.manifest("run", 3)
    assert [e["path"] for e in m.entries] == list(saved[3])  # expanded in the manifest's order
    for step, expected in saved.items():
        assert_exact(repo.load("run", step), expected)
    assert repo.verify().ok


def test_unchanged_entries_share_their_groups(lora):
    root, repo, _saved, _base = lora
    rows = {step: [r[0] for r in file_doc(root, "run", step).get("groups", [])] for step in range(4)}
    # from the second save on, the base's entries sit in groups every later manifest names again
    assert rows[1] and rows[1] == rows[2] == rows[3]
    assert repo.manifest("run", 1).stats["new_chunks"] == LAYERS + len(rows[1])  # adapters, and the groups once
    for step in (2, 3):
        assert repo.manifest("run", step).stats["new_chunks"] == LAYERS  # the adapters only
    assert len(rows[1]) <= LAYERS // 8 + 2  # ~1 group per 32 entries (content-defined cuts)


def test_a_new_process_shares_the_groups_the_last_one_wrote(lora, tmp_path):
    root, repo, _saved, base = lora
    repo.close()
    with luopan.open(root) as again:
        again.save("run", 4, state(4, base))
        before = {r[0] for r in file_doc(root, "run", 3)["groups"]}
        after = {r[0] for r in file_doc(root, "run", 4)["groups"]}
        assert before == after
        assert again.manifest("run", 4).stats["new_chunks"] == LAYERS
        assert_exact(again.load("run", 4), state(4, base))


def test_small_manifests_stay_inline(tmp_path):
    with luopan.open(tmp_path / "r") as repo:
        repo.save("run", 0, {f"t{i}": np.full(4, i, np.float32) for i in range(GROUP_MIN_ENTRIES - 1)})
        doc = file_doc(str(tmp_path / "r"), "run", 0)
        assert "groups" not in doc and len(doc["entries"]) == GROUP_MIN_ENTRIES - 1 and doc["format_version"] < 6


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_repositories_of_older_versions_keep_inline_manifests(tmp_path, compression):
    base = base_state()
    with luopan.open(tmp_path / "r", compression=compression) as repo:
        assert repo.config.format_version == 1
        repo.save("run", 0, state(0, base))
        doc = file_doc(str(tmp_path / "r"), "run", 0)
        assert "groups" not in doc and doc["format_version"] == 1
        assert_exact(repo.load("run", 0), state(0, base))


def test_a_version_5_reader_refuses_the_repository_and_its_manifests(lora, monkeypatch):
    root, repo, _saved, _base = lora
    repo.close()
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 5)
    with pytest.raises(luopan.UnsupportedFormatError, match=r"format_version 6, newer than this luopan reads \(5\)"):
        luopan.open(root)
    from luopan.format.manifest import parse_manifest
    with open(os.path.join(root, manifest_key("run", 3)), "rb") as f:
        data = f.read()
    with pytest.raises(luopan.UnsupportedFormatError, match="newer"):
        parse_manifest(data, "m", "run", 3)


def test_a_damaged_group_blob_is_an_integrity_error_and_verify_names_it(lora):
    root, repo, _saved, _base = lora
    doc = file_doc(root, "run", 3)
    h, p, off, length, *_ = doc["groups"][0]
    path = os.path.join(root, pack_key(doc["packs"][p]))
    with open(path, "r+b") as f:
        f.seek(off + length // 2)
        b = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    from luopan.format import groups
    groups.CACHE.blobs.clear()  # this process read it intact before
    groups.CACHE.size = 0
    with luopan.open(root) as fresh:
        with pytest.raises(luopan.IntegrityError):
            fresh.load("run", 3)
        with pytest.raises(luopan.IntegrityError, match=r"entry group.*damaged"):
            fresh.verify()


@pytest.mark.parametrize("damage", ["drop", "duplicate", "inline-dropped", "old-version", "bad-pack"])
def test_crafted_group_lists_are_refused(lora, damage):
    root, repo, _saved, _base = lora
    doc = file_doc(root, "run", 3)
    doc.pop("checksum", None)
    if damage == "drop":
        doc["groups"] = doc["groups"][1:]
    elif damage == "duplicate":
        doc["groups"] = doc["groups"] + doc["groups"][:1]
    elif damage == "inline-dropped":
        doc["entries"] = doc["entries"][1:]
    elif damage == "old-version":
        doc["format_version"] = 5
    elif damage == "bad-pack":
        doc["groups"][0][1] = len(doc["packs"])
    write_doc(root, "run", 3, doc)
    with pytest.raises(luopan.CorruptManifestError):
        repo.manifest("run", 3)
    with pytest.raises(luopan.CorruptManifestError):
        repo.load("run", 3)


def test_a_group_naming_a_pack_the_manifest_does_not_list_is_refused(lora):
    root, repo, _saved, _base = lora
    doc = file_doc(root, "run", 3)
    doc.pop("checksum", None)
    # keep only the packs the group rows name: the entries inside them name packs the manifest no longer lists
    used = sorted({r[1] for r in doc["groups"]})
    doc["groups"] = [[r[0], used.index(r[1]), *r[2:]] for r in doc["groups"]]
    doc["packs"] = [doc["packs"][i] for i in used]
    write_doc(root, "run", 3, doc)
    with pytest.raises(luopan.CorruptManifestError, match="malformed|KeyError"):
        repo.manifest("run", 3)


def test_gc_after_pruning_keeps_what_groups_need_and_repack_rewrites_them_inline(lora):
    root, repo, saved, _base = lora
    repo.prune("run", KeepLast(1))
    report = repo.gc(grace=0, repack_below=0.99)  # step 0's pack lost its adapters: repacked
    assert report.repacked_packs and report.manifests_rewritten == 1
    assert repo.steps("run") == [3]
    assert_exact(repo.load("run", 3), saved[3])
    assert repo.verify().ok
    doc = file_doc(root, "run", 3)  # rewritten with every entry inline, still version 6
    assert "groups" not in doc and len(doc["entries"]) == 2 * LAYERS and doc["format_version"] == 6
    for step in (4, 5):  # the first save after a repack finds its entries moved; the next groups them again
        repo.save("run", step, state(step, _base))
        assert_exact(repo.load("run", step), state(step, _base))
    assert "groups" in file_doc(root, "run", 5)


def test_replication_copies_the_groups(tmp_path):
    base = base_state()
    remote = tmp_path / "remote"
    with luopan.open(tmp_path / "local", replicate_to=str(remote)) as repo:
        for step in range(3):
            repo.save("run", step, state(step, base))
        assert repo.wait_replicated(30)
    with luopan.open(remote) as far:
        assert far.steps("run") == [0, 1, 2]
        for step in range(3):
            assert_exact(far.load("run", step), state(step, base))
        assert far.verify().ok
        assert "groups" in file_doc(str(remote), "run", 2)


def test_signing_covers_the_expanded_entries(lora, tmp_path):
    """What a signature covers does not depend on how the manifest stores its entries."""
    root, repo, _saved, _base = lora
    m = repo.manifest("run", 3)
    from luopan.checkpoint.signatures import content_digest
    inline = dict(m.doc)
    inline.pop("groups")
    assert content_digest(m) == content_digest(luopan.format.manifest.Manifest(inline))


def test_cli_show_ls_and_du_read_grouped_manifests(lora):
    from typer.testing import CliRunner
    from luopan.cli.main import app
    root, repo, _saved, _base = lora
    runner = CliRunner()
    shown = runner.invoke(app, ["show", "-r", root, "run", "3", "--json"])
    assert shown.exit_code == 0, shown.output
    paths = json.dumps(json.loads(shown.output))
    assert "layer39.lora" in paths and "layer00.weight" in paths
    listed = runner.invoke(app, ["ls", "-r", root, "run", "--json"])
    assert listed.exit_code == 0, listed.output
    assert '"step": 3' in listed.output or '"steps": [0, 1, 2, 3]' in listed.output, listed.output
    verified = runner.invoke(app, ["verify", "-r", root])
    assert verified.exit_code == 0, verified.output


@pytest.mark.parametrize("where", ["manifest", "groups"])
def test_a_save_failing_after_its_chunks_leaves_no_packs_or_index(lora, monkeypatch, where):
    """The index file is written after the groups: a save that fails before it takes its packs back."""
    import luopan.checkpoint.grouping as grouping
    import luopan.checkpoint.save as save

    root, repo, saved, base = lora
    packs_before = set(repo.store.list("packs/"))
    index_before = set(repo.store.list("index/"))

    def boom(*_a, **_k):
        raise RuntimeError("injected")

    if where == "manifest":
        monkeypatch.setattr(save._CheckpointWriter, "manifest", boom)
    else:
        monkeypatch.setattr(grouping, "group_blobs", boom)
    with pytest.raises(RuntimeError, match="injected"):
        repo.save("run", 4, state(4, base))
    assert set(repo.store.list("packs/")) == packs_before
    assert set(repo.store.list("index/")) == index_before
    monkeypatch.undo()
    repo.save("run", 4, state(4, base))
    assert_exact(repo.load("run", 4), state(4, base))
    assert repo.verify().ok


def test_check_reads_the_group_blobs(lora):
    root, repo, _saved, _base = lora
    from typer.testing import CliRunner
    from luopan.cli.main import app
    r = CliRunner().invoke(app, ["check", "-r", root, "--read-data", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    groups = {g[0] for step in range(4) for g in file_doc(root, "run", step).get("groups", [])}
    assert groups and report["chunks"] >= 4 * LAYERS + LAYERS + len(groups)  # adapters per step, base, groups
