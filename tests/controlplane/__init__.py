"""Test harness: a real Kubernetes control plane, Prometheus, kubectl and helm, without Docker.

* `harness.ControlPlane` - etcd, kube-apiserver, kube-controller-manager, kube-scheduler (v1.36.3,
  built from Go modules by ``build.sh``) and kwok with fake GPU nodes (``nvidia.com/gpu: 8``).
* `prometheus.Prometheus` - Debian's prometheus, 1 s scrape interval, file-based SD.
* `node.PodNode` - the one simulated part: runs engine pods' containers as local processes and
  publishes them as Prometheus targets.

Set up everything with ``bash tests/controlplane/setup.sh``. Pytest fixtures (``controlplane``,
``prometheus``, ``pod_node``) live in ``tests/integration/conftest.py``; for humans:
``python -m tests.controlplane up|down|env|status``.
"""

from .harness import BIN_DIR, BinariesMissing, CommandFailed, ControlPlane, check_binaries
from .node import DEPLOYMENT_LABEL, ENGINE_SELECTOR, LocalPod, PodNode
from .prometheus import Prometheus

__all__ = [
    "BIN_DIR", "BinariesMissing", "CommandFailed", "ControlPlane", "check_binaries",
    "DEPLOYMENT_LABEL", "ENGINE_SELECTOR", "LocalPod", "PodNode", "Prometheus",
]
