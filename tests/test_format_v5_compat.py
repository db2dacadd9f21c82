"""A repository written by luopan of format version 5 (tests/data/v5_repo/, made by tests/data/make_v5_repo.py with
commit cdafbe7) still reads exactly with this luopan, which can also add to it; and since its config says 5, what
this luopan adds stays version 5 (inline manifests, never entry groups: docs/format.md §8.5), so a reader of
version 5 still opens it afterwards."""

import json
import os

import pytest

import luopan
import luopan.format
from luopan.format.manifest import stored_rows

from .helpers import assert_lora_loads, config_version, data_module, sample_copy, zstd_manifest_doc

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SAMPLE = os.path.join(DATA, "v5_repo")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


gen = data_module("make_v5_repo")
NEW_STEPS = [gen.STEPS[-1] + 1, gen.STEPS[-1] + 2]  # what this luopan adds to the run


@pytest.fixture
def sample(tmp_path):
    return sample_copy(SAMPLE, tmp_path)


file_doc = zstd_manifest_doc  # a format-5 repository's manifests are zstd frames of sealed JSON


def assert_loads_exactly(repo, steps):
    assert_lora_loads(repo, gen, steps)


def test_the_sample_is_what_the_generator_describes():
    """Guards the sample itself: written by a version-5 luopan, with XOR and row deltas and bytegroup chunks, and
    enough mostly unchanged entries that a version-6 writer would have grouped them."""
    root = os.path.join(SAMPLE, "auto")
    assert config_version(root) == 5
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        assert json.loads(f.read())["compression"]["codec"] == "auto"
    docs = [file_doc(root, "lora", s) for s in gen.STEPS]
    assert sorted(os.listdir(os.path.join(root, "runs", "lora", "ckpt"))) == [f"{s:08d}.json" for s in gen.STEPS]
    assert all(d["format_version"] <= 5 for d in docs)
    assert not any("groups" in d for d in docs)
    entries = [e for d in docs for e in d["entries"]]
    assert any("xor" in e for e in entries)
    assert any("delta" in e for e in entries)
    assert any(r[5] == "bytegroup" for e in entries for r in stored_rows(e))
    assert all(len(d["entries"]) >= 40 for d in docs)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(SAMPLE) for f in fs)
    assert total < 400 << 10


def test_every_checkpoint_of_a_v5_repository_loads_exactly(sample):
    repo = luopan.open(sample)
    assert repo.config.format_version == 5
    assert_loads_exactly(repo, gen.STEPS)
    assert repo.verify().ok
    repo.close()


def _add_steps(root):
    """This luopan saves NEW_STEPS of the run into the version-5 repository, from a fresh repo object (its first
    save starts from the version-5 manifest on disk)."""
    repo = luopan.open(root, delta_policy=luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096))
    for step in NEW_STEPS:
        repo.save("lora", step, gen.lora_state(step), metrics=gen.metrics(step))
    repo.close()


def test_this_luopan_adds_checkpoints_to_a_v5_repository(sample):
    _add_steps(sample)
    assert config_version(sample) == 5  # the repository stays version 5
    for step in NEW_STEPS:
        doc = file_doc(sample, "lora", step)
        assert "groups" not in doc, "a version-5 repository got an entry-grouped manifest"
        assert doc["format_version"] <= 5
        assert len(doc["entries"]) == len(file_doc(sample, "lora", gen.STEPS[0])["entries"])  # every entry inline
    again = luopan.open(sample)  # a fresh process
    assert again.config.format_version == 5
    assert_loads_exactly(again, gen.STEPS + NEW_STEPS)
    assert again.verify().ok
    again.gc(grace=0)
    again.close()
    after = luopan.open(sample)
    assert_loads_exactly(after, gen.STEPS + NEW_STEPS)
    assert after.verify().ok
    assert config_version(sample) == 5


def test_a_version_5_reader_still_opens_it_after_this_luopan_added_to_it(sample, monkeypatch):
    _add_steps(sample)
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 5)
    repo = luopan.open(sample)
    assert_loads_exactly(repo, gen.STEPS + NEW_STEPS)
    assert repo.verify().ok
    repo.close()
