"""The engine as the demo runs it: a `kvtune serve` child process on a free loopback port."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ..prometheus import tls_context


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free loopback port for a server to bind, outside the kernel's ephemeral range.

    A port bound to 0 comes from that range, and any outgoing connection of any process can take it
    as its local port between this choice and the server's bind (seen: 30 engines under load, one
    restarted engine failing with "Address already in use"). Ports outside it go only to who binds
    them; none is handed out twice by this process (a restarting server keeps its port)."""
    lo, hi = _ephemeral_range()
    pool = range(10000, lo) if lo - 10000 >= 1000 else range(hi + 1, 65536)
    for _ in range(256):
        port = random.choice(pool)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag_args(flags: dict[str, Any]) -> list[str]:
    """EngineConfig-style fields -> vLLM-style flags."""
    out = []
    for k, v in flags.items():
        name = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(name if v else "--no-" + name[2:])
        elif v is not None:
            out += [name, str(v)]
    return out


class EngineProcess:
    """``kvtune serve`` as a child process: the real engine on a model on CPU standing in for a device
    of ``device_memory_gib``, or (``simulate``: a profile name) the simulated engine of that profile."""

    def __init__(self, model_dir: Path | None, flags: dict[str, Any], *, device_memory_gib: float, log_path: Path,
                 simulate: str | None = None):
        self.model_dir, self.flags, self.device_memory_gib, self.log_path = model_dir, dict(flags), device_memory_gib, log_path
        self.simulate = simulate
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        what = (["--simulate", self.simulate] if self.simulate else
                ["--model", str(self.model_dir), "--device", "cpu", "--device-memory", str(self.device_memory_gib)])
        argv = [sys.executable, "-c", "from kvtune_operator.cli import main; main()", "serve", *what,
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *flag_args(self.flags)]
        self.log = open(self.log_path, "ab")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0, verify=tls_context()).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the engine did not become healthy in {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()
