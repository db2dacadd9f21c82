"""P15 (issue 15): how much of a LoRA run's repository is metadata (manifests and index files) rather than packs.

`P15.manifest_share` = (bytes of checkpoint manifests + bytes of index files) / bytes of every file in the
repository directory, after a LoRA fine-tune saved 50 times into one fresh repository. Goal <= 0.10.

**Model** (plain torch, no peft). A tiny decoder of exactly 300 frozen base tensors: 50 layers, each with q/k/v/o
projections (``d x d`` fp32 weights, no bias; ``d = hidden``, 64 by default) and two RMS-norm weights (``d``):
50 x 6 = 300 tensors, 50 x (4 d^2 + 2 d) x 4 bytes = 3.2 MiB at d = 64. Every q/k/v/o projection carries a LoRA
adapter of rank 8 (``lora_A`` r x d, ``lora_B`` d x r, ``B`` zero-initialised, scale alpha / r = 2): 400 trainable
tensors, 0.78 MiB at d = 64 (25% of this tiny base's parameters, far more than a real LoRA's share: the
denominator's packs are generous to the ratio only through the adapters and optimizer state, which are what a
LoRA run writes).

**Training.** AdamW (lr 1e-3, weight decay 0.01, not fused) over the adapters only. One optimizer step per save,
on real gradients: a batch of 4 sequences of 16 random tokens' embeddings (seeded) goes through the 50 layers
(causal single-head attention with the LoRA-adapted projections, residuals, RMS norms) and the loss is the MSE
against a fixed random target.

**Saves.** After each step: ``repo.save("lora", step, {"model": model.state_dict(), "optim":
optimizer.state_dict()})`` (the frozen base, the adapters, AdamW's ``exp_avg``/``exp_avg_sq``/``step`` per adapter and
its param groups: a LoRA fine-tune's checkpoint) for steps 1..50 into one repository made by ``luopan.open(path)``
(default options). Each save's ``stored_bytes`` and time are recorded.

**Measure** (on disk, after the last save, ``os.stat`` sizes of every file under the repository directory):
``packs`` (``packs/**``), ``manifests`` (``runs/<run>/ckpt/*.json``), ``index`` (``index/**``), ``run_records``
(``runs/<run>/record.json``), ``refs`` (``refs/**``), ``config`` (``luopan.json``) and anything else by its
top-level name. ratio = (manifests + entry groups + index) / all bytes, where ``entry groups`` are the blobs of a
grouped manifest's entries (docs/format.md §8.5), stored in packs but counted here as manifest bytes (a pack of
group blobs only counts whole). The last step is loaded back and compared exactly (every
tensor ``torch.equal``, same keys, same non-tensor values) with what was saved.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

ID = "P15.manifest_share"
GOAL = 0.10
RUN = "lora"
LAYERS = 50
RANK = 8
ALPHA = 16
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
NORMS = ("input_norm", "post_norm")


# -- repository bytes by category (shared with rowdelta.first_resave) ---------------------------------------------
def repo_bytes_by_category(path: str) -> dict[str, int]:
    """Bytes of every file under a luopan repository directory, by what it is: ``packs``, ``manifests``
    (``runs/*/ckpt/*.json``), ``index``, ``run_records`` (``runs/*/record.json``), ``refs``, ``config``
    (``luopan.json``), anything else under ``other:<top-level name>`` (or ``other:<runs/…>`` below runs/)."""
    out: dict[str, int] = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                size = os.stat(full).st_size
            except FileNotFoundError:  # a temporary that went away
                continue
            rel = os.path.relpath(full, path).split(os.sep)
            top = rel[0]
            if top == "packs":
                cat = "packs"
            elif top == "index":
                cat = "index"
            elif top == "refs":
                cat = "refs"
            elif rel == ["luopan.json"]:
                cat = "config"
            elif top == "runs" and len(rel) == 4 and rel[2] == "ckpt" and rel[3].endswith(".json"):
                cat = "manifests"
            elif top == "runs" and len(rel) == 3 and rel[2] == "record.json":
                cat = "run_records"
            elif top == "runs":
                cat = "other:runs/*/" + "/".join(rel[2:-1] + ["*"]) if len(rel) > 3 else "other:runs/*/" + rel[-1]
            else:
                cat = f"other:{top}"
            out[cat] = out.get(cat, 0) + size
    return out


def entry_group_bytes(path: str) -> tuple[int, int]:
    """(bytes, packs): what the entry groups of every checkpoint manifest under ``path`` take (docs/format.md §8.5).
    A pack holding only group blobs counts whole (header and trailer too); in a mixed pack, the group blobs' stored
    lengths. Grouped manifests name their group rows; inline ones have none."""
    from luopan.format.canonical import inflate_json, unseal
    from luopan.repository.chunkio import read_trailer
    from luopan.store.local import LocalStore

    store = LocalStore(path)
    rows: dict[str, tuple[str, int]] = {}  # group hash -> (pack id, stored length)
    for key in store.list("runs/"):
        if "/ckpt/" in key and key.endswith(".json"):
            doc = unseal(inflate_json(store.get(key)))
            for r in doc.get("groups", []):
                rows[r[0]] = (doc["packs"][r[1]], r[3])
    total, whole = 0, 0
    for pack in sorted({p for p, _n in rows.values()}):
        _id, blobs = read_trailer(store, pack)
        if all(b["hash"] in rows for b in blobs):
            total += os.stat(os.path.join(path, "packs", pack[:2], pack + ".pack")).st_size
            whole += 1
        else:
            total += sum(n for p, n in rows.values() if p == pack)
    return total, whole


def file_counts(path: str, sub: str) -> int:
    n = 0
    for _root, _dirs, files in os.walk(os.path.join(path, sub)):
        n += len(files)
    return n


# -- the model -----------------------------------------------------------------------------------------------------
def _build(hidden: int, seed: int) -> tuple[Any, list[Any]]:
    """(model, adapter parameters). ``model.state_dict()`` holds the 300 frozen base tensors and 400 adapters."""
    import torch

    g = torch.Generator().manual_seed(seed)

    class LoraLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden),
                                             requires_grad=False)
            self.lora_A = torch.nn.Parameter(torch.randn(RANK, hidden, generator=g) / math.sqrt(hidden))
            self.lora_B = torch.nn.Parameter(torch.zeros(hidden, RANK))

        def forward(self, x: Any) -> Any:
            return x @ self.weight.T + (ALPHA / RANK) * ((x @ self.lora_A.T) @ self.lora_B.T)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for p in PROJ:
                self.add_module(p, LoraLinear())
            for n in NORMS:
                self.register_parameter(n, torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g),
                                                              requires_grad=False))

        @staticmethod
        def _norm(x: Any, w: Any) -> Any:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def forward(self, h: Any) -> Any:
            a = self._norm(h, self.input_norm)
            q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hidden)
            n = scores.shape[-1]
            scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            h = h + self.o_proj(torch.softmax(scores, -1) @ v)
            return self._norm(h, self.post_norm)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))

        def forward(self, h: Any) -> Any:
            for layer in self.layers:
                h = layer(h)
            return h

    model = Model()
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    return model, adapters


def _same_tree(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return a == b


def _clone_tree(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(v) for v in tree)
    return tree


def _tensor_stats(tree: Any) -> tuple[int, int]:
    import torch

    if isinstance(tree, torch.Tensor):
        return 1, tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        n = b = 0
        for v in tree:
            dn, db = _tensor_stats(v)
            n, b = n + dn, b + db
        return n, b
    return 0, 0


# -- P15 ---------------------------------------------------------------------------------------------------------
def manifest_share(work: str, log: Callable[..., Any], *, saves: int = 50, hidden: int = 64,
                   seed: int = 0) -> dict[str, Any]:
    """The P15 measurement in a fresh repository under ``work`` (removed at the end). ``saves`` and ``hidden``
    scale it down for tests; the goal is defined at 50 saves."""
    import torch

    import luopan

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model, adapters = _build(hidden, seed)
    base_tensors = sum(1 for n, _ in model.named_parameters() if "lora_" not in n)
    base_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" not in n)
    adapter_bytes = sum(p.numel() * 4 for p in adapters)
    assert base_tensors == LAYERS * (len(PROJ) + len(NORMS)) == 300
    opt = torch.optim.AdamW(adapters, lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4, 16, hidden, generator=g)
    target = torch.randn(4, 16, hidden, generator=g)
    path = os.path.join(work, "p15-repo")
    repo = luopan.open(path)
    stored: list[int] = []
    save_s: list[float] = []
    losses: list[float] = []
    state: dict[str, Any] = {}
    try:
        for step in range(1, saves + 1):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            t = time.perf_counter()
            info = repo.save(RUN, step, state)
            save_s.append(time.perf_counter() - t)
            stored.append(info.stored_bytes)
            if step == 1 or step % 10 == 0 or step == saves:
                log(f"  P15 save {step}/{saves}: loss {losses[-1]:.5f}, stored {info.stored_bytes} bytes in "
                    f"{save_s[-1]:.3f}s")
        expected = _clone_tree(state)
        repo.close()
        by_cat = repo_bytes_by_category(path)
        # the last step, loaded by a fresh handle, must be exactly what was saved
        check = luopan.open(path)
        got = check.load(RUN, saves)
        check.close()
        verified = _same_tree(got, expected)
        if not verified:
            raise RuntimeError(f"P15: repo.load({RUN!r}, {saves}) differs from the state saved at that step")
        del got
        groups_bytes, group_packs = entry_group_bytes(path)
        n_manifests = len([f for f in os.listdir(os.path.join(path, "runs", RUN, "ckpt")) if f.endswith(".json")])
        n_index = file_counts(path, "index")
        n_packs = file_counts(path, "packs")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    total = sum(by_cat.values())
    manifests = by_cat.get("manifests", 0)
    index = by_cat.get("index", 0)
    packs = by_cat.get("packs", 0)
    # a grouped manifest's entry groups (docs/format.md §8.5) are manifest bytes kept in packs: counted as such
    ratio = (manifests + index + groups_bytes) / total if total else float("nan")
    tensors, state_bytes = _tensor_stats(expected)
    result = {
        "id": ID,
        "ratio": round(ratio, 4),
        "value": round(ratio, 4),
        "goal": GOAL,
        "goal_op": "<=",
        "met": ratio <= GOAL,
        "unit": "(manifest bytes + entry group bytes + index file bytes) / bytes of every file in the repository",
        "saves": saves,
        "manifest_bytes": manifests,
        "index_bytes": index,
        "entry_group_bytes": groups_bytes,
        "entry_group_packs": group_packs,
        "pack_bytes": packs,
        "total_bytes": total,
        "bytes_by_category": by_cat,
        "non_pack_bytes": total - packs,
        "non_pack_share": round((total - packs) / total, 4) if total else None,
        "manifests": n_manifests,
        "index_files": n_index,
        "packs": n_packs,
        "manifest_mean_bytes": round(manifests / n_manifests) if n_manifests else None,
        "index_mean_bytes": round(index / n_index) if n_index else None,
        "stored_bytes_total": sum(stored),
        "stored_bytes_per_save": stored,
        "stored_bytes_first_save": stored[0],
        "stored_bytes_mean_later_saves": round(sum(stored[1:]) / len(stored[1:])) if saves > 1 else None,
        "save_s_mean": sum(save_s) / len(save_s),
        "save_s_first": save_s[0],
        "hidden": hidden,
        "layers": LAYERS,
        "lora_rank": RANK,
        "base_tensors": base_tensors,
        "base_bytes": base_bytes,
        "adapter_tensors": len(adapters),
        "adapter_bytes": adapter_bytes,
        "state_tensors": tensors,
        "state_bytes": state_bytes,
        "loss_first_last": [round(losses[0], 6), round(losses[-1], 6)],
        "verified_last_step": verified,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "notes": f"LoRA fine-tune (plain torch): {base_tensors} frozen base tensors ({LAYERS} layers x q/k/v/o "
                 f"{hidden}x{hidden} + 2 RMS norms, {base_bytes / 2**20:.2f} MiB fp32), rank-{RANK} adapters on "
                 f"every projection ({len(adapters)} tensors, {adapter_bytes / 2**20:.2f} MiB), AdamW one step per "
                 f"save on real gradients; {saves} saves of {{model: state_dict(), optim: state_dict()}} into one "
                 "fresh repository (default options). Sizes on disk after the last save; the last step loaded back "
                 "and compared exactly.",
    }
    log(f"  P15: manifests {manifests} B ({n_manifests} files, mean {result['manifest_mean_bytes']} B), entry groups "
        f"{groups_bytes} B ({group_packs} packs of groups only), index "
        f"{index} B ({n_index} files), packs {packs} B, all {total} B: ratio {ratio:.4f}")
    return result


def run_p15(quick: bool, workdir: str | None, log: Callable[..., Any]) -> dict[str, Any]:
    """P15.manifest_share for the incremental suite. ``quick`` changes nothing (50 saves of a 4 MiB state take
    seconds); ``workdir``: parent of the scratch directory (removed at the end)."""
    if workdir is not None:
        os.makedirs(workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="luopan-bench-p15-", dir=workdir)
    try:
        return manifest_share(work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import json
    import sys

    HERE = os.path.dirname(os.path.abspath(__file__))
    try:
        import luopan  # noqa: F401
    except ImportError:  # a checkout without an installed luopan
        sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))
    res = run_p15(False, None, lambda *a: print(*a, file=sys.stderr, flush=True))
    print(json.dumps(res, indent=2))
