"""The saver's journal records and snapshot (docs/format.md §18): a 1-byte format version, then one msgpack
array. Only plain msgpack types are used (no ext types), so decoding a record runs no code from the data.

Channel values and write values are content-addressed objects, named by the first 16 bytes of
BLAKE3(type tag, 0x00, serialized bytes). A record carries only the objects the journal does not hold yet. A list value
whose elements serialize to at least `SPLIT_MIN_BYTES` is stored element by element: its reference is
``[[block keys...], [tail keys...]]``, where each full block names `BLOCK` consecutive element keys and is itself an
object (type `BLOCK_TYPE`, data = the keys concatenated). A growing message list therefore costs, per step, its new
elements, the tail (< `BLOCK` keys) and the short list of block keys, never the whole list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import ormsgpack
from blake3 import blake3

from ..errors import IntegrityError, UnsupportedFormatError

FORMAT = 1
VERSION_BYTE = bytes([FORMAT])
SNAPSHOT_MAGIC = "luopan-langgraph"
KEY_BYTES = 16
BLOCK = 64
BLOCK_TYPE = "luopan.block"
SPLIT_MIN_BYTES = 1024

# op codes (first element of a record's array)
PUT, WRITES, DELETE_THREADS, DROP, COPY_THREAD, BLOBS = 1, 2, 3, 4, 5, 6

Typed = tuple[str, bytes]
Obj = list  # [key, type, data] as stored in a record


def object_key(type_: str, data: bytes) -> bytes:
    """The 16-byte content key of one serialized object."""
    return blake3(type_.encode() + b"\x00" + data).digest(length=KEY_BYTES)


def check_object(key: bytes, type_: str, data: bytes) -> None:
    if object_key(type_, data) != key:
        raise IntegrityError(f"langgraph journal object {key.hex()} does not match its BLAKE3 key (damaged data)")


def encode(record: list) -> bytes:
    return VERSION_BYTE + ormsgpack.packb(record)


def decode(raw: bytes | bytearray | memoryview) -> list:
    raw = bytes(raw)
    if not raw or raw[0] != FORMAT:
        raise UnsupportedFormatError(
            f"not a luopan langgraph record (format byte {raw[:1].hex() or 'missing'}, expected {FORMAT:02x})")
    try:
        out = ormsgpack.unpackb(raw[1:])
    except (ormsgpack.MsgpackDecodeError, ValueError, TypeError) as exc:
        raise IntegrityError(f"undecodable langgraph journal record: {exc}") from None
    if not isinstance(out, list) or not out:
        raise IntegrityError("langgraph journal record is not a non-empty array")
    return out


class ValueEncoder:
    """Turns values into references, collecting the objects the store does not have yet.

    `have(key)` says whether the store already holds an object; `dumps(value)` is the serializer's `dumps_typed`.
    """

    def __init__(self, dumps: Callable[[Any], Typed], have: Callable[[bytes], bool]) -> None:
        self.dumps = dumps
        self.have = have
        self.new: list[Obj] = []
        self._pending: set[bytes] = set()

    def _add(self, type_: str, data: bytes) -> bytes:
        key = object_key(type_, data)
        if key not in self._pending and not self.have(key):
            self._pending.add(key)
            self.new.append([key, type_, data])
        return key

    def ref(self, value: Any) -> Any:
        """The reference of one value: a key (bytes) or a split list ``[[blocks], [tail]]``."""
        if type(value) is list and value:
            parts = [self.dumps(v) for v in value]
            if sum(len(d) for _t, d in parts) >= SPLIT_MIN_BYTES and all(t != "bytearray" for t, _d in parts):
                keys = [self._add(t, bytes(d)) for t, d in parts]
                full = len(keys) - len(keys) % BLOCK
                blocks = [self._add(BLOCK_TYPE, b"".join(keys[i:i + BLOCK])) for i in range(0, full, BLOCK)]
                return [blocks, keys[full:]]
        type_, data = self.dumps(value)
        return self._add(type_, bytes(data))


def ref_keys(ref: Any, block_data: Callable[[bytes], bytes]) -> Iterable[bytes]:
    """Every object key a reference needs (blocks and their elements included)."""
    if ref is None:
        return
    if isinstance(ref, bytes):
        yield ref
        return
    blocks, tail = ref
    for b in blocks:
        yield b
        yield from split_keys(block_data(b))
    yield from tail


def split_keys(data: bytes) -> list[bytes]:
    if len(data) % KEY_BYTES:
        raise IntegrityError("langgraph journal block object has a truncated key list")
    return [data[i:i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def element_keys(ref: list, block_data: Callable[[bytes], bytes]) -> list[bytes]:
    blocks, tail = ref
    out: list[bytes] = []
    for b in blocks:
        out.extend(split_keys(block_data(b)))
    out.extend(tail)
    return out


def _msgpack_array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def join_list(parts: list[Typed], loads: Callable[[Typed], Any]) -> list:
    """Rebuild a split list exactly as the serializer would have returned the whole list.

    When every element is a msgpack payload (LangGraph's serializer), the elements are spliced into one msgpack
    array and decoded in one call: byte for byte what serializing the whole list gives. Otherwise each element is
    decoded alone.
    """
    if parts and all(t == "msgpack" for t, _d in parts):
        out = loads(("msgpack", _msgpack_array_header(len(parts)) + b"".join(d for _t, d in parts)))
        if isinstance(out, list) and len(out) == len(parts):
            return out
    return [loads(p) for p in parts]
