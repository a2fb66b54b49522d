"""The device memory picture of one window, and what a candidate config would get.

Measured, not assumed: bytes by kind come from the observation, so a candidate never asks for more
device memory than the measured peak non-KV memory plus a safety margin leaves:

    usable(u)        = u * device_total
    kv_bytes(u, T)   = usable(u) - weights - activations_peak(T)        (T = the profiled budget)
    u_max            = (device_total - overshoot - margin) / device_total
    margin           = max(margin_min_bytes, margin_frac * measured non-KV)  (allocator slack, CUDA context)
    overshoot        = max(0, measured weights + activations peak + KV - u_now * device_total)

``activations_peak(T)`` scales linearly with the token budget from the measured value (the
activation buffers are sized per batched token). Diagnose and candidates both read it from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtune_engine.config import EngineConfig

from .observation import GiB, Observation


@dataclass(frozen=True)
class Safety:
    margin_frac: float = 0.10              # of the measured non-KV memory
    margin_min_bytes: float = 1.0 * GiB    # CUDA context, allocator slack, other processes
    margin_min_device_frac: float = 0.02   # ... but never more than this share of a (small) device
    swap_headroom: float = 1.5             # swap sized to this many times the observed swap volume


@dataclass(frozen=True)
class MemoryPicture:
    """Device memory as measured in the window, and what a candidate config would get."""
    device_total: float
    weights: float
    activations_peak: float
    kv_cache: float
    tokens_budget: int               # max_num_batched_tokens the activation peak was measured at
    utilization: float               # gpu_memory_utilization the window ran at
    kv_bytes_per_token: float        # measured: kv_cache bytes / (num_blocks * block_size)
    host_swap_bytes_max: float | None = None

    @classmethod
    def from_observation(cls, obs: Observation) -> "MemoryPicture | None":
        m = obs.memory
        total = float(m.get("device_total", 0) or 0)
        kv = float(m.get("kv_cache", 0) or 0)
        if total <= 0 or kv <= 0 or obs.num_blocks <= 0 or obs.config.kv_cache_memory is not None:
            return None  # (a fixed kv_cache_memory: gpu_memory_utilization does not size the cache)
        return cls(device_total=total, weights=float(m.get("weights", 0) or 0),
                   activations_peak=float(m.get("activations_peak", 0) or 0), kv_cache=kv,
                   tokens_budget=obs.config.profiled_batched_tokens,
                   utilization=obs.config.gpu_memory_utilization,
                   kv_bytes_per_token=kv / (obs.num_blocks * obs.config.block_size))

    def activations(self, tokens_budget: int) -> float:
        return self.activations_peak * tokens_budget / max(1, self.tokens_budget)

    def kv_bytes(self, cfg: EngineConfig) -> float:
        return cfg.gpu_memory_utilization * self.device_total - self.weights - self.activations(cfg.profiled_batched_tokens)

    def num_blocks(self, cfg: EngineConfig) -> int:
        return max(0, int(self.kv_bytes(cfg) // (self.kv_bytes_per_token * cfg.block_size)))

    def non_kv(self) -> float:
        return self.weights + self.activations_peak

    def max_utilization(self, safety: Safety = Safety(), tokens_budget: int | None = None) -> float:
        """The highest gpu_memory_utilization the measured memory allows, with the safety margin."""
        floor = min(safety.margin_min_bytes, safety.margin_min_device_frac * self.device_total)
        margin = max(floor, safety.margin_frac * self.non_kv())
        planned = self.utilization * self.device_total
        measured = self.non_kv() + self.kv_cache
        overshoot = max(0.0, measured - planned)
        extra_act = 0.0
        if tokens_budget is not None:  # a bigger token budget needs more activation memory, outside KV
            extra_act = max(0.0, self.activations(tokens_budget) - self.activations_peak) * safety.margin_frac
        return max(0.0, (self.device_total - overshoot - margin - extra_act) / self.device_total)

    def unused_bytes(self) -> float:
        """Device memory outside the engine's budget, beyond the safety margin."""
        return max(0.0, (self.max_utilization() - self.utilization) * self.device_total)


def swap_needed_gib(obs: Observation, safety: Safety = Safety()) -> float | None:
    """Swap volume the window asked for, in GiB, with headroom; None when the window did not swap.

    Observed volume = the pool's peak usage, plus, for each swap-full event, one request's K/V at the
    moment it was preempted (about three quarters of its final length, from the window's lengths and
    the K/V bytes per token; without them, the pool's peak divided by the swap preemptions)."""
    cfg = obs.config
    if obs.preemptions_swap == 0 and obs.swap_full == 0:
        return None
    used = obs.swap_usage_peak * cfg.swap_space
    mem = MemoryPicture.from_observation(obs)
    if obs.lengths is not None and obs.lengths.count and mem is not None:
        per_req_gib = 0.75 * obs.lengths.total_mean * mem.kv_bytes_per_token / GiB
    elif used > 0:
        per_req_gib = used / max(1, obs.preemptions_swap)
    else:
        return None
    return (used + per_req_gib * obs.swap_full) * safety.swap_headroom
