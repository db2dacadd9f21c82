"""luopan demo: LoRA fine-tune of a tiny transformer with CheckpointManager, killed mid-run and resumed bit-exactly.

The model is built from a config (no downloads): a small decoder whose "pretrained" weights are frozen, with
rank-4 LoRA adapters on the attention projections. Three training processes share one repository:

1. run "straight" trains to the end in one go;
2. run "resumed" is killed with SIGKILL partway through an epoch;
3. run "resumed" starts again, restores its latest checkpoint (model, optimizer, LR schedule, RNG, data-loader
   position, loss history) and trains to the end.

Each save writes only what changed (the adapters, their AdamW moments, the RNG and counters), not the frozen base;
the table compares that with a full torch.save of the same state. At the end the two runs' final checkpoints are
compared byte for byte, including the per-step loss history.

Run with: make demo   (or: python examples/demo.py [--repo DIR] [--steps N] [--every N] [--kill-at N])
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from torch import nn

import luopan
from luopan.policies import EveryNSteps
from luopan.torch import CheckpointManager, ResumableLoader, TrainingState
from luopan.tree import flatten

CONFIG = {"vocab": 256, "dim": 128, "layers": 4, "heads": 4, "mlp": 512, "seq": 32, "lora_rank": 4,
          "dropout": 0.1, "lr": 3e-3, "batch": 16, "sequences": 512, "seed": 0}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (B @ A), B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        d = c["dim"]
        self.heads = c["heads"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, c["mlp"]), nn.Linear(c["mlp"], d)
        self.drop = nn.Dropout(c["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.o(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.ln2(x)))))


class TinyLM(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.emb = nn.Embedding(c["vocab"], c["dim"])
        self.pos = nn.Parameter(torch.randn(c["seq"], c["dim"]) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.ln = nn.LayerNorm(c["dim"])
        self.head = nn.Linear(c["dim"], c["vocab"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build(c: dict) -> nn.Module:
    torch.manual_seed(c["seed"])
    model = TinyLM(c)  # the "pretrained" base: frozen
    model.requires_grad_(False)
    for blk in model.blocks:  # LoRA on the query and value projections, as in the LoRA paper
        blk.q = LoRALinear(blk.q, c["lora_rank"])
        blk.v = LoRALinear(blk.v, c["lora_rank"])
    return model


def dataset(c: dict) -> torch.utils.data.TensorDataset:
    """Sequences from a fixed random Markov chain over the vocabulary: learnable, deterministic, no download."""
    g = torch.Generator().manual_seed(1)
    trans = torch.softmax(torch.randn(c["vocab"], c["vocab"], generator=g) * 3, dim=1)
    seqs = torch.empty(c["sequences"], c["seq"] + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, c["vocab"], (c["sequences"],), generator=g)
    for t in range(1, c["seq"] + 1):
        seqs[:, t] = torch.multinomial(trans[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return torch.utils.data.TensorDataset(seqs[:, :-1], seqs[:, 1:])


def train(repo_dir: str, run: str, steps: int, every: int, kill_at: int | None) -> None:
    """One training process: restore if the run has a checkpoint, train to `steps`, save by policy."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    c = CONFIG
    random.seed(c["seed"])  # a reproducible script seeds every generator; luopan saves and restores them all
    np.random.seed(c["seed"])
    model = build(c)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=c["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    loader = ResumableLoader(dataset(c), batch_size=c["batch"], shuffle=True, seed=c["seed"])
    history: dict = {"losses": []}
    state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader, extras=history)
    mgr = CheckpointManager(repo_dir, run, state, policy=EveryNSteps(every), config={**c, "steps": steps})
    start = mgr.restore()
    if start:
        print(f"  [{run}] restored step {start} (epoch {loader.epoch}, batch {loader.batches} of {len(loader)})")
    step = start
    while step < steps:
        for x, y in loader:
            model.train()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, c["vocab"]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            step += 1
            history["losses"].append(loss.item())
            t0 = time.perf_counter()
            info = mgr.maybe_save(step, metrics={"loss": loss.item()})
            if info is not None:
                ms = (time.perf_counter() - t0) * 1000
                buf = io.BytesIO()
                torch.save(state.capture(), buf)  # what a full torch.save of the same state would write
                print(f"  [{run}] step {step:>4}  loss {loss.item():.4f}  luopan wrote {human(info.stored_bytes):>9}"
                      f"  torch.save {human(buf.tell()):>9}  ({info.stored_bytes / buf.tell():6.1%})  {ms:5.0f} ms",
                      flush=True)
            if step == kill_at:
                print(f"  [{run}] killed with SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= steps:
                break
    mgr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default="demo-repo", help="repository directory (recreated by the demo)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25, help="save every N steps")
    ap.add_argument("--kill-at", type=int, default=None, help="kill the second run after this step (default: "
                    "just after the middle save)")
    ap.add_argument("--_train", nargs=2, metavar=("RUN", "KILL_AT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._train:
        run, kill = args._train
        train(args.repo, run, args.steps, args.every, int(kill) or None)
        return

    kill_at = args.kill_at or (args.steps // args.every // 2) * args.every + args.every // 2 + 1
    if os.path.exists(args.repo):
        shutil.rmtree(args.repo)  # the demo's own directory: start fresh each run
    model = build(CONFIG)
    total = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"tiny transformer: {total:,} parameters, {lora:,} in LoRA adapters ({lora / total:.1%}); "
          f"{args.steps} steps, a checkpoint every {args.every}")

    def child(run: str, kill: int) -> int:
        cmd = [sys.executable, __file__, "--repo", args.repo, "--steps", str(args.steps), "--every", str(args.every),
               "--_train", run, str(kill)]
        return subprocess.run(cmd).returncode

    print("1) run 'straight': uninterrupted")
    assert child("straight", 0) == 0
    print(f"2) run 'resumed': the same training, killed after step {kill_at} (mid-epoch). Its chunks are already in "
          "the repository from run 'straight' (cross-run deduplication), so it writes almost nothing")
    rc = child("resumed", kill_at)
    assert rc == -signal.SIGKILL, rc
    print("3) run 'resumed' again: restores its latest checkpoint and finishes")
    assert child("resumed", 0) == 0

    repo = luopan.open(args.repo)
    a, b = repo.load("straight", args.steps), repo.load("resumed", args.steps)
    _, la = flatten(a)
    _, lb = flatten(b)
    same = ([x.path for x in la] == [y.path for y in lb]
            and all(bytes(x.host_bytes()) == bytes(y.host_bytes()) for x, y in zip(la, lb))
            and a["extras"]["losses"] == b["extras"]["losses"] and a["scheduler"] == b["scheduler"])
    print(f"resumed run matches the uninterrupted one bit for bit (weights, optimizer, RNG, loss history of "
          f"{len(b['extras']['losses'])} steps): {same}")
    du = repo.du()
    print(f"repository: {du['checkpoints']} checkpoints, {human(du['logical_bytes'])} logical, "
          f"{human(du['physical_bytes'])} on disk; verify: {repo.verify().ok}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
