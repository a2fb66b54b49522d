"""Fixtures for the engine, server, metrics and offline tests (import them by name from a test module).

* ``tiny_llama`` (session): conftest.py's tiny random Llama (``tiny_model("llama")``).
* ``run_server(...)``: a context manager running the real FastAPI app under uvicorn on a free
  loopback port (socket bound here, so no port race), yielding a ``Srv`` with the URL and engine.
* ``ScriptedRunner``: a Runner that emits scripted tokens (detokenization and stop-string tests
  without a model).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.batch import Batch, StepOutput

# Small and quick: a 2-layer model, a few hundred KV blocks, a tiny swap pool.
TEST_FLAGS: dict[str, Any] = dict(kv_cache_memory=0.004, swap_space=0.002, max_model_len=512,
                                  max_num_batched_tokens=512, block_size=16)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Path:
    """The shared session tiny Llama of conftest.py (2 layers, hidden 64, vocab 512)."""
    return tiny_model("llama")


def set_test_threads() -> None:
    """One torch thread unless KVTUNE_TEST_TORCH_THREADS says otherwise: on a small shared machine,
    two OpenMP threads of tiny ops under oversubscription run ~40x slower than one."""
    import torch
    torch.set_num_threads(int(os.environ.get("KVTUNE_TEST_TORCH_THREADS", "1")))


def build_engine(model_dir: Path, **flags: Any):
    from kvtune_engine.builder import build_engine as build
    set_test_threads()
    # a flag given as None is left unset (the engine's default, e.g. max_model_len from the model)
    cfg = EngineConfig.build(**{k: v for k, v in {**TEST_FLAGS, **flags}.items() if v is not None})
    return build(str(model_dir), cfg, device="cpu", seed=0)


@dataclass
class Srv:
    url: str            # http://127.0.0.1:PORT
    engine: Any
    app: Any
    admin_key: str | None = None   # sent on the admin API by state() and wait_idle()

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def get_json(self, path: str, headers: dict | None = None) -> Any:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def state(self) -> dict:
        return self.get_json("/kvtune/v1/state",
                             {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Wait until nothing runs or waits; return the state then."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            q = st["queues"]
            if q["running"] == 0 and q["waiting"] == 0 and q["swapped"] == 0 and st["blocks"]["used"] == 0:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {st['queues']} {st['blocks']}")
            time.sleep(0.05)


@contextlib.contextmanager
def run_server(model_dir: Path, *, api_key: str | None = None, max_waiting: int | None = None,
               config_file: str | Path | None = None, watch_interval_s: float = 0.1, host: str = "127.0.0.1",
               server_settings: dict[str, Any] | None = None, **flags: Any):
    """``host``: the address to bind (``0.0.0.0`` to be reached on a non-loopback address too);
    ``server_settings``: more ServerSettings fields (admin_key, max_body_bytes, ...)."""
    import uvicorn

    from kvtune_engine.server.app import ServerSettings, create_app
    from kvtune_engine.server.config_watch import ConfigFileWatcher

    engine = build_engine(model_dir, **flags)
    watcher = None
    if config_file is not None:
        watcher = ConfigFileWatcher(config_file, interval_s=watch_interval_s)
        watcher.prime(ConfigFileWatcher.digest(config_file))
    app = create_app(engine, ServerSettings(api_key=api_key, max_waiting=max_waiting, model_dir=str(model_dir),
                                            **(server_settings or {})),
                     config_watcher=watcher)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield Srv(f"http://127.0.0.1:{port}", engine, app, (server_settings or {}).get("admin_key"))
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()


class ScriptedRunner:
    """Runner that samples tokens from a script: ``script[request_id]`` (or a default list)."""

    def __init__(self, script: dict[str, list[int]] | None = None, default: list[int] | None = None):
        self.script = script or {}
        self.default = default or []
        self.num_steps = 0

    def execute(self, batch: Batch) -> StepOutput:
        self.num_steps += 1
        toks: list[int | None] = []
        for s in batch.seqs:
            if not s.sample:
                toks.append(None)
                continue
            seq = self.script.get(s.request.request_id, self.default)
            i = len(s.request.output_token_ids)
            toks.append(seq[i] if i < len(seq) else seq[-1])
        return StepOutput(tokens=toks, duration_s=0.0)


def scripted_engine(model_dir: Path, script: dict[str, list[int]] | None = None, *,
                    default: list[int] | None = None, num_blocks: int = 64, num_swap_blocks: int = 0, **flags):
    """An LLMEngine with the real tokenizer and scheduler but a ScriptedRunner (no model)."""
    from kvtune_engine.core.scheduler import Scheduler
    from kvtune_engine.engine import LLMEngine
    from kvtune_engine.model import load_tokenizer

    cfg = EngineConfig.build(**{**TEST_FLAGS, **flags})
    tok = load_tokenizer(model_dir)
    return LLMEngine(cfg, Scheduler(cfg, num_blocks, num_swap_blocks), ScriptedRunner(script, default), tok,
                     model_name="scripted", eos_token_ids=tok.eos_token_ids, vocab_size=tok.vocab_size)
