"""Reading chunks back, for every kind: each chunk's BLAKE3 is checked as it is read (docs/format.md §10 rule 7)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import xxhash

from ..errors import (
    CorruptPackError,
    IntegrityError,
    MissingPackError,
    StorageError,
    UnreadableError,
)
from ..format.limits import MAX_TRAILER_BYTES
from ..format.names import pack_key
from ..format.pack import FOOTER_SIZE, HEADER_SIZE, PackFormatError, parse_trailer
from ..store.base import KeyNotFound, Store
from ..format.codecs import decode_blob
from .parallel import WORKERS, ordered_map

_tls = threading.local()


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of one entry of one manifest, with what error messages need to name it."""

    owner: str  # what holds the chunk, for messages: "run 'a' step 3", "artifact 'x' version 2"
    path: str
    index: int  # chunk number within the entry
    hash: str
    pack: str
    offset: int
    length: int
    size: int
    codec: str
    xxh3: str = ""  # set: check the bytes against this XXH3-128 instead of the BLAKE3 address (read_check="xxh3")

    def where(self) -> str:
        return (f"{self.owner} entry {self.path!r} chunk {self.index} "
                f"(hash {self.hash[:16]}…, pack {self.pack[:16]}… offset {self.offset})")


def _scratch(size: int, name: str = "buf") -> memoryview:
    """``size`` bytes of this thread's scratch memory ``name`` (reused until its next call)."""
    buf = getattr(_tls, name, None)
    if buf is None or len(buf) < size:
        buf = bytearray(size)
        setattr(_tls, name, buf)
    return memoryview(buf)[:size]


class PackSizes:
    """The real sizes of the packs one batch of reads touches, each looked up once (a stat, or a HEAD on an object
    store): a chunk row is checked against its pack's size before any byte is read or any buffer sized by it, so
    a damaged or hostile manifest cannot make a read allocate what it declares (docs/format.md §11)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._sizes: dict[str, int] = {}

    def prefetch(self, packs: set[str]) -> None:
        """Look up the sizes of many packs at once, in parallel (one HEAD each on an object store)."""
        missing = sorted(p for p in packs if p not in self._sizes)
        if len(missing) < 4:
            return

        def size(pack: str) -> None:
            try:
                self._sizes[pack] = self.store.size(pack_key(pack))
            except KeyNotFound:
                pass  # reported by check() with the chunk that needs it

        with ThreadPoolExecutor(min(16, len(missing)), "luopan-stat") as pool:
            list(pool.map(size, missing))

    def check(self, ref: ChunkRef) -> None:
        size = self._sizes.get(ref.pack)
        if size is None:
            key = pack_key(ref.pack)
            try:
                size = self._sizes[ref.pack] = self.store.size(key)
            except KeyNotFound:
                raise MissingPackError(f"missing pack: {ref.where()}: {key} is not in the repository") from None
        if ref.offset + ref.length > size:
            raise CorruptPackError(f"pack truncated: {ref.where()} needs bytes up to {ref.offset + ref.length}, "
                                   f"the pack has {size}")


def read_chunk(store: Store, ref: ChunkRef, out: memoryview, sizes: PackSizes | None = None) -> None:
    """Read and verify one chunk into ``out`` (exactly ``ref.size`` bytes). Raises typed IntegrityErrors; a
    pack that cannot be read raises StorageError. ``sizes`` checks the row against the pack's size first."""
    key = pack_key(ref.pack)
    (sizes or PackSizes(store)).check(ref)
    try:
        if ref.codec == "none":
            got = store.read_into(key, ref.offset, out)
            if got != ref.size:
                raise CorruptPackError(f"pack truncated: {ref.where()} has {got} of {ref.size} bytes")
        else:
            data = _scratch(ref.length, "stored")  # reused: a fresh buffer per chunk would be faulted in each time
            got = store.read_into(key, ref.offset, data)
            if got != ref.length:
                raise CorruptPackError(f"pack truncated: {ref.where()} has {got} of {ref.length} bytes")
            decode_blob(ref.codec, data, ref.size, ref.where(), out)
    except KeyNotFound:
        raise MissingPackError(f"missing pack: {ref.where()}: {key} is not in the repository") from None
    if ref.xxh3:
        if xxhash.xxh3_128_hexdigest(out) != ref.xxh3:
            raise IntegrityError(f"XXH3 mismatch: {ref.where()}: the stored bytes are damaged")
        return
    actual = blake3.blake3(out).hexdigest()
    if actual != ref.hash:
        raise IntegrityError(f"hash mismatch: {ref.where()} reads as {actual[:16]}…; the stored bytes are damaged")


def blob_reader(store: Store, owner: str) -> Callable[[str, list[Any]], bytes]:
    """Reads the blob of one chunk row whole, checked against its BLAKE3 address: a manifest's entry groups
    (docs/format.md §8.5). Missing or damaged packs raise the typed errors of ``read_chunk``."""
    sizes = PackSizes(store)  # one size lookup per pack for all the groups of a manifest

    def read(pack: str, row: list[Any]) -> bytes:
        out = bytearray(row[4])  # the row's size, bounded by the caller
        read_chunk(store, ChunkRef(owner, "(entry group)", 0, row[0], pack, row[2], row[3], row[4], row[5]),
                   memoryview(out), sizes)
        return bytes(out)
    return read


def read_chunks(store: Store, jobs: list[Any], *, via_scratch: bool = False, sizes: PackSizes | None = None) -> None:
    """Read and verify many chunks on both cores, each straight into its destination.

    Jobs are ``(ref, out)`` or ``(ref, out, after)``: ``after(out)`` runs on the worker once the chunk is verified
    and in place (row deltas patch a base chunk there, while it is in cache). A job may also be a callable, run on a
    worker as it is (a row delta's patch reads, queued ahead of the base chunks). With ``via_scratch`` each chunk is
    read and verified in scratch memory and only then copied to its destination, so damaged bytes never reach it
    (for restoring into memory the caller already owns), and ``after`` runs on the scratch copy before that.
    """
    sizes = sizes or PackSizes(store)

    def one(job: Any) -> None:
        if callable(job):
            job()
            return
        ref, out = job[0], job[1]
        if via_scratch:
            sizes.check(ref)  # before the scratch buffer is sized by the row
            tmp = _scratch(ref.size)
            read_chunk(store, ref, tmp, sizes)
            if len(job) > 2:
                job[2](tmp)  # patched in scratch too: a delta whose patch fails to read never reaches ``out``
            out[:] = tmp
        else:
            read_chunk(store, ref, out, sizes)
            if len(job) > 2:
                job[2](out)

    if len(jobs) <= 1:
        for job in jobs:
            one(job)
        return
    with ThreadPoolExecutor(WORKERS, "luopan-read") as pool:
        for _ in ordered_map(pool, one, jobs, window=4 * WORKERS, group=_job_bytes, group_size=READ_GROUP):
            pass


# Small chunks (a model's biases and norms) go to a worker in groups of about this many bytes, not one handoff (a
# future and a wakeup) each: a chunk of a few KiB is read and hashed in less time than its handoff takes.
READ_GROUP = 1 << 20


def _job_bytes(job: Any) -> int:
    return READ_GROUP if callable(job) else job[0].size  # a patch's reads are handed over alone


def verify_chunks(
    store: Store, refs: list[ChunkRef], progress: Callable[[int], Any] | None = None
) -> list[IntegrityError]:
    """Read every chunk into scratch memory and check it; returns the problems found (does not raise them). A pack
    that cannot be read is an UnreadableError problem, and verification carries on."""
    sizes = PackSizes(store)
    sizes.prefetch({ref.pack for ref in refs})

    def one(ref: ChunkRef) -> tuple[int, IntegrityError | None]:
        try:
            sizes.check(ref)  # before the scratch buffer is sized by the row
            read_chunk(store, ref, _scratch(ref.size), sizes)
        except IntegrityError as exc:
            exc.chunk = ref  # type: ignore[attr-defined]  # lets the caller stop deduplicating against it
            return ref.size, exc
        except StorageError as exc:
            return ref.size, UnreadableError(f"cannot read {ref.where()}: {exc}")
        return ref.size, None

    problems = []
    with ThreadPoolExecutor(WORKERS, "luopan-verify") as pool:
        for size, problem in ordered_map(pool, one, refs, window=4 * WORKERS):
            if problem is not None:
                problems.append(problem)
            if progress is not None:
                progress(size)
    return problems


def read_trailer(store: Store, pack_id: str) -> tuple[str, list[dict[str, Any]]]:
    """(pack id computed from the trailer, checked blob records) of a pack. Raises KeyNotFound, PackFormatError
    (damage: the trailer length is checked against the file's size and MAX_TRAILER_BYTES before it is read) or
    StorageError."""
    key = pack_key(pack_id)
    size = store.size(key)
    head = store.get_range(key, 0, HEADER_SIZE)
    footer = store.get_range(key, max(0, size - FOOTER_SIZE), FOOTER_SIZE)
    tlen = int.from_bytes(footer[:8], "little") if len(footer) == FOOTER_SIZE else 0
    if tlen > MAX_TRAILER_BYTES or tlen + FOOTER_SIZE + HEADER_SIZE > size:
        raise PackFormatError("pack trailer length out of range")
    tail = store.get_range(key, size - FOOTER_SIZE - tlen, FOOTER_SIZE + tlen)
    return parse_trailer(head, tail, size)


def check_pack_trailer(store: Store, pack_id: str) -> IntegrityError | None:
    """Check that a pack's header, footer and trailer index are intact and that the trailer hashes to the pack id
    (docs/format.md §6). Returns the problem (UnreadableError when the pack cannot be read), or None."""
    try:
        computed, _blobs = read_trailer(store, pack_id)
    except KeyNotFound:
        return None  # reported per chunk as MissingPackError
    except PackFormatError as exc:
        return CorruptPackError(f"pack {pack_id[:16]}…: {exc}")
    except StorageError as exc:
        return UnreadableError(f"pack {pack_id[:16]}… cannot be read: {exc}")
    if computed != pack_id:
        return CorruptPackError(f"pack {pack_id[:16]}…: its trailer index is damaged (hashes to {computed[:16]}…)")
    return None
