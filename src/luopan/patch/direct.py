"""``patch apply -o FILE``: the target written in one pass over the base (docs/format.md §13.4).

The chunks the patch carries are decoded, verified and written first (they are the changed part: few, and small
beside the base). Then the base is read once, in chunks, and each chunk, hashed for the base's content fingerprint,
is written from the same buffer to every place of the target that names its hash: the hash that proves it is the
chunk the target needs is the hash of the very bytes written. The fingerprint is compared once the base is hashed;
a base that is not the patch's (or a plan that does not hold) discards the temporary output, so the output file is
untouched by any failure. One fsync of the output, its rename and one fsync of its directory end it (AtomicOutput).

Before, the base was read and hashed twice (once for its fingerprint, once more as each chunk was written): the
single pass halves the reading and hashing, which on a warm page cache is most of the CPU an apply spends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .basefile import hash_file, scratch
from .files import AtomicOutput
from .prepare import Chunk, Prepared


def write_file(prep: Prepared, out_path: str | os.PathLike[str], head: bytes,
               progress: Callable[[int], Any] | None) -> int:
    """Write the target of ``prep`` (opened with ``hash_base=False``; settled here) as a safetensors file whose
    header is ``head``; returns its size. The errors of ``Prepared.settle`` and ``Prepared.read``, or the output's
    (``files.output_error``), with nothing written at ``out_path``."""
    header = prep.header
    total = len(head) + header.target["bytes"]
    carried: list[Chunk] = []  # chunks the patch carries, in target order
    wanted: dict[str, list[tuple[int, int]]] = {}  # the rest: hash -> (target offset, size) of each place
    offset = 0
    for t in header.tensors:
        for h, size in t.chunks:
            blob = header.blobs.get(h)
            if blob is not None:
                carried.append(Chunk(offset, size, h, blob=blob))
            else:
                wanted.setdefault(h, []).append((offset, size))
            offset += size
    lock = threading.Lock()
    landed: set[str] = set()  # hashes of the base already written (a base may hold one chunk many times)
    put = [0]  # target bytes written

    with AtomicOutput(out_path, total) as out:
        def place(data: memoryview, at: int) -> None:
            out.write(data, len(head) + at)
            out.written(len(head) + at, len(data))
            with lock:
                put[0] += len(data)
            if progress is not None:
                progress(len(data))

        out.write(head, 0)
        out.written(0, len(head))

        def carry(c: Chunk) -> None:
            buf = scratch(c.size)
            prep.read(c, buf)  # verified in ``buf``, the bytes written
            place(buf, c.offset)

        prep.each(carry, carried)

        def land(h: str, buf: memoryview) -> None:
            places = wanted.get(h)
            if places is None:
                return
            with lock:
                if h in landed:
                    return
                landed.add(h)
            for at, size in places:
                if size == len(buf):  # else settle's plan refuses the patch (once the base is known to be its own)
                    place(buf, at)

        prep.settle(hash_file(prep.base_fd, prep.base_path, header.chunk_size, progress, land))
        if put[0] != header.target["bytes"]:  # settle's plan found every chunk: a hole here is a bug, not damage
            raise RuntimeError(f"patch apply wrote {put[0]} of the target's {header.target['bytes']} bytes; "
                               f"nothing was written to {os.fspath(out_path)}")
    return total
