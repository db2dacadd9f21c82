"""A patch's header (docs/format.md §13.2): the target's tensors with their chunks, both content fingerprints and
the blobs the patch carries. Built canonical by writers; parsed by readers as hostile input, every member checked
for type and range before anything is sized by it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptPatchError, UnsupportedFormatError
from ..format.canonical import SealError, canonical, parse_object
from ..format.limits import MAX_NBYTES, MAX_PATH_CHARS, shape_fits
from ..format.names import MAX_STEP, is_hex64, is_run_name
from .fingerprint import content_fingerprint
from .stfile import ITEMSIZE, METADATA, nbytes_of

FORMAT = "luopan-patch"
FORMAT_VERSION = 1
MIN_CHUNK, MAX_CHUNK = 4096, 1 << 30  # as a repository's chunk_size (§3)
CODECS = ("none", "zstd")
MAX_TEXT = 4096  # source descriptions, created
MEMBERS = {"base", "blobs", "body_bytes", "chunk_size", "created", "format", "format_version", "metadata", "subtree",
           "target", "tensors"}


@dataclass(frozen=True)
class TensorSpec:
    """A target tensor: luopan dtype name, shape, bytes, and its chunks as (BLAKE3 hex, size) in order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Blob:
    """A chunk the patch carries: where it lies in the body (offset from the body's start), stored and raw size."""

    hash: str
    offset: int
    length: int
    size: int
    codec: str


@dataclass(frozen=True)
class Header:
    chunk_size: int
    tensors: list[TensorSpec]
    blobs: dict[str, Blob]
    body_bytes: int
    base: dict[str, Any]  # bytes, fingerprint, source, tensors
    target: dict[str, Any]  # bytes, fingerprint, run, step, tensors
    metadata: dict[str, str] | None  # the output's safetensors __metadata__, in order
    subtree: str | None  # the key path the target's tensor names are relative to
    created: str


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a tensor name in a patch, or None. Names become keys of the output file, and readers
    of it may make paths of them: no absolute path, no empty, '.' or '..' part, no backslash or control character."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_PATH_CHARS:
        return "not a string of 1 to 65536 characters"
    if name == METADATA:
        return "__metadata__ is reserved by safetensors"
    if any(ord(c) < 32 or ord(c) == 127 or c == "\\" or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "it holds a control character, a backslash or a lone surrogate"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "it has an empty, '.' or '..' part (or starts with '/')"
    return None


def spans(nbytes: int, shape: tuple[int, ...], chunk_size: int) -> tuple[int, int]:
    """(step, count) of the §5 chunks of an entry: every chunk is ``step`` bytes but the last. Arithmetic only, so a
    hostile size cannot make a reader build a huge list (the same cut as luopan.format.chunking.chunk_spans)."""
    if nbytes == 0:
        return chunk_size, 0
    step = chunk_size
    if len(shape) >= 2 and shape[0] > 0:
        row = nbytes // shape[0]
        if 0 < row <= chunk_size:
            step = (chunk_size // row) * row
    return step, -(-nbytes // step)


def build_header(*, chunk_size: int, tensors: list[TensorSpec], blobs: list[Blob], base: dict[str, Any],
                 target: dict[str, Any], metadata: dict[str, str] | None, subtree: str | None, created: str) -> bytes:
    """The canonical header bytes (what a signature signs)."""
    doc = {
        "base": base,
        "blobs": [[b.hash, b.offset, b.length, b.size, b.codec] for b in blobs],
        "body_bytes": sum(b.length for b in blobs),
        "chunk_size": chunk_size,
        "created": created,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "metadata": None if metadata is None else [[k, v] for k, v in metadata.items()],
        "subtree": subtree,
        "target": target,
        "tensors": [{"chunks": [list(c) for c in t.chunks], "dtype": t.dtype, "name": t.name, "shape": list(t.shape)}
                    for t in tensors],
    }
    return canonical(doc)


def _int(x: Any, lo: int, hi: int) -> bool:
    """A JSON integer from ``lo`` to ``hi``: never a bool, never a float (``4096.0 == 4096`` in Python, but a float
    would reach arithmetic and file offsets that need an int)."""
    return type(x) is int and lo <= x <= hi


def has_surrogate(s: str) -> bool:
    """Whether ``s`` holds a lone surrogate (JSON can escape one; UTF-8 cannot encode it, so no file can hold it)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False


def _text(x: Any, limit: int = MAX_TEXT) -> bool:
    return isinstance(x, str) and len(x) <= limit and not has_surrogate(x)


def parse_header(data: bytes, where: str) -> Header:
    """The checked header of a patch. CorruptPatchError naming ``where`` and the member on any damage;
    UnsupportedFormatError for a newer format_version."""
    def bad(msg: str) -> CorruptPatchError:
        return CorruptPatchError(f"{where}: damaged patch header: {msg}")

    try:
        doc = parse_object(data)
    except SealError as exc:
        raise bad(str(exc)) from None
    if doc.get("format") != FORMAT:
        raise bad(f"format is {str(doc.get('format'))[:40]!r}, not {FORMAT!r}")
    version = doc.get("format_version")
    if _int(version, FORMAT_VERSION + 1, 1 << 62):
        raise UnsupportedFormatError(f"{where} is patch format_version {version}; this luopan reads version "
                                     f"{FORMAT_VERSION}: upgrade luopan (pip install -U luopan)")
    if not _int(version, FORMAT_VERSION, FORMAT_VERSION):
        raise bad(f"format_version {str(version)[:20]} is not {FORMAT_VERSION}")
    if set(doc) != MEMBERS:
        extra, missing = sorted(set(doc) - MEMBERS), sorted(MEMBERS - set(doc))
        raise bad(f"unknown members {[m[:40] for m in extra][:5]}, missing {missing}")
    chunk_size = doc["chunk_size"]
    if not _int(chunk_size, MIN_CHUNK, MAX_CHUNK):
        raise bad(f"chunk_size {str(chunk_size)[:20]} is not an integer from {MIN_CHUNK} to {MAX_CHUNK}")
    if not _text(doc["created"], 64):
        raise bad("created is not a time")
    subtree = doc["subtree"]
    if subtree is not None and name_problem(subtree) is not None:
        raise bad(f"subtree: {name_problem(subtree)}")
    metadata = _metadata(doc["metadata"], bad)
    tensors, sizes = _tensors(doc["tensors"], chunk_size, bad)
    blobs, body = _blobs(doc["blobs"], chunk_size, sizes, bad)
    if not _int(doc["body_bytes"], body, body):
        raise bad(f"body_bytes {str(doc['body_bytes'])[:20]} is not the sum of the blob lengths ({body})")
    base, target = doc["base"], doc["target"]
    total = sum(t.nbytes for t in tensors)
    if not isinstance(base, dict) or set(base) != {"bytes", "fingerprint", "source", "tensors"} \
            or not _fingerprint(base["fingerprint"]) or not _text(base["source"]) \
            or not _int(base["bytes"], 0, MAX_NBYTES) or not _int(base["tensors"], 0, MAX_NBYTES):
        raise bad("base is not {bytes, fingerprint, source, tensors}")
    if not isinstance(target, dict) or set(target) != {"bytes", "fingerprint", "run", "step", "tensors"} \
            or not _fingerprint(target["fingerprint"]) or not is_run_name(target["run"]) \
            or not _int(target["step"], 0, MAX_STEP):
        raise bad("target is not {bytes, fingerprint, run, step, tensors}")
    if not _int(target["tensors"], len(tensors), len(tensors)) or not _int(target["bytes"], total, total):
        raise bad(f"target declares {str(target['tensors'])[:20]} tensors of {str(target['bytes'])[:20]} bytes; "
                  f"the list holds {len(tensors)} of {total}")
    computed = content_fingerprint(chunk_size, ((t.name, t.dtype, t.shape, [h for h, _s in t.chunks])
                                                for t in tensors))
    if computed != target["fingerprint"]:
        raise bad(f"the target's tensor list has fingerprint {computed}, the header says {target['fingerprint']}")
    return Header(chunk_size, tensors, blobs, body, base, target, metadata, subtree, doc["created"])


def _metadata(raw: Any, bad: Any) -> dict[str, str] | None:
    """The output's ``__metadata__``, kept as ``[key, value]`` pairs so its order survives canonical JSON."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 and _text(p[0], MAX_PATH_CHARS)
                                            and _text(p[1], MAX_PATH_CHARS) for p in raw):
        raise bad("metadata is not a list of [string, string] pairs (each at most 65536 characters, no lone "
                  "surrogate)")
    out = dict(raw)
    if len(out) != len(raw):
        raise bad("metadata names a key twice")
    return out


def _fingerprint(x: Any) -> bool:
    return isinstance(x, str) and x.startswith("blake3:") and is_hex64(x[7:])


def _tensors(raw: Any, chunk_size: int, bad: Any) -> tuple[list[TensorSpec], dict[str, int]]:
    """Checked tensor specs, and the size of every chunk hash they name."""
    if not isinstance(raw, list):
        raise bad("tensors is not a list")
    out: list[TensorSpec] = []
    names: set[str] = set()
    sizes: dict[str, int] = {}
    total = 0
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or set(t) != {"chunks", "dtype", "name", "shape"}:
            raise bad(f"tensor #{i} is not {{chunks, dtype, name, shape}}")
        name, dtype, shape, chunks = t["name"], t["dtype"], t["shape"], t["chunks"]
        problem = name_problem(name)
        if problem is not None:
            raise bad(f"tensor #{i} name {str(name)[:100]!r}: {problem}")
        if name in names:
            raise bad(f"tensor {name[:100]!r} is listed twice")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise bad(f"tensor {name[:100]!r} has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(_int(d, 0, 1 << 48) for d in shape) \
                or not shape_fits(shape, ITEMSIZE[dtype]):
            raise bad(f"tensor {name[:100]!r} has an impossible shape {str(shape)[:80]}")
        nbytes = nbytes_of(dtype, shape)
        total += nbytes
        if total > MAX_NBYTES:
            raise bad(f"the tensors add up to more than {MAX_NBYTES} bytes")
        step, count = spans(nbytes, tuple(shape), chunk_size)
        if not isinstance(chunks, list) or len(chunks) != count:
            raise bad(f"tensor {name[:100]!r} ({nbytes} bytes) must have {count} chunks of chunk_size {chunk_size}, "
                      f"it lists {len(chunks) if isinstance(chunks, list) else 'none'}")
        for k, c in enumerate(chunks):
            want = min(step, nbytes - k * step)
            if not isinstance(c, list) or len(c) != 2 or not is_hex64(c[0]) or not _int(c[1], want, want):
                raise bad(f"tensor {name[:100]!r} chunk {k} is not [64-hex hash, {want}]")
            if sizes.setdefault(c[0], want) != want:
                raise bad(f"chunk {c[0][:16]}… is listed with two sizes")
        out.append(TensorSpec(name, dtype, tuple(shape), nbytes, tuple((h, s) for h, s in chunks)))
    return out, sizes


def _blobs(raw: Any, chunk_size: int, sizes: dict[str, int], bad: Any) -> tuple[dict[str, Blob], int]:
    """Checked blobs: laid out back to back from offset 0, each a chunk the target needs, none twice."""
    if not isinstance(raw, list):
        raise bad("blobs is not a list")
    out: dict[str, Blob] = {}
    offset = 0
    for i, b in enumerate(raw):
        if not isinstance(b, list) or len(b) != 5:
            raise bad(f"blob #{i} is not [hash, offset, length, size, codec]")
        h, off, length, size, codec = b
        if not is_hex64(h) or h in out:
            raise bad(f"blob #{i} hash {str(h)[:70]!r} is not 64 hex digits, or is listed twice")
        if sizes.get(h) is None:
            raise bad(f"blob {h[:16]}… is not a chunk of any target tensor")
        if not _int(size, 1, chunk_size) or size != sizes[h] or codec not in CODECS or not _int(length, 1, size) \
                or (codec == "none") != (length == size):
            raise bad(f"blob {h[:16]}… has impossible sizes (stored {str(length)[:20]}, raw {str(size)[:20]}, "
                      f"codec {str(codec)[:10]!r}; the chunk is {sizes[h]} bytes)")
        if not _int(off, offset, offset):
            raise bad(f"blob {h[:16]}… is at offset {str(off)[:20]}, expected {offset} (blobs lie back to back)")
        out[h] = Blob(h, off, length, size, codec)
        offset += length
    return out, offset
