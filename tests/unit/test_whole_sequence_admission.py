"""vLLM's admission rule (``admission="whole"``, its scheduler_reserve_full_isl): a waiting request
gets in only when blocks for its whole sequence are free, though it takes just its chunk's. Ours
("chunk") admits it into its first chunk's blocks. The simulator predicts vLLM with vLLM's rule."""
from __future__ import annotations

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.scheduler import Scheduler
from kvtune_engine.request import Request, SamplingParams
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.simulator import simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_engine.sim.vllm_policy import ADMISSION, vllm_v1_config

CFG = EngineConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512,
                   enable_prefix_caching=False, watermark=0.0, swap_space=0.0)


def _req(i: int, prompt: int) -> Request:
    return Request(list(range(1, prompt + 1)), SamplingParams(max_tokens=4, ignore_eos=True), request_id=f"r{i}")


@pytest.mark.parametrize("admission,admitted", [("chunk", True), ("whole", False)])
def test_a_long_prompt_waits_for_its_whole_sequence_under_vllms_rule(admission, admitted):
    s = Scheduler(CFG, num_blocks=8, num_swap_blocks=0, admission=admission)   # 128 token slots
    s.add_request(_req(0, 60))
    assert len(s.schedule(0.0).seqs) == 1 and s.kv.num_free == 4               # r0 holds 4 blocks
    s.add_request(_req(1, 100))                                                 # 7 blocks, 4 free
    batch = s.schedule(0.1)                                                     # r1 with r0?
    assert [q.request.request_id for q in batch.seqs] == (["r0", "r1"] if admitted else ["r0"])
    if admitted:  # into its chunk's blocks, though its whole sequence (7) can never fit beside r0's 4
        assert s.kv.num_free < 4
    else:
        assert s.kv.num_free == 4 and [r.request_id for r in s.waiting] == ["r1"]


def test_unknown_admission_is_refused_with_the_rules():
    with pytest.raises(ValueError, match="chunk.*whole"):
        Scheduler(CFG, num_blocks=4, num_swap_blocks=0, admission="eager")


def test_vllms_rule_preempts_less_when_long_requests_crowd_a_small_cache():
    """Prompts of 300-900 tokens at a budget of 256 in a cache for ~4k tokens: admitted by their first
    chunk, requests crowd in and preempt each other in turn (thousands of recomputes); admitted whole,
    they wait instead (tens), and the same work is served sooner."""
    trace = [TraceRequest(0.05 * i, 300 + 97 * (i % 7), 150) for i in range(120)]
    cfg = vllm_v1_config(EngineConfig(block_size=16, max_num_batched_tokens=256, max_num_seqs=16,
                                      enable_prefix_caching=False, kv_cache_memory=0.5, max_model_len=2048))
    prof = load_profile("a100-llama3-8b")
    whole = simulate(trace, cfg, prof, admission=ADMISSION)
    chunk = simulate(trace, cfg, prof, admission="chunk")
    assert ADMISSION == "whole"
    assert 10 * whole["preemptions"]["recompute"] < chunk["preemptions"]["recompute"], (whole["preemptions"], chunk["preemptions"])
    assert whole["output_tokens"] == chunk["output_tokens"] == 120 * 150      # the same work, all of it
    assert whole["output_tokens_per_s"] > chunk["output_tokens_per_s"]
