"""P13's fp32 run (issue 31): a Hugging Face model fully fine-tuned in fp32, saved by luopan and by its own
``save_pretrained``, side by side on the same states.

**Model.** ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (random init, nothing downloaded; vocabulary 512,
32 positions, 64-dim heads, tied embeddings) whose fp32 parameters total the target size (``target_mib``; P13 uses
its own model size: 256 MiB with ``--quick``). ``d_model`` is the largest of 128..2048 leaving at least ~6 blocks.

**Training.** AdamW (lr 1e-5, the fused CPU kernel) on the fp32 weights, as the Trainer does without mixed
precision, on real gradients of the language-model loss over a seeded random batch (2 x 32 tokens), one step
before each save. Every weight with a gradient moves by about ``lr`` at every step: each fp32 element keeps its
sign, exponent and top mantissa bits, and its low 12-15 bits change.

**Saved.** ``model.state_dict()`` after steps 1..8 (8 saves), in lockstep, the order rotating every step, each
timed with ``os.sync()`` before it and the GC paused:

* ``save_pretrained``: ``model.save_pretrained(dir)`` (``model.safetensors`` + config), what the Trainer writes
  for the weights. Its time is reported as HF does it (``save_s``: no fsync) and made durable as a luopan save is
  (``synced_s``: the same plus fsync of its files and directory). Only the latest directory is kept.
* ``uncompressed``: ``luopan.open(path, compression="none", delta_policy=DeltaPolicy(enabled=False))``; the previous
  step is deleted and collected after each step (outside the timings).
* ``default``: ``luopan.open(path)``, every save kept: the repository a user gets.

**Fields.** ``ratio`` (logical / stored bytes of ``default`` over the 8 saves), ``ratio_uncompressed``,
``stored_bytes_per_save`` (``default``), ``save_pretrained_bytes`` (the last directory's size),
``time_over_save_pretrained`` (median save s of ``default`` / ``save_pretrained``'s, no fsync),
``time_over_save_pretrained_synced`` (/ its synced time), ``time_over_uncompressed``, ``xor_entries_per_save`` and
``delta_candidates`` (entries of at least DeltaPolicy.xor_min_bytes), ``peers`` (per peer: bytes and seconds per
save), ``verified`` (step 8 of every peer loaded and compared bit for bit with the model's state).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from common import dir_bytes, fsync_path, median, settle, timed

RUN = "ft"
SAVES = 8
LR = 1e-5
BATCH, SEQ, VOCAB = 2, 32, 512
HEAD_DIM = 64
SEED = 0


def plan_gpt2(target_mib: float) -> dict[str, int]:
    """GPT-2 shape whose fp32 parameters total about ``target_mib`` MiB (a block holds ~12 d^2 + 13 d)."""
    params = int(target_mib * (1 << 20)) // 4
    d = 128
    for cand in (256, 512, 1024, 2048):
        if 72 * cand * cand <= params:
            d = cand
    layers = max(1, round((params - (VOCAB + SEQ) * d) / (12 * d * d + 13 * d)))
    return {"d_model": d, "layers": layers, "heads": max(1, d // HEAD_DIM), "vocab": VOCAB, "seq": SEQ}


def build_gpt2(plan: dict[str, int]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    torch.manual_seed(SEED)
    cfg = GPT2Config(n_embd=plan["d_model"], n_layer=plan["layers"], n_head=plan["heads"], vocab_size=VOCAB,
                     n_positions=SEQ, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).float().train()


def _adamw(params: list[Any]) -> Any:
    import torch

    try:
        return torch.optim.AdamW(params, lr=LR, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel here
        return torch.optim.AdamW(params, lr=LR, foreach=True)


class _Pretrained:
    """``save_pretrained`` as a peer: one directory per step, only the latest kept."""

    name = "save_pretrained"

    def __init__(self, path: str, model: Any) -> None:
        self.path, self.model = path, model
        os.makedirs(path)
        self.save_s: list[float] = []
        self.synced_s: list[float] = []
        self.stored: list[int] = []
        self.verified = False

    def save(self, step: int) -> None:
        out = os.path.join(self.path, f"checkpoint-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dt, _ = timed(lambda: self.model.save_pretrained(out))
        sync_s, _ = timed(lambda: [fsync_path(p) for p in [*(os.path.join(out, f) for f in os.listdir(out)), out,
                                                           self.path]])
        self.save_s.append(dt)
        self.synced_s.append(dt + sync_s)
        self.stored.append(dir_bytes(out))
        prev = os.path.join(self.path, f"checkpoint-{step - 1}")
        if os.path.isdir(prev):
            shutil.rmtree(prev)

    def load(self, step: int) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.path, f"checkpoint-{step}", "model.safetensors"))


class _Luopan:
    def __init__(self, name: str, path: str) -> None:
        import luopan

        self.name = name
        kwargs: dict[str, Any] = {}
        if name == "uncompressed":
            kwargs = {"compression": "none", "delta_policy": luopan.DeltaPolicy(enabled=False)}
        self.prune = name == "uncompressed"
        self.repo = luopan.open(path, progress=False, **kwargs)
        self.save_s: list[float] = []
        self.stored: list[int] = []
        self.xor_entries: list[int] = []
        self.verified = False

    def save(self, step: int, state: dict[str, Any]) -> int:
        dt, info = timed(lambda: self.repo.save(RUN, step, state))
        self.save_s.append(dt)
        self.stored.append(info.stored_bytes)
        self.xor_entries.append(sum("xor" in e for e in self.repo.manifest(RUN, step).doc["entries"]))
        if self.prune and step > 1:
            self.repo.delete(RUN, step - 1)
            self.repo.gc(grace=0)
        return info.logical_bytes

    def load(self, step: int) -> dict[str, Any]:
        return self.repo.load(RUN, step)


def _same(want: dict[str, Any], got: dict[str, Any], label: str) -> None:
    import torch

    missing = [k for k in want if k not in got and not k.startswith("lm_head.")]  # tied: save_pretrained drops it
    bad = [k for k in want if k in got and not (got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
                                                and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)))]
    if missing or bad:
        raise RuntimeError(f"P13 fp32 [{label}]: step {SAVES} loads differently: missing {missing[:3]}, "
                           f"differing {bad[:3]}")


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def run_fp32(target_mib: float, workdir: str | None, log: Callable[[str], Any]) -> dict[str, Any]:
    """The fp32 run (module docstring): a GPT-2 of ``target_mib`` MiB of fp32 weights. Returns its result dict."""
    import luopan
    import torch

    plan = plan_gpt2(target_mib)
    work = tempfile.mkdtemp(prefix="luopan-bench-p13-fp32-", dir=workdir)
    try:
        model = build_gpt2(plan)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        need = (SAVES + 4) * nbytes
        if shutil.disk_usage(work).free < need:
            raise RuntimeError(f"P13 fp32 needs ~{need >> 20} MiB free in {work}")
        opt = _adamw(list(model.parameters()))
        gen = torch.Generator().manual_seed(SEED + 1)
        peers: list[Any] = [_Pretrained(os.path.join(work, "save_pretrained"), model),
                            _Luopan("uncompressed", os.path.join(work, "uncompressed")),
                            _Luopan("default", os.path.join(work, "default"))]
        min_bytes = luopan.DeltaPolicy().xor_min_bytes
        candidates = sum(v.nbytes >= min_bytes for v in model.state_dict().values())
        log(f"  P13 fp32: GPT-2 d={plan['d_model']} x {plan['layers']} blocks = {nbytes / (1 << 20):.1f} MiB fp32, "
            f"{candidates} entries of >= {min_bytes >> 20} MiB; AdamW lr {LR}; {SAVES} saves")
        logical: list[int] = []
        for s in range(1, SAVES + 1):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            out = model(tokens, labels=tokens)
            out.loss.backward()
            loss = out.loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = model.state_dict()
            rot = (s - 1) % len(peers)
            for p in peers[rot:] + peers[:rot]:
                settle()
                if isinstance(p, _Pretrained):
                    p.save(s)
                else:
                    n = p.save(s, state)
                    if p.name == "default":
                        logical.append(n)
            d, hf = peers[2], peers[0]
            log(f"  P13 fp32 save {s}/{SAVES}: loss {loss.item():.4f}; default {d.stored[-1] / (1 << 20):.1f} MiB "
                f"{d.save_s[-1]:.2f}s ({d.xor_entries[-1]} XOR deltas), save_pretrained "
                f"{hf.stored[-1] / (1 << 20):.1f} MiB {hf.save_s[-1]:.2f}s ({hf.synced_s[-1]:.2f}s synced), "
                f"uncompressed {peers[1].save_s[-1]:.2f}s")
        final = model.state_dict()
        for p in peers:
            _same(final, p.load(SAVES), p.name)
            p.verified = True
        for p in peers[1:]:
            p.repo.close()
        hf, unc, d = peers
        lsum = sum(logical)
        med = {p.name: median(p.save_s) for p in peers}
        return {
            "precision": "fp32",
            "model": {**plan, "param_bytes": nbytes, "mib": round(nbytes / (1 << 20), 2),
                      "architecture": "transformers GPT2LMHeadModel (tied embeddings)",
                      "optimizer": f"AdamW(lr={LR}, fused CPU kernel) on the fp32 weights"},
            "ratio": _r(lsum / sum(d.stored)),
            "ratio_uncompressed": _r(lsum / sum(unc.stored)),
            "logical_bytes": lsum,
            "stored_bytes": sum(d.stored),
            "stored_bytes_per_save": d.stored,
            "save_pretrained_bytes": hf.stored[-1],
            "default_s": med["default"],
            "save_pretrained_s": med["save_pretrained"],
            "save_pretrained_synced_s": median(hf.synced_s),
            "uncompressed_s": med["uncompressed"],
            "time_over_save_pretrained": _r(med["default"] / med["save_pretrained"]),
            "time_over_save_pretrained_synced": _r(med["default"] / median(hf.synced_s)),
            "time_over_uncompressed": _r(med["default"] / med["uncompressed"]),
            "xor_entries_per_save": d.xor_entries,
            "delta_candidates": candidates,
            "peers": {p.name: {"save_s": [round(x, 4) for x in p.save_s], "stored_bytes_per_save": p.stored,
                               "median_save_s": med[p.name], "verified": p.verified} for p in peers},
            "verified": all(p.verified for p in peers),
            "notes": "an HF GPT-2 fully fine-tuned in fp32 (AdamW lr 1e-5), state_dict after each of 8 steps; "
                     "ratio = logical / stored bytes of luopan.open(path) defaults over the 8 saves; times are "
                     "medians of saves in lockstep with model.save_pretrained (safetensors, no fsync, as HF does; "
                     "_synced: with the fsyncs luopan makes) and an uncompressed luopan repository",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
