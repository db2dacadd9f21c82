"""``luopan.journal.Journal``: append-only records that survive a crash, compacted into snapshots kept in the
repository (docs/format.md §16).

    from luopan.journal import Journal
    with Journal("agent-repo", fsync="always", name="agent-1") as j:
        seq = j.append({"step": 1, "tool": "search", "result": "..."})   # durable when append returns
        for rec in j.read(): ...                                        # every record, in order
        j.compact({"state": ...})                                        # a snapshot standing for records < next_seq
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import (
    CheckpointExistsError,
    CorruptJournalError,
    CorruptManifestError,
    ManifestNotFoundError,
    UsageError,
)
from ..format.canonical import json_culprit
from ..repository.core import Repository, repository_of
from ..store.base import Store
from ..repository.opening import connect
from ..repository.pins import read_pins
from ..repository.pruning import prune_series
from ..repository.wal import DEFAULT_SEGMENT_BYTES, Log, Recovery, check_options
from ..repository.walshare import SharedLog
from ..retention import KeepLast, Plan
from ..store.local import LocalStore
from ..store.tiered import TieredStore
from .kind import JOURNAL_KIND
from .names import check_journal, log_prefix, snapshot_key
from .snapshots import Snapshot, key_culprit, read_snapshot, store_snapshot

_BYTES, _JSON = b"B", b"J"


def encode_record(record: Any) -> bytes:
    if isinstance(record, (bytes, bytearray, memoryview)):
        return _BYTES + bytes(record)
    if isinstance(record, dict):
        culprit = key_culprit(record, "record")
        if culprit is not None:
            raise UsageError(f"a journal record is bytes or a JSON-able dict whose keys are strings: {culprit} is "
                             f"not a string, and would come back as one (convert the key with str(), or encode the "
                             "record to bytes yourself)")
        try:
            text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            culprit = json_culprit(record, "record") or "a value"
            raise UsageError(f"a journal record is bytes or a JSON-able dict: {culprit} is not JSON "
                             "(convert it, or encode the record to bytes yourself)") from None
        return _JSON + text.encode()
    raise UsageError(f"a journal record is bytes or a JSON-able dict, not {type(record).__name__}")


def decode_record(payload: bytes, where: str, seq: int) -> Any:
    tag, body = payload[:1], payload[1:]
    if tag == _BYTES:
        return body
    if tag == _JSON:
        try:
            return json.loads(body)
        except ValueError:
            pass
    raise CorruptJournalError(f"{where}: record {seq} passed its checksum but is not a journal record (type byte "
                              f"{tag!r}): it was written by something else")


def _local_root(repo: Repository) -> str:
    store = repo.store
    if isinstance(store, TieredStore):
        store = store.local
    if not isinstance(store, LocalStore):
        raise UsageError(f"{repo.where} is not on a local filesystem: a journal appends to and fsyncs files, which "
                         "object stores cannot do. Keep the journal in a local (or tiered, replicate_to=) repository")
    return store.root


class Journal:
    """A journal named ``name`` in the repository at ``location`` (a path, created when missing, or an open
    ``luopan.Repo``). ``fsync``: ``"always"`` (an acknowledged record is durable), ``"batch"`` (group commit: a machine
    crash can lose the records of the last ``batch_records`` records or ``batch_ms`` milliseconds, whichever is
    fewer) or ``"off"``. One writer at a time per journal (a second gets `JournalBusyError`), or, with
    ``shared=True``, any number of them, in any processes, each appending after catching up with the others
    (docs/format.md §16.2); ``read_only=True`` reads beside them. Thread-safe."""

    def __init__(self, location: str | os.PathLike[str] | Repository | Any, fsync: str = "always", *,
                 name: str = "main", batch_records: int = 64, batch_ms: float = 10.0,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, read_only: bool = False, shared: bool = False) -> None:
        check_journal(name)
        check_options(fsync, batch_records, batch_ms, segment_bytes)
        self.name = name
        if not isinstance(location, (str, os.PathLike, Store)):
            self.repo, self._own_repo = repository_of(location), False  # a luopan.Repo gives its Repository
        else:
            store, config, _tiering = connect(location, create=not read_only, chunk_size=None, pack_size=None,
                                              compression=None, replicate_to=None, local_retention=None, cold=None,
                                              storage_options=None)
            self.repo, self._own_repo = Repository(store, config), True
        self.directory = os.path.join(_local_root(self.repo), *log_prefix(name).rstrip("/").split("/"))
        if shared and read_only:
            raise UsageError("shared=True is for writers: open read_only=True alone to read beside them")
        self.shared = shared
        for attempt in range(3):  # read-only, a writer compacting meanwhile can make one look inconsistent
            latest = self._latest_number() or 0
            options = dict(fsync=fsync, batch_records=batch_records, batch_ms=batch_ms, segment_bytes=segment_bytes,
                           start_seq=latest)
            self._log = SharedLog(self.directory, **options) if shared else Log(self.directory, read_only=read_only,
                                                                                 **options)
            first, end = self._log.first_seq, self._log.next_seq
            if first <= latest <= end:
                return
            self._log.close()
            if not (read_only or shared) or attempt == 2:
                break
        if end < latest:
            raise CorruptJournalError(f"journal {name!r} in {self.repo.where}: its log ends at record {end}, before "
                                      f"its latest snapshot ({latest}): records the snapshot covered were lost from "
                                      "the log afterwards; restore the log's segments")
        raise CorruptJournalError(f"journal {name!r} in {self.repo.where}: its log starts at record {first}, but no "
                                  f"snapshot covers the records before it (the latest is at {latest}): restore the "
                                  "missing segments or snapshot manifest")

    # -- the log ----------------------------------------------------------------------------------------------------
    @property
    def fsync(self) -> str:
        return self._log.fsync

    @property
    def recovered(self) -> list[Recovery]:
        """What opening cut from a torn tail (empty when the log was whole)."""
        return list(self._log.recovered)

    @property
    def last_seq(self) -> int:
        """The seq of the last record appended (-1 when none ever was)."""
        return self._log.last_seq

    @property
    def next_seq(self) -> int:
        return self._log.next_seq

    @property
    def first_seq(self) -> int:
        """The first seq still in the log (the records before it are in a snapshot)."""
        return self._log.first_seq

    def writing(self) -> Any:
        """A context: within it this journal has every record appended so far (by any writer of a ``shared=True``
        journal) and its appends are the only ones; the state it derived from the records stays current."""
        return self._log.writing()

    def reading(self) -> Any:
        """A context: within it this journal has every record appended so far, and none is compacted away."""
        return self._log.reading()

    @property
    def generation(self) -> int:
        """Counts the times another writer of a ``shared=True`` journal compacted records this one had read: state
        built from them must be rebuilt from the latest snapshot and the records after it."""
        return self._log.generation

    def append(self, record: bytes | dict[str, Any]) -> int:
        """Append a record (bytes, or a JSON-able dict); returns its seq (0, 1, 2, …). In ``"always"`` mode it is
        durable when this returns."""
        return self._log.append(encode_record(record))

    def append_many(self, records: Iterable[bytes | dict[str, Any]]) -> list[int]:
        """Append several records with one write and one sync; returns their seqs."""
        return self._log.append_many([encode_record(r) for r in records])

    def items(self, start_seq: int = 0) -> Iterator[tuple[int, Any]]:
        """(seq, record) from ``start_seq`` on. RecordNotFoundError when ``start_seq`` was compacted away."""
        if self.shared:
            with self._log.reading():  # what the other writers appended too
                pass
        for seq, payload in self._log.items(start_seq):
            yield seq, decode_record(payload, self.directory, seq)

    def read(self, start_seq: int = 0) -> Iterator[Any]:
        """The records from ``start_seq`` on, as appended (bytes stay bytes, dicts come back as dicts)."""
        for _seq, record in self.items(start_seq):
            yield record

    def get(self, seq: int) -> Any:
        """The record ``seq``."""
        return decode_record(self._log.get(seq), self.directory, seq)

    def sync(self) -> None:
        """Make every record appended so far durable (in any mode)."""
        self._log.sync()

    @property
    def size_bytes(self) -> int:
        """Bytes of the log's segments on disk."""
        return self._log.size_bytes

    # -- snapshots --------------------------------------------------------------------------------------------------
    def compact(self, snapshot: bytes | dict[str, Any], *, upto: int | None = None,
                metadata: dict[str, Any] | None = None) -> int:
        """Store ``snapshot`` (bytes or a JSON-able dict) as standing for every record with a seq below ``upto``
        (default: all appended so far), content-addressed in the repository, then delete the log segments it covers.
        Returns the snapshot's seq. Retention (``prune``), pins and gc apply to snapshots."""
        end = self._log.next_seq if upto is None else upto
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= self._log.next_seq:
            raise UsageError(f"upto must be a seq from 0 to {self._log.next_seq}, not {upto!r}")
        latest = self._latest_number() or 0
        if end < latest:  # it would stand for fewer records than the log has already given up: nothing to compact
            raise UsageError(f"upto={end} is below the latest snapshot of journal {self.name!r} (seq {latest}): the "
                             f"records before {latest} are only in that snapshot, so a snapshot at {end} cannot be "
                             f"made from the log; compact with upto between {latest} and {self._log.next_seq} "
                             "(or leave upto out)")
        meta = {} if metadata is None else metadata
        if not isinstance(meta, dict) or json_culprit(meta, "metadata") is not None:
            raise UsageError("metadata must be a JSON object")
        self._log.sync()  # what the snapshot stands for is durable before anything that held it goes
        if self.shared:  # the snapshot's seq starts a segment, so every segment before goes and every other writer
            self._log.start_segment(end)  # sees the drop (its generation moves) and rebuilds from the snapshot
        try:
            store_snapshot(self.repo, self.name, end, snapshot, meta, end - latest)
        except CheckpointExistsError:
            if not self.shared:
                raise  # (shared: another writer's snapshot at this seq stands for the same records)
        self._log.drop_before(end)
        return end

    def _latest_number(self) -> int | None:
        seqs = self.snapshots()
        return seqs[-1] if seqs else None

    def snapshots(self) -> list[int]:
        """The seqs of the committed snapshots, ascending."""
        return JOURNAL_KIND.scan(self.repo.store, self.name, False).steps.get(self.name, [])

    def latest_snapshot(self) -> Snapshot | None:
        """The newest snapshot (verified as it is read), or None."""
        n = self._latest_number()
        return None if n is None else self.load_snapshot(n)

    def load_snapshot(self, seq: int) -> Snapshot:
        key = snapshot_key(self.name, seq)
        try:
            doc = self.repo.read_manifest(JOURNAL_KIND, self.name, seq)
        except FileNotFoundError:
            raise ManifestNotFoundError(f"journal {self.name!r} has no snapshot at seq {seq} (it has "
                                        f"{self.snapshots() or 'none'})") from None
        except KeyError:
            raise ManifestNotFoundError(f"journal {self.name!r} has no snapshot at seq {seq}") from None
        if doc["kind"] != "journal":  # pragma: no cover  (parse checks it)
            raise CorruptManifestError(f"{key} is not a journal snapshot")
        return read_snapshot(self.repo, doc, key)

    def prune(self, keep_last: int = 1, *, dry_run: bool = False) -> Plan:
        """Remove all but the ``keep_last`` newest snapshots (pinned ones stay; the newest always stays: the log
        no longer holds what it covers). Their chunks go at the next ``gc``."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise UsageError(f"keep_last must be an integer >= 1 (the newest snapshot always stays), not {keep_last!r}")
        return prune_series(self.repo, JOURNAL_KIND, self.name, KeepLast(keep_last), dry_run=dry_run,
                            missing=ManifestNotFoundError(f"journal {self.name!r} has no snapshot to prune"))

    def pins(self) -> dict[int, dict[str, Any]]:
        return read_pins(self.repo.store, JOURNAL_KIND, self.name)

    # -- closing ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Sync (unless ``fsync="off"``) and release the log; closes the repository when this journal opened it."""
        try:
            self._log.close()
        finally:
            if self._own_repo:
                self.repo.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Journal({self.repo.where!r}, fsync={self.fsync!r}, name={self.name!r}, records "
                f"{self.first_seq}..{self.last_seq})")
