"""Which filesystem a local repository lives on, and whether luopan's atomic writes are durable there.

luopan commits with write → fsync → rename → fsync(directory) (docs/format.md §10). On a local disk filesystem
(ext4, xfs, btrfs, zfs …) a committed checkpoint survives a crash or power loss. Some filesystems break that
promise: memory-backed ones lose everything at reboot, some network and FUSE filesystems acknowledge fsync before
the data is stored or implement rename as copy + delete, and a container's overlay layer vanishes with the
container. The mount comes from ``/proc/self/mountinfo`` (Linux); ``classify`` says why a type is a risk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .context import Context
from .finding import Finding, ok, warn

MOUNTINFO = "/proc/self/mountinfo"

_MEMORY = "memory-backed: everything in it is lost at reboot or power loss, and fsync reaches no disk"
_TO_DISK = "move the repository to a disk, or replicate it (`luopan replicate --to URL`)"
_NETWORK_FIX = ("keep the repository on a local disk filesystem (ext4, xfs, btrfs, zfs) and replicate it "
                "(`luopan replicate --to URL`), or use an object store URL (s3://…)")
_NFS = ("a network filesystem: whether fsync and rename reach the server's disk depends on its export options (an "
        "`async` export acknowledges fsync before the data is stored), and other hosts may see stale listings")
_SMB = ("a network filesystem (SMB): fsync and rename durability depend on the server and the cache mode, and file "
        "locks may be emulated")
_OVERLAY = ("a container's overlay filesystem: the repository vanishes with the container's writable layer, and "
            "fsync and rename go through copy-up")
_FUSE = ("a FUSE filesystem: many (s3fs, gcsfuse, sshfs, rclone) implement rename as copy + delete, which is not "
         "atomic, and fsync may not reach storage")
_GUEST_DISK = "keep the repository on the guest's own disk"
RISKS: dict[str, tuple[str, str]] = {  # fstype -> (why, what to do)
    "tmpfs": (_MEMORY, _TO_DISK),
    "ramfs": (_MEMORY, _TO_DISK),
    "nfs": (_NFS, "check that the export is `sync`, or " + _NETWORK_FIX),
    "cifs": (_SMB, _NETWORK_FIX),
    "overlay": (_OVERLAY, "mount a volume (a host directory) for the repository"),
    "9p": ("a 9p host share (a VM or WSL): fsync may not reach the host's disk, and rename semantics vary",
           _GUEST_DISK + ", or share the host directory another way (virtiofs)"),
    "vboxsf": ("a VirtualBox shared folder: fsync and rename are not reliably passed to the host's disk", _GUEST_DISK),
    "vfat": ("FAT has no journal: a crash during a write can leave a rename half done",
             "use a journaling filesystem (ext4, xfs, btrfs) for the repository"),
    "fuse": (_FUSE, "use the object store's URL directly (s3://…, gs://…), or a local disk filesystem"),
}
ALIASES = {"nfs4": "nfs", "smb3": "cifs", "smbfs": "cifs", "aufs": "overlay", "overlayfs": "overlay",
           "exfat": "vfat", "msdos": "vfat"}


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """Mount points escape space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/self/mountinfo`` text, in its order (later mounts hide earlier ones on the same
    point). Lines that do not parse are skipped."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]) if len(tail) > 1 else ""))
    return mounts


def mount_for(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount ``path`` (absolute, links resolved) is on: the longest mount point containing it, the last one
    mounted when several share it."""
    best: Mount | None = None
    for m in mounts:
        point = m.point.rstrip("/") or "/"
        inside = point == "/" or path == point or path.startswith(point + "/")
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = m
    return best


def mount_of(path: str) -> Mount | None:
    """The mount of ``path`` (or of its nearest existing parent), from /proc/self/mountinfo; None where that
    cannot be read (not Linux)."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            mounts = parse_mountinfo(f.read())
    except OSError:
        return None
    real = os.path.realpath(path)
    while not os.path.exists(real) and os.path.dirname(real) != real:
        real = os.path.dirname(real)
    return mount_for(real, mounts)


def classify(fstype: str) -> tuple[str, str] | None:
    """(why, what to do) when luopan's writes are not durable on ``fstype``; None when they are (as far as known)."""
    base = ALIASES.get(fstype, fstype)
    if base.startswith("fuse.") or base == "fuse":
        base = "fuse"
    return RISKS.get(base)


def check_filesystem(ctx: Context) -> list[Finding]:
    root = getattr(ctx.local, "root", None)
    if root is None:
        return [ok("filesystem", f"{ctx.where} is not a local directory: object stores write each file atomically, "
                                 "no rename or fsync involved")]
    m = ctx.mount_of(root)
    if m is None:
        return [ok("filesystem", f"filesystem of {root} unknown (no {MOUNTINFO}): not checked")]
    risk = classify(m.fstype)
    where = f"{root} is on {m.fstype} (mounted at {m.point}" + (f" from {m.source}" if m.source else "") + ")"
    if risk is None:
        return [ok("filesystem", f"{where}: rename and fsync are durable")]
    why, fix = risk
    return [warn("filesystem", f"{where}, {why}", fix)]
