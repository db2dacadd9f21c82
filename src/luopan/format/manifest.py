"""Checkpoint manifests: build, seal, parse and validate (docs/format.md §8)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any, NamedTuple

import numpy as np
from fastjsonschema import JsonSchemaException

from ..errors import CorruptManifestError
from .. import typed
from ..tree import itemsize, unflatten
from . import ENGINE2_FORMAT_VERSION, SEGMENTS_FORMAT_VERSION, refuse_newer
from .groups import GROUPS_FORMAT_VERSION, ReadBlob, expand
from .canonical import SealError, canonical, compress_json, digest, inflate_json, parse_object, seal, verify_seal
from .limits import MAX_MANIFEST_BYTES, MAX_NBYTES, MAX_NDIM, shape_fits

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
NODE_TAGS = ("dict", "list", "tuple", "entry", "int", "float", "str", "bool", "none", "typed")
SCALAR_TYPES: dict[str, Any] = {"int": int, "float": (int, float, str), "str": str, "bool": bool,
                                "none": type(None)}


def _scalar_ok(tag: str, value: Any) -> bool:
    """A scalar tree node inside a typed value, as the schema checks those outside one: an int or a float is never
    a bool, a float's string is one of the non-finite names (what ``tree.unflatten`` reads back)."""
    if isinstance(value, bool) and tag in ("int", "float"):
        return False
    if tag == "float" and isinstance(value, str):
        return value in ("nan", "inf", "-inf")
    return isinstance(value, SCALAR_TYPES[tag])


@cache
def _validator() -> Any:
    # fastjsonschema compiles the schema to Python: 7 ms vs 106 ms (jsonschema) for a 300-entry manifest here.
    import fastjsonschema

    schema = json.loads(resources.files(__package__).joinpath("manifest.schema.json").read_text())
    return fastjsonschema.compile(schema)


def encode_metrics(metrics: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if hasattr(v, "item") and callable(v.item):  # 0-d tensors and NumPy scalars
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        elif v is not None and not isinstance(v, (int, float, str, bool)):
            raise TypeError(f"metric {k!r} must be a number, str, bool or None, got {type(v).__name__}")
        out[k] = v
    return out


def decode_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in metrics.items()}


def structure_fingerprint(entries: list[dict[str, Any]]) -> str:
    rows = [[e["path"], e["kind"], e["dtype"], list(e["shape"])] for e in entries]
    return "blake3:" + digest(canonical(rows))


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. ``doc`` is the JSON object (without its checksum member). ``xxh3_reads``: its
    chunks are checked against their rows' XXH3-128 when read for a load (the opt-in ``read_check="xxh3"``)."""

    doc: dict[str, Any]
    xxh3_reads: bool = False

    @property
    def run(self) -> str:
        return self.doc["run"]

    @property
    def step(self) -> int:
        return self.doc["step"]

    @property
    def created(self) -> str:
        return self.doc["created"]

    @property
    def metrics(self) -> dict[str, Any]:
        return decode_metrics(self.doc["metrics"])

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.doc["entries"]

    @property
    def packs(self) -> list[str]:
        return self.doc["packs"]

    @property
    def stats(self) -> dict[str, int]:
        return self.doc["stats"]

    @property
    def tree(self) -> dict[str, Any]:
        return self.doc["tree"]

    def entry(self, path: str) -> dict[str, Any]:
        for e in self.entries:
            if e["path"] == path:
                return e
        raise KeyError(path)


def seal_manifest(doc: dict[str, Any], compress: bool = False) -> bytes:
    """A manifest's file bytes: sealed JSON, or (``compress``, repositories of format_version 5) a zstd frame of it."""
    data = seal(doc)
    return compress_json(data) if compress else data


def parse_manifest(data: bytes, where: str, run: str | None = None, step: int | None = None,
                   read: ReadBlob | None = None) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where``; typed errors name the file. A grouped manifest
    (§8.5) has its entry groups read through ``read`` and expanded: the document has ``entries`` either way."""
    return Manifest(_validated(_opened(data, where), where, run, step, read))


def schema_check(doc: dict[str, Any], where: str, nested: str = "its tree") -> None:
    """The manifest schema on ``doc``; CorruptManifestError naming ``where`` (and ``nested`` when too deep)."""
    try:
        _validator()(doc)
    except JsonSchemaException as e:
        raise CorruptManifestError(f"manifest {where} does not match the schema: {e.message[:300]}") from None
    except RecursionError:
        raise CorruptManifestError(f"manifest {where}: {nested} is nested too deeply") from None


def _opened(data: bytes, where: str) -> dict[str, Any]:
    """The sealed document of manifest bytes (inflated, seal checked, not newer than this reader)."""
    try:
        obj = parse_object(inflate_json(data, MAX_MANIFEST_BYTES))
        refuse_newer(obj, where)
        return verify_seal(obj)
    except SealError as exc:
        raise CorruptManifestError(f"manifest {where} is damaged: {exc}") from None


def _validated(doc: dict[str, Any], where: str, run: str | None, step: int | None,
               read: ReadBlob | None) -> dict[str, Any]:
    if "groups" in doc:
        if not isinstance(doc.get("format_version"), int) or doc["format_version"] < GROUPS_FORMAT_VERSION:
            raise CorruptManifestError(f"manifest {where} has entry groups, which its format_version "
                                       f"{str(doc.get('format_version'))[:20]!r} lacks (they need 6)")
        expand(doc, read, where)
    schema_check(doc, where)
    if "groups" in doc and structure_fingerprint(doc["entries"]) != doc["fingerprint"]:  # as the writer listed them
        raise CorruptManifestError(f"manifest {where}: its entries, rebuilt from its entry groups, do not match "
                                   "its fingerprint")
    _check_consistency(doc, where)
    if run is not None and (doc["run"], doc["step"]) != (run, step):
        raise CorruptManifestError(
            f"manifest {where} names run {doc['run']!r} step {doc['step']}, not its location's {run!r} step {step}"
        )
    return doc


class Row(NamedTuple):
    """A chunk row of a manifest, ``[hash, pack index, offset, length, size, codec, xxh3-128]`` (docs/format.md §8),
    read by field name: ``Row._make(r)``. Positions for writers that update a row in place are ``Row._fields``."""

    hash: str
    pack: int  # index into the manifest's "packs"
    offset: int
    length: int  # stored bytes (compressed or not)
    size: int  # raw bytes
    codec: str
    xxh3: str


def rows_of(entry: dict[str, Any]) -> list[Row]:
    """``stored_rows`` read by field name."""
    return [Row._make(r) for r in stored_rows(entry)]


def stored_rows(entry: dict[str, Any]) -> list[list[Any]]:
    """Every chunk row an entry's bytes depend on: its (base) chunks, then any row delta's index and values, or
    any XOR delta's chunks."""
    d = entry.get("delta", {})
    return entry.get("chunks", []) + d.get("index", []) + d.get("values", []) + entry.get("xor", {}).get("chunks", [])


def manifest_rows(doc: dict[str, Any]) -> list[Row]:
    """Every chunk row a parsed manifest document names: its entries' rows, then its entry groups' (§8.5)."""
    return [r for e in doc["entries"] for r in rows_of(e)] + [Row._make(r) for r in doc.get("groups", [])]


def uses_new_codecs(entries: list[dict[str, Any]]) -> bool:
    """Whether any chunk row names a codec that format_version 5 introduced (§6.1)."""
    return any(r[5] not in ("none", "zstd") for e in entries for r in stored_rows(e))


MAX_CHUNK_BYTES = 1 << 30  # the largest chunk_size a repository may have (format/config.py)




def chunk_bytes(chunks: list[list[Any]], npacks: int, path: str, bad: Any) -> int:
    """Raw bytes a list of chunk rows holds, after checking each row's pack index and sizes."""
    total = 0
    for row in map(Row._make, chunks):
        pack, length, csize, codec = row.pack, row.length, row.size, row.codec
        if pack >= npacks:
            raise bad(f"entry {path!r} names pack #{pack} of {npacks}")
        if csize == 0 or csize > MAX_CHUNK_BYTES or (length != csize if codec == "none" else length > csize):
            raise bad(f"entry {path!r} has a chunk of impossible size (stored {length}, raw {csize})")
        total += csize
    return total


def patch_segments(entry: dict[str, Any], index_bytes: Any, where: str) -> list[tuple[int, Any]]:
    """(first position, row numbers) of each segment of a row delta's patch (§5.2), given the bytes of its verified
    ``index`` chunks, after checking what a load relies on: each segment's row numbers sorted, unique and below the
    table's rows. CorruptManifestError naming the entry otherwise. Loading (``checkpoint.rowdelta.decode_patch``) and
    ``verify`` both call this, so a patch verify passes is one a load applies."""
    nrows = entry["shape"][0]
    index = np.frombuffer(index_bytes, dtype="<i8")
    out = []
    start = 0
    for n in entry.get("delta", {}).get("segments", [index.size]):
        seg = index[start : start + n]
        if seg.size and (seg[0] < 0 or seg[-1] >= nrows or (seg.size > 1 and np.any(seg[1:] <= seg[:-1]))):
            raise CorruptManifestError(
                f"{where}: entry {entry['path']!r} row delta has row numbers that are not sorted, unique and below "
                f"{nrows} within a segment")
        out.append((start, seg))
        start += n
    return out


def _check_consistency(doc: dict[str, Any], where: str) -> None:
    """What the schema cannot say: sizes agree with dtypes and shapes, indices are in range, aliases match.

    Every check here guards a read path: without it a damaged or hostile manifest could make `load` return memory
    it never read (shape larger than nbytes), or allocate absurd buffers.
    """
    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"manifest {where}: {msg}")

    try:
        created = datetime.fromisoformat(doc["created"].replace("Z", "+00:00"))
    except ValueError:
        created = None
    if created is None or created.utcoffset() is None:
        raise bad(f"created time {doc['created'][:40]!r} is not an ISO-8601 time with a timezone")
    npacks = len(doc["packs"])
    chunk_bytes(doc.get("groups", []), npacks, "(entry groups)", bad)
    entries = doc["entries"]
    for i, e in enumerate(entries):
        path = e["path"]
        size = itemsize(e["kind"], e["dtype"])
        if size is None:
            raise bad(f"entry {path!r} has unsupported {e['kind']} dtype {e['dtype']!r}")
        if not shape_fits(e["shape"], size):
            raise bad(f"entry {path!r}: shape {e['shape'][:8]}… cannot be allocated (at most {MAX_NDIM} dimensions "
                      f"and {MAX_NBYTES} bytes counting empty ones as 1)")
        if math.prod(e["shape"]) * size != e["nbytes"]:
            raise bad(f"entry {path!r}: shape {e['shape']} of {e['dtype']} is not {e['nbytes']} bytes")
        if e.get("scalar") and e["shape"]:
            raise bad(f"entry {path!r} is a scalar with shape {e['shape']}")
        if "alias_of" in e:
            j = e["alias_of"]
            if j >= i or "alias_of" in entries[j]:
                raise bad(f"entry {path!r} aliases an invalid entry {j}")
            if any(entries[j][k] != e[k] for k in ("kind", "dtype", "shape", "nbytes")):
                raise bad(f"entry {path!r} aliases entry {entries[j]['path']!r} of a different type or shape")
            if {"delta", "xor", "chunks"} & e.keys():
                raise bad(f"entry {path!r} is an alias and cannot have chunks or a delta")
            continue
        total = chunk_bytes(e["chunks"], npacks, path, bad)
        if total != e["nbytes"]:
            raise bad(f"entry {path!r} chunks hold {total} bytes, expected {e['nbytes']}")
        d = e.get("delta")
        if d is not None:  # docs/format.md §5.2: base chunks + changed rows (indices, values)
            if doc["format_version"] < 2:
                raise bad(f"entry {path!r} has a row delta, which format_version {doc['format_version']} lacks")
            if e.get("scalar") or not e["shape"] or e["shape"][0] == 0:
                raise bad(f"entry {path!r} has a row delta but no rows")
            nrows = e["shape"][0]
            segments = d.get("segments", [d["rows"]])
            if "segments" in d and doc["format_version"] < SEGMENTS_FORMAT_VERSION:
                raise bad(f"entry {path!r} has a row delta in segments, which format_version "
                          f"{doc['format_version']} lacks")
            if sum(segments) != d["rows"]:
                raise bad(f"entry {path!r} delta segments {segments[:8]} do not add up to its {d['rows']} rows")
            if max(segments) > nrows:
                raise bad(f"entry {path!r} delta names {max(segments)} rows in one segment, of {nrows}")
            if chunk_bytes(d["index"], npacks, path, bad) != 8 * d["rows"]:
                raise bad(f"entry {path!r} delta index is not {d['rows']} int64 row numbers")
            if chunk_bytes(d["values"], npacks, path, bad) != d["rows"] * (e["nbytes"] // nrows):
                raise bad(f"entry {path!r} delta values are not {d['rows']} rows of {e['nbytes'] // nrows} bytes")
        x = e.get("xor")
        if x is not None:  # docs/format.md §5.4: base chunks XOR delta chunks, chunk by chunk
            if doc["format_version"] < ENGINE2_FORMAT_VERSION or d is not None:
                raise bad(f"entry {path!r} has an XOR delta, which format_version {doc['format_version']} lacks "
                          "or which is combined with a row delta")
            if [r[4] for r in x["chunks"]] != [r[4] for r in e["chunks"]]:
                raise bad(f"entry {path!r} XOR delta chunks do not have the sizes of its base chunks")
            chunk_bytes(x["chunks"], npacks, path, bad)

    def walk(node: Any, checked: bool = True) -> None:
        """``checked``: the schema validated this node; nodes inside a typed value are checked here instead."""
        if not checked and not (isinstance(node, dict) and len(node) == 1 and next(iter(node)) in NODE_TAGS):
            raise bad(f"a typed value holds a malformed tree node {str(node)[:60]}")
        (tag, value), = node.items()
        if tag == "dict":
            if not checked and not (isinstance(value, list) and all(
                    isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) for kv in value)):
                raise bad("a typed value holds a malformed dict node")
            for _k, v in value:
                walk(v, checked)
        elif tag in ("list", "tuple"):
            if not checked and not isinstance(value, list):
                raise bad(f"a typed value holds a malformed {tag} node")
            for v in value:
                walk(v, checked)
        elif tag == "typed":
            if not isinstance(value, dict):
                raise bad("a typed node is not an object")
            if value.get("type") == "torch.dtype" and value.get("v") not in typed.TORCH_NAMES:
                raise bad(f"a typed value names an unknown torch dtype {str(value.get('v'))[:40]!r}")
            for v in typed.children(value):
                walk(v, False)
        elif tag == "entry" and (type(value) is not int or not 0 <= value < len(entries)):
            raise bad(f"tree names entry {str(value)[:20]} of {len(entries)}")
        elif not checked and tag in SCALAR_TYPES and not _scalar_ok(tag, value):
            raise bad(f"a typed value holds a malformed {tag} node")

    try:
        walk(doc["tree"])
        _decode_typed(doc["tree"], where)
    except RecursionError:
        raise bad("tree is nested too deeply") from None


def _decode_typed(tree: dict[str, Any], where: str) -> None:
    """Decode each outermost typed value of a walked tree as a load does (``tree.unflatten``, entries stood in for),
    so a typed value a load would refuse is refused when the manifest is read (by ``verify`` too). A value holding
    a torch dtype or device is left to the load: decoding it needs torch, which a reader need not have."""
    for node in _typed_nodes(tree, outermost=True):
        if not any(str(t.get("type")).startswith("torch.") for t in _typed_nodes(node)):
            unflatten(node, lambda i: ("entry", i), where)


def _typed_nodes(node: dict[str, Any], outermost: bool = False) -> Iterator[dict[str, Any]]:
    """The typed nodes of a walked tree (``{"typed": ...}``; with ``outermost`` as nodes, else their specs), and
    with ``outermost`` only those inside no other."""
    stack = [node]
    while stack:
        (tag, value), = stack.pop().items()
        if tag == "typed":
            if outermost:
                yield {tag: value}
                continue
            yield value
            stack.extend(typed.children(value))
        elif tag == "dict":
            stack.extend(v for _k, v in value)
        elif tag in ("list", "tuple"):
            stack.extend(value)
