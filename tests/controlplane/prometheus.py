"""A real Prometheus server (Debian's ``prometheus`` package) for tests.

It scrapes, every second, the targets listed in a file-based service discovery file
(`Prometheus.sd_file`, Prometheus' ``file_sd_configs`` JSON format) that
`tests.controlplane.node.PodNode` keeps up to date with the engine processes it runs, labelled
``namespace``, ``pod``, ``container`` and ``inference_deployment`` (what a PodMonitor would give).
Tests can also publish their own targets with `set_targets` (a different SD file, so both coexist).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable

from .harness import RUN_ROOT, ManagedProcess, free_port

SCRAPE_INTERVAL = "1s"


class PrometheusMissing(RuntimeError):
    pass


def prometheus_binary() -> str:
    path = os.environ.get("KVTUNE_PROMETHEUS_BIN") or shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.access(path, os.X_OK):
        raise PrometheusMissing(
            "the prometheus server binary is missing: install Debian's package "
            "(apt-get update && apt-get install -y prometheus), or run: bash tests/controlplane/setup.sh")
    return path


class Prometheus:
    """A Prometheus process on 127.0.0.1 with a 1 s scrape interval and file-based SD.

    Attributes once started:
      url        ``http://127.0.0.1:PORT`` (for ``prometheus_api_client.PrometheusConnect(url)``).
      sd_file    the SD file the pod node writes (job ``kvtune-engine``, path ``/metrics``).
      extra_sd_file  SD file for targets a test publishes itself with `set_targets` (job ``extra``).
      run_dir    config, TSDB and ``prometheus.log``.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, *, detached: bool = False,
                 keep_run_dir: bool | None = None):
        self.detached = detached
        self.keep_run_dir = bool(os.environ.get("KVTUNE_CP_KEEP")) if keep_run_dir is None else keep_run_dir
        self._given_run_dir = Path(run_dir) if run_dir else None
        self.run_dir: Path | None = None
        self.proc: ManagedProcess | None = None
        self.url = ""
        self.port = 0
        self.sd_file: Path | None = None
        self.extra_sd_file: Path | None = None
        self.started_in: float | None = None

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> "Prometheus":
        binary = prometheus_binary()
        t0 = time.monotonic()
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        if self._given_run_dir:
            self.run_dir = self._given_run_dir
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir.mkdir(parents=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"prom-{os.getpid()}-", dir=RUN_ROOT))
        rd = self.run_dir
        self.sd_file = rd / "targets-kvtune-engine.json"
        self.extra_sd_file = rd / "targets-extra.json"
        for f in (self.sd_file, self.extra_sd_file):
            write_sd_file(f, [])
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL,
                       "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "kvtune-engine", "metrics_path": "/metrics",
                 "file_sd_configs": [{"files": [str(self.sd_file)], "refresh_interval": "1s"}]},
                {"job_name": "extra", "metrics_path": "/metrics",
                 "file_sd_configs": [{"files": [str(self.extra_sd_file)], "refresh_interval": "1s"}]},
            ],
        }
        (rd / "prometheus.yml").write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if not self.detached:
            atexit.register(self.stop)
        self._launch(binary, timeout)
        self.started_in = time.monotonic() - t0
        return self

    def _launch(self, binary: str, timeout: float) -> None:
        rd = self.run_dir
        self.proc = ManagedProcess("prometheus", [
            binary, f"--config.file={rd / 'prometheus.yml'}", f"--storage.tsdb.path={rd / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
            "--web.enable-lifecycle", "--log.level=warn",
        ], rd / "prometheus.log", die_with_parent=not self.detached, cwd=rd)
        self._write_state()
        deadline = time.monotonic() + timeout
        while True:
            if not self.proc.alive():
                tail = self.proc.tail()
                self.stop(remove=False)
                raise RuntimeError(f"prometheus exited (code {self.proc.popen.returncode}):\n{tail}")
            if _http_status(self.url + "/-/ready") == 200:
                break
            if time.monotonic() > deadline:
                self.stop(remove=False)
                raise TimeoutError(f"prometheus not ready after {timeout}s; log {rd / 'prometheus.log'}")
            time.sleep(0.1)

    @contextlib.contextmanager
    def down(self, timeout: float = 30.0):
        """An outage: the server stops (SIGTERM) and, on leaving the block, starts again on the same
        port and the same storage, as a restarted Prometheus pod with a persistent volume would; the
        scrapes of the outage are missing."""
        assert self.proc is not None and self.run_dir is not None
        self.proc.stop()
        try:
            yield self
        finally:
            self._launch(prometheus_binary(), timeout)

    def stop(self, remove: bool | None = None) -> None:
        atexit.unregister(self.stop)
        if self.proc is not None:
            self.proc.stop()
        if remove is None:
            remove = not self.keep_run_dir
        if remove and self.run_dir and self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def set_targets(self, targets: Iterable[tuple[str, dict]]) -> None:
        """Publish ``[(host:port, labels), ...]`` as the ``extra`` job's targets."""
        assert self.extra_sd_file is not None
        write_sd_file(self.extra_sd_file, [{"targets": [t], "labels": dict(lbl)} for t, lbl in targets])

    def query(self, promql: str) -> list[dict]:
        """Instant query via the HTTP API (``/api/v1/query``); returns ``data.result``."""
        from urllib.parse import urlencode

        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urlencode({'query': promql})}", timeout=10) as r:
            return json.loads(r.read())["data"]["result"]

    def active_targets(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=10) as r:
            return json.loads(r.read())["data"]["activeTargets"]

    def _write_state(self) -> None:
        assert self.run_dir is not None and self.proc is not None
        state = {"owner_pid": None if self.detached else os.getpid(), "pgids": {"prometheus": self.proc.pid},
                 "url": self.url, "sd_file": str(self.sd_file)}
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2))


def write_sd_file(path: Path, groups: list[dict]) -> None:
    """Atomically replace a file_sd JSON file (Prometheus watches it and re-reads it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=2))
    os.replace(tmp, path)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0
