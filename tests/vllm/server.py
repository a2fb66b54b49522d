"""Start and stop a real `vllm serve` (the CPU build installed by tests/vllm/setup.sh).

Interface (stable; tests/ and bench/ rely on it)::

    from tests.vllm.server import VllmServer, vllm_bin, VllmNotInstalled, spawn_logged, wait_healthy
    with VllmServer(model_dir, run_dir, kv_cache_gib=1.0,
                    args=["--max-num-seqs", "4", "--max-model-len", "1024"], env={...}) as srv:
        srv.url          # "http://127.0.0.1:PORT" (a free loopback port), /health already answered
        srv.metrics()    # the /metrics text
        srv.log_path     # vLLM's stdout+stderr
    # leaving the block (or srv.stop()) kills the API server; it ends its engine-core children

    python -m tests.vllm.server MODEL_DIR [vllm flags...]   # serve until Ctrl-C, prints the URL

``vllm_bin()`` raises ``VllmNotInstalled`` (message: run ``bash tests/vllm/setup.sh``) when the venv
is missing; tests call it so that a missing vLLM FAILS them, never skips them. ``VLLM_VENV``
overrides the venv location (default ``.venv-vllm/`` at the repo root).

Why the environment below: vLLM's caches (torch.compile, triton, HF,
its ZMQ socket files) go under ``run_dir`` instead of $HOME and /tmp -- except where ``run_dir`` is
too deep for a socket path (107 bytes; pytest-xdist's ``popen-gwN`` adds a level), then TMPDIR is a
short ``/tmp/kvv-*`` the server removes when it stops; ``HF_HUB_OFFLINE=1`` and
``VLLM_NO_USAGE_STATS=1`` keep it off the network; ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache
(whole GiB; a fractional ``kv_cache_gib`` goes as ``--kv-cache-memory-bytes``) and ``VLLM_CPU_OMP_THREADS_BIND=0-1`` gives the model both cores. Models need head_dim >= 32
(``kvtune make-tiny-model DIR --head-dim 32``): vLLM's CPU attention refuses smaller ones.
"""
from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from kvtune_operator.demo.engine import free_port  # noqa: F401  (bench imports it from here)

REPO = Path(__file__).resolve().parents[2]


class VllmNotInstalled(RuntimeError):
    """Real vLLM is not set up; the message says how to set it up."""


def vllm_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV") or REPO / ".venv-vllm")


def vllm_bin() -> Path:
    """Path of the ``vllm`` executable, or VllmNotInstalled saying to run setup.sh."""
    exe = vllm_venv() / "bin" / "vllm"
    if not exe.is_file() or not any(vllm_venv().glob(".kvtune-vllm-*")):
        raise VllmNotInstalled(
            f"real vLLM is not installed in {vllm_venv()}; install it with:  bash tests/vllm/setup.sh")
    return exe


def spawn_logged(argv: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A server process in its own session (its children go with it), stdout+stderr appended to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str,
                 log_tail: Callable[[], str], interval_s: float = 0.5) -> None:
    """Poll ``url``/health until it answers 200; RuntimeError (with the log's tail) if the process
    exits first, TimeoutError after ``timeout_s``. Shared by the vLLM and kvtune servers of tests/bench."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before /health:\n{log_tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not healthy after {timeout_s:.0f}s:\n{log_tail()}")


# For the tests' vLLMs, not the benchmarks': no torch.compile of the model. It starts in ~27 s instead of
# ~50 on two cores (measured with the tests' tiny model), and steps run ~1.5x slower; what the tests
# judge (vLLM's metrics, its scheduling under a cap or a small cache, the operator's rollout) does
# not depend on the compiled kernels. The benchmarks compare with vLLM at its defaults.
TEST_ARGS = ["--enforce-eager"]
# For the same vLLMs: the model worker inside the engine-core process (vLLM's uni executor; on CPU vLLM
# picks the multiprocess one unless this variable is 0). The multiprocess worker spins on its shared-memory
# queue for a second after each step (shm_broadcast's SpinCondition, sched_yield): at 2 requests/s on
# the tests' tiny model it used 1.05 cores against 0.16 in-process, and a start-up 25 CPU-s against 16.
# On two cores shared with a control plane, an operator and the other test worker, that spin starved
# the neighbours. What the tests judge (the API, the metrics, the scheduling) is the same.
# And one compute thread, placed by the kernel (no binding), as the tests' kvtune engines have: at two
# threads each, a canary test's three vLLM pods under load wanted six cores, and the tests on the other
# worker (engine start-ups of 3 CPU-s) took ten times as long beside them (make test, issue 18).
TEST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


# vLLM binds ZMQ sockets at "ipc://<VLLM_RPC_BASE_PATH>/<uuid4>": 6 + 1 + 36 bytes besides the
# directory, and a Unix socket path holds at most 107 bytes (8 more kept spare)
SOCKET_DIR_MAX = 107 - 43 - 8


def vllm_env(run_dir: Path, kv_cache_gib: float, threads_bind: str = "0-1",
             tmp: Path | None = None) -> dict[str, str]:
    """The environment for ``vllm serve``: caches under run_dir, offline, KV space, thread binding;
    TMPDIR and the socket files in ``tmp`` (default ``run_dir/tmp``)."""
    run_dir = Path(run_dir)
    tmp = Path(tmp) if tmp is not None else run_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor-cache"),
        "TRITON_CACHE_DIR": str(run_dir / "triton-cache"),
        "HF_HOME": str(run_dir / "hf-home"),
        "TMPDIR": str(tmp),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
    })
    env.pop("VIRTUAL_ENV", None)
    if float(kv_cache_gib).is_integer():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    else:  # vLLM reads the variable as whole GiB; a fraction goes as --kv-cache-memory-bytes (serve_argv)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def serve_argv(model_dir: Path | str, port: int, args: Sequence[str] = (), kv_cache_gib: float = 1.0) -> list[str]:
    """``vllm serve`` command line; --dtype float32 and --max-model-len 2048 unless args set them;
    a fractional ``kv_cache_gib`` as ``--kv-cache-memory-bytes``."""
    argv = [str(vllm_bin()), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    if not float(kv_cache_gib).is_integer() and "--kv-cache-memory-bytes" not in args:
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 1024 ** 3))]
    if "--dtype" not in args:
        argv += ["--dtype", "float32"]
    if "--max-model-len" not in args:
        argv += ["--max-model-len", "2048"]
    return argv + list(args)


class LoggedServer:
    """A server process on a loopback port, its output in ``log_path`` (``spawn_logged``): started
    and waited for healthy, stopped with SIGTERM to it, then SIGKILL to what is left of its session.
    Subclasses set ``argv``, ``env``, ``url``, ``log_path`` and ``what``."""

    what = "server"
    argv: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    cwd: Path | None = None
    start_timeout_s = 300.0
    proc: subprocess.Popen | None = None
    #: starts on a new port when another process took the chosen one before the server bound it (vLLM
    #: binds ~20 s after it starts; seen once with two test workers starting control planes beside it)
    bind_tries = 3

    def start(self, timeout_s: float | None = None):
        for attempt in range(1, self.bind_tries + 1):
            self.proc = spawn_logged(self.argv, self.env, self.log_path, cwd=self.cwd)
            try:
                wait_healthy(self.proc, self.url, timeout_s or self.start_timeout_s, self.what, self.log_tail)
                return self
            except RuntimeError:
                if attempt < self.bind_tries and "Address already in use" in self.log_tail() \
                        and self.use_port(free_port()):
                    print(f"  {self.what}: its port was taken before it bound it; again on port {self.port}",
                          file=sys.stderr)
                    self.stop()
                    continue
                raise
            except TimeoutError:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def use_port(self, port: int) -> bool:
        """Move the server to ``port`` before a new start; False where the subclass cannot."""
        return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server (it ends its own children); SIGKILL its session if anything lingers."""
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is not None:
            print(f"  {self.what} had exited with status {p.returncode}", file=sys.stderr)
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # leftovers of its own session (vLLM's engine core), if any
        except ProcessLookupError:
            pass
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


class VllmServer(LoggedServer):
    """One real ``vllm serve`` process on a free loopback port (context manager); start-up is 40-80 s
    of torch.compile on two cores."""

    what = "vllm serve"
    start_timeout_s = 420.0

    def __init__(self, model_dir: Path | str, run_dir: Path | str, *, kv_cache_gib: float = 1.0,
                 args: Sequence[str] = (), port: int | None = None, threads_bind: str = "0-1",
                 env: dict[str, str] | None = None):
        self.model_dir = Path(model_dir)
        self.run_dir = self.cwd = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.args, self.kv_cache_gib = list(args), kv_cache_gib
        self.use_port(port or free_port())
        tmp = self.run_dir / "tmp"
        self.short_tmp = Path(tempfile.mkdtemp(prefix="kvv-", dir="/tmp")) if len(str(tmp)) > SOCKET_DIR_MAX else None
        self.env = {**vllm_env(self.run_dir, kv_cache_gib, threads_bind, tmp=self.short_tmp or tmp), **(env or {})}
        self.proc = None

    def use_port(self, port: int) -> bool:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = serve_argv(self.model_dir, port, self.args, self.kv_cache_gib)
        self.log_path = self.run_dir / f"vllm-{port}.log"
        return True

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def __enter__(self) -> "VllmServer":
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # pytest shows captured stdout with the failure: what vLLM said last
            print(f"--- {self.log_path} (last lines) ---\n{self.log_tail(80)}", flush=True)
        self.stop()

    def start(self, timeout_s: float | None = None):
        Path(self.env["TMPDIR"]).mkdir(parents=True, exist_ok=True)  # again after a stop removed it
        return super().start(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        if self.short_tmp is not None:
            shutil.rmtree(self.short_tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.vllm.server MODEL_DIR [vllm flags...]", file=sys.stderr)
        return 2
    run_dir = REPO / "out" / "vllm-run"
    srv = VllmServer(argv[0], run_dir, args=argv[1:])
    with srv:
        print(f"vLLM serving {argv[0]} at {srv.url} (log {srv.log_path})", flush=True)
        try:
            while srv.proc and srv.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
