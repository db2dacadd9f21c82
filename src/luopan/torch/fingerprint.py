"""Content fingerprints of models and state trees: a hash over every tensor's bytes, not only names and shapes (the
check a patch or an adapter makes that it meets the base it was made for)."""

from __future__ import annotations

import weakref
from typing import Any

import blake3

from ..format.canonical import canonical
from ..tree import flatten

# tensor identity -> (weak reference to its storage, version, digest): a frozen base is hashed once per process
_cache: dict[tuple[Any, ...], tuple[Any, int, str]] = {}


def fingerprint(model_or_state: Any) -> str:
    """``"blake3:<hex>"`` over every tensor's key path, dtype, shape and bytes (in key-path order) of a module's
    ``state_dict()`` or of a state tree. Tensors are hashed once and cached while their storage lives and their
    version counter does not move, so fingerprinting a frozen base again is cheap; an in-place change through
    ordinary ops is seen (writes that bypass the counter — ``t.data[...] = …``, fused optimizers — are not: call
    ``fingerprint.cache_clear()`` after those)."""
    state = model_or_state.state_dict() if hasattr(model_or_state, "state_dict") and \
        callable(model_or_state.state_dict) else model_or_state
    _skeleton, leaves = flatten(state)
    rows = []
    for leaf in sorted(leaves, key=lambda lf: lf.path):
        rows.append([leaf.path, leaf.kind, leaf.dtype, list(leaf.shape), _digest(leaf)])
    return "blake3:" + blake3.blake3(canonical(rows)).hexdigest()


def cache_clear() -> None:
    """Forget every cached tensor digest."""
    _cache.clear()


fingerprint.cache_clear = cache_clear  # type: ignore[attr-defined]


def remember(t: Any, digest: str) -> None:
    """Record ``digest`` (BLAKE3 hex of its bytes) as the digest of tensor ``t`` as it is now: for a writer that
    knows what it wrote (luopan.sync hashes a staged copy before writing it in place), so the next fingerprint does
    not hash the tensor again. Any later in-place change moves the version counter and is hashed anew."""
    if not t.is_inference() and t.numel():
        _store(_key(t), t, digest)


def _key(t: Any) -> tuple[Any, ...]:
    """What identifies a tensor's bytes in the cache (with its storage and version counter)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device),
            t.is_conj(), t.is_neg())


def _store(key: tuple[Any, ...], t: Any, digest: str) -> None:
    if len(_cache) > 100_000:  # drop the digests of storages that are gone
        for k in [k for k, (ref, _v, _d) in _cache.items() if ref() is None]:
            del _cache[k]
    try:
        _cache[key] = (weakref.ref(t.untyped_storage()), t._version, digest)
    except TypeError:
        pass


def _digest(leaf: Any) -> str:
    t = leaf.obj
    key = None
    if leaf.kind == "torch" and not t.is_inference() and leaf.nbytes:
        key = _key(t)
        hit = _cache.get(key)
        if hit is not None and hit[0]() is t.untyped_storage() and hit[1] == t._version:
            return hit[2]
    digest = blake3.blake3(leaf.host_bytes()).hexdigest()
    if key is not None:
        _store(key, t, digest)
    return digest
