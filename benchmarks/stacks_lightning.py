"""E1 (issue 31): PyTorch Lightning through luopan vs Lightning's own default, on the tiny run of the tests
(tests/lightning_exact_job.py: an MLP with dropout, a shuffled loader, ModelCheckpoint(monitor="val_loss",
save_top_k=2, save_last=True), ExactResume).

E1.lightning_bytes_over_default = bytes of luopan's repository + its pointer files / bytes of Lightning's .ckpt
files (torch.save), both after the same fit; goal <= 1.0. Rotated-out checkpoints free their packs at once
(LuopanCheckpointIO(reclaim=True), the default). Also reported: bytes on disk by allocated blocks, and the median
seconds per save of each (the CheckpointIO's save_checkpoint, timed in the same run).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_exact_job", os.path.join(ROOT, "tests",
                                                                                      "lightning_exact_job.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sizes(*paths: str) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk) under ``paths``."""
    size = blocks = 0
    for top in paths:
        for parent, _dirs, files in os.walk(top):
            for name in files:
                st = os.lstat(os.path.join(parent, name))
                size += st.st_size
                blocks += st.st_blocks * 512
    return size, blocks


def _timed(io: Any, seconds: list[float]) -> Any:
    save = io.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t)

    io.save_checkpoint = timed_save
    return io


def _fit(job: Any, io: Any, ckpt_dir: str, epochs: int) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from luopan.lightning import ExactResume

    L.seed_everything(0)
    train, val = job.loaders()
    trainer = L.Trainer(max_epochs=epochs, plugins=[io], logger=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True),
                                   ExactResume()])
    trainer.fit(job.DropNet(), train, val)


def run(quick: bool, workdir: str, log: Callable[[str], Any]) -> list[dict[str, Any]]:
    import warnings

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from luopan.lightning import LuopanCheckpointIO

    warnings.filterwarnings("ignore")
    job = _job()
    epochs = 6 if quick else 20
    base = os.path.join(workdir, "e1-lightning")
    shutil.rmtree(base, ignore_errors=True)
    default_dir, repo, pointers = (os.path.join(base, n) for n in ("default", "repo", "pointers"))
    t_default: list[float] = []
    t_luopan: list[float] = []
    log(f"E1: Lightning default, {epochs} epochs")
    _fit(job, _timed(TorchCheckpointIO(), t_default), default_dir, epochs)
    log(f"E1: luopan, {epochs} epochs")
    _fit(job, _timed(LuopanCheckpointIO(repo, "e1"), t_luopan), pointers, epochs)
    default_bytes, default_disk = _sizes(default_dir)
    luopan_bytes, luopan_disk = _sizes(repo, pointers)
    value = luopan_bytes / default_bytes
    log(f"E1: luopan {luopan_bytes} B vs default {default_bytes} B = {value:.3f}x")
    shutil.rmtree(base, ignore_errors=True)
    return [{
        "id": "E1.lightning_bytes_over_default", "value": value, "ratio": value, "goal": 1.0, "goal_op": "<=",
        "met": value <= 1.0, "unit": "x",
        "notes": (f"{epochs} epochs of the tests' MLP (hidden {job.HIDDEN}, dropout, AdamW), ModelCheckpoint("
                  "monitor='val_loss', save_top_k=2, save_last=True) + ExactResume; bytes = file sizes of luopan's "
                  "repository and pointer files vs Lightning's .ckpt files after the fit; rotated-out checkpoints "
                  "reclaimed at once"),
        "luopan_bytes": luopan_bytes, "default_bytes": default_bytes,
        "luopan_disk_bytes": luopan_disk, "default_disk_bytes": default_disk,
        "luopan_seconds_per_save": statistics.median(t_luopan), "default_seconds_per_save": statistics.median(t_default),
        "saves": len(t_luopan),
    }]
