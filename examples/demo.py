"""luopan demo: train a small PyTorch model on CPU, checkpoint every N steps, restore and check bit-exactly.

The model has a frozen "pretrained" body and a small trainable head (a fine-tune), so each save writes only the
chunks that changed: the head, its optimizer state and the step counter's chunk — not the frozen body.
Run with: make demo   (or: python examples/demo.py [--repo DIR] [--steps N] [--every N])
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
from torch import nn

import luopan


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(6)])
    for p in body.parameters():
        p.requires_grad_(False)  # "pretrained", frozen
    head = nn.Sequential(nn.Linear(512, 64), nn.GELU(), nn.Linear(64, 10))
    return nn.Sequential(body, head)


def training_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": {"torch": torch.get_rng_state()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default="demo-repo", help="repository directory (recreated by the demo)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="save every N steps")
    args = ap.parse_args()

    if os.path.exists(args.repo):
        shutil.rmtree(args.repo)  # the demo's own directory: start fresh each run
    repo = luopan.open(args.repo, chunk_size=256 * 1024)
    model = build_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(4096, 512, generator=g)
    y_all = torch.randint(0, 10, (4096,), generator=g)

    print(f"training {sum(p.numel() for p in model.parameters()):,} parameters "
          f"({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable) for {args.steps} steps")
    print(f"{'step':>6} {'loss':>8} {'logical':>10} {'written':>10} {'written/logical':>16} {'save ms':>8}")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, 4096, (64,), generator=g)
        loss = nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            ts = time.perf_counter()
            info = repo.save("demo", step, training_state(model, opt, step), metrics={"loss": loss.item()})
            ms = (time.perf_counter() - ts) * 1000
            print(f"{step:>6} {loss.item():>8.4f} {human(info.logical_bytes):>10} {human(info.stored_bytes):>10} "
                  f"{info.stored_bytes / info.logical_bytes:>15.1%} {ms:>8.0f}")
    print(f"trained in {time.perf_counter() - t0:.1f} s")

    # Restore the latest checkpoint two ways and check every tensor bit for bit:
    # load() into a fresh model + optimizer (the usual resume), and load_into() in place (like DCP) for the weights.
    final = training_state(model, opt, args.steps)
    restored = repo.load("demo")
    fresh = build_model()
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    fresh.load_state_dict(restored["model"])
    fresh_opt.load_state_dict(restored["optim"])
    in_place = build_model()
    repo.load_into("demo", {"model": in_place.state_dict()}, strict=False)  # only the model subtree

    def bits_equal(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return (a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
        return a == b

    ok_load = bits_equal(final, restored) and bits_equal(final["optim"], fresh_opt.state_dict())
    ok_into = bits_equal(final["model"], in_place.state_dict())
    repo.verify("demo")
    print(f"restored step {restored['step']}: load() bit-exact: {ok_load}; load_into() a fresh model: {ok_into}; "
          "verify: ok")
    if not (ok_load and ok_into):
        raise SystemExit("restore mismatch")
    luopan_cli = os.path.join(os.path.dirname(os.path.abspath(__import__("sys").executable)), "luopan")
    print(f"\nexplore it:  {luopan_cli} ls -r {args.repo} demo   |   {luopan_cli} du -r {args.repo}")


if __name__ == "__main__":
    main()
