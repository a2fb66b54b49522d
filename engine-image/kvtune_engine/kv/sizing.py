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
"""
from __future__ import annotations

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
        how = f"kv_cache_memory {kv_cache_memory_gib} GiB"
    else:
        budget = int(device_total_bytes * gpu_memory_utilization) - weights_bytes - activation_peak_bytes
        how = (f"{gpu_memory_utilization} x {device_total_bytes / GIB:.2f} GiB device memory "
               f"- {weights_bytes / GIB:.2f} GiB weights - {activation_peak_bytes / GIB:.2f} GiB peak activations "
               f"= {budget / GIB:.2f} GiB")
    n = max(budget, 0) // block_bytes
    if n < 1:
        raise ConfigError(
            f"no room for the KV cache: {how}, less than one block of {block_bytes} bytes "
            f"(block_size {block_size} x {kv_bytes_per_token} bytes/token); raise gpu_memory_utilization "
            "or lower max_num_batched_tokens")
    ns = num_swap_blocks(swap_space_gib, block_size, kv_bytes_per_token)
    return KVCacheSize(num_blocks=n, num_swap_blocks=ns, block_bytes=block_bytes,
                       kv_cache_bytes=n * block_bytes, swap_bytes=ns * block_bytes, budget_bytes=budget)
