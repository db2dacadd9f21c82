"""Where a ``luopan.sync.Publisher`` writes (docs/format.md §19.4): a directory, or an object store.

* **A directory** (a shared filesystem, or the root of a static web server): publishes are serialized by a flock on
  the directory; each new file and the new index are written to temporary names and fsynced, the files renamed into
  place and their directories fsynced, then the index renamed into place and the directory fsynced.
* **An object store** (``s3://bucket/prefix``, and the other fsspec object stores of ``luopan.store``): each file is
  one whole-object PUT (a reader sees all of it or none), the index is PUT after every file it names has been
  written. There is no lock: one Publisher per target (a second one is refused when it finds an index it did not
  write, as in a directory).

Both read the index back to check no other Publisher wrote, and delete the files no index names after a publish.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from concurrent.futures import Executor, Future
from typing import Any, ContextManager

from .._files import fsync_dir, make_dirs, write_error
from ..channel.files import publish_lock
from ..errors import UsageError
from ..store import KeyNotFound, is_object_url, open_store
from .index import INDEX_NAME, MAX_INDEX_BYTES

FULL_DIR, DELTA_DIR, SUFFIX = "full", "deltas", ".lpsync"
TMP_MARK = ".tmp-"


def open_target(target: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> DirTarget | ObjectTarget:
    """The target a Publisher writes to: an object store for ``s3://…`` (and the other object-store URLs), else a
    directory (a path, or ``file://``)."""
    loc = os.fspath(target)
    if is_object_url(loc):
        return ObjectTarget(loc, storage_options or {})
    if storage_options:
        raise UsageError(f"storage_options apply to object-store targets (s3://…), not to the directory {loc!r}")
    return DirTarget(os.path.abspath(loc[7:] if loc.startswith("file://") else loc))


class DirTarget:
    def __init__(self, root: str) -> None:
        self.root = self.where = root
        make_dirs(root)
        for sub in (FULL_DIR, DELTA_DIR):
            make_dirs(os.path.join(root, sub))

    def lock(self) -> ContextManager[Any]:
        return publish_lock(self.root)

    def clear_temporaries(self) -> None:
        for sub in ("", FULL_DIR, DELTA_DIR):
            d = os.path.join(self.root, sub)
            for name in os.listdir(d):
                if TMP_MARK in name:
                    try:
                        os.unlink(os.path.join(d, name))
                    except (FileNotFoundError, IsADirectoryError):
                        pass

    def read_index(self) -> bytes | None:
        path = os.path.join(self.root, INDEX_NAME)
        try:
            with open(path, "rb") as f:
                return f.read(MAX_INDEX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise write_error(exc, path) from None

    def stage(self, files: list[tuple[str, bytes]], pool: Executor) -> list[Future[str]]:
        """Start writing each file to a temporary name and fsyncing it, on the pool's threads (the caller hashes the
        tensors meanwhile; the syncs overlap)."""
        return [pool.submit(self._write_temporary, name, data) for name, data in files]

    def commit(self, files: list[tuple[str, bytes]], staged: list[Future[str]], index: bytes) -> None:
        """Write the index to a temporary name and fsync it; when the staged files are synced, rename them into
        place and fsync their directories; only then rename the index into place and fsync the directory. Any
        failure removes the temporary files: the previous index is in place."""
        temps: list[str] = []
        try:
            index_tmp = self._write_temporary(INDEX_NAME, index)
            temps.append(index_tmp)
            for f in staged:
                temps.append(f.result())
            for (name, _data), tmp in zip(files, temps[1:]):
                os.replace(tmp, os.path.join(self.root, name))
            for sub in {n.split("/")[0] for n, _d in files}:
                fsync_dir(os.path.join(self.root, sub))
            _place_index(index_tmp, os.path.join(self.root, INDEX_NAME))
        except OSError as exc:
            self.abandon(staged)
            for tmp in temps:
                _unlink(tmp)
            raise write_error(exc, self.root, "the previous index and its files are unchanged") from None
        try:
            fsync_dir(self.root)
        except OSError as exc:
            raise write_error(exc, os.path.join(self.root, INDEX_NAME), placed=True) from None

    def abandon(self, staged: list[Future[str]]) -> None:
        """Remove the temporary files of a publish that does not commit (waiting for their writes to end)."""
        for f in staged:
            try:
                _unlink(f.result())
            except OSError:
                pass

    def _write_temporary(self, name: str, data: bytes) -> str:
        tmp = f"{os.path.join(self.root, name)}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def remove_unlisted(self, keep: set[str], newest: int) -> None:
        """Delete the ``.lpsync`` files not in ``keep`` and not of a version after ``newest`` (a newer Publisher's).
        Best effort: what a failure leaves, a later publish deletes."""
        for sub in (FULL_DIR, DELTA_DIR):
            d = os.path.join(self.root, sub)
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                if _removable(f"{sub}/{name}", keep, newest) and TMP_MARK not in name:
                    try:
                        _unlink(os.path.join(d, name))
                    except OSError:
                        pass


class ObjectTarget:
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.store = open_store(url, **storage_options)
        self.where = url.rstrip("/")

    def lock(self) -> ContextManager[Any]:
        return contextlib.nullcontext()  # object stores have no lock: one Publisher per target

    def clear_temporaries(self) -> None:
        pass  # a PUT is whole or absent: no temporaries

    def read_index(self) -> bytes | None:
        try:
            return self.store.get_range(INDEX_NAME, 0, MAX_INDEX_BYTES + 1)
        except KeyNotFound:
            return None
        except OSError as exc:
            raise write_error(exc, f"{self.where}/{INDEX_NAME}") from None

    def stage(self, files: list[tuple[str, bytes]], pool: Executor) -> list[Future[None]]:
        """Start the PUT of each file on the pool's threads."""
        return [pool.submit(self.store.put, name, data) for name, data in files]

    def commit(self, files: list[tuple[str, bytes]], staged: list[Future[None]], index: bytes) -> None:
        """When every file's PUT has succeeded, PUT the index: a reader never finds an index naming a file that is
        not whole."""
        try:
            for f in staged:
                f.result()
            self.store.put(INDEX_NAME, index)
        except OSError as exc:
            self.abandon(staged)
            raise write_error(exc, self.where, "the previous index is unchanged (files it does not name may have "
                                               "been written; the next publish deletes them)") from None

    def abandon(self, staged: list[Future[None]]) -> None:
        for f in staged:
            try:
                f.result()
            except OSError:
                pass

    def remove_unlisted(self, keep: set[str], newest: int) -> None:
        for sub in (FULL_DIR, DELTA_DIR):
            try:
                keys = list(self.store.list(sub + "/"))
                for key in keys:
                    if _removable(key, keep, newest):
                        self.store.delete(key)
            except OSError:
                continue


def _removable(name: str, keep: set[str], newest: int) -> bool:
    """Whether a file of the target may be deleted after the publish of version ``newest`` that keeps ``keep``: a
    ``.lpsync`` file not kept, unless its name says it is of a later version (``full/<v>-…``,
    ``deltas/<from>-<to>-…``: a newer Publisher's, published meanwhile)."""
    if name in keep or not name.endswith(SUFFIX):
        return False
    parts = name.split("/", 1)[-1].split("-")
    version = parts[0] if name.startswith(FULL_DIR + "/") else (parts[1] if len(parts) > 2 else "")
    return not (version.isdigit() and int(version) > newest)


def _place_index(tmp: str, path: str) -> None:
    """Rename the new index into place: the step that publishes (a seam the kill tests stop at)."""
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
