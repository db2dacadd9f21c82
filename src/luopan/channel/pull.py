"""``luopan.channel.pull``: bring a device's safetensors file up to a channel's newest version (docs/format.md
§15.4), with no repository: read and accept the signed index (luopan.channel.trust), find the version the device has,
download the smallest patch from it (else the full file) with resume, verify, apply, record.

Nothing is written before the index is accepted, the output checked writable and the free space found sufficient.
Then the state file records the accepted index first (so a crash at any later point cannot let a replay of an older
index through), the download and the install follow under the partial file's lock, and the output appears
atomically (a patch is applied into a temporary file beside it, checked against the newest version's fingerprint and
renamed; a verified full file is renamed), after which the state file records what was installed.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import blake3

from ..errors import (
    BaseMismatchError,
    ChannelDownloadError,
    ChannelRollbackError,
    CorruptChannelIndexError,
    CorruptSafetensorsError,
    InsufficientSpaceError,
    LuopanError,
    OutputPathError,
    UsageError,
)
from ..format.names import is_run_name
from ..patch import apply, fingerprint_file, read_header
from ..signing import ENV_TRUSTED, TrustedKeys
from ..units import format_bytes
from .download import applied_path, download, open_partial, partial_path, remove_stale_partials
from .files import copy_atomic, move_into_place
from .index import INDEX_NAME, MAX_INDEX_BYTES, ChannelIndex, ChannelVersion, format_time
from .source import Source, open_source, retryable
from .state import DeviceState, read_state, write_state
from .trust import accept_index

Progress = Callable[[str, int, int], Any]  # (phase "download" / "apply", done, total)
BACKOFF = 1.0  # seconds before the first retry of a cut transfer; doubled at each further one
Found = tuple[ChannelVersion | None, str | None, str | None]  # listed version, fingerprint, "state"/"fingerprint"


def pull(
    url: str,
    base_path: str | os.PathLike[str] | None,
    out_path: str | os.PathLike[str],
    *,
    trusted_keys: TrustedKeys | str | os.PathLike[str] | None,
    state_file: str | os.PathLike[str] | None = None,
    channel: str | None = None,
    retries: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Update from the channel at ``url`` (http(s):// or a directory): the newest version is written to
    ``out_path``, made from ``base_path`` (the safetensors file the device has; None: download the full file).

    ``trusted_keys`` (a directory of ``*.pub``, a TrustedKeys, or None for $LUOPAN_TRUSTED_KEYS) is required: only
    an index signed by one of them is used. ``state_file`` records the newest index seen (an older one is then
    refused as a replay) and the version installed; without it, the version is found by the files' content
    fingerprints. ``channel``: the channel name the index must have (also on a first pull, without state). A cut
    transfer (the index or a file) is retried ``retries`` times, each resuming; a rerun after a failure resumes too.

    Already up to date — the output holds the newest version, or the base does (it is then copied to the output,
    so the output exists afterwards) — downloads nothing and returns ``up_to_date`` true. Returns up_to_date,
    copied, index_version, version, from_version, kind ("patch"/"full"/None), file, size, downloaded (bytes this call
    received), resumed_from, restarts, matched_by ("state"/"fingerprint"/None), path (the output).
    """
    trusted = trusted_keys if isinstance(trusted_keys, TrustedKeys) else TrustedKeys.load(trusted_keys)
    if trusted is None:
        raise UsageError(f"pull needs trusted keys (--trusted-keys DIR or ${ENV_TRUSTED}): a channel index is used "
                         "only when one of them signed it")
    if channel is not None and not is_run_name(channel):
        raise UsageError(f"the channel name {str(channel)[:80]!r} is not valid: 1-128 ASCII letters, digits, '.', "
                         "'_', '-'")
    out = _check_output(out_path)
    base = os.fspath(base_path) if base_path is not None else None
    if base is not None and not os.path.isfile(base):
        raise UsageError(f"the base file {base} does not exist; give the model file this device has, or no base "
                         "to download the full file")
    state = read_state(state_file) if state_file is not None else None
    source = open_source(url)
    for attempt in range(2):
        raw = _read_index(source, retries)
        index = accept_index(raw, f"{source.location}/{INDEX_NAME}", trusted, state, time.time(), channel)
        try:
            return _update(source, index, raw, base, out, trusted, state, state_file, retries, progress)
        except ChannelDownloadError as exc:
            if not exc.missing or attempt:
                raise
            # a publish removed the file after this index was read: the channel's new index names what to get
            state = read_state(state_file) if state_file is not None else None
    raise AssertionError("unreachable")


def _read_index(source: Source, retries: int) -> bytes:
    for attempt in itertools.count():
        try:
            return source.read(INDEX_NAME, MAX_INDEX_BYTES)
        except ChannelDownloadError as exc:
            if not retryable(exc) or attempt >= retries:
                raise
            time.sleep(min(BACKOFF * 2**attempt, 30.0))
    raise AssertionError("unreachable")


def _update(source: Source, index: ChannelIndex, raw: bytes, base: str | None, out: str, trusted: TrustedKeys,
            state: DeviceState | None, state_file: Any, retries: int, progress: Progress | None,
            known: Found | None = None) -> dict[str, Any]:
    latest = index.latest
    digest = blake3.blake3(raw).hexdigest()
    summary: dict[str, Any] = {"up_to_date": False, "copied": False, "index_version": index.version,
                               "version": latest.version, "from_version": None, "kind": None, "file": None,
                               "size": 0, "downloaded": 0, "resumed_from": 0, "restarts": 0, "matched_by": None,
                               "path": out}

    def installed() -> dict[str, Any]:
        remove_stale_partials(out)  # leftovers of earlier pulls into this output (one another pull holds stays)
        if state_file is not None:
            new = _installed_state(index, digest, out)
            if new != _with_time(state, new.updated):
                write_state(state_file, new)
        return summary

    # the output already holds the newest version (a rerun of `--base OLD -o NEW`)
    if known is None and os.path.lexists(out) and not _same_file(out, base):
        found = _identify(index, state, out, strict=False)
        if found[1] == latest.fingerprint:
            summary.update(up_to_date=True, from_version=latest.version, matched_by=found[2])
            return installed()
    have, fingerprint, matched_by = known if known is not None else _identify(index, state, base)
    summary.update(from_version=have.version if have else None, matched_by=matched_by)
    if fingerprint == latest.fingerprint:
        assert base is not None
        if not _same_file(out, base):
            _check_space(out, os.path.getsize(base))
            copy_atomic(base, out)
            summary["copied"] = True
        summary["up_to_date"] = True
        return installed()
    if state is not None and state.version is not None and state.version > latest.version and have is None:
        raise ChannelRollbackError(
            f"this device installed version {state.version} (its state file {os.fspath(state_file)}), newer than "
            f"version {latest.version}, the newest in channel index {source.location}/{INDEX_NAME} (index version "
            f"{index.version}), and " + (f"the base {base} is no version that index lists" if base else "no base "
                                          "was given") + ": refusing to replace it with an older version. Nothing "
            "was written. If the channel was rebuilt on purpose, delete the state file")
    patch = index.patch_from(have.version) if have is not None else None
    if patch is not None and patch.file.size >= latest.full.size:
        patch = None  # nearly everything changed: the full file is less to download, and needs no base read
    ref = patch.file if patch is not None else latest.full
    partial = partial_path(out, ref)
    _check_space(out, ref.size - _size(partial) + (latest.full.size if patch is not None else 0))
    fallback: Found | None = None
    with open_partial(partial, ref.name) as part:  # locked until the output is in place
        remove_stale_partials(out, keep=part.path)
        if state_file is not None:  # the rollback rule holds from here on, whatever happens next
            seen = _seen(state, index, digest)
            if seen != _with_time(state, seen.updated):
                write_state(state_file, seen)
        got = download(source, ref, part, retries=retries,
                       progress=None if progress is None else lambda d, t: progress("download", d, t))
        summary.update(kind="patch" if patch else "full", file=ref.name, size=ref.size, downloaded=got.downloaded,
                       resumed_from=got.resumed_from, restarts=got.restarts)
        if patch is not None:
            assert base is not None
            try:
                _apply_checked(part, base, out, trusted, latest, ref.name, progress)
            except (BaseMismatchError, CorruptSafetensorsError) as exc:
                if matched_by != "state":
                    raise
                # the state file named the base's version, but the base holds other content (rewritten in place
                # with its size and time kept): forget that, and go by what the base holds
                actual = exc.actual if isinstance(exc, BaseMismatchError) else None
                fallback = (index.find(actual) if actual else None, actual, "fingerprint")
                if state_file is not None:
                    write_state(state_file, _forget_install(_seen(state, index, digest)))
        else:
            move_into_place(part.path, out)  # verified against the signed BLAKE3 by download()
    if fallback is not None:
        again = _update(source, index, raw, base, out, trusted, None, state_file, retries, progress, fallback)
        again["downloaded"] += summary["downloaded"]
        return again
    return installed()


def _identify(index: ChannelIndex, state: DeviceState | None, path: str | None, strict: bool = True) -> Found:
    """(the listed version ``path`` holds or None, its fingerprint, how it was found). The state file's fingerprint
    is used while the file has the size, modification time and inode recorded with it; otherwise it is hashed.
    ``strict`` false: a file that cannot be fingerprinted (not a safetensors file) is simply not a known version."""
    if path is None:
        return None, None, None
    try:
        st = os.stat(path)
        if state is not None and state.channel == index.channel and state.holds(st):
            fp, how = state.fingerprint, "state"
        else:
            fp, how = fingerprint_file(path, index.chunk_size), "fingerprint"
    except (LuopanError, OSError):
        if strict:
            raise
        return None, None, None
    return index.find(fp) if fp else None, fp, how


def _apply_checked(part: Any, base: str, out: str, trusted: TrustedKeys, latest: ChannelVersion, name: str,
                   progress: Progress | None) -> None:
    """Check (from its signed header) that the downloaded patch makes the newest version, apply it into a temporary
    file beside the output, check the result again, and only then rename it onto the output (the output is
    untouched by any failure)."""
    tmp = applied_path(part.path)
    try:
        made = read_header(part.path, trusted_keys=trusted)["target_fingerprint"]  # before any work
        done = _apply(part.path, base, tmp, trusted, progress) if made == latest.fingerprint else {
            "target_fingerprint": made}
        if done["target_fingerprint"] != latest.fingerprint:
            part.remove()
            raise CorruptChannelIndexError(
                f"channel index is refused: its patch {name} makes content {done['target_fingerprint']}, not the "
                f"newest version's {latest.fingerprint}; nothing was written (the publisher must publish again)")
        move_into_place(tmp, out)
    except BaseException:
        _unlink(tmp)
        raise
    part.remove()


def _apply(patch: str, base: str, out: str, trusted: TrustedKeys, progress: Progress | None) -> dict[str, Any]:
    """Apply the downloaded patch; its own signature is checked too (publish signs patches with the index's key)."""
    if progress is None:
        return apply(patch, base, out, trusted_keys=trusted)
    total, done = [0], [0]

    def on_total(n: int) -> None:
        total[0] = n
        progress("apply", 0, n)

    def step(n: int) -> None:
        done[0] += n
        progress("apply", done[0], total[0])

    return apply(patch, base, out, trusted_keys=trusted, progress=step, on_total=on_total)


def _seen(state: DeviceState | None, index: ChannelIndex, digest: str) -> DeviceState:
    """The state with ``index`` as the newest index accepted, and the install as it was."""
    now = format_time(time.time())
    if state is None:
        return DeviceState(index.channel, index.version, digest, None, None, None, None, None, now)
    return DeviceState(index.channel, index.version, digest, state.version, state.fingerprint, state.file_size,
                       state.file_mtime_ns, state.file_inode, now)


def _forget_install(state: DeviceState) -> DeviceState:
    return DeviceState(state.channel, state.index_version, state.index_blake3, None, None, None, None, None,
                       state.updated)


def _installed_state(index: ChannelIndex, digest: str, path: str) -> DeviceState:
    st = os.stat(path)
    return DeviceState(index.channel, index.version, digest, index.latest.version, index.latest.fingerprint,
                       st.st_size, st.st_mtime_ns, st.st_ino, format_time(time.time()))


def _with_time(state: DeviceState | None, updated: str) -> DeviceState | None:
    """``state`` with another ``updated`` time (to compare two states but for it)."""
    if state is None:
        return None
    return DeviceState(state.channel, state.index_version, state.index_blake3, state.version, state.fingerprint,
                       state.file_size, state.file_mtime_ns, state.file_inode, updated)


def _same_file(a: str, b: str | None) -> bool:
    if b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _check_output(path: str | os.PathLike[str]) -> str:
    out = os.fspath(path)
    if not out or os.path.isdir(out):
        raise OutputPathError(errno.EISDIR, f"{out or '(empty)'} is a directory: give the file to write, e.g. "
                                            f"{os.path.join(out or '.', 'model.safetensors')}")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise OutputPathError(errno.ENOENT, f"cannot write {out}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputPathError(errno.EACCES, f"cannot write {out}: {parent} is not writable")
    return out


def _check_space(out: str, needed: int) -> None:
    """InsufficientSpaceError, before any byte is written, when the output's disk lacks ``needed`` bytes."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))).free
    if needed > free:
        err = InsufficientSpaceError(errno.ENOSPC, f"the update needs {format_bytes(needed)} next to {out} "
                                                   f"(download and output), but only {format_bytes(free)} is free; "
                                                   "nothing was written")
        err.needed, err.free, err.estimate = needed, free, needed
        raise err


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
