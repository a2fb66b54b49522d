"""spec.runtime vllm: vLLM pods from the same knob table (vLLM's flags), every change a restart, and
admission rules for what vLLM refuses."""
from __future__ import annotations

import pytest
import yaml

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import VLLM_LACKS
from kvtune_operator import render as r
from kvtune_operator.crd import CRD_FILE
from kvtune_operator.model import InferenceDeployment
from kvtune_operator.render_vllm import DEFAULT_VLLM_IMAGE, parse_knobs
from tests.infd import infd_body

CHANGES = {"block_size": 32, "gpu_memory_utilization": 0.8, "swap_space": 8.0, "kv_cache_memory": 0.5,
           "max_model_len": 4096, "max_num_seqs": 160, "max_num_batched_tokens": 4096, "watermark": 0.02,
           "enable_prefix_caching": False, "enable_chunked_prefill": False}


def infd(**spec) -> InferenceDeployment:
    return InferenceDeployment.from_body(
        infd_body("qwen", namespace="llm", uid="uid-1", generation=1, **{"runtime": "vllm", **spec}))


def container(config: EngineConfig, **spec) -> dict:
    out = {c["kind"]: c for c in r.render_children(infd(**spec), config, image=DEFAULT_VLLM_IMAGE, pod_monitor=False)}
    return out["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_runtime_defaults_to_kvtune():
    body = infd_body("q", namespace="n", uid="u", model_path="/m")
    assert InferenceDeployment.from_body(body).spec.runtime == "kvtune"


def test_vllm_command_line_carries_every_knob_in_vllms_flags():
    cfg = EngineConfig(max_num_seqs=48, max_num_batched_tokens=1024, swap_space=4.0, enable_prefix_caching=False,
                       max_model_len=2048)
    c = container(cfg, engine={"maxModelLen": 2048}, extraArgs=["--dtype", "bfloat16"])
    assert c["command"] == ["vllm", "serve"] and c["image"] == DEFAULT_VLLM_IMAGE
    a = c["args"]
    assert a[:7] == ["/models/qwen", "--served-model-name", "qwen", "--host", "0.0.0.0", "--port", "8000"]
    assert a[a.index("--max-num-seqs") + 1] == "48" and a[a.index("--max-num-batched-tokens") + 1] == "1024"
    assert "--no-enable-prefix-caching" in a and "--enable-chunked-prefill" in a
    assert a[a.index("--kv-offloading-backend") + 1] == "native" and a[a.index("--kv-offloading-size") + 1] == "4"
    assert a[-2:] == ["--dtype", "bfloat16"]      # extraArgs last: they win
    assert "--config-file" not in a and "--admin-port" not in a  # no config file, one port for all
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    pod = r.render_children(infd(), cfg, image="i", pod_monitor=True)
    ann = next(x for x in pod if x["kind"] == "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == "8000"  # vLLM's /metrics is on its API port
    assert next(x for x in pod if x["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert parse_knobs(a) == {k: v for k, v in cfg.model_dump().items()
                              if k != "kv_cache_memory" and k not in VLLM_LACKS}  # vLLM has no flag for those


@pytest.mark.parametrize("runtime", ["vllm", "kvtune"])
def test_a_stopping_engine_pod_serves_on_then_drains_its_requests_within_the_grace_period(runtime):
    """A rollout stops the old pod while clients still send to it: it serves through a preStop sleep
    (the endpoints forget it meanwhile), then drains (vLLM's default --shutdown-timeout 0 aborts the
    requests in flight), all before the grace period's SIGKILL."""
    out = {c["kind"]: c for c in r.render_children(infd(runtime=runtime), EngineConfig(), image="i", pod_monitor=False)}
    pod = out["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = int(c["args"][c["args"].index("--shutdown-timeout") + 1])
    assert sleep >= 5 and drain >= 30 and sleep + drain < pod["terminationGracePeriodSeconds"]


def test_no_swap_means_no_offloading_and_unset_model_len_is_left_to_vllm():
    a = container(EngineConfig(swap_space=0.0))["args"]
    assert "--kv-offloading-size" not in a and "--kv-offloading-backend" not in a
    assert "--max-model-len" not in a


@pytest.mark.parametrize("knob", sorted(CHANGES))
def test_every_change_restarts_vllm_pods(knob):
    base = EngineConfig(max_num_batched_tokens=8192, max_model_len=8192)
    changed = base.with_changes(**{knob: CHANGES[knob]})
    ta = r.render_children(infd(), base, image="i", pod_monitor=False)[1]["spec"]["template"]
    tb = r.render_children(infd(), changed, image="i", pod_monitor=False)[1]["spec"]["template"]
    ha, hb = (t["metadata"]["annotations"][r.ANNOTATION_RESTART_HASH] for t in (ta, tb))
    assert ha != hb, knob                         # live knobs too: vLLM changes nothing while running


def test_crd_refuses_what_vllm_refuses_with_a_message():
    from pathlib import Path

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / CRD_FILE).read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["runtime"]["enum"] == ["kvtune", "vllm"]
    rules = {x["rule"]: x["message"] for x in spec["x-kubernetes-validations"]}
    rule = "self.runtime != 'vllm' || self.engine.maxNumBatchedTokens >= self.engine.maxNumSeqs"
    assert rule in rules and "vLLM refuses" in rules[rule]
