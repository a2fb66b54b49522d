"""Where vLLM's own ``cache_config_info`` contradicts the operator's picture of the engine.

The tuner predicts a vLLM deployment from the knobs the operator put on its command line plus the few
vLLM exports. vLLM's ``cache_config_info`` says more than the knobs: the KV cache in blocks, in
tokens and in bytes, and how many requests of the model length it holds at once. Checked against the
command line, these catch an engine that does not run what the operator believes: a block size or
memory share vLLM chose itself, a KV cache of another size than the one passed, a model length other
than the one rendered. A disagreement is drift: the predictions assume the operator's values, so the
status says so (condition ``EngineDrift``) with each figure and where it came from.

Invariant: ``drift`` is pure (labels and the rendered config in, findings out) and names a
disagreement only from two figures that are both present; an absent label is never a finding.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

from kvtune_engine.config import EngineConfig

#: the shares within which two figures agree (vLLM rounds the cache down to whole blocks and pages)
TOLERANCE = 0.02
GiB = 1024 ** 3


def _num(v: str | None) -> float | None:
    try:
        x = float(v) if v not in (None, "", "None") else None
    except ValueError:
        return None
    return x if x is not None and math.isfinite(x) else None


def _bool(v: str | None) -> bool | None:
    return {"true": True, "false": False}.get(str(v).lower()) if v is not None else None


def _differ(a: float, b: float) -> bool:
    return abs(a - b) > TOLERANCE * max(abs(a), abs(b), 1e-9)


def drift(infos: Iterable[Mapping[str, str]], rendered: EngineConfig,
          left_to_engine: frozenset[str] = frozenset()) -> list[str]:
    """The findings, one sentence each, over every engine's ``cache_config_info`` labels (``infos``;
    ``engine``/``instance``/``pod`` labels name it). ``rendered``: the knobs on the pods' command line;
    ``left_to_engine``: knobs not rendered (vLLM chose them, e.g. max_model_len), never a finding."""
    out: list[str] = []
    for info in infos:
        who = info.get("pod") or info.get("instance") or "the engine"
        said = []
        bs = _num(info.get("block_size"))
        if bs is not None and "block_size" not in left_to_engine and int(bs) != rendered.block_size:
            said.append(f"block_size {int(bs)}, the command line {rendered.block_size}")
        util = _num(info.get("gpu_memory_utilization"))
        if util is not None and "gpu_memory_utilization" not in left_to_engine \
                and _differ(util, rendered.gpu_memory_utilization):
            said.append(f"gpu_memory_utilization {util:g}, the command line {rendered.gpu_memory_utilization:g}")
        epc = _bool(info.get("enable_prefix_caching"))
        if epc is not None and epc != rendered.enable_prefix_caching:
            said.append(f"enable_prefix_caching {epc}, the command line {rendered.enable_prefix_caching}")
        kv_bytes = _num(info.get("kv_cache_memory_bytes"))
        if kv_bytes is not None and rendered.kv_cache_memory is not None \
                and _differ(kv_bytes, rendered.kv_cache_memory * GiB):
            said.append(f"a KV cache of {kv_bytes / GiB:.3g} GiB, the command line {rendered.kv_cache_memory:g} GiB")
        blocks, tokens = _num(info.get("num_gpu_blocks")), _num(info.get("kv_cache_size_tokens"))
        if blocks and tokens and bs and _differ(blocks * bs, tokens):
            said.append(f"{tokens:.0f} KV tokens, but {blocks:.0f} blocks of {bs:.0f} hold {blocks * bs:.0f}")
        conc = _num(info.get("kv_cache_max_concurrency"))
        if blocks and bs and conc and "max_model_len" not in left_to_engine and rendered.max_model_len:
            # vLLM: the blocks a request of the model length takes at most, into the blocks there are
            expect = blocks / math.ceil(rendered.max_model_len / bs)
            if _differ(conc, expect):
                length = blocks * bs / conc
                said.append(f"room for {conc:g} requests of the model length at once: a model length of about "
                            f"{length:.0f}, the command line {rendered.max_model_len} ({expect:.4g} would fit)")
        if said:
            out.append(f"{who}: vLLM reports " + "; ".join(said))
    return out


def check() -> None:
    """The invariant on vLLM 0.32's own labels (a CPU server, block size 128 of its choice)."""
    info = {"block_size": "128", "gpu_memory_utilization": "0.92", "enable_prefix_caching": "True",
            "kv_cache_memory_bytes": "1073741824", "num_gpu_blocks": "8192", "kv_cache_size_tokens": "1048576",
            "kv_cache_max_concurrency": "512.0"}
    cfg = EngineConfig(block_size=128, gpu_memory_utilization=0.92, enable_prefix_caching=True, kv_cache_memory=1.0,
                       max_model_len=2048)
    if drift([info], cfg):
        raise AssertionError(f"drift on a matching engine: {drift([info], cfg)}")
    if drift([{}], cfg.with_changes(block_size=16)):
        raise AssertionError("an absent label was a finding")
    if len(drift([info], cfg.with_changes(max_model_len=4096))[0].split("; ")) != 1:
        raise AssertionError("a model length drift was not found alone")
