"""What `verify` accepts, load must load (issue 27 item 14).

A valid manifest is mutated in many ways — every integer turned into a float, a bool, a string or a negative
number, every member removed, a row delta's ``segments`` removed or changed — and re-sealed so its checksum
matches (only its meaning is wrong). For each mutation either ``verify`` fails with a typed error and load raises
a typed luopan error, or ``verify`` passes and load succeeds: never a bare TypeError/KeyError, never verify-ok but
load-fails. `luopan verify` exits with the damage code (3) on such damage, without a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import luopan
from luopan.checkpoint.checking import ALL, check
from luopan.format.canonical import inflate_json, seal, unseal
from luopan.format.names import manifest_key

RUN = "strict"
ROWS, DIM = 4096, 16  # 256 KiB fp32 table, 64-byte rows
POLICY = luopan.DeltaPolicy(min_bytes=64 << 10, rebase_fraction=0.3, xor=False)
DAMAGE_EXIT = 3  # docs/format.md: `verify` carries on past each problem and exits 3


def _state(emb: np.ndarray) -> dict:
    w = np.arange(24, dtype=np.float64).reshape(4, 6)
    return {
        "emb": emb,
        "model": {"w": w, "tied": w, "b": np.ones(3, dtype=np.float32)},
        "step": 7,
        "lr": 0.5,
        "name": "x",
        "flags": [True, None, (1, 2)],
        "when": dt.timedelta(days=1, seconds=2),
        "tags": {3, 4},
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A repository whose step 2 holds a row delta in two segments, an alias, scalars and typed values."""
    root = str(tmp_path_factory.mktemp("strict") / "repo")
    repo = luopan.open(root, chunk_size=16 << 10, delta_policy=POLICY)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    saved = {}
    for step, rows in ((0, None), (1, [5, 900, 4000]), (2, [3, 900, 2000, 4095])):
        if rows is not None:
            emb[rows] += 1
        repo.save(RUN, step, _state(emb))
        saved[step] = emb.copy()
    d = repo.manifest(RUN, 2).entry("emb")["delta"]
    assert d["segments"] == [3, 4] and d["rows"] == 7, d
    repo.close()
    return root, saved


def _doc(root: str, step: int) -> dict:
    with open(os.path.join(root, manifest_key(RUN, step)), "rb") as f:
        return unseal(inflate_json(f.read()))


def _write(root: str, step: int, doc: dict) -> None:
    with open(os.path.join(root, manifest_key(RUN, step)), "wb") as f:
        f.write(seal(doc))


def _leaves(node, path=()):
    """(path, value) of every member and list item of a JSON document, depth first."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if i > 0 and isinstance(v, list) and len(v) == 7 and isinstance(v[0], str):
                break  # chunk rows: the first of each list stands for the others
            yield from _leaves(v, path + (i,))


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _remove(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    del doc[path[-1]]


def _mutations(doc: dict) -> dict[str, object]:
    """name -> edit(doc) for every mutation tried on ``doc``."""
    out: dict[str, object] = {}
    for path, value in _leaves(doc):
        name = "/".join(map(str, path))
        if isinstance(value, int) and not isinstance(value, bool):
            for label, new in (("float", float(value)), ("float+0.5", value + 0.5), ("true", True),
                               ("false", False), ("str", str(value)), ("negative", -1 - value)):
                out[f"{name}={label}"] = lambda d, p=path, v=new: _set(d, p, v)
        if path and isinstance(path[-1], str) and path[-1] != "checksum":
            out[f"{name} removed"] = lambda d, p=path: _remove(d, p)
    emb = next(i for i, e in enumerate(doc["entries"]) if e["path"] == "emb")

    def segments(value):
        return lambda d: _set(d, ("entries", emb, "delta", "segments"), value)

    out["segments reversed"] = segments([4, 3])
    out["segments one short"] = segments([3, 3])
    out["segments as floats"] = segments([3.0, 4.0])
    out["segments split"] = segments([3, 2, 2])
    out["segments single"] = segments([7])
    out["segments empty"] = segments([])
    out["segments null"] = segments(None)
    out["delta rows as float"] = lambda d: _set(d, ("entries", emb, "delta", "rows"), 7.0)
    out["typed int holds a bool"] = lambda d: _set(d, ("tree",), {"typed": {"type": "set", "v": [{"int": True}]}})
    out["typed float holds a word"] = lambda d: _set(d, ("tree",), {"typed": {"type": "set",
                                                                              "v": [{"float": "word"}]}})
    out["typed float holds a bool"] = lambda d: _set(d, ("tree",), {"typed": {"type": "set",
                                                                              "v": [{"float": False}]}})
    out["typed set of lists"] = lambda d: _set(d, ("tree",), {"typed": {"type": "set", "v": [{"list": []}]}})
    out["typed timedelta of floats"] = lambda d: _set(d, ("tree",), {"typed": {"type": "timedelta",
                                                                               "v": [1.0, 2, 0]}})
    out["exponent step"] = lambda d: _set(d, ("step",), 2e0)
    return out


def _outcome(call) -> str | None:
    """None when ``call`` succeeds, the error's type name when it raises a luopan error; anything else fails."""
    try:
        call()
    except luopan.LuopanError as exc:
        return type(exc).__name__
    return None


def _check(root: str, name: str) -> tuple[str | None, str | None]:
    repo = luopan.open(root)
    try:
        verified = _outcome(lambda: repo.verify(RUN, 2))
        loaded = _outcome(lambda: repo.load(RUN, 2))
    finally:
        repo.close()
    assert (verified is None) == (loaded is None), (name, verified, loaded)
    if verified is not None:
        assert verified in ("IntegrityError", "CorruptManifestError"), (name, verified)
    return verified, loaded


def test_every_mutation_is_refused_by_both_or_loaded_by_both(template, tmp_path):
    root0, saved = template
    doc0 = _doc(root0, 2)
    mutations = _mutations(doc0)
    assert len(mutations) > 150, len(mutations)
    refused = []
    root = str(tmp_path / "repo")
    for name, edit in mutations.items():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(root0, root)
        doc = json.loads(json.dumps(doc0))
        edit(doc)
        _write(root, 2, doc)
        verified, _loaded = _check(root, name)
        if verified is not None:
            refused.append(name)
    # the cases are among the refused ones
    for name in ("step=float", "entries/0/shape/0=float", "format_version=float", "exponent step",
                 "segments reversed", "typed int holds a bool", "typed float holds a word", "typed set of lists",
                 "typed timedelta of floats"):
        assert name in refused or name not in mutations, name
    emb = next(i for i, e in enumerate(doc0["entries"]) if e["path"] == "emb")
    assert f"entries/{emb}/delta/segments removed" in refused
    assert f"entries/{emb}/delta/rows=float" in refused
    for i, e in enumerate(doc0["entries"]):
        for k in ("shape", "nbytes", "dtype"):
            assert f"entries/{i}/{k} removed" in refused
        if "chunks" in e:
            for col in range(1, 5):
                for label in ("float", "true", "str", "negative"):
                    assert f"entries/{i}/chunks/0/{col}={label}" in refused, (i, col, label)


def test_segments_removed_is_refused_by_verify_check_and_load(template, tmp_path):
    """The issue's case: verify passed a segmented row delta whose `segments` were removed, which load refuses."""
    root = str(tmp_path / "repo")
    shutil.copytree(template[0], root)
    doc = _doc(root, 2)
    emb = next(e for e in doc["entries"] if e["path"] == "emb")
    del emb["delta"]["segments"]
    _write(root, 2, doc)
    repo = luopan.open(root)
    with pytest.raises(luopan.IntegrityError) as ei:
        repo.verify(RUN, 2)
    assert any(isinstance(p, luopan.CorruptManifestError) and "'emb'" in str(p) and "row delta" in str(p)
               for p in ei.value.problems), ei.value.problems
    with pytest.raises(luopan.CorruptManifestError, match="row delta"):
        repo.load(RUN, 2)
    rep = check(repo, ALL)
    assert any("row delta" in str(p) for p in rep.problems), rep.problems
    assert not any("row delta" in str(p) for p in check(repo, None).problems)  # structure only reads no data
    assert (repo.load(RUN, 1)["emb"] == template[1][1]).all()  # the others stay loadable
    repo.close()


@pytest.mark.parametrize("edit", ["step", "shape", "offset", "segments"])
def test_cli_verify_exits_with_the_damage_code(template, tmp_path, edit):
    root = str(tmp_path / "repo")
    shutil.copytree(template[0], root)
    doc = _doc(root, 2)
    emb = next(e for e in doc["entries"] if e["path"] == "emb")
    if edit == "step":
        doc["step"] = 2.0
    elif edit == "shape":
        emb["shape"][0] = float(emb["shape"][0])
    elif edit == "offset":
        emb["chunks"][0][2] = float(emb["chunks"][0][2])
    else:
        del emb["delta"]["segments"]
    _write(root, 2, doc)
    for args in (["verify", "-r", root], ["verify", "-r", root, RUN, "2"]):
        proc = subprocess.run([sys.executable, "-m", "luopan", *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == DAMAGE_EXIT, (args, proc.returncode, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr
        assert "00000002" in proc.stdout + proc.stderr or "step 2" in proc.stdout + proc.stderr


@pytest.mark.parametrize("path, field", [(("step",), "data.step"), (("entries", 0, "nbytes"), "data.entries[0].nbytes"),
                                         (("entries", 0, "chunks", 0, 3), "data.entries[0].chunks[0][3]")])
def test_a_float_integer_is_a_corrupt_manifest_error_naming_the_field(template, tmp_path, path, field):
    root = str(tmp_path / "repo")
    shutil.copytree(template[0], root)
    doc = _doc(root, 2)
    holder = doc
    for k in path[:-1]:
        holder = holder[k]
    holder[path[-1]] = float(holder[path[-1]])
    _write(root, 2, doc)
    with luopan.open(root) as repo:
        with pytest.raises(luopan.CorruptManifestError) as ei:
            repo.load(RUN, 2)
    assert f"{field} must be integer" in str(ei.value)
