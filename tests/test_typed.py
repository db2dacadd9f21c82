"""Ordinary config values in state trees (docs/format.md §8.3): typed JSON leaves, never pickle."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import decimal
import enum
import json
import pathlib

import numpy as np
import pytest
import torch

import luopan
from luopan.format.canonical import inflate_json, seal, unseal
from luopan.format.names import manifest_key


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Cfg:
    lr: float
    weights: object


Pair = collections.namedtuple("Pair", "a b")


def lightning_like():
    """What a Lightning checkpoint's hyper_parameters and a PEFT LoraConfig.to_dict() hold."""
    return {
        "hyper_parameters": {"data_dir": pathlib.Path("/data/train"), "precision": torch.bfloat16,
                             "device": torch.device("cpu"), "started": dt.datetime(2026, 12, 1, 9, 30,
                                                                                   tzinfo=dt.timezone.utc),
                             "day": dt.date(2026, 12, 1), "at": dt.time(9, 30), "budget": dt.timedelta(hours=5),
                             "args": argparse.Namespace(lr=3e-4, layers=[1, 2]), "color": Color.RED,
                             "pair": Pair(1, "x"), "cfg": Cfg(0.1, torch.ones(3)), "tolerance": decimal.Decimal("0.10"),
                             "z": complex(1.5, float("-inf")), "blob": b"\x00\xff", "win": pathlib.PureWindowsPath("C:/d")},
        "lora": {"target_modules": {"q_proj", "v_proj"}, "frozen": frozenset({3, 1})},
        "state_dict": {"w": torch.arange(4.0)},
    }


def test_typed_values_round_trip(repo):
    info = repo.save("typed", 1, lightning_like())
    assert repo.manifest("typed", 1).doc["format_version"] == 3  # only manifests holding typed values say 3
    back = repo.load("typed", 1)
    hp = back["hyper_parameters"]
    want = lightning_like()["hyper_parameters"]
    for key in ("data_dir", "precision", "device", "started", "day", "at", "budget", "tolerance", "blob", "win"):
        assert hp[key] == want[key] and type(hp[key]) is type(want[key]), key
    assert hp["z"].real == 1.5 and hp["z"].imag == float("-inf")
    # classes are recorded, never imported: rebuilt as plain data
    assert hp["args"] == {"lr": 3e-4, "layers": [1, 2]}
    assert hp["color"] == "red"
    assert hp["pair"] == {"a": 1, "b": "x"}
    assert set(hp["cfg"]) == {"lr", "weights"} and torch.equal(hp["cfg"]["weights"], torch.ones(3))
    assert back["lora"] == {"target_modules": {"q_proj", "v_proj"}, "frozen": frozenset({1, 3})}
    assert info.logical_bytes == 4 * 4 + 3 * 4  # the tensor inside the dataclass is an entry like any other
    doc = unseal(inflate_json(repo.store.get(manifest_key("typed", 1))))
    assert 'Color' in json.dumps(doc["tree"])  # the class is recorded for people to read
    repo.save("plain", 1, {"x": np.arange(3)})
    assert repo.manifest("plain", 1).doc["format_version"] == 1


def test_manifests_do_not_depend_on_hash_order(repo):
    repo.save("s", 1, {"tags": {"b", "a", "c", "d"}})
    repo.save("s", 2, {"tags": {"d", "c", "b", "a"}})
    assert repo.manifest("s", 1).doc["tree"] == repo.manifest("s", 2).doc["tree"]


def test_everything_unsupported_is_refused_at_once(repo):
    state = {"a": object(), "b": {"fn": lambda: 0}, "ok": 1, "l": [1, open]}
    with pytest.raises(luopan.UnsupportedValueError) as exc:
        repo.save("bad", 1, state)
    text = str(exc.value)
    assert "3 value(s)" in text and "'a': builtins.object" in text and "'b/fn'" in text and "'l/1'" in text
    assert repo.steps("bad") == []


@pytest.mark.parametrize("spec,match", [
    ({"type": "path", "v": 5}, "path must be a string"),
    ({"type": "datetime", "v": "yesterday"}, "datetime"),
    ({"type": "bytes", "v": "!!!"}, "bytes"),
    ({"type": "timedelta", "v": [1, 2]}, "timedelta"),
    ({"type": "torch.dtype", "v": "__class__"}, "unknown torch dtype"),
    ({"type": "pickle", "v": "gASV"}, "unknown type 'pickle'"),
    ({"type": "set", "v": [{"dict": []}]}, "set"),  # an unhashable member
    ({"type": "decimal", "v": "one"}, "decimal"),
    ({"type": "set", "v": ["x"]}, "malformed tree node"),  # members must be tree nodes
    ({"type": "dataclass", "class": "m.C", "v": {"dict": [["a", {"entry": -1}]]}}, "names entry -1"),
    ({"type": "dataclass", "class": "m.C", "v": {"dict": [["a", {"entry": "x"}]]}}, "names entry x"),
    ({"type": "namedtuple", "class": "m.P", "v": {"dict": [[{"k": 1}, {"int": 1}]]}}, "malformed dict node"),
])
def test_damaged_typed_values_are_refused_on_load(repo, spec, match):
    repo.save("t", 1, {"x": 1})
    key = manifest_key("t", 1)
    doc = unseal(inflate_json(repo.store.get(key)))
    doc.pop("checksum", None)
    doc["tree"] = {"dict": [["x", {"typed": spec}]]}
    doc["format_version"] = 3
    repo.store.put(key, seal(doc))
    with pytest.raises(luopan.CorruptManifestError, match=match):
        repo.load("t", 1)
