"""`kvtune serve` with flags its model and device cannot run: the real process exits 1 with one
line naming the flag and the figures, and no traceback. That line is what a pod's termination
message shows (FallbackToLogsOnError), so it must be true: the value it asks for starts the engine,
one step below it does not."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest_engine import tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.kv.sizing import format_bytes
from kvtune_operator.demo.engine import free_port  # noqa: F401  (test_admin_port & co. import it from here)

pytestmark = pytest.mark.slow

KVTUNE = os.path.join(os.path.dirname(sys.executable), "kvtune")
DEVICE_GIB = 0.01  # the CPU stands in for a 10 MiB device: the tiny model's weights are ~0.5 MiB
BLOCK_BYTES = 16 * 512  # --block-size 16 x (2 layers x K,V x 2 KV heads x head dim 16 x float32)


def weights_bytes(model: Path) -> int:
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def serve(model: Path, *flags: str, timeout: float = 120) -> tuple[int | None, str, str]:
    """Run `kvtune serve`; (exit code, stdout, stderr) if it exits, (None, '', '') once /health
    answers 200 (then it is stopped). At --block-size 16 (BLOCK_BYTES) unless ``flags`` say another
    (the last one given wins): the CPU's default is 128 (knobs.CPU_BLOCK_SIZE)."""
    port = free_port()
    p = subprocess.Popen([KVTUNE, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                          "--max-model-len", "256", "--max-num-batched-tokens", "256", "--swap-space", "0",
                          "--block-size", "16", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if p.poll() is not None:
                out, err = p.communicate()
                return p.returncode, out, err
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return None, "", ""
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("kvtune serve neither exited nor served")
    finally:
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=30)


def the_line(code: int | None, out: str, err: str) -> str:
    """The one line of a failed start: exit status 1, last line on stderr, no traceback."""
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("kvtune serve: "), err
    assert [ln for ln in lines if ln.startswith("kvtune serve:")] == [lines[-1]]
    return lines[-1]


def test_weights_do_not_fit_names_flag_figures_and_the_least_value_that_runs(tiny_llama):  # noqa: F811
    device = int(DEVICE_GIB * 2**30)
    line = the_line(*serve(tiny_llama, "--device-memory", str(DEVICE_GIB), "--gpu-memory-utilization", "0.05"))
    weights = weights_bytes(tiny_llama)
    assert line.startswith("kvtune serve: no room for the KV cache: --gpu-memory-utilization 0.05 allows "
                           f"{format_bytes(int(device * 0.05))} of the {format_bytes(device)} device, "
                           f"less than the {format_bytes(weights)} of weights"), line
    assert f"one {format_bytes(BLOCK_BYTES)} block (--block-size 16" in line, line
    least = float(re.search(r"raise --gpu-memory-utilization to at least ([0-9.]+)$", line).group(1))
    assert int(device * least) >= weights + BLOCK_BYTES > int(device * (least - 0.01))
    # the value it names runs; the one below it does not, and says so the same way
    assert serve(tiny_llama, "--device-memory", str(DEVICE_GIB), "--gpu-memory-utilization", f"{least:g}") \
        == (None, "", "")
    below = the_line(*serve(tiny_llama, "--device-memory", str(DEVICE_GIB),
                            "--gpu-memory-utilization", f"{least - 0.01:g}"))
    assert f"at least {least:g}" in below, below


def test_no_block_after_the_weights(tiny_llama):  # noqa: F811
    """The weights fit but the rest holds less than one block of --block-size 128."""
    device = int(DEVICE_GIB * 2**30)
    weights = weights_bytes(tiny_llama)
    block = 128 * 512
    util = round((weights + block // 2) / device + 0.0005, 3)  # about half a block left
    left = int(device * util) - weights
    assert 0 < left < block
    line = the_line(*serve(tiny_llama, "--device-memory", str(DEVICE_GIB), "--gpu-memory-utilization", str(util),
                           "--block-size", "128"))
    assert (f"--gpu-memory-utilization {util:g} allows {format_bytes(int(device * util))} of the "
            f"{format_bytes(device)} device, after {format_bytes(weights)} of weights, {format_bytes(left)} "
            f"are left: not even one {format_bytes(block)} block (--block-size 128 x 512 B per token) fits") in line


def test_kv_cache_memory_below_one_block(tiny_llama):  # noqa: F811
    line = the_line(*serve(tiny_llama, "--kv-cache-memory", "0.000001"))
    assert line == ("kvtune serve: no room for the KV cache: --kv-cache-memory 1e-06 GiB (1.0 KiB) is less than "
                    "one 8.0 KiB block (--block-size 16 x 512 B per token); raise --kv-cache-memory to at least 8e-06")
