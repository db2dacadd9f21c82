"""How a save stores each delta-candidate entry: in full, as a row delta (§5.2) or as an XOR delta (§5.4).

Every delta is against a *base*: the last version of the entry stored in full. A track (rowdelta.RowTrack) carries
what this process knows about the entry since its last save. A process that has not saved the run yet starts from
the run's newest manifest on disk (``disk_tracks``): of that, only the base chunks' BLAKE3 addresses are used, and
they are checked against the bytes — a current chunk whose BLAKE3 equals the base chunk's is the same bytes; any
other chunk is compared with the base chunk read back from the repository (verified on read), row by row. So a row
counts as unchanged only when its bytes are shown equal to the base's, and neither a damaged nor a crafted
repository can make a save skip a row that changed: the base bytes it compares with are the ones the new manifest
lists and a load returns.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import xxhash

from ..tree import Leaf
from ..errors import CorruptManifestError
from .rowdelta import (MAX_BACKOFF, WRITER_SEGMENTS, Decision, DeltaPolicy, RowDigests, RowTrack, Segment,
                       decode_patch, gather, layout, rows_in_spans)

_EMPTY = np.empty(0, dtype=np.int64)
Triple = tuple[str, int, str]  # a chunk: (BLAKE3 hash, raw size, XXH3-128)


class BaseReadError(Exception):
    """A base chunk could not be read back intact; the save is retried without that chunk as a base."""

    def __init__(self, chunk_hash: str, cause: BaseException) -> None:
        super().__init__(f"base chunk {chunk_hash[:16]}… could not be read: {cause}")
        self.chunk_hash = chunk_hash


@dataclass
class PlanContext:
    policy: DeltaPolicy
    base_usable: Callable[[list[Triple]], bool]  # every chunk present, its pack intact
    read_base: Callable[[Triple, int], memoryview]  # verified bytes of a base chunk (thread-local; BaseReadError)
    pool: ThreadPoolExecutor
    compressing: bool  # the repository compresses chunks (XOR deltas only pay then)
    encode: Callable[[memoryview, int, bool], memoryview]  # stored bytes of a piece of an entry (an XOR delta's: True)
    segments: bool = False  # the repository takes patches in segments (format 7, docs/format.md §5.2)
    # bytes [a, b) of a base chunk, for an estimate only (_xor_pays); None: read_base(chunk)[a:b]
    peek_base: Callable[[Triple, int, int], memoryview] | None = None


def chunk_xxh3s(data: memoryview, spans: list[tuple[int, int]]) -> list[str]:
    """XXH3-128 of each chunk ``(offset, length)`` of ``data`` (the change detector the plan compares)."""
    return [xxhash.xxh3_128_hexdigest(data[o : o + n]) for o, n in spans]


def plan_entry(leaf: Leaf, data: memoryview, spans: list[tuple[int, int]], step: int, track: RowTrack | None,
               hint: np.ndarray | None, pc: PlanContext, xs: list[str] | None = None) -> Decision:
    """Decide how to store one delta-candidate entry this save: in full, as base + rows, or as base XOR delta.
    ``xs``: the XXH3-128 of its chunks when the caller computed them already."""
    if xs is None:
        xs = list(pc.pool.map(xxhash.xxh3_128_hexdigest, [data[o : o + n] for o, n in spans]))
    lay = layout(leaf)
    full = RowTrack(lay, tuple(xs), None, step, None, _EMPTY)
    if track is not None:  # XOR backoff survives a rebase
        full = dataclasses.replace(full, xor_skip=max(0, track.xor_skip - 1), xor_backoff=track.xor_backoff)
    if (track is None or track.layout != lay or track.base_chunks is None
            or [b[1] for b in track.base_chunks] != [n for _o, n in spans]):
        return Decision(full, xs)  # nothing to compare with (or a base cut otherwise: a crafted manifest)
    hashes = None
    if track.trusted:
        changed_k = [k for k, (x, old) in enumerate(zip(xs, track.xxh)) if x != old]
    else:  # from disk: only the base's BLAKE3 addresses count
        hashes = list(pc.pool.map(lambda v: blake3.blake3(v).hexdigest(), [data[o : o + n] for o, n in spans]))
        changed_k = [k for k, h in enumerate(hashes) if h != track.base_chunks[k][0]]
    if not changed_k:
        if not track.trusted or track.form == "full":  # the base's bytes: stored plainly, every chunk deduplicates
            return Decision(full, xs, hashes=hashes)
        if not pc.base_usable(track.base_chunks):
            return Decision(full, xs)
        if track.form == "rows":  # same content as the previous save: the same patch
            if track.segments and pc.base_usable(_segment_chunks(track)):
                return Decision(track, xs, kept=track.segments)  # stored again by reference
            # Its rows gathered again (one segment): a kept segment's chunk is gone (gc, damage), or none kept.
            return Decision(dataclasses.replace(track, segments=()), xs,
                            gather(data, track.patch, leaf.nbytes // leaf.shape[0]))
        same = _same_as_base(track, xs, None)
        if same is not None and all(same):
            return Decision(full, xs)
        return Decision(dataclasses.replace(track, xxh=tuple(xs)), xs, xor=True, same=same)

    dense = False
    if pc.policy.eligible(leaf) and track.skip == 0 and track.form != "xor":
        dec = _plan_rows(leaf, data, spans, step, track, hint, pc, xs, changed_k)
        if isinstance(dec, Decision):
            if dec.hashes is None and dec.delta is None:
                dec.hashes = hashes
            return dec
        dense = dec
    skip, backoff = max(0, track.skip - 1), track.backoff
    if dense:
        backoff = min(MAX_BACKOFF, max(1, 2 * track.backoff))
        skip = backoff
    n, c = track.cycle_saves, track.cycle_bytes
    estimate = track.xor_bytes if track.form == "xor" else 0  # the first XOR delta of a cycle is a measurement
    # XOR deltas are for dense changes (most chunks moved); a few changed chunks deduplicate the rest already.
    wide = track.form == "xor" or dense or len(changed_k) * 2 >= len(spans)
    if (wide and pc.policy.xor_eligible(leaf) and pc.compressing and track.xor_skip == 0
            and estimate <= pc.policy.xor_fraction * leaf.nbytes and estimate * n <= c
            and pc.base_usable(track.base_chunks)):
        if not estimate and not _xor_pays(leaf, data, spans, changed_k[len(changed_k) // 2], track.base_chunks, pc):
            # The sample says it would not pay (an optimizer's moments, a replaced head): stored in full, and XOR
            # deltas paused as after one that did not pay, so the sample is not read again at every save.
            pause = min(MAX_BACKOFF, max(1, 2 * track.xor_backoff))
            return Decision(dataclasses.replace(full, skip=skip, backoff=backoff, xor_skip=pause, xor_backoff=pause),
                            xs, hashes=hashes)
        xt = RowTrack(lay, tuple(xs), None, track.base_step, track.base_chunks, _EMPTY, skip, backoff, c, n,
                      "xor", track.xor_bytes, 0, track.xor_backoff, base_checked=track.base_checked)
        same = _same_as_base(track, xs, hashes)
        if same is not None and all(same):  # the base's bytes again: its chunks, no XOR delta to read
            return Decision(dataclasses.replace(full, skip=skip, backoff=backoff), xs, hashes=hashes)
        return Decision(xt, xs, xor=True, same=same)
    return Decision(dataclasses.replace(full, skip=skip, backoff=backoff), xs, hashes=hashes)


SAMPLE_BYTES = 256 << 10  # the slice of one changed chunk that decides whether a cycle's first XOR delta pays


def _xor_pays(leaf: Leaf, data: memoryview, spans: list[tuple[int, int]], k: int, base: list[Triple],
              pc: PlanContext) -> bool:
    """Whether an XOR delta would be worth its CPU time, judged on a slice of chunk ``k``: store at most
    ``xor_fraction`` of the content's size, and less than the content itself would (a replaced tensor, e.g. a
    re-initialised head, or an optimizer's moments XOR into noise; a full fp32 fine-tune's weights into two noise
    bytes of four, ~0.55-0.6 of their size)."""
    off, n = spans[k]
    a = (n - min(n, SAMPLE_BYTES)) // 2 // 8 * 8
    b = a + min(n, SAMPLE_BYTES)
    current = data[off + a : off + b]
    window = pc.peek_base(base[k], a, b) if pc.peek_base is not None else pc.read_base(base[k], k)[a:b]
    delta = len(pc.encode(xor_into(current, window), leaf.itemsize, True))
    return delta <= pc.policy.xor_fraction * len(current) and delta < len(pc.encode(current, leaf.itemsize, False))


def _same_as_base(track: RowTrack, xs: list[str], hashes: list[str] | None) -> list[bool] | None:
    """Which chunks are shown equal to the base's: by BLAKE3, or by XXH3 where both sides are this process's own
    (never by an XXH3 read from disk). None: not known."""
    base = track.base_chunks
    assert base is not None
    if hashes is not None:
        return [h == b[0] for h, b in zip(hashes, base)]
    if track.base_checked:
        return [x == b[2] for x, b in zip(xs, base)]
    return None


def _plan_rows(leaf: Leaf, data: memoryview, spans: list[tuple[int, int]], step: int, track: RowTrack,
               hint: np.ndarray | None, pc: PlanContext, xs: list[str], changed_k: list[int]) -> Decision | bool:
    """A row-delta plan for a changed table, or whether the change was dense (then XOR or full is for the caller)."""
    nrows = leaf.shape[0]
    rb = leaf.nbytes // nrows
    changed = [spans[k] for k in changed_k]
    changed_mask, in_changed = rows_in_spans(changed, rb, nrows)
    digests = track.digests
    xxh_track = tuple(xs)
    if not track.trusted or digests is None:
        # Compare with the base bytes themselves. Rows of unchanged chunks equal the base: a trusted track without
        # digests stored its last save in full (that save is the base); for a track from disk, BLAKE3 showed it.
        if not pc.base_usable(track.base_chunks):
            return Decision(RowTrack(layout(leaf), tuple(xs), None, step, None, _EMPTY), xs)
        touched = differing_rows(data, spans, changed_k, track.base_chunks, rb, nrows, pc)
        patch = touched
        digests = RowDigests.of(data, rb)  # later saves of this process compare with this content
        if pc.segments and not track.trusted and track.segments:
            dec = _after_disk_segments(leaf, data, track, touched, xs, digests, pc)
            if dec is not None:
                return dec
    else:
        touched = None
        if hint is not None:
            touched = hint[changed_mask[hint]]  # rows in unchanged chunks did not change
            if not _covers(changed, touched, rb, nrows):
                touched = None  # a chunk changed without any touched row: the hint is incomplete, look at the rows
            else:
                digests = digests.with_rows(data, rb, touched)
                # Rows of these chunks the hint did not name were not looked at: the next save re-examines them.
                unseen = set(changed_k)
                xxh_track = tuple("" if k in unseen else x for k, x in enumerate(xs))
        if touched is None:
            touched, digests = digests.detect(data, rb, in_changed)
        patch = np.union1d(track.patch, touched)
    if patch.size == 0:  # the content is the base's again: store it plainly (its chunks deduplicate)
        return Decision(RowTrack(layout(leaf), xxh_track, digests, step, None, _EMPTY), xs)
    budget = pc.policy.rebase_fraction * leaf.nbytes
    cost = patch.size * (rb + 8)
    if (pc.segments and track.trusted and track.form == "rows" and track.segments and cost <= budget
            and len(track.segments) < WRITER_SEGMENTS and pc.base_usable(track.base_chunks)):
        # Segments (§5.2): the previous save's patch stays as it was stored (its chunks by reference) and the rows
        # changed since that save follow as one more segment, while a restore's reading stays within the cap.
        new = touched.size * (rb + 8)
        if (track.segment_bytes(rb) + new <= budget and new * track.cycle_saves <= track.cycle_bytes
                and pc.base_usable(_segment_chunks(track))):
            return Decision(RowTrack(layout(leaf), xxh_track, digests, track.base_step, track.base_chunks, patch,
                                     cycle_bytes=track.cycle_bytes + new, cycle_saves=track.cycle_saves + 1,
                                     form="rows", xor_skip=track.xor_skip, xor_backoff=track.xor_backoff,
                                     base_checked=track.base_checked),
                            xs, gather(data, touched, rb) if touched.size else None, kept=track.segments)
    # Rebase when another delta would raise the average bytes per save since the base (the patch is cumulative,
    # so it only grows; for a growing patch this minimises bytes written), or when it passes the cap.
    if cost <= budget and cost * track.cycle_saves <= track.cycle_bytes and pc.base_usable(track.base_chunks):
        return Decision(RowTrack(layout(leaf), xxh_track, digests, track.base_step, track.base_chunks, patch,
                                 cycle_bytes=track.cycle_bytes + cost, cycle_saves=track.cycle_saves + 1,
                                 form="rows", xor_skip=track.xor_skip, xor_backoff=track.xor_backoff,
                                 base_checked=track.base_checked),
                        xs, gather(data, patch, rb))
    if touched.size * (rb + 8) > budget:
        return True  # dense update: pause row detection; the caller may store an XOR delta
    return Decision(RowTrack(layout(leaf), xxh_track, digests, step, None, _EMPTY, xor_skip=track.xor_skip,
                             xor_backoff=track.xor_backoff), xs)  # rebase


def _after_disk_segments(leaf: Leaf, data: memoryview, track: RowTrack, off_base: np.ndarray, xs: list[str],
                         digests: RowDigests, pc: PlanContext) -> Decision | None:
    """A process's first save of a table whose newest manifest on disk kept its patch in segments (§5.2): keep those
    segments and append the rows whose bytes differ from what base + segments give, when the policy allows. The
    segments' chunks are read back and verified (their BLAKE3 is what the new manifest lists), their row numbers
    checked, and every row they name compared with the live bytes; rows off the base (``off_base``, compared with
    the base's bytes) that no segment names are new. So, as in §5.5, nothing read from disk can make a save skip a
    row that changed. None: store one segment instead (the caller's path)."""
    nrows = leaf.shape[0]
    rb = leaf.nbytes // nrows
    budget = pc.policy.rebase_fraction * leaf.nbytes
    chunks = _segment_chunks(track)
    if (len(track.segments) >= WRITER_SEGMENTS or track.segment_bytes(rb) > budget
            or not pc.base_usable(chunks)):
        return None
    kept, index_parts, value_parts = [], [], []
    k = 0
    for n, index, values in track.segments:
        got = []
        for part, out in ((index, index_parts), (values, value_parts)):
            checked = []
            for c in part:
                raw = bytes(pc.read_base(c, k))  # verified against c's BLAKE3 (BaseReadError otherwise)
                k += 1
                out.append(raw)
                checked.append((c[0], c[1], xxhash.xxh3_128_hexdigest(raw)))  # never the XXH3 read from disk
            got.append(tuple(checked))
        kept.append((n, got[0], got[1]))
    entry = {"path": leaf.path, "shape": list(leaf.shape), "nbytes": leaf.nbytes,
             "delta": {"segments": [n for n, _i, _v in track.segments]}}
    try:
        segments, _rb = decode_patch(entry, memoryview(b"".join(index_parts)), memoryview(b"".join(value_parts)),
                                     f"the newest checkpoint of entry {leaf.path!r}")
    except (CorruptManifestError, ValueError):
        return None  # row numbers out of order or sizes that do not fit: one segment, compared with the base
    rows = np.concatenate([i for i, _v in segments])
    vals = np.concatenate([v for _i, v in segments])
    last = rows.size - 1 - np.unique(rows[::-1], return_index=True)[1]  # each named row's last occurrence
    named = rows[last]
    table = np.frombuffer(data, dtype=np.uint8).reshape(nrows, rb)
    moved = named[np.any(table[named] != vals[last], axis=1)]  # differ from what base + segments give
    new = np.union1d(np.setdiff1d(off_base, named, assume_unique=True), moved)
    patch = np.union1d(off_base, named)
    cost = new.size * (rb + 8)
    if (patch.size * (rb + 8) > budget or track.segment_bytes(rb) + cost > budget
            or cost * track.cycle_saves > track.cycle_bytes):
        return None
    return Decision(RowTrack(layout(leaf), tuple(xs), digests, track.base_step, track.base_chunks, patch,
                             cycle_bytes=track.cycle_bytes + cost, cycle_saves=track.cycle_saves + 1, form="rows",
                             xor_skip=track.xor_skip, xor_backoff=track.xor_backoff,
                             base_checked=track.base_checked),
                    xs, gather(data, new, rb) if new.size else None, kept=tuple(kept))


def _segment_chunks(track: RowTrack) -> list[Triple]:
    """Every chunk of a track's stored patch segments."""
    return [c for _n, index, values in track.segments for c in (*index, *values)]


def differing_rows(data: memoryview, spans: list[tuple[int, int]], ks: list[int], base: list[Triple], rb: int,
                   nrows: int, pc: PlanContext) -> np.ndarray:
    """Sorted numbers of the rows, within chunks ``ks``, whose bytes differ from the base chunks (read back and
    verified, one chunk at a time per worker: memory stays at a chunk per core)."""
    def one(k: int) -> np.ndarray:
        off, n = spans[k]
        b = np.frombuffer(pc.read_base(base[k], k), dtype=np.uint8)
        c = np.frombuffer(data[off : off + n], dtype=np.uint8)
        if off % rb == 0 and n % rb == 0:
            w = 8 if rb % 8 == 0 else 1
            diff = (c.view(f"u{w}") != b.view(f"u{w}")).reshape(-1, rb // w).any(axis=1)
            return np.flatnonzero(diff) + off // rb
        pos = np.flatnonzero(c != b)  # a row longer than a chunk (flat chunking): rows from byte positions
        return np.unique((pos + off) // rb)

    parts = list(pc.pool.map(one, ks))
    out = np.concatenate(parts) if parts else _EMPTY
    out = np.unique(out.astype(np.int64, copy=False))
    return out[out < nrows]


def xor_into(data: memoryview, base: memoryview, in_place: bool = False) -> memoryview:
    """``data`` XOR ``base`` (8 bytes at a time where the length allows): a new buffer, or with ``in_place`` written
    over ``base`` (a scratch buffer: no fresh memory to fault in)."""
    w = "u8" if len(data) % 8 == 0 else "u1"
    b = np.frombuffer(base, dtype=w)
    out = np.bitwise_xor(np.frombuffer(data, dtype=w), b, out=b if in_place else None)
    return memoryview(out).cast("B")


_tls = threading.local()


def base_scratch(size: int) -> memoryview:
    """This thread's buffer for reading back a delta base chunk."""
    buf = getattr(_tls, "base", None)
    if buf is None or len(buf) < size:
        buf = _tls.base = bytearray(size)
    return memoryview(buf)[:size]


@functools.lru_cache(maxsize=16)
def zero_chunk(size: int) -> tuple[str, str, memoryview]:
    """(BLAKE3, XXH3-128, bytes) of ``size`` zero bytes: the XOR of a chunk with itself (cached, thread-safe)."""
    zeros = memoryview(bytes(size))
    return blake3.blake3(zeros).hexdigest(), xxhash.xxh3_128_hexdigest(zeros), zeros


def _covers(spans: list[tuple[int, int]], rows: np.ndarray, row_bytes: int, nrows: int) -> bool:
    """Whether every span holds at least one of the sorted ``rows``."""
    for off, length in spans:
        r0, r1 = off // row_bytes, min(nrows, -(-(off + length) // row_bytes))
        if np.searchsorted(rows, r0) == np.searchsorted(rows, r1):
            return False
    return True


def estimated_cycle(e: dict[str, Any]) -> list[int]:
    """The writer's ``cycle`` hint of a delta entry; for one of format_version 4 and older, which has none, the
    base and this one delta."""
    d = e.get("delta") or e.get("xor") or {}
    if "cycle" in d:
        return list(d["cycle"])
    return [sum(r[3] for r in e["chunks"]) + sum(r[3] for part in ("index", "values", "chunks")
                                                  for r in d.get(part, [])), 2]


def _disk_segments(e: dict[str, Any]) -> tuple[Segment, ...]:
    """The segments of a row delta on disk, each with its own chunks — () when a segment does not start on a chunk
    boundary of both the index and the values (then they cannot be kept by reference). Nothing of it is trusted: a
    save reads the chunks back and checks them before it keeps them (``_after_disk_segments``)."""
    d = e["delta"]
    rb = e["nbytes"] // e["shape"][0]
    out = []
    cuts: dict[str, list[int]] = {"index": [], "values": []}
    for part, width in (("index", 8), ("values", rb)):
        pos, bounds = 0, {0: 0}
        for k, r in enumerate(d[part]):
            pos += r[4]
            bounds[pos] = k + 1
        at = 0
        for n in d.get("segments", [d["rows"]]):
            at += n * width
            if at not in bounds:
                return ()
            cuts[part].append(bounds[at])
    start_i = start_v = 0
    for n, ci, cv in zip(d.get("segments", [d["rows"]]), cuts["index"], cuts["values"]):
        out.append((n, tuple((r[0], r[4], r[6]) for r in d["index"][start_i:ci]),
                    tuple((r[0], r[4], r[6]) for r in d["values"][start_v:cv])))
        start_i, start_v = ci, cv
    return tuple(out)


def disk_tracks(doc: dict[str, Any], policy: DeltaPolicy) -> dict[str, RowTrack]:
    """Tracks for a process's first save of a run, from the run's newest manifest: each entry's base chunks (only
    their BLAKE3 addresses are used, and checked against the bytes) and the writer hints of its delta."""
    out: dict[str, RowTrack] = {}
    if not policy.enabled:
        return out
    for e in doc.get("entries", []):
        if "alias_of" in e or "chunks" not in e or e.get("scalar"):
            continue
        base = [(r[0], r[4], r[6]) for r in e["chunks"]]
        lay = (e["kind"], e["dtype"], tuple(e["shape"]))
        d = e.get("delta") or e.get("xor")
        if d is None:
            cost = sum(r[3] for r in e["chunks"])  # stored lengths: what the base cost
            out[e["path"]] = RowTrack(lay, (), None, doc["step"], base, _EMPTY, cycle_bytes=cost, cycle_saves=1,
                                      trusted=False, base_checked=False)
            continue
        cycle = estimated_cycle(e)
        form = "rows" if "delta" in e else "xor"
        xor_bytes = sum({r[0]: r[3] for r in d["chunks"]}.values()) if form == "xor" else 0
        out[e["path"]] = RowTrack(lay, (), None, d["base_step"], base, _EMPTY, cycle_bytes=int(cycle[0]),
                                  cycle_saves=int(cycle[1]), form=form, xor_bytes=xor_bytes, trusted=False,
                                  base_checked=False, segments=_disk_segments(e) if form == "rows" else ())
    return out
