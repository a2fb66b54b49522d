"""What one operator costs per deployment, and how it grows with the fleet (issue 22).

For each fleet size (default 10, 50, 100 InferenceDeployments over 10 namespaces) this starts the
real control plane, a real Prometheus and the pod node (tests/controlplane), one operator in Apply
mode, and the fleet of the fleet test (tests/integration/test_operator_fleet.py: simulated engines of
three GPU profiles, one in five mis-tuned, each under its own mixed load). The autotune interval is
sized as the test sizes it: 1.5 times the time the operator takes for as many rounds as deployments
(at least 10 s). Then, over three intervals, it measures:

* the operator's CPU seconds (from /proc) and peak RSS (VmHWM) per deployment per tuning round;
* the lag between a deployment's due round and its start, p50/p99 (the operator's histogram
  kvtune_operator_tuning_round_lag_seconds, a bucket estimate);
* reconcile latency after a spec edit, p50/p99: autotune.cooldown edited on ten deployments, the time
  until status.observedGeneration reaches the new generation;
* apiserver requests per round (the apiserver's apiserver_request_total, every client: operator,
  pod node, controllers, this script's polls) and Prometheus queries per round (Prometheus' own
  prometheus_http_requests_total of /api/v1/query and /api/v1/query_range);
* whether every deployment was tuned within two intervals (its RoundsLate condition says when each
  of its rounds started), and the growth of each per-deployment figure from one size to the next.

    python bench/operator_scale.py [--sizes 10,50,100] [--json out.json]

Figures, the default sizes, one run (2 cores, AVX-512; one other process, a helper's small tests, at
times; 31 minutes in all):

      N  interval  rounds  CPU s/dep/round  peak RSS MiB/dep  lag p50  lag p99  reconcile p50  reconcile p99
     10       20s      24            0.377             16.16     0.9s     2.5s           0.5s           1.1s
     50       60s     146            0.446              4.05     1.3s     4.7s           1.7s           2.6s
    100      180s     286            0.692              2.74     3.8s    20.7s           6.5s          11.0s
        apiserver req/round  prom queries/round  all within 2 intervals
     10               227.0                1.00                    True
     50               272.3                0.99                    True
    100               404.4                1.00                    True
    growth 10 -> 50 (per-deployment ratio): CPU x1.18, peak RSS x0.25, apiserver req x1.20, prom queries x0.99
    growth 50 -> 100 (per-deployment ratio): CPU x1.55, peak RSS x0.68, apiserver req x1.49, prom queries x1.01

All Ready 6 s, 53 s and 91 s after the apply; the longest gap between one deployment's rounds was 22 s,
67 s and 205 s (two intervals: 40, 120, 360 s). The CPU per round grows with the fleet (x1.55 from 50
to 100): each round's refresh server-side-applies all six children of its deployment, and the kube
client's connection pool (10) is smaller than the handler threads, so requests queue; the sizing
cycle (100 rounds in 114 s on one process) is what sets the interval at 100.

CPU s/dep/round is the operator's CPU over the measured span (refreshes and reconciles included) per
round (a round is one deployment's); apiserver req/round counts every client, the pod node's polls
(4 a second, each listing pods and reading ConfigMaps) most of them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from kubernetes import client as k8s  # noqa: E402

from kvtune_engine import native  # noqa: E402
from kvtune_engine.quantile import bucket_quantile  # noqa: E402
from kvtune_operator.demo.engine import free_port  # noqa: E402
from kvtune_operator.demo.load import LoadGenerator  # noqa: E402
from tests.controlplane import ControlPlane, PodNode, Prometheus  # noqa: E402
from tests.controlplane.harness import RUN_ROOT  # noqa: E402
from tests.integration.e2e_load import served_rate  # noqa: E402
from tests.integration.test_operator_cluster import OperatorProcess, _make_namespace  # noqa: E402
from tests.integration.test_operator_fleet import (  # noqa: E402
    GROUP, INTERVAL_S, LABEL, LAG, PLURAL, POLL_S, ROUND_STARTED, ROUNDS_AT_ONCE, VERSION, VOCAB, WINDOW_S, body,
    condition, histogram, mis_tuned, ts, workload,
)

NAMESPACES = 10
EDITS = 10


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def buckets(h: dict[str, float]) -> list[tuple[float, float]]:
    return sorted((float(le), c) for le, c in h.items() if le != "_count")


def counter_sum(text: str, name: str, where: str = "") -> float:
    """The sum of a counter's series whose labels contain ``where``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and where in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class Probe:
    """The figures this bench reads: the operator's process, its /metrics, the apiserver's, Prometheus'."""

    def __init__(self, cp: ControlPlane, prom: Prometheus, op: OperatorProcess, metrics_port: int):
        self.cp, self.prom, self.op, self.metrics_port = cp, prom, op, metrics_port
        self.ssl = ssl.create_default_context(cafile=str(cp.ca_file))

    def operator_cpu_s(self) -> float:
        with open(f"/proc/{self.op.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def operator_peak_rss_mib(self) -> float:
        with open(f"/proc/{self.op.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    def lag(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return histogram(text, LAG)

    def apiserver_requests(self) -> float:
        req = urllib.request.Request(f"{self.cp.server}/metrics", headers={"Authorization": f"Bearer {self.cp.token}"})
        text = urllib.request.urlopen(req, timeout=20, context=self.ssl).read().decode()
        return counter_sum(text, "apiserver_request_total")

    def prometheus_queries(self) -> float:
        text = urllib.request.urlopen(f"{self.prom.url}/metrics", timeout=10).read().decode()
        return sum(counter_sum(text, "prometheus_http_requests_total", f'handler="{h}"')
                   for h in ("/api/v1/query", "/api/v1/query_range"))


def run_size(n: int, cp: ControlPlane, prom: Prometheus, node: PodNode, log_dir: Path) -> dict:
    per_ns = math.ceil(n / NAMESPACES)
    namespaces = [_make_namespace(cp, f"scale{n}") for _ in range(NAMESPACES)]
    fleet = [(ns, f"d{j}", i) for i, (ns, j) in enumerate((ns, j) for ns in namespaces for j in range(per_ns))][:n]
    api = k8s.CustomObjectsApi(cp.api_client())
    metrics_port = free_port()
    env = {**cp.subprocess_env(), "KVTUNE_PROMETHEUS_URL": prom.url, "KVTUNE_TUNE_POLL_INTERVAL": str(POLL_S),
           "KVTUNE_STATUS_INTERVAL": "5", "KVTUNE_TUNING_ROUNDS_AT_ONCE": str(ROUNDS_AT_ONCE),
           "KVTUNE_METRICS_PORT": str(metrics_port)}
    loads: list[LoadGenerator] = []
    node.namespaces = set(namespaces)
    op = OperatorProcess(env, namespaces, log_dir / f"operator-{n}.log").start()
    probe = Probe(cp, prom, op, metrics_port)

    def objects() -> dict[tuple[str, str], dict]:
        return {(ns, o["metadata"]["name"]): o for ns in namespaces
                for o in api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]}

    def url_of(ns: str, name: str):
        return lambda: next(iter(node.urls_for_selector(ns, {LABEL: name})), None)

    def wait(pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(1)
        raise RuntimeError(f"{n} deployments: timed out after {timeout:.0f}s waiting for {what}")

    try:
        t0 = time.time()
        cp.kubectl("apply", "-f", "-", input="---\n".join(yaml.safe_dump(body(ns, m, i, INTERVAL_S))
                                                         for ns, m, i in fleet), timeout=300)
        ns0, n0, _ = fleet[0]
        served = served_rate(url_of(ns0, n0), n0, requests=4, prompt_tokens=300, output_tokens=120, vocab=VOCAB)
        for ns, name, i in fleet:
            trace = workload(0 if mis_tuned(i) else i, 2 * served if mis_tuned(i) else 0.5, seed=i)
            load = LoadGenerator(url_of(ns, name), trace, vocab=VOCAB, model=name, seed=i, max_in_flight=16)
            load.start()
            loads.append(load)
        wait(lambda: sum(condition(o, "Ready").get("status") == "True" for o in objects().values()) == n,
             timeout=60 + 3 * n, what="every deployment Ready")
        ready_s = time.time() - t0
        log(f"{n}: all Ready {ready_s:.0f}s after the apply")

        start = time.time()
        before = probe.lag()["_count"]
        wait(lambda: probe.lag()["_count"] >= before + n, timeout=60 + 5 * n, what=f"{n} rounds")
        cycle = time.time() - start
        interval = max(INTERVAL_S, 10 * math.ceil(1.5 * cycle / 10))
        for ns, name, _ in fleet:
            api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"spec": {"autotune": {
                "interval": f"{interval}s", "window": f"{max(WINDOW_S, interval)}s"}}})
        log(f"{n}: {n} rounds took {cycle:.0f}s: interval {interval}s")
        time.sleep(interval)  # rounds due under the new interval from here on

        lag0, cpu0, api0, prom0 = probe.lag(), probe.operator_cpu_s(), probe.apiserver_requests(), \
            probe.prometheus_queries()
        begun = time.time()
        rounds: dict[tuple[str, str], set[float]] = {(ns, m): set() for ns, m, _ in fleet}
        edits = {k: None for k in list(rounds)[:: max(1, n // EDITS)][:EDITS]}
        edited_at: dict[tuple[str, str], tuple[float, int]] = {}
        latencies: list[float] = []
        while time.time() < begun + 3 * interval:
            now = time.time()
            for key, o in objects().items():
                m = ROUND_STARTED.search(condition(o, "RoundsLate").get("message", ""))
                if m:
                    rounds[key].add(ts(m.group(1)))
                if key in edited_at and (o.get("status") or {}).get("observedGeneration", 0) >= edited_at[key][1]:
                    latencies.append(now - edited_at.pop(key)[0])
            # one spec edit at a time, spread over the first interval
            if edits and now >= begun + len(latencies) * interval / EDITS and not edited_at:
                key = next(iter(edits))
                del edits[key]
                sent = time.time()
                out = api.patch_namespaced_custom_object(GROUP, VERSION, key[0], PLURAL, key[1], {
                    "spec": {"autotune": {"cooldown": f"{601 + len(latencies)}s"}}})
                edited_at[key] = (sent, out["metadata"]["generation"])
            time.sleep(0.5)
        ended = time.time()
        lag1 = probe.lag()
        cpu = probe.operator_cpu_s() - cpu0
        api_requests, prom_queries = probe.apiserver_requests() - api0, probe.prometheus_queries() - prom0
        late = {le: lag1[le] - lag0[le] for le in lag1}
        made = late["_count"]
        gaps = {}
        for key, starts in rounds.items():
            seen = sorted(t for t in starts if t >= begun - 1)
            gaps[key] = max(b - a for a, b in zip([begun, *seen], [*seen, ended]))
        worst = max(gaps.values())
        applied = sum(1 for o in objects().values() for h in ((o.get("status") or {}).get("tuning") or {})
                      .get("history") or [] if h["action"] == "Apply")
        return {
            "deployments": n, "interval_s": interval, "ready_s": round(ready_s, 1), "cycle_s": round(cycle, 1),
            "rounds": made, "cpu_s_per_deployment_round": cpu / made if made else math.nan,
            "peak_rss_mib_per_deployment": probe.operator_peak_rss_mib() / n,
            "peak_rss_mib": probe.operator_peak_rss_mib(),
            "lag_p50_s": bucket_quantile(buckets(late), 0.5), "lag_p99_s": bucket_quantile(buckets(late), 0.99),
            "reconcile_p50_s": statistics.median(latencies) if latencies else math.nan,
            "reconcile_p99_s": max(latencies) if latencies else math.nan, "edits": len(latencies),
            "apiserver_requests_per_round": api_requests / made if made else math.nan,
            "prometheus_queries_per_round": prom_queries / made if made else math.nan,
            "worst_gap_s": round(worst, 1), "tuned_within_two_intervals": worst <= 2 * interval + POLL_S + 1,
            "applied_changes": applied,
        }
    finally:
        for load in loads:
            load.stop()
        op.stop()
        for ns in namespaces:
            cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        node.namespaces = set()
        deadline = time.monotonic() + 120
        while [p for p in node.pods.values() if p.namespace in namespaces] and time.monotonic() < deadline:
            time.sleep(1)


COLUMNS = [("deployments", "N", "{:d}"), ("interval_s", "interval", "{:d}s"), ("rounds", "rounds", "{:.0f}"),
           ("cpu_s_per_deployment_round", "CPU s/dep/round", "{:.3f}"),
           ("peak_rss_mib_per_deployment", "peak RSS MiB/dep", "{:.2f}"),
           ("lag_p50_s", "lag p50", "{:.1f}s"), ("lag_p99_s", "lag p99", "{:.1f}s"),
           ("reconcile_p50_s", "reconcile p50", "{:.1f}s"), ("reconcile_p99_s", "reconcile p99", "{:.1f}s"),
           ("apiserver_requests_per_round", "apiserver req/round", "{:.1f}"),
           ("prometheus_queries_per_round", "prom queries/round", "{:.2f}"),
           ("tuned_within_two_intervals", "all within 2 intervals", "{}")]
GROWTH = ("cpu_s_per_deployment_round", "peak_rss_mib_per_deployment", "apiserver_requests_per_round",
          "prometheus_queries_per_round")


def table(results: list[dict]) -> str:
    rows = [[title for _, title, _ in COLUMNS]] + [[fmt.format(r[k]) for k, _, fmt in COLUMNS] for r in results]
    widths = [max(len(row[c]) for row in rows) for c in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    for a, b in zip(results, results[1:]):
        lines.append(f"growth {a['deployments']} -> {b['deployments']} (per-deployment ratio): " + ", ".join(
            f"{k} x{b[k] / a[k]:.2f}" for k in GROWTH if a[k]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,50,100", help="fleet sizes, comma-separated [10,50,100]")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cp, prom = ControlPlane(gpu_nodes=3), Prometheus()
    run_dir = Path(tempfile.mkdtemp(prefix="scale-node-", dir=RUN_ROOT))
    results = []
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        deadline = time.monotonic() + 60
        while cp.kubectl("get", "infd", "-A", check=False).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.5)  # the CRD established and discovered
        prom.start()
        node = PodNode(cp.kubeconfig, run_dir, sd_file=prom.sd_file, extra_env={"KVTUNE_EXT_DIR": str(native.ext_dir())})
        node.namespaces = set()
        node.start()
        try:
            for n in sizes:
                results.append(run_size(n, cp, prom, node, run_dir))
                log(json.dumps(results[-1]))
                print(table(results), flush=True)
        finally:
            node.stop()
    finally:
        prom.stop()
        cp.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
