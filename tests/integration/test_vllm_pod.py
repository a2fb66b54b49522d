"""A real vLLM pod tuned by the operator (issue 9): an InferenceDeployment with ``runtime: vllm``.

The pod node runs the pod's own command line (``vllm serve ...`` as the operator rendered it, every
knob a vLLM flag) with the real vLLM of ``tests/vllm/setup.sh``; Prometheus scrapes its /metrics
like any engine pod's; the operator (a subprocess, Recommend mode) reads vLLM's series from
Prometheus. Under a load bound by ``maxNumSeqs 2`` with the KV cache almost empty, it names the
sequence cap and recommends a higher maxNumSeqs, predicted on a trace synthesized from vLLM's
histograms (said so in status), and changes nothing (Recommend). Switched to Apply, under the same
load, it makes the change: the Deployment rolls, a new vLLM process serves with the higher cap while
the old one serves until it is ready (no request fails), and the change is verified on the new pod's
window and kept. A missing vLLM fails the test.

Time (~2.5 min on two cores): two vLLM start-ups (~30 s each without torch.compile,
``TEST_ARGS``), a Recommend window, the rollout with the old pod's preStop and drain, then a whole
window of the new pod alone before the verdict.
"""
from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.infd import infd_body
from tests.vllm.server import TEST_ARGS, TEST_ENV, vllm_bin

from .e2e_load import OpenLoopLoad, served_rate
from .test_operator_cluster import OperatorProcess, _make_namespace, crd, eventually, get  # noqa: F401
from .test_tuner_e2e import LABEL, first_apply, history, start_engine, url_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow, pytest.mark.alone]
VOCAB = 512


@pytest.fixture(scope="module")
def vllm_model():
    vllm_bin()  # FAILS (never skips) with "install it with: bash tests/vllm/setup.sh"
    root = Path(tempfile.mkdtemp(prefix="kvtune-vllm-pod-", dir="/var/tmp"))
    path = root / "tiny-hd32"
    subprocess.run([str(Path(sys.executable).with_name("kvtune")), "make-tiny-model", str(path), "--head-dim", "32",
                    "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", str(VOCAB)],
                   check=True, capture_output=True, timeout=300)
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def vllm_ns(controlplane, crd, pod_node):  # noqa: F811
    ns = _make_namespace(controlplane, "vllm")
    saved = dict(pod_node.command_map)
    pod_node.command_map["vllm"] = [str(vllm_bin())]  # the image's `vllm` is this venv's
    with pod_node.restricted_to(ns):
        yield ns
        controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        eventually(lambda: not [p for p in pod_node.pods.values() if p.namespace == ns], timeout=60,
                   what="the vLLM processes to stop")
    pod_node.command_map.clear()
    pod_node.command_map.update(saved)


@pytest.fixture
def vllm_run(controlplane, prometheus, vllm_ns, tmp_path):
    """(operator, cache dir): the operator watching the namespace, and vLLM's caches for the pods'
    env -- short and outside the pod's /tmp (an emptyDir the pod node maps to a long local path):
    vLLM's ZMQ socket paths must stay under 107 characters."""
    cache = Path(tempfile.mkdtemp(prefix="kvv-", dir="/var/tmp"))
    (cache / "tmp").mkdir(parents=True)
    env = {**controlplane.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prometheus.url, "KVTUNE_TUNE_POLL_INTERVAL": "1"}
    op = OperatorProcess(env, [vllm_ns], tmp_path / "operator.log").start()
    try:
        yield op, cache
    finally:
        op.stop()
        sys.stderr.write(f"\n[operator log tail]\n{op.tail(30)}\n")
        shutil.rmtree(cache, ignore_errors=True)


def infd(name: str, model: Path, cache: Path, mode: str = "Recommend", replicas: int = 1, ttft: str = "1s") -> str:
    # TEST_ENV leaves the threads unbound, which a rolling update needs here: it runs two vLLM pods on
    # this node's two cores; bound ("0-1"), each worker's main thread sits on core 0 from its first
    # import on, and the new pod's start-up, next to the old worker, got 0.6 s of CPU in 300 s
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "HF_HOME": str(cache / "hf"), "TMPDIR": str(cache / "tmp"),
           "VLLM_RPC_BASE_PATH": str(cache / "tmp"), **TEST_ENV}
    return yaml.safe_dump(infd_body(
        name, runtime="vllm", replicas=replicas,
        model={"path": str(model), "servedModelName": "tiny"},
        resources={"gpus": 0},
        engine={"maxNumSeqs": 2, "maxNumBatchedTokens": 1024, "maxModelLen": 1024, "blockSize": 128,
                "kvCacheMemoryGiB": 1, "swapSpaceGiB": 0, "enablePrefixCaching": False},
        autotune={"mode": mode, "interval": "8s", "window": "20s", "cooldown": "10m",
                  "objectives": {"ttftP95": ttft},
                  "bounds": {"blockSize": [128], "maxNumSeqs": {"min": 1, "max": 64}}},
        env=[{"name": k, "value": v} for k, v in env.items()],
        extraArgs=["--dtype", "float32", *TEST_ARGS]))


def test_operator_recommends_then_applies_and_keeps_more_sequences_on_a_real_vllm_pod(
        controlplane, pod_node, vllm_ns, vllm_model, vllm_run):
    # one vLLM pod for both modes (each vLLM start costs half a minute or more on two cores)
    ns, name = vllm_ns, "vllm-seqcap"
    op, cache = vllm_run
    t0 = time.monotonic()
    controlplane.kubectl("apply", "-n", ns, "-f", "-", input=infd(name, vllm_model, cache))
    old = start_engine(controlplane, pod_node, ns, name, timeout=420)
    sys.stderr.write(f"vLLM pod serving after {time.monotonic() - t0:.0f}s: {' '.join(old.argv[:4])} ...\n")
    assert Path(old.argv[0]) == vllm_bin() and old.argv[1] == "serve"
    argv = old.argv
    assert argv[argv.index("--max-num-seqs") + 1] == "2" and "--no-enable-prefix-caching" in argv
    # twice what two sequences serve of 32 + 32 tokens, measured on this pod (a constant 10 requests/s
    # queued on one machine and was served without a queue on a faster one). At most 32 in flight:
    # the backlog built while the new pod of the Apply starts (a minute or two) reaches it at once,
    # and 128 of them would take its first window to drain
    rate = 2 * served_rate(url_of(pod_node, ns, name), "tiny", requests=8, prompt_tokens=32, output_tokens=32,
                           vocab=VOCAB)
    sys.stderr.write(f"two sequences serve {rate / 2:.1f} requests/s; the load sends {rate:.1f}\n")
    load = OpenLoopLoad(url_of(pod_node, ns, name), "tiny", rate=rate, prompt_tokens=32, output_tokens=32,
                        vocab=VOCAB, max_requests=int(rate * 600) + 1, max_seconds=600, max_in_flight=32, seed=5)
    with load:
        # 1. Recommend: the cause and a higher maxNumSeqs in status, nothing changed
        obj = wait_for(controlplane, ns, name,
                       lambda o: ((o.get("status") or {}).get("tuning") or {}).get("phase") == "Recommended",
                       timeout=240, what="a recommendation", operator=op)
        st = obj["status"]
        rec = st["tuning"]["lastChange"]
        sys.stderr.write(f"recommendation after {time.monotonic() - t0:.0f}s: {rec}\n")
        assert rec["action"] == "Recommend" and rec["cause"] == "SequenceCap", rec
        assert rec["before"]["maxNumSeqs"] == 2 and rec["after"]["maxNumSeqs"] > 2
        assert rec["restart"] is True                      # vLLM changes no knob live
        assert st["diagnosis"]["cause"] == "SequenceCap"
        assert st["tuning"]["traceSource"] == "synthesized"
        metrics = next(c for c in st["conditions"] if c["type"] == "MetricsAvailable")
        assert metrics["status"] == "True" and "synthesized from vLLM's histograms" in metrics["message"]
        # vLLM's own cache_config_info agrees with the knobs the operator put on its command line
        drift = next(c for c in st["conditions"] if c["type"] == "EngineDrift")
        assert (drift["status"], drift["reason"]) == ("False", "CacheConfigMatches"), drift
        assert load.stats.ok > 0
        dep = get(controlplane, "deployment", name, ns)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "2"
        assert pod_node.get(ns, old.name).returncode is None  # the same vLLM process

        # 2. Apply: the change rolls out, the old pod serves until the new one is ready
        controlplane.kubectl("patch", "infd", name, "-n", ns, "--type", "merge",
                             "-p", '{"spec": {"autotune": {"mode": "Apply"}}}')
        obj, apply = first_apply(controlplane, ns, name, timeout=240, operator=op)
        sys.stderr.write(f"applied after {time.monotonic() - t0:.0f}s: {apply}\n")
        assert apply["cause"] == "SequenceCap" and apply["restart"] is True
        assert apply["before"]["maxNumSeqs"] == 2 and apply["after"]["maxNumSeqs"] > 2
        cap = apply["after"]["maxNumSeqs"]
        assert f"Changing maxNumSeqs 2 -> {cap}: predicted goodput" in apply["message"], apply["message"]

        def new_vllm():
            pods = [p for p in pod_node.pods_for_selector(ns, {LABEL: name}) if p.name != old.name]
            if pods and pods[0].argv[pods[0].argv.index("--max-num-seqs") + 1] == str(cap):
                return pods[0]
            return None
        new = eventually(new_vllm, timeout=120, interval=1, what=f"a vLLM pod started with --max-num-seqs {cap}")
        try:
            eventually(lambda: httpx.get(f"{new.url}/health", timeout=2).status_code == 200, timeout=420,
                       interval=1, what="the new vLLM pod to be healthy (40-140 s of start-up on two cores)")
        except AssertionError as e:
            raise AssertionError(f"{e}\n[new pod's log tail]\n{pod_node.logs(ns, new.name)[-4000:]}") from None
        healthy_at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        sys.stderr.write(f"new vLLM pod {new.name} serving after {time.monotonic() - t0:.0f}s\n")
        eventually(lambda: pod_node.get(ns, old.name) is None, timeout=120, what="the old vLLM pod to go")
        obj = wait_for(controlplane, ns, name,
                       lambda o: any(h["action"] in ("Keep", "RollBack") for h in history(o)),
                       timeout=240, what="the verdict on the new pod's window", operator=op)
    verdict = next(h for h in history(obj) if h["action"] in ("Keep", "RollBack"))
    sys.stderr.write(f"verdict after {time.monotonic() - t0:.0f}s: {verdict}\nload: {load.stats}\n")
    assert verdict["action"] == "Keep", verdict
    # judged on the new pod's own window, not on the old pod's while the new one started
    assert dt.datetime.fromisoformat(verdict["time"].replace("Z", "+00:00")) >= healthy_at, (verdict, healthy_at)
    assert obj["status"]["engine"]["maxNumSeqs"] == cap
    dep = get(controlplane, "deployment", name, ns)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == str(cap)
    assert load.stats.ok > 0 and load.stats.failed == 0, load.stats.errors  # the old pod served until the new one was ready
