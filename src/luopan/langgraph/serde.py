"""The saver's serializer: LangGraph's `SerializerProtocol`, never pickle.

The default is LangGraph's `JsonPlusSerializer` with `pickle_fallback=False` and a strict msgpack allowlist (only
LangGraph's built-in safe types, LangChain messages among them, plus what `allowed_msgpack_modules` or
`with_allowlist` add): loading never imports an arbitrary module named by the data. Whatever serializer is used, it is
wrapped so that a payload typed ``"pickle"`` is refused on write and on read (`PickledPayloadError`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from langgraph.checkpoint.serde.base import SerializerProtocol, maybe_add_typed_methods
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from ..errors import UnsupportedValueError

PICKLE_TYPES = frozenset({"pickle"})


class PickledPayloadError(UnsupportedValueError):
    """A value serialized with pickle: luopan neither stores nor loads one (a pickle runs code when loaded)."""


def default_serde(allowed_msgpack_modules: Iterable[tuple[str, ...] | type] | None = None) -> JsonPlusSerializer:
    """LangGraph's serializer without pickle and with a strict msgpack allowlist (plus the given types)."""
    return JsonPlusSerializer(pickle_fallback=False,
                              allowed_msgpack_modules=tuple(allowed_msgpack_modules) if allowed_msgpack_modules
                              else None)


class NoPickleSerializer(SerializerProtocol):
    """Wraps a serializer; refuses pickled payloads in both directions."""

    def __init__(self, inner: Any) -> None:
        if isinstance(inner, NoPickleSerializer):
            inner = inner.inner
        self.inner: SerializerProtocol = maybe_add_typed_methods(inner)

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        type_, data = self.inner.dumps_typed(obj)
        if _is_pickle(type_):
            raise PickledPayloadError(
                f"the serializer pickled a {type(obj).__name__} value; luopan never stores pickles "
                "(make the value msgpack-serializable, or use a serializer without pickle_fallback)")
        return type_, data

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        if _is_pickle(data[0]):
            raise PickledPayloadError(f"refusing to load a payload typed {data[0]!r}: luopan never loads pickles")
        return self.inner.loads_typed(data)

    def with_msgpack_allowlist(self, extra: Collection[tuple[str, ...]]) -> NoPickleSerializer:
        inner = self.inner
        if isinstance(inner, JsonPlusSerializer):
            new = inner.with_msgpack_allowlist(extra)
        elif isinstance(inner, EncryptedSerializer) and isinstance(inner.serde, JsonPlusSerializer):
            updated = inner.serde.with_msgpack_allowlist(extra)
            new = inner if updated is inner.serde else EncryptedSerializer(inner.cipher, updated)
        else:
            return self
        return self if new is inner else NoPickleSerializer(new)


def _is_pickle(type_: str) -> bool:
    # an encrypted serializer tags "pickle+aes"; the base type is what was serialized
    return type_.split("+", 1)[0] in PICKLE_TYPES
