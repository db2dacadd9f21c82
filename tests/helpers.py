"""Assertions shared by the crash, kill and corruption tests."""

import os

import numpy as np


def assert_same_state(got, expected, path="<root>"):
    """Same tree structure and types; arrays equal byte for byte."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_same_state(got[k], expected[k], f"{path}/{k}")
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.tobytes() == expected.tobytes(), f"{path}: bytes differ"
    else:
        assert got == expected, path


def temp_files(root):
    """Temporary files (`.tmp-` names) anywhere below root."""
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp-" in f]
