"""Plain safetensors files, as a patch's base and as its output: the header read with bounds (a file on a device is
trusted no further than its size allows), and the header written byte for byte as ``luopan export`` writes it, so an
applied patch and an export of the same checkpoint are the same file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptSafetensorsError
from ..format.canonical import SealError, parse_object
from ..format.dtypes import SAFETENSORS_DTYPES, TORCH_DTYPE_SIZES
from ..format.limits import shape_fits

# safetensors itself allows headers up to 100 MB, which parse to ~1 GB of Python objects; a base's header is
# refused over 16 MiB before it is read (~160k tensors; parsed, ~170 MiB at most; docs/format.md §13.4)
MAX_HEADER_BYTES = 16 << 20
DTYPE_OF_CODE = {code: name for name, code in SAFETENSORS_DTYPES.items()}
ITEMSIZE = {name: TORCH_DTYPE_SIZES[name] for name in SAFETENSORS_DTYPES}
METADATA = "__metadata__"


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: luopan dtype name, shape, and where its bytes lie in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


def nbytes_of(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def read_header(fd: int, size: int, where: str) -> tuple[list[FileTensor], dict[str, str] | None]:
    """The tensors (in file order) and ``__metadata__`` of the safetensors file open at ``fd`` (``size`` bytes).
    CorruptSafetensorsError, naming ``where``, when it is not a valid safetensors file of known dtypes."""
    def bad(msg: str) -> CorruptSafetensorsError:
        return CorruptSafetensorsError(f"{where} is not a valid safetensors file: {msg}")

    if size < 8:
        raise bad(f"it has {size} bytes, fewer than the 8-byte header length")
    hlen = int.from_bytes(os.pread(fd, 8, 0), "little")
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise bad(f"its header length {hlen} is over the {MAX_HEADER_BYTES}-byte limit or past the end of the file "
                  f"({size} bytes)")
    raw = os.pread(fd, hlen, 8)
    if len(raw) != hlen:
        raise bad("the file is shorter than its header (it changed while being read?)")
    try:
        doc = parse_object(raw.rstrip(b" "))
    except SealError as exc:
        raise bad(f"its header is not a JSON object ({exc})") from None
    data_start, data_len = 8 + hlen, size - 8 - hlen
    metadata = doc.pop(METADATA, None)
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())
                                 or any(_surrogate(x) for kv in metadata.items() for x in kv)):
        raise bad("__metadata__ is not a map of strings to strings (without lone surrogates)")
    tensors = []
    for name, spec in doc.items():
        if _surrogate(name):  # a name no UTF-8 file can hold: it could not be hashed or written again
            raise bad(f"tensor name {name[:100]!r} holds a lone surrogate")
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name[:100]!r} is not {{dtype, shape, data_offsets}}")
        dtype = DTYPE_OF_CODE.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise bad(f"tensor {name[:100]!r} has dtype {str(spec['dtype'])[:20]!r}, which luopan does not know "
                      f"(known: {', '.join(sorted(DTYPE_OF_CODE))})")
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) \
                or not shape_fits(shape, ITEMSIZE[dtype]):
            raise bad(f"tensor {name[:100]!r} has an impossible shape")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets) \
                or not 0 <= offsets[0] <= offsets[1] <= data_len:
            raise bad(f"tensor {name[:100]!r} has data offsets {str(offsets)[:60]} outside the file's "
                      f"{data_len} data bytes")
        nbytes = nbytes_of(dtype, shape)
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"tensor {name[:100]!r} ({dtype} {shape}) needs {nbytes} bytes, its offsets span "
                      f"{offsets[1] - offsets[0]}")
        tensors.append(FileTensor(name, dtype, tuple(shape), data_start + offsets[0], nbytes))
    tensors.sort(key=lambda t: t.offset)
    return tensors, metadata


def header_bytes(metadata: dict[str, str] | None, tensors: list[tuple[str, str, list[int], int]]) -> bytes:
    """The 8-byte length and header of a safetensors file of ``(name, dtype, shape, nbytes)`` laid out in order,
    exactly as luopan.checkpoint.export writes it (metadata first, compact JSON, spaces to an 8-byte boundary)."""
    header: dict[str, Any] = {} if metadata is None else {METADATA: metadata}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def _is_int(x: Any) -> bool:
    return type(x) is int


def _surrogate(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False
