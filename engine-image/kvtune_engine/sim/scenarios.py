"""Deterministic trace generators: the six scenarios of the field reports, and synthetic mixes.

Each `Scenario` carries the trace generator and what goes with it: the profile and baseline engine
flags under which the trace shows its symptom, the knob change that relieves it, and the SLO to
judge goodput by. `kvtune trace gen --scenario NAME` writes the trace and prints the matching
`kvtune sim` commands; the scenario tests check symptom and relief with exactly these values.
The same seed always gives the same trace (only `random.Random(seed)` is used).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from .trace import TraceRequest


def lognormal_int(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    """A lognormal draw with the given mean (sigma in log space), rounded and clipped."""
    if sigma <= 0:
        v = mean
    else:
        v = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(low, min(high, int(round(v))))


def arrivals(rng: random.Random, n: int, rate: float, process: str = "poisson",
             burstiness: float = 3.0) -> list[float]:
    """n arrival times at `rate` requests/s on average. poisson: exponential gaps; bursty: gamma
    gaps with coefficient of variation `burstiness` (> 1: clumps of requests, then lulls).
    Rounded to microseconds, as the trace file stores them, so a trace replays the same from
    memory and from its file."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (got {rate})")
    t, out = 0.0, []
    if process == "poisson":
        for _ in range(n):
            out.append(round(t, 6))
            t += rng.expovariate(rate)
    elif process == "bursty":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0 (got {burstiness})")
        k = 1.0 / (burstiness * burstiness)       # gamma shape; mean gap k * theta = 1 / rate
        for _ in range(n):
            out.append(round(t, 6))
            t += rng.gammavariate(k, 1.0 / (rate * k))
    else:
        raise ValueError(f"arrival process must be poisson or bursty (got {process!r})")
    return out


def mix(*, requests: int = 1000, rate: float = 10.0, arrival: str = "poisson", burstiness: float = 3.0,
        prompt_mean: float = 512, prompt_sigma: float = 1.0, output_mean: float = 256,
        output_sigma: float = 0.8, max_tokens: int = 8192, prefix_groups: int = 0,
        prefix_tokens: int = 0, prefix_share: float = 0.5, seed: int = 0) -> list[TraceRequest]:
    """A synthetic workload: Poisson or bursty arrivals, lognormal prompt and output lengths
    (clipped so prompt + output <= max_tokens), and optionally `prefix_groups` shared prefixes of
    `prefix_tokens` tokens used by a `prefix_share` fraction of the requests."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1 (got {requests})")
    if not 0.0 <= prefix_share <= 1.0:
        raise ValueError(f"prefix_share must be in [0, 1] (got {prefix_share})")
    if prefix_groups < 0 or prefix_tokens < 0 or (prefix_groups > 0) != (prefix_tokens > 0):
        raise ValueError("prefix_groups and prefix_tokens go together (both > 0, or both 0)")
    if max_tokens < 2 or prefix_tokens >= max_tokens:
        raise ValueError(f"max_tokens {max_tokens} must be >= 2 and > prefix_tokens {prefix_tokens}")
    rng = random.Random(seed)
    out = []
    for t in arrivals(rng, requests, rate, arrival, burstiness):
        grouped = prefix_groups > 0 and rng.random() < prefix_share
        k = prefix_tokens if grouped else 0
        prompt = k + lognormal_int(rng, prompt_mean, prompt_sigma, 1, max_tokens - 1 - k)
        output = lognormal_int(rng, output_mean, output_sigma, 1, max_tokens - prompt)
        if grouped:
            out.append(TraceRequest(t, prompt, output, f"prefix-{rng.randrange(prefix_groups)}", k))
        else:
            out.append(TraceRequest(t, prompt, output))
    return out


@dataclass(frozen=True)
class Scenario:
    name: str
    symptom: str
    profile: str
    baseline: dict            # engine flags (EngineConfig fields) under which the symptom shows
    fix: dict                 # the change that relieves it
    slo_ttft_s: float
    slo_tpot_s: float
    make: Callable[[int], list[TraceRequest]] = field(repr=False)

    def trace(self, seed: int = 0) -> list[TraceRequest]:
        return self.make(seed)

    def sim_command(self, trace_file: str, fixed: bool = False) -> str:
        flags = {**self.baseline, **(self.fix if fixed else {})}
        parts = [f"kvtune sim --trace {trace_file} --profile {self.profile}"]
        for k, v in flags.items():
            flag = k.replace("_", "-")
            parts.append(f"--{flag}" if v is True else f"--no-{flag}" if v is False else f"--{flag} {v}")
        parts.append(f"--slo-ttft {self.slo_ttft_s} --slo-tpot {self.slo_tpot_s}")
        return " ".join(parts)


def _seq_cap(seed: int) -> list[TraceRequest]:
    # Steady chat traffic, more than 64 sequences' worth of decode work but little KV memory.
    return mix(requests=1200, rate=12.0, prompt_mean=300, prompt_sigma=0.6, output_mean=400,
               output_sigma=0.5, max_tokens=4096, seed=seed)


def _shared_prefix(seed: int) -> list[TraceRequest]:
    # Many agents/tenants, each with its own long system prompt; short user turns.
    return mix(requests=900, rate=5.0, prompt_mean=200, prompt_sigma=0.7, output_mean=150,
               output_sigma=0.6, max_tokens=8192, prefix_groups=24, prefix_tokens=2500,
               prefix_share=0.9, seed=seed)


def _long_prompt(seed: int) -> list[TraceRequest]:
    # Short chat requests, and now and then a document of almost 32k tokens.
    rng = random.Random(seed)
    short = mix(requests=1000, rate=8.0, prompt_mean=300, prompt_sigma=0.5, output_mean=400,
                output_sigma=0.5, max_tokens=4096, seed=seed + 1)
    end = short[-1].arrival_s
    longs = [TraceRequest(round(end * f, 6), rng.randint(32720, 32760), 8) for f in (0.15, 0.35, 0.55, 0.75, 0.95)]
    return sorted(short + longs, key=lambda r: r.arrival_s)


def _block_waste(seed: int) -> list[TraceRequest]:
    # Many very short sequences (classification / extraction calls) from a small co-located model.
    return mix(requests=20000, rate=5000.0, prompt_mean=40, prompt_sigma=0.5, output_mean=12,
               output_sigma=0.5, max_tokens=512, seed=seed)


def _low_memory(seed: int) -> list[TraceRequest]:
    # Short prompts, long answers: admission is cheap, then every running sequence grows.
    return mix(requests=600, rate=5.0, prompt_mean=300, prompt_sigma=0.5, output_mean=1500,
               output_sigma=0.4, max_tokens=8192, seed=seed)


def _swap_full(seed: int) -> list[TraceRequest]:
    # The same kind of load on a smaller card: preemptions are frequent and swap fills up.
    return mix(requests=500, rate=3.0, prompt_mean=300, prompt_sigma=0.5, output_mean=1200,
               output_sigma=0.4, max_tokens=8192, seed=seed)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("seq-cap",
             "KV usage stays low (~25% or less) while running == max_num_seqs and the queue grows; "
             "the waiting cause is max_num_seqs",
             "a100-llama3-8b", {"max_num_seqs": 64}, {"max_num_seqs": 256}, 2.0, 0.1, _seq_cap),
    Scenario("shared-prefix",
             "idle cached prefix blocks fill the pool: the strictly free block count is far below what "
             "the usage gauge suggests, and prefixes are evicted before reuse (low hit rate)",
             "l20-qwen3-8b", {"gpu_memory_utilization": 0.7}, {"gpu_memory_utilization": 0.95},
             4.0, 0.15, _shared_prefix),
    Scenario("long-prompt",
             "a 32k-token prompt at the queue head does not fit the token budget next to the running "
             "decodes; short requests behind it starve (token_budget), and its single prefill step stalls "
             "every decode",
             "a100-llama3-8b",
             {"enable_chunked_prefill": False, "max_num_batched_tokens": 32768, "max_model_len": 32768},
             {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096}, 3.0, 0.2, _long_prompt),
    Scenario("block-waste",
             "short sequences leave most of each 128-token block empty (high internal fragmentation), "
             "so the cache holds few sequences and requests wait on kv_blocks",
             "h200-qwen3-0.6b", {"block_size": 128, "gpu_memory_utilization": 0.04, "max_num_seqs": 1024},
             {"block_size": 16}, 0.25, 0.05, _block_waste),
    Scenario("low-memory",
             "preemptions climb under load while a large part of the GPU memory is left unused",
             "a100-llama3-8b", {"gpu_memory_utilization": 0.5}, {"gpu_memory_utilization": 0.9},
             5.0, 0.15, _low_memory),
    Scenario("swap-full",
             "the CPU swap pool fills up (usage 100%): swap is wanted but full, and preemption falls "
             "back to recompute",
             "l20-qwen3-8b", {"swap_space": 1}, {"swap_space": 16}, 5.0, 0.2, _swap_full),
)}
