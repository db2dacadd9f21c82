"""The `incremental` suite (issue 3). So far: P8 (re-saving unchanged state) and P6 (async save stall).

P8.unchanged_over_full: a state of NumPy arrays (no version counters: change detection must look at the bytes) is
saved into a fresh repository (a first, full save), then saved again unchanged as the next step of the same run.
ratio = re-save time / full save time (goal <= 0.10). Medians over repetitions, each in a fresh repository.

P6.stall_over_sync: the time `repo.save_async` blocks the caller (steady state: host buffers already allocated by
an earlier async save, previous save finished) / the time of a synchronous `repo.save` of the same fp32 torch state
into a fresh repository. Every tensor changes between saves. Goal <= 0.10.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np

from common import machine_info, median, settle, spread, timed


def build_numpy_state(size_mib: int, seed: int = 0) -> dict[str, Any]:
    """fp32 arrays totalling size_mib MiB: 4 MiB matrices plus a few small vectors (a model + optimizer shape)."""
    rng = np.random.default_rng(seed)
    total = size_mib << 20
    state: dict[str, Any] = {}
    i = 0
    while total > 0:
        n = min(total, 4 << 20)
        if n == 4 << 20:
            state[f"layers.{i}.weight"] = rng.standard_normal((1024, 1024), dtype=np.float32)
        else:
            state[f"layers.{i}.rest"] = rng.standard_normal(n // 4, dtype=np.float32)
        state[f"layers.{i}.bias"] = rng.standard_normal(1024, dtype=np.float32)
        total -= n
        i += 1
    return state


def run_incremental(size_mib: int, reps: int, workdir_parent: str | None, log: Any) -> dict[str, Any]:
    import luopan

    work = tempfile.mkdtemp(prefix="luopan-bench-inc-", dir=workdir_parent)
    try:
        state = build_numpy_state(size_mib)
        nbytes = sum(a.nbytes for a in state.values())
        full, again, written = [], [], []
        for r in range(reps + 1):  # the first repetition warms up and is not counted
            path = os.path.join(work, f"repo{r}")
            repo = luopan.open(path)
            settle()
            t_full, _ = timed(lambda: repo.save("run", 1, state))
            t_again, info = timed(lambda: repo.save("run", 2, state))
            if r:
                full.append(t_full)
                again.append(t_again)
                written.append(info.stored_bytes)
            log(f"  rep {r}{' (warm-up)' if not r else ''}: full save {t_full:.3f}s, unchanged re-save "
                f"{t_again:.3f}s, re-save wrote {info.stored_bytes} bytes")
            shutil.rmtree(path)
        ratio = median(again) / median(full)
        p6 = _p6(size_mib, reps, work, log)
        return {
            "suite": "incremental",
            "size_mib": size_mib,
            "machine": machine_info(work),
            "config": {"reps": reps},
            "results": [{
                "id": "P8.unchanged_over_full",
                "ratio": round(ratio, 4),
                "value": round(ratio, 4),
                "goal": 0.10,
                "goal_op": "<=",
                "met": ratio <= 0.10,
                "luopan_full_save_s": median(full),
                "luopan_unchanged_resave_s": median(again),
                "full_save_spread": spread(full),
                "resave_spread": spread(again),
                "resave_bytes_written": max(written),
                "state_bytes": nbytes,
                "notes": "NumPy arrays (no version counters), so every byte is looked at: XXH3-128 per chunk "
                         "against the run's previous manifest (docs/format.md §5.1); BLAKE3 only for chunks "
                         "that changed (none here). Each repetition uses a fresh repository.",
            }, p6],
            "pending": ["P2.vs_torch_save_full", "P2.vs_md5_delta", "P2.bytes_over_changed", "P3.full_over_written",
                        "P4.restore_100_over_1"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _p6(size_mib: int, reps: int, work: str, log: Any) -> dict[str, Any]:
    import luopan
    import torch

    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(max(1, size_mib // 4))}
    nbytes = sum(t.numel() * 4 for t in state.values())
    async_repo = luopan.open(os.path.join(work, "async"))
    async_repo.save_async("run", 0, state).wait()  # warm-up: allocates the host buffers
    stalls, syncs = [], []
    for r in range(1, reps + 1):
        for t in state.values():
            t.add_(1.0)
        settle()
        t_stall, handle = timed(lambda: async_repo.save_async("run", r, state))
        handle.wait()
        path = os.path.join(work, f"sync{r}")
        sync_repo = luopan.open(path)
        settle()
        t_sync, _ = timed(lambda: sync_repo.save("run", r, state))
        shutil.rmtree(path)
        stalls.append(t_stall)
        syncs.append(t_sync)
        log(f"  P6 rep {r}: save_async blocked {t_stall:.3f}s, synchronous save {t_sync:.3f}s")
    async_repo.close()
    ratio = median(stalls) / median(syncs)
    return {
        "id": "P6.stall_over_sync",
        "ratio": round(ratio, 4),
        "value": round(ratio, 4),
        "goal": 0.10,
        "goal_op": "<=",
        "met": ratio <= 0.10,
        "luopan_async_stall_s": median(stalls),
        "luopan_sync_save_s": median(syncs),
        "stall_spread": spread(stalls),
        "sync_spread": spread(syncs),
        "state_bytes": nbytes,
        "notes": "fp32 CPU torch tensors, all changed between saves. The stall is a two-thread memcpy into reused "
                 "host buffers; the sync save writes every byte into a fresh repository with fsync.",
    }
