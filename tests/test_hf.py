"""luopan.hf.LuopanCallback with a real transformers Trainer (tiny Llama from a config, CPU) and luopan.peft with a
real PEFT LoRA: resume gives the same per-step losses, checkpoints land once (no checkpoint-N directories, nothing
pickled), save_total_limit keeps the best, load_best_model_at_end loads it, adapters refuse another base."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import luopan
import luopan.peft
from luopan.hf import LuopanCallback

VOCAB = 48


def tiny_llama(seed: int = 0) -> object:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                   attention_dropout=0.1)  # dropout: the RNG state matters on resume
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def lora(model: object) -> object:
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.1, task_type="CAUSAL_LM"))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(transformers.TrainerCallback):
    """Ends training after global step ``n`` (after that step's save), like a job cut off there."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.n:
            control.should_training_stop = True
        return control


def make_trainer(tmp_path, repo, model, *, run="hf-run", callbacks=(), eval_ds=None, **overrides):
    args = dict(output_dir=str(tmp_path / "out"), max_steps=6, save_steps=2, save_strategy="steps",
                per_device_train_batch_size=4, logging_steps=1, learning_rate=5e-3, seed=7, data_seed=7,
                report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    args.update(overrides)
    cb = LuopanCallback(repo, run)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args),
                                   train_dataset=Tokens(32, 1), eval_dataset=eval_ds,
                                   callbacks=[cb, *callbacks])
    return trainer, cb


def losses(trainer) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}


def no_trainer_files(root) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        assert not [d for d in dirnames if d.startswith("checkpoint-")], dirpath
        assert not [f for f in filenames if f.endswith((".pth", ".bin", ".pt"))], dirpath


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_resume_gives_the_same_losses(tmp_path, use_lora) -> None:
    repo = luopan.open(tmp_path / "repo")
    wrap = lora if use_lora else (lambda m: m)
    whole, _ = make_trainer(tmp_path / "a", repo, wrap(tiny_llama()), run="whole")
    whole.train()
    expected = losses(whole)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    cut, _ = make_trainer(tmp_path / "b", repo, wrap(tiny_llama()), run="cut", callbacks=[StopAt(4)])
    cut.train()
    assert repo.steps("cut") == [2, 4]
    resumed, _ = make_trainer(tmp_path / "b", repo, wrap(tiny_llama()), run="cut")
    resumed.train(resume_from_checkpoint=True)
    got = losses(resumed)
    assert {s: got[s] for s in (5, 6)} == {s: expected[s] for s in (5, 6)}
    assert repo.steps("cut") == [2, 4, 6]
    no_trainer_files(tmp_path)
    no_trainer_files(repo.where)

    tree = repo.load("cut", 6)
    assert set(tree) >= {"model", "optimizer", "scheduler", "rng", "trainer_state", "training_args"}
    assert tree["trainer_state"]["global_step"] == 6
    if use_lora:  # the adapter only, with its config and the base's content fingerprint
        assert all("lora_" in k for k in tree["model"]), list(tree["model"])[:3]
        assert tree["peft"]["base_fingerprint"] == luopan.torch.fingerprint(tiny_llama())
    else:
        assert set(tree["model"]) == set(tiny_llama().state_dict())
    # the same weights as the uninterrupted run
    final = repo.load("whole", 6)["model"]
    for k, v in tree["model"].items():
        assert torch.equal(v, final[k]), k


def test_resume_by_step_and_by_checkpoint_path(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    first, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=4)
    first.train()
    expected = losses(first)
    again, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=4)
    with pytest.raises(luopan.UsageError, match="steps 4 after step 2"):  # would replace step 4 of that training
        again.train(resume_from_checkpoint=2)
    assert repo.steps("hf-run") == [2, 4]
    for resume in (2, str(tmp_path / "out" / "checkpoint-2")):
        repo.delete("hf-run", 4)
        again, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=4)
        again.train(resume_from_checkpoint=resume)
        got = losses(again)
        assert {s: got[s] for s in (3, 4)} == {s: expected[s] for s in (3, 4)}
    again, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=4)
    with pytest.raises(luopan.CheckpointNotFoundError, match="no checkpoint at step 3"):
        again.train(resume_from_checkpoint=3)
    with pytest.raises(luopan.UsageError, match="output_dir"):  # another experiment's directory is not this run
        again.train(resume_from_checkpoint=str(tmp_path / "elsewhere" / "checkpoint-2"))
    with pytest.raises(luopan.UsageError, match="already has checkpoints at steps 2, 4"):  # a fresh training
        again.train()
    assert repo.steps("hf-run") == [2, 4]
    fresh, _ = make_trainer(tmp_path, repo, tiny_llama(), run="never-saved")
    with pytest.raises(luopan.CheckpointNotFoundError, match="no checkpoint to resume from"):
        fresh.train(resume_from_checkpoint=True)


def test_a_pinned_step_is_never_replaced(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    repo.save("r", 2, {"w": torch.zeros(3)})
    repo.run("r").pin(2, "release")
    with pytest.raises(luopan.UsageError, match="pinned"):
        repo.save("r", 2, {"w": torch.ones(3)}, overwrite=True)
    assert torch.equal(repo.load("r", 2)["w"], torch.zeros(3))


@pytest.mark.parametrize("limit", [1, 2])
def test_save_total_limit_keeps_the_best_and_loads_it_at_the_end(tmp_path, limit) -> None:
    repo = luopan.open(tmp_path / "repo")
    # greater_is_better=True on eval_loss: the best is an early checkpoint, which rotation must keep
    trainer, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=8, eval_ds=Tokens(8, 2),
                              eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss",
                              greater_is_better=True, load_best_model_at_end=True, save_total_limit=limit)
    seen: list[list[int]] = []

    class Watch(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(repo.steps("hf-run"))

    trainer.add_callback(Watch())
    trainer.train()
    best = trainer.state.best_global_step
    evals = {r["step"]: r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r}
    assert best == max(evals, key=evals.get)
    assert best < 8  # an early best: rotation had to keep it
    for steps in seen:  # after every save: the newest `limit` and the best, nothing else
        assert best in steps or max(steps) < best
    assert seen[-1] == sorted({*seen[-1][-limit:], best})
    final_steps = repo.steps("hf-run")
    assert final_steps == ([best] if limit == 1 else sorted({best, 6, 8}))
    # load_best_model_at_end: the live model holds the best checkpoint's weights
    best_model = repo.load("hf-run", best)["model"]
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, best_model[k]), k
    info = {c.step: c for c in repo.checkpoints("hf-run")}
    assert "eval_loss" in info[best].metrics
    # the best is named by a luopan reference that resolves (no checkpoint-N directory exists to name)
    ref = trainer.state.best_model_checkpoint
    assert ref == f"hf-run@{best}" and repo.load("hf-run", best)["trainer_state"]["best_model_checkpoint"] == ref
    from typer.testing import CliRunner

    from luopan.cli.main import app

    out = tmp_path / "best.safetensors"
    r = CliRunner().invoke(app, ["export", "-r", str(tmp_path / "repo"), ref, "--subtree", "model", "-o", str(out)])
    assert r.exit_code == 0 and out.stat().st_size > 0, r.output


def test_a_best_found_at_an_unsaved_evaluation_does_not_lose_the_saved_best(tmp_path):
    """evals every 2 steps, saves every 4: the Trainer's best checkpoint is the best *saved* step."""
    repo = luopan.open(tmp_path / "repo")
    scores = iter([1.0, 5.0, 9.0, 2.0])  # evals at 2, 4, 6, 8: best saved at 4; step 6 is better but not saved
    trainer, _ = make_trainer(tmp_path, repo, tiny_llama(), max_steps=8, save_steps=4, eval_ds=Tokens(4, 2),
                              eval_strategy="steps", eval_steps=2, metric_for_best_model="score",
                              greater_is_better=True, load_best_model_at_end=True, save_total_limit=1)
    trainer.compute_metrics = lambda pred: {"score": next(scores)}
    trainer.train()
    assert trainer.state.best_global_step == 6
    assert trainer.state.best_model_checkpoint == "hf-run@4"
    assert repo.steps("hf-run") == [4]
    best_model = repo.load("hf-run", 4)["model"]
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, best_model[k]), k


def test_one_callback_per_trainer(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, save_steps=2, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    cb = LuopanCallback(repo, "one")
    transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8, 1), callbacks=[cb])
    with pytest.raises(luopan.UsageError, match="another Trainer"):
        transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8, 1), callbacks=[cb])


@pytest.mark.parametrize("kind", ["adapter-named-model", "modules_to_save", "trainable_tokens"])
def test_base_fingerprint_covers_every_base_tensor(kind):
    def wrap(m):
        if kind == "adapter-named-model":  # an adapter name equal to a key component of the base
            return peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="model")
        if kind == "modules_to_save":
            return peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
        return peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                      trainable_token_indices={"embed_tokens": [1, 2]}))

    base = tiny_llama()
    plain = luopan.torch.fingerprint(base)
    assert luopan.peft.base_fingerprint(wrap(base)) == plain
    other = tiny_llama()
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[0, 0] += 1  # one base weight differs
    assert luopan.peft.base_fingerprint(wrap(other)) != plain


def test_adapter_refused_on_another_base_and_exported_for_peft(tmp_path) -> None:
    repo = luopan.open(tmp_path / "repo")
    trainer, _ = make_trainer(tmp_path, repo, lora(tiny_llama()), max_steps=2)
    trainer.train()
    record = luopan.peft.peft_record(repo, "hf-run")
    assert record["base_fingerprint"] == luopan.peft.base_fingerprint(tiny_llama())

    other = lora(tiny_llama(seed=1))  # same names and shapes, other weights
    with pytest.raises(luopan.BaseMismatchError) as err:
        luopan.peft.load_adapter(repo, "hf-run", other)
    assert record["base_fingerprint"] in str(err.value)
    assert luopan.peft.base_fingerprint(other) in str(err.value)
    assert all(torch.count_nonzero(p) == 0 for n, p in other.named_parameters() if "lora_B" in n)  # untouched

    same = lora(tiny_llama())
    luopan.peft.load_adapter(repo, "hf-run", same)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    same.eval()
    with torch.no_grad():
        assert torch.equal(same(ids).logits, trainer.model(ids).logits)

    out = tmp_path / "adapter"
    info = luopan.peft.export_adapter(repo, "hf-run", out)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert info["base_fingerprint"] == record["base_fingerprint"]
    cli_out = tmp_path / "adapter-cli"
    from typer.testing import CliRunner

    from luopan.cli.main import app

    r = CliRunner().invoke(app, ["export", "-r", str(tmp_path / "repo"), "hf-run", "--adapter", "-o", str(cli_out)])
    assert r.exit_code == 0, r.output
    assert "fingerprint" in r.output and "blake3:" in r.output
    for d in (out, cli_out):
        loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(d))
        loaded.eval()
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, trainer.model(ids).logits)
    repo.save("plain", 1, {"model": {"w": torch.zeros(2)}})
    r = CliRunner().invoke(app, ["export", "-r", str(tmp_path / "repo"), "plain", "--adapter", "-o", str(cli_out)])
    assert r.exit_code == 4 and "not an adapter checkpoint" in r.output, r.output
    wrong = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                              task_type="CAUSAL_LM"))
    with pytest.raises(luopan.UsageError, match="target_modules"):  # same base, another config: not loaded partially
        luopan.peft.load_adapter(repo, "hf-run", wrong)


def test_base_fingerprint_is_the_plain_models_and_the_callback_needs_binding(tmp_path) -> None:
    base = tiny_llama()
    plain = luopan.torch.fingerprint(base)
    assert luopan.peft.base_fingerprint(lora(base)) == plain  # wrapping does not change the base's fingerprint
    repo = luopan.open(tmp_path / "repo")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, save_steps=2, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8, 1))
    late = LuopanCallback(repo)
    trainer.add_callback(late)
    with pytest.raises(luopan.UsageError, match="attach"):
        trainer.train()
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8, 1))
    LuopanCallback(repo).attach(trainer)
    trainer.train()
    assert repo.steps("o") == [2]  # run named after output_dir
    with pytest.raises(luopan.UsageError, match="not a PEFT model"):
        luopan.peft.save_adapter(repo, "x", 1, tiny_llama())


def test_readme_hf_example_runs_as_written(tmp_path, child_env) -> None:
    import re
    import subprocess
    import sys

    from .conftest import ROOT

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "LuopanCallback" in b]
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=child_env, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    with luopan.open(tmp_path / "ckpts") as repo:
        assert repo.steps("llama-lora") == [10, 20]
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not os.path.exists(tmp_path / "out" / "checkpoint-10")


def test_load_adapter_returns_the_adapter_weights_only(tmp_path) -> None:
    repo = luopan.open(tmp_path / "repo")
    trained = lora(tiny_llama())
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)
    luopan.peft.save_adapter(repo, "a", 1, trained, extra={"optimizer": {"lr": torch.tensor(0.1)}})
    fresh = lora(tiny_llama())
    got = luopan.peft.load_adapter(repo, "a", fresh)
    expected = peft.get_peft_model_state_dict(trained)
    assert set(got) == set(expected)  # PEFT's names, nothing of "peft" or "optimizer"
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_the_best_reference_survives_a_resume(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    scores = iter([9.0, 1.0, 2.0, 3.0])  # evals at 2, 4 (cut), then 6, 8 after the resume: the best stays step 2
    opts = dict(max_steps=8, eval_ds=Tokens(4, 2), eval_strategy="steps", eval_steps=2, metric_for_best_model="score",
                greater_is_better=True, load_best_model_at_end=True, save_total_limit=2)
    cut, _ = make_trainer(tmp_path, repo, tiny_llama(), callbacks=[StopAt(4)], **opts)
    cut.compute_metrics = lambda pred: {"score": next(scores)}
    cut.train()
    assert cut.state.best_model_checkpoint == "hf-run@2" and repo.steps("hf-run") == [2, 4]
    resumed, _ = make_trainer(tmp_path, repo, tiny_llama(), **opts)
    resumed.compute_metrics = lambda pred: {"score": next(scores)}
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.best_model_checkpoint == "hf-run@2"
    assert repo.steps("hf-run") == [2, 6, 8]  # the newest two and, across the resume, the best
    best_model = repo.load("hf-run", 2)["model"]
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, best_model[k]), k
