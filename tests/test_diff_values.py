"""``luopan diff`` / ``repo.diff``: per tensor the size of the change — relative L2 norm ||b-a||/||a||, max abs
difference, elements differing — checked against torch's own computation for each dtype, read one tensor of each
checkpoint at a time; integer and bool tensors count the elements that differ; and the config/metadata diff."""

from __future__ import annotations

import json
import math
import weakref

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import luopan
from luopan.checkpoint import changes
from luopan.checkpoint.reading import Reading
from luopan.cli.main import app

runner = CliRunner()
BIG = changes.SLICE + 12345  # more than one slice: compared in parts


def states():
    g = torch.Generator().manual_seed(0)
    a = {
        "f32": torch.randn(64, 33, generator=g),
        "big": torch.randn(BIG, generator=g),
        "bf16": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "f16": torch.randn(100, generator=g).to(torch.float16),
        "f64": torch.randn(7, 9, generator=g, dtype=torch.float64),
        "c64": torch.randn(30, generator=g, dtype=torch.complex64),
        "i64": torch.randint(-1000, 1000, (50,), generator=g),
        "i8": torch.randint(-100, 100, (64,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(80, generator=g) > 0.5,
        "zero": torch.zeros(10),
        "same": torch.ones(5),
        "np": np.arange(48, dtype=np.float32).reshape(6, 8),
        "shape": torch.zeros(4, 4),
        "lr": 0.1,
    }
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v)
         for k, v in a.items()}
    b["f32"] += 0.01 * torch.randn(64, 33, generator=g)
    b["big"][::1000] += 1.0
    b["bf16"] = (b["bf16"].float() * 1.5).to(torch.bfloat16)
    b["f16"][3] = 7.0
    b["f64"] *= -1
    b["c64"][0] += 1j
    b["i64"][::5] += 3
    b["i8"][10] = -a["i8"][10] - 1 if a["i8"][10] >= 0 else 5
    b["u8"][:7] = 255 - a["u8"][:7]
    b["mask"][:9] = ~a["mask"][:9]
    b["zero"][2] = 0.5
    b["np"][1, 2] = -3.0
    b["shape"] = torch.zeros(2, 8)
    b["lr"] = 0.2
    return a, b


def expected(a, b):
    """The figures as torch computes them, in float64."""
    if isinstance(a, np.ndarray):
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    differing = int((a != b).sum())
    if a.dtype == torch.bool:
        return {"differing": differing, "max_abs": None, "rel_l2": None}
    if a.is_complex():
        d = (b.to(torch.complex128) - a.to(torch.complex128)).abs()
        return {"differing": differing, "max_abs": float(d.max()),
                "rel_l2": float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(a.to(torch.complex128)))}
    d = (b.double() - a.double()).abs()
    if not a.is_floating_point():
        return {"differing": differing, "max_abs": float(d.max()), "rel_l2": None}
    base = torch.linalg.vector_norm(a.double())
    rel = float(torch.linalg.vector_norm(d) / base) if base else math.inf
    return {"differing": differing, "max_abs": float(d.max()), "rel_l2": rel}


@pytest.fixture()
def repo(tmp_path):
    a, b = states()
    r = luopan.open(tmp_path / "repo")
    r.save("run", 1, a, metrics={"loss": 1.0}, metadata={"lr": 0.1, "opt": {"name": "adam", "beta": 0.9}})
    r.save("run", 2, b, metrics={"loss": 0.5}, metadata={"lr": 0.2, "opt": {"name": "adam"}, "seed": 3})
    yield r, a, b, tmp_path / "repo"
    r.close()


def test_sizes_of_the_change_match_torch(repo):
    r, a, b, _ = repo
    d = r.diff("run", 1, 2)
    got = {c["path"]: c for c in d["changed"]}
    assert "same" not in got and got["shape"]["was"] == {"dtype": "float32", "shape": [4, 4]}
    assert got["shape"]["rel_l2"] is None and got["shape"]["differing"] is None
    for path in ("f32", "big", "bf16", "f16", "f64", "c64", "i64", "i8", "u8", "mask", "zero", "np"):
        want = expected(a[path], b[path])
        have = got[path]
        assert have["differing"] == want["differing"], path
        for key in ("max_abs", "rel_l2"):
            if want[key] is None:
                assert have[key] is None, (path, key)
            else:
                assert have[key] == pytest.approx(want[key], rel=1e-9, abs=0), (path, key)
    assert got["big"]["differing"] == len(range(0, BIG, 1000)) and got["big"]["max_abs"] == pytest.approx(1.0)
    assert got["zero"]["rel_l2"] == math.inf and got["f64"]["rel_l2"] == pytest.approx(2.0)
    # the config/metadata diff
    assert d["config"]["changed"] == {"metadata.lr": [0.1, 0.2]}
    assert d["config"]["added"] == {"metadata.seed": 3} and d["config"]["removed"] == {"metadata.opt.beta": 0.9}


def test_nan_is_reported_not_hidden(tmp_path):
    r = luopan.open(tmp_path / "repo")
    try:
        x = torch.ones(6)
        r.save("run", 1, {"w": x, "n": torch.tensor([1.0, float("nan")])})
        y = x.clone()
        y[0] = float("nan")
        r.save("run", 2, {"w": y, "n": torch.tensor([2.0, float("nan")])})
        got = {c["path"]: c for c in r.diff("run", 1, 2)["changed"]}
    finally:
        r.close()
    assert math.isnan(got["w"]["rel_l2"]) and got["w"]["differing"] == 1
    assert got["n"]["differing"] == 1 and got["n"]["max_abs"] == 1.0  # NaN in both: the same element


def test_one_tensor_of_each_checkpoint_at_a_time(repo, monkeypatch):
    r, *_ = repo
    monkeypatch.setattr(Reading, "_load_manifest", lambda *a, **k: pytest.fail("a whole checkpoint was loaded"))
    alive: list[weakref.ref] = []
    most = 0
    real = Reading.load_entry

    def load_entry(self, m, index):
        nonlocal most
        obj = real(self, m, index)
        if isinstance(obj, torch.Tensor):
            alive.append(weakref.ref(obj))
        most = max(most, sum(1 for w in alive if w() is not None))
        return obj

    monkeypatch.setattr(Reading, "load_entry", load_entry)
    d = r.diff("run", 1, 2)
    assert len(alive) >= 2 * 10 and most <= 2
    assert all(c["differing"] is not None for c in d["changed"] if c["was"] is None)


def test_values_false_reads_no_tensor(repo, monkeypatch):
    r, *_ = repo
    monkeypatch.setattr(Reading, "load_entry", lambda *a, **k: pytest.fail("a tensor was read"))
    d = r.diff("run", 1, 2, values=False)
    assert d["changed"] and all("rel_l2" not in c for c in d["changed"])


def test_cli_diff_json_and_table(repo):
    r, a, b, path = repo
    r.save("other", 7, b, metadata={"lr": 0.3})
    res = runner.invoke(app, ["diff", "-r", str(path), "run@1", "run@2", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    got = {c["path"]: c for c in d["changed"]}
    assert got["f32"]["rel_l2"] == pytest.approx(expected(a["f32"], b["f32"])["rel_l2"], rel=1e-9)
    assert got["zero"]["rel_l2"] == "inf" and got["mask"]["differing"] == 9
    assert d["config"]["changed"] == {"metadata.lr": [0.1, 0.2]}
    res = runner.invoke(app, ["diff", "-r", str(path), "run@2", "other@7", "--json"])  # two runs
    d = json.loads(res.output)
    assert res.exit_code == 0 and d["from_run"] == "run" and d["run"] == "other"
    # stored differently (a delta against step 1 in run, whole in other): the values say nothing changed
    assert all(c["differing"] == 0 and c["rel_l2"] == 0.0 and c["max_abs"] == 0.0 for c in d["changed"])
    assert d["config"]["changed"] == {"metadata.lr": [0.2, 0.3]}
    res = runner.invoke(app, ["diff", "-r", str(path), "run@1", "run@2"])
    assert res.exit_code == 0, res.output
    assert "rel L2" in res.output and "max abs" in res.output and "metadata.lr" in res.output
    line = next(ln for ln in res.output.splitlines() if ln.split()[1:2] == ["f64"])
    assert line.split()[-3] == "2" and line.split()[-1] == "63"  # rel L2 2; 7x9 elements, all differ
    res = runner.invoke(app, ["diff", "-r", str(path), "run@1", "run@2", "--bytes-only", "--json"])
    assert res.exit_code == 0 and "rel_l2" not in res.output


def test_config_diff_reads_framework_settings_in_the_state(tmp_path):
    """Lightning keeps ``hyper_parameters`` and the HF Trainer ``training_args`` at the top of the state; typed values
    (docs/format.md §8.3: a Path, a Namespace) read as their plain values; tensors are not config."""
    import argparse
    from pathlib import PurePosixPath
    r = luopan.open(tmp_path / "repo")
    try:
        w = torch.zeros(3)
        r.save("pl", 1, {"state_dict": {"w": w}, "hyper_parameters": {"lr": 0.1, "data": PurePosixPath("/d/a"),
                                                                      "ns": argparse.Namespace(depth=2)}})
        r.save("hf", 1, {"model": {"w": w}, "training_args": {"learning_rate": 0.1, "seed": 1}})
        r.save("pl", 2, {"state_dict": {"w": w + 1}, "hyper_parameters": {"lr": 0.2, "data": PurePosixPath("/d/b"),
                                                                          "ns": argparse.Namespace(depth=2)}})
        d = r.diff("pl", 1, 2)
        x = r.diff("pl", 2, 1, to_run="hf")
    finally:
        r.close()
    assert d["config"]["changed"] == {"state.hyper_parameters.lr": [0.1, 0.2],
                                      "state.hyper_parameters.data": ["/d/a", "/d/b"]}
    assert d["config"]["same"] == 1  # state.hyper_parameters.ns.depth
    assert x["config"]["added"] == {"state.training_args.learning_rate": 0.1, "state.training_args.seed": 1}
    assert "state.hyper_parameters.lr" in x["config"]["removed"]
    assert [c["path"] for c in d["changed"]] == ["state_dict/w"] and d["changed"][0]["max_abs"] == 1.0
