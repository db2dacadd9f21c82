"""Does the newest checkpoint of each run (and the newest version of each artifact, journal snapshot, index) still
verify? The one a resume would load. Sampled by default: every pack it needs is present, and a sample of its chunks
is read and checked against its BLAKE3 address, with those packs' trailers; ``full`` reads every chunk (what
``luopan verify RUN STEP`` does)."""

from __future__ import annotations

import random

from ..errors import (
    IntegrityError,
    LuopanError,
    MissingPackError,
    UnsupportedFormatError,
)
from ..format.names import pack_key
from ..repository.chunkio import ChunkRef, check_pack_trailer, verify_chunks
from ..repository.verify import manifest_chunk_refs
from ..units import format_bytes
from .context import Context, Newest
from .finding import Finding, fail, ok, plural, warn

SAMPLE_CHUNKS = 16  # per manifest: reads a few chunk sizes, so doctor stays quick on a big repository


def sample(refs: list[ChunkRef], full: bool, rng: random.Random) -> list[ChunkRef]:
    """Every chunk when ``full`` or few; else the first, the last and a random sample, SAMPLE_CHUNKS in all."""
    if full or len(refs) <= SAMPLE_CHUNKS:
        return refs
    picked = [refs[0], refs[-1]] + rng.sample(refs[1:-1], SAMPLE_CHUNKS - 2)
    return sorted(picked, key=lambda r: (r.pack, r.offset))


def _problems(ctx: Context, n: Newest, rng: random.Random) -> tuple[list[Exception], int, int, int]:
    """(problems, chunks read, chunks in all, bytes read) of one newest manifest."""
    assert n.doc is not None
    store = ctx.repo.store
    problems: list[Exception] = []
    for pack in n.doc["packs"]:
        if not store.exists(pack_key(pack)):
            problems.append(MissingPackError(f"missing pack: {n.label()} needs {pack_key(pack)}, which is not in "
                                             "the repository"))
    unique = {f"{r.hash}/{r.pack}/{r.offset}": r for r in manifest_chunk_refs(n.kind, n.series, n.number, n.doc)}
    refs = sample(list(unique.values()), ctx.full, rng)
    for pack in sorted({r.pack for r in refs}):
        trailer = check_pack_trailer(store, pack)
        if trailer is not None:
            problems.append(trailer)
    problems += [p for p in verify_chunks(store, refs) if not isinstance(p, MissingPackError)]  # counted above
    return problems, len(refs), len(unique), sum(r.size for r in refs)


def _fix(ctx: Context, n: Newest) -> str:
    if n.kind.name == "checkpoint":
        return (f"{ctx.command(f'verify {n.series} {n.number}')} names every damaged chunk; resume from an earlier "
                "step (CheckpointManager.restore() skips damaged ones) and save again, or restore the damaged files "
                "from a replica")
    return (f"{ctx.command('verify')} names every damaged file; restore them from a replica, or commit that "
            f"{n.kind.series_noun} again")


def check_newest(ctx: Context) -> list[Finding]:
    newest = ctx.newest()
    if not newest:
        return [ok("verify", "no checkpoints or artifact versions yet")]
    rng = random.Random()
    out: list[Finding] = []
    read = total = nbytes = 0
    for n in newest:
        if isinstance(n.error, UnsupportedFormatError):
            out.append(warn("verify", f"{n.label()} (the newest) was written by a newer luopan: {n.error}",
                            "upgrade luopan (pip install -U luopan)"))
            continue
        if n.error is not None:
            out.append(fail("verify", f"{n.label()} (the newest) is damaged: {n.error}", _fix(ctx, n)))
            continue
        try:
            problems, got, of, b = _problems(ctx, n, rng)
        except (IntegrityError, KeyError, TypeError, ValueError) as exc:  # a manifest that parses but misleads
            problems, got, of, b = [exc], 0, 0, 0
        except (LuopanError, OSError) as exc:
            out.append(warn("verify", f"{n.label()} (the newest) could not be read: {exc}",
                            "check that the repository's storage is reachable and readable, then run doctor again"))
            continue
        read, total, nbytes = read + got, total + of, nbytes + b
        if problems:
            more = f" (and {plural(len(problems) - 1, 'more problem')})" if len(problems) > 1 else ""
            out.append(fail("verify", f"{n.label()} (the newest) is damaged: {problems[0]}{more}", _fix(ctx, n)))
    if not any(f.status == "fail" for f in out):
        how = "every chunk" if ctx.full or read == total else f"{read} of {total} chunks (sampled; --full reads all)"
        counts: dict[str, int] = {}
        for n in newest:
            counts[n.kind.series_noun] = counts.get(n.kind.series_noun, 0) + 1
        of_what = ", ".join(plural(c, noun) for noun, c in counts.items())
        each = "" if len(newest) == 1 else "each of "
        out.insert(0, ok("verify", f"the newest of {each}{of_what} verifies: {how}, {format_bytes(nbytes)} read, "
                                   "BLAKE3 intact"))
    return out
