"""Pack files: many blobs plus a trailer index (docs/format.md §6)."""

from __future__ import annotations

import json
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import blake3

from .canonical import canonical
from .limits import MAX_OFFSET, MAX_TRAILER_BYTES
from .names import is_hex64

# How a blob is stored (§6): raw, one zstd frame, or the float codec of §6.1 (format_version 5).
CODECS = ("none", "zstd", "bytegroup")
# The codecs an older luopan cannot decode: a manifest (or repository config) that uses one says format_version 5.
ENGINE2_CODECS = frozenset({"bytegroup"})

MAGIC = b"LUOPANPK"
TRAILER_MAGIC = b"LPIX"
PACK_VERSION = 1
HEADER = MAGIC + struct.pack("<II", PACK_VERSION, 0)
HEADER_SIZE = len(HEADER)  # 16
FOOTER_SIZE = 12  # u64 trailer length + magic


@dataclass(frozen=True)
class BlobLocation:
    """Where a chunk lives: pack id, offset and stored length in the pack, raw size, codec."""

    pack: str
    offset: int
    length: int
    size: int
    codec: str


@dataclass
class PackBuilder:
    """Collects blobs (zero-copy references) until the pack is big enough, then lays out the file."""

    parts: list[memoryview] = field(default_factory=list)
    blobs: list[dict[str, Any]] = field(default_factory=list)
    offset: int = HEADER_SIZE
    pack_id: str | None = None  # set by finish()

    def add(self, chunk_hash: str, stored: memoryview, size: int, codec: str) -> int:
        """Append a blob; returns its offset in the pack."""
        off = self.offset
        self.parts.append(stored)
        self.blobs.append({"codec": codec, "hash": chunk_hash, "length": len(stored), "offset": off, "size": size})
        self.offset += len(stored)
        return off

    @property
    def nbytes(self) -> int:
        return self.offset

    def finish(self) -> tuple[str, list[memoryview], int]:
        """(pack id, the file's parts in order, total file size)."""
        # The nonce makes every pack id unique to the save that wrote it, even for identical chunks: a writer may
        # then delete its own packs after a failed save without ever touching a pack another writer committed.
        trailer = canonical({"blobs": self.blobs, "nonce": secrets.token_hex(16), "version": PACK_VERSION})
        pack_id = self.pack_id = blake3.blake3(trailer).hexdigest()
        footer = struct.pack("<Q", len(trailer)) + TRAILER_MAGIC
        parts = [memoryview(HEADER), *self.parts, memoryview(trailer), memoryview(footer)]
        return pack_id, parts, self.offset + len(trailer) + len(footer)


class PackFormatError(ValueError):
    """A pack's header, footer or trailer is damaged."""


def parse_trailer(head: bytes, tail: bytes, file_size: int) -> tuple[str, list[dict[str, Any]]]:
    """Parse a pack's trailer given its first 16 bytes and its last bytes (which must contain the trailer).

    Returns (pack id computed from the trailer, blob records, each checked: hash, offset/length inside the file,
    size, codec). Raises PackFormatError on damage.
    """
    if len(head) < HEADER_SIZE or head[:8] != MAGIC:
        raise PackFormatError("bad pack header magic")
    (version,) = struct.unpack("<I", head[8:12])
    if version > PACK_VERSION:
        raise PackFormatError(f"pack format version {version} is newer than supported ({PACK_VERSION})")
    if len(tail) < FOOTER_SIZE or tail[-4:] != TRAILER_MAGIC:
        raise PackFormatError("bad pack footer (truncated?)")
    (tlen,) = struct.unpack("<Q", tail[-12:-4])
    if tlen > MAX_TRAILER_BYTES or tlen + FOOTER_SIZE + HEADER_SIZE > file_size or tlen + FOOTER_SIZE > len(tail):
        raise PackFormatError("pack trailer length out of range")
    trailer = tail[len(tail) - FOOTER_SIZE - tlen : len(tail) - FOOTER_SIZE]
    end = file_size - FOOTER_SIZE - tlen  # where the blobs must end
    try:
        obj = json.loads(trailer)
        blobs = obj["blobs"]
        if not isinstance(blobs, list):
            raise TypeError
        for b in blobs:
            if not (is_hex64(b["hash"]) and b["codec"] in CODECS and all(
                    isinstance(b[k], int) and not isinstance(b[k], bool) for k in ("offset", "length", "size"))
                    and HEADER_SIZE <= b["offset"] and 0 < b["length"] and b["offset"] + b["length"] <= end
                    and 0 < b["size"] <= MAX_OFFSET and (b["codec"] != "none" or b["length"] == b["size"])):
                raise ValueError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise PackFormatError("pack trailer is not a valid index") from None
    return blake3.blake3(trailer).hexdigest(), blobs
