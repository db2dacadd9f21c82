"""A repository written by luopan of format version 6 (tests/data/v6_repo/, made by tests/data/make_v6_repo.py with
commit c2fe856) still reads exactly with this luopan, which can also add to it; since its config says 6, what this
luopan adds stays version 6 (entry groups, one cumulative patch per row delta, never patch segments: docs/format.md
§5.2), so a reader of version 6 still opens it afterwards. Once `luopan upgrade` raises it to 7, later saves keep the
version-6 patch as the first segment and append to it."""

import os

import pytest
from typer.testing import CliRunner

import luopan
import luopan.format
from luopan.cli.main import app
from luopan.format.manifest import stored_rows

from .helpers import assert_lora_loads, config_version, data_module, sample_copy, zstd_manifest_doc

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SAMPLE = os.path.join(DATA, "v6_repo")

gen = data_module("make_v6_repo")
NEW_STEPS = [gen.STEPS[-1] + 1, gen.STEPS[-1] + 2]
POLICY = luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096)


@pytest.fixture
def sample(tmp_path):
    return sample_copy(SAMPLE, tmp_path)


file_doc = zstd_manifest_doc


def assert_loads_exactly(repo, steps):
    assert_lora_loads(repo, gen, steps)


def _add_steps(root):
    repo = luopan.open(root, delta_policy=POLICY)  # a fresh process: its first save starts from the disk
    for step in NEW_STEPS:
        repo.save("lora", step, gen.lora_state(step), metrics=gen.metrics(step))
    repo.close()


def test_the_sample_is_what_the_generator_describes():
    root = os.path.join(SAMPLE, "auto")
    assert config_version(root) == 6
    docs = [file_doc(root, "lora", s) for s in gen.STEPS]
    assert all(d["format_version"] <= 6 for d in docs)
    assert any("groups" in d for d in docs)
    with luopan.open(root) as repo:  # entries as readers see them (groups expanded)
        entries = [e for s in gen.STEPS for e in repo.manifest("lora", s).entries]
    deltas = [e["delta"] for e in entries if "delta" in e]
    assert deltas and not any("segments" in d for d in deltas)
    assert deltas[-1]["rows"] > deltas[0]["rows"]  # a cumulative patch
    assert any("xor" in e for e in entries)
    assert any(r[5] == "bytegroup" for e in entries for r in stored_rows(e))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(SAMPLE) for f in fs)
    assert total < 400 << 10


def test_every_checkpoint_of_a_v6_repository_loads_exactly(sample):
    with luopan.open(sample) as repo:
        assert repo.config.format_version == 6
        assert_loads_exactly(repo, gen.STEPS)
        assert repo.verify().ok


def test_this_luopan_adds_checkpoints_to_a_v6_repository_without_segments(sample, monkeypatch):
    _add_steps(sample)
    assert config_version(sample) == 6
    for step in NEW_STEPS:
        doc = file_doc(sample, "lora", step)
        assert doc["format_version"] <= 6
        assert not any("segments" in e.get("delta", {}) for e in doc["entries"])
    with luopan.open(sample) as again:
        assert_loads_exactly(again, gen.STEPS + NEW_STEPS)
        assert again.verify().ok
        again.gc(grace=0)
    with luopan.open(sample) as after:
        assert_loads_exactly(after, gen.STEPS + NEW_STEPS)
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 6)  # a version-6 luopan still opens it
    with luopan.open(sample) as old:
        assert_loads_exactly(old, gen.STEPS + NEW_STEPS)
        assert old.verify().ok


def test_after_upgrade_the_v6_patch_becomes_the_first_segment(sample, monkeypatch):
    done = CliRunner().invoke(app, ["upgrade", "-r", str(sample)])
    assert done.exit_code == 0 and "from format 6 to 8" in done.output, done.output
    before = file_doc(sample, "lora", gen.STEPS[-1])
    with luopan.open(sample) as repo:
        flat = repo.manifest("lora", gen.STEPS[-1]).entry("table")["delta"]
    _add_steps(sample)
    with luopan.open(sample) as repo:
        d = repo.manifest("lora", NEW_STEPS[0]).entry("table")["delta"]
        assert d["segments"][0] == flat["rows"] and len(d["segments"]) == 2  # kept, read back and checked
        assert [r[0] for r in d["values"][: len(flat["values"])]] == [r[0] for r in flat["values"]]
        assert_loads_exactly(repo, gen.STEPS + NEW_STEPS)
        assert repo.verify().ok
    assert before == file_doc(sample, "lora", gen.STEPS[-1])  # nothing stored was rewritten
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 6)
    with pytest.raises(luopan.UnsupportedFormatError, match="newer"):
        luopan.open(sample)
