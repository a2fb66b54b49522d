"""tuner/vllm_drift: vLLM's cache_config_info against the operator's picture of the engine, and the
EngineDrift condition it becomes (with its Warning event when it turns True)."""
from __future__ import annotations

from kvtune_engine.config import EngineConfig
from kvtune_operator import conditions as c
from kvtune_operator.tuner import vllm_drift
from kvtune_operator.tuner.vllm_drift import drift

#: vLLM 0.32's own labels on a CPU server (the subset drift reads), as its /metrics gives them
INFO = {"block_size": "128", "gpu_memory_utilization": "0.92", "enable_prefix_caching": "True",
        "kv_cache_memory_bytes": "1073741824", "num_gpu_blocks": "8192", "kv_cache_size_tokens": "1048576",
        "kv_cache_max_concurrency": "512.0", "pod": "chat-0"}
CFG = EngineConfig(block_size=128, gpu_memory_utilization=0.92, enable_prefix_caching=True, kv_cache_memory=1.0,
                   max_model_len=2048)


def test_the_module_invariant_holds():
    vllm_drift.check()


def test_each_disagreement_is_said_with_both_figures():
    found = drift([INFO], CFG.with_changes(gpu_memory_utilization=0.5, enable_prefix_caching=False,
                                           kv_cache_memory=2.0))
    assert len(found) == 1 and found[0].startswith("chat-0: vLLM reports ")
    for said in ("gpu_memory_utilization 0.92, the command line 0.5", "enable_prefix_caching True, the command "
                 "line False", "a KV cache of 1 GiB, the command line 2 GiB"):
        assert said in found[0]
    inconsistent = {**INFO, "kv_cache_size_tokens": "500000"}
    assert "500000 KV tokens, but 8192 blocks of 128 hold 1048576" in drift([inconsistent], CFG)[0]
    # one finding per engine that disagrees, none for one that agrees
    assert len(drift([INFO, {**INFO, "pod": "chat-1", "block_size": "16"}], CFG)) == 1


def test_absent_or_unreadable_labels_are_no_finding():
    assert drift([{"pod": "chat-0"}], CFG) == []
    assert drift([{**INFO, "kv_cache_max_concurrency": "nan", "num_gpu_blocks": "None"}], CFG) == []


def test_the_condition_and_its_event():
    on = c.engine_drift(["chat-0: vLLM reports block_size 128, the command line 16"])
    assert (on.type, on.status, on.reason) == ("EngineDrift", "True", "CacheConfigDiffers")
    assert "block_size 128" in on.message and "predictions assume the command line's values" in on.message
    off = c.engine_drift([])
    assert (off.status, off.reason) == ("False", "CacheConfigMatches")
    new = {"type": on.type, "status": on.status, "reason": on.reason, "message": on.message}
    assert c.transition_event({"status": "False", "reason": off.reason}, new) == ("Warning", on.reason, on.message)
    assert c.transition_event(new, new) is None                       # told once, not every round
