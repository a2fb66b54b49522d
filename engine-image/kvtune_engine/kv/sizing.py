"""How many KV blocks fit: the single formula shared by the CUDA runner and the simulator.

    kv_cache_bytes = floor(device_total_bytes * gpu_memory_utilization)
                     - weights_bytes - activation_peak_bytes
    num_blocks     = kv_cache_bytes // (block_size * kv_bytes_per_token)
    num_swap_blocks = floor(swap_space GiB * 2**30) // (block_size * kv_bytes_per_token)

`activation_peak_bytes` is everything that is neither weights nor KV cache at the peak of a
profiling forward pass of `max_num_batched_tokens` tokens (activations, workspaces, the CUDA
context). When `kv_cache_memory` (GiB) is set, it replaces the subtraction (CPU runs, tests).
Torch-free: the real runner measures the inputs with torch and calls this; the simulator takes them
from a profile.

`ActivationProfile` records the step shape that profile covered: a later live raise past it
could allocate more than was set aside, and an out-of-memory inside a step fails every request in
flight, so the engine refuses such a raise (it needs a restart, which profiles again).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ConfigError

GIB = 1 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V, every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    num_blocks: int
    num_swap_blocks: int
    block_bytes: int          # device bytes of one block (all layers, K and V)
    kv_cache_bytes: int       # bytes given to the KV cache (num_blocks * block_bytes)
    swap_bytes: int           # host bytes of the swap pool (num_swap_blocks * block_bytes)
    budget_bytes: int         # what the formula left for the KV cache before rounding to blocks

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


#: sampled rows every start-up profile covers (vLLM's default max_num_seqs): the headroom of a live
#: sequence-cap raise
LIVE_SEQS_HEADROOM = 256


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """The largest step the start-up memory profile measured: ``max_num_batched_tokens`` tokens and
    ``max_num_seqs`` sampled rows, at least ``LIVE_SEQS_HEADROOM`` of them (within the budget: a step
    never has more sequences than tokens), so that the tuner's usual live fix, a higher sequence cap,
    never needs a restart: an engine started at ``--max-num-seqs 2`` pays at start-up for sampling
    256 rows. Raising a knob past these makes steps the profile never paid for."""
    max_num_batched_tokens: int
    max_num_seqs: int

    @classmethod
    def of(cls, max_num_batched_tokens: int, max_num_seqs: int) -> "ActivationProfile":
        budget = int(max_num_batched_tokens)
        return cls(budget, max(int(max_num_seqs), min(budget, LIVE_SEQS_HEADROOM)))

    @property
    def rows(self) -> int:
        """Sampled rows (logits, softmax, sort) the profile covered."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def exceeded(self, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, tuple[int, int]]:
        """``{knob: (most the profile covers, requested)}`` for every knob whose value allows a
        step larger than profiled; empty when the step fits."""
        out: dict[str, tuple[int, int]] = {}
        if max_num_batched_tokens > self.max_num_batched_tokens:
            out["max_num_batched_tokens"] = (self.max_num_batched_tokens, max_num_batched_tokens)
        if min(max_num_seqs, max_num_batched_tokens) > self.rows:
            out["max_num_seqs"] = (self.rows, max_num_seqs)
        return out

    def as_dict(self) -> dict[str, int]:
        return {"max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs}


def num_swap_blocks(swap_space_gib: float, block_size: int, kv_bytes_per_token: int) -> int:
    if swap_space_gib < 0:
        raise ConfigError(f"swap_space must be >= 0 GiB (got {swap_space_gib})")
    return int(swap_space_gib * GIB) // (block_size * kv_bytes_per_token)


def kv_cache_size(*, device_total_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                  activation_peak_bytes: int, block_size: int, kv_bytes_per_token: int,
                  swap_space_gib: float = 0.0, kv_cache_memory_gib: float | None = None) -> KVCacheSize:
    """Blocks of the device KV cache and of the host swap pool. Raises ConfigError, with the
    numbers, when not even one block fits."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1] (got {gpu_memory_utilization})")
    if block_size < 1 or kv_bytes_per_token < 1:
        raise ConfigError(f"block_size ({block_size}) and kv_bytes_per_token ({kv_bytes_per_token}) must be >= 1")
    block_bytes = block_size * kv_bytes_per_token
    if kv_cache_memory_gib is not None:
        budget = int(kv_cache_memory_gib * GIB)
    else:
        budget = int(device_total_bytes * gpu_memory_utilization) - weights_bytes - activation_peak_bytes
    n = max(budget, 0) // block_bytes
    if n < 1:
        raise ConfigError(_no_block_message(
            device_total_bytes=device_total_bytes, gpu_memory_utilization=gpu_memory_utilization,
            weights_bytes=weights_bytes, activation_peak_bytes=activation_peak_bytes, block_size=block_size,
            kv_bytes_per_token=kv_bytes_per_token, kv_cache_memory_gib=kv_cache_memory_gib))
    ns = num_swap_blocks(swap_space_gib, block_size, kv_bytes_per_token)
    return KVCacheSize(num_blocks=n, num_swap_blocks=ns, block_bytes=block_bytes,
                       kv_cache_bytes=n * block_bytes, swap_bytes=ns * block_bytes, budget_bytes=budget)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _no_block_message(*, device_total_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                      activation_peak_bytes: int, block_size: int, kv_bytes_per_token: int,
                      kv_cache_memory_gib: float | None) -> str:
    """One line for an engine that cannot start: the flag, the figures, and the least value that
    fits (an operator's termination message and a user's first clue)."""
    block_bytes = block_size * kv_bytes_per_token
    block = (f"one {format_bytes(block_bytes)} block (--block-size {block_size} x "
             f"{format_bytes(kv_bytes_per_token)} per token)")
    if kv_cache_memory_gib is not None:
        least = math.ceil(block_bytes / GIB * 1e6) / 1e6
        while int(least * GIB) < block_bytes:
            least += 1e-6
        return (f"no room for the KV cache: --kv-cache-memory {kv_cache_memory_gib:g} GiB "
                f"({format_bytes(int(kv_cache_memory_gib * GIB))}) is less than {block}; "
                f"raise --kv-cache-memory to at least {least:g}")
    total, util = device_total_bytes, gpu_memory_utilization
    allowed = int(total * util)
    used = f"{format_bytes(weights_bytes)} of weights"
    if activation_peak_bytes:
        used += f" and {format_bytes(activation_peak_bytes)} of activations (--max-num-batched-tokens)"
    if allowed < weights_bytes + activation_peak_bytes:
        what = f"less than the {used}"
    else:
        what = f"after {used}, {format_bytes(allowed - weights_bytes - activation_peak_bytes)} are left"
    head = (f"no room for the KV cache: --gpu-memory-utilization {util:g} allows "
            f"{format_bytes(allowed)} of the {format_bytes(total)} device, {what}: not even {block} fits")
    need = weights_bytes + activation_peak_bytes + block_bytes
    least = math.ceil(need / total * 100) / 100 if total > 0 else math.inf
    while least <= 1.0 and int(total * least) < need:
        least = round(least + 0.01, 2)
    if least > 1.0:
        return (f"{head}; even --gpu-memory-utilization 1 would not fit: the device is too small for "
                f"{format_bytes(need)} (a smaller model, a bigger device)")
    fix = f"raise --gpu-memory-utilization to at least {least:g}"
    if activation_peak_bytes:
        fix += " or lower --max-num-batched-tokens"
    return f"{head}; {fix}"
