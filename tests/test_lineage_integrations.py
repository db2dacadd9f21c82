"""Lineage from every integration (issue 31): ``inputs=`` ("NAME@V": artifact versions, other checkpoints) on
``CheckpointManager``, ``luopan.hf.LuopanCallback``, ``luopan.lightning.LuopanCheckpointIO`` and ``luopan.dcp.Writer``
is recorded in every checkpoint they save (the manifest's ``inputs``, docs/format.md §8), and ``repo.lineage`` finds
those checkpoints from the dataset version. Each runs its real stack."""

from __future__ import annotations

import os

import pytest
import torch

import luopan

DATA = "datasets/train@1"


def dataset(root: str) -> None:
    with luopan.open(root) as repo:
        repo.artifact("datasets/train").commit({"shard-0.jsonl": b'{"text": "hello"}\n'})


def recorded(root: str, run: str) -> dict[int, list[str]]:
    with luopan.open(root) as repo:
        steps = repo.steps(run)
        assert steps, f"run {run!r} saved nothing"
        out = {s: repo.manifest(run, s).doc.get("inputs", []) for s in steps}
        assert sorted(repo.repository.lineage(DATA).checkpoints) == sorted(f"{run}@{s}" for s in steps)
    return out


def test_checkpoint_manager_records_its_inputs(tmp_path):
    from luopan.torch import CheckpointManager, TrainingState

    root = str(tmp_path / "repo")
    dataset(root)
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(root, "mgr", TrainingState(model=model), inputs=[DATA]) as mgr:
        mgr.save(1)
        model.weight.data.add_(1)
        mgr.save(2)
    assert recorded(root, "mgr") == {1: [DATA], 2: [DATA]}
    with pytest.raises(luopan.ManifestNotFoundError, match="does not exist"):
        with CheckpointManager(root, "bad", TrainingState(model=model), inputs=["datasets/train@7"]) as mgr:
            mgr.save(1)


def test_dcp_writer_records_its_inputs(tmp_path):
    import torch.distributed.checkpoint as dcp

    import luopan.dcp

    root = str(tmp_path / "repo")
    dataset(root)
    state = {"w": torch.randn(8, 4), "b": torch.zeros(4)}
    dcp.save(state, storage_writer=luopan.dcp.Writer(root, "dcp-run", 3, inputs=[DATA]), no_dist=True)
    assert recorded(root, "dcp-run") == {3: [DATA]}


def test_lightning_plugin_records_its_inputs(tmp_path):
    pytest.importorskip("lightning")
    from .lightning_job import fit

    root = str(tmp_path / "repo")
    dataset(root)
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        fit(root, str(tmp_path / "ck"), "pl", 2, inputs=[DATA])
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    assert set(map(tuple, recorded(root, "pl").values())) == {(DATA,)}


def test_hf_callback_records_its_inputs(tmp_path):
    transformers = pytest.importorskip("transformers")
    from luopan.hf import LuopanCallback

    from .test_hf import Tokens, tiny_llama

    root = str(tmp_path / "repo")
    dataset(root)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2,
                                          save_strategy="steps", per_device_train_batch_size=4, logging_steps=1,
                                          learning_rate=5e-3, seed=7, data_seed=7, report_to=[], use_cpu=True,
                                          dataloader_num_workers=0, disable_tqdm=True)
    cb = LuopanCallback(root, "hf-run", inputs=[DATA])
    transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(32, 1), callbacks=[cb]).train()
    assert recorded(root, "hf-run") == {2: [DATA], 4: [DATA]}
    assert not os.path.exists(tmp_path / "out" / "checkpoint-2")  # saved in luopan, not beside it
