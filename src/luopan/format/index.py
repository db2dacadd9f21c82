"""Index files: which chunk lives in which pack, for deduplication (docs/format.md §7)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptRepoError
from . import BASE_FORMAT_VERSION
from .canonical import SealError, canonical, digest, seal, unseal
from .pack import BlobLocation


def build_index(packs: dict[str, list[dict[str, Any]]]) -> tuple[str, bytes]:
    """(index id, sealed bytes) for {pack id: trailer blob records}."""
    body = {
        "format_version": BASE_FORMAT_VERSION,
        "packs": {p: [[b["hash"], b["offset"], b["length"], b["size"], b["codec"]] for b in blobs]
                  for p, blobs in packs.items()},
    }
    return digest(canonical(body)), seal(body)


def parse_index(data: bytes, where: str) -> dict[str, BlobLocation]:
    try:
        doc = unseal(data)
        out = {}
        for pack, rows in doc["packs"].items():
            for h, off, length, size, codec in rows:
                out[h] = BlobLocation(pack, off, length, size, codec)
        return out
    except (SealError, KeyError, TypeError, ValueError) as exc:
        raise CorruptRepoError(f"index file {where} is damaged: {exc}; it is only used for deduplication, "
                               "delete it to continue (the next saves may store some chunks again)") from None
