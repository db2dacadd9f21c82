"""ordered_map: results in input order whatever mix of inline items and grouped worker batches."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import luopan
from luopan.repository.parallel import ordered_map


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=60), window=st.integers(1, 6), group_size=st.integers(0, 100))
def test_order_is_kept(sizes, window, group_size):
    with ThreadPoolExecutor(2) as pool:
        out = list(ordered_map(pool, lambda x: (x, x[1] * 2), list(enumerate(sizes)), window,
                               inline=lambda x: x[1] < 10, group=lambda x: x[1], group_size=group_size))
    assert out == [((i, s), s * 2) for i, s in enumerate(sizes)]


def test_errors_are_raised_in_order():
    def fn(x):
        if x == 3:
            raise ValueError("three")
        return x

    with ThreadPoolExecutor(2) as pool:
        got = []
        with pytest.raises(ValueError, match="three"):
            for r in ordered_map(pool, fn, range(8), 2, inline=lambda x: x % 2 == 0, group=lambda x: 1,
                                 group_size=2):
                got.append(r)
    assert got == [0, 1, 2]


def test_entry_with_big_chunks_and_a_small_tail_round_trips(repo):
    rng = np.random.default_rng(0)
    state = {"a": rng.standard_normal((9 << 20) // 4 + 1000, dtype=np.float32),  # 2 big chunks + a small tail
             "b": rng.standard_normal(10, dtype=np.float32)}
    repo.save("r", 1, state)
    out = repo.load("r", 1)
    assert all(np.array_equal(out[k], v) for k, v in state.items())
