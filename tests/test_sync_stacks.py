"""Live weight sync in the training stacks (luopan.sync.helpers, luopan.sync.hf): the README example runs as
written; a Hugging Face Trainer.train publishes every step through SyncCallback and a worker follows bit-exactly;
a vLLM-style worker (``load_weights`` of ``(name, tensor)`` pairs into fused layers) is kept in sync by WeightLoader."""

from __future__ import annotations

import pytest
import torch

import luopan.sync

from .test_readme_agent import block, run_python
from .test_sync import bits, make_model, train_step


def test_readme_example(tmp_path, child_env):
    assert run_python(block("python", "luopan.sync.Publisher"), tmp_path, child_env).strip() == \
        "in sync at version 5"


def test_step_publisher_counts_and_skips(tmp_path):
    model = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch")
    hook = luopan.sync.StepPublisher(pub, model, every=2)
    assert [hook() for _ in range(4)] == [None, 1, None, 2]
    assert hook(step=40) is None and hook(step=50) == 3
    assert luopan.sync.Subscriber(tmp_path / "ch").update(make_model(1)) == 3


def test_hf_trainer_sync_callback(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    from .test_hf import Tokens, tiny_llama

    model, worker = tiny_llama(0), tiny_llama(1)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=3)
    sub = luopan.sync.Subscriber(tmp_path / "ch")
    seen = []

    class Follow(transformers.TrainerCallback):  # a worker updating after each published step
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(sub.update(worker))
            assert bits(worker) == bits(model)

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                          dataloader_num_workers=0, disable_tqdm=True)
    cb = luopan.sync.SyncCallback(pub)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(16, 1), callbacks=[cb, Follow()]).train()
    assert cb.versions == [1, 2, 3, 4] and seen == [1, 2, 3, 4]
    assert bits(worker) == bits(model)


class FusedWorker(torch.nn.Module):
    """A vLLM-style model: its layers are laid out its own way (one fused matrix for two published ones) and it
    takes weights only through ``load_weights((name, tensor), ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(32 + 50, 16, dtype=torch.bfloat16), requires_grad=False)
        self.loaded: list[str] = []

    def load_weights(self, weights) -> None:
        for name, t in weights:
            self.loaded.append(name)
            if name == "1.weight":
                self.fused.data[:32] = t
            elif name == "3.weight":
                self.fused.data[32:] = t


def test_weight_loader_for_vllm_style_workers(tmp_path):
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch")
    shadow = {k: torch.zeros_like(v) for k, v in trainer.state_dict().items()}
    worker = FusedWorker()
    loader = luopan.sync.WeightLoader(luopan.sync.Subscriber(tmp_path / "ch"), worker.load_weights, shadow)
    for step in range(3):
        train_step(trainer, step)
        pub.publish(step, trainer)
        worker.loaded.clear()
        assert loader.update() == step + 1 == loader.version
        assert torch.equal(worker.fused[:32], trainer[1].weight) and torch.equal(worker.fused[32:],
                                                                                       trainer[3].weight)
        assert "1.weight" in worker.loaded and (step == 0 or len(worker.loaded) < len(shadow))
    assert loader.update() is None
