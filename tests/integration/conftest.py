"""Integration-test fixtures: a real control plane, a real Prometheus, and the pod node.

Every test in ``tests/integration/`` is marked ``integration`` automatically (also register it
yourself with ``pytestmark = pytest.mark.integration`` for clarity). Run them with::

    bash tests/controlplane/setup.sh              # once: apt prometheus, Go build, helm/kubectl
    .venv/bin/python -m pytest tests/integration -m integration

If the binaries are not built, the fixtures FAIL (never skip) and say to run
``tests/controlplane/setup.sh``. Set ``KVTUNE_CP_KEEP=1`` to keep run dirs (logs of every component,
``tests/controlplane/run/``) after the session.

Session-scoped fixtures (started once per pytest session, lazily, torn down at session end, at
interpreter exit, and - through PR_SET_PDEATHSIG - even if pytest is killed):

``controlplane`` -> `tests.controlplane.ControlPlane`
    etcd + kube-apiserver/controller-manager/scheduler v1.36.3 + kwok, 3 fake GPU nodes
    ``kwok-gpu-0..2`` (``nvidia.com/gpu: 8``, label ``type=kwok``). Use:
      ``controlplane.kubeconfig``       Path of the admin kubeconfig (system:masters token).
      ``controlplane.kubectl(*args, check=True, input=None, timeout=120)`` -> CompletedProcess
                                        (text stdout/stderr; raises CommandFailed on non-zero exit).
      ``controlplane.kubectl_json(*args)`` -> parsed ``-o json`` output.
      ``controlplane.helm(*args, ...)``  same for helm v4 (isolated HELM_* dirs).
      ``controlplane.env``              dict of env overrides (KUBECONFIG, PATH with bin/ first,
                                        HELM_*, KUBECACHEDIR); ``controlplane.subprocess_env()``
                                        is os.environ merged with it - pass it to the operator.
      ``controlplane.api_client()``     a ``kubernetes.client.ApiClient`` for this cluster.
      ``controlplane.server``, ``.token``, ``.ca_file``, ``.nodes``, ``.run_dir``.
    The cluster is shared by the whole session: create your objects in your own namespace (the
    ``namespace`` fixture) and do not change cluster-scoped objects others rely on.

``prometheus`` -> `tests.controlplane.Prometheus`
    ``prometheus.url`` (``http://127.0.0.1:PORT``; ``PrometheusConnect(prometheus.url)``),
    scrape interval 1 s, job ``kvtune-engine`` fed by the pod node, job ``extra`` fed by
    ``prometheus.set_targets([("127.0.0.1:PORT", {"label": "v"}), ...])``;
    ``prometheus.query(promql)`` (raw HTTP API), ``prometheus.active_targets()``.

``pod_node`` -> `tests.controlplane.PodNode` (needs ``controlplane`` and ``prometheus``)
    Runs each pod labelled ``app.kubernetes.io/name=kvtune-engine`` as a local process once kwok
    gave it an IP (first container's command+args+env; ``--port N`` rewritten and ``KVTUNE_PORT``
    set to a free loopback port; mounted ConfigMaps written locally and kept in sync, paths in args
    rewritten), stops it when the pod goes away, and publishes it to Prometheus with labels
    ``namespace``, ``pod``, ``container``, ``node``, ``inference_deployment``. Like a kubelet it
    restarts a process that exits (back-off 1 s doubling to 30 s, a tenth of the kubelet's) and
    writes the pod's status: phase, ``containerStatuses[0]`` (state running/waiting
    CrashLoopBackOff/terminated, ``lastState.terminated`` with exit code and the termination
    message, ``restartCount``, ``ready``) and Ready/ContainersReady from the readiness probe. An
    engine pod it does not run is never Ready: use a stand-in (``health_server.py``) for tests
    that need Ready pods but no engine. Use:
      ``pod_node.command_map["kvtune-engine"] = [sys.executable, "-m", "..."]`` (how a command
          becomes a local process; ``python``/``python3`` map to this interpreter already;
          or set ``pod_node.translate = fn(pod, container, argv) -> argv``),
      ``pod_node.wait_for_pod(ns, pod)``, ``pod_node.wait_for_selector(ns, labels, count)``,
      ``pod_node.url_for(ns, pod)``, ``pod_node.urls_for_selector(ns, labels)`` (Ready pods only),
      ``pod_node.urls_for_service(ns, service)``, ``pod_node.rewrite_url(url_with_pod_ip)``,
      ``pod_node.logs(ns, pod)``, ``pod_node.get(ns, pod)`` -> LocalPod (``.port``, ``.argv``,
      ``.returncode``, ``.ready``, ``.restart_count``, ``.local_path(container_path)``),
      ``pod_node.default_translate(argv)``, ``pod_node.errors``,
      ``with pod_node.restricted_to(ns): ...`` (run only your namespace's engine pods: by default
      EVERY engine pod in the cluster becomes a local process, including ones other tests left
      behind - each ``kvtune serve`` imports torch, which is slow on 2 cores; delete your engine
      pods/namespaces when done).
    Change ``command_map``/``translate`` before creating your pods, and restore them afterwards
    (session-scoped object).

Function-scoped: ``namespace`` -> name of a fresh namespace (deleted after the test).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kvtune_engine import native

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.controlplane import (  # noqa: E402
    BinariesMissing, ControlPlane, PodNode, Prometheus, check_binaries,
)
from tests.controlplane.harness import RUN_ROOT  # noqa: E402
from tests.controlplane.prometheus import PrometheusMissing, prometheus_binary  # noqa: E402

_STARTED: list = []  # everything this session started, stopped again at session end
_INTEGRATION_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "integration: needs the real control plane / Prometheus harness (tests/controlplane)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    while _STARTED:
        _STARTED.pop().stop()


def _problem(check, exc_type) -> str | None:
    try:
        check()
    except exc_type as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def controlplane():
    """A real Kubernetes v1.36.3 control plane with kwok GPU nodes (see module docstring)."""
    missing = _problem(check_binaries, BinariesMissing)
    if missing:
        pytest.fail(missing, pytrace=False)
    cp = ControlPlane(gpu_nodes=3)
    _STARTED.append(cp)
    cp.start()
    sys.stderr.write(f"\n[controlplane] ready in {cp.started_in:.1f}s at {cp.server} (run dir {cp.run_dir})\n")
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def prometheus():
    """A real Prometheus (Debian package), 1 s scrape interval, file-based SD (see module docstring)."""
    missing = _problem(prometheus_binary, PrometheusMissing)
    if missing:
        pytest.fail(missing, pytrace=False)
    prom = Prometheus()
    _STARTED.append(prom)
    prom.start()
    yield prom
    prom.stop()


@pytest.fixture(scope="session")
def pod_node(controlplane, prometheus):
    """Engine pods -> local processes, published to `prometheus` (see module docstring)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"node-{os.getpid()}-", dir=RUN_ROOT))
    # An engine image ships its kernels built; here the pods use this checkout's (built by `make setup`)
    # instead of compiling both again in each pod's empty /tmp (HOME): 1-2 minutes of a start on two
    # cores, which a restart change's new pod must not spend before it can serve.
    node = PodNode(controlplane.kubeconfig, run_dir, sd_file=prometheus.sd_file,
                   extra_env={"KVTUNE_EXT_DIR": str(native.ext_dir())})
    node.controlplane = controlplane
    node.prometheus = prometheus
    cleanup = _Cleanup(node, run_dir)
    _STARTED.append(cleanup)
    node.start()
    yield node
    cleanup.stop()


class _Cleanup:
    """Stops the pod node and removes its run dir (unless KVTUNE_CP_KEEP)."""

    def __init__(self, node: PodNode, run_dir: Path):
        self.node, self.run_dir, self.done = node, run_dir, False

    def stop(self) -> None:
        if self.done:
            return
        self.done = True
        self.node.stop()
        if not os.environ.get("KVTUNE_CP_KEEP"):
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def namespace(controlplane):
    """A fresh namespace (with its default ServiceAccount ready); deleted after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    controlplane.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while controlplane.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"namespace {name}: default ServiceAccount never appeared (controller-manager?)")
        time.sleep(0.1)
    yield name
    controlplane.kubectl("delete", "namespace", name, "--wait=false", check=False)
