"""Canonical JSON and sealed JSON (docs/format.md §4)."""

from __future__ import annotations

import json
from typing import Any

import blake3
import zstandard

from ..errors import CorruptRepoError
from . import refuse_newer

CHECKSUM_FIELD = "checksum"


class SealError(ValueError):
    """A sealed JSON document is unparsable or its checksum does not match."""


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def seal(obj: dict[str, Any]) -> bytes:
    """Canonical JSON of ``obj`` with a ``checksum`` member over the rest."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    encoded = canonical(body)
    head = b'{"' + CHECKSUM_FIELD.encode() + b'":"blake3:' + digest(encoded).encode() + b'"'
    if body and min(body) > CHECKSUM_FIELD:  # "checksum" sorts first: splice it in instead of encoding twice
        return head + b"," + encoded[1:]
    return canonical({**body, CHECKSUM_FIELD: "blake3:" + digest(encoded)})


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _v in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup[:100]!r}")
    return obj


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_INFLATED = 1 << 30  # what a compressed JSON file may inflate to (the manifest and index file limit, §11)


def compress_json(data: bytes) -> bytes:
    """A zstd frame of sealed JSON (checkpoint manifests and index files, format_version 5: docs/format.md §4)."""
    return zstandard.ZstdCompressor(level=9).compress(data)


def inflate_json(data: bytes, limit: int = MAX_INFLATED) -> bytes:
    """The JSON text of a checkpoint manifest or index file, which may be a zstd frame of it (§4); other bytes are
    returned as they are. SealError on a damaged frame, one without its size in the header (writers always put it
    there), or one that would inflate past ``limit`` (the file kind's own limit, §11: checked before anything that
    large exists)."""
    if not data.startswith(ZSTD_MAGIC):
        return data
    try:
        size = zstandard.frame_content_size(data)
        if not 0 <= size <= limit:
            raise SealError(f"compressed JSON does not say its size, or says more than {limit} bytes ({size})")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise SealError(f"not a valid zstd frame of JSON ({str(exc)[:200]})") from None
    if len(out) != size:
        raise SealError(f"compressed JSON inflated to {len(out)} bytes, not the {size} its frame says")
    return out


def parse_object(data: bytes) -> dict[str, Any]:
    """Parse a JSON object; SealError when the bytes are not one. A key given twice in one object is refused:
    parsers disagree on which value wins, so such a file could mean different things to different readers."""
    try:
        obj = json.loads(data, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SealError(f"not valid JSON ({str(exc)[:200]})") from None
    except RecursionError:
        raise SealError("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise SealError("not a JSON object")
    return obj


def verify_seal(obj: dict[str, Any]) -> dict[str, Any]:
    """Check and drop the ``checksum`` member of a parsed sealed object. Raises SealError on any damage."""
    recorded = obj.pop(CHECKSUM_FIELD, None)
    if not isinstance(recorded, str):
        raise SealError("no checksum member")
    try:
        actual = "blake3:" + digest(canonical(obj))
    except (ValueError, RecursionError) as exc:  # e.g. NaN tokens, which canonical JSON never contains
        raise SealError(f"not canonical JSON ({exc!r})") from None
    if actual != recorded:
        raise SealError(f"checksum mismatch (recorded {recorded}, computed {actual})")
    return obj


def unseal(data: bytes) -> dict[str, Any]:
    """Parse sealed JSON, verify and drop its checksum. Raises SealError on any damage."""
    return verify_seal(parse_object(data))


def unseal_file(data: bytes, where: str) -> dict[str, Any]:
    """A sealed file's members: UnsupportedFormatError when it declares a newer format_version (checked first: a
    newer version may seal differently), CorruptRepoError naming ``where`` on any damage."""
    try:
        obj = parse_object(data)
        refuse_newer(obj, where)
        return verify_seal(obj)
    except SealError as exc:
        raise CorruptRepoError(f"{where} is damaged: {exc}") from None


_CHECKSUM_PREFIX = b'{"' + CHECKSUM_FIELD.encode() + b'":"'


def sealed_checksum(data: bytes) -> str:
    """The checksum recorded in sealed bytes (for refs that pin a manifest); unverified. Reads it from the front
    when `seal` put it there (the usual case) instead of parsing a possibly large document again."""
    try:
        data = inflate_json(data)
    except SealError:
        return ""
    if data.startswith(_CHECKSUM_PREFIX):
        end = data.find(b'"', len(_CHECKSUM_PREFIX))
        if end > 0:
            return data[len(_CHECKSUM_PREFIX) : end].decode("ascii", "replace")
    try:
        return str(parse_object(data).get(CHECKSUM_FIELD, ""))
    except SealError:
        return ""


def json_culprit(value: Any, path: str, depth: int = 0) -> str | None:
    """Where in ``value`` the first value canonical JSON refuses lies, e.g. ``metadata['a'][2]`` (None if unknown)."""
    if depth > 200:
        return f"{path} (nested too deeply)"
    if isinstance(value, dict):
        for k, v in value.items():
            try:
                canonical({k: None})
            except (TypeError, ValueError):
                return f"the key {k!r} in {path}"
            found = json_culprit(v, f"{path}[{k!r}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = json_culprit(v, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    try:
        canonical(value)
    except (TypeError, ValueError):
        return f"at {path}"
    return None
