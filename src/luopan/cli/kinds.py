"""Every kind in the CLI's listings (``ls``, ``stats``, ``du``, ``show``): artifacts, journals (a LangGraph saver's
threads and checkpoints) and index snapshots beside the runs, in their own words (luopan.listing)."""

from __future__ import annotations

import json
from typing import Any

from ..errors import IntegrityError, ManifestNotFoundError, StorageError, UnsupportedFormatError
from ..listing import WORDS, describe, dedup_words, holds, journal_threads, kind_of, plural, series_json
from ..repo import Repo
from ..repository.usage import Holdings, SeriesUsage
from ..store.base import KeyNotFound
from .app import dedup_ratio, dedup_text, emit_json, human, out, table

UNREADABLE = (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound)


def print_storage(d: dict[str, int]) -> None:
    out.print(f"on storage: {human(d['physical_bytes'])} (packs {human(d['pack_bytes'])}, index "
              f"{human(d['index_bytes'])}, manifests {human(d['manifest_bytes'])}"
              + (f", logs {human(d['log_bytes'])}" if d.get("log_bytes") else "")
              + f", refs {human(d['ref_bytes'])})", highlight=False, markup=False)


def print_kinds(h: Holdings) -> None:
    """One row per kind: its series and manifests in its words, logical, stored (distinct chunks), dedup, logs."""
    t = table(title="per kind")
    for col in ("kind", "holds", "logical", "stored", "dedup", "logs"):
        t.add_column(col, justify="left" if col in ("kind", "holds") else "right")
    for kind, k in h.kinds.items():
        noun, word = WORDS.get(kind, (kind, "manifest"))
        t.add_row(noun, f"{plural(k['series'], noun)}, {plural(k['manifests'], word)}", human(k["logical_bytes"]),
                  human(k["stored_bytes"]), dedup_text(dedup_ratio(k["logical_bytes"], k["stored_bytes"])),
                  human(k["log_bytes"]) if k["log_bytes"] else "")
    out.print(t)


def other_kinds_table(series: list[SeriesUsage], title: str) -> None:
    """The artifacts, journals and indexes: one row each, in their own words, with sizes."""
    t = table(title=title)
    for col in ("kind", "name", "holds", "latest", "created", "logical", "stored", "only this"):
        t.add_column(col, justify="left" if col in ("kind", "name", "holds", "created") else "right")
    for s in series:
        t.add_row(kind_of(s), s.series, holds(s), "" if s.latest is None else str(s.latest), s.created[:19],
                  human(s.logical_bytes), human(s.stored_bytes), human(s.exclusive_bytes))
    out.print(t)


def other_target(r: Repo, ref: str) -> tuple[Any, str, int | None] | None:
    """(kind, series, number or None) when ``ref`` (NAME or NAME@N) names no run with checkpoints but an artifact,
    journal or index; else None (the checkpoint commands' own errors apply)."""
    name, at, number = ref.rpartition("@") if "@" in ref else (ref, "", "")
    if at and not number.isdigit():
        return None
    if name in r.runs():
        return None
    for kind in r.kinds:
        if kind.name == "checkpoint":
            continue
        try:
            kind.check_series(name)
        except ValueError:
            continue
        cat = kind.scan(r.store, name, False)
        if name in cat.steps or (kind.logs is not None and name in kind.logs(r.store)):
            return kind, name, int(number) if at else None
    return None


def show_other(r: Repo, kind: Any, name: str, number: int | None, as_json: bool) -> None:
    """``luopan show NAME[@N]`` of an artifact, journal or index: what the series holds in its words, and its
    manifests (or the one named)."""
    h = describe(r, (kind,))
    s = next(x for x in h.series if x.series == name)
    numbers = s.numbers if number is None else [number]
    if number is not None and number not in s.numbers:
        raise ManifestNotFoundError(f"{kind.series_noun} {name!r} has no {kind.number_noun} {number} (it has "
                                    f"{', '.join(map(str, s.numbers)) or 'none'}; `luopan show {name}` lists them)")
    rows = []
    for n in numbers:
        try:
            doc = r.repository.read_manifest(kind, name, n)
        except UNREADABLE as exc:
            rows.append({"number": n, "error": str(exc)})
            continue
        rows.append({"number": n, "created": doc.get("created", ""), "stats": doc.get("stats", {}),
                     "metadata": doc.get("metadata", {}), "entries": len(doc.get("entries", [])),
                     **{k: doc[k] for k in ("parents", "index_type", "ntotal", "dim") if k in doc}})
    threads = journal_threads(r, name) if "threads" in s.contents else None
    if as_json:
        emit_json({**series_json(s), kind.number_noun + "s": rows, **({"threads": threads} if threads else {})})
        return
    out.print(f"{kind_of(s)} {name}: {holds(s)}; {human(s.logical_bytes)} logical, {human(s.stored_bytes)} stored "
              f"({dedup_words(s.logical_bytes, s.stored_bytes)})", highlight=False, markup=False)
    if threads:
        t = table(title=f"threads of {name}")
        t.add_column("thread")
        t.add_column("checkpoints", justify="right")
        for thread, n in threads.items():
            t.add_row(thread, str(n))
        out.print(t)
    if not rows:
        out.print(f"no {WORDS.get(kind.name, ('', kind.noun))[1]} yet" + (": everything is in its log" if s.log_bytes
                                                                        else ""), highlight=False, markup=False)
        return
    t = table(title=f"{kind.number_noun}s of {name}")
    for col in (kind.number_noun, "created", "entries", "logical", "written", "detail"):
        t.add_column(col, justify="left" if col in ("created", "detail") else "right")
    for row in rows:
        if "error" in row:
            t.add_row(str(row["number"]), "", "", "", "", "DAMAGED: " + row["error"])
            continue
        st = row["stats"]
        detail = " ".join(f"{k}={json.dumps(row[k])}" for k in ("parents", "index_type", "ntotal", "dim") if k in row)
        if row["metadata"]:
            detail += (" " if detail else "") + "metadata " + json.dumps(row["metadata"])
        t.add_row(str(row["number"]), str(row["created"])[:19], str(row["entries"]),
                  human(st.get("logical_bytes", 0)), human(st.get("stored_bytes", 0)), detail)
    out.print(t)
