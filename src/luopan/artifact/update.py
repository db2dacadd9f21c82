"""Checking a version out into a folder that exists: only what differs is written, files the version no longer has are
removed, and local changes are never overwritten without ``force`` (docs/format.md §8.2.1).

The order is the crash rule: (1) a record naming the new version that also accepts every file's old digest, durable
before anything changes; (2) removals, new directories, then each changed file written beside its path, fsync'd and
renamed over it; (3) every directory touched fsync'd; (4) the final record. A crash leaves every file old or new, and
the same checkout run again finds nothing in its way and finishes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._files import fsync_dir, write_error
from ..errors import CheckoutConflictError, LockedError, LuopanError, UsageError
from ..format.names import show_path
from ..store.base import Store
from .checkout import CHECKOUT_MODE_MASK, write_files
from .ownfiles import FILE_TMP_PREFIX, RECORD, is_luopans
from .worktree import Digests, Local, Record, RecordError, entry_digest, read_record, record_of, scan, \
    write_record

MAX_LISTED = 20  # paths named in a conflict's message


@dataclass
class Plan:
    write: list[dict[str, Any]] = field(default_factory=list)  # file entries to write
    keep: list[dict[str, Any]] = field(default_factory=list)  # file entries already there
    unlink: list[str] = field(default_factory=list)  # local files (and links) to remove
    trees: list[str] = field(default_factory=list)  # directories in the way, removed whole (force)
    rmdirs: list[str] = field(default_factory=list)  # directories to remove once empty
    mkdirs: list[str] = field(default_factory=list)
    conflicts: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    @property
    def changes(self) -> bool:
        return bool(self.write or self.unlink or self.trees or self.rmdirs or self.mkdirs)


def lock_folder(root: str) -> int:
    """An exclusive flock on the folder itself: one checkout at a time updates it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(f"another checkout is updating {root}: wait for it to finish, then check out again") from None
    return fd


def plan_update(root: str, doc: dict[str, Any], local: Local, rec: Record | None, force: bool) -> Plan:
    """What checking the version ``doc`` out over ``local`` does, and what stands in its way."""
    digests = Digests(root, local, rec)
    files = {e["path"]: e for e in doc["entries"] if e["type"] == "file"}
    dirs = {e["path"] for e in doc["entries"] if e["type"] == "dir"}
    plan = Plan()

    def clean(path: str) -> bool:
        return rec is not None and path in local.files and rec.accepts(path, digests.of(path))

    def what(path: str) -> str:
        if rec is not None and path in rec.files:
            return "edited since it was checked out"
        return "not from a checkout (untracked)"

    def removable_dir(path: str) -> bool:
        """A local directory at a path the version needs for a file: it goes if it holds only clean files."""
        below = local.under(path)
        return all(p in local.dirs or (p in local.files and clean(p)) for p in below)

    def clear(path: str, why: str) -> None:
        """Something at ``path`` must go for the version's file or directory to take its place."""
        if path in local.dirs:
            if force:
                plan.trees.append(path)
            elif removable_dir(path):
                plan.unlink.extend(p for p in local.under(path) if p in local.files)
                plan.rmdirs.extend(p for p in local.under(path) if p in local.dirs)
                plan.rmdirs.append(path)
            else:
                plan.conflicts.append((path, f"a directory with files of its own, where {why}"))
        elif path in local.other:
            if force:
                plan.unlink.append(path)
            else:
                plan.conflicts.append((path, f"{local.other[path]}, where {why}"))
        elif path in local.files:
            if force or clean(path):
                plan.unlink.append(path)
            else:
                plan.conflicts.append((path, f"{what(path)}, where {why}"))

    for path in sorted(dirs, key=lambda p: p.count("/")):
        if path not in local.dirs:
            if path in local.files or path in local.other:
                clear(path, "the version has a directory")
            plan.mkdirs.append(path)
    for path, e in files.items():
        if path in local.files:
            if digests.of(path) == entry_digest(e):
                plan.keep.append(e)
            elif force or clean(path):
                plan.write.append(e)
            else:
                plan.conflicts.append((path, what(path)))
        else:
            if path in local.dirs or path in local.other:
                clear(path, "the version has a file")
            plan.write.append(e)
    for path in local.files:
        if path in files or path in dirs or rec is None or path not in rec.files:
            continue  # the version's, handled above; or not luopan's: left alone
        if force or clean(path):
            plan.unlink.append(path)
        else:
            plan.conflicts.append((path, "edited since it was checked out, and the version does not have it"))
    if rec is not None:  # directories of the version before that this one lacks: removed when nothing else is there
        plan.rmdirs.extend(p for p in rec.dirs if p in local.dirs and p not in dirs and p not in plan.rmdirs)
    gone = tuple(t + "/" for t in plan.trees)  # what lies below a tree removed whole goes with it
    plan.unlink = sorted(p for p in set(plan.unlink) if not p.startswith(gone))
    plan.rmdirs = sorted({p for p in plan.rmdirs if not p.startswith(gone)}, key=lambda p: -p.count("/"))
    return plan


def conflict_error(root: str, ref: str, conflicts: list[tuple[str, str]]) -> CheckoutConflictError:
    shown = "; ".join(f"{show_path(p, 200)} ({why})" for p, why in conflicts[:MAX_LISTED])
    more = f"; … {len(conflicts) - MAX_LISTED} more" if len(conflicts) > MAX_LISTED else ""
    exc = CheckoutConflictError(
        f"checking out {ref} into {root} would overwrite or remove {len(conflicts)} local change(s): {shown}{more}. "
        "Nothing was changed. Commit them first (luopan artifact commit), move them away, or check out with --force "
        "(Python: force=True) to discard them")
    exc.paths = [p for p, _why in conflicts]
    return exc


def refuse_own_files(doc: dict[str, Any]) -> None:
    """A version holding a file with the name of luopan's own files in a folder (committed as a mapping by an older
    luopan) cannot be checked out: its file and the record would be one."""
    own = [e["path"] for e in doc["entries"] if is_luopans(e["path"])]
    if own:
        raise UsageError(f"{doc['name']}@{doc['version']} has a file named {show_path(own[0], 200)}, a name luopan "
                         f"keeps for its own files in a checked-out folder ({RECORD}, {FILE_TMP_PREFIX}*): commit it "
                         "again without that file (or under another name), then check that version out")


def update(store: Store, owner: str, doc: dict[str, Any], root: str, repository: str, *, force: bool,
           progress: Callable[[int], Any] | None) -> str:
    """Check the version ``doc`` out into the existing folder ``root`` (see the module docstring); returns ``root``."""
    ref = f"{doc['name']}@{doc['version']}"
    refuse_own_files(doc)
    lock = lock_folder(root)
    try:
        try:
            rec = read_record(root)
        except RecordError:
            if not force:
                raise
            rec = None
        local = scan(root)
        for tmp in local.temps:  # left by a checkout that died: this one holds the folder's lock
            os.unlink(os.path.join(root, tmp))
        plan = plan_update(root, doc, local, rec, force)
        if plan.conflicts:
            raise conflict_error(root, ref, plan.conflicts)
        if plan.changes or rec is None or rec.ref != ref or not rec.complete:
            write_record(root, _pending(rec, doc, repository))
            _apply(store, owner, doc, root, plan, progress)
        elif progress is not None:
            for e in plan.keep:
                progress(e["size"])
        for e in doc["entries"]:  # modes of what was kept (and of directories): only where they differ
            path = os.path.join(root, e["path"])
            if os.stat(path).st_mode & CHECKOUT_MODE_MASK != e["mode"] & CHECKOUT_MODE_MASK:
                os.chmod(path, e["mode"] & CHECKOUT_MODE_MASK)
        write_record(root, record_of(root, repository, doc))
    except OSError as exc:
        if isinstance(exc, LuopanError):
            raise
        where = os.fsdecode(exc.filename) if exc.filename else root
        raise write_error(exc, where, "files already written hold the new version, the others the old one: check "
                                      "out again to finish") from None
    finally:
        os.close(lock)
    return root


def _pending(rec: Record | None, doc: dict[str, Any], repository: str) -> Record:
    """The record written before anything changes: the new version's files, each also accepting the digest the record
    before accepted for it, and the files of the version before (so that a rerun after a crash removes them)."""
    files: dict[str, dict[str, Any]] = {}
    also: dict[str, list[str]] = {}
    for e in doc["entries"]:
        if e["type"] == "file":
            files[e["path"]] = {"digest": entry_digest(e), "mode": e["mode"]}
    if rec is not None:
        for path, old in rec.files.items():
            before = [old["digest"], *rec.also.get(path, [])]
            if path in files:
                also[path] = sorted(set(before) - {files[path]["digest"]})
            else:
                files[path] = {"digest": old["digest"], "mode": old.get("mode", 0o644)}
                also[path] = rec.also.get(path, [])
    dirs = [e["path"] for e in doc["entries"] if e["type"] == "dir"] + (rec.dirs if rec is not None else [])
    return Record(repository, doc["name"], doc["version"], files, sorted(set(dirs)), complete=False,
                  also={p: d for p, d in also.items() if d})


def _apply(store: Store, owner: str, doc: dict[str, Any], root: str, plan: Plan,
           progress: Callable[[int], Any] | None) -> None:
    touched = set()

    def at(path: str) -> str:
        touched.add(os.path.dirname(os.path.join(root, path)))
        return os.path.join(root, path)

    for path in plan.trees:
        shutil.rmtree(at(path))
    for path in plan.unlink:
        os.unlink(at(path))
    for path in plan.rmdirs:
        try:
            os.rmdir(at(path))
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise  # a directory that still holds files luopan does not know stays
    for path in plan.mkdirs:  # parents first; each synced into its parent below, before any file in it is renamed
        os.mkdir(at(path), 0o700)
        touched.add(os.path.join(root, path))
    for d in sorted(touched, key=lambda p: p.count(os.sep)):
        if os.path.isdir(d):
            fsync_dir(d)
    if progress is not None:
        for e in plan.keep:
            progress(e["size"])
    write_files(store, owner, doc, plan.write, root, progress, replace=True)
    for e in plan.write:
        touched.add(os.path.dirname(os.path.join(root, e["path"])))
    for d in sorted(touched, key=lambda p: -p.count(os.sep)):
        if os.path.isdir(d):  # not one removed
            fsync_dir(d)
