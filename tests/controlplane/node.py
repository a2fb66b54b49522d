"""A node for our pods: runs engine pods' containers as local processes.

THIS IS THE ONE SIMULATED PART OF THE TEST HARNESS. Everything else (apiserver, controllers,
scheduler, Prometheus, kubectl, helm) is the real thing; kwok plays the kubelet of fake GPU nodes
but runs nothing. `PodNode` fills that gap, and only for kvtune engine pods, in a deliberately small
way: it is not a kubelet, but it reports what a kubelet reports where the control plane and the
operator act on it (container state, restarts, readiness).

Who writes what: for engine pods (label ``app.kubernetes.io/name=kvtune-engine``) kwok only starts
the "sandbox" (``kwok/engine-pod-start.yaml``: pod IP, host IP, ``startTime``, ``Initialized``;
phase Pending, not Ready); its stock pod-ready stage, which would mark them Running and Ready at
once, excludes them (``harness.kwok_stages``). No kwok stage matches such a pod again, so nothing
overwrites what the pod node writes. Pods the node does not run (another namespace than
`namespaces`, or no pod node at all) stay Pending with ``ContainerCreating``, as on a node that
cannot start them.

What it does, polling the apiserver every `poll_interval` seconds:

* It looks at pods matching `selector` (default ``app.kubernetes.io/name=kvtune-engine``; engine
  pods also carry ``kvtune.io/inference-deployment=<name>``) in all namespaces, or only in
  `namespaces` when set (``with pod_node.restricted_to(ns): ...``).
* For each pod bound to a node, with its sandbox up (a pod IP), not being deleted, it starts the
  pod's FIRST container as a local process: ``command + args`` (``$(VAR)`` references expanded like
  the kubelet does), with
  the container's ``env``/``envFrom`` (literal values, ``fieldRef``, ``configMapKeyRef``,
  ``secretKeyRef``) on top of this process' own environment (so the venv's Python is used):

  - The port: a free loopback port is chosen; it is passed as ``KVTUNE_PORT`` and every
    ``--port N`` / ``--port=N`` argument is rewritten to it (``--host`` becomes ``127.0.0.1``,
    ``KVTUNE_HOST=127.0.0.1`` is set too). An ``--admin-port N`` gets a free port of its own. A URL
    of the pod's IP is mapped by its container port (``rewrite_url``); Prometheus scrapes the port
    the ``prometheus.io/port`` annotation names.
  - ConfigMap volumes mounted by the container are written to a local directory
    (``items``/``subPath`` honoured) and KEPT IN SYNC when the ConfigMap changes (atomic
    replace, like the kubelet's eventual update); ``emptyDir`` mounts get an empty local directory.
    Any argument or env value naming a path under a ``mountPath`` is rewritten to the local copy.
  - ``command[0]`` is translated by `command_map` (exact name -> replacement argv prefix, e.g.
    ``{"kvtune-engine": [sys.executable, "-m", "kvtune_engine.server"]}``); ``python``/``python3``
    become this interpreter; other names are looked up on PATH with this venv's ``bin`` first. For
    anything else, set `translate` to a function ``(pod, container, argv) -> argv``.
* Like a kubelet, it keeps a deleted pod Terminating until its process has stopped: it holds the
  finalizer `FINALIZER` on each pod it runs and drops it once the process is gone (kwok's pod-delete
  stage would remove the pod at once, and a rollout then looked complete, old pod gone, while the
  old engine still finished its requests on the node's cores).
* It stops the process (SIGTERM to its main process, as a container runtime does; SIGKILL to its
  process group after the grace period, 30 s at most, counted from the start of a ``preStop``
  ``sleep`` hook, which it waits out first while the process serves on; no other kind of hook)
  when the pod is deleted, or is replaced (new uid). Pods outside `namespaces` are no longer its
  business: their processes stop and their status is left as it was.
* Like a kubelet with ``restartPolicy: Always``, it restarts a process that exits, in the same pod
  (same port, same emptyDir and ConfigMap copies, same argv and env; output appended to the same
  log), with the kubelet's back-off rules (container.py `BackOff`): the first restart at once, then
  `backoff` = (initial, max) seconds, doubling. The kubelet's is (10, 300); the default here is
  (1, 30), a tenth, so that a crash loop shows in seconds. ``PodNode(backoff=KUBELET_BACKOFF)`` for
  the real one.
* It writes the container's status through the pods/status subresource (strategic merge, like the
  kubelet), whenever it changes (container.py `ContainerStatus.patch`):

  - ``status.phase`` Running from the first start on (Pending before);
  - ``status.containerStatuses[0]``: ``name``, ``image``, ``containerID`` (``local://<pid>``),
    ``restartCount``, ``started``, ``ready``, ``state`` = ``running {startedAt}`` | ``terminated
    {exitCode, reason: Completed|Error, message, startedAt, finishedAt, containerID}`` (from the
    exit until the restart decision, one poll) | ``waiting {reason: CrashLoopBackOff, message:
    "back-off 2s restarting failed container=C pod=NAME_NS(UID)"}`` (while it waits) |
    ``waiting {reason: ContainerCreating}`` (kwok's, before the first start);
    ``lastState.terminated`` = the previous run's terminated state. The ``message`` is the
    termination message: with ``terminationMessagePolicy: FallbackToLogsOnError`` and a non-zero
    exit code, the last 80 lines of that run's output, at most its last 2048 bytes (the kubelet's
    limits); otherwise empty (the termination-message file is not simulated). An exit by a signal
    has exit code 128 + the signal number.
  - conditions ``ContainersReady`` and ``Ready``: True while the process runs and its
    ``readinessProbe`` passes (``httpGet``: status 200-399 on the local port; ``tcpSocket``: a
    connection; after the ``startupProbe``, if any), else False with reason ``ContainersNotReady``.
    Without a readiness probe the container is ready once it runs, as with a kubelet. Until the
    first success the probes run every `probe_interval` seconds (the kubelet waits up to
    ``periodSeconds``: a scaled detail); then every ``periodSeconds`` with the probe's
    ``timeoutSeconds`` and ``failureThreshold``. ``exec``/``grpc`` probes and liveness probes
    are not simulated.

  With readiness real, the real controllers do the rest: a Deployment's ``readyReplicas``, a
  rollout with ``maxUnavailable: 0`` that keeps the old pods until the new ones are Ready, and
  ``ProgressDeadlineExceeded`` for a rollout whose pods never are.
* It publishes every live process as a Prometheus file-SD target (``127.0.0.1:PORT``) with labels
  ``namespace``, ``pod``, ``container``, ``node`` and ``inference_deployment`` (from the pod label),
  which is what the kvtune PodMonitor gives; ``prometheus.io/path`` pod annotation sets the path.

How tests reach the processes: `url_for` (pod), `urls_for_selector` / `urls_for_service` (what a
Service would load-balance to: Ready pods only), `rewrite_url` (turns ``http://<podIP>:<containerPort>/...``, as the
operator would build it from the pod status, into the local URL), `wait_for_pod` /
`wait_for_selector` (the process listens), `logs` (its output).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .container import (
    KUBELET_BACKOFF, BackOff, ContainerStatus, Probe, go_duration, rfc3339, terminated_state, termination_message,
)
from .harness import ManagedProcess, free_port
from .prometheus import write_sd_file

ENGINE_SELECTOR = "app.kubernetes.io/name=kvtune-engine"
DEPLOYMENT_LABEL = "kvtune.io/inference-deployment"
#: held on each pod the node runs, dropped once its process stopped (a kubelet's Terminating)
FINALIZER = "kvtune.io/pod-node"

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass
class LocalPod:
    """One engine pod running locally."""

    namespace: str
    name: str
    uid: str
    labels: dict[str, str]
    node: str
    pod_ip: str
    container: str
    container_port: int | None
    port: int
    argv: list[str]
    workdir: Path
    proc: ManagedProcess
    mounts: list[tuple[str, Path]] = field(default_factory=list)  # (mountPath, local path)
    #: container port -> local port, for every port the process listens on (the API's and an admin port)
    ports: dict[int, int] = field(default_factory=dict)
    metrics_port: int | None = None   # the local port Prometheus scrapes (default: ``port``)
    grace_seconds: float = 10.0
    prestop_sleep_s: float = 0.0      # lifecycle.preStop.sleep.seconds
    metrics_path: str = "/metrics"
    env: dict[str, str] = field(default_factory=dict)
    #: What the node reports in the pod's status (state, restarts, readiness); see container.py.
    status: ContainerStatus | None = None
    backoff: BackOff | None = None
    readiness: Probe | None = None
    startup: Probe | None = None
    termination_policy: str | None = None
    run: int = 0                      # starts of the container so far
    log_offset: int = 0               # where the current run's output begins in the log
    exited: dict | None = None        # terminated state of the last run, once it exited
    finished: float | None = None     # time.monotonic() of that exit, until the restart
    last_patch: str | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """Where /metrics and the admin API answer: the scraped port (the API's unless the pod has
        an admin port)."""
        return f"http://127.0.0.1:{self.metrics_port or self.port}"

    def local_port(self, container_port: int | None) -> int:
        return self.ports.get(container_port, self.port) if container_port is not None else self.port

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    @property
    def returncode(self) -> int | None:
        return self.proc.popen.poll()

    def alive(self) -> bool:
        return self.proc.alive()

    @property
    def ready(self) -> bool:
        """The container runs and passed its readiness probe (what ``Ready`` says)."""
        return self.status is not None and self.status.ready and self.alive()

    @property
    def restart_count(self) -> int:
        return self.status.restart_count if self.status else 0

    def local_path(self, container_path: str) -> str:
        """The local file behind a path inside the container (a mounted ConfigMap, emptyDir)."""
        return _map_path(container_path, self.mounts)


class PodNode:
    """Runs engine pods locally. Start with `start()`, stop with `stop()` (stops all processes).

    Args:
      kubeconfig:    admin kubeconfig of the cluster.
      run_dir:       where pod work dirs, mounted files and ``<ns>_<pod>.log`` go.
      sd_file:       Prometheus file-SD file to keep up to date (``Prometheus.sd_file``), or None.
      selector:      label selector of the pods to run.
      command_map:   ``{command0: [replacement, argv, prefix]}``.
      poll_interval: seconds between reconciles.
      backoff:       (initial, max) seconds of the restart back-off (the kubelet's: `KUBELET_BACKOFF`).
      probe_interval: seconds between probes until a container first passes them.
    """

    def __init__(self, kubeconfig: str | os.PathLike, run_dir: str | os.PathLike, *,
                 sd_file: str | os.PathLike | None = None, selector: str = ENGINE_SELECTOR,
                 command_map: dict[str, list[str]] | None = None, poll_interval: float = 0.25,
                 extra_env: dict[str, str] | None = None,
                 backoff: tuple[float, float] = (KUBELET_BACKOFF[0] / 10, KUBELET_BACKOFF[1] / 10),
                 probe_interval: float = 0.5):
        self.kubeconfig = str(kubeconfig)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sd_file = Path(sd_file) if sd_file else None
        self.selector = selector
        self.command_map: dict[str, list[str]] = dict(command_map or {})
        self.translate: Callable[[dict, dict, list[str]], list[str]] | None = None
        self.extra_env = dict(extra_env or {})
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.probe_interval = probe_interval
        #: None: run engine pods of every namespace; a set: only those namespaces (see `restricted_to`).
        self.namespaces: set[str] | None = None
        self.pods: dict[tuple[str, str], LocalPod] = {}
        self.errors: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api = None
        self._log = open(self.run_dir / "pod-node.log", "a", buffering=1)
        self._last_sd: str | None = None
        self._synced = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "PodNode":
        from kubernetes import client, config

        self._api = client.CoreV1Api(config.new_client_from_config(config_file=self.kubeconfig))
        if self.sd_file:
            write_sd_file(self.sd_file, [])
        # The thread that starts the processes must live as long as they do: their
        # PR_SET_PDEATHSIG fires when it exits. It is this loop's thread.
        self._thread = threading.Thread(target=self._loop, name="pod-node", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        self._synced.wait(10)
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self._log.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            self._stop_pods(list(self.pods), "pod node stopping", hooks=False)
        if self.sd_file and self.sd_file.parent.is_dir():
            write_sd_file(self.sd_file, [])
        self._log.close()

    def __enter__(self) -> "PodNode":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @contextlib.contextmanager
    def restricted_to(self, *namespaces: str):
        """Within the block, run only the engine pods of these namespaces (others' processes are
        stopped; they start again after the block). Engine pods that other tests leave behind
        otherwise all become local processes (each ``kvtune serve`` imports torch: slow on 2 cores)."""
        before = self.namespaces
        self.namespaces = set(namespaces)
        try:
            yield self
        finally:
            self.namespaces = before

    # ------------------------------------------------------------------ lookups for tests
    def get(self, namespace: str, pod: str) -> LocalPod | None:
        with self._lock:
            return self.pods.get((namespace, pod))

    def url_for(self, namespace: str, pod: str) -> str:
        """``http://127.0.0.1:PORT`` of the pod's local process (KeyError if not running)."""
        lp = self.get(namespace, pod)
        if lp is None:
            raise KeyError(f"no local process for pod {namespace}/{pod}; running: {sorted(self.pods)}")
        return lp.url

    def pods_for_selector(self, namespace: str, labels: dict[str, str]) -> list[LocalPod]:
        """Live local pods in `namespace` whose labels include all of `labels`, sorted by name."""
        with self._lock:
            found = [lp for (ns, _), lp in self.pods.items()
                     if ns == namespace and lp.alive() and all(lp.labels.get(k) == v for k, v in labels.items())]
        return sorted(found, key=lambda lp: lp.name)

    def urls_for_selector(self, namespace: str, labels: dict[str, str]) -> list[str]:
        """Local URLs a Service with this selector would route to: its Ready pods' processes."""
        return [lp.url for lp in self.pods_for_selector(namespace, labels) if lp.ready]

    def urls_for_service(self, namespace: str, service: str) -> list[str]:
        """Local URLs behind a Service (reads its ``spec.selector`` from the apiserver)."""
        svc = self._call(self._api.read_namespaced_service, service, namespace)
        return self.urls_for_selector(namespace, svc["spec"].get("selector") or {})

    def rewrite_url(self, url: str) -> str:
        """``http://<podIP>:<containerPort>/x`` -> ``http://127.0.0.1:<local port>/x`` (unchanged if
        no local pod has that IP)."""
        m = re.match(r"^(https?://)([^/:]+)(?::(\d+))?(.*)$", url)
        if not m:
            return url
        with self._lock:
            for lp in self.pods.values():
                if lp.pod_ip and lp.pod_ip == m.group(2):
                    local = lp.local_port(int(m.group(3)) if m.group(3) else None)
                    return f"{m.group(1)}127.0.0.1:{local}{m.group(4)}"
        return url

    def logs(self, namespace: str, pod: str) -> str:
        lp = self.get(namespace, pod)
        return lp.log_path.read_text(errors="replace") if lp else ""

    def wait_for_pod(self, namespace: str, pod: str, timeout: float = 60) -> LocalPod:
        """Wait until the pod's process runs and accepts TCP connections on its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lp = self.get(namespace, pod)
            if lp is not None:
                if not lp.alive():
                    raise RuntimeError(f"process of {namespace}/{pod} exited with {lp.returncode}:\n"
                                       f"{lp.proc.tail()}")
                if _port_open(lp.port):
                    return lp
            time.sleep(0.1)
        raise TimeoutError(f"pod {namespace}/{pod}: no listening local process after {timeout}s "
                           f"(running: {sorted(self.pods)}; errors: {self.errors[-3:]})")

    def wait_for_selector(self, namespace: str, labels: dict[str, str], count: int = 1,
                          timeout: float = 60) -> list[LocalPod]:
        """Wait until at least `count` matching processes listen; returns them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = [lp for lp in self.pods_for_selector(namespace, labels) if _port_open(lp.port)]
            if len(ready) >= count:
                return ready
            time.sleep(0.1)
        raise TimeoutError(f"{namespace} {labels}: fewer than {count} listening local processes after "
                           f"{timeout}s (running: {sorted(self.pods)}; errors: {self.errors[-3:]})")

    # ------------------------------------------------------------------ reconcile loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - keep the node alive, record the error
                err = traceback.format_exc()
                if not self.errors or self.errors[-1] != err:
                    self.errors.append(err)
                    del self.errors[:-50]
                    self._log.write(err)
            self._synced.set()
            self._stop.wait(self.poll_interval)
        # Stop the processes from this thread: they die with it (PR_SET_PDEATHSIG), so this is the
        # last moment for a graceful SIGTERM.
        with self._lock:
            self._stop_pods(list(self.pods), "pod node stopping", hooks=False)

    def reconcile(self) -> None:
        pods = self._call(self._api.list_pod_for_all_namespaces, label_selector=self.selector)["items"]
        wanted: dict[tuple[str, str], dict] = {}
        for pod in pods:
            md, spec, st = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
            if md.get("deletionTimestamp") or st.get("phase") not in ("Pending", "Running") \
                    or not spec.get("nodeName") or not st.get("podIP"):
                continue
            if self.namespaces is not None and md["namespace"] not in self.namespaces:
                continue
            wanted[(md["namespace"], md["name"])] = pod
        cm_cache: dict[tuple[str, str], dict | None] = {}
        with self._lock:
            gone = [k for k in self.pods if k not in wanted]
            replaced = [k for k, lp in self.pods.items() if k in wanted and wanted[k]["metadata"]["uid"] != lp.uid]
        # not under the lock: the other pods' clients keep finding them while these drain
        self._stop_pods(gone, "pod gone, deleting, not Running or outside `namespaces`")
        self._stop_pods(replaced, "pod replaced")
        with self._lock:
            for key, pod in wanted.items():
                if key not in self.pods:
                    try:
                        self._start_pod(pod, cm_cache)
                    except Exception as e:  # noqa: BLE001
                        self._record_error(f"cannot start {key[0]}/{key[1]}: {e!r}")
                        continue
                else:
                    self._sync_volumes(pod, self.pods[key], cm_cache)
                    self._tend(self.pods[key])
                self._report(self.pods[key])
            self._publish_targets()

    # ------------------------------------------------------------------ pods
    def _start_pod(self, pod: dict, cm_cache: dict) -> None:
        md, spec = pod["metadata"], pod["spec"]
        ns, name = md["namespace"], md["name"]
        container = spec["containers"][0]
        workdir = self.run_dir / f"{ns}_{name}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        mounts = self._materialize_volumes(pod, container, workdir, cm_cache)

        port = free_port()
        env_list = self._container_env(pod, container, cm_cache)
        env_list.update({"KVTUNE_PORT": str(port), "KVTUNE_HOST": "127.0.0.1"})
        env_list.update(self.extra_env)
        env_list = {k: _map_in_value(v, mounts) for k, v in env_list.items()}

        argv = [_expand(a, env_list) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not container.get("command"):
            raise ValueError("the container has no `command`: the local node cannot know the image's entrypoint")
        admin_local = free_port()  # used only if argv has an --admin-port
        argv, container_port, admin_container_port = _rewrite_port_args(argv, port, admin_local)
        if container_port is None:
            ports = container.get("ports") or []
            container_port = ports[0].get("containerPort") if ports else None
        port_map = {cp: lp_ for cp, lp_ in ((container_port, port), (admin_container_port, admin_local))
                    if cp is not None}
        scraped = _int(str((md.get("annotations") or {}).get("prometheus.io/port", "")))
        argv = [_map_in_value(a, mounts) for a in argv]
        argv = self._translate(pod, container, argv)

        env = {**os.environ, **env_list}
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
        grace = spec.get("terminationGracePeriodSeconds")
        status = ContainerStatus(name=container["name"], image=container.get("image", ""))
        # A pod this node ran before (a pod node restarted, or a namespace back in `namespaces`):
        # like a kubelet finding its exited container, count this start as a restart.
        before = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                       if c.get("name") == container["name"]), {})
        if before.get("containerID"):
            status.restart_count = int(before.get("restartCount") or 0) + 1
            status.ever_started = True
        ready_cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})
        if ready_cond.get("lastTransitionTime"):
            status.ready_since = ready_cond["lastTransitionTime"]
        lp = LocalPod(
            namespace=ns, name=name, uid=md["uid"], labels=dict(md.get("labels") or {}),
            node=spec.get("nodeName", ""), pod_ip=pod.get("status", {}).get("podIP", ""),
            container=container["name"], container_port=container_port, port=port, argv=argv,
            ports=port_map, metrics_port=port_map.get(scraped) if scraped is not None else None,
            workdir=workdir, proc=None, mounts=mounts,  # type: ignore[arg-type]  # _spawn sets it
            grace_seconds=min(float(grace if grace is not None else 10), 30.0),
            prestop_sleep_s=float((((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep")
                                   or {}).get("seconds") or 0),
            metrics_path=(md.get("annotations") or {}).get("prometheus.io/path", "/metrics"),
            env=env, status=status, backoff=BackOff(*self.backoff),
            readiness=Probe.from_spec(container.get("readinessProbe")),
            startup=Probe.from_spec(container.get("startupProbe")),
            termination_policy=container.get("terminationMessagePolicy"),
        )
        self._spawn(lp)
        self.pods[(ns, name)] = lp
        self._finalizer(lp, hold=True)
        threading.Thread(target=self._prober, args=(lp,), name=f"probe-{ns}/{name}", daemon=True).start()

    def _finalizer(self, lp: LocalPod, *, hold: bool) -> None:
        """Add (``hold``) or remove `FINALIZER` on the pod (a strategic merge: other finalizers stay)."""
        change = {"finalizers": [FINALIZER]} if hold else {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}
        try:
            self._call(self._api.patch_namespaced_pod, lp.name, lp.namespace, {"metadata": change},
                       _content_type="application/strategic-merge-patch+json")
        except _NotFound:
            pass
        except Exception as e:  # noqa: BLE001 - the apiserver is away: recorded, the pod stays as it is
            self._record_error(f"cannot {'add' if hold else 'remove'} the finalizer of {lp.namespace}/{lp.name}: {e!r}")

    def _record_error(self, msg: str) -> None:
        """Keep ``msg`` in `errors` (once; the last 50) and in the node's log: the node goes on."""
        if msg not in self.errors:
            self.errors.append(msg)
            del self.errors[:-50]
            self._log.write(msg + "\n")

    def _spawn(self, lp: LocalPod) -> None:
        """Start (or restart) the container's process; called from the reconcile thread only (the
        processes die with the thread that started them)."""
        log_path = self.run_dir / f"{lp.namespace}_{lp.name}.log"
        lp.log_offset = log_path.stat().st_size if log_path.exists() else 0
        lp.proc = ManagedProcess(f"{lp.namespace}/{lp.name}", lp.argv, log_path, env=lp.env, cwd=lp.workdir,
                                 die_with_parent=True)
        lp.run += 1
        st = lp.status
        st.container_id = f"local://{lp.proc.pid}"
        st.running_since, st.terminated, st.waiting = rfc3339(), None, None
        st.started = st.ready = False
        st.ever_started = True
        lp.exited = lp.finished = None
        self._log.write(f"{time.strftime('%H:%M:%S')} started {lp.namespace}/{lp.name} pid={lp.proc.pid} "
                        f"port={lp.port} restarts={st.restart_count} argv={lp.argv}\n")

    def _tend(self, lp: LocalPod) -> None:
        """The kubelet's part for a container that exits: record how it ended, then restart it at
        once the first time, after the back-off (CrashLoopBackOff) the times after."""
        st = lp.status
        code = lp.proc.popen.poll()
        if st.running_since is not None and code is not None:
            lp.finished = time.monotonic()
            finished_at = rfc3339()
            lp.proc.stop(timeout=0.5)  # what is left of its process group; closes the log
            exit_code = code if code >= 0 else 128 - code
            message = termination_message(lp.log_path, lp.log_offset, exit_code, lp.termination_policy)
            lp.exited = terminated_state(exit_code, message, st.running_since, finished_at, st.container_id)
            st.running_since, st.terminated, st.ready, st.started = None, lp.exited, False, False
            self._log.write(f"{time.strftime('%H:%M:%S')} exited {lp.namespace}/{lp.name} code={exit_code} "
                            f"restarts={st.restart_count}\n")
            return  # reported as terminated first; the restart decision is the next poll's
        if st.running_since is None and lp.finished is not None:
            if lp.backoff.in_backoff_since(lp.finished, time.monotonic()):
                st.terminated, st.last_terminated = None, lp.exited
                st.waiting = {"reason": "CrashLoopBackOff", "message":
                              f"back-off {go_duration(lp.backoff.current)} restarting failed "
                              f"container={lp.container} pod={lp.name}_{lp.namespace}({lp.uid})"}
                return
            lp.backoff.next(lp.finished)
            st.last_terminated = lp.exited
            st.restart_count += 1
            self._spawn(lp)

    def _report(self, lp: LocalPod) -> None:
        """Patch pods/status when what the node reports has changed."""
        patch = lp.status.patch()
        text = json.dumps(patch, sort_keys=True)
        if text == lp.last_patch:
            return
        try:
            self._call(self._api.patch_namespaced_pod_status, lp.name, lp.namespace, patch,
                       _content_type="application/strategic-merge-patch+json")
        except _NotFound:
            return
        except Exception as e:  # noqa: BLE001 - the apiserver is away: the next poll tries again
            self._record_error(f"cannot patch the status of {lp.namespace}/{lp.name}: {e!r}")
            return
        lp.last_patch = text

    def _prober(self, lp: LocalPod) -> None:
        """The kubelet's prober for one container: startup probe, then readiness (see the module doc)."""
        successes = failures = 0
        run = 0
        while not lp.stopping.is_set():
            st = lp.status
            if run != lp.run:  # a new run starts unready
                run, successes, failures = lp.run, 0, 0
            if st.running_since is None or not lp.alive():
                lp.stopping.wait(self.probe_interval)
                continue
            if not st.started:
                if lp.startup is not None and not lp.startup.check(lp.port):
                    lp.stopping.wait(self.probe_interval)
                    continue
                if run == lp.run:
                    st.started = True
            if lp.readiness is None:
                ok = True
            else:
                ok = lp.readiness.check(lp.port)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if run == lp.run and st.running_since is not None:
                if ok and successes >= (lp.readiness.success_threshold if lp.readiness else 1):
                    st.ready = True
                elif not ok and (not st.ready or failures >= lp.readiness.failure_threshold):
                    st.ready = False
            period = lp.readiness.period if (lp.readiness and st.ready) else self.probe_interval
            lp.stopping.wait(period)

    def _stop_pods(self, keys: list[tuple[str, str]], why: str, *, hooks: bool = True) -> None:
        """Out of the Services at once (``urls_for_selector``); the ``preStop`` sleep, in which they
        still serve the requests sent before; SIGTERM to their main processes; SIGKILL to what is
        left of their groups at the end of the grace period. A container runtime signals the
        container's PID 1 only, which stops its own children (vLLM's API server drains its
        requests; its engine and worker signalled too would die first)."""
        with self._lock:
            lps = [lp for lp in (self.pods.pop(k, None) for k in keys) if lp is not None]
        if not lps:
            return
        deadline = time.monotonic() + max(lp.grace_seconds for lp in lps)
        hook = max((lp.prestop_sleep_s for lp in lps if lp.exited is None), default=0.0) if hooks else 0.0
        time.sleep(min(hook, max(0.0, deadline - time.monotonic())))
        for lp in lps:
            lp.stopping.set()  # ends its prober
            if lp.exited is not None:
                continue  # exited and reaped already: its pid may belong to someone else by now
            try:
                os.kill(lp.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        while time.monotonic() < deadline and any(lp.proc.popen.poll() is None for lp in lps):
            time.sleep(0.05)
        for lp in lps:
            if lp.exited is None:  # (else `_tend` has stopped and reaped it)
                lp.proc.stop(timeout=0.5)  # SIGKILLs leftovers of the group, reaps, closes the log
            self._finalizer(lp, hold=False)  # a deleted pod goes now, as a kubelet's does once stopped
            self._log.write(f"{time.strftime('%H:%M:%S')} stopped {lp.namespace}/{lp.name} ({why}), "
                            f"rc={lp.returncode}\n")

    def _translate(self, pod: dict, container: dict, argv: list[str]) -> list[str]:
        if self.translate is not None:
            return list(self.translate(pod, container, argv))
        return self.default_translate(argv)

    def default_translate(self, argv: list[str]) -> list[str]:
        """`command_map`, then ``python`` -> this interpreter, then PATH with this venv first (what a
        `translate` function may fall back to)."""
        head, rest = argv[0], argv[1:]
        if head in self.command_map:
            return list(self.command_map[head]) + rest
        if os.path.basename(head) in ("python", "python3") or re.fullmatch(r"python3\.\d+", os.path.basename(head)):
            return [sys.executable] + rest
        venv_bin = str(Path(sys.executable).parent)
        found = shutil.which(os.path.basename(head), path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
        if not os.path.isabs(head) and found:
            return [found] + rest
        if os.path.isabs(head) and not os.path.exists(head) and found:
            return [found] + rest
        return argv

    # ------------------------------------------------------------------ env and volumes
    def _container_env(self, pod: dict, container: dict, cm_cache: dict) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                cm = self._configmap(ns, src["configMapRef"]["name"], cm_cache) or {}
                env.update({prefix + k: v for k, v in (cm.get("data") or {}).items()})
            elif "secretRef" in src:
                sec = self._secret(ns, src["secretRef"]["name"]) or {}
                env.update({prefix + k: v for k, v in _decode_secret(sec).items()})
        for item in container.get("env") or []:
            name = item["name"]
            if "valueFrom" not in item:
                env[name] = _expand(item.get("value", ""), env)
                continue
            vf = item["valueFrom"]
            if "fieldRef" in vf:
                env[name] = _field(pod, vf["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                cm = self._configmap(ns, ref["name"], cm_cache) or {}
                env[name] = (cm.get("data") or {}).get(ref["key"], "")
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                env[name] = _decode_secret(self._secret(ns, ref["name"]) or {}).get(ref["key"], "")
            else:  # resourceFieldRef: not simulated
                env[name] = ""
        return env

    def _materialize_volumes(self, pod: dict, container: dict, workdir: Path, cm_cache: dict) -> list[tuple[str, Path]]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: list[tuple[str, Path]] = []
        for vm in container.get("volumeMounts") or []:
            vol = volumes.get(vm["name"])
            if vol is None:
                continue
            if "configMap" in vol or "emptyDir" in vol:
                local = workdir / "volumes" / vm["name"]
                local.mkdir(parents=True, exist_ok=True)
                if vm.get("subPath"):
                    local = local / vm["subPath"]
                mounts.append((vm["mountPath"].rstrip("/") or "/", local))
        self._sync_volumes(pod, None, cm_cache, workdir=workdir)
        # Longest mount path first, so nested mounts win.
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def _sync_volumes(self, pod: dict, lp: LocalPod | None, cm_cache: dict, workdir: Path | None = None) -> None:
        workdir = workdir or (lp.workdir if lp else None)
        ns = pod["metadata"]["namespace"]
        for vol in pod["spec"].get("volumes") or []:
            if "configMap" not in vol:
                continue
            src = vol["configMap"]
            cm = self._configmap(ns, src["name"], cm_cache)
            local = workdir / "volumes" / vol["name"]
            if not local.is_dir():
                continue  # not mounted by our container
            if cm is None:
                continue  # optional or not yet there: leave the directory as it is
            files: dict[str, bytes] = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            import base64

            files.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
            if src.get("items"):
                files = {it["path"]: files[it["key"]] for it in src["items"] if it["key"] in files}
            for rel, content in files.items():
                target = local / rel
                if target.is_file() and target.read_bytes() == content:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name("." + target.name + ".tmp")
                tmp.write_bytes(content)
                os.replace(tmp, target)
            for existing in local.rglob("*"):
                if existing.is_file() and str(existing.relative_to(local)) not in files:
                    existing.unlink()

    def _configmap(self, ns: str, name: str, cache: dict) -> dict | None:
        key = (ns, name)
        if key not in cache:
            try:
                cache[key] = self._call(self._api.read_namespaced_config_map, name, ns)
            except _NotFound:
                cache[key] = None
        return cache[key]

    def _secret(self, ns: str, name: str) -> dict | None:
        try:
            return self._call(self._api.read_namespaced_secret, name, ns)
        except _NotFound:
            return None

    def _call(self, fn, *args, **kwargs) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=10, **kwargs)
        except ApiException as e:
            if e.status == 404:
                raise _NotFound(str(e)) from None
            raise
        return json.loads(resp.data)

    # ------------------------------------------------------------------ prometheus
    def _publish_targets(self) -> None:
        if not self.sd_file:
            return
        groups = []
        for (ns, name), lp in sorted(self.pods.items()):
            if not lp.alive():
                continue
            labels = {"namespace": ns, "pod": name, "container": lp.container, "node": lp.node,
                      "inference_deployment": lp.labels.get(DEPLOYMENT_LABEL, "")}
            if lp.metrics_path != "/metrics":
                labels["__metrics_path__"] = lp.metrics_path
            groups.append({"targets": [f"127.0.0.1:{lp.metrics_port or lp.port}"], "labels": labels})
        text = json.dumps(groups, sort_keys=True)
        if text != self._last_sd:
            write_sd_file(self.sd_file, groups)
            self._last_sd = text


class _NotFound(Exception):
    pass


def _decode_secret(sec: dict) -> dict[str, str]:
    import base64

    out = {k: base64.b64decode(v).decode(errors="replace") for k, v in (sec.get("data") or {}).items()}
    out.update(sec.get("stringData") or {})
    return out


def _field(pod: dict, path: str) -> str:
    md = pod["metadata"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (md.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": md.get("name"), "metadata.namespace": md.get("namespace"), "metadata.uid": md.get("uid"),
        "spec.nodeName": pod["spec"].get("nodeName"), "spec.serviceAccountName": pod["spec"].get("serviceAccountName"),
        "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
    }
    return str(simple.get(path) or "")


def _expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` escapes are left as they are)."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), s)


def _rewrite_port_args(argv: list[str], port: int, admin_port: int | None = None
                       ) -> tuple[list[str], int | None, int | None]:
    """``argv`` with ``--port`` (and ``--admin-port``) set to the local ports and ``--host`` to
    loopback; the container ports they replaced."""
    local = {"--port": port, "--admin-port": admin_port}
    original: dict[str, int | None] = {"--port": None, "--admin-port": None}
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag, _, value = a.partition("=")
        if flag in local and local[flag] is not None and (value or i + 1 < len(argv)):
            original[flag] = _int(value if value else argv[i + 1])
            out += [f"{flag}={local[flag]}"] if value else [flag, str(local[flag])]
            i += 1 if value else 2
            continue
        if a == "--host" and i + 1 < len(argv):
            out += ["--host", "127.0.0.1"]
            i += 2
            continue
        out.append("--host=127.0.0.1" if a.startswith("--host=") else a)
        i += 1
    return out, original["--port"], original["--admin-port"]


def _int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def _map_path(path: str, mounts: list[tuple[str, Path]]) -> str:
    for mount_path, local in mounts:
        if path == mount_path:
            return str(local)
        if path.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + path[len(mount_path.rstrip("/")):]
    return path


def _map_in_value(value: str, mounts: list[tuple[str, Path]]) -> str:
    """Rewrite a container path in an argument or env value: ``/cfg/x``, ``--config=/cfg/x``,
    ``a=/cfg/x``."""
    mapped = _map_path(value, mounts)
    if mapped != value:
        return mapped
    if "=" in value:
        k, v = value.split("=", 1)
        mv = _map_path(v, mounts)
        if mv != v:
            return f"{k}={mv}"
    return value


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
