"""Index files: which chunk lives in which pack, for deduplication (docs/format.md §7)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptRepoError
from . import BASE_FORMAT_VERSION
from .canonical import SealError, canonical, compress_json, digest, inflate_json, seal, unseal
from .limits import MAX_INDEX_BYTES, MAX_OFFSET
from .names import is_hex64
from .pack import CODECS, BlobLocation


def build_index(packs: dict[str, list[dict[str, Any]]], compress: bool = False) -> tuple[str, bytes]:
    """(index id, sealed bytes) for {pack id: trailer blob records}; ``compress`` (format_version 5 repositories):
    a zstd frame of them (docs/format.md §4, §7). The id names the content, whichever way it is stored."""
    body = {
        "format_version": BASE_FORMAT_VERSION,
        "packs": {p: [[b["hash"], b["offset"], b["length"], b["size"], b["codec"]] for b in blobs]
                  for p, blobs in packs.items()},
    }
    return digest(canonical(body)), compress_json(seal(body)) if compress else seal(body)


def parse_index(data: bytes, where: str) -> dict[str, BlobLocation]:
    """Chunk hash -> location from an index file, every row checked (pack ids and hashes are hex digests, offsets
    and sizes bounded integers, codecs known). CorruptRepoError on any damage."""
    try:
        doc = unseal(inflate_json(data, MAX_INDEX_BYTES))
        packs = doc["packs"]
        if not isinstance(packs, dict):
            raise TypeError("packs is not an object")
        out = {}
        for pack, rows in packs.items():
            if not is_hex64(pack) or not isinstance(rows, list):
                raise ValueError("a pack id is not a hex digest")
            for row in rows:
                h, off, length, size, codec = row
                if not (is_hex64(h) and codec in CODECS and all(_bounded(v) for v in (off, length, size))
                        and length > 0 and size > 0):
                    raise ValueError("a row is not (hash, offset, length, size, codec)")
                out[h] = BlobLocation(pack, off, length, size, codec)
        return out
    except (SealError, KeyError, TypeError, ValueError) as exc:
        raise CorruptRepoError(f"index file {where} is damaged: {str(exc)[:200]}; it is only used for "
                               "deduplication, delete it to continue (the next saves may store some chunks again)"
                               ) from None


def _bounded(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_OFFSET
