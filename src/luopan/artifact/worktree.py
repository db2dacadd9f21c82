"""A checked-out folder: its checkout record ``DIR/.luopan-checkout.json`` (what luopan wrote there), what the folder
holds now, and the content digests that tell an untouched file from a local edit (docs/format.md §8.2.1)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import blake3

from .._files import write_atomic
from ..errors import IntegrityError, StorageError
from ..format.canonical import SealError, seal, unseal
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import Row
from ..format.names import show_path
from .ownfiles import RECORD, is_luopans
from .writer import cdc_chunks

RECORD_FORMAT = 1
# A file whose mtime or ctime is this close to the record's time may have been edited within the file system's
# timestamp granularity after it was recorded (git's "racily clean" entries): its digest is computed, not trusted.
RACY_NS = 2_000_000_000
_STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "ino")


def chunk_digest(hashes: Iterable[str]) -> str:
    """A file's digest: BLAKE3 of its chunk hashes (§5.3 cuts) joined by single spaces."""
    return blake3.blake3(" ".join(hashes).encode()).hexdigest()


def entry_digest(entry: dict[str, Any]) -> str:
    """The digest of a file entry of an artifact manifest."""
    return chunk_digest(Row._make(r).hash for r in entry["chunks"])


def file_digest(path: str) -> str:
    """The digest of a local file, cut and hashed as a commit would (never following a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        return chunk_digest(blake3.blake3(c).hexdigest() for c in cdc_chunks(f, size))


def stat_fields(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


@dataclass
class Record:
    """What a checkout wrote into a folder. ``files``: path -> {"digest", "mode", and the stat fields of
    ``_STAT_KEYS`` when known}. ``also``: while ``complete`` is false (a checkout under way), path -> digests of the
    version before that the path may still hold."""

    repository: str
    artifact: str
    version: int
    files: dict[str, dict[str, Any]]
    dirs: list[str]
    complete: bool = True
    written_ns: int = 0
    also: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.artifact}@{self.version}"

    def accepts(self, path: str, digest: str) -> bool:
        """Whether ``digest`` is what this record says luopan left at ``path`` (no local edit)."""
        entry = self.files.get(path)
        return entry is not None and (digest == entry["digest"] or digest in self.also.get(path, ()))

    def to_bytes(self) -> bytes:
        return seal({"checkout_format": RECORD_FORMAT, "repository": self.repository, "artifact": self.artifact,
                     "version": self.version, "complete": self.complete, "written_ns": self.written_ns,
                     "files": self.files, "dirs": sorted(self.dirs), "also": self.also})


class RecordError(IntegrityError):
    """The checkout record of a folder cannot be read: damaged, not luopan's, or unreadable (CLI exit 3)."""


def read_record(root: str) -> Record | None:
    """The record of the folder ``root``; None when it has none. RecordError when it is damaged or not luopan's."""
    path = os.path.join(root, RECORD)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RecordError(f"cannot read the checkout record {path}: {exc.strerror or exc}; remove it, or check out "
                          "with --force (force=True)") from None
    with open(fd, "rb") as f:
        return parse_checkout_record(f.read(MAX_MANIFEST_BYTES + 1), path)


def parse_checkout_record(data: bytes, path: str) -> Record:
    """A checkout record's bytes, read from ``path``, checked; RecordError naming ``path`` when they are not one."""
    try:
        doc = unseal(data)
        files, also = doc["files"], doc["also"]
        rec = Record(doc["repository"], doc["artifact"], doc["version"], files, list(doc["dirs"]),
                     doc["complete"], doc["written_ns"], also)
        ok = (doc["checkout_format"] == RECORD_FORMAT and isinstance(files, dict) and isinstance(also, dict)
              and isinstance(rec.version, int) and isinstance(rec.written_ns, int) and isinstance(rec.artifact, str)
              and all(isinstance(e, dict) and isinstance(e.get("digest"), str) for e in files.values())
              and all(isinstance(d, list) for d in also.values()))
    except (SealError, KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise RecordError(f"{path} is not a checkout record this luopan can read (damaged, or not luopan's): "
                          "remove it, or check out with --force (force=True); every file then counts as untracked")
    return rec


def write_record(root: str, rec: Record) -> None:
    """Replace the record of ``root`` atomically and durably (temporary file, fsync, rename, fsync of ``root``)."""
    rec.written_ns = time.time_ns()
    write_atomic(os.path.join(root, RECORD), rec.to_bytes())


def record_of(root: str, repository: str, doc: dict[str, Any]) -> Record:
    """The record of a checkout of the version ``doc`` that has just been written under ``root``: every file's digest,
    mode and current stat."""
    files = {}
    for e in doc["entries"]:
        if e["type"] == "file":
            st = os.lstat(os.path.join(root, e["path"]))
            files[e["path"]] = {"digest": entry_digest(e), "mode": e["mode"], **stat_fields(st)}
    dirs = [e["path"] for e in doc["entries"] if e["type"] == "dir"]
    return Record(repository, doc["name"], doc["version"], files, dirs)


@dataclass
class Local:
    """What a folder holds now (links never followed): regular files with their lstat, directories, anything else
    (links, FIFOs…) with what it is, and temporary files an interrupted checkout left."""

    files: dict[str, os.stat_result] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    other: dict[str, str] = field(default_factory=dict)
    temps: list[str] = field(default_factory=list)

    def under(self, path: str) -> list[str]:
        """Every file and other entry strictly below the directory ``path``."""
        prefix = path + "/"
        return [p for p in (*self.files, *self.other, *self.dirs) if p.startswith(prefix)]


def scan(root: str) -> Local:
    """Walk the folder ``root`` without following links."""
    local = Local()
    todo = [""]
    while todo:
        rel_dir = todo.pop()
        where = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(where) as it:
                entries = sorted(((e.name, e.stat(follow_symlinks=False)) for e in it), key=lambda p: p[0])
        except OSError as exc:
            raise StorageError(exc.errno or 5, f"cannot read the folder {show_path(where)}: "
                                               f"{exc.strerror or exc}") from None
        for name, st in entries:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if is_luopans(rel):
                if rel != RECORD:
                    local.temps.append(rel)
            elif stat.S_ISDIR(st.st_mode):
                local.dirs.add(rel)
                todo.append(rel)
            elif stat.S_ISREG(st.st_mode):
                local.files[rel] = st
            else:
                local.other[rel] = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
    return local


class Digests:
    """Digests of a folder's files, trusting the record's for a file whose stat it matches (and that is not racily
    clean); the others are read and hashed, once."""

    def __init__(self, root: str, local: Local, rec: Record | None) -> None:
        self.root, self.local, self.rec = root, local, rec
        self._seen: dict[str, str] = {}

    def of(self, path: str) -> str:
        if path not in self._seen:
            self._seen[path] = self._cached(path) or file_digest(os.path.join(self.root, path))
        return self._seen[path]

    def _cached(self, path: str) -> str | None:
        entry = self.rec.files.get(path) if self.rec is not None else None
        if entry is None or not all(k in entry for k in _STAT_KEYS):
            return None
        st = self.local.files[path]
        if stat_fields(st) != {k: entry[k] for k in _STAT_KEYS}:
            return None
        if max(st.st_mtime_ns, st.st_ctime_ns) >= self.rec.written_ns - RACY_NS:  # type: ignore[union-attr]
            return None
        return str(entry["digest"])

