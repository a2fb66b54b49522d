"""CUDA only (marker `cuda`: deselected without a GPU): the compiled Triton decode kernel and the CUDA runner.

The Triton kernel against the PyTorch reference on the GPU for block sizes 8..128 and GQA; a CUDA
runner (Triton decode, profiled memory, pinned swap pool) against the CPU runner on the same tiny
model: identical greedy tokens, logprobs within 1e-3 (TF32-free float32, different kernels).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.runner import ModelRunner

# Deselected by `make test` on machines without a GPU (-m "not cuda"); `make test-gpu` runs them.
pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128])
def test_compiled_triton_decode_matches_reference(bs):
    from test_attention import make_cache

    from kvtune_engine.attention.reference import paged_decode_reference
    from kvtune_engine.attention.triton_decode import paged_decode_triton
    lens = [1, bs - 1, bs, 3 * bs + 5, 300]
    kc, vc, bt, _ = make_cache(lens, 2, 128, bs, seed=bs)
    q = torch.randn(len(lens), 8, 128)
    ref = paged_decode_reference(q, kc, vc, bt, lens, 1 / math.sqrt(128))
    dev = [t.cuda() for t in (q, kc, vc, bt)]
    out = paged_decode_triton(*dev, torch.tensor(lens, device="cuda"), 1 / math.sqrt(128))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=0)


def test_cuda_runner_matches_cpu_runner(tiny_model, drive):
    torch.backends.cuda.matmul.allow_tf32 = False
    d = tiny_model("qwen3")
    cfg = EngineConfig(block_size=16, swap_space=0.01, max_model_len=256, max_num_batched_tokens=64,
                       gpu_memory_utilization=0.05)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 40, 100)]

    def run(device, **kw):
        c = cfg.with_changes(kv_cache_memory=0.002) if device == "cpu" else cfg
        runner = ModelRunner(d, c, device=device, seed=0, **kw)
        reqs = [Request(p, SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)) for p in prompts]
        sched, lps = drive(runner, c, reqs)
        return runner, [r.output_token_ids for r in reqs], [[x.logprob for x in v] for v in lps.values()]

    cuda_runner, tok_gpu, lp_gpu = run("cuda")
    assert cuda_runner.model.decode_fn is not None  # Triton decode in use
    m = cuda_runner.memory
    assert m["activations_peak"] > 0 and m["weights"] > 0 and m["kv_cache"] > 0 and m["swap"] > 0
    assert cuda_runner.swap_k.is_pinned()
    _, tok_cpu, lp_cpu = run("cpu")
    assert tok_gpu == tok_cpu
    torch.testing.assert_close(torch.tensor(sum(lp_gpu, [])), torch.tensor(sum(lp_cpu, [])), atol=1e-3, rtol=0)
