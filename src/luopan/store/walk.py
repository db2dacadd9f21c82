"""The one walk of a local repository's files (docs/format.md §2): keys of regular files, following symlinks.

Symbolic links inside the repository are followed, to directories and files alike, wherever they point (a run moved
to another disk and linked back stays part of the repository). Every listing of a local store goes through `walk`,
so listing, gc marking, verify, du, replication and prune all see the same keys. A directory already on the path
(a symlink loop) is walked once; a FIFO, socket or device, a dangling link and a directory that cannot be read are
yielded as strays with the reason, never opened.

The search for temporary files (``temporaries=True``: cleanup at open and in gc, the doctor) follows a link to a
directory only where luopan writes files (``KEY_DIRS``: a run or pack directory moved to another disk and linked
back), and below a followed link enters only such directories: a temporary file lies beside the file it becomes, so a
link planted anywhere else (``locks/x -> /``) costs one stat instead of a walk of whatever it points at, and a file
there that merely looks like a temporary is never deleted. Real directories of the store itself are all searched.
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


MAX_DEPTH = 16  # path components below the root: luopan's deepest keys have 12 (refs/pins/_artifacts/<8 parts>/<v>.json)

# The directories luopan writes files in (docs/format.md §2, §16, §17, §10.2), as patterns of path components: "*"
# is one name, "+" one to eight (an artifact or index name). A directory is entered by the search for temporaries
# only when it is, or can lead to, one of these.
KEY_DIRS = (
    "packs/*", "index", "locks", "gc", "runs/*/ckpt", "runs/*/evals",
    "artifacts/+/_v", "journals/*/log", "journals/*/_v", "indexes/+/log", "indexes/+/_v",
    "refs/runs/*", "refs/pins/*", "refs/pins/_artifacts/+", "refs/pins/_journals/*", "refs/pins/_indexes/+",
    "refs/indexes/+", "refs/signatures/*/*",
    "refs/links/*/*", "refs/links/_artifacts/+/*", "refs/links/_journals/*/*", "refs/links/_indexes/+/*",
    "tier/*/*", "tier/*/_artifacts/+", "tier/*/_journals/*", "tier/*/_indexes/+",
)
_PATTERNS = tuple(tuple(p.split("/")) for p in KEY_DIRS)
MAX_NAME_PARTS = 8


def _leads_to(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether the directory ``parts`` is a directory of ``pattern`` or on the way to one."""
    if not parts:
        return True
    if not pattern:
        return False
    head = pattern[0]
    if head == "+":
        return any(_leads_to(parts[n:], pattern[1:]) if n < len(parts) else True
                   for n in range(1, MAX_NAME_PARTS + 1))
    return (head == "*" or head == parts[0]) and _leads_to(parts[1:], pattern[1:])


def may_hold_files(rel: str) -> bool:
    """Whether luopan may write files in the directory ``rel`` (relative to the root, "" for the root) or below it."""
    parts = tuple(rel.split("/")) if rel else ()
    return any(_leads_to(parts, p) for p in _PATTERNS)


def walk(root: str, prefix: str = "", temporaries: bool = False) -> Iterator[tuple[str, Stray | None]]:
    """(key, None) for every regular file under ``prefix``, following symlinks; (relative path, Stray) for every
    entry that cannot be a key. With ``temporaries``, temporary files (regular files only) are yielded as absolute
    paths too, for cleanup — and a link to a directory, or a directory below one, is entered only where luopan
    writes files (``may_hold_files``): what lies elsewhere is not walked (nor reported).

    Each directory is walked once: one reached again through a link below itself (a loop) is skipped, and one
    reached again through another link (two names for one directory) is a stray marked ``unreadable`` — which name
    is luopan's is ambiguous, so gc must not trust the walk. This also bounds the walk: a tree of links cannot make
    it visit exponentially many paths.
    """
    rel = prefix.strip("/")
    if rel and not valid_key(rel):
        return
    base = os.path.join(root, *rel.split("/")) if rel else root
    try:
        st = os.stat(base)
    except ABSENT:
        dangling = _dangling_component(root, rel)
        if dangling is not None:  # e.g. runs -> a disk that is not mounted: what lies there is unseen, not absent
            yield dangling, Stray(dangling, f"a dangling symbolic link (to {_readlink(os.path.join(root, dangling))})",
                                  unreadable=True)
        return
    except OSError as exc:
        yield rel or ".", Stray(rel or ".", f"cannot be read ({exc.strerror or exc})", unreadable=True)
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    first: dict[tuple[int, int], str] = {(st.st_dev, st.st_ino): rel}  # directory -> the path it was walked under
    stack = [(base, rel, frozenset({(st.st_dev, st.st_ino)}), False)]  # the root (or prefix) asked for: not "linked"
    while stack:
        d, drel, ancestors, linked = stack.pop()  # linked: reached through a symbolic link
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)  # a stable walk: the same alias is first each time
        except ABSENT:
            continue  # removed while we walked
        except OSError as exc:
            yield drel, Stray(drel + "/", f"a directory that cannot be read ({exc.strerror or exc})",
                              unreadable=True)
            continue
        for e in entries:
            krel = f"{drel}/{e.name}" if drel else e.name
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
                if e.is_symlink() and TMP_MARK not in e.name:
                    yield krel, Stray(krel, f"a dangling symbolic link (to {_readlink(e.path)})", unreadable=True)
                continue
            except OSError as exc:
                why = ("a symbolic link loop" if exc.errno == errno.ELOOP
                       else f"cannot be read ({exc.strerror or exc})")
                yield krel, Stray(krel, why, unreadable=exc.errno != errno.ELOOP)
                continue
            if est is not None and stat.S_ISDIR(est.st_mode):
                ident = (est.st_dev, est.st_ino)
                if ident in ancestors:
                    yield krel, Stray(krel + "/", "a symbolic link loop (a directory containing itself)")
                elif ident in first:
                    yield krel, Stray(krel + "/", f"the same directory as {first[ident] or '.'}/ (two names for one "
                                                  "directory: remove one link)", unreadable=True)
                elif krel.count("/") >= MAX_DEPTH:
                    yield krel, Stray(krel + "/", f"nested deeper than {MAX_DEPTH} directories")
                elif temporaries and (linked or e.is_symlink()) and not may_hold_files(krel):
                    continue  # a link to where luopan writes nothing: no temporary file of its can be there
                else:
                    first[ident] = krel
                    stack.append((e.path, krel, ancestors | {ident}, linked or e.is_symlink()))
            elif TMP_MARK in e.name:  # a temporary file (docs/format.md §2): never a key
                if temporaries and (est is None or stat.S_ISREG(est.st_mode)):
                    yield e.path, None
            elif est is None or stat.S_ISREG(est.st_mode):
                if valid_key(krel):
                    yield krel, None
                else:
                    yield krel, Stray(krel, "a file whose name is not a valid key")
            else:
                yield krel, Stray(krel, file_kind(est.st_mode))


def list_dir(root: str, prefix: str) -> list[str]:
    """Keys of the regular files directly in directory ``prefix`` (following symlinks), not below it. Raises
    OSError when the directory exists but cannot be read."""
    rel = prefix.strip("/")
    base = os.path.join(root, *rel.split("/")) if rel else root
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except ABSENT:
        return []
    out = []
    for e in entries:
        if TMP_MARK in e.name:
            continue
        try:
            regular = e.is_file(follow_symlinks=True)
        except OSError:
            continue
        key = f"{rel}/{e.name}" if rel else e.name
        if regular and valid_key(key):
            out.append(key)
    return out


def _dangling_component(root: str, rel: str) -> str | None:
    """The first path component of ``rel`` (relative to ``root``) that is a dangling symbolic link, if any."""
    path = root
    parts = rel.split("/") if rel else []
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        if not os.path.exists(path):
            return "/".join(parts[: i + 1]) if os.path.lexists(path) else None
    return None
