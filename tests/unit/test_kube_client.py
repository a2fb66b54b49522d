"""The operator's Kubernetes client keeps a connection for every thread that calls it at once: the
client's own pool is 5 per CPU (10 on a 2-CPU pod), and with more handler threads than that each
extra call opened a connection and threw it away ("Connection pool is full, discarding connection")."""
from __future__ import annotations

import yaml

from kvtune_operator.kube import Kube


def test_the_client_pool_holds_a_connection_per_calling_thread(tmp_path, monkeypatch):
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kube = Kube.from_environment(str(cfg), connections=40)
    assert kube.core.api_client.configuration.connection_pool_maxsize >= 40
    assert kube.core.api_client.configuration.host == "https://127.0.0.1:1"
