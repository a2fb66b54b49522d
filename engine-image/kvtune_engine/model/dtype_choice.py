"""The dtype the engine runs a model in: ``--dtype`` (auto: the checkpoint's), except bfloat16 on a
CPU without bfloat16 arithmetic (``cpu_features.has_bf16``), which runs float32 and says so at
start-up: oneDNN would emulate every bf16 GEMM there, slower than float32 and no more accurate.

Invariant owned here: on CPU the weights and the KV cache are bfloat16 only where the CPU has it.
"""
from __future__ import annotations

import logging

import torch

from .. import cpu_features
from .config import parse_dtype

log = logging.getLogger("kvtune.model")


def choose_dtype(requested: str | torch.dtype | None, checkpoint: torch.dtype,
                 device: str | torch.device) -> torch.dtype:
    """``requested`` (a name, a torch dtype, or auto/None for the checkpoint's) on ``device``."""
    dt = parse_dtype(requested, checkpoint)
    if torch.device(device).type == "cpu" and dt == torch.bfloat16 and not cpu_features.has_bf16():
        log.warning("dtype bfloat16 asked for (%s), but this CPU has no bfloat16 arithmetic (none of %s in "
                    "/proc/cpuinfo's flags): running float32", "--dtype" if requested not in (None, "auto")
                    else "the checkpoint's dtype", ", ".join(cpu_features.BF16_FLAGS))
        return torch.float32
    return dt
