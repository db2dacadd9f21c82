"""Assertions shared by the crash, kill, corruption and format-compatibility tests."""

import importlib.util
import os
import pathlib
import struct

import numpy as np
import torch


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


def raw(t):
    """A tensor's bytes."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_exact(got, expected, path="<root>"):
    """Same tree structure, types, dtypes and shapes; tensors and arrays equal byte for byte, floats bit for bit."""
    if isinstance(expected, pathlib.PurePath):  # a posix path comes back as pathlib.Path on a posix host (§8.3)
        assert isinstance(got, pathlib.PurePosixPath) and got == expected, path
        return
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_exact(got[k], expected[k], f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_exact(g, e, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert raw(got) == raw(expected), f"{path}: bytes differ"
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.tobytes() == expected.tobytes(), f"{path}: bytes differ"
    elif isinstance(expected, float):
        assert struct.pack("<d", got) == struct.pack("<d", expected), path
    else:
        assert got == expected, path


def data_module(name):
    """A generator script of tests/data/ (``make_v4_repo``, ``make_v5_repo``) loaded as a module: the tests import its
    functions to rebuild what the sample repository it made holds."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
