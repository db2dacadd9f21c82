"""save_async of CUDA state: how long the caller stalls (device→pinned host copy) vs how long the save takes.

    .venv/bin/python benchmarks/gpu_staging.py                    # 1 GiB of fp32 CUDA tensors, 5 saves
    .venv/bin/python benchmarks/gpu_staging.py --size-mib 4096 --saves 3 --workdir /mnt/scratch
    .venv/bin/python benchmarks/gpu_staging.py --size-mib 8192 --saves 2 --scenarios waited,dcp

Three figures, medians over ``--saves`` saves after one untimed save that allocates (pins) the buffers; every tensor
changes before each save (in place, on the current stream, synchronised before the clock starts):

* ``waited``: save_async, then handle.wait() — stall = time save_async blocks, total = until the save committed.
* ``back-to-back``: save_async called again as soon as the previous call returned (overlap=True, the default): the
  copy of one save runs while the previous one writes; stall per call, total = all saves / count.
* ``back-to-back, overlap=False``: the same, each call first waiting for the previous save (the old behaviour).
* ``dcp async_save (pinned)``: the peer, PyTorch DCP's ``async_save`` with its DefaultStager in pinned memory; stall
  = until its copy to host completed (``staging_completion``), total = until the checkpoint was written.

Needs a CUDA device; without one it says so and exits with status 2 (it cannot run). Scratch space: about 2x the
state per repository (a fresh one per scenario, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import luopan
except ImportError:  # running from a checkout without an installed luopan
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    import luopan


def build_state(torch, size_mib: int) -> dict:
    """fp32 CUDA tensors totalling size_mib MiB: 64 MiB matrices and one remainder."""
    g = torch.Generator(device="cuda").manual_seed(0)
    state, left, i = {}, size_mib << 20, 0
    while left > 0:
        n = min(left, 64 << 20) // 4
        state[f"layers.{i}.weight"] = torch.randn(n, device="cuda", generator=g).view(-1, 1024) \
            if n % 1024 == 0 else torch.randn(n, device="cuda", generator=g)
        left -= n * 4
        i += 1
    return state


def touch(torch, state: dict) -> None:
    with torch.no_grad():
        for v in state.values():
            v.add_(1e-3)
    torch.cuda.synchronize()


def waited(torch, repo, state, saves: int) -> tuple[list[float], list[float]]:
    stalls, totals = [], []
    for step in range(1, saves + 1):
        touch(torch, state)
        t0 = time.perf_counter()
        handle = repo.save_async("bench", step, state)
        stalls.append(time.perf_counter() - t0)
        handle.wait()
        totals.append(time.perf_counter() - t0)
    return stalls, totals


def back_to_back(torch, repo, state, saves: int, overlap: bool) -> tuple[list[float], list[float]]:
    stalls = []
    t0 = time.perf_counter()
    for step in range(1, saves + 1):
        touch(torch, state)  # a training step's worth of GPU work, synchronised: not part of the stall
        t = time.perf_counter()
        repo.save_async("bench", step, state, overlap=overlap)
        stalls.append(time.perf_counter() - t)
    repo.repository.drain()
    return stalls, [(time.perf_counter() - t0) / saves]


def dcp_async(torch, root: str, state, saves: int) -> tuple[list[float], list[float]]:
    """The peer: PyTorch DCP's ``async_save`` (no process group) with its DefaultStager in pinned memory. The GPU
    is blocked until the copy to host finished (``staging_completion``): the training loop may not change the tensors
    before. One untimed save first (the stager allocates and pins its buffers)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=True))
    stalls, totals = [], []
    try:
        for step in range(saves + 1):
            touch(torch, state)
            path = os.path.join(root, f"dcp-{step}")
            t0 = time.perf_counter()
            resp = dcp.async_save(state, checkpoint_id=path, async_stager=stager, no_dist=True)
            staged = getattr(resp, "staging_completion", None)
            if staged is not None:
                staged.result()
            stall = time.perf_counter() - t0
            (getattr(resp, "upload_completion", None) or resp).result()
            total = time.perf_counter() - t0
            if step:  # step 0 warms up
                stalls.append(stall)
                totals.append(total)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        close = getattr(stager, "close", None)
        if close is not None:
            close()
    return stalls, totals


# --scenarios names -> the rows' labels
SCENARIOS = {"waited": "waited", "back-to-back": "back-to-back", "no-overlap": "back-to-back, overlap=False",
             "dcp": "dcp async_save (pinned)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--workdir", default=None, help="parent of the scratch directory (default: the system temp dir)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of: {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args()
    names = [c.strip() for c in args.scenarios.split(",") if c.strip()]
    unknown = [c for c in names if c not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    chosen = [SCENARIOS[c] for c in names]
    try:
        import torch
    except ImportError:
        print("gpu_staging: needs torch with CUDA; torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"gpu_staging: needs a CUDA device; torch {torch.__version__} sees none "
              "(torch.cuda.is_available() is False). Nothing measured.", file=sys.stderr)
        return 2
    state = build_state(torch, args.size_mib)
    size = sum(v.nbytes for v in state.values())
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | luopan {luopan.__version__} | "
          f"state {size / 2**20:.0f} MiB in {len(state)} CUDA tensors | {args.saves} saves")
    root = tempfile.mkdtemp(prefix="luopan-gpu-staging-", dir=args.workdir)
    rows = []
    try:
        if "dcp async_save (pinned)" in chosen:
            try:
                stalls, totals = dcp_async(torch, root, state, args.saves)
                rows.append(("dcp async_save (pinned)", statistics.median(stalls), statistics.median(totals), True))
            except Exception as exc:  # noqa: BLE001 - the peer's API differs across torch versions: say so
                print(f"dcp async_save peer failed on torch {torch.__version__}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        for name, run in (("waited", lambda r: waited(torch, r, state, args.saves)),
                          ("back-to-back", lambda r: back_to_back(torch, r, state, args.saves, True)),
                          ("back-to-back, overlap=False", lambda r: back_to_back(torch, r, state, args.saves, False))):
            if name not in chosen:
                continue
            path = os.path.join(root, name.replace(" ", "").replace(",", "-").replace("=", ""))
            repo = luopan.open(path)
            repo.save_async("bench", 0, state).wait()  # untimed: allocates and pins the buffers
            pinned = all(p.is_pinned() for s in repo.checkpointing._staging.sets for p in s.pinned()) and any(
                s.pinned() for s in repo.checkpointing._staging.sets)
            stalls, totals = run(repo)
            repo.close()
            shutil.rmtree(path, ignore_errors=True)
            stall, total = statistics.median(stalls), statistics.median(totals)
            rows.append((name, stall, total, pinned))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'scenario':30} {'stall s':>9} {'per save s':>11} {'stall/save':>11} {'copy GB/s':>10} pinned")
    for name, stall, total, pinned in rows:
        print(f"{name:30} {stall:9.4f} {total:11.4f} {stall / total:11.3f} {size / stall / 1e9:10.1f} "
              f"{'yes' if pinned else 'no'}")
    peer = {name: stall for name, stall, _t, _p in rows}.get("dcp async_save (pinned)")
    ours = {name: stall for name, stall, _t, _p in rows}.get("waited")
    if peer and ours:
        print(f"GPU-blocked time: luopan save_async {ours:.4f} s, DCP async_save {peer:.4f} s "
              f"(DCP / luopan = {peer / ours:.2f}x)")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "state_bytes": size,
                       "saves": args.saves, "rows": [{"scenario": n, "stall_s": st, "per_save_s": tt, "pinned": pn}
                                                     for n, st, tt, pn in rows],
                       "dcp_over_luopan_stall": (peer / ours) if peer and ours else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
