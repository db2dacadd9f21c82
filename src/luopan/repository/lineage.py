"""Lineage across kinds: what a manifest was made from (an artifact version's parents, a checkpoint's inputs), up the
graph, and what was made from it (docs/format.md §8.2). A manifest's inputs are its own and those linked to it
afterwards (§9.4, luopan.repository.links)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..store.base import KeyNotFound
from .kinds import Opened
from .links import all_links


@dataclass(frozen=True)
class Lineage:
    """The lineage of one ``NAME@N``."""

    ref: str
    kind: str  # "artifact" or "checkpoint"
    parents: list[str]  # what it names directly as made from
    ancestors: list[str]  # every reference up the graph, nearest first
    edges: list[tuple[str, str]]  # (child, parent) of every edge up the graph
    used_by: dict[str, list[str]] = field(default_factory=dict)  # kind -> references naming it directly
    missing: list[str] = field(default_factory=list)  # ancestors named but no longer in the repository
    linked: list[str] = field(default_factory=list)  # those of ``parents`` linked afterwards (§9.4), not in its manifest

    @property
    def checkpoints(self) -> list[str]:
        """Checkpoints (``run@step``) that name it as an input."""
        return self.used_by.get("checkpoint", [])

    @property
    def children(self) -> list[str]:
        """Artifact versions that name it as a parent."""
        return self.used_by.get("artifact", [])


def lineage(repo: Opened, text: str) -> Lineage:
    """Parents up the graph of ``text`` ("datasets/train@2", "run-a@100"), and every manifest that names it."""
    kind, series, number = repo.resolve(text, "reference")
    ref = kind.ref(series, number)
    inputs: dict[str, list[str]] = {}  # every manifest's ref -> what it names
    linked_of: dict[str, list[str]] = {}  # every manifest's ref -> what was linked to it (§9.4)
    kinds_of: dict[str, str] = {}
    links = all_links(repo)
    for k in repo.kinds:
        for s, n in k.scan(repo.store, None, False).pairs():
            try:
                doc = repo.read_manifest(k, s, n)
            except (KeyNotFound, IntegrityError, StorageError, UnsupportedFormatError):
                continue  # `luopan verify` names a damaged manifest; lineage shows what can be read
            own = k.inputs(doc)
            linked = [i for of, i in links.get((k.name, s, n), []) if of == doc.get("created", "") and i not in own]
            linked_of[k.ref(s, n)] = list(dict.fromkeys(linked))
            inputs[k.ref(s, n)] = own + linked_of[k.ref(s, n)]
            kinds_of[k.ref(s, n)] = k.name
    ancestors: list[str] = []
    edges: list[tuple[str, str]] = []
    missing: list[str] = []
    seen = {ref}
    queue = deque([ref])
    while queue:
        child = queue.popleft()
        for parent in inputs.get(child, []):
            edges.append((child, parent))
            if parent in seen:
                continue
            seen.add(parent)
            if parent in inputs:
                ancestors.append(parent)
                queue.append(parent)
            else:
                missing.append(parent)
    used_by: dict[str, list[str]] = {}
    for other, named in sorted(inputs.items()):
        if ref in named:
            used_by.setdefault(kinds_of[other], []).append(other)
    return Lineage(ref, kind.name, list(inputs.get(ref, [])), ancestors, edges, used_by, missing,
                   linked_of.get(ref, []))
