"""``luopan.channel.publish``: add a checkpoint to a static update channel (docs/format.md §15).

A channel is a directory any web server can serve as it is:

    index.json                                    signed index, written last
    full/00000003-1a2b3c4d5e6f7a8b.safetensors    the full file of each listed version (``repo.export``)
    patches/00000001-00000003-9c8d….lpatch        a patch from each of the last ``keep`` versions to the newest

Write order (§15.5): the current index must verify against the signing key (or a key given as trusted, to move
the channel to a new key), and every file the new index keeps from it must still have its listed size and BLAKE3 —
publish never signs what it did not check. The new full file and patches are written in a fresh scratch directory
that publish creates itself (a random name, mode 0700, in a private container beside the channel — not served — or
in ``.tmp/`` inside it when the parent cannot hold it; a link in the way is never followed), read back, hashed and
fsynced through descriptors of the files luopan wrote and renamed into place from that directory's descriptor, so
the bytes the index lists are the bytes luopan wrote; the index naming them is written after, atomically; only then are files that neither the new index nor the
one it replaced names deleted — a file leaves one publish after its last index, so a device that read the previous
index keeps its download. A reader never sees an index naming a missing file (except one deleted by a *later*
publish, which a pull meets as "missing" and answers by reading the index again). Publishing content equal to the
newest version's only renews the index (a new index version and expiry, the same files).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from typing import Any

from .._files import PATH_ERRNOS, make_dirs, write_error
from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    SignatureError,
    UnsignedError,
    UntrustedKeyError,
    UsageError,
)
from ..format.names import check_run, check_step, is_run_name
from ..patch.basefile import hash_file
from ..patch.creating import create
from ..repo import Repo
from ..repo import open as open_repo
from ..signing import SigningKey, TrustedKeys, load_signing_key
from ..store.tempfiles import cleanup_failed
from ..units import parse_duration
from .files import Scratch, fd_blake3, fsync_dir, make_scratch, publish_lock, real_dir, write_atomic
from .index import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    MAX_INDEX_VERSION,
    ChannelIndex,
    ChannelVersion,
    FileRef,
    PatchRef,
    encode_index,
    format_time,
    parse_index,
)

MAX_KEEP = 100
TMP_DIR = ".tmp"
# In a channel without an index, present while its first publish runs (written durably before any file is moved in,
# removed once the index is): files beside it were never named by an index, so a rerun after a crash may replace
# them (without it they mean a lost index, and the index version counter with it)
FIRST = ".publish-first"
FULL_TMP, PATCH_TMP = "full.safetensors", "patch.lpatch"  # names in the scratch directory


def publish(
    repo: Any,
    run: str,
    step: int | None,
    channel_dir: str | os.PathLike[str],
    *,
    sign_key: SigningKey | str | os.PathLike[str],
    keep: int = 5,
    expires: str | float = "30d",
    subtree: str | None = None,
    name: str | None = None,
    trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None,
    min_version: int | None = None,
    progress: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Publish checkpoint ``step`` of ``run`` (the latest when None; its tensors under ``subtree``, e.g.
    ``"model"``) as the newest version of the channel in ``channel_dir`` (created when missing).

    Writes the version's full safetensors file, a patch (luopan.patch.create) from each of the last ``keep``
    listed versions to it, and a new index signed with ``sign_key`` (a SigningKey or ``.key`` file) whose version
    is the previous index's + 1 and which expires ``expires`` from now (a duration such as ``"30d"``, or seconds).
    The channel's name (``name``, default the directory's name), chunk size (the repository's) and subtree are
    fixed by its first publish; a later publish that differs is refused (UsageError). One publish at a time
    (LockedError). ``progress(message)`` is told each step.

    The channel's current index must be signed by ``sign_key`` or by a key in ``trusted_keys`` (a directory of
    ``*.pub`` or a TrustedKeys: the old key, when moving a channel to a new one); else UnsignedError,
    UntrustedKeyError or SignatureError, and nothing is written. A file it names that the new index keeps must have
    its listed size and BLAKE3 (IntegrityError). ``min_version``: the new index's version is at least this — to
    start a channel whose index was lost above every version devices have seen; a channel directory that holds
    published files but no index is refused without it (UsageError).

    Returns a summary: channel, name, index_version, version, refreshed, expires, full, patches, removed.
    """
    lifetime = _check_options(keep, expires, min_version)
    key = sign_key if isinstance(sign_key, SigningKey) else load_signing_key(sign_key)
    trusted = trusted_keys if isinstance(trusted_keys, TrustedKeys) or trusted_keys is None else \
        TrustedKeys.load(trusted_keys)
    check_run(run)
    r = repo if isinstance(repo, Repo) else open_repo(repo, create=False, replicate=False)
    step = r.manifest(run, None if step is None else check_step(step)).step
    say = progress or (lambda _msg: None)
    root = os.fspath(channel_dir)
    _make_channel_dirs(root)
    with publish_lock(root):
        prev = _previous(root, key, trusted, min_version)
        chunk_size = r.config.chunk_size
        channel = _settle(prev, name, os.path.basename(os.path.abspath(root)), chunk_size, subtree)
        version = max((prev.version if prev else 0) + 1, min_version or 1)
        if version > MAX_INDEX_VERSION:
            raise UsageError(f"the channel {root} has used every index version: start a new channel")
        if prev is None and (_is_file(os.path.join(root, FIRST)) or not _published_files(root)):
            # only a channel nothing was ever published into (or whose first publish was cut short) gets the mark:
            # a --min-version publish over a lost index, cut short, must leave the lost-index guard standing
            write_atomic(os.path.join(root, FIRST), b"the first publish of this channel is running or was cut short: "
                         b"no index named the files beside this one\n")
        scratch = make_scratch(scratch_candidates(root), os.stat(root).st_dev)
        try:
            say(f"exporting {run} step {step}" + (f" ({subtree})" if subtree else ""))
            r.export(run, step, scratch.file(FULL_TMP), subtree=subtree)
            fd = scratch.open_written(FULL_TMP)  # what is fingerprinted, hashed and moved is what luopan wrote
            try:
                fingerprint = hash_file(fd, scratch.file(FULL_TMP), chunk_size).fingerprint
            finally:
                os.close(fd)
            if prev is not None and prev.latest.fingerprint == fingerprint:
                say(f"{run} step {step} is the newest version's content: renewing the index only")
                _renew(root, scratch, prev, say)
                new, versions, patches = prev.latest, prev.versions, prev.patches
            else:
                # devices on a version with the new content are up to date already: no patch from it
                sources = [v for v in (prev.versions if prev else ()) if v.fingerprint != fingerprint]
                sources = sources[-keep:] if keep else []
                _check_files(root, [v.full for v in sources], say)
                new = ChannelVersion(version, run, step, fingerprint, _place(scratch, FULL_TMP, root, "full",
                                                                             f"{version:08d}", ".safetensors"))
                patches = tuple(_patch(r, root, scratch, v, new, subtree, key, say) for v in sources)
                versions = (*sources, new)
            now = time.time()  # after the work: the index is valid for `expires` from when devices can see it
            index = ChannelIndex(channel, version, format_time(now), format_time(now + lifetime), chunk_size,
                                 subtree, versions, patches, None)
            data = encode_index(index, key)
            say(f"writing {INDEX_NAME} (version {version}, expires {index.expires})")
            write_atomic(os.path.join(root, INDEX_NAME), data)  # last: every file it names is in place and durable
            _clear_first(root)
            removed = _remove_unlisted(root, index, prev)
        finally:
            scratch.remove()
    return {
        "channel": root, "name": channel, "index_version": version, "version": new.version,
        "refreshed": new.version != version, "expires": index.expires,
        "full": {"name": new.full.name, "size": new.full.size, "blake3": new.full.blake3},
        "patches": [{"from": p.source, "to": p.target, "name": p.file.name, "size": p.file.size} for p in patches],
        "removed": removed,
    }


def _check_options(keep: int, expires: str | float, min_version: int | None) -> float:
    """The index's lifetime in seconds; UsageError for a ``keep``, ``expires`` or ``min_version`` out of range."""
    if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= MAX_KEEP:
        raise UsageError(f"keep is {keep!r}: give how many earlier versions get a patch, 0 to {MAX_KEEP}")
    lifetime = parse_duration(expires) if isinstance(expires, str) else float(expires)
    if not 1 <= lifetime <= 10 * 365 * 86400:
        raise UsageError(f"expires {expires!r}: an index must expire between 1 s and 10 years after it is published")
    if min_version is not None and (not isinstance(min_version, int) or isinstance(min_version, bool)
                                    or not 1 <= min_version <= MAX_INDEX_VERSION):
        raise UsageError(f"min_version is {min_version!r}: give an index version from 1 to {MAX_INDEX_VERSION}")
    return lifetime


def _make_channel_dirs(root: str) -> None:
    """The channel's ``full/`` and ``patches/`` (and ``root``), created when missing and synced into their parents
    (the index written later is inside); each must be a real directory, not a link."""
    try:
        for d in ("full", "patches"):
            make_dirs(os.path.join(root, d))
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise write_error(exc, root, "nothing was published") from None
        raise UsageError(f"cannot create the channel directory {root}: {exc.strerror or exc}") from None
    for d in ("full", "patches"):  # files are renamed into them and deleted from them: never through a link
        real_dir(os.path.join(root, d), "the channel's directory")


def _renew(root: str, scratch: Scratch, prev: ChannelIndex, say: Callable[[str], Any]) -> None:
    """Before a new index over the same versions (the exported file in ``scratch`` is the newest version's content):
    put the export in place of the listed full file when it has the very bytes listed, and check every other file
    the index keeps (IntegrityError)."""
    kept = list(prev.files())
    listed = prev.latest.full
    fd = scratch.open_written(FULL_TMP)
    try:
        same = fd_blake3(fd) == (listed.size, listed.blake3)
        if same:  # the very bytes: put them in place again
            scratch.sync(fd, FULL_TMP)
    finally:
        os.close(fd)
    if same:
        scratch.move(FULL_TMP, os.path.join(root, *listed.name.split("/")))
        kept.remove(listed)
    _check_files(root, kept, say)


def scratch_candidates(root: str) -> list[tuple[str, str]]:
    """Where the publisher's scratch directory for the channel ``root`` may go, as (parent, container): in
    ``.<name>.publish-tmp`` beside the channel, so nothing unfinished or unpublished is ever under the served
    directory; else in ``<root>/.tmp`` (the parent is not writable, or is another file system). Each publish makes a
    fresh directory of a random name inside (files.make_scratch) and removes it when done."""
    real = os.path.realpath(root)
    parent, base = os.path.split(real)
    return ([(parent, f".{base}.publish-tmp")] if base else []) + [(real, TMP_DIR)]


def _previous(root: str, key: SigningKey, trusted: TrustedKeys | None, min_version: int | None
              ) -> ChannelIndex | None:
    """The channel's current index, its signature checked against ``key`` and ``trusted``; None for a new channel
    (UsageError when the channel has published files but lost its index, unless ``min_version`` is given)."""
    path = os.path.join(root, INDEX_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
    except FileNotFoundError:
        _check_no_leftovers(root, min_version)
        return None
    prev = parse_index(data, path)
    keys = {key.key_id: key.private.public_key(), **(trusted.keys if trusted is not None else {})}
    source = "the signing key" + (f" and the trusted keys in {trusted.source}" if trusted is not None else "")
    try:
        TrustedKeys(keys, source).verify(prev.signed_bytes(), prev.signature, f"the channel's current index {path}")
    except SignatureError as exc:
        way = ("to move the channel to a new signing key, pass the public key that signed it as trusted "
               "(--trusted-keys DIR)" if isinstance(exc, UntrustedKeyError) else
               "luopan publish never writes an unsigned index: it was replaced" if isinstance(exc, UnsignedError)
               else "it was changed after it was signed")
        raise type(exc)(f"{exc}. publish signs a new index only over a current one it can verify: {way}. Else "
                        f"restore the channel's signed {INDEX_NAME}, or move it away and publish with --min-version "
                        "above every index version devices have seen. Nothing was written") from None
    return prev


def _check_no_leftovers(root: str, min_version: int | None) -> None:
    """UsageError when a channel without an index holds published files (and no ``min_version`` says where to go
    on): its index version counter was lost with the index, and a new count from 1 would be refused by every
    device that saw the old one (or worse, accepted by none and replayed later)."""
    leftovers = _published_files(root)
    if not leftovers or min_version is not None or _is_file(os.path.join(root, FIRST)):
        return  # (a first publish that was cut short: no device saw an index, the files are replaced)
    seen = [int(m.group(1)) for n in leftovers if (m := re.search(r"(\d{8})-[0-9a-f]{16}\.", n))]
    hint = f" (more than {max(seen)}, the newest version named by these files)" if seen else ""
    raise UsageError(
        f"the channel {root} has no {INDEX_NAME}, but it has published files ({', '.join(leftovers[:3])}"
        f"{', …' if len(leftovers) > 3 else ''}): its index was lost, and with it the index version devices compare "
        f"against. Restore {INDEX_NAME} from a backup; or publish with --min-version N (min_version=N), N above "
        f"every index version devices have seen{hint}: the files no new index names are then deleted")


def _published_files(root: str) -> list[str]:
    """The files in the channel's ``full/`` and ``patches/`` (``d/name``), sorted."""
    return sorted(f"{d}/{n}" for d in ("full", "patches") for n in os.listdir(os.path.join(root, d)))


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _clear_first(root: str) -> None:
    """Remove the first-publish mark once an index is in place (durably: a mark that came back after a power loss
    would let a later publish without ``min_version`` restart the version count of a channel whose index was lost)."""
    path = os.path.join(root, FIRST)
    if not _is_file(path):
        return
    try:
        os.unlink(path)
        fsync_dir(root)
    except OSError as exc:
        cleanup_failed(f"the channel {root} is published, but removing {path} failed ({exc.strerror or exc}); the "
                       "next publish removes it")


def _check_files(root: str, refs: list[FileRef], say: Callable[[str], Any]) -> None:
    """IntegrityError unless each of ``refs`` (files the current index names, kept by the new one) is in the channel
    as a regular file of its listed size and BLAKE3: the new index is signed only over files that were checked."""
    for ref in refs:
        path = os.path.join(root, *ref.name.split("/"))
        say(f"checking {ref.name}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            problem = "is missing"
        except OSError:
            problem = "is not a regular file"
        else:
            try:  # checked through the descriptor: the bytes hashed are the file's, not a link's target
                st = os.fstat(fd)
                problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
                           f"is {st.st_size} bytes, not the {ref.size} listed" if st.st_size != ref.size else
                           "does not have the BLAKE3 listed" if fd_blake3(fd)[1] != ref.blake3 else None)
            finally:
                os.close(fd)
        if problem is not None:
            raise IntegrityError(
                f"the channel's file {path}, named by its current index, {problem} (changed or damaged "
                "since it was published): publish signs no index naming it. Restore it; or move the channel's index.json away "
                "and publish with --min-version above every index version devices have seen. Nothing was written")


def _settle(prev: ChannelIndex | None, name: str | None, default: str, chunk_size: int, subtree: str | None) -> str:
    """The channel's name; UsageError when this publish does not match what the channel was made with."""
    if prev is None:
        channel = name or default
        if not is_run_name(channel):
            raise UsageError(f"the channel name {channel[:80]!r} is not valid: use 1-128 ASCII letters, digits, "
                             "'.', '_', '-', starting with a letter or digit" + ("" if name else " (pass --name)"))
        return channel
    if name is not None and name != prev.channel:
        raise UsageError(f"this channel is named {prev.channel!r}, not {name!r}: a channel keeps its name")
    if chunk_size != prev.chunk_size:
        raise UsageError(f"the channel's content fingerprints use chunk size {prev.chunk_size}, the repository "
                         f"{chunk_size}: publish from a repository with chunk size {prev.chunk_size}, or start a new "
                         "channel")
    if subtree != prev.subtree:
        raise UsageError(f"the channel publishes {_what(prev.subtree)}, not {_what(subtree)}: pass "
                         + (f"--subtree {prev.subtree}" if prev.subtree else "no --subtree"))
    return prev.channel


def _what(subtree: str | None) -> str:
    return f"subtree {subtree!r}" if subtree else "whole checkpoints"


def _patch(r: Repo, root: str, scratch: Scratch, base: ChannelVersion, new: ChannelVersion, subtree: str | None,
           key: SigningKey, say: Callable[[str], Any]) -> PatchRef:
    """A patch from ``base`` to ``new``: from the base checkpoint when the repository still holds it with the same
    content (no byte of it read), else from the channel's full file of ``base``."""
    tmp = scratch.file(PATCH_TMP)
    say(f"making the patch from version {base.version} to {new.version}")
    made = None
    if base.run == new.run:
        try:
            made = create(r, new.run, base.step, new.step, tmp, subtree=subtree, sign_key=key)
        except CheckpointNotFoundError:
            made = None
        if made is not None and made["base_fingerprint"] != base.fingerprint:
            made = None  # the step was deleted and saved again: not what devices on that version have
    if made is None:
        made = create(r, new.run, None, new.step, tmp, subtree=subtree, sign_key=key,
                      from_file=os.path.join(root, *base.full.name.split("/")))
    if made["base_fingerprint"] != base.fingerprint or made["target_fingerprint"] != new.fingerprint:
        raise RuntimeError(f"luopan bug: the patch {base.version}->{new.version} has fingerprints "
                           f"{made['base_fingerprint']} -> {made['target_fingerprint']}, the channel "
                           f"{base.fingerprint} -> {new.fingerprint}")
    ref = _place(scratch, PATCH_TMP, root, "patches", f"{base.version:08d}-{new.version:08d}", ".lpatch")
    return PatchRef(base.version, new.version, ref)


def _place(scratch: Scratch, tmp: str, root: str, folder: str, stem: str, suffix: str) -> FileRef:
    """Move the finished scratch file ``tmp`` to ``folder/<stem>-<16 hex of its BLAKE3><suffix>``, durably: hashed
    and synced through a descriptor of the very file luopan wrote, then renamed out of the scratch directory's
    descriptor, so the bytes the index lists are the bytes luopan wrote."""
    fd = scratch.open_written(tmp)
    try:
        size, digest = fd_blake3(fd)
        scratch.sync(fd, tmp)
    finally:
        os.close(fd)
    name = f"{folder}/{stem}-{digest[:16]}{suffix}"
    scratch.move(tmp, os.path.join(root, folder, name.split("/", 1)[1]))
    return FileRef(name, size, digest)


def _remove_unlisted(root: str, index: ChannelIndex, prev: ChannelIndex | None) -> list[str]:
    """Delete the files under full/ and patches/ that neither ``index`` (in place now) nor ``prev``, the index it
    replaced, names: a device that read ``prev`` just before can still download what it names."""
    listed = {f.name for f in index.files()} | ({f.name for f in prev.files()} if prev is not None else set())
    removed = []
    for folder in ("full", "patches"):
        d = os.path.join(root, folder)
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise UsageError(f"cannot clean up the channel's directory {d}: {exc.strerror or exc} (a link?)") from None
        try:
            gone = []
            for entry in sorted(os.listdir(dfd)):
                if f"{folder}/{entry}" not in listed and stat.S_ISREG(os.lstat(entry, dir_fd=dfd).st_mode):
                    os.unlink(entry, dir_fd=dfd)  # a link or directory someone put there is left alone
                    gone.append(f"{folder}/{entry}")
            if gone:
                os.fsync(dfd)
            removed += gone
        except OSError as exc:  # the new index is published: what is left is removed by the next publish
            cleanup_failed(f"the channel {root} is published, but removing files no index names from {d} failed "
                           f"({exc.strerror or exc}); the next publish removes them")
        finally:
            os.close(dfd)
    return removed
