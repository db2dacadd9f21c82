"""The patch file's byte layout (docs/format.md §13.1): a fixed prefix, the header, its signature, then the body of
blobs. Reading checks the prefix against the limits and the file's real size before a header byte is read."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptPatchError, SignatureError, UnsupportedFormatError
from ..format.canonical import SealError, canonical, parse_object
from .files import open_regular, read_exact

MAGIC = b"LUOPANPT"
CONTAINER_VERSION = 1
PREFIX = struct.Struct("<8sIIII")  # magic, container version, header length, signature length, reserved (zero)
# ~80 bytes per chunk listed, ~100 more per chunk carried: 45k carried chunks (180 GB at 4 MiB chunks) or 100k
# unchanged ones fit. Parsed JSON costs up to ~25x its bytes (a hostile header of empty lists), so ~200 MiB at most
# before the header's checks reject it (docs/format.md §13.4).
MAX_HEADER_BYTES = 8 << 20
MAX_SIGNATURE_BYTES = 4096


@dataclass
class PatchFile:
    """An open patch: its checked prefix, the header bytes (unparsed: the signature is checked first) and the
    signature document. ``body_start`` is where blob offsets count from."""

    path: str
    fd: int
    size: int
    header_bytes: bytes
    signature: dict[str, Any] | None
    body_start: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PatchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_patch(path: str | os.PathLike[str]) -> PatchFile:
    """Open a patch and read its prefix, header and signature (each bounded). CorruptPatchError when it is not a
    patch or is truncated; UnsupportedFormatError for a newer container version; OSError when it cannot be read."""
    where = os.fspath(path)
    fd = open_regular(where, CorruptPatchError)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, PREFIX.size, 0)
        if len(prefix) < PREFIX.size or prefix[:8] != MAGIC:
            raise CorruptPatchError(f"{where} is not a luopan patch (no {MAGIC.decode()} magic at its start)")
        _magic, version, hlen, slen, reserved = PREFIX.unpack(prefix)
        if version > CONTAINER_VERSION:
            raise UnsupportedFormatError(f"{where} is a patch of container version {version}; this luopan reads "
                                         f"version {CONTAINER_VERSION}: upgrade luopan")
        if version != CONTAINER_VERSION or reserved != 0:
            raise CorruptPatchError(f"{where}: damaged patch prefix (version {version}, reserved {reserved})")
        if not 0 < hlen <= MAX_HEADER_BYTES or slen > MAX_SIGNATURE_BYTES:
            raise CorruptPatchError(f"{where}: header of {hlen} bytes or signature of {slen} bytes is over the limit "
                                    f"({MAX_HEADER_BYTES} / {MAX_SIGNATURE_BYTES} bytes); refused before reading")
        body_start = PREFIX.size + hlen + slen
        if body_start > size:
            raise CorruptPatchError(f"{where} is truncated: {size} bytes, its header and signature end at "
                                    f"{body_start}")
        buf = bytearray(hlen + slen)
        if read_exact(fd, memoryview(buf), PREFIX.size) != len(buf):
            raise CorruptPatchError(f"{where}: the patch file changed while it was read (it is shorter than its "
                                    "header and signature); nothing was written")
        header, sig = bytes(buf[:hlen]), bytes(buf[hlen:])
        return PatchFile(where, fd, size, header, parse_signature(sig, where) if slen else None, body_start)
    except BaseException:
        os.close(fd)
        raise


def parse_signature(data: bytes, where: str) -> dict[str, Any]:
    """The signature document ``{"alg", "key_id", "sig"}`` (checked by luopan.signing when trust is asked for)."""
    try:
        doc = parse_object(data)
    except SealError as exc:
        raise SignatureError(f"{where}: its signature is not readable ({exc})") from None
    if set(doc) != {"alg", "key_id", "sig"} or not all(isinstance(v, str) for v in doc.values()):
        raise SignatureError(f"{where}: its signature is not {{alg, key_id, sig}}")
    return doc


def prefix_bytes(header: bytes, signature: bytes) -> bytes:
    return PREFIX.pack(MAGIC, CONTAINER_VERSION, len(header), len(signature), 0)


def signature_bytes(signature: dict[str, Any] | None) -> bytes:
    return b"" if signature is None else canonical(signature)
