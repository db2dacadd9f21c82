"""State trees: every dtype round-trips bit-exactly; odd layouts work; unsupported values are refused."""

import collections
import math

import numpy as np
import pytest
import torch

import luopan

QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
ALL_TORCH_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED, key=str)


def random_bytes_tensor(dtype, shape, seed=0):
    """A tensor of `dtype` filled with random bit patterns (so NaN payloads, -0.0 etc. are exercised)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    raw = t.reshape(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return t


def same_bits(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
    return a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
def test_every_torch_dtype_roundtrips_bit_exactly(repo, dtype):
    state = {"x": random_bytes_tensor(dtype, (5, 7)), "zero_d": random_bytes_tensor(dtype, ()),
             "empty": torch.empty((0, 3), dtype=dtype)}
    repo.save("dt", 0, state)
    out = repo.load("dt")
    for k in state:
        assert same_bits(state[k], out[k]), k


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int64", "float16", "float32", "float64",
                                   "complex64", "complex128"])
def test_numpy_dtypes_roundtrip(repo, dtype):
    rng = np.random.default_rng(1)
    a = np.frombuffer(rng.bytes(np.dtype(dtype).itemsize * 12), dtype=dtype).reshape(3, 4).copy()
    repo.save("np", 0, {"a": a, "s": a[0, 0], "e": np.zeros((2, 0), dtype)})
    out = repo.load("np")
    assert same_bits(a, out["a"])
    assert type(out["s"]) is type(a[0, 0]) and out["s"].tobytes() == a[0, 0].tobytes()
    assert out["e"].shape == (2, 0) and out["e"].dtype == np.dtype(dtype)


def test_big_endian_numpy_is_stored_by_value(repo):
    a = np.arange(6, dtype=">i4").reshape(2, 3)
    repo.save("be", 0, {"a": a})
    out = repo.load("be")["a"]
    assert out.dtype == np.dtype("int32") and np.array_equal(out, a)


def test_non_contiguous_conj_and_views(repo):
    base = torch.randn(64, 32)
    c = torch.randn(4, 4, dtype=torch.complex64)
    state = {"t": base.t(), "strided": base[::3, 1::2], "conj": c.conj(), "neg": torch._neg_view(base[:2]),
             "np_t": np.arange(12.0).reshape(3, 4).T}
    repo.save("nc", 0, state)
    out = repo.load("nc")
    assert torch.equal(out["t"], base.t()) and out["t"].is_contiguous()
    assert torch.equal(out["strided"], base[::3, 1::2])
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert torch.equal(out["neg"], -base[:2])
    assert np.array_equal(out["np_t"], state["np_t"])


def test_tied_tensors_are_stored_once_and_come_back_tied(repo):
    emb = torch.randn(256, 64)
    arr = np.ones(1000)
    state = {"embed": emb, "lm_head": emb, "nested": [emb], "a": arr, "b": arr, "not_tied": emb.clone()}
    info = repo.save("tie", 0, state)
    assert info.logical_bytes == emb.numel() * 4 * 2 + arr.nbytes  # tied copies counted once
    out = repo.load("tie")
    assert out["embed"] is out["lm_head"] is out["nested"][0]
    assert out["a"] is out["b"]
    assert out["not_tied"] is not out["embed"] and torch.equal(out["not_tied"], emb)
    m = repo.manifest("tie")
    assert [e.get("alias_of") for e in m.entries].count(None) == 3


def test_tree_structure_and_scalars_roundtrip(repo):
    state = collections.OrderedDict(
        model={"w": torch.ones(2)},
        optim={"state": {0: {"step": torch.tensor(5.0)}, 1: {}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                                                   "params": [0, 1]}]},
        floats=[0.1, -0.0, float("inf"), float("-inf"), 1e308, 5e-324],
        misc=(None, True, False, 2**80, -3, "文字", ""),
        empty=({}, [], ()),
    )
    repo.save("tree", 1, state)
    out = repo.load("tree")
    assert out["optim"]["state"].keys() == {0, 1}
    assert out["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]
    assert out["misc"] == state["misc"]
    assert out["empty"] == ({}, [], ())
    assert [math.copysign(1, x) for x in out["floats"]] == [math.copysign(1, x) for x in state["floats"]]
    assert out["floats"] == state["floats"]
    nan = repo.save("tree", 2, {"nan": float("nan")})
    assert nan.step == 2 and math.isnan(repo.load("tree", 2)["nan"])


def test_gpu_tensors_are_copied_to_host(repo):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine; device-to-host copy is exercised only where a GPU exists")
    t = torch.randn(100, device="cuda")
    repo.save("gpu", 0, {"t": t})
    assert torch.equal(repo.load("gpu")["t"], t.cpu())


class Opaque:
    pass


@pytest.mark.parametrize(
    "value, path, match",
    [
        ({"model": {"fn": lambda x: x}}, "model/fn", "function"),
        ({"cfg": Opaque()}, "cfg", "(?s)Opaque.*state_dict"),
        ({"a": [1, np.array(["x"], dtype=object)]}, "a/1", "dtype object"),
        ({"a": np.array(["ab"])}, "a", "dtype <U2"),
        ({"k": {(1, 2): 3}}, "k/(1, 2)", "dict key of type tuple"),
        ({"sp": torch.eye(3).to_sparse()}, "sp", "to_dense"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "q", "quantized"),
        ({"m": torch.empty(3, device="meta")}, "m", "meta"),
        ({"b": b"x" * (1 << 21)}, "b", "np.frombuffer"),  # small bytes are typed values (test_typed.py)
    ],
)
def test_unsupported_values_are_refused_naming_the_path(repo, value, path, match):
    with pytest.raises(luopan.UnsupportedValueError, match=match) as exc:
        repo.save("bad", 0, value)
    assert repr(path) in str(exc.value)
    assert isinstance(exc.value, TypeError)
    assert repo.steps("bad") == []  # nothing was committed
    assert list(repo.store.list("packs/")) == []  # and nothing written


def test_cycles_are_refused(repo):
    d = {}
    d["self"] = d
    with pytest.raises(luopan.UnsupportedValueError, match="contains itself"):
        repo.save("cyc", 0, d)


@pytest.mark.parametrize("value, match", [
    ({1: "a", "1": "b"}, "both keys 1 and '1'"),
    ({"big": 10**5000}, "4300 digits"),
    ({"s": "\ud800"}, "surrogate"),
    ({"\ud800": 1}, "surrogate"),
])
def test_values_json_cannot_store_are_refused_before_writing(repo, value, match):
    with pytest.raises(luopan.UnsupportedValueError, match=match):
        repo.save("bad", 0, value)
    assert list(repo.store.list("packs/")) == [] and list(repo.store.list("index/")) == []


def test_deep_nesting_and_bad_metrics_are_typed_errors(repo):
    deep = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(luopan.UnsupportedValueError, match="deeply"):
        repo.save("bad", 0, {"d": deep})
    with pytest.raises(luopan.UnsupportedValueError, match="metrics"):
        repo.save("bad", 0, {}, metrics={"loss": torch.ones(3)})


def test_hostile_deeply_nested_manifest_is_corrupt_not_a_crash(repo):
    repo.save("r", 1, {"x": np.zeros(2)})
    key = next(repo.store.list("runs/r/ckpt/"))
    repo.store.put(key, b"[" * 200_000)
    with pytest.raises(luopan.CorruptManifestError):
        repo.load("r")


def test_empty_tensors_with_zero_strides(repo):
    """Found by the property test: an empty tensor whose stride is 0 cannot be viewed as bytes (nor needs to)."""
    t = torch.empty(0, dtype=torch.int64).as_strided((0,), (0,))
    u = torch.zeros(3, 0, 2).as_strided((3, 0, 2), (0, 0, 0))
    repo.save("e", 0, {"t": t, "u": u})
    out = repo.load("e")
    assert out["t"].shape == (0,) and out["t"].dtype == torch.int64 and out["u"].shape == (3, 0, 2)
    target = {"t": torch.empty(0, dtype=torch.int64).as_strided((0,), (0,)), "u": torch.zeros(3, 0, 2)}
    repo.load_into("e", target)
