"""Two operator replicas on one fleet (issue 22, part B), against the real control plane.

Both replicas watch the same namespaces and share the InferenceDeployments through the shard Leases
(coordination.k8s.io/v1) in their own namespace. What a user checks: the Leases say which replica
holds which shard; each deployment is tuned by the replica holding its shard and by no other; a second
replica takes half the shards from the first without a round on the same deployment by both; killing
one (SIGKILL) hands its deployments to the other within a minute, which then reconciles them (a spec
edit reaches the engine's ConfigMap) and tunes them. Engine pods are `health_server.py` stand-ins:
the rounds end in MetricsAvailable False (no engine metrics), which is still a round and its write.

Time (about 35 s): two operator start-ups, a Lease duration for the second replica to take its half,
and up to a minute (the handover bound the test asserts) after the SIGKILL.
"""
from __future__ import annotations

import datetime as dt
import re
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvtune_operator.shards import shard_of

from tests.infd import infd_body

from .test_operator_cluster import HEALTH_SERVER, OperatorProcess, _make_namespace
from .waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.wallclock]

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 16
ROUND = re.compile(r"^(\S+ \S+) INFO kvtune_operator: (\S+)/(\S+): tuning round by replica (\S+)$")


@pytest.fixture(scope="module")
def crd(controlplane):
    controlplane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    eventually(lambda: controlplane.kubectl("get", "infd", "-A", check=False).returncode == 0,
               what="kubectl to discover infd")


@pytest.fixture(scope="module")
def fleet(controlplane, crd, pod_node):
    """Two fleet namespaces (engine pods: stand-ins) and the operators' own (the Leases)."""
    namespaces = [_make_namespace(controlplane, "fleet"), _make_namespace(controlplane, "fleet")]
    system = _make_namespace(controlplane, "opsys")
    before = pod_node.translate

    def stand_in(pod, container, argv):
        if pod["metadata"]["namespace"] in namespaces:
            return [sys.executable, str(HEALTH_SERVER)]
        return before(pod, container, argv) if before else pod_node.default_translate(argv)
    pod_node.translate = stand_in
    try:
        with pod_node.restricted_to(*namespaces):
            yield namespaces, system
    finally:
        pod_node.translate = before
        for ns in (*namespaces, system):
            controlplane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def replica(controlplane, prometheus, namespaces, system, identity: str, log_dir: Path) -> OperatorProcess:
    env = {**controlplane.subprocess_env(), "KVTUNE_SHARDS": str(SHARDS), "KVTUNE_LEASE_NAMESPACE": system,
           "KVTUNE_IDENTITY": identity, "KVTUNE_TUNE_POLL_INTERVAL": "1", "KVTUNE_PROMETHEUS_URL": prometheus.url}
    return OperatorProcess(env, namespaces, log_dir / f"{identity}.log")


def holders(controlplane, system: str) -> dict[int, str | None]:
    """shard -> holderIdentity, as the Leases say."""
    items = controlplane.kubectl_json("get", "leases", "-n", system, "-o", "json")["items"]
    out = {}
    for lease in items:
        name = lease["metadata"]["name"]
        if name.startswith("kvtune-shard-"):
            out[int(name.rsplit("-", 1)[1])] = lease["spec"].get("holderIdentity")
    return out


def rounds(*ops: OperatorProcess) -> list[tuple[float, str, str, str]]:
    """(time, namespace, name, replica) of every tuning round the replicas logged, in time order."""
    out = []
    for op in ops:
        if not op.log_path.exists():  # not started yet
            continue
        for line in op.log_path.read_text(errors="replace").splitlines():
            m = ROUND.match(line)
            if m:
                t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((t, m.group(2), m.group(3), m.group(4)))
    return sorted(out)


def names_in(namespace: str, shards: range, count: int) -> list[str]:
    """``count`` deployment names of ``namespace`` whose shard is in ``shards``."""
    return [n for n in (f"d{i}" for i in range(1000)) if shard_of(namespace, n, SHARDS) in shards][:count]


def test_two_replicas_share_the_fleet_and_a_killed_one_hands_its_deployments_over(
        controlplane, prometheus, fleet, tmp_path):
    namespaces, system = fleet
    a = replica(controlplane, prometheus, namespaces, system, "op-a", tmp_path).start()
    b = replica(controlplane, prometheus, namespaces, system, "op-b", tmp_path)
    try:
        eventually(lambda: set(holders(controlplane, system).values()) == {"op-a"}
                   and len(holders(controlplane, system)) == SHARDS, timeout=30, what="op-a holding every shard")
        # two deployments in each half of the shards, spread over both namespaces
        objs = [(ns, n) for ns in namespaces for half in (range(0, 8), range(8, 16)) for n in names_in(ns, half, 1)]
        for ns, n in objs:
            body = infd_body(n, namespace=ns, model_path="/models/tiny",
                             autotune={"mode": "Recommend", "interval": "5s", "window": "10s"})
            controlplane.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
        tuned_by = lambda who, since=0.0: {(ns, n) for t, ns, n, r in rounds(a, b) if r == who and t >= since}  # noqa: E731
        eventually(lambda: tuned_by("op-a") >= set(objs), timeout=90, what="op-a tuning every deployment")

        joined = time.time()
        b.start()
        split = eventually(lambda: (h := holders(controlplane, system)) and sorted(h.values()).count("op-a") == 8
                           and sorted(h.values()).count("op-b") == 8 and h, timeout=60, what="an 8/8 split")
        owner = {o: split[shard_of(*o, SHARDS)] for o in objs}
        assert set(owner.values()) == {"op-a", "op-b"}, owner  # both halves have deployments
        settled = time.time()
        eventually(lambda: all(o in tuned_by(owner[o], settled) for o in objs), timeout=60,
                   what="each deployment tuned by its shard's holder")
        time.sleep(6)  # another round of each (interval 5 s)

        # each deployment tuned by exactly one replica at a time: op-a's rounds of a moved deployment
        # all come before op-b's first, and after the split only the holder tunes it
        log = rounds(a, b)
        for o in objs:
            seq = [r for t, ns, n, r in log if (ns, n) == o]
            switches = sum(1 for x, y in zip(seq, seq[1:]) if x != y)
            assert seq[0] == "op-a" and switches == (1 if owner[o] == "op-b" else 0), (o, seq)
            late = {r for t, ns, n, r in log if (ns, n) == o and t >= settled}
            assert late == {owner[o]}, (o, late)
        assert not [t for t, *_ in log if t < joined and _[2] == "op-b"]

        # SIGKILL the replica holding op-a's half: its deployments go to op-b within a minute
        victims = [o for o in objs if owner[o] == "op-a"]
        a.kill()
        killed = time.time()
        ns, n = victims[0]
        controlplane.kubectl("patch", "infd", n, "-n", ns, "--type=merge", "-p",
                             '{"spec": {"engine": {"maxNumSeqs": 77}}}')
        eventually(lambda: set(holders(controlplane, system).values()) == {"op-b"}, timeout=60,
                   what="op-b holding every shard after op-a's death")
        sys.stderr.write(f"\n[replicas] op-b held op-a's shards {time.time() - killed:.1f}s after the SIGKILL "
                         "(Lease duration 15 s)\n")
        def engine_config() -> dict:
            data = controlplane.kubectl_json("get", "configmap", f"{n}-engine", "-n", ns, "-o", "json")["data"]
            return yaml.safe_load(next(iter(data.values())))
        eventually(lambda: engine_config().get("max_num_seqs") == 77, timeout=max(1.0, 60 - (time.time() - killed)),
                   what=f"op-b reconciling {ns}/{n}'s spec edit into its engine ConfigMap")
        eventually(lambda: tuned_by("op-b", killed) >= set(victims), timeout=max(1.0, 60 - (time.time() - killed)),
                   what="op-b tuning op-a's deployments")
        assert time.time() - killed < 60
        assert not [r for t, ns_, n_, r in rounds(a, b) if r == "op-a" and t > killed]
        # its Events name the replica that acted
        events = controlplane.kubectl_json("get", "events", "-n", ns, "-o", "json")["items"]
        assert {e.get("reportingInstance") for e in events
                if e["involvedObject"]["name"] == n and e.get("source", {}).get("component") == "kvtune-operator"
                } <= {"op-a", "op-b"}
    finally:
        a.stop()
        b.stop()
        sys.stderr.write(f"\n[op-a log tail]\n{a.tail(20)}\n[op-b log tail]\n{b.tail(20)}\n")


def test_a_stale_tuner_write_is_refused_by_the_apiserver(controlplane, fleet):
    """The last guard against a round recorded twice: the status patch carries the resourceVersion
    the round's write was planned from, and the real apiserver refuses it once anything wrote the
    object since (409); with the current one it goes through."""
    from kvtune_operator.kube import Kube, KubeError

    ns = fleet[0][0]
    controlplane.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        infd_body("stale", namespace=ns, model_path="/models/tiny", autotune={"mode": "Off"})))
    kube = Kube(controlplane.api_client())
    old = kube.get_infd(ns, "stale")["metadata"]["resourceVersion"]
    kube.patch_infd_status(ns, "stale", {"tuning": {"phase": "Observing", "message": "the holder's round"}})
    with pytest.raises(KubeError) as refused:
        kube.patch_infd_status(ns, "stale", {"tuning": {"phase": "Verifying", "message": "a stale round"}},
                               resource_version=old)
    assert refused.value.status == 409
    assert kube.get_infd(ns, "stale")["status"]["tuning"]["message"] == "the holder's round"
    current = kube.get_infd(ns, "stale")["metadata"]["resourceVersion"]
    kube.patch_infd_status(ns, "stale", {"tuning": {"phase": "Verifying", "message": "the next round"}},
                           resource_version=current)
    assert kube.get_infd(ns, "stale")["status"]["tuning"]["message"] == "the next round"
