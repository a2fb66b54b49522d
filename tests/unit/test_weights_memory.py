"""The weights figure the KV cache is sized around counts every weight byte, packed or not."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from kvtune_engine.model import load_model
from kvtune_engine.runner.model_runner import weights_bytes


def test_weights_bytes_count_the_checkpoint_whether_matmul_weights_are_packed_or_not(tiny_model, monkeypatch):
    d = tiny_model("llama")
    on_disk = sum(t.numel() * t.element_size() for f in d.glob("*.safetensors") for t in load_file(f).values())
    packed = load_model(d, dtype=torch.float32)
    monkeypatch.setenv("KVTUNE_CPU_GEMM", "torch")
    plain = load_model(d, dtype=torch.float32)
    assert weights_bytes(plain) == on_disk
    assert weights_bytes(packed) == on_disk
