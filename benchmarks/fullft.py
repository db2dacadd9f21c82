"""P13 (issue 15): full fine-tuning of a bf16 model, every save a state in which (nearly) every tensor moved a little.

`P13.fullft_logical_over_stored` = logical bytes / stored bytes over the saves of a full fine-tune. Goal >= 2.0, with
the median save time <= 1.25x that of an uncompressed save (``save_time_ratio``; ``met`` needs both).

**Model.** A small GPT-like decoder (token + learned position embedding, ``layers`` pre-norm blocks of causal
self-attention (fused qkv, 64-dim heads) + GELU MLP, a final norm and an untied lm head; no biases, LayerNorm
weights only) whose bf16 parameters total the target size: ``max(size_mib, 1024)`` MiB for the full run, 256 MiB
with ``--quick`` (``model_mib`` / ``--model-mib`` overrides both, for the tests). ``d_model`` is the largest of
128..2048 that leaves at least ~6 blocks, ``layers = round(params / (12 d^2))`` and the MLP width is solved so the
total lands on the target (within a few KiB; the exact figure is reported). Built on the meta device, materialised
in bf16 (``model.to(torch.bfloat16)``) and initialised GPT-2 style, seeded: ``N(0, 0.02)``, the residual projections
``N(0, 0.02 / sqrt(2 layers))``, norm weights 1. A random init stands in for pretrained weights (nothing is
downloaded); the value distribution (bf16 of ~N(0, 0.02)) is that of a typical checkpoint's matrices.

**Training.** AdamW (lr 1e-5, default betas, eps and weight decay 0.01; the fused CPU kernel) on real gradients of a
next-token cross-entropy loss over a tiny seeded random batch (2 x 32 tokens, vocabulary 512; a new batch each
step). Two precisions, both measured in the same invocation on the same init and batches:

* ``bf16``: AdamW directly on the bf16 parameters (a pure bf16 full fine-tune, optimizer state in bf16).
* ``mixed``: the common mixed-precision setup: fp32 master weights in AdamW, the bf16 model used for forward and
  backward, its gradients copied to the masters, the updated masters rounded into the bf16 model after each step.

A bf16 value has 8 significant bits, so an update of ~1e-5 (Adam's first step moves every weight with a gradient by
``lr``, later steps by less) is below half an ulp for any weight with ``|w| >~ 2.5e-3``: in pure bf16 those weights
never change, only the small ones do. With fp32 masters the update accumulates and the bf16 copy flips once the
master crosses a rounding boundary, so more elements change per step, and different ones each step.
``changed_fraction_per_step`` (the share of bf16 elements whose bits differ from the previous step) and
``changed_fraction_cumulative`` (vs the first save) are reported for each precision. Measured (256 MiB and 1 GiB
alike): both change ~35% of the elements at step 1 (the residual projections, initialised ~6x smaller, change
mostly); then pure bf16 falls to ~10% by step 8 with the union since save 1 stuck at ~26% (always the same small
weights), mixed to ~17% with the union growing to ~55%. The headline is the precision closest to the issue's "every
weight changing each step" -- ``mixed`` (fixed here, not chosen at run time); ``bf16`` is context (``context``).
Neither comes close to every element changing every step: that is bf16 arithmetic, not a choice of the benchmark.

**What is saved.** The model's ``state_dict()`` (bf16 tensors) after training steps 1..8: 8 saves per repository,
all counted (steps 1..8 of run ``ft``; the initial weights are not saved -- a fine-tune's first checkpoint is its
first save, and that full write is part of the cost). ``logical bytes`` = sum over the saves of the tensors'
nbytes; ``stored bytes`` = sum of ``info.stored_bytes`` (bytes of pack files the save wrote, after compression) of
the ``CheckpointInfo`` each ``repo.save`` returns, cross-checked by the growth of the repository directory on disk
around each save (packs + manifests + index: ``ratio_by_disk_growth``).

**Peers.** The same states are saved in lockstep into separate fresh repositories (the order rotating every step;
each ``repo.save`` timed with ``os.sync()`` before it and the GC paused during it):

* ``uncompressed``: ``compression="none"``, ``DeltaPolicy(enabled=False)``: the uncompressed save whose median time
  is the denominator of ``save_time_ratio``;
* ``default``: ``luopan.open(path)``: **the headline** (whatever this luopan's defaults are: the float-aware
  ``compression="auto"`` codec and XOR deltas of densely changed entries once they exist);
* ``zstd``: ``compression="zstd"`` without deltas (context);
* ``default_no_xor``: ``DeltaPolicy(xor=False)``, default codec (context: the codec without XOR deltas) and
* ``zstd_xor``: ``compression="zstd"`` with the default DeltaPolicy (context: XOR deltas with a generic codec),
  both only where DeltaPolicy has ``xor``.

The repositories without deltas keep only their latest step (the previous one is deleted and collected with
``gc(grace=0)`` after each step's saves, outside the timings: chunk dedup only ever matches the previous step, so
this changes nothing they store) to bound the disk; those with deltas keep everything. The ``bf16`` context run uses
only ``uncompressed`` and ``default``.

Context figures, not goals: ``zipnn_final_ratio`` (logical / ZipNN-compressed bytes of the final bf16 weights, when
zipnn is importable) and ``xor_estimate`` (what XOR against the previous / the first save, split into the two byte
planes of bf16 and zstd-3 compressed, would store: a rough estimate of what XOR deltas can reach; the first save
counted as its byte planes zstd-compressed; measured outside the timings).

**Fields.** ``ratio`` (default repo, 4 decimals), ``save_time_ratio`` (median save s default / uncompressed),
``save_time_ratio_by_min``, ``ratio_steady`` (saves 2..8 only), ``ratio_by_disk_growth``, ``stored_bytes_per_save``,
``peers`` (per peer: ratio, stored bytes per save, save seconds, median, disk growth, load seconds, verified),
``ratio_<peer>``, ``changed_fraction_per_step``, ``changed_fraction_cumulative``, ``step_s`` and ``loss`` per step,
``model``, ``features`` (which luopan features were present: ``delta_policy``, ``xor_deltas``, ``codec_auto`` and
the default repository's configured compression), ``context`` (the other precision), ``disk_peak_bytes``,
``loadavg`` (start, end), ``elapsed_s``.

**fp32 run** (``fp32``, issue 31; ``--no-fp32`` skips it): an HF GPT-2 of the same size in fp32 bytes, fully
fine-tuned in fp32 (AdamW lr 1e-5 on the fp32 weights), saved by luopan (default and uncompressed repositories) and
by its own ``save_pretrained``, in lockstep: ratio, seconds per save against ``save_pretrained`` (with and without
the fsyncs luopan makes) and XOR deltas per save (benchmarks/fullft_fp32.py says how).

**Correctness.** After the last save, step 8 of every repository is loaded (``repo.load``) and compared bit for bit
with the model's state (``torch.equal`` on int16 views, same keys, dtypes and shapes); a mismatch raises.

Disk: the repositories with deltas keep all 8 saves (8x the model each while they store every save in full, as
today's defaults do; 4x at the goal ratio), those without about 2x each at their peak: up to ~28x the model with
all five repositories (``disk_peak_bytes`` is the measured peak); the run refuses to start without that much free.
Memory: the model, its gradients and optimizer state (mixed: fp32 masters, their gradients and fp32 Adam moments,
~10x the bf16 size; ~12 GiB peak RSS at 1 GiB) plus two bf16 copies of the state. Everything is removed at the end.

Timing: every save is timed once (8 per repository; medians compared). On a small shared machine the save times of
two identically configured repositories can differ by 1.3x; ``save_time_ratio_by_min`` (fastest save of each) and
``loadavg`` are there to judge that.

    .venv/bin/python benchmarks/fullft.py [--quick] [--size-mib N] [--workdir DIR] [--json OUT]
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from common import dir_bytes, loadavg, median, settle, spread, timed
from fullft_fp32 import run_fp32

ID = "P13.fullft_logical_over_stored"
RUN = "ft"
SAVES = 8
LR = 1e-5
BATCH, SEQ, VOCAB = 2, 32, 512
HEAD_DIM = 64
SEED = 0
QUICK_MIB = 256
FULL_MIN_MIB = 1024
HEADLINE = "mixed"
GOAL = 2.0
PRUNED = ("uncompressed", "zstd")  # no deltas: these repositories keep only their latest step
SAVE_TIME_GOAL = 1.25


# -- the model -------------------------------------------------------------------------------------------------
def plan_model(target_mib: int | float) -> dict[str, int]:
    """Shape of the decoder whose bf16 parameters total ``target_mib`` MiB (as nearly as the MLP width allows)."""
    params = int(target_mib * (1 << 20)) // 2
    d = 128
    for cand in (256, 512, 1024, 2048):
        if 72 * cand * cand <= params:  # room for >= ~6 blocks of ~12 d^2
            d = cand
    layers = max(1, round(params / (12 * d * d)))
    fixed = 2 * VOCAB * d + SEQ * d + d  # embedding, lm head, positions, final norm
    per_block = 4 * d * d + 2 * d  # qkv + out projection, two norms
    hidden = max(8, (params - fixed - layers * per_block) // (2 * d * layers))
    total = fixed + layers * (per_block + 2 * d * hidden)
    return {"d_model": d, "layers": layers, "heads": max(1, d // HEAD_DIM), "mlp_hidden": hidden, "vocab": VOCAB,
            "seq": SEQ, "batch": BATCH, "params": total, "param_bytes": 2 * total}


def build_model(plan: dict[str, int], seed: int = SEED) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads = plan["d_model"], plan["heads"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d, bias=False)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.ln2 = nn.LayerNorm(d, bias=False)
            self.up = nn.Linear(d, plan["mlp_hidden"], bias=False)
            self.down = nn.Linear(plan["mlp_hidden"], d, bias=False)

        def forward(self, x: Any) -> Any:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(plan["vocab"], d)
            self.pos = nn.Embedding(plan["seq"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(plan["layers"]))
            self.ln_f = nn.LayerNorm(d, bias=False)
            self.head = nn.Linear(d, plan["vocab"], bias=False)

        def forward(self, idx: Any) -> Any:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    with torch.device("meta"):
        model = Decoder()
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * plan["layers"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2].startswith("ln"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, resid if name.endswith(("proj.weight", "down.weight")) else 0.02, generator=g)
    n = sum(p.numel() for p in model.parameters())
    assert n == plan["params"], (n, plan)
    return model


def _adamw(params: list[Any]) -> Any:
    import torch

    try:
        return torch.optim.AdamW(params, lr=LR, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this dtype/device
        return torch.optim.AdamW(params, lr=LR, foreach=True)


class Trainer:
    """One seeded full fine-tune: ``step()`` runs forward, backward and AdamW, in ``bf16`` or ``mixed`` precision."""

    def __init__(self, plan: dict[str, int], precision: str, seed: int = SEED) -> None:
        import torch

        if precision not in ("bf16", "mixed"):
            raise ValueError(f"precision must be bf16 or mixed, got {precision!r}")
        self.plan, self.precision = plan, precision
        self.model = build_model(plan, seed)
        self.params = list(self.model.parameters())
        if precision == "bf16":
            self.master: list[Any] | None = None
            self.opt = _adamw(self.params)
        else:
            self.master = [p.detach().float().requires_grad_() for p in self.params]
            self.opt = _adamw(self.master)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> float:
        import torch
        import torch.nn.functional as F

        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        if self.master is None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    m.grad = p.grad.float()
                    p.grad = None
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)  # round to nearest bf16
                    m.grad = None
        return float(loss.detach())

    def state(self) -> dict[str, Any]:
        return self.model.state_dict()

    def close(self) -> None:
        self.opt = self.model = self.params = self.master = None  # type: ignore[assignment]


# -- measurements outside the timings ----------------------------------------------------------------------------
def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _bits(t: Any) -> Any:
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def _changed(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Elements whose bits differ between two states of the same layout."""
    return sum(int((_bits(a[k]) != _bits(b[k])).sum()) for k in a)


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in state.items()}


def _planes_zstd(state: dict[str, Any], base: dict[str, Any] | None, zc: Any) -> int:
    """zstd-3 bytes of each 2-byte tensor (XOR ``base`` when given) split into its low and high byte planes."""
    import torch

    total = 0
    for k, t in state.items():
        x = _bits(t) if base is None else _bits(t) ^ _bits(base[k])
        u = x.contiguous().view(-1).view(torch.uint8).numpy()
        if t.element_size() == 2:
            u = u.reshape(-1, 2)
            total += sum(len(zc.compress(u[:, i].copy())) for i in range(2))
        else:
            total += len(zc.compress(u.tobytes()))
    return total


def _zipnn_bytes(state: dict[str, Any]) -> int | None:
    try:
        import zipnn
    except ImportError:
        return None
    z = zipnn.ZipNN(bytearray_dtype="bfloat16", threads=max(1, min(8, os.cpu_count() or 1)))
    return sum(len(z.compress(_bits(t).contiguous().view(-1).numpy().tobytes())) for t in state.values())


def _same(expected: dict[str, Any], got: Any, label: str) -> None:
    import torch

    if not isinstance(got, dict) or set(got) != set(expected):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        raise RuntimeError(f"P13 [{label}]: loaded keys {keys} differ from the saved ones")
    bad = []
    for k, want in expected.items():
        g = got[k] if isinstance(got[k], torch.Tensor) else torch.as_tensor(got[k])
        if g.dtype != want.dtype or g.shape != want.shape or not torch.equal(_bits(g), _bits(want)):
            bad.append(k)
    if bad:
        raise RuntimeError(f"P13 [{label}]: repo.load({RUN!r}, {SAVES}) differs from the saved state in {bad[:5]} "
                           f"({len(bad)} tensors)")


# -- luopan feature detection ----------------------------------------------------------------------------------
def _features(scratch: str) -> dict[str, Any]:
    import luopan

    delta = hasattr(luopan, "DeltaPolicy") and "delta_policy" in inspect.signature(luopan.open).parameters
    xor = delta and "xor" in inspect.signature(luopan.DeltaPolicy).parameters
    probe = os.path.join(scratch, "probe-auto")
    try:  # a codec name luopan does not know is refused when the repository is created
        luopan.open(probe, compression="auto").close()
        auto, why = True, None
    except Exception as exc:  # noqa: BLE001  (any refusal means: not there)
        auto, why = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return {"delta_policy": delta, "xor_deltas": xor, "codec_auto": auto, "codec_auto_refusal": why}


def _compression_of(repo: Any) -> Any:
    c = getattr(getattr(repo, "config", None), "compression", None)
    return c.to_json() if hasattr(c, "to_json") else (None if c is None else str(c))


class _Repo:
    def __init__(self, name: str, path: str, feats: dict[str, Any]) -> None:
        import luopan

        kwargs: dict[str, Any] = {}
        self.prune = False
        if name in PRUNED:
            kwargs["compression"] = "none" if name == "uncompressed" else "zstd"
            if feats["delta_policy"]:
                kwargs["delta_policy"] = luopan.DeltaPolicy(enabled=False)
            self.prune = True  # chunk dedup only: only the previous step can ever match
        elif name == "default_no_xor":
            kwargs["delta_policy"] = luopan.DeltaPolicy(xor=False)
        elif name == "zstd_xor":
            kwargs["compression"] = "zstd"  # default DeltaPolicy: XOR deltas on
        elif name != "default":
            raise ValueError(name)
        self.name, self.path = name, path
        self.repo = luopan.open(path, **kwargs)
        self.options = {k: (repr(v) if k == "delta_policy" else v) for k, v in kwargs.items()}
        self.compression = _compression_of(self.repo)
        self.stored: list[int] = []
        self.logical: list[int] = []
        self.growth: list[int] = []
        self.save_s: list[float] = []
        self.load_s: float | None = None
        self.verified = False

    def summary(self, logical: int) -> dict[str, Any]:
        stored, growth = sum(self.stored), sum(self.growth)
        steady = sum(self.stored[1:])
        return {
            "ratio": _r(logical / stored if stored else float("inf")),
            "ratio_steady": _r(sum(self.logical[1:]) / steady) if steady else None,
            "ratio_by_disk_growth": _r(logical / growth) if growth else None,
            "stored_bytes": stored,
            "stored_bytes_per_save": self.stored,
            "disk_growth_bytes_per_save": self.growth,
            "save_s": [round(s, 4) for s in self.save_s],
            "median_save_s": median(self.save_s),
            "save_spread_s": spread(self.save_s),
            "load_s": self.load_s,
            "verified": self.verified,
            "options": self.options,
            "compression": self.compression,
            "keeps_only_latest_step": self.prune,
        }


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# -- one precision, all its repositories in lockstep ------------------------------------------------------------
def _measure(precision: str, plan: dict[str, int], names: list[str], base: str, feats: dict[str, Any],
             log: Callable[[str], Any], extras: bool) -> dict[str, Any]:
    import zstandard

    os.makedirs(base)
    t_build, trainer = timed(lambda: Trainer(plan, precision))
    log(f"  P13 {precision}: model built in {t_build:.1f}s")
    repos = [_Repo(n, os.path.join(base, n), feats) for n in names]
    zc = zstandard.ZstdCompressor(level=3, threads=-1)
    prev = _clone(trainer.state())  # the initial (not saved) weights
    first: dict[str, Any] | None = None
    total = sum(t.numel() for t in prev.values())
    fractions, cumulative, step_s, losses, logical = [], [], [], [], []
    est_prev = est_first = 0
    disk_peak = 0
    for s in range(1, SAVES + 1):
        dt, loss = timed(trainer.step)
        step_s.append(round(dt, 3))
        losses.append(round(loss, 5))
        state = trainer.state()
        fractions.append(round(_changed(prev, state) / total, 6))
        if extras:
            if first is None:
                est_prev = est_first = _planes_zstd(state, None, zc)
            else:
                est_prev += _planes_zstd(state, prev, zc)
                est_first += _planes_zstd(state, first, zc)
        if first is None:
            first = _clone(state)
            cumulative.append(0.0)
        else:
            cumulative.append(round(_changed(first, state) / total, 6))
        for k, v in state.items():
            prev[k].copy_(v)
        logical.append(_nbytes(state))
        rot = (s - 1) % len(repos)
        parts = []
        for m in repos[rot:] + repos[:rot]:
            before = dir_bytes(m.path)
            settle()
            dt, info = timed(lambda: m.repo.save(RUN, s, state))
            m.save_s.append(dt)
            m.stored.append(info.stored_bytes)
            m.logical.append(info.logical_bytes)
            m.growth.append(dir_bytes(m.path) - before)
            if info.logical_bytes != logical[-1]:
                raise RuntimeError(f"P13 [{m.name}]: info.logical_bytes {info.logical_bytes} != the state's "
                                   f"{logical[-1]} bytes")
            parts.append(f"{m.name} {info.stored_bytes / (1 << 20):.1f} MiB {dt:.2f}s")
        disk_peak = max(disk_peak, dir_bytes(base))
        for m in repos:
            if m.prune and s > 1:
                m.repo.delete(RUN, s - 1)
                m.repo.gc(grace=0)
        log(f"  P13 {precision} save {s}/{SAVES}: loss {loss:.4f}, step {step_s[-1]:.2f}s, "
            f"{fractions[-1]:.1%} of elements changed ({cumulative[-1]:.1%} since save 1); " + ", ".join(parts))
    final = trainer.state()
    for m in repos:
        m.load_s, got = timed(lambda: m.repo.load(RUN, SAVES))
        _same(final, got, f"{precision}/{m.name}")
        m.verified = True
        del got
    log(f"  P13 {precision}: step {SAVES} of every repository loads back bit for bit")
    zipnn_bytes = _zipnn_bytes(final) if extras else None
    for m in repos:
        m.repo.close()
    trainer.close()
    del trainer, prev, first, final
    lsum = sum(logical)
    out = {
        "precision": precision,
        "repos": {m.name: m.summary(lsum) for m in repos},
        "logical_bytes": lsum,
        "logical_bytes_per_save": logical,
        "changed_fraction_per_step": fractions,
        "changed_fraction_cumulative": cumulative,
        "step_s": step_s,
        "median_step_s": _r(median(step_s), 3),
        "loss": losses,
        "build_s": round(t_build, 2),
        "disk_peak_bytes": disk_peak,
    }
    if extras:
        out["xor_estimate"] = {
            "bytes_vs_previous": est_prev, "ratio_vs_previous": _r(lsum / est_prev),
            "bytes_vs_first": est_first, "ratio_vs_first": _r(lsum / est_first),
        }
        out["zipnn_final_ratio"] = _r(logical[-1] / zipnn_bytes) if zipnn_bytes else None
        out["zipnn_final_bytes"] = zipnn_bytes
    shutil.rmtree(base, ignore_errors=True)
    return out


# -- P13 -------------------------------------------------------------------------------------------------------
def run_p13(size_mib: int, quick: bool, workdir: str | None, log: Callable[[str], Any], *,
            model_mib: float | None = None, context: bool = True, fp32: bool = True) -> dict[str, Any]:
    """P13.fullft_logical_over_stored: see the module docstring. ``size_mib`` is the suite's --size-mib (the model
    is ``max(size_mib, 1024)`` MiB, 256 with ``quick``; ``model_mib`` overrides both, e.g. 4 in the tests);
    ``workdir`` the parent of a scratch directory removed at the end; ``context=False`` skips the pure-bf16 run,
    ``fp32=False`` the fp32 run against ``save_pretrained`` (benchmarks/fullft_fp32.py). Returns one result dict."""
    import torch

    target = model_mib if model_mib is not None else (QUICK_MIB if quick else max(size_mib, FULL_MIN_MIB))
    plan = plan_model(target)
    work = tempfile.mkdtemp(prefix="luopan-bench-p13-", dir=workdir)
    try:
        t0 = time.perf_counter()
        load_start = loadavg()
        feats = _features(work)
        names = ["uncompressed", "default", "zstd"]
        if feats["xor_deltas"]:
            names += ["default_no_xor", "zstd_xor"]
        # worst case: every repository stores every save in full; those without deltas keep two steps
        need = (SAVES * sum(n not in PRUNED for n in names) + 2 * sum(n in PRUNED for n in names) + 2) \
            * plan["param_bytes"]
        free = shutil.disk_usage(work).free
        if free < need:
            raise RuntimeError(f"P13 needs ~{need >> 20} MiB free in {work} ({need // plan['param_bytes']}x the "
                               f"model: every repository storing every save in full), has {free >> 20} MiB")
        log(f"  P13: decoder d={plan['d_model']} x {plan['layers']} blocks, mlp {plan['mlp_hidden']}, "
            f"{plan['params'] / 1e6:.1f}M params = {plan['param_bytes'] / (1 << 20):.1f} MiB bf16; {SAVES} saves; "
            f"luopan features {feats}; torch threads {torch.get_num_threads()}")
        head = _measure(HEADLINE, plan, names, os.path.join(work, HEADLINE), feats, log, extras=True)
        other = "bf16" if HEADLINE == "mixed" else "mixed"
        ctx = (_measure(other, plan, ["uncompressed", "default"], os.path.join(work, other), feats, log,
                        extras=False) if context else None)
        feats["default_compression"] = head["repos"]["default"]["compression"]
        result = _result(head, ctx, plan, feats, target)
        result["fp32"] = run_fp32(target, work, log) if fp32 else None
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        result["loadavg"] = {"start": load_start, "end": loadavg()}
        log(f"  P13: ratio {result['ratio']} ({HEADLINE}; goal >= {GOAL}), save time ratio "
            f"{result['save_time_ratio']} (goal <= {SAVE_TIME_GOAL}); uncompressed {result['ratio_uncompressed']}, "
            f"zstd {result['ratio_zstd']}, zipnn (final weights) {result['zipnn_final_ratio']}")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _time_ratio(run: dict[str, Any], by: str = "median") -> float | None:
    d, u = (run["repos"][n]["save_spread_s"] for n in ("default", "uncompressed"))
    return _r(d[by] / u[by]) if d and u and u[by] else None


def _result(head: dict[str, Any], ctx: dict[str, Any] | None, plan: dict[str, int], feats: dict[str, Any],
            target: float) -> dict[str, Any]:
    d = head["repos"]["default"]
    ratio, tr = d["ratio"], _time_ratio(head)
    met = ratio is not None and ratio >= GOAL and tr is not None and tr <= SAVE_TIME_GOAL
    context = None
    if ctx is not None:
        context = {
            "precision": ctx["precision"],
            "ratio": ctx["repos"]["default"]["ratio"],
            "save_time_ratio": _time_ratio(ctx),
            "ratio_uncompressed": ctx["repos"]["uncompressed"]["ratio"],
            "changed_fraction_per_step": ctx["changed_fraction_per_step"],
            "changed_fraction_cumulative": ctx["changed_fraction_cumulative"],
            "median_step_s": ctx["median_step_s"],
            "step_s": ctx["step_s"],
            "loss": ctx["loss"],
            "disk_peak_bytes": ctx["disk_peak_bytes"],
            "repos": ctx["repos"],
        }
    return {
        "id": ID,
        "ratio": ratio,
        "value": ratio,
        "goal": GOAL,
        "goal_op": ">=",
        "met": met,
        "unit": "logical bytes / stored bytes over 8 saves (default repository)",
        "save_time_ratio": tr,
        "save_time_goal": SAVE_TIME_GOAL,
        "save_time_ratio_by_min": _time_ratio(head, "min"),
        "save_time_met": tr is not None and tr <= SAVE_TIME_GOAL,
        "ratio_met": ratio is not None and ratio >= GOAL,
        "precision": head["precision"],
        "ratio_steady": d["ratio_steady"],
        "ratio_by_disk_growth": d["ratio_by_disk_growth"],
        "ratio_uncompressed": head["repos"]["uncompressed"]["ratio"],
        "ratio_zstd": head["repos"]["zstd"]["ratio"],
        "ratio_default_no_xor": head["repos"].get("default_no_xor", {}).get("ratio"),
        "ratio_zstd_xor": head["repos"].get("zstd_xor", {}).get("ratio"),
        "zipnn_final_ratio": head.get("zipnn_final_ratio"),
        "xor_estimate": head.get("xor_estimate"),
        "logical_bytes": head["logical_bytes"],
        "stored_bytes": d["stored_bytes"],
        "stored_bytes_per_save": d["stored_bytes_per_save"],
        "luopan_s": d["median_save_s"],
        "uncompressed_s": head["repos"]["uncompressed"]["median_save_s"],
        "load_s": d["load_s"],
        "verified": all(r["verified"] for r in head["repos"].values()),
        "peers": head["repos"],
        "saves": SAVES,
        "saved_steps": list(range(1, SAVES + 1)),
        "changed_fraction_per_step": head["changed_fraction_per_step"],
        "changed_fraction_cumulative": head["changed_fraction_cumulative"],
        "step_s": head["step_s"],
        "median_step_s": head["median_step_s"],
        "loss": head["loss"],
        "model": {**plan, "target_mib": target, "mib": round(plan["param_bytes"] / (1 << 20), 2),
                  "optimizer": f"AdamW(lr={LR}, fused CPU kernel)", "seed": SEED},
        "features": feats,
        "disk_peak_bytes": head["disk_peak_bytes"],
        "context": context,
        "notes": f"ratio = sum of the saved states' nbytes / sum of info.stored_bytes over {SAVES} saves (steps "
                 f"1..{SAVES}, all counted; the initial weights are not saved) of luopan.open(path) defaults; "
                 f"precision {head['precision']} (fp32 AdamW masters, bf16 model saved); met needs ratio >= {GOAL} "
                 f"and median save time <= {SAVE_TIME_GOAL}x the uncompressed peer's (compression none, deltas "
                 f"off), saved in lockstep. context = the other precision. Step {SAVES} of every repository "
                 f"verified bit for bit.",
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(description="P13 full fine-tune benchmark (see the module docstring)")
    ap.add_argument("--quick", action="store_true", help=f"a {QUICK_MIB} MiB model")
    ap.add_argument("--size-mib", type=int, default=FULL_MIN_MIB,
                    help=f"model size in MiB of bf16 weights (at least {FULL_MIN_MIB}; ignored with --quick)")
    ap.add_argument("--model-mib", type=float, default=None, help=argparse.SUPPRESS)  # the tests' tiny model
    ap.add_argument("--no-context", action="store_true", help="skip the pure-bf16 context run")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 run against save_pretrained")
    ap.add_argument("--workdir", help="parent of the scratch directory (default: the system temp dir)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    r = run_p13(args.size_mib, args.quick, args.workdir, log, model_mib=args.model_mib,
                context=not args.no_context, fp32=not args.no_fp32)
    mib = 1 << 20
    print(f"{r['id']}: {r['ratio']} (goal {r['goal_op']} {r['goal']} and save time <= {r['save_time_goal']}x "
          f"uncompressed: {'met' if r['met'] else 'MISSED'}); save time ratio {r['save_time_ratio']} "
          f"({r['luopan_s']:.3f}s vs {r['uncompressed_s']:.3f}s median)")
    print(f"  model {r['model']['mib']} MiB bf16 ({r['model']['params'] / 1e6:.1f}M params), {r['precision']} "
          f"precision, step {r['median_step_s']}s median; {r['logical_bytes'] / mib:.0f} MiB logical, "
          f"{r['stored_bytes'] / mib:.0f} MiB stored; per save (MiB) "
          f"{[round(b / mib, 1) for b in r['stored_bytes_per_save']]}")
    print("  peers: " + ", ".join(f"{n} {p['ratio']} ({p['median_save_s']:.3f}s)" for n, p in r["peers"].items())
          + f"; zipnn final weights {r['zipnn_final_ratio']}; xor estimate {r['xor_estimate']}")
    print(f"  changed per step ({r['precision']}): {r['changed_fraction_per_step']}")
    if r["context"]:
        c = r["context"]
        print(f"  context {c['precision']}: ratio {c['ratio']}, save time ratio {c['save_time_ratio']}, changed "
              f"per step {c['changed_fraction_per_step']}, step {c['median_step_s']}s median")
    if r["fp32"]:
        f = r["fp32"]
        print(f"  fp32 ({f['model']['mib']} MiB GPT-2, AdamW lr {LR}): ratio {f['ratio']} (uncompressed "
              f"{f['ratio_uncompressed']}); save time {f['time_over_save_pretrained']}x save_pretrained "
              f"({f['default_s']:.3f}s vs {f['save_pretrained_s']:.3f}s; {f['time_over_save_pretrained_synced']}x "
              f"with its fsyncs), {f['time_over_uncompressed']}x uncompressed; XOR deltas per save "
              f"{f['xor_entries_per_save']} of {f['delta_candidates']} candidates; verified {f['verified']}")
    print(f"  features {r['features']}; verified {r['verified']}; {r['elapsed_s']}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [r]}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    import sys

    HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, HERE)
    try:
        import luopan  # noqa: F401
    except ImportError:  # a checkout without an installed luopan
        sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))
    sys.exit(main())
