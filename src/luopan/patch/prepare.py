"""Everything ``patch apply`` checks before it writes a byte (docs/format.md §13.4), in this order: the prefix and
size limits, the signature (before the header is parsed), the header, the file's length, the base's content
fingerprint, and that every chunk of the target comes from the base or the patch. Then it reads each chunk, verified,
wherever it comes from."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3
import zstandard

from .._parallel import ordered_map
from ..errors import BaseMismatchError, CorruptPatchError, CorruptSafetensorsError, IntegrityError, StateMismatchError
from ..signing import TrustedKeys, check_signature
from ..units import format_bytes
from .basefile import HashedFile, hash_file
from .container import PatchFile, open_patch
from .files import open_regular, read_exact, workers_for
from .header import Blob, Header, parse_header

# The most memory a zstd frame may ask of its decoder: 8 MiB per worker, whatever the chunk size. ``create`` writes
# frames with a window of 2**WINDOW_LOG (level 3's own, so its output is unchanged); a frame that needs more is damage.
MAX_WINDOW = 8 << 20
WINDOW_LOG = 21


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of the target: where it goes (offset in the tensor data), and where it comes from: the base file
    (``base_offset``) or the patch (``blob``)."""

    offset: int
    size: int
    hash: str
    base_offset: int = -1
    blob: Blob | None = None


@dataclass
class Prepared:
    """A checked patch and base, open, with the plan of every target chunk. Close it (or use ``with``)."""

    patch: PatchFile
    header: Header
    signed_by: str | None
    base_fd: int
    base_path: str
    base: HashedFile = field(init=False)  # set by ``settle``, once the base is hashed
    chunks: list[Chunk] = field(default_factory=list)

    def settle(self, base: HashedFile) -> None:
        """Take the hashed base: BaseMismatchError (naming both fingerprints) unless its content fingerprint is the
        patch's, then the plan of every target chunk (CorruptPatchError for one that neither holds)."""
        expected = self.header.base["fingerprint"]
        if base.fingerprint != expected:
            h, where = self.header, self.base_path
            err = BaseMismatchError(
                f"{where} is not the base this patch was made for: the patch needs content fingerprint {expected} "
                f"({h.base['source']}: {h.base['tensors']} tensors, {format_bytes(h.base['bytes'])}), {where} has "
                f"{base.fingerprint} ({len(base.tensors)} tensors, {format_bytes(base.nbytes)}); nothing was written")
            err.expected, err.actual = expected, base.fingerprint  # type: ignore[attr-defined]
            raise err
        self.base = base
        self.chunks = plan(self.header, base, self.patch.path)

    def close(self) -> None:
        self.patch.close()
        if self.base_fd >= 0:
            os.close(self.base_fd)
            self.base_fd = -1

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def each(self, fn: Callable[[Chunk], None], chunks: list[Chunk] | None = None) -> None:
        """``fn`` over every chunk of the plan (or of ``chunks``) on as many threads as the buffer budget allows
        (each holds one chunk); the first error stops the rest (nothing more is queued) and is raised."""
        workers = workers_for(self.header.chunk_size)
        with ThreadPoolExecutor(workers, "luopan-patch") as pool:
            for _ in ordered_map(pool, fn, self.chunks if chunks is None else chunks,
                                 window=2 * workers):  # a few chunks queued, not all
                pass

    def read(self, c: Chunk, dest: memoryview) -> None:
        """Fill ``dest`` (``c.size`` bytes) with the chunk and verify its BLAKE3. IntegrityError when the base changed
        since it was hashed, CorruptPatchError for a damaged blob; the bytes in ``dest`` are then not to be used."""
        if c.blob is None:
            if read_exact(self.base_fd, dest, c.base_offset) != c.size:
                raise IntegrityError(f"{self.base.path} became shorter while the patch was applied; nothing was "
                                     "written")
            if blake3.blake3(dest).hexdigest() != c.hash:
                raise IntegrityError(f"{self.base.path} changed while the patch was applied (chunk {c.hash[:16]}… at "
                                     f"offset {c.base_offset} no longer matches); nothing was written")
            return
        self._read_blob(c.blob, dest)
        actual = blake3.blake3(dest).hexdigest()
        if actual != c.hash:
            raise CorruptPatchError(f"{self.patch.path}: blob {c.hash[:16]}… is damaged (its bytes hash to "
                                    f"{actual[:16]}…); nothing was written")

    def _read_blob(self, b: Blob, dest: memoryview) -> None:
        start = self.patch.body_start + b.offset
        if b.codec == "none":
            if read_exact(self.patch.fd, dest, start) != b.size:
                raise CorruptPatchError(f"{self.patch.path} is truncated inside blob {b.hash[:16]}…")
            return
        # streamed into place: memory for one chunk, whatever the frame claims (its window is bounded too)
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        try:
            with dctx.stream_reader(_Range(self.patch.fd, start, b.length), read_size=1 << 20) as reader:
                got = 0
                while got < b.size:
                    n = reader.readinto(dest[got:])
                    if n == 0:
                        break
                    got += n
                extra = reader.read(1) if got == b.size else b""
        except zstandard.ZstdError as exc:
            raise CorruptPatchError(f"{self.patch.path}: blob {b.hash[:16]}… does not decompress ({exc}); nothing "
                                    "was written") from None
        if got != b.size or extra:
            raise CorruptPatchError(f"{self.patch.path}: blob {b.hash[:16]}… decompresses to "
                                    f"{'more' if extra else got} bytes, not {b.size}; nothing was written")


class _Range:
    """``read(n)`` over ``length`` bytes of a file from ``offset``: what the zstd stream reader consumes."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.pos, self.left = fd, offset, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = os.pread(self.fd, n, self.pos) if n else b""
        self.pos += len(data)
        self.left -= len(data)
        return data


def open_checked(patch_path: str | os.PathLike[str], trusted_keys: TrustedKeys | str | os.PathLike[str] | None,
                 require_signature: bool | None) -> tuple[PatchFile, Header, str | None]:
    """The open patch, its checked header and the trusted key that signed it (None when no signature was checked):
    the prefix, the signature, the header and the file's length, in that order. The caller closes the patch."""
    trusted = trusted_keys if isinstance(trusted_keys, TrustedKeys) else TrustedKeys.load(trusted_keys)
    pf = open_patch(patch_path)
    try:
        if require_signature is False and pf.signature is None:
            signed_by = None
        else:
            signed_by = check_signature(trusted, pf.header_bytes, pf.signature, f"patch {pf.path}",
                                        required=require_signature)
        header = parse_header(pf.header_bytes, pf.path)
        end = pf.body_start + header.body_bytes
        if pf.size != end:
            raise CorruptPatchError(f"{pf.path} is {'truncated' if pf.size < end else 'longer than its header says'}: "
                                    f"{pf.size} bytes, its header says {end}; nothing was written")
        return pf, header, signed_by
    except BaseException:
        pf.close()
        raise


def check_target(header: Header, expect_target: str | None, where: str) -> None:
    """StateMismatchError (``expected``, ``actual``) when ``expect_target`` is given and is not the patch's target
    content fingerprint."""
    actual = header.target["fingerprint"]
    if expect_target is not None and expect_target != actual:
        err = StateMismatchError(f"{where} makes content fingerprint {actual} ({header.target['run']}@"
                                 f"{header.target['step']}), not the expected {str(expect_target)[:80]}; nothing was "
                                 "written")
        err.expected, err.actual = expect_target, actual  # type: ignore[attr-defined]
        raise err


def prepare(patch_path: str | os.PathLike[str], base_path: str | os.PathLike[str], *,
            trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None, require_signature: bool | None = None,
            expect_target: str | None = None, check: Callable[[Header], Any] | None = None,
            progress: Callable[[int], Any] | None = None, on_total: Callable[[int], Any] | None = None,
            hash_base: bool = True) -> Prepared:
    """Open and check a patch and its base (module docstring); nothing is written. The caller closes the result.
    ``expect_target`` and ``check(header)`` (which raises to refuse) are checked before the base is read.
    ``progress(n)`` gets the bytes of the base as they are hashed; ``on_total(n)`` the bytes of base and target.
    With ``hash_base=False`` the base is opened, not read: the caller hashes it (``basefile.hash_file``) and hands
    the result to ``Prepared.settle`` before it uses ``base`` or ``chunks``."""
    pf, header, signed_by = open_checked(patch_path, trusted_keys, require_signature)
    base_fd = -1
    try:
        check_target(header, expect_target, pf.path)
        if check is not None:
            check(header)
        where = os.fspath(base_path)
        base_fd = open_regular(where, CorruptSafetensorsError)
        if on_total is not None:  # the base is hashed, then the target written
            on_total(os.fstat(base_fd).st_size + header.target["bytes"])
        prep = Prepared(pf, header, signed_by, base_fd, where)
        if hash_base:
            prep.settle(hash_file(base_fd, where, header.chunk_size, progress))
        return prep
    except BaseException:
        pf.close()
        if base_fd >= 0:
            os.close(base_fd)
        raise


def plan(header: Header, base: HashedFile, where: str) -> list[Chunk]:
    """Every chunk of the target in output order, from the base where it has it, else from the patch."""
    out = []
    offset = 0
    for t in header.tensors:
        for h, size in t.chunks:
            located = base.where.get(h)
            if located is not None:
                if located[1] != size:
                    raise CorruptPatchError(f"{where}: tensor {t.name!r} lists chunk {h[:16]}… as {size} bytes; the "
                                            f"base holds it as {located[1]} bytes; nothing was written")
                out.append(Chunk(offset, size, h, base_offset=located[0]))
            elif h in header.blobs:
                out.append(Chunk(offset, size, h, blob=header.blobs[h]))
            else:
                raise CorruptPatchError(f"{where}: tensor {t.name!r} needs chunk {h[:16]}…, which neither the patch "
                                        "nor the base holds; nothing was written")
            offset += size
    return out
