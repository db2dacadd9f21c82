"""Generator of tests/data/v5_repo/: a repository written by luopan of repository format version 5.

tests/test_format_v5_compat.py opens it with the current code and compares what it reads with what the functions
below build (every value is a pure function of fixed seeds and the step; only ids, nonces and timestamps in the
files differ between two runs of this script).

How the sample was made (commit cdafbe7, "XOR-delta chunks are split without the sign rotation ...", is the last
commit whose luopan writes format version 5; its luopan.format.FORMAT_VERSION is 5)::

    git -C /work/main worktree add /tmp/v5 cdafbe7
    PYTHONPATH=/tmp/v5/src .venv/bin/python tests/data/make_v5_repo.py tests/data/v5_repo
    git -C /work/main worktree remove /tmp/v5 --force

The script refuses to run with a luopan whose luopan.format.FORMAT_VERSION is not 5. Each run's first save writes
a run record (argv, cwd, environment, git state: docs/format.md §8.1), so the script first moves into an empty
temporary directory (no git work tree), empties the environment down to PATH and sets argv to the script's name:
the sample records nothing of the machine that made it. What it writes:

* ``auto/`` (the default compression "auto": a version-5 config, zstd-compressed manifests and index files, the
  bytegroup float codec; 16 KiB chunks, 64 KiB packs, deltas from 4 KiB on):
  - run ``lora``, steps 0-3 (``STEPS``): a LoRA-like state of 2 x ``LAYERS`` tensor entries, interleaved by name
    as PEFT's state dicts are: ``model/layerNN.weight`` (frozen fp32 32x32 base weights, the same at every step)
    and ``model/layerNN.lora`` (fp32 2x32 adapters, new at every step); ``model/head``, a 64x256 bf16 tensor
    that small dense multiplicative updates change everywhere at every step (the later steps store XOR deltas);
    ``table``, a 512x32 fp32 numpy table changed in a few scattered rows at every step (row deltas); and the
    scalars ``step`` and ``lr``. Each save has metrics ``{"loss": 1 / (step + 1)}``.

More than 32 entries (luopan.format.groups.GROUP_MIN_ENTRIES) with most of them unchanged from one step to the
next: a version-6 writer would store this run's manifests with entry groups (docs/format.md §8.5), which a
version-5 repository must never get.

The functions ``lora_state`` and ``metrics`` are what the test imports to build the expected contents (they
extend past ``STEPS``: the test adds later steps of the same run).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

CHUNK = 16 << 10
PACK = 64 << 10
STEPS = list(range(4))
LAYERS = 20  # 20 base weights + 20 adapters + head: 41 tensor entries
ROWS, DIM = 512, 32  # 64 KiB fp32 table with 128-byte rows: four 16 KiB chunks


def _rows(seed: int, n: int, nrows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).choice(nrows, n, replace=False)


def base_weights() -> dict[str, torch.Tensor]:
    """The frozen base weights (the same at every step)."""
    g = torch.Generator().manual_seed(5000)
    return {f"layer{i:02d}.weight": torch.randn(32, 32, generator=g) for i in range(LAYERS)}


def adapter(step: int, i: int) -> torch.Tensor:
    return torch.randn(2, 32, generator=torch.Generator().manual_seed(10000 + 100 * step + i))


def lora_state(step: int) -> dict:
    """The state saved as checkpoint ``step`` of run ``lora`` (built from the seeds by replaying steps 1..step)."""
    base = base_weights()
    model: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):  # interleaved: base weight, adapter, base weight, ...
        model[f"layer{i:02d}.weight"] = base[f"layer{i:02d}.weight"]
        model[f"layer{i:02d}.lora"] = adapter(step, i)
    head = torch.randn(64, 256, generator=torch.Generator().manual_seed(6000)).to(torch.bfloat16)
    table = np.random.default_rng(7000).standard_normal((ROWS, DIM), dtype=np.float32)
    for s in range(1, step + 1):
        noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(6000 + s))
        head.mul_(1 + noise * 0.01)  # dense and small: an XOR delta
        table[_rows(7000 + s, 3)] += np.float32(0.25 * s)  # a few scattered rows: a row delta
    model["head"] = head
    return {"model": model, "table": table, "step": step, "lr": 1e-4 / (step + 1)}


def metrics(step: int) -> dict:
    return {"loss": 1.0 / (step + 1)}


def main(out: str) -> None:
    import luopan
    from luopan.format import FORMAT_VERSION

    if FORMAT_VERSION != 5:
        sys.exit(f"this luopan writes format version {FORMAT_VERSION}; run with PYTHONPATH=<checkout of cdafbe7>/src")
    print(f"luopan from {luopan.__file__} (format version {FORMAT_VERSION})")
    run_neutral(out, "make_v5_repo.py", lambda path: _write(path, luopan))


def run_neutral(out: str, script: str, write) -> None:
    """``write(out)`` into a fresh directory ``out``, with nothing of this machine in the run records it writes (also
    used by make_v6_repo.py); then removes empty directories, which git would not keep."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # Run records (§8.1) capture argv, cwd, the environment and the git diff of the cwd: keep them neutral.
    home, scratch = os.getcwd(), tempfile.mkdtemp(prefix=script.split(".")[0] + "-")
    os.chdir(scratch)
    os.environ.clear()
    os.environ["PATH"] = "/usr/bin:/bin"
    sys.argv = [script]
    try:
        write(out)
    finally:
        os.chdir(home)
        shutil.rmtree(scratch)
    for dirpath, dirs, files in os.walk(out, topdown=False):  # git keeps no empty directory (locks/): neither do we
        if not dirs and not files:
            os.rmdir(dirpath)


def write_run(out: str, luopan):
    """Saves run ``lora``'s STEPS into ``out/auto``; returns (its path, the open repo, the manifests' documents, their
    entries) (also used by make_v6_repo.py)."""
    root = os.path.join(out, "auto")
    repo = luopan.open(root, chunk_size=CHUNK, pack_size=PACK,
                       delta_policy=luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096))
    for step in STEPS:
        repo.save("lora", step, lora_state(step), metrics=metrics(step))
    docs = [repo.manifest("lora", step).doc for step in STEPS]
    return root, repo, docs, [e for d in docs for e in d["entries"]]


def _write(out: str, luopan) -> None:
    from luopan.format.manifest import stored_rows  # the luopan being run (cdafbe7 has it too)

    root, repo, docs, entries = write_run(out, luopan)
    assert sum(1 for e in docs[0]["entries"] if e.get("kind") in ("torch", "numpy")) >= 40
    assert any("xor" in e for e in entries), "no XOR delta"
    assert any("delta" in e for e in entries), "no row delta"
    assert any(r[5] == "bytegroup" for e in entries for r in stored_rows(e)), "no bytegroup chunk"
    assert all(d["format_version"] <= 5 for d in docs)
    assert repo.verify().ok
    repo.close()
    with open(os.path.join(root, "luopan.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == 5


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "v5_repo"))
