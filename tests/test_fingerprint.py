"""luopan.torch.fingerprint: a content hash over tensor bytes (issue 12, part 6)."""

from __future__ import annotations

import numpy as np
import torch

import luopan
from luopan.torch import fingerprint


def test_fingerprint_is_over_content_not_only_names_and_shapes():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    a = fingerprint(m)
    assert a.startswith("blake3:") and len(a) == 7 + 64
    assert fingerprint(m.state_dict()) == a == fingerprint(m)  # a module or its state; cached the second time
    same_shapes = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    assert fingerprint(same_shapes) != a
    before = m[0].weight[0, 0].item()
    with torch.no_grad():
        m[0].weight[0, 0] += 1  # an ordinary in-place change moves the version counter: seen despite the cache
    assert fingerprint(m) != a
    fingerprint.cache_clear()
    with torch.no_grad():
        m[0].weight[0, 0] = before
    assert fingerprint(m) == a
    assert fingerprint({"x": np.arange(3)}) != fingerprint({"y": np.arange(3)})  # key paths count
    assert fingerprint({"x": np.arange(3, dtype=np.int64)}) != fingerprint({"x": np.arange(3, dtype=np.int32)})
    assert luopan.torch.fingerprint is fingerprint
    z = torch.complex(torch.ones(3), torch.arange(3.0))
    assert fingerprint({"w": z}) != fingerprint({"w": z.conj()})  # the conjugate bit is part of a cached tensor's key
