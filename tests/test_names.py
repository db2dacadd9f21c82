"""Names luopan takes from users — run names, pin tags, subtrees, entry keys — and steps, tried with newlines, NUL,
``..``, ``/``, absolute paths, lookalike Unicode, 10,000 characters, bools, floats, negative and huge numbers.

Run names become path components, so they are validated by one full-match rule before any write. Entry keys are
data (escaped into key paths, stored in JSON): any str round-trips exactly. Subtrees only select; tags are printable
text. Every refusal is an InvalidNameError naming the value.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import luopan
from luopan.format.names import MAX_STEP, check_run, check_step, check_tag, manifest_key
from luopan.retention import KeepLast

NASTY = ["a\nb", "a\n", "\n", "a\0b", "..", ".", "../x", "a/../b", "/abs", "a/b", "a\\b", "", " ", "x" * 10_000,
         "ехр", "exp‐1", "ｅｘｐ", "e\u0301", "\u202eabc", "a\u200bb", "~0", "~1", "a~b", "\ud800", "💾"]
FULL_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

suppress = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@given(st.one_of(st.text(max_size=140), st.sampled_from(NASTY)))
@settings(max_examples=300, deadline=None)
def test_run_names_follow_one_full_match_rule(name):
    if FULL_RULE.fullmatch(name) and name.isascii():
        assert check_run(name) == name
        assert manifest_key(name, 1).split("/")[1] == name  # exactly one path component
    else:
        with pytest.raises(luopan.InvalidNameError, match="invalid run name"):
            check_run(name)


@given(st.one_of(st.text(max_size=140), st.sampled_from(NASTY)))
@settings(max_examples=300, deadline=None)
def test_tags_are_printable_text(tag):
    ok = 0 < len(tag) <= 128 and tag.isprintable() and not any(0xD800 <= ord(c) <= 0xDFFF for c in tag)
    if ok:
        assert check_tag(tag) == tag
    else:
        with pytest.raises(luopan.InvalidNameError, match="invalid tag"):
            check_tag(tag)


@pytest.mark.parametrize("step", [True, False, 1.0, 1.5, float("nan"), -1, -(2**63), 2**63, 2**64, MAX_STEP + 1,
                                  "1", b"1", None, [1], np.float64(2), np.bool_(True), complex(1, 0)])
def test_bad_steps(step):
    with pytest.raises(luopan.InvalidNameError, match="invalid step"):
        check_step(step)


@pytest.mark.parametrize("step", [0, 1, MAX_STEP, np.int8(5), np.uint64(7), np.int64(MAX_STEP)])
def test_good_steps_are_plain_ints(step):
    got = check_step(step)
    assert type(got) is int and got == int(step)


def test_names_at_every_public_entry_point(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    repo.save("ok", 1, {"w": np.ones(3)})
    for bad in NASTY:
        if FULL_RULE.fullmatch(bad):
            continue
        for call in (lambda: repo.save(bad, 1, {"w": np.ones(3)}), lambda: repo.load(bad),
                     lambda: repo.steps(bad), lambda: repo.run(bad), lambda: repo.verify(bad),
                     lambda: repo.prune(bad, KeepLast(1)), lambda: repo.prune(bad, KeepLast(1), dry_run=True)):
            with pytest.raises(luopan.InvalidNameError):
                call()
    assert sorted(p.name for p in (tmp_path / "repo" / "runs").iterdir()) == ["ok"]
    repo.close()


@given(keys=st.lists(st.one_of(st.text(max_size=30).filter(lambda k: not any(0xD800 <= ord(c) <= 0xDFFF
                                                                              for c in k)),
                               st.sampled_from([k for k in NASTY if k != "\ud800"])),
                     min_size=1, max_size=6, unique=True))
@settings(max_examples=40, deadline=None, suppress_health_check=suppress)
def test_entry_keys_round_trip_exactly(tmp_path_factory, keys):
    """Any str key (newlines, NUL, '..', '/', 10,000 characters, lookalikes) is data: it round-trips exactly, and
    distinct keys get distinct key paths (a key path collision, only possible through an empty top-level key, is
    refused instead)."""
    root = tmp_path_factory.mktemp("keys") / "repo"
    state = {"m": {k: np.full(2, i, np.int32) for i, k in enumerate(keys)}}
    with luopan.open(root) as repo:
        repo.save("r", 1, state)
        got = repo.load("r")
        assert list(got["m"]) == keys
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(got["m"][k], np.full(2, i, np.int32))
        paths = [e["path"] for e in repo.manifest("r").entries]
        assert len(set(paths)) == len(paths)


def test_odd_entry_keys_export_and_subtrees_only_select(tmp_path):
    from safetensors.numpy import load_file

    keys = ["a/b", "..", "../../etc/passwd", "/abs", "x" * 10_000, "ехр", "a\nb"]
    with luopan.open(tmp_path / "repo") as repo:
        repo.save("r", 1, {"model": {k: np.full(2, i, np.float32) for i, k in enumerate(keys)}})
        out = tmp_path / "out" / "m.safetensors"
        out.parent.mkdir()
        repo.export("r", out, subtree="model")
        got = load_file(str(out))
        assert sorted(got) == sorted(k.replace("~", "~0").replace("/", "~1") for k in keys)
        for bad in ("../model", "/model", "model/../..", "\0", "x" * 10_000, "mοdel"):
            with pytest.raises(luopan.CheckpointNotFoundError):
                repo.export("r", tmp_path / "out" / "n.safetensors", subtree=bad)
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.safetensors"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "repo"]
