"""A small deterministic training run for the exact-resume tests (run as a subprocess by test_exact_resume.py).

    python resume_worker.py REPO RUN TOTAL_STEPS LOSSES_FILE [--kill-at K] [--workers W] [--optim adamw|sgd]
                            [--amp] [--async] [--every N]

Trains an MLP with dropout on a fixed dataset (shuffled ResumableLoader), AdamW + warmup-cosine LambdaLR (or SGD
with momentum), gradient clipping, optional CPU autocast + GradScaler. Restores the run's latest checkpoint first
(prints "RESTORED <step>"), appends "<step> <loss as float.hex>" per step to LOSSES_FILE, saves through a
CheckpointManager every N steps, and SIGKILLs itself right after step K (after its save call returned, so with
--async the save may still be in flight). At TOTAL_STEPS it saves a final checkpoint.
"""

import argparse
import math
import os
import random
import signal
import sys

import numpy as np
import torch

import luopan
from luopan.policies import EveryNSteps
from luopan.torch import CheckpointManager, ResumableLoader, TrainingState


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("repo")
    ap.add_argument("run")
    ap.add_argument("total", type=int)
    ap.add_argument("losses")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--no-rng", action="store_true", help="leave the RNGs out (tests that this breaks resumption)")
    a = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # model init; the RNG then drives dropout and is captured/restored
    random.seed(5)  # Python's and NumPy's generators also steer training below (a loss weight), so they must
    np.random.seed(6)  # be restored exactly too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    y = torch.randint(0, 4, (96,), generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = ResumableLoader(dataset, batch_size=8, shuffle=True, seed=7, num_workers=a.workers)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 4))
    if a.optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    warmup = 5

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, a.total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    components = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    scaler = None
    if a.amp:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        components["scaler"] = scaler
    counters = {"step": 0}
    state = TrainingState(extras=counters, rng=not a.no_rng, **components)
    repo = luopan.open(a.repo)
    mgr = CheckpointManager(repo, a.run, state, policy=EveryNSteps(a.every), async_save=a.async_save,
                            verify_every=2)
    start = mgr.restore()
    assert start == counters["step"], (start, counters)
    print(f"RESTORED {start}", flush=True)
    step = start
    with open(a.losses, "a") as out:
        while step < a.total:
            for xb, yb in loader:
                model.train()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp):
                    weight = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
                    loss = torch.nn.functional.cross_entropy(model(xb), yb) * weight
                opt.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                sched.step()
                step += 1
                counters["step"] = step
                out.write(f"{step} {loss.item().hex()}\n")
                out.flush()
                mgr.maybe_save(step, metrics={"loss": loss.item()})
                if step == a.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step >= a.total:
                    break
    mgr.save(step, reason="final") if step not in repo.steps(a.run) else None
    mgr.close()


if __name__ == "__main__":
    sys.exit(main())
