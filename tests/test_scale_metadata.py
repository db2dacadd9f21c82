"""Metadata at scale (issue 30): saves carry unchanged entries and their entry groups without touching their chunk
rows (luopan.checkpoint.carry); listing, prune and gc read each manifest's own file and each distinct group once
(format.groups.GroupMemo); ``verify --structure`` checks manifests and packs without reading a chunk."""

import os

import pytest
import torch
import zstandard

import luopan
from luopan.checkpoint import carry
from luopan.format import groups
from luopan.format.canonical import unseal
from luopan.format.names import manifest_key, pack_key
from luopan.retention import KeepBest, KeepLast

from .helpers import flip_byte

from typer.testing import CliRunner

from luopan.cli.main import app

N = 64  # entries: above GROUP_MIN_ENTRIES, a few groups
TRAINED = ("w07", "w39")


def make_state():
    g = torch.Generator().manual_seed(3)
    return {f"w{i:02d}": torch.randn(64, 64, generator=g) for i in range(N)}


def run_cli(args):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def file_doc(root, step, run="run"):
    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        data = f.read()
    if data.startswith(b"\x28\xb5\x2f\xfd"):
        data = zstandard.ZstdDecompressor().decompress(data)
    return unseal(data)


def by_pack_id(doc):
    """Every entry with its rows naming pack ids (what is equal between manifests that list packs differently)."""
    packs = doc["packs"]
    return {e["path"]: groups.with_pack_ids(e, packs) for e in doc["entries"]}


@pytest.fixture
def counting(monkeypatch):
    """How many entries each save carried (luopan.checkpoint.carry.Basis.carried returning an entry)."""
    seen = []
    real = carry.Basis.carried

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(carry.Basis, "carried", spy)
    return seen


def train(state, step):
    for k in TRAINED:
        state[k].add_(step)


def saved_run(root, saves=6, counting=None):
    repo = luopan.open(root, chunk_size=4096)
    state = make_state()
    for step in range(saves):
        train(state, step)
        repo.save("run", step, state, trust_versions=True, metrics={"loss": 10.0 - step})
    return repo, state


def test_trusted_saves_carry_unchanged_entries_and_name_the_same_groups(tmp_path, counting):
    repo, state = saved_run(str(tmp_path / "r"))
    assert sum(counting) >= (N - len(TRAINED)) * 3  # saves 2.. carried every untouched entry
    a, b = file_doc(str(tmp_path / "r"), 4), file_doc(str(tmp_path / "r"), 5)
    assert a["groups"] and [g[0] for g in a["groups"]] == [g[0] for g in b["groups"]]  # the same blobs, named again
    assert sorted(e["path"] for e in b["entries"]) == sorted(TRAINED)  # only what changed is inline
    assert repo.manifest("run", 5).stats["new_chunks"] == 2 * 4  # two trained tensors of 16 KiB in 4 KiB chunks
    for k, v in repo.load("run", 5).items():
        assert torch.equal(v, state[k]), k
    # what was carried is what a save reading every byte would have listed
    expected = by_pack_id(repo.manifest("run", 5).doc)
    with luopan.open(str(tmp_path / "r")) as fresh:
        fresh.save("run", 6, state)  # a new process: nothing carried, every chunk hashed (found, not stored)
        again = by_pack_id(fresh.manifest("run", 6).doc)
    assert again == expected
    assert repo.verify().ok


def test_nothing_is_carried_after_gc_or_into_a_missing_pack(tmp_path, counting):
    root = str(tmp_path / "r")
    repo, state = saved_run(root, 4)
    repo.prune("run", KeepLast(2))
    repo.gc(grace=0)  # the index files are replaced: locations are read again, nothing carried from before
    counting.clear()
    train(state, 4)
    repo.save("run", 4, state, trust_versions=True)
    assert not any(counting)
    for k, v in repo.load("run", 4).items():
        assert torch.equal(v, state[k]), k
    # a pack a carried entry names disappears: that entry is stored again, not named
    doc = file_doc(root, 4)
    full = repo.manifest("run", 4).doc
    victim = full["packs"][full["entries"][0]["chunks"][0][1]]
    train(state, 5)
    repo.save("run", 5, state, trust_versions=True)
    os.remove(os.path.join(root, pack_key(victim)))
    counting.clear()
    train(state, 6)
    repo.save("run", 6, state, trust_versions=True)
    assert counting and not all(counting)
    for k, v in repo.load("run", 6).items():
        assert torch.equal(v, state[k]), k
    assert doc["groups"]


def test_verify_structure_checks_manifests_and_packs_without_reading_chunks(tmp_path, monkeypatch):
    root = str(tmp_path / "r")
    repo, _state = saved_run(root, 4)
    report = repo.verify(structure=True)
    assert report.ok and report.checkpoints == 4 and report.chunks > 0 and report.bytes == 0
    reads = []
    monkeypatch.setattr(groups.GroupMemo, "_read", (lambda real: lambda self, row, *a: reads.append(row[0])
                                                     or real(self, row, *a))(groups.GroupMemo._read))
    assert repo.verify("run", structure=True).ok
    assert len(reads) == len(set(reads)) > 0  # each distinct group once, though every manifest names it
    assert run_cli(["-r", root, "verify", "--structure"]).exit_code == 0
    # a pack cut short: its rows run past its end
    doc = file_doc(root, 3)
    data_pack = [p for p in doc["packs"] if p not in {doc["packs"][g[1]] for g in doc["groups"]}][0]
    path = os.path.join(root, pack_key(data_pack))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(luopan.IntegrityError, match=data_pack[:16]):
        repo.verify("run", structure=True)
    result = run_cli(["-r", root, "verify", "--structure"])
    assert result.exit_code == 3 and data_pack[:16] in result.output


def test_a_damaged_group_is_found_by_verify_structure_but_listing_and_prune_do_not_read_groups(tmp_path):
    root = str(tmp_path / "r")
    repo, _state = saved_run(root, 5)
    doc = file_doc(root, 4)
    _h, p, off, length, *_ = doc["groups"][0]
    flip_byte(os.path.join(root, pack_key(doc["packs"][p])), off + length // 2)
    groups.CACHE.blobs.clear()
    groups.CACHE.size = 0
    with luopan.open(root) as fresh:
        assert [c.step for c in fresh.checkpoints("run")] == [0, 1, 2, 3, 4]  # listing reads manifests' own files
        with pytest.raises(luopan.IntegrityError, match="entry group|damaged"):
            fresh.verify("run", structure=True)
        with pytest.raises(luopan.IntegrityError):
            fresh.load("run", 4)
        plan = fresh.prune("run", KeepBest(1, "loss", "max"))  # metrics come from the manifests' own files
        assert plan.kept == [0, 4]  # the best, and the newest (always kept)
        assert fresh.steps("run") == [0, 4]


def test_gc_reads_each_group_once_and_keeps_what_groups_need(tmp_path, monkeypatch):
    root = str(tmp_path / "r")
    repo, state = saved_run(root, 8)
    reads = []
    monkeypatch.setattr(groups.GroupMemo, "_read", (lambda real: lambda self, row, *a: reads.append(row[0])
                                                     or real(self, row, *a))(groups.GroupMemo._read))
    report = repo.gc(grace=0, dry_run=True)
    assert report.manifests == 8 and len(reads) == len(set(reads)) > 0
    repo.prune("run", KeepLast(2))
    report = repo.gc(grace=0)
    assert report.deleted_packs > 0
    for k, v in repo.load("run", 7).items():
        assert torch.equal(v, state[k]), k
    assert repo.verify().ok


@pytest.mark.parametrize("damage", ["nbytes", "created", "row"])
def test_listing_a_grouped_manifest_still_checks_its_own_file(tmp_path, damage):
    """Listing skips the groups, not the checks of what the manifest's own file holds."""
    from luopan.format.canonical import seal

    root = str(tmp_path / "r")
    repo, _state = saved_run(root, 4)
    doc = file_doc(root, 3)
    doc.pop("checksum", None)
    assert doc["groups"] and doc["entries"]
    if damage == "nbytes":
        doc["entries"][0]["nbytes"] += 1
    elif damage == "created":
        doc["created"] = "yesterday"
    else:
        doc["entries"][0]["chunks"][0][2] = -16
    with open(os.path.join(root, manifest_key("run", 3)), "wb") as f:
        f.write(seal(doc))
    with pytest.raises(luopan.CorruptManifestError, match="00000003"):
        repo.checkpoints("run")
    result = run_cli(["-r", root, "ls", "run"])
    assert "DAMAGED" in result.output and "step 3" in result.output
