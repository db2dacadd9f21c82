"""Inverted lists stored as segments (docs/format.md §17.2): the lists of an IVF index grow by appending, each a
little, so a snapshot stores the lists' contents as of the previous snapshot as the same segments as before (their
chunks reused) plus one new segment holding every list's new tail. The manifest's size then does not grow with
``nlist``.

Entries at an IVF node's prefix ``p``: ``p + "ivf/counts"`` (int64 ``[S, nlist]``: entries of list ``i`` in segment
``k``), and for each segment ``k`` ``p + "ivf/<k>/codes"`` (uint8 ``[m_k, code_size]``) and ``p + "ivf/<k>/ids"``
(int64 ``[m_k]``): the run of every list's slice of that segment, in list order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .extents import Gathered, as_bytes

MAX_SEGMENTS = 16


def plan_segments(sizes: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
    """Counts per segment and list for lists of ``sizes`` entries, given the previous snapshot's counts: its segments
    stay when every list still holds at least what they hold, and the tails form one more segment. Trailing segments
    are merged while the last is at least half the one before (so each entry is rewritten O(log) times) or there
    are more than MAX_SEGMENTS."""
    sizes = sizes.astype(np.int64)
    if previous is None or previous.ndim != 2 or previous.shape[1] != len(sizes) or \
            bool((previous.sum(axis=0) > sizes).any()):
        return sizes[None, :].copy()
    tail = sizes - previous.sum(axis=0)
    counts = previous if not tail.any() else np.vstack([previous, tail[None, :]])
    while len(counts) >= 2 and (2 * counts[-1].sum() >= counts[-2].sum() or len(counts) > MAX_SEGMENTS):
        counts = np.vstack([counts[:-2], counts[-2:].sum(axis=0)[None, :]])
    return counts


def segment_views(lists: Any, counts: np.ndarray) -> list[tuple[Gathered, Gathered, int]]:
    """Per segment: (codes, ids, entries) as Gathered views of the lists' memory (``lists``: faiss_codec.Lists)."""
    cs = lists.code_size
    starts = np.zeros(counts.shape[1], dtype=np.int64)
    out = []
    for row in counts:
        codes, ids = [], []
        for i in np.flatnonzero(row).tolist():
            a, n = int(starts[i]), int(row[i])
            codes.append(as_bytes(lists.codes[i])[a * cs:(a + n) * cs])
            ids.append(as_bytes(lists.ids[i])[a * 8:(a + n) * 8])
        starts += row
        out.append((Gathered(codes), Gathered(ids), int(row.sum())))
    return out


def arrays(lists: Any, counts: np.ndarray) -> list[tuple[str, Any, str, list[int]]]:
    """The entries (path, data, dtype, shape) of one IVF node's lists, segmented by ``counts``."""
    p = lists.prefix + "ivf/"
    out: list[tuple[str, Any, str, list[int]]] = [(p + "counts", counts, "int64", list(counts.shape))]
    for k, (codes, ids, m) in enumerate(segment_views(lists, counts)):
        out.append((f"{p}{k}/codes", codes, "uint8", [m, lists.code_size]))
        out.append((f"{p}{k}/ids", ids, "int64", [m]))
    return out


def check_counts(counts: np.ndarray, nlist: int, entries: dict[str, dict[str, Any]], prefix: str, code_size: int | None,
                 bad: Any) -> None:
    """The counts entry and the segment entries agree (shapes, sums), before any list is sized by them."""
    p = prefix + "ivf/"
    if counts.ndim != 2 or counts.shape[1] != nlist or len(counts) < 1 or len(counts) > 1 << 16 or \
            bool((counts < 0).any()):
        raise bad(f"its {p}counts are not [segments, {nlist}] non-negative counts")
    for k, row in enumerate(counts):
        m = int(row.sum())
        codes, ids = entries.get(f"{p}{k}/codes"), entries.get(f"{p}{k}/ids")
        if codes is None or ids is None or codes["dtype"] != "uint8" or ids["dtype"] != "int64" or \
                ids["shape"] != [m] or len(codes["shape"]) != 2 or codes["shape"][0] != m or \
                (code_size is not None and codes["shape"][1] != code_size):
            raise bad(f"segment {k} of {p} does not match its counts")


def paths(prefix: str, segments: int) -> set[str]:
    p = prefix + "ivf/"
    return {p + "counts"} | {f"{p}{k}/{part}" for k in range(segments) for part in ("codes", "ids")}
