"""Ordinary config values in state trees, as typed JSON leaves, without pickle (docs/format.md §8.3).

A tree node ``{"typed": {"type": T, "v": …}}`` holds one value of a type JSON lacks. Types that are safe to rebuild
come back as themselves: ``path`` (pathlib), ``datetime``, ``date``, ``time``, ``timedelta``, ``bytes`` (base64),
``set``, ``frozenset``, ``complex``, ``decimal``, ``torch.dtype`` (by a whitelisted name), ``torch.device``. Enum,
dataclass, namedtuple and ``argparse.Namespace`` values come back as plain data — the enum's value, a dict of the
fields — with their class recorded in ``class`` for people to read: a class named in a file is never imported.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import datetime as dt
import decimal
import enum
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from .errors import CorruptManifestError
from .format.names import join_path

Node = dict[str, Any]
Walk = Callable[[Any, str], Node]
PLAIN = ("enum", "dataclass", "namedtuple", "namespace")  # recorded with their class, rebuilt as plain data
TORCH_NAMES = frozenset((
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "int64", "int32", "int16",
    "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz",
))
MAX_BYTES = 1 << 20  # a bytes leaf larger than this belongs in a tensor (np.frombuffer(b, np.uint8))


def class_name(value: Any) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def _float(x: float) -> Any:
    return x if math.isfinite(x) else repr(x)


def encode(value: Any, path: str, walk: Walk) -> Node | None:
    """The typed node for ``value`` (children through ``walk``), or None when it is not one of these types."""
    def node(kind: str, v: Any, **extra: Any) -> Node:
        return {"typed": {"type": kind, "v": v, **extra}}

    if isinstance(value, pathlib.PurePath):
        return node("path", str(value), flavour="windows" if isinstance(value, pathlib.PureWindowsPath) else "posix")
    if isinstance(value, dt.datetime):
        return node("datetime", value.isoformat())
    if isinstance(value, dt.date):
        return node("date", value.isoformat())
    if isinstance(value, dt.time):
        return node("time", value.isoformat())
    if isinstance(value, dt.timedelta):
        return node("timedelta", [value.days, value.seconds, value.microseconds])
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if len(data) > MAX_BYTES:
            return None  # refused by the caller with the fix
        return node("bytes", base64.b64encode(data).decode("ascii"))
    if isinstance(value, enum.Enum):
        return node("enum", walk(value.value, path), **{"class": class_name(value), "name": value.name})
    if isinstance(value, (set, frozenset)):
        items = [walk(v, join_path(path, i)) for i, v in enumerate(_stable(value))]
        return node("frozenset" if isinstance(value, frozenset) else "set", items)
    if isinstance(value, complex):
        return node("complex", [_float(value.real), _float(value.imag)])
    if isinstance(value, decimal.Decimal):
        return node("decimal", str(value))
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a namedtuple
        return node("namedtuple", walk(dict(value._asdict()), path), **{"class": class_name(value)})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return node("dataclass", walk(fields, path), **{"class": class_name(value)})
    if isinstance(value, argparse.Namespace):
        return node("namespace", walk(dict(vars(value)), path), **{"class": class_name(value)})
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.dtype):
            name = str(value).split(".", 1)[1]
            return node("torch.dtype", name) if name in TORCH_NAMES else None
        if isinstance(value, torch.device):
            return node("torch.device", str(value))
    return None


def _stable(items: Any) -> list[Any]:
    """Set members in a deterministic order (so a manifest does not depend on hash seeds)."""
    try:
        return sorted(items)
    except Exception:  # noqa: BLE001 - members that do not compare (mixed types, tensors): order by repr
        return sorted(items, key=repr)


TYPED_FORMAT_VERSION = 3  # docs/format.md §1: a manifest holding a typed value says 3


def present(node: Node) -> bool:
    """Whether a tree skeleton holds a typed value anywhere (its manifest is then format_version 3)."""
    stack = [node]
    while stack:
        (tag, value), = stack.pop().items()
        if tag == "typed":
            return True
        if tag == "dict":
            stack.extend(v for _k, v in value)
        elif tag in ("list", "tuple"):
            stack.extend(value)
    return False


def children(spec: Any) -> list[Node]:
    """The tree nodes inside a typed node (set members, an enum's value, a dataclass's fields), for walkers."""
    if not isinstance(spec, dict):
        return []
    kind, v = spec.get("type"), spec.get("v")
    if kind in ("set", "frozenset") and isinstance(v, list):
        return list(v)  # each checked by the manifest's tree walk
    if kind in PLAIN:
        return [v]
    return []


def decode(spec: Any, where: str, rebuild: Callable[[Node], Any]) -> Any:
    """The value of a typed node (children through ``rebuild``); CorruptManifestError for anything malformed."""
    def bad(why: str) -> CorruptManifestError:
        return CorruptManifestError(f"manifest {where}: a typed value is damaged: {why}")

    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str) or "v" not in spec:
        raise bad("it needs a type and a value")
    kind, v = spec["type"], spec["v"]
    try:
        if kind == "path":
            if not isinstance(v, str):
                raise bad("a path must be a string")
            return pathlib.PureWindowsPath(v) if spec.get("flavour") == "windows" else pathlib.Path(v)
        if kind in ("datetime", "date", "time"):
            if not isinstance(v, str):
                raise bad(f"a {kind} must be an ISO-8601 string")
            return {"datetime": dt.datetime, "date": dt.date, "time": dt.time}[kind].fromisoformat(v)
        if kind == "timedelta":
            if not (isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v)):
                raise bad("a timedelta is [days, seconds, microseconds]")
            return dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
        if kind == "bytes":
            if not isinstance(v, str) or len(v) > 2 * MAX_BYTES:
                raise bad("bytes are a base64 string")
            return base64.b64decode(v, validate=True)
        if kind in ("set", "frozenset"):
            if not isinstance(v, list):
                raise bad("a set is a list of members")
            members = [rebuild(n) for n in v]
            return frozenset(members) if kind == "frozenset" else set(members)
        if kind == "complex":
            if not (isinstance(v, list) and len(v) == 2):
                raise bad("a complex is [real, imag]")
            return complex(float(v[0]), float(v[1]))
        if kind == "decimal":
            if not isinstance(v, str):
                raise bad("a decimal is a string")
            return decimal.Decimal(v)
        if kind in PLAIN:
            if not isinstance(spec.get("class", ""), str):
                raise bad("a class name must be a string")
            return rebuild(v)
        if kind == "torch.dtype":
            if v not in TORCH_NAMES:
                raise bad(f"unknown torch dtype {str(v)[:40]!r}")
            return getattr(_torch(where), v)
        if kind == "torch.device":
            if not isinstance(v, str) or len(v) > 64:
                raise bad("a device is a string such as 'cuda:0'")
            return _torch(where).device(v)
    except CorruptManifestError:
        raise
    except (ValueError, TypeError, OverflowError, AttributeError, KeyError, binascii.Error, decimal.InvalidOperation,
            RuntimeError) as exc:
        raise bad(f"{kind}: {str(exc)[:120]}") from None
    raise bad(f"unknown type {str(kind)[:40]!r} (written by a newer luopan?)")


def _torch(where: str) -> Any:
    try:
        import torch
    except ImportError:
        raise CorruptManifestError(f"{where} holds torch values; install torch (pip install 'luopan[torch]')") \
            from None
    return torch
