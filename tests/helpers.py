"""Assertions shared by the crash, kill, corruption and format-compatibility tests."""

import importlib.util
import os
import pathlib
import struct

import numpy as np
import pytest
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


def assert_refused_as_newer(monkeypatch, root, run, step, reader_version):
    """A luopan that reads only format ``reader_version`` refuses the repository at ``root`` and its manifest
    ``run``/``step`` as newer (not as damaged)."""
    import luopan
    import luopan.format
    from luopan.format.manifest import parse_manifest
    from luopan.format.names import manifest_key

    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", reader_version)
    with pytest.raises(luopan.UnsupportedFormatError, match=rf"newer than this luopan reads \({reader_version}\)"):
        luopan.open(root)
    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        data = f.read()
    with pytest.raises(luopan.UnsupportedFormatError, match="newer"):
        parse_manifest(data, "m", run, step)


def zstd_manifest_doc(root, run, step):
    """The document of a manifest file stored as a zstd frame of sealed JSON (repositories of format 5 and later
    with compression auto, docs/format.md §4), as written: entry groups not expanded."""
    import json

    import zstandard

    from luopan.format.names import manifest_key

    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        data = f.read()
    assert data.startswith(b"\x28\xb5\x2f\xfd"), "a repository with compression auto compresses its manifests"
    return json.loads(zstandard.ZstdDecompressor().decompress(data))


def config_version(root):
    """The format_version a repository's config file says."""
    import json

    with open(os.path.join(root, "luopan.json"), "rb") as f:
        return json.loads(f.read())["format_version"]


def sample_copy(sample, tmp_path):
    """A private copy of a sample repository of tests/data (a test must never modify tests/data): its ``auto``
    repository."""
    import shutil

    dest = tmp_path / os.path.basename(sample)
    shutil.copytree(sample, dest)
    return dest / "auto"


def _zeroed(tree):
    """A target for load_into with the structure of ``tree`` and every tensor and array zeroed."""
    if isinstance(tree, dict):
        return {k: _zeroed(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, np.ndarray):
        return np.zeros_like(tree)
    return tree


def assert_lora_loads(repo, gen, steps):
    """Run ``lora`` of a sample repository (tests/data/make_v5_repo.py and make_v6_repo.py, loaded as ``gen``) holds
    exactly ``steps``, and each loads exactly what ``gen.lora_state`` builds, with load and with load_into."""
    assert repo.steps("lora") == steps
    for step in steps:
        expected = gen.lora_state(step)
        assert_exact(repo.load("lora", step), expected)
        assert repo.manifest("lora", step).metrics == gen.metrics(step)
        target = _zeroed(expected)
        repo.load_into("lora", target, step)
        assert_exact(target["model"], expected["model"])
        assert_exact(target["table"], expected["table"])


def flip_byte(path, offset):
    """Invert one byte of a file in place (damage that keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
