"""Shared helpers for the luopan benchmarks: timing, statistics, the page cache, memory probes, machine facts.

Nothing here depends on luopan internals; suites use only luopan's public API.
"""

from __future__ import annotations

import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- timing ----------------------------------------------------------------------------------------------------
@contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect first, then keep the cyclic GC out of the timed region."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, with the GC collected before and paused during it."""
    with quiet_gc():
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


# -- files -----------------------------------------------------------------------------------------------------
def fsync_path(path: str) -> None:
    """fsync a file (or directory) by path; fsync on a read-only descriptor is valid on Linux."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def settle() -> None:
    """Flush pending writeback (e.g. of just-deleted files' metadata) so it does not land in the next timing."""
    try:
        os.sync()
    except OSError:
        pass


# -- page cache ------------------------------------------------------------------------------------------------
_DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches() -> bool:
    """sync + drop the page cache (root only). Returns False (and never raises) where that is not permitted."""
    settle()
    try:
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    return os.access(_DROP_CACHES, os.W_OK) and drop_caches()


# -- memory ----------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil  # fallback for systems without /proc/self/status

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


class RssSampler:
    """Samples RSS on a background thread (a fallback / cross-check for the kernel high-water mark)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = rss_bytes()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# -- machine ---------------------------------------------------------------------------------------------------
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mount_of(path: str) -> dict[str, str] | None:
    """Device and filesystem type of the mount holding ``path`` (longest matching mount point)."""
    path = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best[1])):
                    best = (dev, mnt, fstype)
    except OSError:
        return None
    return None if best is None else {"device": best[0], "mount": best[1], "fstype": best[2]}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine_info(workdir: str) -> dict[str, Any]:
    mem_total = None
    try:
        import psutil

        mem_total = round(psutil.virtual_memory().total / (1 << 30), 2)
    except Exception:
        pass
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": mem_total,
        "workdir": workdir,
        "workdir_mount": _mount_of(workdir),
        "workdir_free_gib": round(shutil.disk_usage(workdir).free / (1 << 30), 2),
        "versions": {name: _version(name) for name in ("luopan", "torch", "safetensors", "numpy", "blake3")},
        "luopan_commit": _git("rev-parse", "HEAD"),
        "luopan_dirty": None if status is None else bool(status),
        "executable": sys.executable,
        "loadavg_start": loadavg(),
    }


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine makes the figures noisier."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- results shared by the suites that report peer seconds / luopan seconds ---------------------------------
def ratio_result(rid: str, short: str, peer: str, peer_key: str, lp_key: str, goal: float,
                  samples: dict[str, list[float]], nbytes: int, notes: str, **extra: Any) -> dict[str, Any]:
    p, lp = median(samples[peer_key]), median(samples[lp_key])
    r = ratio(p, lp)
    return {
        "id": rid,
        "peer": peer,
        "peer_short": short,
        "ratio": r,
        "value": r,
        "goal": goal,
        "goal_op": ">=",
        "met": r is not None and r >= goal,
        "unit": "peer median seconds / luopan median seconds (> 1: luopan faster)",
        "peer_s": p,
        "luopan_s": lp,
        "peer_gib_s": nbytes / (1 << 30) / p if p else None,
        "luopan_gib_s": nbytes / (1 << 30) / lp if lp else None,
        "peer_samples_s": samples[peer_key],
        "luopan_samples_s": samples[lp_key],
        "peer_spread_s": spread(samples[peer_key]),
        "luopan_spread_s": spread(samples[lp_key]),
        **extra,
        "notes": notes,
    }


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(title: str, head: list[str], rows: list[list[str]], xhead: list[str], xrows: list[list[str]]) -> None:
    """The goal table (last column "met"/"MISSED", coloured) and the context table: rich when it is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for table in ([head] + rows, [xhead] + xrows):
            widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
            for row in table:
                print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
            print()
        return
    console = Console(width=None if sys.stdout.isatty() else 118)
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(head):
        t.add_column(h, justify="right" if 2 <= i <= 4 else "left", no_wrap=i == 0)
    for row in rows:
        style = "green" if row[-1] == "met" else "bold red"
        t.add_row(*row[:-1], f"[{style}]{row[-1]}[/{style}]")
    console.print(t)
    t2 = Table(title=xhead[0], title_justify="left")
    for h in xhead:
        t2.add_column(h, justify="left" if h == xhead[0] else "right")
    for row in xrows:
        t2.add_row(*row)
    console.print(t2)


def print_footer(report: dict[str, Any], legend: str) -> None:
    """Machine line, what the values mean, missed goals and data problems."""
    m = report["machine"]
    print(f"machine: {m.get('cpu_count')} CPUs, {m.get('mem_total_gib')} GiB RAM, workdir on "
          f"{(m.get('workdir_mount') or {}).get('fstype', '?')}; load average at start {m.get('loadavg_start')}, "
          f"at end {m.get('loadavg_end')} (other work on the machine makes the figures noisier)")
    print(legend)
    missed = [r["id"] for r in report["results"] if not r["met"]]
    print("goals missed: " + (", ".join(missed) if missed else "none"))
    if report.get("problems"):
        print("DATA PROBLEMS: " + "; ".join(report["problems"]))


def dir_bytes(path: str) -> int:
    """Sum of the sizes of the regular files under ``path`` (its size if it is a file; 0 if it does not exist). A
    file that goes away meanwhile (a temporary) counts 0."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total
