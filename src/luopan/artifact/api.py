"""Datasets and other artifacts: versioned, content-addressed files and directories with lineage, in the same
repository as the checkpoints (docs/format.md §8.2).

    art = repo.artifact("datasets/clean")
    v = art.commit("data/clean/", parents=["datasets/raw@1"], metadata={"rows": 120000})
    art.checkout("out/clean")                       # latest version; the directory appears atomically, verified
    art.checkout("out/clean", 1)                    # in place: only what differs is written, local edits refused
    art.status("out/clean").modified                # what was edited since
    art.diff(1, 2).added                            # what version 2 added
    with art.open("part-0001.jsonl", version=2) as f: ...
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..errors import ArgumentTypeError, ArtifactNotFoundError, LuopanError, UsageError
from ..format.canonical import canonical
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.names import artifact_manifest_key, check_artifact, check_version, parse_ref_text
from ..repository.core import Repository, repository_of
from ..repository.pins import add_pin, read_pins, remove_pin
from ..repository.preflight import fits
from ..repository.pruning import prune_series
from ..retention import Plan, Rules
from ..store.base import KeyNotFound
from ..repository.verify import raise_problems, verify_manifests
from ..units import format_bytes
from .checkout import VerifiedReader, checkout, file_refs
from .compare import ArtifactDiff, CheckoutStatus, folder_status, version_diff
from .kind import ARTIFACTS_KIND
from .ownfiles import RECORD
from .manifest import ARTIFACT_FORMAT_VERSION, parse_artifact_manifest, seal_artifact_manifest
from .sources import Collected, collect
from .update import refuse_own_files, update
from .worktree import read_record, record_of, write_record
from .writer import store_sources


@dataclass(frozen=True)
class ArtifactVersion:
    """One committed version of an artifact."""

    name: str
    version: int
    created: str
    files: list[str]  # relative paths of its files, sorted
    dirs: list[str]
    logical_bytes: int  # bytes of its files
    stored_bytes: int  # bytes of pack files this commit wrote (after compression, with framing)
    new_bytes: int  # raw bytes of chunks this commit added to the repository
    chunks: int
    new_chunks: int
    parents: list[str]
    metadata: dict[str, Any]
    root: str  # what was committed: "dir", "file" or "files" (a mapping)
    manifest: str = field(repr=False)

    @property
    def ref(self) -> str:
        """``NAME@VERSION``, as parents, ``inputs=`` and ``luopan lineage`` name it."""
        return f"{self.name}@{self.version}"

    @classmethod
    def from_doc(cls, doc: dict[str, Any], key: str) -> ArtifactVersion:
        s = doc["stats"]
        files = sorted(e["path"] for e in doc["entries"] if e["type"] == "file")
        dirs = sorted(e["path"] for e in doc["entries"] if e["type"] == "dir")
        return cls(doc["name"], doc["version"], doc["created"], files, dirs, s["logical_bytes"], s["stored_bytes"],
                   s["new_bytes"], s["chunks"], s["new_chunks"], list(doc["parents"]), dict(doc["metadata"]),
                   doc["root"], key)


class Artifact:
    """A named artifact of a repository: ``repo.artifact("datasets/clean")``."""

    def __init__(self, repo: Repository | Any, name: str) -> None:
        self.repo = repository_of(repo)  # composed with the core (a luopan.Repo gives its Repository)
        self.name = check_artifact(name)

    def __repr__(self) -> str:
        return f"<luopan.Artifact {self.name!r} in {self.repo.where}>"

    # -- writing ------------------------------------------------------------------------------------------------
    def commit(self, what: Any, *, parents: list[str] | None = None, metadata: dict[str, Any] | None = None,
               progress: Callable[[int], Any] | None = None) -> ArtifactVersion:
        """Store a directory, a file, or a ``{relative path: bytes}`` dict as the next version; returns it.

        Files are cut into content-defined chunks, so a version that changed a little costs about what changed;
        identical content gives a new version that writes nothing. Relative paths, file and directory modes, empty
        files and empty directories are kept. Symbolic links, devices, FIFOs, sockets and paths escaping the
        directory are refused (UnsupportedFileError naming them) before anything is written. ``parents``
        (``"NAME@V"``, each must exist) record lineage; ``metadata`` is any JSON object. ``progress(n)`` is called with
        the bytes of each chunk stored. The version becomes visible atomically when its manifest is durable; an
        existing version is never overwritten.
        """
        repo = self.repo
        repo.drain()
        if isinstance(parents, str) or not isinstance(parents, (list, tuple, type(None))):
            raise UsageError("parents must be a list of 'NAME@V' strings, e.g. parents=['datasets/raw@1']")
        parent_refs = sorted({kind.ref(s, n) for kind, s, n in (repo.resolve(p, "parent") for p in parents or [])})
        meta = _json_object("metadata", metadata)
        collected = collect(what)
        with repo.transaction(ARTIFACTS_KIND, self.name, None, what=f"commit of artifact {self.name}",
                              estimate=self._estimate(collected), purpose=f"commit artifact {self.name!r}",
                              format_version=ARTIFACT_FORMAT_VERSION) as tx:
            stored = store_sources(tx.chunks(progress=progress, crash_label="artifact.chunk.written", copy_raw=True),
                                   collected.files)
            pack_ids: dict[str, int] = {}
            entries: list[dict[str, Any]] = [{"path": p, "type": "dir", "mode": m} for p, m in collected.dirs]
            for src, rows in zip(collected.files, stored.rows):
                chunks = []
                for h, size, x in rows:
                    loc = stored.location(h)
                    chunks.append([h, pack_ids.setdefault(loc.pack, len(pack_ids)), loc.offset, loc.length, size,
                                   loc.codec, x])
                entries.append({"path": src.path, "type": "file", "mode": src.mode,
                                "size": sum(r[1] for r in rows), "chunking": "cdc", "chunks": chunks})
            entries.sort(key=lambda e: e["path"])
            doc: dict[str, Any] = {
                "format_version": ARTIFACT_FORMAT_VERSION, "kind": "artifact", "name": self.name, "version": 0,
                "created": datetime.now(timezone.utc).isoformat(), "root": collected.root, "parents": parent_refs,
                "metadata": meta, "packs": list(pack_ids), "entries": entries,
                "stats": {"logical_bytes": sum(e.get("size", 0) for e in entries),
                          "files": len(collected.files), "chunks": sum(len(r) for r in stored.rows),
                          "new_chunks": stored.new_chunks, "new_bytes": stored.new_bytes,
                          "stored_bytes": stored.stored_bytes, "new_packs": stored.new_packs},
            }
            tx.put_next(lambda version: self._seal(doc, version), (self.numbers() or [0])[-1] + 1, "commit again")
        key = tx.manifest_key
        assert key is not None
        return ArtifactVersion.from_doc(doc, key)

    def _estimate(self, collected: Collected) -> int:
        """Bytes the commit may write, for the space preflight: files whose path and size differ from the latest
        version's (a file that kept both is most likely unchanged; a wrong guess still fails cleanly when the disk
        fills)."""
        total = sum(s.size for s in collected.files)
        if not fits(self.repo, self.repo.space_margin, total) and self.numbers():
            try:
                before = {(e["path"], e.get("size")) for e in self.listing()}
            except LuopanError:
                return total
            return sum(s.size for s in collected.files if (s.path, s.size) not in before)
        return total

    def _seal(self, doc: dict[str, Any], version: int) -> bytes:
        doc["version"] = version
        data = seal_artifact_manifest(doc)
        if len(data) > MAX_MANIFEST_BYTES:
            raise UsageError(f"the manifest of artifact {self.name!r} would be {format_bytes(len(data))}, more than "
                             f"readers accept ({format_bytes(MAX_MANIFEST_BYTES)}): split it into several artifacts")
        return data

    # -- reading ------------------------------------------------------------------------------------------------
    def numbers(self) -> list[int]:
        """Committed version numbers, ascending."""
        return ARTIFACTS_KIND.scan(self.repo.store, self.name, False).steps.get(self.name, [])

    def versions(self) -> list[ArtifactVersion]:
        """Every committed version, oldest first."""
        return [self.get(v) for v in self.numbers()]

    def get(self, version: int | None = None) -> ArtifactVersion:
        """One version (the latest when None)."""
        doc, key = self._doc(version)
        return ArtifactVersion.from_doc(doc, key)

    def _doc(self, version: int | None) -> tuple[dict[str, Any], str]:
        numbers = self.numbers()
        if version is None:
            if not numbers:
                raise ArtifactNotFoundError(self._missing())
            version = numbers[-1]
        version = check_version(version)
        key = artifact_manifest_key(self.name, version)
        try:
            data = self.repo.store.get_limited(key, MAX_MANIFEST_BYTES)
        except KeyNotFound:
            raise ArtifactNotFoundError(self._missing(version)) from None
        return parse_artifact_manifest(data, key, self.name, version), key

    def _missing(self, version: int | None = None) -> str:
        numbers = self.numbers()
        if not numbers:
            names = artifact_names(self.repo)
            have = f"artifacts here: {', '.join(names[:20])}" if names else "the repository has no artifacts yet"
            return f"artifact {self.name!r} has no committed version ({have})"
        return (f"artifact {self.name!r} has no version {version}; committed versions: "
                f"{', '.join(map(str, numbers[-10:]))}")

    def listing(self, version: int | None = None) -> list[dict[str, Any]]:
        """The files and directories of a version: {"path", "type" ("file"/"dir"), "mode", "size" (files)}."""
        doc, _key = self._doc(version)
        return [{k: e[k] for k in ("path", "type", "mode", "size") if k in e} for e in doc["entries"]]

    def checkout(self, dest: str | os.PathLike[str], version: int | None = None, *, force: bool = False,
                 progress: Callable[[int], Any] | None = None) -> str:
        """Write a version (the latest when None) into the folder ``dest``; every chunk is verified and every file made
        durable. Returns its path. A new ``dest`` appears atomically (renamed into place whole). An existing folder is
        updated in place: files that already hold the version's bytes are left untouched, each changed file is
        replaced atomically, files of the previous checkout the version lacks are removed, files luopan did not write
        are left alone. It refuses (CheckoutConflictError, ``.paths``; nothing changed) to overwrite or remove a
        local change — a file edited since the checkout, or one it did not write in the way — unless ``force``.
        The folder keeps a record of what was checked out, ``.luopan-checkout.json`` (docs/format.md §8.2.1); a
        checkout cut short leaves each file old or new and finishes when run again. ``progress(n)``: bytes."""
        doc, _key = self._doc(version)
        owner = ARTIFACTS_KIND.label(self.name, doc["version"])
        if not isinstance(force, bool):
            raise ArgumentTypeError(f"force must be True or False, got {force!r}")
        if isinstance(dest, bytes):
            dest = os.fsdecode(dest)
        if isinstance(dest, (str, os.PathLike)) and os.fspath(dest) and os.path.isdir(dest):
            return update(self.repo.store, owner, doc, os.path.abspath(dest), self.repo.where, force=force,
                          progress=progress)
        refuse_own_files(doc)
        return checkout(self.repo.store, owner, doc, dest, progress,
                        lambda root: write_record(root, record_of(root, self.repo.where, doc)))

    def status(self, dest: str | os.PathLike[str], version: int | None = None) -> CheckoutStatus:
        """How the folder ``dest`` differs from a version: by default the one checked out there last (from its
        record), else ``version``. ``modified``, ``added`` and ``deleted`` list paths; ``clean`` when none."""
        if not isinstance(dest, (str, bytes, os.PathLike)):
            raise ArgumentTypeError(f"a folder must be a path (str or os.PathLike), got {type(dest).__name__}")
        root = os.path.abspath(os.fsdecode(os.fspath(dest)))
        if not os.path.isdir(root):
            raise UsageError(f"{root} is not a folder: give the folder an artifact was checked out into")
        rec = read_record(root)
        if version is None:
            if rec is None:
                raise UsageError(f"{root} has no checkout record ({RECORD}): name the version to compare it with, "
                                 f"e.g. {self.name}@1 (Python: version=1)")
            if rec.artifact != self.name:
                raise UsageError(f"{root} holds a checkout of {rec.ref}, not of {self.name}: name the version to "
                                 f"compare it with, e.g. {self.name}@1 (Python: version=1)")
            version = rec.version
        doc, _key = self._doc(version)
        return folder_status(root, f"{self.name}@{doc['version']}", doc, rec)

    def diff(self, a: int | str, b: int | str | None = None) -> ArtifactDiff:
        """The files added, removed and modified (content or mode) from version ``a`` to version ``b`` (the latest when
        None). Either may be a ``"NAME@V"`` of another artifact."""
        (ref_a, doc_a), (ref_b, doc_b) = self._side(a), self._side(b)
        return version_diff(ref_a, doc_a, ref_b, doc_b)

    def _side(self, which: int | str | None) -> tuple[str, dict[str, Any]]:
        art = self
        if isinstance(which, str):
            name, number = parse_ref_text(which, "artifact version")
            art, which = Artifact(self.repo, name), number
        doc, _key = art._doc(which)
        return f"{art.name}@{doc['version']}", doc

    def open(self, path: str, version: int | None = None) -> io.BufferedReader:
        """A binary file object streaming one file of a version (the latest when None), each chunk verified as it is
        read: ``with art.open("part-0001.jsonl") as f: for line in f: ...``."""
        doc, _key = self._doc(version)
        for e in doc["entries"]:
            if e["path"] == path and e["type"] == "file":
                owner = ARTIFACTS_KIND.label(self.name, doc["version"])
                return io.BufferedReader(VerifiedReader(self.repo.store, file_refs(owner, doc, e), e["size"], path),
                                         buffer_size=1 << 20)
        files = [e["path"] for e in doc["entries"] if e["type"] == "file"]
        raise ArtifactNotFoundError(f"artifact {self.name!r} version {doc['version']} has no file {path!r}; it has "
                                    f"{len(files)} file(s): {', '.join(files[:10])}{' …' if len(files) > 10 else ''}")

    def verify(self, version: int | None = None, *, progress: Callable[[int], Any] | None = None) -> int:
        """Read every chunk of one version (or of all of them when None) and check it; returns the bytes checked.
        IntegrityError (``.problems``) names every damaged file and chunk."""
        numbers = [check_version(version)] if version is not None else self.numbers()
        if not numbers or (version is not None and version not in self.numbers()):
            raise ArtifactNotFoundError(self._missing(version))
        checked = verify_manifests(self.repo.store, self.repo.read_manifest,
                                   [(ARTIFACTS_KIND, self.name, n) for n in numbers], progress=progress)
        self.repo.forget_damaged(checked.chunk_problems)
        raise_problems(checked.problems, checked)
        return checked.bytes

    # -- pins and pruning -----------------------------------------------------------------------------------------
    def pin(self, version: int, tag: str | None = None) -> None:
        """Protect ``version`` from pruning."""
        add_pin(self.repo, ARTIFACTS_KIND, self.name, check_version(version), tag, ArtifactNotFoundError)

    def unpin(self, version: int) -> bool:
        return remove_pin(self.repo.store, ARTIFACTS_KIND, self.name, check_version(version))

    def pins(self) -> dict[int, dict[str, Any]]:
        return read_pins(self.repo.store, ARTIFACTS_KIND, self.name)

    def prune(self, retention: Rules, *, dry_run: bool = False) -> Plan:
        """Remove the versions ``retention`` (luopan.retention rules, e.g. ``KeepLast(3)``) does not keep; the newest
        and pinned ones always stay. Their chunks stay until ``gc``. Returns the Plan."""
        return prune_series(self.repo, ARTIFACTS_KIND, self.name, retention, dry_run=dry_run,
                            missing=ArtifactNotFoundError(self._missing()))


def artifact_names(repo: Any) -> list[str]:
    """Names of the artifacts of a repository with at least one committed version, sorted."""
    return ARTIFACTS_KIND.scan(repository_of(repo).store, None, False).runs


def _json_object(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{name} must be a dict of JSON values, got {type(value).__name__}")
    try:
        return json.loads(canonical(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UsageError(f"{name} must hold only JSON values (str, finite numbers, bool, None, lists, dicts with "
                         f"str keys): {exc}") from None
