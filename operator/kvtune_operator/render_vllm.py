"""The vLLM runtime's container command line (``spec.runtime: vllm``), from the one knob table.

vLLM reads no config file and changes no knob while running, so every knob goes on ``vllm serve``'s
command line (vLLM's flag of each knob is in ``kvtune_engine.knobs``) and every change is a restart:
the restart hash covers all knobs. Swap space becomes vLLM's CPU KV offloading
(``--kv-offloading-backend native --kv-offloading-size GiB``), a second cache tier: vLLM V1
preempts by recompute only. The port, /health and /metrics are the same as our engine's.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import TABLE
from kvtune_operator.pod_stop import DRAIN_TIMEOUT_S

#: vLLM's official OpenAI-server image, of the version whose metrics and flags kvtune reads
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_COMMAND = ["vllm", "serve"]
GiB = 1024 ** 3


def knob_flags(config: EngineConfig, omit: frozenset[str] = frozenset()) -> list[str]:
    """vLLM flags for every knob (``omit``: knobs left to vLLM, e.g. max_model_len unset)."""
    values = config.model_dump()
    out: list[str] = []
    for k in TABLE:
        v = values[k.name]
        if k.name in omit or k.vllm is None or v is None:
            continue
        if k.name == "swap_space":
            if v > 0:
                out += ["--kv-offloading-backend", "native", k.vllm, f"{v:g}"]
        elif k.name == "kv_cache_memory":
            out += [k.vllm, str(int(v * GiB))]
        elif isinstance(v, bool):
            out.append(k.vllm if v else "--no-" + k.vllm.removeprefix("--"))
        else:
            out += [k.vllm, f"{v:g}" if isinstance(v, float) else str(v)]
    return out


def vllm_args(model_path: str, served_name: str, port: int, config: EngineConfig, *,
              omit: frozenset[str] = frozenset(), extra: list[str] | None = None) -> list[str]:
    return [model_path, "--served-model-name", served_name, "--host", "0.0.0.0", "--port", str(port),
            "--shutdown-timeout", str(DRAIN_TIMEOUT_S), *knob_flags(config, omit), *(extra or [])]


def vllm_restart_hash(config: EngineConfig) -> str:
    """Hash of every knob: on vLLM any change restarts the pods."""
    canonical = json.dumps(config.model_dump(), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def parse_knobs(args: list[str]) -> dict[str, Any]:
    """The knob values on a vLLM command line (the inverse of ``knob_flags``), for reading back
    what a vLLM pod runs with: vLLM does not export max_num_seqs and friends."""
    by_flag = {k.vllm: k for k in TABLE if k.vllm}
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        flag, _, inline = a.partition("=")
        if flag.startswith("--no-") and "--" + flag[5:] in by_flag:
            out[by_flag["--" + flag[5:]].name] = False
        elif flag in by_flag:
            k = by_flag[flag]
            if k.choices == (True, False):
                out[k.name] = True
            else:
                v = inline or (args[i + 1] if i + 1 < len(args) else "")
                i += 0 if inline else 1
                out[k.name] = (float(v) / GiB if k.name == "kv_cache_memory"
                               else float(v) if "." in v or k.type is float else int(v))
        i += 1
    return out
