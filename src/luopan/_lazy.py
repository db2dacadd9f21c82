"""Names of a package loaded on first use (PEP 562): importing the package does not import what they need (the
repository, torch). ``__getattr__, __dir__ = lazy_names(__name__, {"create": ".creating"})`` in its __init__."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any


def lazy_names(package: str, exports: dict[str, str], listed: Iterable[str] = ()
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module hooks of ``package``: ``exports`` maps a name to the (relative) module defining it; once loaded, a
    name is kept in the package's namespace, so the hook runs once per name."""
    names = set(exports) | set(listed)

    def __getattr__(name: str) -> Any:  # noqa: N807
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | names)

    return __getattr__, __dir__
