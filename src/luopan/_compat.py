"""Old spellings of public arguments, kept working with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

from .errors import UsageError


def deprecated_alias(value: Any, old_value: Any, name: str, old_name: str) -> Any:
    """``value``, or ``old_value`` (given under the deprecated keyword ``old_name``) with a DeprecationWarning."""
    if old_value is None:
        return value
    if value is not None:
        raise UsageError(f"pass {name}= only (`{old_name}=` is its old name)")
    warnings.warn(f"the keyword {old_name}= is deprecated: use {name}=", DeprecationWarning, stacklevel=3)
    return old_value
