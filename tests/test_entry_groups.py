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

from .helpers import assert_refused_as_newer

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
    # created at the newest version (7 since patch segments, §5.2), which includes entry groups (6)
    assert repo.config.format_version == luopan.format.FORMAT_VERSION == 8 > GROUPS_FORMAT_VERSION
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
    assert_refused_as_newer(monkeypatch, root, "run", 3, 5)


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
    """What a signature covers does not depend on how the manifest stores its entries: the same checkpoints saved
    into a repository that keeps them inline (version 1) have the same content digests."""
    from luopan.checkpoint.signatures import content_digest

    root, repo, saved, _base = lora
    with luopan.open(tmp_path / "inline", compression="zstd") as plain:
        for step, st in saved.items():
            plain.save("run", step, st)
        assert "groups" not in file_doc(str(tmp_path / "inline"), "run", 3)
        assert "groups" in file_doc(root, "run", 3)
        for step in saved:
            assert content_digest(repo.manifest("run", step)) == content_digest(plain.manifest("run", step))


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
    import luopan.checkpoint.pipeline as save

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


def test_luopan_upgrade_raises_an_older_repository_to_version_6(tmp_path):
    from typer.testing import CliRunner
    from luopan.cli.main import app
    runner = CliRunner()
    root = str(tmp_path / "r")
    base = base_state()
    with luopan.open(root, compression="zstd") as repo:  # version 1
        for step in (0, 1):
            repo.save("run", step, state(step, base))
    dry = runner.invoke(app, ["upgrade", "-r", root, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["changed"] is False and json.loads(dry.output)["format_version"] == 8
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == 1
    done = runner.invoke(app, ["upgrade", "-r", root])
    assert done.exit_code == 0 and "from format 1 to 8" in done.output, done.output
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == 8
    with luopan.open(root) as repo:
        for step in (2, 3):
            repo.save("run", step, state(step, base))
        assert "groups" not in file_doc(root, "run", 1)  # nothing stored is rewritten
        assert "groups" in file_doc(root, "run", 3)  # later saves group (against step 1's entries on disk)
        for step in range(4):
            assert_exact(repo.load("run", step), state(step, base))
        assert repo.verify().ok
    again = runner.invoke(app, ["upgrade", "-r", root])
    assert again.exit_code == 0 and "already at format 8" in again.output


# -- review fixes: bounded groups, crafted rows and blobs, timing ----------------------------------------------------
def test_groups_stay_below_the_target_size_and_huge_entries_stay_inline(monkeypatch, tmp_path):
    from luopan.format import groups

    monkeypatch.setattr(groups, "GROUP_TARGET_BYTES", 40 << 10)  # 40 KiB: a few entries of 16 rows a group
    root = str(tmp_path / "r")
    rng = np.random.default_rng(3)
    st = {f"w{i:02d}": rng.standard_normal((128, 128), dtype=np.float32) for i in range(40)}  # 16 chunks of 4 KiB
    st["huge"] = rng.standard_normal((512, 512), dtype=np.float32)  # 256 chunk rows: estimated over 40 KiB: inline
    with luopan.open(root, chunk_size=4096) as repo:
        repo.save("run", 0, st)
        repo.save("run", 1, st)
        doc = file_doc(root, "run", 1)
        assert len(doc["groups"]) >= 4 and all(r[4] <= 40 << 10 for r in doc["groups"])
        assert [e["path"] for e in doc["entries"]] == ["huge"]
        assert_exact(repo.load("run", 1), st)


def test_a_group_blob_too_large_for_readers_is_never_written(monkeypatch, tmp_path):
    from luopan.checkpoint import grouping

    monkeypatch.setattr(grouping, "MAX_GROUP_BYTES", 1000)  # as if plan_groups had let one through
    base = base_state()
    with luopan.open(tmp_path / "r") as repo:
        for step in (0, 1):
            repo.save("run", step, state(step, base))
        assert "groups" not in file_doc(str(tmp_path / "r"), "run", 1)  # inline instead
        assert_exact(repo.load("run", 1), state(1, base))


def _put_blob(repo, raw):
    """A pack holding ``raw`` as one blob: (pack id, offset) — for crafting group blobs with genuine addresses."""
    import blake3
    from luopan.format.pack import PackBuilder

    b = PackBuilder()
    off = b.add(blake3.blake3(raw).hexdigest(), memoryview(raw), len(raw), "none")
    pack_id, parts, _total = b.finish()
    repo.store.put(pack_key(pack_id), b"".join(bytes(p) for p in parts))
    return pack_id, off


@pytest.mark.parametrize("blob", ["deep", "duplicate-key", "not-canonical", "extra-member"])
def test_crafted_group_blobs_are_corrupt_manifests(lora, blob):
    import blake3
    from luopan.format import groups

    root, repo, _saved, _base = lora
    doc = file_doc(root, "run", 3)
    doc.pop("checksum", None)
    h, p, off, length, size, codec, x = doc["groups"][0]
    real = json.loads(zstandard.ZstdDecompressor().decompress(
        open(os.path.join(root, pack_key(doc["packs"][p])), "rb").read()[off:off + length]) if codec == "zstd"
        else open(os.path.join(root, pack_key(doc["packs"][p])), "rb").read()[off:off + length])
    if blob == "deep":
        raw = b'{"entries":' + b"[" * 100_000 + b"]" * 100_000 + b',"packs":[]}'
    elif blob == "duplicate-key":
        raw = json.dumps(real, separators=(",", ":"), sort_keys=True).encode()
        raw = raw[:-1] + b',"packs":' + json.dumps(real["packs"]).replace(" ", "").encode() + b"}"
    elif blob == "not-canonical":
        raw = json.dumps(real, indent=1).encode()
    else:
        raw = json.dumps({**real, "more": 1}, separators=(",", ":"), sort_keys=True).encode()
    pack_id, pos = _put_blob(repo, raw)
    doc["packs"].append(pack_id)
    doc["groups"][0] = [blake3.blake3(raw).hexdigest(), len(doc["packs"]) - 1, pos, len(raw), len(raw), "none",
                        "0" * 32]
    write_doc(root, "run", 3, doc)
    groups.CACHE.blobs.clear()
    groups.CACHE.size = 0
    with luopan.open(root) as fresh:
        with pytest.raises(luopan.CorruptManifestError, match="malformed"):
            fresh.manifest("run", 3)


@pytest.mark.parametrize("field,value", [(2, "16"), (2, 1.5), (3, None), (3, True), (2, -1), (6, "zz")])
def test_crafted_group_rows_are_corrupt_manifests(lora, field, value):
    from luopan.format import groups

    root, repo, _saved, _base = lora
    doc = file_doc(root, "run", 3)
    doc.pop("checksum", None)
    doc["groups"][0][field] = value
    write_doc(root, "run", 3, doc)
    groups.CACHE.blobs.clear()
    groups.CACHE.size = 0
    with pytest.raises(luopan.CorruptManifestError, match="malformed"):
        repo.manifest("run", 3)


def test_save_us_covers_storing_the_groups(lora, monkeypatch):
    import time as _time
    from luopan.checkpoint import grouping

    root, repo, _saved, base = lora
    slow = grouping.zstd_blob

    def slow_zstd(*a, **k):
        _time.sleep(0.3)
        return slow(*a, **k)

    monkeypatch.setattr(grouping, "zstd_blob", slow_zstd)
    from luopan.checkpoint.carry import Basis

    monkeypatch.setattr(grouping, "basis", lambda doc: Basis({}))  # nothing reused below: the groups are written anew
    repo.checkpointing._grouping["run"] = Basis({})
    repo.save("run", 4, state(4, base))  # nothing to compare with: no groups
    repo.save("run", 5, state(5, base))  # the base's groups again, found in the index: none written
    repo.save("run", 6, {**state(6, base), "extra.weight": np.ones(4, np.float32)})
    stats = repo.manifest("run", 6).stats
    written = stats["new_chunks"] - LAYERS - 1  # group blobs this save coded
    assert stats["save_us"] >= written * 0.3e6


def test_a_damaged_group_is_stored_again_not_named_by_later_saves(lora):
    """A group blob damaged in its pack (trailer intact) is read back before a save names it again: the next
    checkpoint stores a fresh copy and loads; only the checkpoints that already named it are damaged."""
    from luopan.format import groups

    root, repo, _saved, base = lora
    doc = file_doc(root, "run", 3)
    h, p, off, length, *_ = doc["groups"][0]
    with open(os.path.join(root, pack_key(doc["packs"][p])), "r+b") as f:
        f.seek(off + length // 2)
        b = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    groups.CACHE.blobs.clear()
    groups.CACHE.size = 0
    repo.save("run", 4, state(4, base))
    new = file_doc(root, "run", 4)
    assert any(r[0] == h and new["packs"][r[1]] != doc["packs"][p] for r in new["groups"])  # a fresh copy
    groups.CACHE.blobs.clear()
    groups.CACHE.size = 0
    with luopan.open(root) as fresh:
        with pytest.raises(luopan.IntegrityError):
            fresh.load("run", 3)  # names the damaged copy
        assert_exact(fresh.load("run", 4), state(4, base))


def test_a_process_reads_each_reused_group_back_once(lora, monkeypatch):
    """A group blob this process has read back intact is named again without another read while its pack is
    unchanged (the damage test above shows a changed pack is read again)."""
    from luopan.checkpoint import grouping

    root, repo, _saved, base = lora
    reads = []
    real = grouping.read_chunk
    monkeypatch.setattr(grouping, "read_chunk", lambda store, ref, out, *a: reads.append(ref.hash) or
                        real(store, ref, out, *a))
    repo.save("run", 4, state(4, base))
    repo.save("run", 5, state(5, base))
    named = {r[0] for r in file_doc(root, "run", 5)["groups"]}
    assert named and reads == []  # the fixture's saves 2 and 3 already read these groups back
    assert_exact(repo.load("run", 5), state(5, base))
    with luopan.open(root) as fresh:  # a new process reads each group it names again once
        fresh.save("run", 6, state(6, base))
        fresh.save("run", 7, state(7, base))
    assert sorted(reads) == sorted({r[0] for r in file_doc(root, "run", 6)["groups"]})
