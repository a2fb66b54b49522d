"""The one table of engine knobs: every name a knob goes by, whether a change is live or needs a
restart, whether the tuner changes it, and where it may go.

Engine (`EngineConfig`, its flags), CRD (`spec.engine`, `spec.autotune.bounds`), tuner (candidates,
bounds, the bad-candidate memory) and operator (status, events) read this table instead of keeping
maps of their own. `config.check_knobs()` keeps it equal to `EngineConfig`'s fields. A leaf module:
it imports nothing of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZES = (8, 16, 32, 64, 128)
BOOLS = (True, False)


@dataclass(frozen=True)
class Knob:
    name: str                      # EngineConfig field (snake_case) = vLLM's flag without dashes
    camel: str                     # spec.engine field
    live: bool                     # applied by a running engine (config file, admin API); else a restart
    tuned: bool = False            # the tuner may change it (a candidate's identity)
    bounded: bool = False          # users may bound it in spec.autotune.bounds (and freeze it)
    choices: tuple | None = None   # the values it may take (block size, switches)
    search: tuple[float, float] | None = None   # the tuner's default range (spec bounds narrow it)
    allowed: tuple[float, float] | None = None  # the cluster-facing limits (CRD bounds)
    #: vLLM's (0.32) flag for this knob, None where vLLM lacks it (spec.runtime vllm then refuses it);
    #: swap_space is vLLM's CPU KV offloading (--kv-offloading-backend native): a second-tier cache,
    #: since vLLM V1 preempts by recompute only. vLLM applies no knob live: every change restarts it.
    vllm: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def restart(self) -> bool:
        return not self.live


TABLE: tuple[Knob, ...] = (
    Knob("block_size", "blockSize", live=False, tuned=True, bounded=True, choices=BLOCK_SIZES, vllm="--block-size"),
    Knob("gpu_memory_utilization", "gpuMemoryUtilization", live=False, tuned=True, bounded=True,
         search=(0.05, 0.95), allowed=(0.1, 0.98), vllm="--gpu-memory-utilization"),
    # allowed maxima: host RAM of one node, device memory of one 16-GPU pod, and token counts well
    # past any model's context; beyond them a value is a typo (1e308 GiB) the operator refuses
    Knob("swap_space", "swapSpaceGiB", live=False, tuned=True, bounded=True, search=(0.0, 64.0),
         allowed=(0.0, 1024.0), vllm="--kv-offloading-size"),
    Knob("kv_cache_memory", "kvCacheMemoryGiB", live=False, allowed=(0.0, 2048.0), vllm="--kv-cache-memory-bytes"),
    Knob("max_num_seqs", "maxNumSeqs", live=True, tuned=True, bounded=True, search=(1, 1024), allowed=(1, 16384),
         vllm="--max-num-seqs"),
    Knob("max_num_batched_tokens", "maxNumBatchedTokens", live=True, tuned=True, bounded=True,
         search=(16, 65536), allowed=(1, 1048576), vllm="--max-num-batched-tokens"),
    Knob("max_model_len", "maxModelLen", live=False, allowed=(2, 16777216), vllm="--max-model-len"),
    Knob("watermark", "watermark", live=True, tuned=True, vllm="--watermark"),
    Knob("enable_prefix_caching", "enablePrefixCaching", live=True, tuned=True, bounded=True, choices=BOOLS,
         vllm="--enable-prefix-caching"),
    Knob("enable_chunked_prefill", "enableChunkedPrefill", live=True, tuned=True, bounded=True, choices=BOOLS,
         vllm="--enable-chunked-prefill"),
)

BY_NAME: dict[str, Knob] = {k.name: k for k in TABLE}
BY_CAMEL: dict[str, Knob] = {k.camel: k for k in TABLE}

#: Knobs the running engine applies without a restart (admin API PATCH, watched config file).
LIVE_KNOBS = frozenset(k.name for k in TABLE if k.live)
#: Knobs that size memory at start-up: changing them needs a restart (a rollout in a cluster).
RESTART_KNOBS = frozenset(k.name for k in TABLE if k.restart)
#: Knobs the tuner may change; a candidate is identified by their values.
TUNED_KNOBS = tuple(k.name for k in TABLE if k.tuned)
#: Knobs vLLM (spec.runtime vllm) has no flag for.
VLLM_LACKS = frozenset(k.name for k in TABLE if k.vllm is None)
#: Knobs users bound (and freeze) in spec.autotune; the other tuned knobs stay at the baseline in a cluster.
BOUNDED_KNOBS = tuple(k.name for k in TABLE if k.bounded)


def knob(key: str) -> Knob:
    """The knob any spelling names: field (``max_num_seqs``), flag (``--max-num-seqs``, ``max-num-seqs``)
    or CRD name (``maxNumSeqs``, ``swapSpace`` for ``swapSpaceGiB``). KeyError names the knobs."""
    k = key.strip()
    if k in BY_CAMEL:
        return BY_CAMEL[k]
    if k == "swapSpace":
        return BY_NAME["swap_space"]
    snake = k.lstrip("-").replace("-", "_")
    if snake == "swap_space_gib":
        snake = "swap_space"
    if snake in BY_NAME:
        return BY_NAME[snake]
    raise KeyError(f"unknown knob {key!r}; knobs: {', '.join(k.camel for k in TABLE)}")
