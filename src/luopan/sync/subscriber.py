"""``luopan.sync.Subscriber``: keep live tensors (a module or a state dict, CPU or CUDA) at the newest version a
Publisher published, in place (docs/format.md §19.3).

``update`` reads the newest index and accepts it only when signed by a trusted key, unexpired and not older than the
newest one this subscriber has seen (in memory and, with ``state_file``, across restarts). It finds the version the
tensors hold by their fingerprint and fetches one file: the delta from that version, or — a new or far-behind
worker — the newest full version (and the one delta from it). Every byte is checked (size and BLAKE3 named by the
signed index, a strict parse, the versions and base fingerprint of the delta), the update is staged and the result's
fingerprint computed on the staged values before one element of a live tensor is written; any failure leaves the
tensors exactly as they were.
"""

from __future__ import annotations

import os
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request
from typing import Any

import blake3

from .._files import write_atomic
from ..channel.index import FileRef, format_time
from ..errors import (
    BaseMismatchError,
    ChannelDownloadError,
    ChannelRollbackError,
    ChannelStateError,
    CorruptDownloadError,
    StorageError,
    UsageError,
)
from ..format.canonical import SealError, seal, unseal
from ..signing import TrustedKeys
from ..store import KeyNotFound, is_object_url, open_store
from .delta import held_layers, parse_header, read_body, sections
from .index import INDEX_NAME, MAX_INDEX_BYTES, Seen, SyncIndex, SyncVersion, accept_index
from .tensors import Stage, leaves_of

STATE_FORMAT = "luopan-sync-state"
_POOL = ThreadPoolExecutor(2, thread_name_prefix="luopan-sync-apply")  # hashing the staged tensors
TIMEOUT = 60.0


class _Missing(Exception):
    """A file the index named is gone (a newer publish removed it): read the index again."""


class Subscriber:
    """Apply what a Publisher publishes at ``source`` (a directory, the ``http(s)://`` URL of that directory served
    by a web server, or the object store it publishes to: ``s3://bucket/prefix``, options in ``storage_options``)
    to live tensors.

    ``trusted_keys``: a luopan.signing.TrustedKeys, or a directory of ``*.pub`` files; when given, only indexes
    signed by one of them are accepted. ``state_file``: where to remember the newest index seen, so a restarted
    subscriber still refuses an older (replayed) one. ``channel``: the channel name to accept."""

    def __init__(self, source: str | os.PathLike[str], trusted_keys: TrustedKeys | str | os.PathLike[str] | None
                 = None, state_file: str | os.PathLike[str] | None = None, channel: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.source = os.fspath(source)
        self.http = self.source.startswith(("http://", "https://"))
        self.store = open_store(self.source, **(storage_options or {})) if is_object_url(self.source) else None
        if storage_options and self.store is None:
            raise UsageError(f"storage_options apply to object-store sources (s3://…), not to {self.source!r}")
        if self.store is None and not self.http and "://" in self.source and not self.source.startswith("file://"):
            raise UsageError(f"sync source {self.source!r}: a directory, an http(s):// URL of one, or an object "
                             "store (s3://bucket/prefix)")
        if not self.http and self.source.startswith("file://"):
            self.source = self.source[7:]
        self.trusted = trusted_keys if trusted_keys is None or isinstance(trusted_keys, TrustedKeys) \
            else TrustedKeys.load(trusted_keys)
        self.channel = channel
        self.state_file = None if state_file is None else os.fspath(state_file)
        self.seen = self._read_state() if self.state_file else Seen()
        self.version: int | None = None  # the version the tensors hold (None: not known)
        self.fingerprint: str | None = None
        self.step: int | None = None
        self.last_bytes = 0  # bytes fetched by the last update (index excluded)
        self.changed: list[str] = []  # the tensors the last update wrote

    def update(self, model_or_state: Any) -> int | None:
        """Bring the tensors to the newest published version; the version applied, or None when they already hold
        it. Refuses (before any tensor changes) an index that is unsigned or signed by an untrusted key
        (UnsignedError, UntrustedKeyError, SignatureError), older than one seen (ChannelRollbackError), expired
        (ChannelExpiredError) or damaged (CorruptChannelIndexError), a file that does not match it
        (CorruptDownloadError), and a delta for other tensors than those held (BaseMismatchError)."""
        leaves = leaves_of(model_or_state)
        for attempt in range(3):
            data = self._get(INDEX_NAME, None)
            index = accept_index(data, f"{self._where(INDEX_NAME)}", self.trusted, self.seen, time.time(),
                                 self.channel)
            try:
                applied = self._apply(index, leaves)
            except _Missing:
                if attempt == 2:
                    raise
                continue
            self._accepted(index, data)
            return applied
        return None  # not reached

    def _apply(self, index: SyncIndex, leaves: list[Any]) -> int | None:
        latest = index.latest
        if self.version is not None and self.version > latest.version:
            raise ChannelRollbackError(
                f"live-sync index at {self.source} names version {latest.version} as the newest, but this subscriber "
                f"already serves version {self.version}: refusing to go back. Nothing was applied")
        stage = Stage(leaves)
        live_fp, _digests = stage.fingerprint()
        held = index.find(live_fp)
        if self.version is not None and live_fp != self.fingerprint:
            raise BaseMismatchError(
                f"the tensors no longer hold version {self.version} that this subscriber applied (their fingerprint "
                f"is {live_fp[:23]}…, not {str(self.fingerprint)[:23]}…): they were changed outside luopan.sync. "
                "Nothing was applied; reload the model (or make a new Subscriber) to start from a full version")
        listed = index.get(self.version)
        if self.version is not None and listed is not None and listed.fingerprint != live_fp:
            raise BaseMismatchError(
                f"live-sync index at {self.source} lists version {self.version} with fingerprint "
                f"{listed.fingerprint[:23]}…, but the version {self.version} this subscriber applied has "
                f"{live_fp[:23]}…: the source now publishes other weights (another trainer or channel). Refused, "
                "nothing was applied; make a new Subscriber to start over from a full version")
        if held is not None and held.version == latest.version:
            self.changed = []
            self._hold(latest, live_fp)
            return None
        delta = index.delta_from(held.version) if held is not None else None
        self.last_bytes = 0
        if delta is not None:
            self._load(delta.file, stage, index.get(delta.source), latest)
        else:
            full = index.newest_full()
            self._load(full.full, stage, None, full)  # type: ignore[arg-type]
            if full.version != latest.version:
                d = index.delta_from(full.version)
                if d is None:
                    raise CorruptDownloadError(
                        f"live-sync index at {self.source} lists no delta from its newest full version "
                        f"{full.version} to {latest.version}: it was not written by luopan.sync. Nothing was applied")
                # a delta from a version at or before the full one brings it to the newest (it carries every
                # element changed since its own base, a superset of those changed since the full version)
                self._load(d.file, stage, index.get(d.source), latest)
        result, digests = stage.fingerprint(_POOL)
        if result != latest.fingerprint:
            raise CorruptDownloadError(
                f"the update to version {latest.version} from {self.source} would give tensors of fingerprint "
                f"{result[:23]}…, not {latest.fingerprint[:23]}… as published: refused, the tensors are unchanged")
        stage.write(digests)
        self.changed = sorted({*stage.whole, *stage.elements})
        self._hold(latest, result)
        return latest.version

    def _hold(self, v: SyncVersion, fp: str) -> None:
        self.version, self.step, self.fingerprint = v.version, v.step, fp

    def _load(self, ref: FileRef, stage: Stage, base: SyncVersion | None, target: SyncVersion) -> None:
        """Stage the file ``ref`` names — for a delta, the prefix of its file holding the layers after ``base`` —
        checked against the index before anything is decoded."""
        data = self._get(ref.name, ref)
        where = self._where(ref.name)
        source = None if base is None else base.version
        header = parse_header(data, where, None if base is None else target.version - base.version)
        try:
            n = header.span(source)
        except ValueError as exc:
            raise CorruptDownloadError(f"live-sync delta {where} is refused: {exc}. Nothing was applied") from None
        if (header.full, header.target) != (base is None, target.version):
            raise CorruptDownloadError(
                f"live-sync delta {where} goes to version {header.target}{' (a full version)' if header.full else ''}, "
                f"not to {target.version}{' (a full version)' if base is None else f' from {source}'} as the index "
                "says: refused, nothing was applied")
        if held_layers(data, header, where) != n:
            raise CorruptDownloadError(f"live-sync delta {where}: the {len(data)} bytes the index lists for the "
                                       f"delta from {source} are not its {n} layer(s): refused, nothing was applied")
        layers = header.layers[:n]
        if base is not None and layers[-1].base != base.fingerprint:
            raise BaseMismatchError(
                f"live-sync delta {where} applies to tensors of fingerprint {str(layers[-1].base)[:23]}…, not to "
                f"version {base.version} ({base.fingerprint[:23]}…) that this subscriber holds: refused, nothing was "
                "applied")
        for layer in layers:
            stage.check_layout(layer.tensors, base is None, where)
        for layer in reversed(layers):  # oldest first: a newer layer's element is written over an older one's
            for t, idx, values in sections(read_body(data, layer, where), layer, where):
                stage.add(t, idx, values)
        self.last_bytes += len(data)

    # --------------------------------------------------------------------------------------------- fetching

    def _where(self, name: str) -> str:
        return f"{self.source.rstrip('/')}/{name}"

    def _get(self, name: str, ref: FileRef | None) -> bytes:
        """A file of the target: the index (at most its limit), or the first ``ref.size`` bytes of a listed file
        (all of a full version; the prefix a delta is of its file), checked against ``ref``."""
        limit = MAX_INDEX_BYTES if ref is None else ref.size
        where = self._where(name)
        if self.http:
            data = self._get_http(where, limit, ref is not None)
        elif self.store is not None:
            data = self._get_object(name, where, limit, ref is not None)
        else:
            try:
                with open(os.path.join(self.source, name), "rb") as f:
                    data = f.read(limit + 1 if ref is None else limit)
            except FileNotFoundError:
                if ref is not None:
                    raise _Missing() from None
                raise ChannelDownloadError(f"no live-sync index at {where}: nothing was published there yet (or "
                                           "the source is wrong)") from None
            except OSError as exc:
                raise ChannelDownloadError(f"cannot read {where}: {exc.strerror or exc}") from None
        if ref is not None and (len(data) != ref.size or blake3.blake3(data).hexdigest() != ref.blake3):
            raise CorruptDownloadError(f"{where} is not the file the signed index lists (size or BLAKE3 differ): "
                                       "refused, nothing was applied")
        if len(data) > limit:
            raise CorruptDownloadError(f"{where} is over {limit} bytes: refused, nothing was applied")
        return data

    def _get_object(self, name: str, where: str, limit: int, listed: bool) -> bytes:
        """The index (at most ``limit`` + 1 bytes) or the first ``limit`` bytes of a listed object: one ranged GET."""
        assert self.store is not None
        try:
            return self.store.get_range(name, 0, limit if listed else limit + 1)
        except KeyNotFound:
            if listed:
                raise _Missing() from None
            raise ChannelDownloadError(f"no live-sync index at {where}: nothing was published there yet (or the "
                                       "source is wrong)") from None
        except OSError as exc:
            raise ChannelDownloadError(f"cannot fetch {where}: {exc}; check the URL, credentials and the network, "
                                       "then call update() again") from None

    def _get_http(self, url: str, limit: int, listed: bool) -> bytes:
        """The index (at most ``limit`` + 1 bytes, to see it is too long), or the first ``limit`` bytes of a listed
        file: an HTTP range request (a server that ignores it sends the whole file, of which that much is read)."""
        headers = {"Cache-Control": "no-cache"}
        if listed:
            headers["Range"] = f"bytes=0-{limit - 1}"
        try:
            req = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:  # noqa: S310 - an http(s) URL, checked
                return resp.read(limit if listed else limit + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 416) and listed:
                raise _Missing() from None
            raise ChannelDownloadError(f"cannot fetch {url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ChannelDownloadError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}; check the URL and the "
                                       "network, then call update() again") from None

    # ------------------------------------------------------------------------------------------------ state

    def _accepted(self, index: SyncIndex, data: bytes) -> None:
        seen = Seen(index.channel, index.version, blake3.blake3(data).hexdigest())
        if (seen.version, seen.blake3) == (self.seen.version, self.seen.blake3):
            return
        self.seen = seen
        if self.state_file:
            doc = {"channel": seen.channel, "format": STATE_FORMAT, "format_version": 1,
                   "index_blake3": seen.blake3, "index_version": seen.version, "updated": format_time(time.time())}
            try:
                write_atomic(self.state_file, seal(doc))
            except StorageError:
                raise
            except OSError as exc:
                raise ChannelStateError(f"cannot write the sync state file {self.state_file}: {exc}") from None

    def _read_state(self) -> Seen:
        assert self.state_file is not None
        try:
            with open(self.state_file, "rb") as f:
                data = f.read(1 << 16)
        except FileNotFoundError:
            return Seen()
        except OSError as exc:
            raise ChannelStateError(f"cannot read the sync state file {self.state_file}: {exc.strerror}") from None
        try:
            doc = unseal(data)
            ok = doc.get("format") == STATE_FORMAT and isinstance(doc.get("channel"), str) and \
                isinstance(doc.get("index_version"), int) and isinstance(doc.get("index_blake3"), str)
            if not ok:
                raise ValueError("not a live-sync state file")
        except (ValueError, SealError) as exc:
            raise ChannelStateError(
                f"the sync state file {self.state_file} is damaged ({str(exc)[:200]}); it was left as it is. Restore "
                "it, or delete it to start over (the subscriber then accepts any unexpired index the trusted keys "
                "signed)") from None
        return Seen(doc["channel"], doc["index_version"], doc["index_blake3"])
