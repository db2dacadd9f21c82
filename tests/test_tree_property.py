"""Hypothesis: any state tree of supported values round-trips exactly through a memory repository."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import luopan

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True),
)
arrays = hnp.arrays(
    dtype=st.sampled_from([np.bool_, np.int8, np.uint32, np.int64, np.float16, np.float32, np.float64,
                           np.complex64]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
trees = st.recursive(
    st.one_of(scalars, arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return isinstance(b, float) and (a == b and math.copysign(1, a) == math.copysign(1, b)
                                         or math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(tree=trees)
def test_roundtrip(tree):
    repo = luopan.open("memory://", chunk_size=4096, pack_size=8192)
    repo.save("p", 0, {"t": tree})
    assert same({"t": tree}, repo.load("p"))
    assert repo.verify().ok
