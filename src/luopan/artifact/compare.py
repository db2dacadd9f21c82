"""What differs: a checked-out folder against a version (``status``), and two versions against each other
(``diff``). Files are compared by content (their digests, docs/format.md §8.2.1); modes by ``diff`` only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .worktree import Digests, Record, entry_digest, scan


@dataclass(frozen=True)
class CheckoutStatus:
    """How a folder differs from an artifact version: files the version has that differ in the folder
    (``modified``), files the folder has that the version lacks (``added``), files of the version missing from the
    folder (``deleted``); paths relative to the folder, sorted. ``complete`` is False while the folder's checkout of
    ``ref`` was cut short (check out again to finish it)."""

    path: str
    ref: str
    modified: list[str]
    added: list[str]
    deleted: list[str]
    complete: bool = True

    @property
    def clean(self) -> bool:
        return not (self.modified or self.added or self.deleted)


@dataclass(frozen=True)
class FileChange:
    """One file of a version diff; sizes and modes are None on the side that lacks the file."""

    path: str
    size_a: int | None
    size_b: int | None
    mode_a: int | None
    mode_b: int | None


@dataclass(frozen=True)
class ArtifactDiff:
    """Files ``added`` in ``b``, ``removed`` from ``a``, ``modified`` (content or mode) between two versions, and how
    many are the same in both."""

    a: str
    b: str
    added: list[FileChange]
    removed: list[FileChange]
    modified: list[FileChange]
    unchanged: int

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.modified)


def folder_status(root: str, ref: str, doc: dict[str, Any], rec: Record | None) -> CheckoutStatus:
    """``root`` (a folder) against the version ``doc``; ``rec`` (the folder's record, if any) spares hashing files it
    vouches for."""
    local = scan(root)
    digests = Digests(root, local, rec)
    files = {e["path"]: e for e in doc["entries"] if e["type"] == "file"}
    dirs = {e["path"] for e in doc["entries"] if e["type"] == "dir"}
    modified, deleted = [], []
    for path, e in files.items():
        if path in local.files:
            if digests.of(path) != entry_digest(e):
                modified.append(path)
        elif path in local.dirs or path in local.other:
            modified.append(path)
        else:
            deleted.append(path)
    added = [p for p in (*local.files, *local.other) if p not in files and p not in dirs]
    complete = rec is None or rec.complete or rec.ref != ref
    return CheckoutStatus(os.path.abspath(root), ref, sorted(modified), sorted(added), sorted(deleted), complete)


def version_diff(a: str, doc_a: dict[str, Any], b: str, doc_b: dict[str, Any]) -> ArtifactDiff:
    fa = {e["path"]: e for e in doc_a["entries"] if e["type"] == "file"}
    fb = {e["path"]: e for e in doc_b["entries"] if e["type"] == "file"}
    added = [FileChange(p, None, e["size"], None, e["mode"]) for p, e in sorted(fb.items()) if p not in fa]
    removed = [FileChange(p, e["size"], None, e["mode"], None) for p, e in sorted(fa.items()) if p not in fb]
    modified, unchanged = [], 0
    for p in sorted(fa.keys() & fb.keys()):
        ea, eb = fa[p], fb[p]
        if ea["mode"] != eb["mode"] or entry_digest(ea) != entry_digest(eb):
            modified.append(FileChange(p, ea["size"], eb["size"], ea["mode"], eb["mode"]))
        else:
            unchanged += 1
    return ArtifactDiff(a, b, added, removed, modified, unchanged)
