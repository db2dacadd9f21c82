"""The live-sync delta file (docs/format.md §19.1): the elements of a set of tensors that changed over the last
versions, in **layers** (newest first) so that one file serves every lag — or every element (a full version).

    magic "LPSYNC\\x00\\x01" | u32 LE header length | header (canonical JSON) | one zstd frame per layer

Layer ``u`` carries the elements that changed in version ``u``, with their values then (the publisher may leave out
those that changed again later); the layers are versions ``to``, ``to - 1``, … in that order. So the file's prefix
through layer ``b + 1`` is the delta from version ``b``: a subscriber holding ``b`` reads that prefix (one read, an
HTTP range) and applies its layers oldest first, a later layer's element over an older one's.

A layer's body is, for each tensor of its header entry in order, its index section then its value section. A tensor
is coded ``gaps`` (the changed elements' flat indices, ascending, as LEB128 varints of the gap to the previous one —
the first from 0), ``gaps16`` (the same gaps as little-endian uint16), ``bitmap`` (one bit per element,
little-endian bit order, set where it changed) or ``whole`` (no index, every element); values are the new elements'
raw little-endian bytes. Encoding and decoding are vectorised (NumPy), never a Python loop per element. The parser
is strict: every member's type and range, every section's size, each frame's declared size, canonical varints,
strictly ascending indices below the tensor's element count — a hostile file is a CorruptDownloadError before
anything is sized by it beyond the declared (and checked) sizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from ..channel.index import _int, _is_int, _members  # the signed formats' member checks, shared
from ..errors import CorruptDownloadError, UnsupportedFormatError
from ..format.canonical import SealError, canonical, parse_object
from ..format.limits import MAX_NDIM, shape_fits
from .codings import (  # noqa: F401  (re-exported: the codings are part of the delta format)
    MAX_VARINT,
    _gaps,
    decode_bitmap,
    decode_gaps,
    decode_gaps16,
    encode_bitmap,
    encode_gaps,
    gaps_size,
)

MAGIC = b"LPSYNC\x00\x01"
FORMAT = "luopan-sync-delta"
FORMAT_VERSION = 2
MAX_HEADER = 16 << 20
MAX_TENSORS = 100_000
MAX_LAYERS = 1024
MAX_NAME = 4096
MAX_VERSION = 1 << 53
# dtypes a delta carries element by element; any other dtype is carried whole (still bit-exact)
ELEMENT_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}
MODES = ("gaps", "gaps16", "bitmap", "whole")
GAPS16_FROM = 64  # elements: below, varint gaps (smaller); from there, fixed 16-bit gaps (10x faster to code)
HEADER_MEMBERS = {"format", "format_version", "full", "layers", "to"}
LAYER_MEMBERS = {"base", "body_size", "frame_size", "tensors", "version"}
TENSOR_MEMBERS = {"count", "dtype", "index_bytes", "mode", "name", "shape", "value_bytes"}
FP_LEN = len("blake3:") + 64
_ZSTD_LEVEL = 1
Part = tuple[str, str, tuple[int, ...], "np.ndarray | None", np.ndarray]  # name, dtype, shape, indices, value bytes


@dataclass(frozen=True)
class TensorDelta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    mode: str  # gaps | gaps16 | bitmap | whole
    count: int  # elements carried
    index_bytes: int
    value_bytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layer:
    version: int  # it carries the elements whose last change was in this version
    base: str | None  # fingerprint of version - 1: what a subscriber reading the file down to this layer holds
    tensors: tuple[TensorDelta, ...]
    body_size: int
    frame_size: int
    offset: int  # where its zstd frame starts in the file

    @property
    def end(self) -> int:
        return self.offset + self.frame_size


@dataclass(frozen=True)
class DeltaHeader:
    target: int  # the version the file brings tensors to
    full: bool  # a full version: one layer, every tensor whole
    layers: tuple[Layer, ...]  # newest first: versions target, target - 1, …
    body_offset: int  # where the first frame starts

    def span(self, source: int | None) -> int:
        """How many layers the delta from ``source`` reads (None: a full version's one); ValueError when the file
        does not reach back to it."""
        n = 1 if source is None else self.target - source
        if not 1 <= n <= len(self.layers):
            raise ValueError(f"its layers go down to version {self.layers[-1].version}, not to the delta from "
                             f"version {source}")
        return n

    def prefix(self, source: int | None) -> int:
        """The bytes of the file the delta from ``source`` is: the header and its layers' frames."""
        return self.layers[self.span(source) - 1].end

# ------------------------------------------------------------------------------------------------------ files

def encode_body(parts: list[Part]) -> tuple[list[dict[str, Any]], int, bytes]:
    """(the layer's tensors, body_size, the zstd frame) of ``parts``: (name, dtype, shape, ascending flat indices or
    None for the whole tensor, the carried elements' bytes as uint8), in ascending name order."""
    tensors, body = [], []
    for name, dtype, shape, idx, values in parts:
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if idx is None:
            mode, count, index = "whole", numel, np.zeros(0, np.uint8)
        else:
            count = int(idx.size)
            bitmap = (numel + 7) // 8
            diffs = np.diff(idx, prepend=0)
            if count >= GAPS16_FROM and int(diffs.max()) < 1 << 16:
                mode, index = "gaps16", diffs.astype("<u2").view(np.uint8)
                size = index.size
            else:
                pre = _gaps(idx)
                mode, size = "gaps", int(pre[1].sum(dtype=np.int64))
            if bitmap < size:
                mode, index = "bitmap", encode_bitmap(idx, numel)
            elif mode == "gaps":
                index = encode_gaps(idx, pre)
        tensors.append({"count": count, "dtype": dtype, "index_bytes": int(index.size), "mode": mode, "name": name,
                        "shape": list(shape), "value_bytes": int(values.size)})
        body += [index, values]
    raw = b"".join(memoryview(np.ascontiguousarray(b)).cast("B") for b in body)
    return tensors, len(raw), zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True).compress(raw)


def assemble(target: int, layers: list[tuple[int, str | None, tuple[list[dict[str, Any]], int, bytes]]],
             full: bool = False) -> tuple[bytes, list[int]]:
    """The file of ``layers`` — (version, base fingerprint, ``encode_body``'s result), newest first — and where
    each layer's frame ends in it (the size of the delta down to that layer)."""
    docs = [{"base": base, "body_size": size, "frame_size": len(frame), "tensors": tensors, "version": version}
            for version, base, (tensors, size, frame) in layers]
    header = canonical({"format": FORMAT, "format_version": FORMAT_VERSION, "full": full, "layers": docs,
                        "to": target})
    head = MAGIC + struct.pack("<I", len(header)) + header
    ends, at = [], len(head)
    for _v, _b, (_t, _s, frame) in layers:
        at += len(frame)
        ends.append(at)
    return b"".join([head, *(frame for _v, _b, (_t, _s, frame) in layers)]), ends


def encode_delta(source: int | None, target: int, base: str | None, parts: list[Part]) -> bytes:
    """A file of one layer: the delta from ``target - 1`` (``source``, of fingerprint ``base``) carrying ``parts``,
    or (``source`` and ``base`` None) a full version."""
    if source is not None and source != target - 1:
        raise ValueError("a file of one layer goes from target - 1 to target")
    return assemble(target, [(target, base, encode_body(parts))], full=source is None)[0]


def parse_header(data: bytes | memoryview, where: str = "delta", layers: int | None = None) -> DeltaHeader:
    """The header of a delta file, every member checked (CorruptDownloadError; UnsupportedFormatError for a newer
    format_version). ``layers``: check the tensors of the first so many layers only (those a subscriber reads; the
    header of the others is parsed, their tensors are not: ``Layer.tensors`` is empty for them)."""
    try:
        return _parse_header(memoryview(data), where, layers)
    except (ValueError, SealError) as exc:
        raise CorruptDownloadError(f"live-sync delta {where} is refused: {exc}. Nothing was applied") from None


def _parse_header(data: memoryview, where: str, upto: int | None = None) -> DeltaHeader:
    if len(data) < len(MAGIC) + 4 or bytes(data[:len(MAGIC)]) != MAGIC:
        raise ValueError("it does not start with the live-sync delta magic")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(data):
        raise ValueError(f"its header length {hlen} is beyond the file or over {MAX_HEADER} bytes")
    raw = bytes(data[start:start + hlen])
    doc = parse_object(raw)
    if doc.get("format") != FORMAT:
        raise ValueError(f"its format is not {FORMAT!r}")
    fv = doc.get("format_version")
    if _is_int(fv) and fv > FORMAT_VERSION:
        raise UnsupportedFormatError(f"live-sync delta {where} has format_version {fv}, newer than this luopan reads "
                                     f"({FORMAT_VERSION}); upgrade luopan on the subscriber")
    _members(doc, HEADER_MEMBERS, "the header")
    if fv != FORMAT_VERSION:
        raise ValueError(f"format_version is not {FORMAT_VERSION} (a file of an older luopan.sync: publish again "
                         "with this version)")
    if canonical(doc) != raw:
        raise ValueError("its header is not canonical JSON")
    target = _int(doc["to"], "to", 1, MAX_VERSION)
    full = doc["full"]
    if not isinstance(full, bool):
        raise ValueError("full is not true or false")
    items = doc["layers"]
    if not isinstance(items, list) or not 1 <= len(items) <= (1 if full else min(MAX_LAYERS, target - 1)):
        raise ValueError("layers is not a list of one layer (a full version) or of 1 to "
                         f"{MAX_LAYERS} layers, none before version 2")
    layers, at, count = [], start + hlen, 0
    for k, item in enumerate(items):
        _members(item, LAYER_MEMBERS, "a layer")
        version = _int(item["version"], "a layer's version", 1, MAX_VERSION)
        if version != target - k:
            raise ValueError(f"layer {k} is of version {version}, not {target - k}: the layers go from the newest "
                             "version down, one each")
        base = None if item["base"] is None else _fp(item["base"], f"layer {version}: base")
        if (base is None) != full:
            raise ValueError(f"layer {version}: base is {'set in a full version' if full else 'null in a delta'}")
        tensors = item["tensors"]
        count += len(tensors) if isinstance(tensors, list) else 0
        if not isinstance(tensors, list) or count > MAX_TENSORS:
            raise ValueError(f"layer {version}: tensors is not a list, or the layers hold over {MAX_TENSORS}")
        ts = tuple(_tensor(t, full) for t in tensors) if upto is None or k < upto else ()
        names = [t.name for t in ts]
        if names != sorted(set(names)):
            raise ValueError(f"layer {version}: tensor names are not unique and in ascending order")
        body = _int(item["body_size"], f"layer {version}: body_size", 0, 1 << 50)
        if (upto is None or k < upto) and body != sum(t.index_bytes + t.value_bytes for t in ts):
            raise ValueError(f"layer {version}: body_size is not the sum of the tensors' sections")
        frame = _int(item["frame_size"], f"layer {version}: frame_size", 1, 1 << 50)
        layers.append(Layer(version, base, ts, body, frame, at))
        at += frame
    return DeltaHeader(target, full, tuple(layers), start + hlen)


def _tensor(t: Any, full: bool) -> TensorDelta:
    _members(t, TENSOR_MEMBERS, "a tensor")
    name = t["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ValueError("a tensor name is not a string of 1-4096 characters")
    dtype = t["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list or dict is unhashable: refused, not a crash
        raise ValueError(f"tensor {name[:80]!r} has dtype {str(dtype)[:20]!r}, not one of {sorted(DTYPE_SIZES)}")
    shape = t["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) and d >= 0 for d in shape) or \
            not shape_fits(tuple(shape), DTYPE_SIZES[dtype]):
        raise ValueError(f"tensor {name[:80]!r} has an invalid shape")
    td = TensorDelta(name, dtype, tuple(shape), t["mode"], _int(t["count"], "count", 0, 1 << 48),
                     _int(t["index_bytes"], "index_bytes", 0, 1 << 50), _int(t["value_bytes"], "value_bytes", 0,
                                                                             1 << 50))
    n, size = td.numel, DTYPE_SIZES[dtype]
    if td.mode not in MODES or (full and td.mode != "whole"):
        raise ValueError(f"tensor {name[:80]!r} has mode {str(td.mode)[:20]!r}"
                         + (" in a full version (only 'whole')" if full else ""))
    if td.mode != "whole" and dtype not in ELEMENT_DTYPES:
        raise ValueError(f"tensor {name[:80]!r} of dtype {dtype} is coded by element, which only "
                         f"{sorted(ELEMENT_DTYPES)} are")
    if td.value_bytes != td.count * size:
        raise ValueError(f"tensor {name[:80]!r}: value_bytes is not count x {size}")
    if td.mode == "whole":
        ok = td.count == n and td.index_bytes == 0
    elif td.mode == "bitmap":
        ok = 0 < td.count <= n and td.index_bytes == (n + 7) // 8
    elif td.mode == "gaps16":
        ok = 0 < td.count <= n and td.index_bytes == 2 * td.count
    else:
        ok = 0 < td.count <= n and td.count <= td.index_bytes <= min(MAX_VARINT * td.count, (n + 7) // 8 or 1)
    if not ok:
        raise ValueError(f"tensor {name[:80]!r}: count {td.count} and index_bytes {td.index_bytes} do not fit mode "
                         f"{td.mode} and {n} elements")
    return td


def held_layers(data: bytes | memoryview, header: DeltaHeader, where: str = "delta") -> int:
    """How many layers ``data`` (the file, or a prefix of it) holds whole: it must end exactly after a frame."""
    for k, layer in enumerate(header.layers):
        if layer.end == len(data):
            return k + 1
    raise CorruptDownloadError(f"live-sync delta {where} is refused: its {len(data)} bytes do not end where a "
                               "layer's frame ends. Nothing was applied")


def read_body(data: bytes | memoryview, layer: Layer, where: str = "delta", max_body: int | None = None
              ) -> memoryview:
    """The body of ``layer``: exactly one zstd frame filling its ``frame_size`` bytes, declaring and holding its
    ``body_size`` bytes. ``max_body``: refuse a larger declared body before decompressing (a subscriber checks the
    header's tensors against its own first, which bounds the body by the model's size)."""
    frame = memoryview(data)[layer.offset:layer.end]
    try:
        if len(frame) != layer.frame_size:
            raise ValueError(f"layer {layer.version}'s frame is cut short")
        if max_body is not None and layer.body_size > max_body:
            raise ValueError(f"layer {layer.version}'s body of {layer.body_size} bytes is over the limit of "
                             f"{max_body}")
        declared = zstandard.frame_content_size(frame)
        if declared != layer.body_size:
            raise ValueError(f"layer {layer.version}'s zstd frame declares {declared} bytes, not its body_size "
                             f"{layer.body_size}")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(1, layer.body_size),
                                                      allow_extra_data=False)
    except (ValueError, zstandard.ZstdError) as exc:
        raise CorruptDownloadError(f"live-sync delta {where} is refused: {exc}. Nothing was applied") from None
    if len(out) != layer.body_size:
        raise CorruptDownloadError(f"live-sync delta {where} is refused: layer {layer.version}'s body is {len(out)} "
                                   f"bytes, not {layer.body_size}. Nothing was applied")
    return memoryview(out)


def sections(body: memoryview, layer: Layer, where: str = "delta"
             ) -> list[tuple[TensorDelta, np.ndarray | None, memoryview]]:
    """For each tensor of ``layer``: (its entry, its flat indices — None when whole —, its values' bytes);
    CorruptDownloadError for an index section that does not hold what the header says."""
    out, at = [], 0
    for t in layer.tensors:
        index = np.frombuffer(body, np.uint8, t.index_bytes, at)
        at += t.index_bytes
        values = body[at:at + t.value_bytes]
        at += t.value_bytes
        try:
            idx = None if t.mode == "whole" else (decode_gaps(index, t.count, t.numel) if t.mode == "gaps" else
                                                  decode_gaps16(index, t.count, t.numel) if t.mode == "gaps16" else
                                                  decode_bitmap(index, t.count, t.numel))
        except ValueError as exc:
            raise CorruptDownloadError(f"live-sync delta {where} is refused: layer {layer.version}, tensor "
                                       f"{t.name[:80]!r}: {exc}. Nothing was applied") from None
        out.append((t, idx, values))
    return out


def parse_delta(data: bytes, where: str = "delta", max_body: int | None = None
                ) -> tuple[DeltaHeader, list[tuple[Layer, list[tuple[TensorDelta, Any, Any]]]]]:
    """Header and decoded sections of each layer a delta file (or a prefix of one, ending after a frame) holds,
    newest first (what the fuzz tests feed)."""
    header = parse_header(data, where)
    n = held_layers(data, header, where)
    return header, [(layer, sections(read_body(data, layer, where, max_body), layer, where))
                    for layer in header.layers[:n]]


def _fp(x: Any, what: str) -> str:
    if not isinstance(x, str) or len(x) != FP_LEN or not x.startswith("blake3:") or \
            any(c not in "0123456789abcdef" for c in x[7:]):
        raise ValueError(f"{what} is not 'blake3:' and 64 hex digits")
    return x
