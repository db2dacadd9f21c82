"""State trees: flatten to a JSON skeleton plus tensor leaves, and build them back (docs/format.md §8 `tree`).

Nothing here pickles. Containers are dicts (string or integer keys), lists and tuples; leaves are NumPy arrays and
scalars, torch tensors, JSON scalars and typed values (luopan.typed: Path, datetime, set, dataclass, …). Anything
else is refused, every offending key path at once, with a way to convert it."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import typed
from ._memory import advise_huge_pages
from .errors import LuopanError, UnsupportedValueError
from .format.dtypes import TORCH_DTYPE_SIZES
from .format.limits import MAX_NDIM, MAX_PATH_CHARS, shape_fits
from .format.names import join_path

_BIG_INT_BITS = 14000  # ints this long may exceed Python's 4300-digit str limit: checked, not assumed

_NUMPY_KINDS = "biufc"

def itemsize(kind: str, dtype: str) -> int | None:
    """Element size of a stored dtype name, or None when luopan does not store that dtype."""
    if kind == "torch":
        return TORCH_DTYPE_SIZES.get(dtype)
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        return None
    if dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.name != dtype:
        return None
    return dt.itemsize


@dataclass
class Leaf:
    """One tensor entry of a flattened tree."""

    path: str
    kind: str  # "numpy" | "torch"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    obj: Any  # the array/tensor itself
    alias_of: int | None = None
    scalar: bool = False  # a NumPy scalar (np.float32(1.0)), returned as such on load
    frozen: memoryview | None = None  # a snapshot of the bytes (save_async), used instead of obj

    @property
    def itemsize(self) -> int:  # bytes per element of floating-point entries, the float codec's candidates, else 0
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}.get(self.dtype, 0)

    def host_bytes(self) -> memoryview:
        """The entry's raw C-order bytes in host memory, as a flat byte view (copies only when it must)."""
        if self.frozen is not None:
            return self.frozen
        if self.kind == "torch":
            return _torch_host_bytes(self.obj)
        arr = np.ascontiguousarray(self.obj)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("="))
        return memoryview(arr.reshape(-1).view(np.uint8))


def _torch():
    return sys.modules.get("torch")


class _LazyNumpyViewable:
    """torch dtypes that Tensor.numpy() supports (resolved on first use; torch is imported lazily)."""

    _set: frozenset[Any] | None = None

    def __contains__(self, dtype: Any) -> bool:
        if self._set is None:
            torch = _torch()
            names = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
                     "complex64", "complex128")
            type(self)._set = frozenset(getattr(torch, n) for n in names)
        return dtype in self._set


_NUMPY_VIEWABLE = _LazyNumpyViewable()


def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).split(".", 1)[1]


def _torch_host_bytes(t: Any) -> memoryview:
    if t.is_cpu and t.dtype in _NUMPY_VIEWABLE and t.is_contiguous() and not t.is_conj() and not t.is_neg() \
            and t.numel():
        # the common case: one NumPy view cast to bytes (~2 us; the general path below costs ~5 us per tensor)
        return memoryview(t.detach().numpy()).cast("B")
    torch = _torch()
    if t.numel() == 0:  # no bytes; and an empty view may have stride 0, which view(uint8) refuses
        return memoryview(b"")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype in _NUMPY_VIEWABLE:  # the NumPy route is ~10x cheaper per tensor than torch's view chain
        return memoryview(t.numpy().reshape(-1).view(np.uint8))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _refuse(path: str, what: str, how: str) -> UnsupportedValueError:
    where = path or "<root>"
    return UnsupportedValueError(f"cannot save {what} at key path {where!r}: {how}")


_TORCH_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> name (str(dtype) costs 0.5 us a call)
_NUMPY_DTYPE_NAMES: dict[Any, str] = {}  # storable native-order NumPy dtypes seen -> name (dtype.name is Python code)


def flatten(state: Any) -> tuple[dict[str, Any], list[Leaf]]:
    """(skeleton, leaves). Tensors that are the same object view (tied weights) become aliases of the first."""
    walker = _Flattener()
    try:
        skeleton = walker.walk(state, "")
    except RecursionError:
        raise UnsupportedValueError("cannot save a state tree nested this deeply; flatten it") from None
    if walker.refused:
        raise _refused_types(walker.refused)
    _check_paths(state, walker.leaves)
    return skeleton, walker.leaves


class _Flattener:
    """One walk of a state tree: the skeleton it returns, the leaves it collects (tied views as aliases of the first
    one), the values it refuses by type (reported together by ``flatten``)."""

    __slots__ = ("leaves", "seen", "torch", "strided", "active", "refused")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.seen: dict[tuple[Any, ...], int] = {}  # identity of a tensor's view -> index of its first leaf
        self.torch = _torch()
        self.strided = self.torch.strided if self.torch is not None else None
        self.active: set[int] = set()  # container ids on the current path, to refuse cycles
        self.refused: list[str] = []  # every value of a type luopan cannot store, refused together at the end

    def leaf(self, path: str, value: Any, kind: str, identity: tuple[Any, ...] | None, **kw: Any) -> dict[str, Any]:
        leaves, seen = self.leaves, self.seen
        if identity is not None and identity in seen:
            first = leaves[seen[identity]]
            leaves.append(Leaf(path, kind, first.dtype, first.shape, first.nbytes, value, alias_of=seen[identity]))
            return {"entry": len(leaves) - 1}
        if identity is not None:
            seen[identity] = len(leaves)
        leaves.append(Leaf(path=path, kind=kind, obj=value, **kw))
        return {"entry": len(leaves) - 1}

    def walk(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            return self.walk_numpy(np.asarray(value), path, scalar=True)
        if value is None:
            return {"none": None}
        if isinstance(value, bool):
            return {"bool": value}
        if isinstance(value, int):
            return {"int": _json_int(value, path)}
        if isinstance(value, float):
            return {"float": value if math.isfinite(value) else repr(value)}
        if isinstance(value, str):
            return {"str": _json_str(value, path, "a str")}
        torch = self.torch
        if torch is not None and isinstance(value, torch.Tensor):
            return self.walk_torch(value, path)
        if isinstance(value, np.ndarray):
            if type(value) is not np.ndarray and isinstance(value, np.ma.MaskedArray):
                raise _refuse(path, "a NumPy masked array", "its mask would be lost; store the data and the mask "
                              "as two arrays, e.g. {'data': a.filled(0), 'mask': np.ma.getmaskarray(a)}")
            return self.walk_numpy(value, path, scalar=False)
        active = self.active
        if isinstance(value, (dict, list, tuple)) and not (isinstance(value, tuple) and hasattr(value, "_fields")):
            if id(value) in active:
                raise _refuse(path, "a container that contains itself", "break the reference cycle")
            active.add(id(value))
            try:
                return self.walk_container(value, path)
            finally:
                active.discard(id(value))
        if id(value) in active:
            raise _refuse(path, "a value that contains itself", "break the reference cycle")
        active.add(id(value))
        try:
            node = typed.encode(value, path, self.walk)
        finally:
            active.discard(id(value))
        if node is not None:
            return node
        what = (f"bytes of {len(value)} bytes (more than {typed.MAX_BYTES} as a JSON leaf; store "
                "np.frombuffer(b, np.uint8))" if isinstance(value, (bytes, bytearray, memoryview)) else
                f"{type(value).__module__}.{type(value).__qualname__}")
        self.refused.append(f"{path or '<root>'!r}: {what}")
        return {"none": None}

    def walk_container(self, value: Any, path: str) -> dict[str, Any]:
        walk = self.walk
        if isinstance(value, dict):
            items = []
            names: dict[str, Any] = {}
            for k, v in value.items():
                _check_key(k, path, names)
                items.append([k, walk(v, join_path(path, k))])
            return {"dict": items}
        if type(value) is list:
            return {"list": [walk(v, join_path(path, i)) for i, v in enumerate(value)]}
        if type(value) is tuple:
            return {"tuple": [walk(v, join_path(path, i)) for i, v in enumerate(value)]}
        raise _refuse(
            path,
            f"a {type(value).__qualname__} (a list/tuple subclass)",
            "convert it to a plain tuple/list, or a namedtuple to a dict with x._asdict()",
        )

    def walk_numpy(self, arr: np.ndarray, path: str, scalar: bool) -> dict[str, Any]:
        name = _NUMPY_DTYPE_NAMES.get(arr.dtype)
        if name is not None and (arr.nbytes or shape_fits(arr.shape, arr.dtype.itemsize)):  # fast path
            identity = None
            if arr.nbytes and not scalar:
                identity = ("numpy", arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str)
            return self.leaf(path, arr, "numpy", identity, dtype=name, shape=arr.shape, nbytes=arr.nbytes,
                             scalar=scalar)
        if arr.dtype.kind not in _NUMPY_KINDS or arr.dtype.fields is not None:
            raise _refuse(
                path,
                f"a NumPy array of dtype {arr.dtype}",
                "only bool, integer, float and complex arrays are stored (no pickle); convert object/string "
                "arrays to numbers, or to a list of str",
            )
        dtype = arr.dtype.newbyteorder("=") if arr.dtype.byteorder == ">" else arr.dtype
        if arr.dtype.byteorder != ">":
            _NUMPY_DTYPE_NAMES[arr.dtype] = dtype.name
        if not arr.nbytes and not shape_fits(arr.shape, arr.dtype.itemsize):
            raise _refuse(path, f"an empty array of shape {arr.shape}", "dimensions are limited to 2**48; use a "
                          "smaller empty shape")
        identity = None
        if arr.nbytes and not scalar:
            identity = ("numpy", arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str)
        return self.leaf(path, arr, "numpy", identity, dtype=dtype.name, shape=tuple(arr.shape),
                         nbytes=int(arr.nbytes), scalar=scalar)

    def walk_torch(self, t: Any, path: str) -> dict[str, Any]:
        if t.is_cpu and t.layout is self.strided and not t.is_quantized and not t.is_nested:
            # fast path (~5 us vs ~11 us per tensor): cached dtype name; identity by start address instead of the
            # storage object (same start, shape, strides and dtype on one device = the same view)
            dt = t.dtype
            name = _TORCH_DTYPE_NAMES.get(dt)
            if name is None:
                name = _TORCH_DTYPE_NAMES[dt] = torch_dtype_name(dt)
            if name in TORCH_DTYPE_SIZES and t.dim() <= MAX_NDIM:
                shape = tuple(t.shape)
                nbytes = t.nbytes
                if not nbytes and not shape_fits(shape, TORCH_DTYPE_SIZES[name]):
                    raise _refuse(path, f"an empty tensor of shape {shape}", "dimensions are limited to 2**48 and "
                                  "NumPy must be able to describe it; use a smaller empty shape")
                identity = ("torch", "cpu", t.data_ptr(), shape, t.stride(), dt, t.is_conj(), t.is_neg()) \
                    if nbytes else None
                return self.leaf(path, t, "torch", identity, dtype=name, shape=shape, nbytes=nbytes)
        _check_torch_storable(t, path, self.torch)
        nbytes = t.numel() * t.element_size()
        identity = None
        if nbytes:
            identity = ("torch", str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(),
                        tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())
        return self.leaf(path, t, "torch", identity, dtype=torch_dtype_name(t.dtype), shape=tuple(t.shape),
                         nbytes=nbytes)


def _check_key(k: Any, path: str, names: dict[str, Any]) -> None:
    """Refuse a dict key that is not a str or int, is not storable as JSON, or shares its key path with an earlier
    key of the same dict (``names``: str(key) -> key, updated)."""
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise _refuse(
            join_path(path, str(k)),
            f"a dict key of type {type(k).__name__} ({k!r})",
            "dict keys must be str or int; convert the key, e.g. str(key)",
        )
    if isinstance(k, str):
        _json_str(k, join_path(path, k), "a dict key")
    else:
        _json_int(k, join_path(path, k))
    if str(k) in names:  # 1 and "1" would share the key path "1"
        raise _refuse(join_path(path, k), f"both keys {names[str(k)]!r} and {k!r} in one dict",
                      "key paths must be unique; rename one of the keys")
    names[str(k)] = k


def _check_torch_storable(t: Any, path: str, torch: Any) -> None:
    """Refuse a tensor luopan cannot store as an entry (sparse, quantized, meta, nested, an unknown dtype, too many
    dimensions), each with how to convert it."""
    if t.layout != torch.strided:
        raise _refuse(path, f"a {t.layout} tensor", "convert it with t.to_dense()")
    if t.is_quantized:
        raise _refuse(path, "a quantized tensor", "store t.int_repr() and its scale/zero_point instead")
    if t.device.type == "meta":
        raise _refuse(path, "a tensor on the meta device (it has no data)", "materialise it first")
    if getattr(t, "is_nested", False):
        raise _refuse(path, "a nested tensor", "store its components (t.unbind()) instead")
    if torch_dtype_name(t.dtype) not in TORCH_DTYPE_SIZES:
        raise _refuse(path, f"a tensor of dtype {t.dtype}", "luopan does not store this dtype yet; convert it "
                      "(e.g. t.view(torch.uint8) with the dtype recorded in your metadata)")
    if t.dim() > MAX_NDIM:
        raise _refuse(path, f"a tensor with {t.dim()} dimensions", f"at most {MAX_NDIM} are stored (NumPy's "
                      "limit); reshape it and record the shape in your metadata")


def _refused_types(refused: list[str]) -> UnsupportedValueError:
    """The one error naming every value (``'path': type``) of a type luopan does not store."""
    shown = "\n  ".join(refused[:50]) + (f"\n  … and {len(refused) - 50} more" if len(refused) > 50 else "")
    return UnsupportedValueError(
        f"cannot save {len(refused)} value(s) of types luopan does not store (it never pickles):\n  {shown}\n"
        "luopan stores tensors, NumPy arrays, JSON values and typed values (Path, datetime, date, time, "
        "timedelta, bytes, set, frozenset, complex, Decimal, Enum, dataclass, namedtuple, argparse.Namespace, "
        "torch.dtype, torch.device); convert the others, e.g. obj.state_dict(), a tensor, or str(obj)")


def _check_paths(state: Any, leaves: list[Leaf]) -> None:
    """Refuse a key path longer than MAX_PATH_CHARS, or two tensors with one key path (load could not tell them
    apart)."""
    paths: set[str] = set()
    for lf in leaves:
        if len(lf.path) > MAX_PATH_CHARS:
            raise _refuse(lf.path[:60] + "…", f"a key path of {len(lf.path)} characters",
                          f"key paths are limited to {MAX_PATH_CHARS} characters; use shorter keys")
        if lf.path in paths:
            places = " and ".join(_places(state, lf.path)[:2])
            raise UnsupportedValueError(
                f"two tensors share the key path {lf.path!r}: {places}; luopan could not tell them apart on load "
                "(an empty dict key at the top level joins its children to the root); rename one of the keys")
        paths.add(lf.path)


def _json_int(value: int, path: str) -> int:
    if value.bit_length() > _BIG_INT_BITS:
        try:
            str(value)
        except ValueError:
            raise _refuse(path, f"an int of {value.bit_length()} bits", "JSON values are limited to 4300 digits; "
                          "store it as a str or a tensor") from None
    return value


def _json_str(value: str, path: str, what: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _refuse(path, f"{what} with a lone surrogate ({value[exc.start:exc.end]!r} at index {exc.start})",
                          "only valid Unicode text is stored; repair it, e.g. s.encode('utf-8', "
                          "'surrogateescape').decode('utf-8', 'replace')") from None
    return value


def _places(state: Any, target: str) -> list[str]:
    """How to reach each tensor whose key path is ``target`` from the root, e.g. ``state['']['x']``."""
    out: list[str] = []

    def visit(value: Any, path: str, access: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, join_path(path, k), f"{access}[{k!r}]")
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                visit(v, join_path(path, i), f"{access}[{i}]")
        elif path == target:
            out.append(access)

    visit(state, "", "state")
    return out


def unflatten(node: dict[str, Any], entry: Callable[[int], Any], where: str = "the manifest") -> Any:
    """Build a tree from its skeleton; ``entry(i)`` returns the object for entry ``i``."""
    (tag, value), = node.items()
    if tag == "typed":
        return typed.decode(value, where, lambda n: unflatten(n, entry, where))
    if tag == "dict":
        return {k: unflatten(v, entry, where) for k, v in value}
    if tag == "list":
        return [unflatten(v, entry, where) for v in value]
    if tag == "tuple":
        return tuple(unflatten(v, entry, where) for v in value)
    if tag == "entry":
        return entry(value)
    if tag == "float":
        return float(value)
    if tag in ("int", "str", "bool", "none"):
        return value
    raise ValueError(f"unknown tree node {tag!r}")


def new_array(kind: str, dtype: str, shape: list[int]) -> tuple[Any, memoryview]:
    """An uninitialised array/tensor for an entry and a writable flat byte view of its memory."""
    if kind == "torch":
        torch = _torch()
        if torch is None:
            try:
                import torch  # noqa: F811
            except ImportError:
                raise LuopanError("this checkpoint holds torch tensors; install torch (pip install "
                                  "'luopan[torch]')") from None
        if dtype not in TORCH_DTYPE_SIZES:  # never getattr an unchecked name on the torch module
            raise ValueError(f"unsupported torch dtype {dtype!r}")
        obj = torch.empty(shape, dtype=getattr(torch, dtype))
        if obj.numel() == 0:
            return obj, memoryview(bytearray())
        flat = obj.reshape(-1).view(torch.uint8).numpy()
    else:
        obj = np.empty(shape, dtype=np.dtype(dtype))
        flat = obj.reshape(-1).view(np.uint8)
    advise_huge_pages(flat.ctypes.data, flat.nbytes)  # fewer page faults as the load fills it
    return obj, memoryview(flat)
