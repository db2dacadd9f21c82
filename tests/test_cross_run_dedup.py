"""Many runs that start from one base model share its chunks: 20 short experiments cost about one base plus 20 times
their changed bytes (content addressing across runs; issue 3's cross-run dedup, checked at the foundation level)."""

import torch

import luopan


def test_twenty_experiments_on_one_base(tmp_path):
    repo = luopan.open(tmp_path / "r", chunk_size=64 * 1024)
    g = torch.Generator().manual_seed(0)
    base = {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(8)}  # 8 MiB frozen base
    base_bytes = sum(t.numel() * 4 for t in base.values())
    adapter_bytes = 0
    for run in range(20):
        adapter = {"lora_a": torch.randn(16, 512, generator=g), "lora_b": torch.zeros(512, 16)}
        adapter_bytes = sum(t.numel() * 4 for t in adapter.values())
        info = repo.save(f"exp-{run:02d}", 100, {"base": base, "adapter": adapter})
        assert info.logical_bytes == base_bytes + adapter_bytes
        if run:  # every run after the first writes only its adapter (lora_b zeros dedup too after run 0)
            assert info.new_bytes <= adapter_bytes
    du = repo.du()
    assert du["checkpoints"] == 20
    assert du["pack_bytes"] <= 1.02 * (base_bytes + 20 * adapter_bytes)
    assert du["logical_bytes"] == 20 * (base_bytes + adapter_bytes)
    assert repo.verify().ok
