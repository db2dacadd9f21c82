"""What a repository holds, every kind in its own words: the core's one walk (luopan.repository.usage.holdings:
counts, logical and stored bytes per series, totals shared with ``du``) with what integrations know of their series
(a LangGraph saver's journal: threads and checkpoints). ``luopan ls``, ``stats``, ``show`` and the report use it."""

from __future__ import annotations

from typing import Any

from .repository.core import repository_of
from .repository.usage import Holdings, SeriesUsage, holdings
from .units import format_bytes

# The words of a kind's series and manifests, singular and plural: (series noun, manifest noun)
WORDS = {"checkpoint": ("run", "checkpoint"), "artifact": ("artifact", "version"), "journal": ("journal", "snapshot"),
         "index": ("index", "version")}
PLURAL = {"index": "indexes", "checkpoint": "checkpoints", "version": "versions", "snapshot": "snapshots",
          "thread": "threads", "run": "runs", "artifact": "artifacts", "journal": "journals"}


def plural(n: int, word: str) -> str:
    return f"{n} {word if n == 1 else PLURAL.get(word, word + 's')}"


def describe(repo: Any, kinds: tuple[Any, ...] | None = None) -> Holdings:
    """Every series of every kind (or of ``kinds``), with its contents in its own words where an integration knows
    them."""
    found = holdings(repository_of(repo), kinds)
    first = lambda kind: kind != "checkpoint"  # noqa: E731  (runs first, then the kinds in registry order)
    found.kinds = dict(sorted(found.kinds.items(), key=lambda kv: first(kv[0])))
    found.series.sort(key=lambda s: first(s.kind))
    describers = _journal_describers()
    for s in found.series:
        if s.kind == "journal":
            for fn in describers:
                words = fn(repo, s.series)
                if words is not None:
                    s.contents.update(words)
                    break
    return found


def journal_threads(repo: Any, name: str) -> dict[str, int] | None:
    """thread -> checkpoints of a LangGraph saver's journal, or None (not one, or langgraph not installed)."""
    try:
        from .langgraph.contents import threads_of
    except ImportError:
        return None
    return threads_of(repo, name)


def _journal_describers() -> list[Any]:
    try:  # an optional dependency: without langgraph installed, journals are described as journals
        from .langgraph.contents import describe_journal
    except ImportError:
        return []
    return [describe_journal]


def holds(s: SeriesUsage) -> str:
    """What one series holds, in words: "2 checkpoints", "3 versions", "LangGraph: 2 threads, 6 checkpoints; 1
    snapshot", "log 12.0 KiB"."""
    noun = WORDS.get(s.kind, (s.kind, "manifest"))[1]
    bits = []
    if "threads" in s.contents:
        bits.append(f"{plural(s.contents['threads'], 'thread')}, {plural(s.contents.get('checkpoints', 0), 'checkpoint')}")
    if s.numbers or not bits:
        bits.append(plural(len(s.numbers), noun))
    if s.damaged:
        bits.append(f"{len(s.damaged)} damaged")
    if s.log_bytes:
        bits.append(f"log {format_bytes(s.log_bytes)}")
    return ", ".join(bits)


def kind_of(s: SeriesUsage) -> str:
    """The series' kind as listings name it ("run", "artifact", "journal", "LangGraph journal", "index")."""
    noun = WORDS.get(s.kind, (s.kind, ""))[0]
    return f"LangGraph {noun}" if "threads" in s.contents else noun


def series_json(s: SeriesUsage) -> dict[str, Any]:
    return {"kind": s.kind, "name": s.series, "type": kind_of(s), "manifests": len(s.numbers),
            "manifest_word": WORDS.get(s.kind, (s.kind, "manifest"))[1], "latest": s.latest,
            "damaged": len(s.damaged), "logical_bytes": s.logical_bytes, "stored_bytes": s.stored_bytes,
            "exclusive_bytes": s.exclusive_bytes, "log_bytes": s.log_bytes, "created": s.created,
            "contents": dict(s.contents), "holds": holds(s)}


def kind_counts(h: Holdings) -> str:
    """The manifests of every kind in words: "2 checkpoints, 1 artifact version, 1 LangGraph journal (2 threads, 18
    checkpoints)"; "nothing stored yet" for an empty repository."""
    bits = []
    for kind, k in h.kinds.items():
        series = [s for s in h.series if s.kind == kind]
        if kind == "checkpoint":
            bits.append(plural(k["manifests"], "checkpoint"))
            continue
        noun, word = WORDS.get(kind, (kind, "manifest"))
        bits.append(f"{plural(k['series'], noun)} ({plural(k['manifests'], word)}"
                    + "".join(f"; {s.series}: {holds(s)}" for s in series if s.contents or (s.log_bytes and
                                                                                            not s.numbers))
                    + ")")
    return ", ".join(bits) if bits else "nothing stored yet"


def dedup_words(logical: int, stored: int) -> str:
    """The dedup ratio of DEDUP_DEFINITION in words, or why there is none."""
    if not stored:
        return "no dedup ratio: no chunk stored yet" if not logical else "no dedup ratio: nothing stored"
    return f"{logical / stored:.1f}× dedup"
