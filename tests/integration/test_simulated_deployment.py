"""spec.simulate in the real control plane (issue 22): a simulated engine becomes Ready and serves.

The pod node runs the rendered container command (``kvtune serve --simulate PROFILE ...``) as a local
process, so this is the operator's pod as a cluster would run it, minus the image: no model, no
weights volume, a GPU profile's memory picture and step costs. The apiserver refuses what the model
refuses (runtime vllm with simulate, an unknown profile, naming the allowed ones).
"""
from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from kvtune_engine.sim.profiles import PROFILES
from tests.infd import infd_body

from .test_operator_cluster import (  # noqa: F401 - crd is a fixture
    OperatorProcess, _make_namespace, admin_key, condition, crd, get,
)
from .waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.wallclock]

LABEL = "kvtune.io/inference-deployment"


def simulated_yaml(name: str, profile: str, **spec) -> str:
    body = infd_body(name, simulate=profile, resources={"gpus": 0}, **spec)
    del body["spec"]["model"]  # a simulated engine needs none
    return yaml.safe_dump(body)


@pytest.mark.parametrize("spec,words", [
    ({"simulate": "h100-gpt5"}, ["spec.simulate", "Unsupported value", *(f'"{p}"' for p in sorted(PROFILES))]),
    ({"simulate": "cpu-tiny", "runtime": "vllm"}, ["spec.simulate", "runtime vllm has no such mode"]),
    ({}, ["spec.model is required", "unless spec.simulate"]),
])
def test_the_apiserver_refuses_bad_simulate_specs(controlplane, crd, spec, words):
    body = infd_body("bad", **spec)
    del body["spec"]["model"]
    res = controlplane.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-",
                               input=yaml.safe_dump(body), check=False)
    assert res.returncode != 0, f"accepted: {spec}"
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def test_a_simulated_deployment_becomes_ready_and_serves_through_its_service(controlplane, crd, pod_node,
                                                                             tmp_path_factory):
    ns = _make_namespace(controlplane, "sim")
    op = OperatorProcess(controlplane.subprocess_env(), [ns], tmp_path_factory.mktemp("operator-sim") / "operator.log")
    op.start()
    try:
        with pod_node.restricted_to(ns):
            controlplane.kubectl("apply", "-n", ns, "-f", "-", input=simulated_yaml(
                "h200", "h200-qwen3-0.6b", engine={"maxNumSeqs": 32}))

            def ready():
                for p in (p for p in pod_node.pods.values() if p.namespace == ns):
                    assert p.returncode is None, f"engine exited {p.returncode}:\n{p.log_path.read_text()[-3000:]}"
                obj = get(controlplane, "infd", "h200", ns)
                st = obj.get("status") or {}
                return obj if condition(obj, "Ready").get("status") == "True" and st.get("replicaSummary") == "1/1" \
                    else None
            try:
                obj = eventually(ready, timeout=180, interval=1, what="the simulated deployment Ready 1/1")
            except AssertionError:
                raise AssertionError(f"never Ready; operator log:\n{op.tail()}") from None
            assert obj["status"]["engine"]["maxNumSeqs"] == 32

            urls = pod_node.urls_for_service(ns, "h200")  # what the Service routes to: its Ready pods
            assert len(urls) == 1
            client = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="unused", timeout=30)
            assert [m.id for m in client.models.list().data] == ["h200"]
            out = client.completions.create(model="h200", prompt="hello fleet", max_tokens=12)
            assert out.usage.completion_tokens == 12 and out.choices[0].text  # lengths honoured exactly
            chunks = list(client.completions.create(model="h200", prompt="again", max_tokens=5, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices)

            # the engine runs the profile, not a model: its state says so, and its blocks are the H200's
            local = pod_node.wait_for_selector(ns, {LABEL: "h200"}, count=1)[0]
            state = httpx.get(f"{local.admin_url}/kvtune/v1/state", timeout=10,
                              headers={"Authorization": f"Bearer {admin_key(controlplane, ns, 'h200')}"}).json()
            assert state["simulated"] == "h200-qwen3-0.6b"
            pod = get(controlplane, "pod", local.name, ns)
            assert "model" not in [v["name"] for v in pod["spec"]["volumes"]]
    finally:
        op.stop()
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
