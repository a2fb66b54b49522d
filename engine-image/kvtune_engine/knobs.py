"""The one table of engine knobs: every fact about a knob, once. Its name (EngineConfig field, the
``kvtune`` flag, vLLM's flag, a ``camel`` spelling for camelCase configs), its type, default and doc
line, whether a change is live or needs a restart, the values the engine accepts (``limits``), the
values a deployment may set (``allowed``, inside the limits) and the tuner's default search range
(``search``, inside ``allowed``).

A knob whose best default differs by device names it per device (``device_defaults``: the KV block
size, 128 on CPU, 16 on CUDA); the engine takes it at start-up where the knob is not set
(``config.for_device``). EngineConfig (its fields), the CLI flags, the resource's schema, the tuner's bounds and candidates
and the vLLM runtime are all generated from this table: adding a knob is one row here (plus the code
that acts on it). Invariant (`check`): the ranges nest (search in allowed in limits) and every
default lies inside them. A leaf module: it imports nothing of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from annotated_types import Ge, Gt, Le, Lt

BLOCK_SIZES = (8, 16, 32, 64, 128)
BOOLS = (True, False)


@dataclass(frozen=True)
class Knob:
    name: str                      # EngineConfig field (snake_case) = vLLM's flag without dashes
    camel: str                     # its camelCase name (config files, resources); may carry a unit
    type: type                     # int, float or bool (a None default makes it optional)
    default: Any
    doc: str                       # one line: what it is, in its unit
    live: bool                     # applied by a running engine (config file, admin API); else a restart
    limits: tuple = ()             # what the engine accepts (annotated_types Ge/Gt/Le/Lt)
    tuned: bool = False            # the tuner may change it (a candidate's identity)
    bounded: bool = False          # users may bound (and freeze) it
    choices: tuple | None = None   # the values it may take (block size, switches)
    search: tuple[float, float] | None = None   # the tuner's default range (user bounds narrow it)
    allowed: tuple[float, float] | None = None  # what a deployment may set: past it a value is a typo
    #: vLLM's (0.32) flag for this knob, None where vLLM lacks it (spec.runtime vllm then refuses it);
    #: swap_space is vLLM's CPU KV offloading (--kv-offloading-backend native): a second-tier cache,
    #: since vLLM V1 preempts by recompute only. vLLM applies no knob live: every change restarts it.
    vllm: str | None = None
    vllm_default: Any = None       # vLLM's default where it differs from ours
    from_model: str | None = None  # unset, the engine takes this value of the model's (what it is)
    #: (device type, value) where the best default differs by device: unset, the engine takes the value
    #: of the device it starts on (``device_default``); elsewhere ``default``
    device_defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def restart(self) -> bool:
        return not self.live

    @property
    def vllm_value(self) -> Any:
        """What vLLM runs with when the flag is not given."""
        return self.default if self.vllm_default is None else self.vllm_default


_FRACTION = (Gt(0.0), Le(1.0))
#: The KV block size on CPU: 128, the size whose tiles (32 KiB per head in fp32 at head_dim 64) the
#: CPU decode kernel (attention/cpu_paged.cpp) reads fastest: bench/cpu_block_size.py, 256 sequences
#: of the engine benchmark's contexts, 1.34x block size 16's median (64: 1.26x, 32: 1.13x, 8: 0.85x;
#: a busy machine); vLLM picks 128 on CPU too. CUDA keeps 16: what its decode kernels page by, and
#: small blocks waste less of a GPU's scarcer KV memory.
CPU_BLOCK_SIZE = 128
TABLE: tuple[Knob, ...] = (
    Knob("block_size", "blockSize", int, 16, f"Token slots per KV-cache block; one of {', '.join(map(str, BLOCK_SIZES))}.",
         live=False, tuned=True, bounded=True, choices=BLOCK_SIZES, vllm="--block-size",
         device_defaults=(("cpu", CPU_BLOCK_SIZE),)),
    Knob("gpu_memory_utilization", "gpuMemoryUtilization", float, 0.90,
         "Fraction of device memory the engine may use (weights + activations + KV cache).", live=False,
         limits=_FRACTION, tuned=True, bounded=True, search=(0.1, 0.95), allowed=(0.1, 0.98),
         vllm="--gpu-memory-utilization"),
    # allowed maxima: host RAM of one node, device memory of one 16-GPU pod, and token counts well
    # past any model's context; beyond them a value is a typo (1e308 GiB) the operator refuses
    Knob("swap_space", "swapSpaceGiB", float, 4.0, "CPU swap pool for preempted requests, GiB.", live=False,
         limits=(Ge(0.0),), tuned=True, bounded=True, search=(0.0, 64.0), allowed=(0.0, 1024.0),
         vllm="--kv-offloading-size"),
    Knob("kv_cache_memory", "kvCacheMemoryGiB", float, None,
         "KV cache size in GiB, bypassing memory profiling (CPU runs, tests).", live=False, limits=(Gt(0.0),),
         allowed=(0.0, 2048.0), vllm="--kv-cache-memory-bytes"),
    Knob("max_num_seqs", "maxNumSeqs", int, 256, "Most sequences running in one step.", live=True, limits=(Ge(1),),
         tuned=True, bounded=True, search=(1, 1024), allowed=(1, 16384), vllm="--max-num-seqs"),
    Knob("max_num_batched_tokens", "maxNumBatchedTokens", int, 8192,
         "Token budget of one step: prefill chunks plus one token per decode.", live=True, limits=(Ge(1),),
         tuned=True, bounded=True, search=(16, 65536), allowed=(1, 1048576), vllm="--max-num-batched-tokens",
         vllm_default=2048),
    # what vLLM does at every start (it profiles its one budget); here the budget is live, so the
    # profile is what bounds a live raise: reserving a larger step up front trades KV memory for raises
    # without a restart, and the tuner sets it when a raise past the running profile is worth a rollout
    # (frozen, the tuner raises the budget only within the running profile)
    Knob("profile_batched_tokens", "profileBatchedTokens", int, None,
         "Token budget the start-up memory profile reserves activations for (unset: max_num_batched_tokens); "
         "max_num_batched_tokens rises live up to it, past it only with a restart.", live=False,
         limits=(Ge(1),), tuned=True, bounded=True, search=(16, 65536), allowed=(1, 1048576)),
    Knob("max_model_len", "maxModelLen", int, 8192, "Longest prompt + output, in tokens.", live=False,
         limits=(Ge(2),), allowed=(2, 16777216), vllm="--max-model-len",
         from_model="the model's context length (max_position_embeddings); the engine refuses more"),
    Knob("watermark", "watermark", float, 0.01,
         "Fraction of all blocks kept free when admitting new requests (decode headroom).", live=True,
         limits=(Ge(0.0), Lt(1.0)), tuned=True, vllm="--watermark"),
    Knob("enable_prefix_caching", "enablePrefixCaching", bool, True, "Reuse KV blocks of shared prompt prefixes.",
         live=True, tuned=True, bounded=True, choices=BOOLS, vllm="--enable-prefix-caching"),
    Knob("enable_chunked_prefill", "enableChunkedPrefill", bool, True, "Split long prompts across steps.",
         live=True, tuned=True, bounded=True, choices=BOOLS, vllm="--enable-chunked-prefill"),
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
#: Knobs users bound (and freeze); the other tuned knobs stay at the baseline in a cluster.
BOUNDED_KNOBS = tuple(k.name for k in TABLE if k.bounded)


def device_type(device: str) -> str:
    """``cuda:1`` -> ``cuda``."""
    return device.split(":", 1)[0].strip().lower()


def device_default(k: Knob, device: str) -> Any:
    """The knob's default on this device (``device_defaults``, else ``default``)."""
    return dict(k.device_defaults).get(device_type(device), k.default)


#: The devices the engine runs on (``kvtune serve --device``), the first its default.
DEVICES = ("cpu", "cuda")


def defaults_text(k: Knob) -> str:
    """Its default as help text, per device where that differs: ``128 on cpu, 16 on cuda``."""
    if not k.device_defaults:
        return str(k.default).lower() if k.type is bool else str(k.default)
    return ", ".join(f"{device_default(k, d)} on {d}" for d in DEVICES)


def within_limits(k: Knob, v: float) -> bool:
    """Does the engine accept ``v`` for ``k`` (its ``limits``)?"""
    return all((not isinstance(m, Ge) or v >= m.ge) and (not isinstance(m, Gt) or v > m.gt)
               and (not isinstance(m, Le) or v <= m.le) and (not isinstance(m, Lt) or v < m.lt) for m in k.limits)


def limits_text(k: Knob) -> str:
    """The limits as an interval, e.g. ``(0, 1]``."""
    lo = next((f"[{m.ge:g}" if isinstance(m, Ge) else f"({m.gt:g}" for m in k.limits if isinstance(m, (Ge, Gt))), "(-inf")
    hi = next((f"{m.le:g}]" if isinstance(m, Le) else f"{m.lt:g})" for m in k.limits if isinstance(m, (Le, Lt))), "inf)")
    return f"{lo}, {hi}"


def check(table: tuple[Knob, ...] = TABLE) -> None:
    """Names are unique; search lies in allowed, allowed in the engine's limits, the default in all
    but search (a baseline may start outside the tuner's range); a bounded knob is tuned and has a
    range or choices."""
    for attr in ("name", "camel"):
        names = [getattr(k, attr) for k in table]
        if len(set(names)) != len(names):
            raise AssertionError(f"knob {attr}s repeat: {names}")
    for k in table:
        where = f"knob {k.name}"
        if k.search is not None:
            if k.allowed is None or not (k.allowed[0] <= k.search[0] <= k.search[1] <= k.allowed[1]):
                raise AssertionError(f"{where}: search range {k.search} leaves its allowed range {k.allowed}")
        if k.allowed is not None:  # its low end may be an open limit (kv_cache_memory: more than 0)
            lo, hi = k.allowed
            if not (within_limits(k, hi) and (within_limits(k, lo) or any(isinstance(m, Gt) and m.gt == lo
                                                                            for m in k.limits))):
                raise AssertionError(f"{where}: allowed range {k.allowed} leaves the engine's limits {limits_text(k)}")
        if k.default is not None:
            if not isinstance(k.default, k.type) and not (k.type is float and isinstance(k.default, int)):
                raise AssertionError(f"{where}: default {k.default!r} is not a {k.type.__name__}")
            inside = (k.default in k.choices if k.choices else within_limits(k, k.default)
                      and (k.allowed is None or k.allowed[0] <= k.default <= k.allowed[1]))
            if not inside:
                raise AssertionError(f"{where}: default {k.default!r} is outside its range")
        for dev, v in k.device_defaults:
            if dev not in DEVICES:
                raise AssertionError(f"{where}: a default on {dev!r}, which is not a device ({', '.join(DEVICES)})")
            if k.default is None or (v not in k.choices if k.choices else not within_limits(k, v)):
                raise AssertionError(f"{where}: default {v!r} on {dev} is outside its range "
                                     "(or the knob has no default)")
        if k.bounded and not (k.tuned and (k.choices or k.search)):
            raise AssertionError(f"{where}: bounded, so it needs tuned=True and choices or a search range")


def knob(key: str, table: tuple[Knob, ...] = TABLE) -> Knob:
    """The knob any spelling names: field (``max_num_seqs``), flag (``--max-num-seqs``, ``max-num-seqs``)
    or camelCase name (``maxNumSeqs``, ``swapSpace`` for ``swapSpaceGiB``). KeyError names the knobs."""
    k = key.strip()
    snake = {"swapSpace": "swap_space"}.get(k) or k.lstrip("-").replace("-", "_").removesuffix("_gib")
    found = next((x for x in table if k == x.camel or snake == x.name), None)
    if found is None:
        raise KeyError(f"unknown knob {key!r}; knobs: {', '.join(x.camel for x in table)}")
    return found
