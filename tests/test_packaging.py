"""pyproject.toml's metadata in the forms current setuptools accepts without a deprecation warning."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_license_is_an_spdx_string_and_setuptools_is_new_enough_for_it() -> None:
    data = tomllib.loads(PYPROJECT.read_text())
    assert data["project"]["license"] == "Apache-2.0"  # the table form ({text = ...}) is deprecated
    for path in data["project"].get("license-files", []):
        assert list(PYPROJECT.parent.glob(path)), path
    setuptools = next(r for r in data["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.search(r">=(\d+)", setuptools).group(1)) >= 77  # the first setuptools that reads the string form
