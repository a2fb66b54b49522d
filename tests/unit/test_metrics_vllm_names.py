"""Our engine's vllm: series against a real vLLM 0.32's /metrics text (tests/vllm/reference): a dashboard,
an autoscaler or the inference gateway's endpoint picker reading vLLM's names finds the same name,
type and label names on our engine."""
from __future__ import annotations


import pytest
from conftest_engine import build_engine, tiny_llama  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families
from tests.vllm.capture_metrics import REFERENCE_METRICS

REFERENCE = REFERENCE_METRICS  # captured from the real vLLM the tests run (tests/vllm/capture_metrics.py)

#: the vLLM series whose concepts our engine shares (issue 9); each must be exported
SHARED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
          "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:num_preemptions",
          "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:prompt_tokens_cached",
          "vllm:generation_tokens", "vllm:request_success", "vllm:admission_rejections",
          "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
          "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
          "vllm:request_generation_tokens", "vllm:iteration_tokens_total")


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """family -> (type, label names of its samples, without le)."""
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name.startswith("vllm:"):
            labels = {k for s in f.samples for k in s.labels if k != "le"}
            out[f.name] = (f.type, labels)
    return out


def test_reference_file_is_real_vllm():
    assert REFERENCE.exists(), f"missing {REFERENCE}"
    ref = families(REFERENCE.read_text())
    assert "vllm:cache_config_info" in ref and len(ref) > 30


def test_every_vllm_series_matches_the_reference(tiny_llama):  # noqa: F811
    ref = families(REFERENCE.read_text())
    eng = build_engine(tiny_llama)
    ours = families(eng.metrics.render().decode())
    for name in SHARED:
        assert name in ref, f"{name} is not in vLLM 0.32's /metrics"
        assert name in ours, f"our engine does not export {name}"
    for name, (typ, labels) in ours.items():
        assert name in ref, f"we export {name}, which vLLM 0.32 does not have"
        rtyp, rlabels = ref[name]
        assert typ == rtyp, (name, typ, rtyp)
        if name == "vllm:cache_config_info":  # a subset of vLLM's many config labels
            assert labels <= rlabels, (name, labels - rlabels)
        else:
            assert labels == rlabels, (name, labels, rlabels)


@pytest.mark.parametrize("label", ["block_size", "num_gpu_blocks", "enable_prefix_caching",
                                   "gpu_memory_utilization"])
def test_cache_config_info_values_read_like_vllms(tiny_llama, label):  # noqa: F811
    """The endpoint picker parses block_size and num_gpu_blocks as integers; booleans are Python's."""
    ref = [s for f in text_string_to_metric_families(REFERENCE.read_text()) if f.name == "vllm:cache_config_info"
           for s in f.samples][0].labels
    eng = build_engine(tiny_llama)
    ours = [s for f in text_string_to_metric_families(eng.metrics.render().decode())
            if f.name == "vllm:cache_config_info" for s in f.samples][0].labels
    if label in ("block_size", "num_gpu_blocks"):
        assert int(ours[label]) > 0 and int(ref[label]) > 0
        if label == "num_gpu_blocks":
            assert int(ours[label]) == eng.num_blocks
    elif label == "enable_prefix_caching":
        assert ours[label] in ("True", "False") and ref[label] in ("True", "False")
    else:
        assert 0 < float(ours[label]) <= 1 and 0 < float(ref[label]) <= 1


def test_waiting_by_reason_sums_to_waiting(tiny_llama):  # noqa: F811
    from kvtune_engine.core.request import SamplingParams

    eng = build_engine(tiny_llama, max_num_seqs=1)
    for i in range(4):
        eng.add_request(f"request number {i}", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.step()
    fams = {f.name: f for f in text_string_to_metric_families(eng.metrics.render().decode())}
    waiting = [s.value for s in fams["vllm:num_requests_waiting"].samples][0]
    by = {s.labels["reason"]: s.value for s in fams["vllm:num_requests_waiting_by_reason"].samples}
    assert waiting == 3 and by == {"capacity": 3.0, "deferred": 0.0}
