"""Files outside any repository that patches read and write: exact positional reads, and an output that appears
atomically (a temporary file in the same directory, fsync, rename, fsync of the directory) or not at all."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any

from .._files import check_output_path, sync_placed, write_error
from .._parallel import WORKERS
from ..errors import StorageFullError
from ..units import format_bytes


def open_regular(path: str, refuse: Callable[[str], BaseException]) -> int:
    """A read-only descriptor of the regular file at ``path``; ``refuse(message)`` is raised for a FIFO, device or
    directory (opened without blocking, never read). OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse(f"{path} is not a regular file")
    return fd


def read_exact(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``fd`` at ``offset``; returns the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got



def available_memory() -> int | None:
    """Bytes of memory available to a new allocation: MemAvailable of /proc/meminfo (Linux: free memory plus what
    the page cache can give back), else the free pages os.sysconf counts; None when neither can be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


class AtomicOutput:
    """``with AtomicOutput(path) as out: out.write(data, offset)`` writes a temporary file next to ``path`` and
    renames it over ``path`` only when the block succeeds (after fsync); on any error the temporary file is removed
    and ``path`` is untouched. With ``size``, too little free space is a StorageFullError before anything is
    written."""

    def __init__(self, path: str | os.PathLike[str], size: int | None = None) -> None:
        self.path = check_output_path(path)
        self.size = size
        host = socket.gethostname().replace("-", "_")[:32] or "host"
        self.tmp = f"{self.path}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        self.fd = -1
        self._lock = threading.Lock()
        self._done: dict[int, int] = {}  # written ranges after the gap-free prefix: offset -> end
        self._front = 0  # bytes written without a gap from the start
        self._kicked = 0  # bytes whose writeback was started

    def __enter__(self) -> AtomicOutput:
        directory = os.path.dirname(os.path.abspath(self.path))
        if self.size:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            if free < self.size:  # checked, not reserved: fallocate'd extents cost a conversion on every write
                raise StorageFullError(28, f"writing {self.path} needs {format_bytes(self.size)}, {directory} has "
                                           f"{format_bytes(free)} free: nothing was written")
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except BaseException as exc:
            self._discard()
            raise output_error(exc, self.path) from None
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            try:
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = -1
                os.replace(self.tmp, self.path)
            except BaseException as failed:
                self._discard()
                raise output_error(failed, self.path) from None
            sync_placed(self.path)
            return
        self._discard()

    def write(self, data: Any, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (any thread); a failure is a luopan error (output_error)."""
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            raise output_error(exc, self.path) from None

    def written(self, offset: int, length: int) -> None:
        """Note that ``length`` bytes at ``offset`` are final (any thread). Once the bytes written without a gap
        from the start have grown by WRITE_BEHIND, their writeback starts (POSIX_FADV_DONTNEED, whole pages only):
        the disk works while later chunks are read and hashed instead of all at the final fsync, the output does not
        evict the caller's page cache, and no page is written to again while it is under writeback (a page shared by
        two chunks would make the second writer wait for the disk: starting writeback after every chunk made applies
        up to 3x slower here). Measured with 1 GiB applies back to back on this project's shared disk, 10 each:
        median 1.06 s with it, 1.85 s without."""
        with self._lock:
            self._done[offset] = offset + length
            while self._front in self._done:
                self._front = self._done.pop(self._front)
            end = self._front - self._front % PAGE
            if end - self._kicked < WRITE_BEHIND:
                return
            start, self._kicked = self._kicked, end
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # advice only

    def _discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def output_error(exc: BaseException, path: str) -> BaseException:
    """A luopan error for a failure writing the output ``path`` before it was renamed into place (other exceptions
    pass through): luopan._files.write_error."""
    return write_error(exc, path, "nothing was written")


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
WRITE_BEHIND = 32 << 20  # writeback is started for every 32 MiB of finished output

# Chunk buffers in flight while a patch is applied or a base hashed: each worker holds one chunk, so a 1 GiB chunk
# size gets one worker and memory stays within this budget plus one chunk (docs/format.md §13.4).
BUFFER_BUDGET = 128 << 20


def workers_for(chunk_size: int) -> int:
    return max(1, min(WORKERS, BUFFER_BUDGET // chunk_size))
