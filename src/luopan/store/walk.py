"""The one walk of a local repository's files (docs/format.md §2): keys of regular files, following symlinks.

Symbolic links inside the repository are followed, to directories and files alike, wherever they point (a run moved
to another disk and linked back stays part of the repository). Every listing of a local store goes through `walk`,
so listing, gc marking, verify, du, replication and prune all see the same keys. A directory already on the path
(a symlink loop) is walked once; a FIFO, socket or device, a dangling link and a directory that cannot be read are
yielded as strays with the reason, never opened.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

from .base import Stray, valid_key

TMP_MARK = ".tmp-"  # temporary files (docs/format.md §2): never keys
ABSENT = (FileNotFoundError, NotADirectoryError)  # a missing file, or a path through a file: no such key
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def file_kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def walk(root: str, prefix: str = "", temporaries: bool = False) -> Iterator[tuple[str, Stray | None]]:
    """(key, None) for every regular file under ``prefix``, following symlinks; (relative path, Stray) for every
    entry that cannot be a key. With ``temporaries``, temp files are yielded as keys too (for cleanup)."""
    rel = prefix.strip("/")
    if rel and not valid_key(rel):
        return
    base = os.path.join(root, *rel.split("/")) if rel else root
    try:
        st = os.stat(base)
    except ABSENT:
        return
    except OSError as exc:
        yield rel or ".", Stray(rel or ".", f"cannot be read ({exc.strerror or exc})", unreadable=True)
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [(base, rel, frozenset({(st.st_dev, st.st_ino)}))]
    while stack:
        d, drel, ancestors = stack.pop()
        try:
            entries = list(os.scandir(d))
        except ABSENT:
            continue  # removed while we walked
        except OSError as exc:
            yield drel, Stray(drel + "/", f"a directory that cannot be read ({exc.strerror or exc})",
                              unreadable=True)
            continue
        for e in entries:
            krel = f"{drel}/{e.name}" if drel else e.name
            if TMP_MARK in e.name:
                if temporaries:
                    yield e.path, None
                continue
            try:
                if e.is_symlink():
                    est = os.stat(e.path)  # follows the link
                elif e.is_dir(follow_symlinks=False):
                    est = e.stat(follow_symlinks=False)
                elif e.is_file(follow_symlinks=False):
                    est = None  # the common case: a regular file, no stat needed
                else:
                    est = e.stat(follow_symlinks=False)
            except ABSENT:
                if e.is_symlink():
                    yield krel, Stray(krel, f"a dangling symbolic link (to {_readlink(e.path)})", unreadable=True)
                continue
            except OSError as exc:
                why = ("a symbolic link loop" if exc.errno == errno.ELOOP
                       else f"cannot be read ({exc.strerror or exc})")
                yield krel, Stray(krel, why, unreadable=exc.errno != errno.ELOOP)
                continue
            if est is None or stat.S_ISREG(est.st_mode):
                if valid_key(krel):
                    yield krel, None
                else:
                    yield krel, Stray(krel, "a file whose name is not a valid key", unreadable=False)
            elif stat.S_ISDIR(est.st_mode):
                ident = (est.st_dev, est.st_ino)
                if ident in ancestors:
                    yield krel, Stray(krel + "/", "a symbolic link loop (a directory containing itself)",
                                      unreadable=False)
                else:
                    stack.append((e.path, krel, ancestors | {ident}))
            else:
                yield krel, Stray(krel, file_kind(est.st_mode), unreadable=False)
