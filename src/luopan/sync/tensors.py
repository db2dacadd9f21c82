"""Live tensors for live sync: the publisher's record of what it published (to find changed elements with torch ops
on bit views), and the subscriber's staging (decode, stage and fingerprint an update before one element of the live
tensors changes; then write only the changed elements, in place).

Fingerprints are luopan.torch.fingerprint's (docs/format.md §19.3): the same value ``luopan.torch.fingerprint(model)``
gives, computed here from per-tensor digests — unchanged tensors' digests come from its cache, changed ones are hashed
from a staging copy — and handed back to that cache after a write, so the next update's base check hashes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import torch

from ..errors import LayoutMismatchError, UsageError
from ..format.canonical import canonical
from ..torch.fingerprint import _digest as cached_digest
from ..torch.fingerprint import remember
from ..tree import Leaf, flatten
from .delta import DTYPE_SIZES, ELEMENT_DTYPES

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_THREADS = 1 << 22  # hash buffers from 4 MiB on every core
_PARALLEL = 1 << 20


def state_of(model_or_state: Any) -> Any:
    sd = getattr(model_or_state, "state_dict", None)
    return sd() if callable(sd) else model_or_state


def leaves_of(model_or_state: Any, what: str = "the model") -> list[Leaf]:
    """The tensor leaves of a module's state_dict or of a state tree, in key-path order; UsageError for a leaf that
    is not a torch tensor of a dtype live sync carries."""
    _skeleton, leaves = flatten(state_of(model_or_state))
    bad = [lf.path for lf in leaves if lf.kind != "torch" or lf.dtype not in DTYPE_SIZES]
    if bad:
        raise UsageError(f"live sync carries torch tensors of dtypes {sorted(DTYPE_SIZES)}; {what} has other "
                         f"leaves at {bad[:5]}: sync a state dict of such tensors only")
    return sorted(leaves, key=lambda lf: lf.path)


def digest(buf: Any, parallel: bool = False) -> str:
    """BLAKE3 hex of a buffer; from 4 MiB (1 MiB with ``parallel``: nothing else runs meanwhile) on every core."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    if view.nbytes >= (_PARALLEL if parallel else _THREADS):
        return blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3.blake3(view).hexdigest()


def fingerprint_of(rows: list[tuple[str, str, tuple[int, ...], str]]) -> str:
    """luopan.torch.fingerprint's value from (path, dtype, shape, digest) of every torch tensor."""
    doc = [[p, "torch", d, list(s), h] for p, d, s, h in sorted(rows)]
    return "blake3:" + blake3.blake3(canonical(doc)).hexdigest()


def bits_of(t: torch.Tensor) -> np.ndarray:
    """The bits of a tensor as a flat NumPy integer array (uint8, int16, int32, int64 by element size): a view of a
    contiguous CPU tensor's memory, else a CPU copy. Equal bits, equal integers; NumPy's indexing and comparisons are
    single-threaded and fast, where torch's contend for the cores with the training or serving process."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat = t.reshape(-1)
    if not flat.numel():
        return np.zeros(0, np.uint8)
    return flat.view(BITS[flat.element_size()]).numpy()


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------------- publisher

@dataclass
class Record:
    """What the publisher last published of one tensor: a private copy of its bits, and per element the version it
    last changed in (element dtypes) or the version the whole tensor last changed in (other dtypes)."""

    dtype: str
    shape: tuple[int, ...]
    last: np.ndarray  # flat bits
    stamp: np.ndarray | None  # int32 per element, for element dtypes
    changed: int  # version of the tensor's last change
    digest: str


@dataclass
class Changes:
    """The elements of one tensor that changed in one version: ascending flat indices, their bits then, and how
    many of them have changed again since."""

    idx: np.ndarray
    vals: np.ndarray
    dead: int = 0


@dataclass
class Published:
    """The publisher's view: a record per tensor; per version still in the delta window, the elements that changed
    in it (``log``) and its delta layer as last encoded (``frames``, with the elements it then carried). A layer is
    encoded once, when its version is published, and again only when more than half of what it carries has changed
    since (so a catch-up reads at most twice the union of the changes it missed; re-encoding at every publish would
    cost as much as encoding the new layer again)."""

    records: dict[str, Record] = field(default_factory=dict)
    log: dict[int, dict[str, Changes]] = field(default_factory=dict)
    frames: dict[int, tuple[Any, int]] = field(default_factory=dict)
    stale: list[Record] = field(default_factory=list)  # changed by ``update``, not yet digested
    _mask: np.ndarray = field(default_factory=lambda: np.empty(0, np.bool_))
    REENCODE = 0.5  # re-encode a layer once half of what it carries changed again

    def fingerprint(self) -> str:
        return fingerprint_of([(p, r.dtype, r.shape, r.digest) for p, r in self.records.items()])

    def reset(self, leaves: list[Leaf], version: int) -> None:
        self.records, self.log, self.frames, self.stale = {}, {}, {}, []
        for lf in leaves:
            last = bits_of(lf.obj).copy()
            stamp = np.full(last.shape, version, np.int32) if lf.dtype in ELEMENT_DTYPES else None
            self.records[lf.path] = Record(lf.dtype, lf.shape, last, stamp, version, digest(last))

    def update(self, leaves: list[Leaf], version: int) -> int:
        """Take the new values of ``leaves`` as ``version``; the number of elements whose bits changed. The elements
        that changed are struck from the change lists of the older versions they were in; the changed tensors'
        digests are left to ``rehash`` (run while the new files are written). One thread: the comparisons are many
        short NumPy calls, which on several threads mostly wait for the GIL and share the memory bandwidth."""
        self.log[version] = {}
        self.stale = []
        window = [u for u in self.log if u != version]
        return sum(self._take(lf, version, window) for lf in leaves)

    def rehash(self) -> str:
        """Digest the tensors ``update`` changed; the fingerprint of the published state."""
        for r in self.stale:
            r.digest = digest(r.last, parallel=True)
        self.stale = []
        return self.fingerprint()

    def _take(self, lf: Leaf, version: int, window: list[int]) -> int:
        r = self.records[lf.path]
        cur = bits_of(lf.obj)
        if self._mask.size < cur.size:  # one comparison buffer, reused: no fresh pages to fault in per publish
            self._mask = np.empty(cur.size, np.bool_)
        mask = self._mask[:cur.size]
        np.not_equal(cur, r.last, out=mask)
        idx = np.flatnonzero(mask)
        if not idx.size:
            return 0
        if r.stamp is not None:
            vals = cur[idx]
            if window:  # count, per older version, its elements that changed again (a bincount, no search)
                lo = min(window)
                rel = r.stamp[idx] - lo
                counts = np.bincount(rel[rel >= 0], minlength=version - lo)
                for u in window:
                    e = self.log[u].get(lf.path)
                    if e is not None and counts[u - lo]:
                        e.dead += int(counts[u - lo])
            r.last[idx] = vals
            r.stamp[idx] = version
            self.log[version][lf.path] = Changes(idx, vals)
        else:
            r.last[:] = cur
        r.changed = version
        self.stale.append(r)
        return int(idx.size)

    def forget(self, oldest: int) -> None:
        """Drop what is kept of versions at or before ``oldest``: no layer will be written for them."""
        for v in [v for v in self.log if v <= oldest]:
            del self.log[v]
        for v in [v for v in self.frames if v <= oldest]:
            del self.frames[v]

    def carried(self, version: int) -> int:
        """The elements the layer of ``version`` would carry now."""
        return sum(e.idx.size - e.dead for e in self.log.get(version, {}).values())

    def layer(self, version: int, encode: Any) -> Any:
        """The encoded layer of ``version`` (``encode`` of ``layer_parts``): the cached one, unless more than half of
        the elements it carries changed again since."""
        cached = self.frames.get(version)
        now = self.carried(version)
        if cached is None or now < self.REENCODE * cached[1]:
            cached = self.frames[version] = (encode(self.layer_parts(version)), now)
        return cached[0]

    def layer_parts(self, version: int) -> list[tuple[str, str, tuple[int, ...], Any, np.ndarray]]:
        """The parts of the delta layer of ``version`` (luopan.sync.delta.encode_body): the elements that changed in
        ``version`` and not since, with their values — by element for element dtypes (whole, with the current
        values, when that is not larger), whole for other dtypes that last changed then. Only the change lists are
        read, never a whole tensor's stamps."""
        log = self.log.get(version, {})
        out: list[Any] = []
        for path, r in sorted(self.records.items()):
            if r.changed < version:
                continue
            if r.stamp is None:
                if r.changed == version:
                    out.append((path, r.dtype, r.shape, None, r.last.view(np.uint8)))
                continue
            e = log.get(path)
            if e is None:
                continue
            idx, vals = e.idx, e.vals
            if e.dead:  # the elements of its change list whose last change is still this version
                alive = r.stamp[idx] == version
                idx, vals = idx[alive], vals[alive]
            if not idx.size:
                continue
            if idx.size * (ELEMENT_DTYPES[r.dtype] + 1) >= r.last.size * ELEMENT_DTYPES[r.dtype]:
                out.append((path, r.dtype, r.shape, None, r.last.view(np.uint8)))
            else:
                out.append((path, r.dtype, r.shape, idx, vals.view(np.uint8)))
        return out

    def full_parts(self) -> list[tuple[str, str, tuple[int, ...], Any, np.ndarray]]:
        return [(p, r.dtype, r.shape, None, r.last.view(np.uint8)) for p, r in sorted(self.records.items())]


# --------------------------------------------------------------------------------------------------- subscriber

class Stage:
    """An update staged against live tensors: per tensor either element changes (flat indices + values) or a
    whole new tensor (a private CPU copy); nothing live is written until ``write``."""

    def __init__(self, leaves: list[Leaf]) -> None:
        self.leaves = {lf.path: lf for lf in leaves}
        self.whole: dict[str, torch.Tensor] = {}
        self.elements: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def check_layout(self, tensors: Any, full: bool, where: str) -> None:
        names = {t.name for t in tensors}
        if full and names != set(self.leaves):
            missing, extra = sorted(set(self.leaves) - names)[:5], sorted(names - set(self.leaves))[:5]
            raise LayoutMismatchError(f"{where} holds other tensors than the model (missing {missing}, unknown "
                                      f"{extra}): the subscriber's model is not the one published. Nothing changed")
        for t in tensors:
            lf = self.leaves.get(t.name)
            if lf is None or lf.dtype != t.dtype or tuple(lf.shape) != t.shape:
                have = None if lf is None else f"{lf.dtype}{list(lf.shape)}"
                raise LayoutMismatchError(f"{where} has tensor {t.name[:80]!r} as {t.dtype}{list(t.shape)}, the "
                                          f"model has {have}: the subscriber's model is not the one published. "
                                          "Nothing changed")
            if not lf.obj.is_contiguous():
                raise UsageError(f"tensor {t.name[:80]!r} of the model is not contiguous: live sync writes in "
                                 "place into contiguous tensors only")

    def add(self, t: Any, idx: np.ndarray | None, values: memoryview) -> None:
        """Stage one tensor's section (already checked by the parser); sections are staged oldest first, a later one
        written over an earlier one."""
        vals = np.frombuffer(values, BITS_NP[DTYPE_SIZES[t.dtype]]).copy()
        if idx is None:
            self.whole[t.name] = vals
            self.elements.pop(t.name, None)
            return
        base = self.whole.get(t.name)
        if base is not None:  # a delta over a staged full version: change the private copy
            base[idx] = vals
            return
        chunks = self.elements.setdefault(t.name, [])
        chunks.append((idx, vals))
        if sum(i.size for i, _v in chunks) > t.numel:  # more staged than the tensor holds: fold into one copy
            whole = bits_of(self.leaves[t.name].obj).copy()
            for i, v in chunks:
                whole[i] = v
            self.whole[t.name] = whole
            del self.elements[t.name]

    def fingerprint(self, pool: Any = None) -> tuple[str, dict[str, str]]:
        """The fingerprint the live tensors will have after ``write``, and the new digests of the changed ones. A
        changed tensor is hashed from a private copy with its changes applied; tied tensors appear under each of
        their paths, in the delta as in the model. ``pool``: an executor to hash the changed tensors on several
        threads (BLAKE3 and NumPy release the GIL)."""
        def changed(path: str) -> str:
            if path in self.whole:
                return digest(self.whole[path])
            scratch = bits_of(self.leaves[path].obj).copy()
            for idx, vals in self.elements[path]:
                scratch[idx] = vals
            return digest(scratch)

        paths = [p for p in self.leaves if p in self.whole or p in self.elements]
        digests = dict(zip(paths, (pool.map if pool is not None and len(paths) > 1 else map)(changed, paths)))
        rows = [(path, lf.dtype, tuple(lf.shape), digests[path] if path in digests else cached_digest(lf))
                for path, lf in self.leaves.items()]
        self._check_ties({path: h for path, _d, _s, h in rows})
        return fingerprint_of(rows), digests

    def _check_ties(self, digests: dict[str, str]) -> None:
        """Paths that share memory in the live model (tied weights) must come out equal: else writing one would
        change the other, and the live tensors would not be what was checked."""
        groups: dict[tuple[int, int], list[str]] = {}
        for path in digests:
            t = self.leaves[path].obj
            if t.numel():
                groups.setdefault((t.data_ptr(), t.numel() * t.element_size()), []).append(path)
        for paths in groups.values():
            if len({digests[p] for p in paths}) > 1:
                raise LayoutMismatchError(
                    f"the model ties {paths[:4]} (one memory), but the update gives them different values: the "
                    "publisher's model does not tie them. Nothing changed; tie them alike on both sides")

    def write(self, digests: dict[str, str]) -> None:
        """Write the staged values into the live tensors, in place (CPU: through a NumPy view of their memory, then
        their version counters are moved as a torch op would; CUDA: index_put_ / copy_), in the order staged, and
        hand the new digests to the fingerprint cache."""
        with torch.no_grad():
            for path, vals in self.whole.items():
                live = self.leaves[path].obj
                live.view(-1).view(BITS[live.element_size()]).copy_(torch.from_numpy(vals).to(live.device))
            for path, chunks in self.elements.items():
                live = self.leaves[path].obj
                for idx, vals in chunks:  # each chunk's indices are distinct (strictly ascending)
                    if live.device.type == "cpu":
                        bits_of(live)[idx] = vals
                    else:
                        flat = live.view(-1).view(BITS[live.element_size()])
                        flat.index_put_((torch.from_numpy(idx).to(live.device),),
                                        torch.from_numpy(vals).to(live.device))
                if live.device.type == "cpu":
                    torch.autograd.graph.increment_version(live)
        for path in (*self.whole, *self.elements):
            remember(self.leaves[path].obj, digests[path])


BITS_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
