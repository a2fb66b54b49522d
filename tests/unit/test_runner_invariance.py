"""Outputs must not depend on how the scheduler cuts the work: prefix-cache hits, chunked prefill,
preemption with recompute, and swap out/in all give the tokens (and logprobs) of a plain run.

Each run drives the real scheduler over the real runner (tiny Llama and Qwen3, float32). Greedy
tokens must be identical; logprobs of the sampled tokens within 1e-4 (the same math, summed in a
different order: SDPA for prefill chunks, the batched decode path for single tokens). A seeded
temperature-sampled request must also reproduce exactly: its noise comes from its own generator.
Each test also checks that the event it is about really happened (hits, chunks, preemptions).
"""
from __future__ import annotations

import pytest
import torch

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.runner import ModelRunner

LOGPROB_ATOL = 1e-4
BS = 16
MAX_TOKENS = 12


def config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(block_size=BS, kv_cache_memory=0.002, swap_space=0.0, max_model_len=256,
                                  max_num_batched_tokens=256, max_num_seqs=16, enable_prefix_caching=False,
                                  watermark=0.0), **kw})


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Six prompts (5..90 tokens), three sharing a 48-token prefix; one seeded sampled request."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 500, (3 * BS,), generator=g).tolist()
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 37, 90)]
    prompts += [shared + torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 20, 41)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True) for _ in prompts]
    params[4] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234, logprobs=2,
                               ignore_eos=True)
    return list(zip(prompts, params))


def requests(wl):
    return [Request(list(p), SamplingParams(**vars(sp))) for p, sp in wl]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_model, drive):
    """(model dir, workload, reference outputs, reference logprobs) from a plain run: everything
    fits, no chunking, no prefix caching."""
    d = tiny_model(request.param)
    wl = workload()
    cfg = config()
    sched, lps = drive(ModelRunner(d, cfg, seed=0), cfg, requests(wl))
    assert not any(sched.stats.preemptions.values())
    return d, wl, sched_finished(lps)


def sched_finished(lps):
    return [(rid, [x.token_id for x in v], [x.logprob for x in v]) for rid, v in lps.items()]


def check_same(ref, got):
    assert len(ref) == len(got)
    for (_, want_ids, want_lp), (_, ids, lp) in zip(ref, got):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(want_lp), atol=LOGPROB_ATOL, rtol=0)


def test_prefix_cache_hits(setup, drive):
    d, wl, ref = setup
    cfg = config(enable_prefix_caching=True)
    reqs = requests(wl)
    # the first sharer goes first; the other two arrive once its prompt blocks are committed
    sched, lps = drive(ModelRunner(d, cfg, seed=0), cfg, {0: reqs[:4], 3: reqs[4:]})
    assert sched.stats.prefix_hit_tokens >= 2 * 3 * BS
    assert [r.num_cached_tokens for r in reqs[4:]] == [3 * BS, 3 * BS]
    check_same(ref, sched_finished(lps))


def test_chunked_prefill(setup, drive):
    d, wl, ref = setup
    cfg = config(max_num_batched_tokens=BS, enable_chunked_prefill=True)
    runner = ModelRunner(d, cfg, seed=0)
    chunks = []
    orig = runner.execute

    def spy(batch):
        chunks.extend(s.num_tokens for s in batch.seqs if 1 < s.num_tokens and s.start_pos > 0)
        return orig(batch)

    runner.execute = spy
    _, lps = drive(runner, cfg, requests(wl))
    assert len(chunks) >= 5  # later chunks read their own earlier chunks back from the cache
    check_same(ref, sched_finished(lps))


def test_preemption_with_recompute(setup, drive):
    d, wl, ref = setup
    cfg = config()
    sched, lps = drive(ModelRunner(d, cfg, seed=0, num_blocks=10, num_swap_blocks=0), cfg, requests(wl))
    assert sched.stats.preemptions["recompute"] > 0 and sched.stats.preemptions["swap"] == 0
    check_same(ref, sched_finished(lps))


def test_swap_out_and_in(setup, drive):
    d, wl, ref = setup
    cfg = config(swap_space=0.001)
    sched, lps = drive(ModelRunner(d, cfg, seed=0, num_blocks=10, num_swap_blocks=64), cfg, requests(wl))
    assert sched.stats.preemptions["swap"] > 0
    check_same(ref, sched_finished(lps))
