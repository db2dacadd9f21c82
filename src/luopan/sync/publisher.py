"""``luopan.sync.Publisher``: publish a training process's weights after each step to a sync target (docs/format.md
§19), for subscribers to apply in place.

A target is a directory (a shared filesystem, or the root of any static web server) or an object store
(``s3://bucket/prefix``: luopan.sync.targets):

    index.json                                  signed index, written last (luopan.sync.index)
    full/00000001-1a2b3c4d5e6f7a8b.lpsync       a full version: every tensor whole (at the start, then every
                                                ``full_every`` publishes)
    deltas/00000003-00000009-9c8d….lpsync        the delta file of version 9: layers 9, 8, …, 4 (newest first); its
                                                prefix through layer b + 1 is the delta from version b

One file a publish serves every lag: layer ``u`` carries the elements that changed in version ``u`` (encoded once,
when ``u`` is published, and again only when half of it changed since), so the publish encodes one new layer
and writes one file. Write order: the new files and the index are written to temporary names and fsynced, the files
renamed into place and their directories fsynced, then the index renamed into place and the target fsynced; the
files that neither the new index nor the one it replaced names are removed afterwards, in the background, so a
subscriber that read the previous index still finds its file. A killed or interrupted publish leaves the previous
index and its files as they were (temporary files are removed by the next Publisher on the target). The publisher
keeps one CPU copy of the last published weights, per element the version it last changed in, and the change lists
of the last ``keep`` versions.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
import time
from typing import Any

import blake3

from ..channel.index import FileRef, format_time
from ..errors import CorruptChannelIndexError, UsageError
from ..format.names import is_run_name
from ..signing import SigningKey, load_signing_key
from ..store import is_object_url
from ..units import parse_duration
from .delta import assemble, encode_body
from .index import INDEX_NAME, SyncDelta, SyncIndex, SyncVersion, encode_index, parse_index
from .targets import DELTA_DIR, FULL_DIR, SUFFIX, open_target
from .tensors import Published, leaves_of

_POOL = ThreadPoolExecutor(3, thread_name_prefix="luopan-sync")  # BLAKE3, NumPy and zstd release the GIL


class Publisher:
    """Publish weights to ``target`` (a directory, or an object-store URL such as ``s3://bucket/prefix`` with
    ``storage_options`` for its fsspec filesystem) as a signed, versioned live-sync channel.

    ``key``: an Ed25519 SigningKey (or the path of a ``.key`` file, luopan key gen) that signs every index; None
    publishes unsigned indexes (only subscribers without trusted keys accept them). ``keep``: the index lists a
    delta from each of the last ``keep`` versions (prefixes of one file), so a subscriber that missed up to
    ``keep - 1`` publishes catches up in one read of the union of the changes it missed. ``full_every``: a full
    version at the first publish and then every so many (at most ``keep``, so a new subscriber always finds a full
    version and one delta from it). ``spacing="doubling"`` lists deltas only from the versions 1, 2, 4, … and
    ``keep`` publishes back (a shorter index; a delta from version b serves a subscriber holding any version from b
    on, reading more than it needs).
    ``expires``: how long an index stays valid (a subscriber refuses an expired one: publish at least that often).
    ``channel``: the name subscribers check."""

    def __init__(self, target: str | os.PathLike[str], key: SigningKey | str | os.PathLike[str] | None = None,
                 keep: int = 8, full_every: int | None = None, channel: str = "sync",
                 expires: str | float = "7d", spacing: str = "each",
                 storage_options: dict[str, Any] | None = None) -> None:
        loc = os.fspath(target)
        if "://" in loc and not loc.startswith("file://") and not is_object_url(loc):
            raise UsageError(f"sync target {loc!r}: a Publisher writes to a directory (serve it over HTTP for "
                             "subscribers elsewhere) or to an object store (s3://bucket/prefix)")
        self.key = key if key is None or isinstance(key, SigningKey) else load_signing_key(key)
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= 1000:
            raise UsageError(f"keep={keep!r}: keep is the number of versions to write deltas from, 1 to 1000")
        full_every = keep if full_every is None else full_every
        if not isinstance(full_every, int) or not 1 <= full_every <= keep:
            raise UsageError(f"full_every={full_every!r} must be from 1 to keep ({keep}): a new subscriber needs a "
                             "full version with a delta from it to the newest")
        if spacing not in ("each", "doubling"):
            raise UsageError(f"spacing={spacing!r}: 'each' (a delta from each of the last keep versions) or "
                             "'doubling' (from the versions 1, 2, 4, … and keep publishes back)")
        self.spacing = spacing
        if not is_run_name(channel):
            raise UsageError(f"channel {channel!r} is not a name of 1-128 letters, digits, '.', '_', '-'")
        self.keep, self.full_every, self.channel = keep, full_every, channel
        self.expires = float(expires) if isinstance(expires, (int, float)) else parse_duration(expires)
        self._pub = Published()
        self._layout: list[Any] | None = None
        self._versions: list[SyncVersion] = []  # published by this Publisher, oldest first
        self._index: SyncIndex | None = None
        self._index_bytes = b""
        self._attempt: tuple[SyncIndex, bytes] | None = None  # the index of a publish not known to have committed
        self.target = open_target(loc, storage_options)
        self.root = self.target.where  # the directory, or the object-store URL
        with self.target.lock():
            self.target.clear_temporaries()
            self._index, self._index_bytes = self._read_index()
        self.version = self._index.version if self._index is not None else 0
        self.last_bytes: dict[str, int] = {}  # what the last publish wrote: {"full": n, "deltas": n}
        self._cleanup: Future[None] | None = None  # the last publish's removal of files no index names
        self.changed = 0  # elements changed by the last publish

    def _read_index(self) -> tuple[SyncIndex | None, bytes]:
        """The index on the target and its bytes ((None, b"") when there is none). An index of an older format
        (format_version 1) is taken as its version number only: this Publisher goes on from there with a full
        version."""
        data = self.target.read_index()
        if data is None:
            return None, b""
        if self._index is not None and data == self._index_bytes:  # as this Publisher left it: parsed already
            return self._index, data
        try:
            index = parse_index(data, f"{self.root}/{INDEX_NAME}")
        except CorruptChannelIndexError:
            old = _older_index(data, self.channel)
            if old is None:
                raise
            index = old
        if index.channel != self.channel:
            raise UsageError(f"{self.root} holds live-sync channel {index.channel!r}, not {self.channel!r}: pass "
                             f"channel={index.channel!r} or publish to another target")
        return index, data

    def publish(self, step: int, model_or_state: Any) -> int:
        """Publish the weights of ``model_or_state`` (a module or a state dict of tensors) as the next version,
        tagged with training ``step``; returns the version number. Durable when it returns."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UsageError(f"step={step!r} is not a non-negative integer")
        leaves = leaves_of(model_or_state)
        layout = [(lf.path, lf.dtype, tuple(lf.shape)) for lf in leaves]
        with self.target.lock():
            self.wait()
            on_disk, raw = self._read_index()
            if self._attempt is not None and raw == self._attempt[1]:
                # the last publish failed after its index was placed (a directory sync, an object PUT whose answer
                # was lost): that index is what subscribers see, so go on from it (with a full version: the failed
                # publish reset what this Publisher had taken in)
                self._index, self._index_bytes = self._attempt
                self.version, self._versions = self._index.version, []
            self._attempt = None
            if raw != self._index_bytes:
                raise UsageError(
                    f"the live-sync index in {self.root} is at version "
                    f"{on_disk.version if on_disk is not None else 'none'}, not the version {self.version} this "
                    "Publisher left there: another Publisher published there (or the target was changed). One "
                    "Publisher per target: make a new Publisher to continue from what is there")
            try:
                v = self.version + 1
                fresh = layout != self._layout or v >= 2**31 - 1  # per-element stamps are int32
                if fresh:  # first publish, or the model's tensors changed: only a full version this time
                    self._pub.reset(leaves, v)
                    self._layout, self._versions = layout, []
                    self.changed = sum(int(lf.obj.numel()) for lf in leaves)
                else:
                    self.changed = self._pub.update(leaves, v)
                kept = self._versions[-self.keep:]
                newest_full = max((x.version for x in kept if x.full is not None), default=0)
                bases = kept if self.spacing == "each" else \
                    [x for x in kept if (v - x.version) & (v - x.version - 1) == 0 or x is kept[0] or
                     x.version == newest_full]  # a new worker reads the newest full version, then the delta from it
                want_full = fresh or v - newest_full >= self.full_every
                layers = list(range(v, kept[0].version, -1)) if kept else []  # newest first, to the oldest base + 1
                bodies = [self._pub.layer(u, encode_body) for u in layers]
                full_body = encode_body(self._pub.full_parts()) if want_full else None
                files: list[tuple[str, bytes]] = []
                full_ref = None
                if full_body is not None:
                    data, _ends = assemble(v, [(v, None, full_body)], full=True)
                    full_ref = _ref(FULL_DIR, f"{v:08d}", data)
                    files.append((full_ref.name, data))
                deltas = []
                if layers:
                    prints = {x.version: x.fingerprint for x in kept}
                    data, ends = assemble(v, [(u, prints[u - 1], body) for u, body in zip(layers, bodies)])
                    hasher, upto, prefix = blake3.blake3(), 0, {}  # the BLAKE3 of each prefix, in one pass
                    for u, end in zip(layers, ends):
                        hasher.update(memoryview(data)[upto:end])
                        upto, prefix[u - 1] = end, (end, hasher.copy().hexdigest())
                    name = f"{DELTA_DIR}/{kept[0].version:08d}-{v:08d}-{prefix[kept[0].version][1][:16]}{SUFFIX}"
                    files.append((name, data))
                    deltas = [SyncDelta(b.version, v, FileRef(name, *prefix[b.version])) for b in bases]
                staged = self.target.stage(files, _POOL)  # written and synced while the tensors are hashed
                try:
                    fp = self._pub.rehash()
                    new = SyncVersion(v, step, fp, full_ref)
                    now = time.time()
                    index = SyncIndex(self.channel, v, format_time(now), format_time(now + max(self.expires, 1)),
                                      (*kept, new), tuple(deltas), None)
                    data = encode_index(index, self.key)
                except BaseException:
                    self.target.abandon(staged)
                    raise
                self._attempt = (index, data)
                self.target.commit(files, staged, data)
                self._attempt = None
                prev, self._index, self._index_bytes = self._index, index, data
                self._versions = [*kept, new]
                self._pub.forget(self._versions[-self.keep:][0].version)
                self.version = v
                self.last_bytes = {("full" if n.startswith(FULL_DIR) else "deltas"): len(d) for n, d in files}
                self._cleanup = _POOL.submit(self._remove_unlisted, index, prev)
            except BaseException:
                # what was taken in may not be what is published: the next publish starts over from a full version
                self._layout = None
                raise
        return v

    def wait(self) -> None:
        """Wait for the last publish's removal of the files that no index names any more (it runs in the
        background, after the publish returned)."""
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup.result()

    def _remove_unlisted(self, index: SyncIndex, prev: SyncIndex | None) -> None:
        """Delete the ``.lpsync`` files neither ``index`` nor ``prev`` names (a subscriber that read ``prev`` still
        finds its file). Best effort: what a failure leaves is deleted by a later publish."""
        self.target.remove_unlisted({f.name for f in index.files()} |
                                    ({f.name for f in prev.files()} if prev is not None else set()), index.version)


def _ref(folder: str, stem: str, data: bytes) -> FileRef:
    """The entry of a file named ``<folder>/<stem>-<first 16 hex digits of its BLAKE3>.lpsync``."""
    h = blake3.blake3(data, max_threads=blake3.blake3.AUTO if len(data) >= 1 << 22 else 1).hexdigest()
    return FileRef(f"{folder}/{stem}-{h[:16]}{SUFFIX}", len(data), h)


def _older_index(data: bytes, channel: str) -> SyncIndex | None:
    """An index of format_version 1 (luopan.sync before layered delta files) as an index of its version number
    alone, or None when ``data`` is not one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != "luopan-sync-index" or doc.get("format_version") != 1:
        return None
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version < 2**31 - 1:
        return None
    name = doc.get("channel")
    return SyncIndex(name if isinstance(name, str) else channel, version, "", "", (), (), None)
