"""What a report shows, read from an open repository through its public API (never written to): runs with their
checkpoints, pins, latest, eval logs, pruned steps, tiers and timings; artifacts, journals and index snapshots.

Everything here is plain data (dataclasses of str/int/float/dict), so the page (luopan.report.page) never touches
the repository."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import IntegrityError, LuopanError, StorageError, UnsupportedFormatError
from ..format.limits import MAX_SMALL_BYTES
from ..format.names import latest_ref_key
from ..format.refs import parse_ref
from ..listing import describe, series_json
from ..repository.links import all_links
from ..store.base import KeyNotFound
from .logged import config_of, logged_metrics

UNREADABLE = (IntegrityError, UnsupportedFormatError, StorageError, KeyNotFound)
# Metric names where lower is better (the "best" highlight); any other metric is best when highest.
LOWER_IS_BETTER = ("loss", "err", "perplexity", "ppl", "wer", "cer", "mse", "mae", "nll", "latency", "time")
# Settings and counters rather than scores: no "best" checkpoint for them.
NOT_A_SCORE = ("lr", "learning_rate", "epoch", "step", "steps", "tokens", "samples", "batch", "batch_size")


@dataclass
class Checkpoint:
    """One committed checkpoint as the report shows it."""

    run: str
    step: int
    created: str
    metrics: dict[str, float]  # numeric, finite metrics only
    stats: dict[str, Any]
    tier: str  # "local", "replicating", "replicated", "remote" or "cold"
    pin: dict[str, Any] | None  # {"tag", "created"} when pinned
    latest: bool = False
    delta_entries: int = 0  # entries stored as row deltas (docs/format.md §5.2)
    xor_entries: int = 0  # entries stored as XOR deltas (§5.4)
    inputs: list[str] = field(default_factory=list)
    rows: list[tuple[str, int, bool]] = field(default_factory=list, repr=False)  # (hash, raw size, is a delta row)
    best: list[str] = field(default_factory=list)  # metrics this checkpoint is the best of

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    @property
    def save_seconds(self) -> float | None:
        return _seconds(self.stats.get("save_us"))

    @property
    def stall_seconds(self) -> float | None:
        return _seconds(self.stats.get("stall_us"))


@dataclass
class RunData:
    name: str
    checkpoints: list[Checkpoint]
    damaged: list[tuple[int, str]]  # (step, why) of manifests that cannot be read
    pruned: dict[int, dict[str, float]]  # step -> metrics known for it (eval log), manifest gone
    evals: dict[int, dict[str, float]]  # step -> numeric metrics of its eval log
    record: dict[str, Any] | None
    resumes: list[dict[str, Any]]
    logged: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> every journaled (step, value)
    config: dict[str, Any] = field(default_factory=dict)  # dotted keys (luopan.checkpoint.changes.run_config)

    @property
    def metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for c in self.checkpoints:
            names.update(dict.fromkeys(c.metrics))
        for m in (*self.evals.values(), *self.pruned.values()):
            names.update(dict.fromkeys(m))
        return list(names)


@dataclass
class ArtifactVersionData:
    name: str
    version: int
    created: str
    stats: dict[str, Any]
    parents: list[str]
    files: int
    tier: str
    pin: dict[str, Any] | None
    rows: list[tuple[str, int, bool]] = field(default_factory=list, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass
class SnapshotData:
    """A journal snapshot or an index version."""

    name: str
    number: int
    created: str
    stats: dict[str, Any]
    pin: dict[str, Any] | None
    live: bool = False
    detail: str = ""
    rows: list[tuple[str, int, bool]] = field(default_factory=list, repr=False)


@dataclass
class ReportData:
    where: str
    tiered: bool
    runs: list[RunData]
    artifacts: dict[str, list[ArtifactVersionData]]
    journals: dict[str, list[SnapshotData]]
    indexes: dict[str, list[SnapshotData]]
    du: dict[str, int] | None
    edges: list[tuple[str, str]]  # (parent ref, child ref) of every lineage edge among what was read
    selected: bool  # targets were named (a part of the repository)
    resumes_available: bool
    # every series of every kind in its own words (luopan.listing.series_json): a LangGraph journal's threads too
    holdings: list[dict[str, Any]] = field(default_factory=list)


def _seconds(v: Any) -> float | None:
    """Seconds from a manifest's integer microseconds (stats.save_us / stall_us, docs/format.md §8)."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v / 1e6
    return None


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics (bools, strings, NaN are not plotted)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def lower_is_better(metric: str) -> bool:
    low = metric.lower()
    return any(w in low for w in LOWER_IS_BETTER)


def chunk_rows(doc: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """(hash, raw size, is a delta row) of every chunk row of a manifest of any kind (docs/format.md §2a, §5.2, §5.4):
    an entry's ``chunks`` are plain; a row delta's ``index``/``values`` and an XOR delta's ``chunks`` are deltas."""
    out: list[tuple[str, int, bool]] = []
    for e in doc.get("entries", []):
        out += [(r[0], r[4], False) for r in e.get("chunks", [])]
        d = e.get("delta") or {}
        out += [(r[0], r[4], True) for r in d.get("index", []) + d.get("values", [])]
        out += [(r[0], r[4], True) for r in (e.get("xor") or {}).get("chunks", [])]
    return out


def _tiers(repo: Any, kind: Any, series: str) -> dict[int, str]:
    if repo.tier is None:
        return {}
    try:
        return repo.tier.status(kind, series)
    except (LuopanError, OSError):
        return {}


def _pins(fn: Any) -> dict[int, dict[str, Any]]:
    try:
        return fn()
    except (LuopanError, OSError):
        return {}  # a damaged pin: `luopan verify` names it; the report shows what can be read


def gather_run(repo: Any, name: str, list_resumes: Any = None) -> RunData:
    """A run's checkpoints (every manifest read once), eval logs, pins, latest, pruned steps and tiers."""
    from ..checkpoint import CHECKPOINTS
    run = repo.run(name)
    steps = repo.steps(name)
    pins = _pins(run.pins)
    tiers = _tiers(repo, CHECKPOINTS, name)
    cps: list[Checkpoint] = []
    damaged: list[tuple[int, str]] = []
    last = None
    for step in steps:
        try:
            m = repo.manifest(name, step)
        except UNREADABLE as exc:
            damaged.append((step, str(exc)))
            continue
        last = m
        doc = m.doc
        entries = doc.get("entries", [])
        cps.append(Checkpoint(name, step, m.created, numeric(m.metrics), dict(doc.get("stats", {})),
                              tiers.get(step, "local"), pins.get(step),
                              delta_entries=sum(1 for e in entries if "delta" in e),
                              xor_entries=sum(1 for e in entries if "xor" in e),
                              inputs=list(doc.get("inputs", [])), rows=chunk_rows(doc)))
    if cps:
        cps[-1].latest = True  # the highest committed step (docs/format.md §9: the listing is authoritative)
    evals: dict[int, dict[str, float]] = {}
    for step in _safe(run.evals, []):
        try:
            evals[step] = numeric(run.eval(step)["metrics"])
        except (LuopanError, OSError):
            continue
    have = set(steps)
    pruned = {s: m for s, m in evals.items() if s not in have}
    ref_step = _latest_ref_step(repo, name)
    if ref_step is not None and ref_step not in have:
        pruned.setdefault(ref_step, {})
    _mark_best(cps)
    record = _safe(run.record, None)
    resumes: list[dict[str, Any]] = []
    if list_resumes is not None:
        got = _safe(lambda: list_resumes(repo, name), [])
        resumes = [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []
    return RunData(name, cps, damaged, dict(sorted(pruned.items())), evals, record, resumes,
                   logged_metrics(repo, name), config_of(record, last))


def _safe(fn: Any, default: Any) -> Any:
    try:
        return fn()
    except (LuopanError, OSError):
        return default


def _latest_ref_step(repo: Any, run: str) -> int | None:
    """The step the run's ``latest`` ref names (docs/format.md §9), or None when missing or damaged."""
    key = latest_ref_key(run)
    try:
        return parse_ref(repo.store.get_limited(key, MAX_SMALL_BYTES), key)["step"]
    except (LuopanError, OSError, KeyNotFound):
        return None


def _mark_best(cps: list[Checkpoint]) -> None:
    names: dict[str, None] = {}
    for c in cps:
        names.update(dict.fromkeys(c.metrics))
    for metric in names:
        have = [c for c in cps if metric in c.metrics]
        if metric.lower() in NOT_A_SCORE or len({c.metrics[metric] for c in have}) < 2:
            continue  # a setting or a counter, or no difference to pick from
        pick = min if lower_is_better(metric) else max
        best = pick(have, key=lambda c: c.metrics[metric])
        best.best.append(metric)


def gather_artifact(repo: Any, name: str) -> list[ArtifactVersionData]:
    from ..artifact import ARTIFACTS_KIND
    art = repo.artifact(name)
    pins = _pins(art.pins)
    tiers = _tiers(repo, ARTIFACTS_KIND, name)
    out = []
    for v in art.numbers():
        try:
            doc = repo.repository.read_manifest(ARTIFACTS_KIND, name, v)
        except UNREADABLE:
            continue
        files = sum(1 for e in doc["entries"] if e.get("type") == "file")
        out.append(ArtifactVersionData(name, v, doc["created"], dict(doc["stats"]), list(doc.get("parents", [])),
                                       files, tiers.get(v, "local"), pins.get(v), chunk_rows(doc)))
    return out


def gather_journals(repo: Any) -> dict[str, list[SnapshotData]]:
    from ..journal import JOURNAL_KIND
    from ..repository.pins import read_pins
    out: dict[str, list[SnapshotData]] = {}
    for name in JOURNAL_KIND.scan(repo.store, None, False).runs:
        pins = _pins(lambda n=name: read_pins(repo.store, JOURNAL_KIND, n))
        snaps = []
        for seq in JOURNAL_KIND.scan(repo.store, name, False).steps.get(name, []):
            try:
                doc = repo.repository.read_manifest(JOURNAL_KIND, name, seq)
            except UNREADABLE:
                continue
            snaps.append(SnapshotData(name, seq, doc["created"], dict(doc["stats"]), pins.get(seq),
                                      detail=f"{doc['stats'].get('records', 0)} record(s) covered",
                                      rows=chunk_rows(doc)))
        if snaps:
            snaps[-1].live = True
        out[name] = snaps
    return out


def gather_indexes(repo: Any) -> dict[str, list[SnapshotData]]:
    from ..index import INDEX_KIND
    from ..index import IndexStore
    out: dict[str, list[SnapshotData]] = {}
    for name in INDEX_KIND.scan(repo.store, None, False).runs:
        idx = IndexStore(repo, name)
        try:
            live = _safe(idx.current, None)
            pins = _pins(idx.pins)
            snaps = []
            for v in idx.versions():
                try:
                    doc = repo.repository.read_manifest(INDEX_KIND, name, v)
                except UNREADABLE:
                    continue
                detail = f"{doc.get('index_type', '?')}, {doc.get('ntotal', '?')} vectors of dim {doc.get('dim', '?')}"
                snaps.append(SnapshotData(name, v, doc["created"], dict(doc["stats"]), pins.get(v), v == live,
                                          detail, chunk_rows(doc)))
            out[name] = snaps
        finally:
            idx.close()
    return out


def lineage_edges(runs: list[RunData], artifacts: dict[str, list[ArtifactVersionData]]) -> list[tuple[str, str]]:
    """(parent, child) of every lineage edge: artifact parents (§8.2) and checkpoint inputs (§8)."""
    edges = []
    for versions in artifacts.values():
        for v in versions:
            edges += [(p, v.ref) for p in v.parents]
    for r in runs:
        for c in r.checkpoints:
            edges += [(p, c.ref) for p in c.inputs]
    return edges


def resumes_api() -> Any:
    """``luopan.checkpoint.runs.resumes.list_resumes`` when this luopan has it (restore times), else None."""
    try:
        from ..checkpoint import list_resumes
    except ImportError:
        return None
    return list_resumes


def gather(repo: Any, targets: list[str] | None = None) -> ReportData:
    """Everything the report shows, for the whole repository or for the runs and artifacts named in ``targets``
    (an unknown name raises CheckpointNotFoundError)."""
    from ..errors import CheckpointNotFoundError
    from ..format.names import is_artifact_name, is_run_name
    from ..artifact import artifact_names
    list_resumes = resumes_api()
    run_names, art_names = repo.runs(), artifact_names(repo)
    selected = bool(targets)
    if targets:
        runs_sel: list[str] = []
        arts_sel: list[str] = []
        for t in targets:
            if t in art_names and (t not in run_names or not is_run_name(t)):
                arts_sel.append(t)
            elif t in run_names:
                runs_sel.append(t)
            elif is_run_name(t) or is_artifact_name(t):
                have = ", ".join((run_names + art_names)[:20]) or "none"
                raise CheckpointNotFoundError(f"{t!r} is neither a run with checkpoints nor an artifact "
                                              f"(runs and artifacts here: {have})")
            else:
                from ..errors import InvalidNameError
                raise InvalidNameError(f"invalid run or artifact name {t!r}")
        run_names, art_names = list(dict.fromkeys(runs_sel)), list(dict.fromkeys(arts_sel))
    runs = [gather_run(repo, n, list_resumes) for n in run_names]
    artifacts = {n: gather_artifact(repo, n) for n in art_names}
    journals = {} if selected else gather_journals(repo)
    indexes = {} if selected else gather_indexes(repo)
    listed = None if selected else _safe(lambda: describe(repo), None)  # the walk `du` and `stats` share
    return ReportData(repo.where, repo.tier is not None, runs, artifacts, journals, indexes,
                      None if listed is None else listed.totals,
                      lineage_edges(runs, artifacts) + _linked_edges(repo, runs), selected, list_resumes is not None,
                      [] if listed is None else [series_json(s) for s in listed.series])


def _linked_edges(repo: Any, runs: list[RunData]) -> list[tuple[str, str]]:
    """(input, checkpoint) of the inputs linked to the checkpoints read afterwards (docs/format.md §9.4)."""
    created = {c.ref: c.created for r in runs for c in r.checkpoints}
    links = _safe(lambda: all_links(repo.repository), {})
    return [(i, f"{s}@{n}") for (k, s, n), pairs in sorted(links.items()) if k == "checkpoint"
            for of, i in pairs if created.get(f"{s}@{n}") == of]
