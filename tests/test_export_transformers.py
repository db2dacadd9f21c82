"""An exported checkpoint loads in a tiny transformers model built from a config (no downloads)."""

import os

import pytest
import torch

import luopan

transformers = pytest.importorskip("transformers", reason="transformers is a dev extra (pip install -e '.[dev]')")


def test_export_loads_in_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    repo = luopan.open(tmp_path / "repo")
    opt = torch.optim.AdamW(model.parameters())
    repo.save("ft", 1, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
    m = repo.manifest("ft")
    assert any("alias_of" in e for e in m.entries)  # tied embeddings stored once
    out = tmp_path / "export"
    out.mkdir()
    cfg.save_pretrained(out)
    info = repo.export("ft", out / "model.safetensors", subtree="model")
    assert info["tensors"] == len(model.state_dict())
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
