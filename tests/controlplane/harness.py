"""A real Kubernetes control plane for tests, started as local processes (no Docker).

`ControlPlane` starts, from the binaries that ``tests/controlplane/build.sh`` builds into
``tests/controlplane/bin/``:

* etcd (fresh data dir, ``--unsafe-no-fsync``),
* kube-apiserver v1.36 (loopback only, RBAC, an admin bearer token in ``system:masters``,
  a serving certificate from a throw-away CA, a service-account signing key it generates),
* kube-controller-manager (Deployments, ReplicaSets, garbage collection, service accounts, ...),
* kube-scheduler,
* kwok, which plays the kubelets of a few fake GPU nodes (``nvidia.com/gpu: 8`` each) that the
  harness creates: pods scheduled on them are marked Running/Ready, deleted pods go away; engine
  pods only get their sandbox (an IP) and stay Pending, not Ready (`kwok_stages`).

Nothing runs inside those pods; ``tests/controlplane/node.py`` (the one simulated part) starts the
engine pods' processes locally and reports their containers' state and readiness as a kubelet.

Every process runs in its own process group; `stop()` (also called from ``atexit`` and from the
pytest session end) terminates the groups and waits for them. Processes started for a pytest
session also get ``PR_SET_PDEATHSIG=SIGKILL`` (via ``setpriv``) so they die with the test process
even when it is killed hard. Run directories of dead owners are reaped at the next start.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Iterator

from kvtune_operator.demo.engine import free_port  # noqa: F401  (prometheus.py, node.py import it from here)

HERE = Path(__file__).resolve().parent
#: Built binaries (``build.sh``, ``get_helm_kubectl.sh``); ``KVTUNE_CP_BIN`` overrides.
BIN_DIR = Path(os.environ.get("KVTUNE_CP_BIN") or HERE / "bin")
#: Run dirs (logs, etcd data, certificates); ``KVTUNE_CP_RUN`` overrides.
RUN_ROOT = Path(os.environ.get("KVTUNE_CP_RUN") or HERE / "run")
STAGES_DIR = BIN_DIR / "kwok-stages"

CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
TOOL_BINARIES = ("kubectl", "helm")
KWOK_STAGES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)

#: Pods whose container the pod node (node.py) runs: kwok only starts their sandbox (our own stage,
#: ``kwok/engine-pod-start.yaml``) and leaves the container's status to the pod node.
ENGINE_POD_LABEL = ("app.kubernetes.io/name", "kvtune-engine")
ENGINE_POD_STAGE = HERE / "kwok" / "engine-pod-start.yaml"

#: Label and annotation put on every fake node.
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"


def kwok_stages() -> str:
    """kwok's stock stages (``bin/kwok-stages/``) plus ours for engine pods, as one ``--config``.

    The stock pod-ready stage marks a pod Running and Ready the moment it is bound; for engine pods
    that would be a lie the Deployment controller acts on (a rollout would drop the old pod before
    the new engine has loaded), so pod-ready gets one more selector term that leaves engine pods to
    ``engine-pod-start.yaml``: kwok gives them an IP and stops there, the pod node does the rest."""
    import yaml

    docs = []
    for name in KWOK_STAGES:
        doc = yaml.safe_load((STAGES_DIR / name).read_text())
        if doc["metadata"]["name"] == "pod-ready":
            doc["spec"]["selector"]["matchExpressions"].append({
                "key": f'.metadata.labels["{ENGINE_POD_LABEL[0]}"]', "operator": "NotIn",
                "values": [ENGINE_POD_LABEL[1]]})
        docs.append(yaml.safe_dump(doc, sort_keys=False).strip())
    docs.append(ENGINE_POD_STAGE.read_text().strip())
    return "\n---\n".join(docs) + "\n"


class BinariesMissing(RuntimeError):
    """The control-plane binaries have not been built."""


def check_binaries(names: Iterable[str] = CONTROL_PLANE_BINARIES + TOOL_BINARIES) -> None:
    """Raise `BinariesMissing` with the command to run when a binary (or kwok stage) is absent."""
    missing = [n for n in names if not os.access(BIN_DIR / n, os.X_OK)]
    missing += [f"kwok-stages/{s}" for s in KWOK_STAGES if not (STAGES_DIR / s).is_file()]
    if missing:
        raise BinariesMissing(
            f"test control plane binaries missing in {BIN_DIR}: {', '.join(missing)}.\n"
            "Build them first:  bash tests/controlplane/setup.sh\n"
            "(or only the Go part: bash tests/controlplane/build.sh, and helm/kubectl: "
            "bash tests/controlplane/get_helm_kubectl.sh). A cold Go build takes 5-25 min on 2 cores."
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, die_with_parent: bool = True):
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        full = list(argv)
        if die_with_parent and shutil.which("setpriv"):
            full = ["setpriv", "--pdeathsig", "KILL", "--"] + full
        self._log = open(self.log_path, "ab", buffering=0)
        self.popen = subprocess.Popen(
            full, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, cwd=cwd, start_new_session=True, close_fds=True,
        )
        self.pid = self.popen.pid  # == process group id (new session)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        kill_group(self.pid, timeout=timeout, popen=self.popen)
        try:
            self._log.close()
        except OSError:
            pass

    def tail(self, n: int = 40) -> str:
        return _log_tail(self.log_path, n)


def kill_group(pgid: int, timeout: float = 5.0, popen: subprocess.Popen | None = None) -> None:
    """SIGTERM a process group, SIGKILL it after `timeout`, and reap the leader if it is our child."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None:
            popen.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.05)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if popen is not None:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts as "in the group"; treat a group whose only member is a zombie
    # as dead.
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def reap_stale_runs(root: Path = RUN_ROOT) -> list[str]:
    """Kill process groups of run dirs whose owner process is gone, and remove those dirs.

    Returns the names of the reaped run dirs. Detached runs (``python -m tests.controlplane up``)
    have no owner pid and are left alone; ``down`` stops them.
    """
    reaped = []
    if not root.is_dir():
        return reaped
    for state_file in root.glob("*/state.json"):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        owner = state.get("owner_pid")
        if owner is None or _pid_alive(owner):
            continue
        for pgid in state.get("pgids", {}).values():
            if _group_alive(pgid) and _cmdline_mentions(pgid, str(state_file.parent)):
                kill_group(pgid, timeout=2)
        shutil.rmtree(state_file.parent, ignore_errors=True)
        reaped.append(state_file.parent.name)
    return reaped


def _cmdline_mentions(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A throw-away CA, an apiserver serving certificate (127.0.0.1/localhost/kubernetes.default...),
    and an EC service-account signing key; all with openssl (no Python crypto dependency)."""
    d.mkdir(parents=True, exist_ok=True)
    for key in ("ca.key", "apiserver.key", "sa.key"):
        _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key, cwd=d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvtune-test-ca", "-days", "3650",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", "ca.crt", cwd=d)
    _openssl("req", "-new", "-key", "apiserver.key", "-subj", "/CN=kube-apiserver", "-out", "apiserver.csr", cwd=d)
    (d / "apiserver.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-extfile", "apiserver.ext", "-out", "apiserver.crt", cwd=d)


class ControlPlane:
    """A running test cluster. Use `start()` / `stop()`, or as a context manager.

    Attributes once started:
      kubeconfig  Path of an admin kubeconfig (context ``kvtune-test``, namespace ``default``).
      server      ``https://127.0.0.1:PORT`` of the apiserver.
      token       the admin bearer token (group ``system:masters``).
      ca_file     the CA that signed the apiserver's serving certificate.
      env         the environment overrides for tools run against this cluster: ``KUBECONFIG``,
                  ``PATH`` (bin dir first, so ``kubectl``/``helm`` are ours), isolated ``HELM_*``
                  and ``KUBECACHEDIR`` dirs. Use ``{**os.environ, **cp.env}`` or `subprocess_env()`.
      nodes       names of the fake GPU nodes (managed by kwok).
      run_dir     where logs (``<component>.log``), certificates and the etcd data live.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, *, gpu_nodes: int = 3,
                 gpus_per_node: int = 8, detached: bool = False, keep_run_dir: bool | None = None):
        self.gpu_nodes = gpu_nodes
        self.gpus_per_node = gpus_per_node
        self.detached = detached
        if keep_run_dir is None:
            keep_run_dir = bool(os.environ.get("KVTUNE_CP_KEEP"))
        self.keep_run_dir = keep_run_dir
        self._given_run_dir = Path(run_dir) if run_dir else None
        self.run_dir: Path | None = None
        self.procs: dict[str, ManagedProcess] = {}
        self.kubeconfig: Path | None = None
        self.server = ""
        self.token = ""
        self.ca_file: Path | None = None
        self.env: dict[str, str] = {}
        self.nodes: list[str] = []
        self.ports: dict[str, int] = {}
        self.started_in: float | None = None
        self._lock = threading.Lock()
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> "ControlPlane":
        check_binaries()
        t0 = time.monotonic()
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        reap_stale_runs()
        if self._given_run_dir:
            self.run_dir = self._given_run_dir
            if self.run_dir.exists():
                shutil.rmtree(self.run_dir)
            self.run_dir.mkdir(parents=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"cp-{os.getpid()}-", dir=RUN_ROOT))
        rd = self.run_dir
        if not self.detached:
            atexit.register(self.stop)
        try:
            self._start(rd, t0 + timeout)
        except BaseException:
            self._dump_logs_on_failure()
            self.stop(remove=False)
            raise
        self.started_in = time.monotonic() - t0
        return self

    def _start(self, rd: Path, deadline: float) -> None:
        pki = rd / "pki"
        make_pki(pki)
        self.ca_file = pki / "ca.crt"
        self.token = secrets.token_hex(16)
        (rd / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        p = self.ports = {
            "etcd": free_port(), "etcd-peer": free_port(), "apiserver": free_port(),
            "controller-manager": free_port(), "scheduler": free_port(),
            "kwok-server": free_port(),
        }
        self.server = f"https://127.0.0.1:{p['apiserver']}"
        self.kubeconfig = rd / "kubeconfig"
        self._write_kubeconfig(self.kubeconfig)
        self.env = {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
            "HELM_CONFIG_HOME": str(rd / "helm" / "config"),
            "HELM_CACHE_HOME": str(rd / "helm" / "cache"),
            "HELM_DATA_HOME": str(rd / "helm" / "data"),
            "KUBECACHEDIR": str(rd / "kubecache"),
        }
        self._write_state()

        etcd_url = f"http://127.0.0.1:{p['etcd']}"
        peer_url = f"http://127.0.0.1:{p['etcd-peer']}"
        self._spawn("etcd", [
            str(BIN_DIR / "etcd"), "--name=node0", f"--data-dir={rd / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=node0={peer_url}", "--unsafe-no-fsync=true",
            "--log-level=warn", "--quota-backend-bytes=2147483648",
        ])
        self._spawn("kube-apiserver", [
            str(BIN_DIR / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={p['apiserver']}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={rd / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.key'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--endpoint-reconciler-type=none", "--allow-privileged=true",
            "--profiling=false", "--v=0",
        ])
        # The controller-manager exits at once if it cannot reach the apiserver (it loads the
        # request-header CA from it): start it, and the rest, once the apiserver is ready.
        self._wait("kube-apiserver /readyz", lambda: self._get("/readyz") == 200, deadline)
        common = [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false",
        ]
        self._spawn("kube-controller-manager", [
            str(BIN_DIR / "kube-controller-manager"), *common,
            f"--secure-port={p['controller-manager']}", f"--cert-dir={rd / 'kcm-pki'}",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false",
            "--kube-api-qps=200", "--kube-api-burst=400",
            "--concurrent-gc-syncs=10",
        ])
        self._spawn("kube-scheduler", [
            str(BIN_DIR / "kube-scheduler"), *common,
            f"--secure-port={p['scheduler']}", f"--cert-dir={rd / 'scheduler-pki'}",
        ])
        stages = rd / "kwok-stages.yaml"
        stages.write_text(kwok_stages())
        self._spawn("kwok", [
            str(BIN_DIR / "kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={stages}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
            "--cidr=10.244.0.0/16", "--node-ip=10.0.0.1",
            # renew node leases (the heartbeat-with-lease stage), or the node controller marks the
            # nodes, and every pod on them, NotReady ~50 s into a session
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{p['kwok-server']}",
        ])

        self._create_nodes()
        self._wait("kube-controller-manager /healthz",
                   lambda: _https_status(f"https://127.0.0.1:{p['controller-manager']}/healthz") == 200, deadline)
        self._wait("kube-scheduler /healthz",
                   lambda: _https_status(f"https://127.0.0.1:{p['scheduler']}/healthz") == 200, deadline)
        self._wait("fake nodes Ready (kwok)", self._nodes_ready, deadline)
        self._wait("default service account (controller-manager)",
                   lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default") == 200, deadline)

    @contextlib.contextmanager
    def apiserver_frozen(self) -> Iterator[None]:
        """An apiserver outage: kube-apiserver stopped (SIGSTOP) inside the block, so that every
        client's requests and watches hang as behind a partition or a stalled server, then resumed
        (SIGCONT) with its state intact."""
        pid = self.procs["kube-apiserver"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
            self._wait("kube-apiserver /readyz after the outage", lambda: self._get("/readyz") == 200,
                       time.monotonic() + 60)

    def stop(self, remove: bool | None = None) -> None:
        """Terminate every process (process groups), then remove the run dir unless kept."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # Reverse start order: kwok/scheduler/controller-manager first, etcd last.
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        if remove is None:
            remove = not self.keep_run_dir
        if remove and self.run_dir and self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    # ------------------------------------------------------------------ tools
    def subprocess_env(self) -> dict[str, str]:
        """``os.environ`` with `env` applied: pass as ``env=`` to subprocesses."""
        return {**os.environ, **self.env}

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``kubectl ARGS`` (v1.35, from bin/) against this cluster; text output captured.
        With ``check=True`` (default) a non-zero exit raises `CommandFailed` (stderr included)."""
        return self._run([str(BIN_DIR / "kubectl"), *args], check=check, input=input, timeout=timeout)

    def kubectl_json(self, *args: str, timeout: float = 120) -> Any:
        """``kubectl ARGS -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``helm ARGS`` (v4.1, from bin/) against this cluster; like `kubectl`."""
        return self._run([str(BIN_DIR / "helm"), *args], check=check, input=input, timeout=timeout)

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` for this cluster (the official Python client)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    def _run(self, argv: list[str], *, check: bool, input: str | None, timeout: float) -> subprocess.CompletedProcess:
        res = subprocess.run(argv, env=self.subprocess_env(), input=input, text=True,
                             capture_output=True, timeout=timeout)
        if check and res.returncode != 0:
            raise CommandFailed(argv, res)
        return res

    # ------------------------------------------------------------------ internals
    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.run_dir is not None
        self.procs[name] = ManagedProcess(name, argv, self.run_dir / f"{name}.log",
                                          die_with_parent=not self.detached)
        self._write_state()

    def _write_state(self) -> None:
        assert self.run_dir is not None
        state = {
            "owner_pid": None if self.detached else os.getpid(),
            "pgids": {n: pr.pid for n, pr in self.procs.items()},
            "kubeconfig": str(self.kubeconfig) if self.kubeconfig else None,
            "server": self.server,
            "env": self.env,
            "ports": self.ports,
            "nodes": self.nodes,
        }
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_dir / "state.json")

    def _write_kubeconfig(self, path: Path) -> None:
        assert self.ca_file is not None
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        # JSON is valid YAML; kubectl, helm and the Python client all read it.
        cfg = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "kvtune-test", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "kvtune-test", "context": {"cluster": "kvtune-test", "user": "admin", "namespace": "default"}}],
            "current-context": "kvtune-test",
        }
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        path.chmod(0o600)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        return ctx

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl(), timeout=5) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return 0, None

    def _get(self, path: str) -> int:
        return self._request("GET", path)[0]

    def _create_nodes(self) -> None:
        n = str(self.gpus_per_node)
        for i in range(self.gpu_nodes):
            name = f"kwok-gpu-{i}"
            resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti", GPU_RESOURCE: n}
            node = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                        "type": "kwok", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": n,
                        "nvidia.com/gpu.product": "NVIDIA-H200",
                    },
                },
                "spec": {},
                "status": {"capacity": resources, "allocatable": resources},
            }
            code, resp = self._request("POST", "/api/v1/nodes", node)
            if code not in (201, 409):
                raise RuntimeError(f"creating node {name} failed: HTTP {code}: {resp}")
            self.nodes.append(name)
        self._write_state()

    def _nodes_ready(self) -> bool:
        code, body = self._request("GET", "/api/v1/nodes")
        if code != 200:
            return False
        ready = set()
        for item in body.get("items", []):
            for c in item.get("status", {}).get("conditions") or []:
                if c.get("type") == "Ready" and c.get("status") == "True":
                    ready.add(item["metadata"]["name"])
        return set(self.nodes) <= ready

    def _wait(self, what: str, cond, deadline: float) -> None:
        while True:
            for name, pr in self.procs.items():
                if not pr.alive():
                    raise RuntimeError(f"{name} exited (code {pr.popen.returncode}) while waiting for {what}; "
                                       f"log {pr.log_path}:\n{pr.tail()}")
            try:
                if cond():
                    return
            except Exception:  # noqa: BLE001 - retried until the deadline
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"control plane: timed out waiting for {what}; logs in {self.run_dir}")
            time.sleep(0.1)

    def _dump_logs_on_failure(self) -> None:
        for name, pr in self.procs.items():
            sys.stderr.write(f"\n----- {name} ({pr.log_path}) -----\n{pr.tail(25)}\n")


class CommandFailed(subprocess.CalledProcessError):
    """A kubectl/helm call exited non-zero; ``str()`` includes stdout and stderr."""

    def __init__(self, argv: list[str], res: subprocess.CompletedProcess):
        super().__init__(res.returncode, argv, res.stdout, res.stderr)

    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


def _https_status(url: str) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the components' self-signed health endpoints
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def load_detached(run_dir: Path) -> dict:
    """The state of a run started by ``python -m tests.controlplane up``."""
    return json.loads((run_dir / "state.json").read_text())


def stop_detached(run_dir: Path) -> list[str]:
    """Stop the processes recorded in ``run_dir/state.json`` and remove the dir."""
    stopped = []
    state_file = run_dir / "state.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        for name, pgid in reversed(list(state.get("pgids", {}).items())):
            if _group_alive(pgid) and _cmdline_mentions(pgid, str(run_dir)):
                kill_group(pgid)
                stopped.append(name)
    shutil.rmtree(run_dir, ignore_errors=True)
    return stopped
