"""Cost profiles: the memory picture and the step-time model of one (device, model) pair.

Step time of one engine step (what `SimulatedRunner` charges):

    t = step_overhead_s                                   host work + kernel launches
      + max(weights_read_s, per_token_s * batched_tokens) dense layers: memory floor (every
                                                          weight read once) or compute, whichever binds
      + per_context_token_s * decode_context_tokens       decode attention reads each cached token's K/V
      + per_prefill_pair_s * prefill_attention_pairs      prefill attention: (query, key) pairs, causal
      + swapped_bytes / swap_bandwidth_bytes_per_s        swap-in/out copies over PCIe

Why not the plain linear `c0 + c_tok * tokens + c_ctx * context`: a decode batch is bound by
reading the weights until it is large enough to be compute-bound; the max() keeps small decode
batches from looking cheaper than they are, and a linear fit (cpu-tiny) is the special case
weights_read_s = 0. Prefill attention is quadratic in prompt length; without its own term a 32k
prompt would look as cheap as 32k separate decodes.

Machine speed (`speed`, optional): a profile fitted from one window of an engine's steps may carry
how much slower (factor > 1) or faster than the cost model the machine ran, window by window of that
window's clock (`SpeedTimeline`). A shared machine's speed swings by up to 2x within minutes (other
processes take the cores); a replay of that window under a candidate config then runs on the same
machine conditions as the measured one, so a slow stretch builds the queue it built for real.
Outside the timeline, and for named profiles, the factor is 1.

Memory picture (`kv_cache_size`): the device's total bytes, the weights, the activation peak as a
function of `max_num_batched_tokens`, and K/V bytes per token from the model shape; the number of
blocks then comes from `kvtune_engine.kv.sizing.kv_cache_size`, the function the CUDA runner uses.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..config import ConfigError, EngineConfig
from ..kv.sizing import GIB, KVCacheSize, kv_bytes_per_token, kv_cache_size


class ProfileError(ValueError):
    """A profile name that does not exist or a profile file that is not valid."""


class SpeedTimeline(BaseModel):
    """Step-time factors by consecutive windows of ``window_s`` from ``start_s`` (the trace's clock)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    start_s: float
    window_s: float = Field(gt=0)
    factors: tuple[float, ...] = Field(min_length=1)

    def at(self, t: float) -> float:
        k = int((t - self.start_s) // self.window_s)
        return self.factors[k] if 0 <= k < len(self.factors) else 1.0


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    # memory picture
    device_total_bytes: int = Field(gt=0, description="Device memory as the runtime reports it.")
    weights_bytes: int = Field(ge=0)
    activation_base_bytes: int = Field(ge=0, description="Non-KV, non-weight bytes independent of the budget "
                                                         "(CUDA context, workspaces, sampler buffers).")
    activation_bytes_per_batched_token: float = Field(ge=0, description="Peak activation bytes per token of "
                                                                        "max_num_batched_tokens.")
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    kv_dtype_bytes: int = Field(ge=1)
    host_bytes: int = Field(ge=0, description="Host memory available for the swap pool.")
    swap_bandwidth_bytes_per_s: float = Field(gt=0)
    # step time
    step_overhead_s: float = Field(ge=0)
    weights_read_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    per_context_token_s: float = Field(ge=0)
    per_prefill_pair_s: float = Field(ge=0)
    speed: SpeedTimeline | None = Field(default=None, description="The machine's speed over the window the "
                                        "costs were fitted on (module docstring); None: steady.")
    frontend_s: float = Field(0.0, ge=0, description="Time per request outside the stepped engine that its "
                              "latencies include: an API server's hops to the engine loop and back (vLLM's, "
                              "measured: tuner.vllm_steps.frontend_s). Added to TTFT and e2e; it takes no step.")
    derivation: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes)

    def activation_peak_bytes(self, max_num_batched_tokens: int) -> int:
        return int(self.activation_base_bytes + self.activation_bytes_per_batched_token * max_num_batched_tokens)

    def kv_cache_size(self, config: EngineConfig) -> KVCacheSize:
        """Blocks for this config (ConfigError when none fit or swap exceeds host memory)."""
        if config.swap_space * GIB > self.host_bytes:
            raise ConfigError(f"swap_space {config.swap_space} GiB exceeds the host memory of profile "
                              f"{self.name} ({self.host_bytes / GIB:.1f} GiB)")
        return kv_cache_size(
            device_total_bytes=self.device_total_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            weights_bytes=self.weights_bytes,
            activation_peak_bytes=self.activation_peak_bytes(config.profiled_batched_tokens),
            block_size=config.block_size, kv_bytes_per_token=self.kv_bytes_per_token,
            swap_space_gib=config.swap_space, kv_cache_memory_gib=config.kv_cache_memory)

    def step_time(self, batched_tokens: int, decode_context_tokens: int, prefill_pairs: float = 0.0,
                  swapped_bytes: int = 0) -> float:
        dense = self.per_token_s * batched_tokens
        if dense < self.weights_read_s:
            dense = self.weights_read_s
        return (self.step_overhead_s + dense + self.per_context_token_s * decode_context_tokens
                + self.per_prefill_pair_s * prefill_pairs + swapped_bytes / self.swap_bandwidth_bytes_per_s)


def fit_step_costs(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares (step_overhead_s, per_token_s, per_context_token_s) from measured steps
    (batched_tokens, decode_context_tokens, duration_s): for refitting a profile (cpu-tiny) from
    the engine's own step timings. Plain Python (3x3 normal equations)."""
    if len(samples) < 3:
        raise ValueError("need at least 3 samples")
    rows = [(1.0, float(b), float(c), float(t)) for b, c, t in samples]
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    y = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    for col in range(3):                      # Gauss-Jordan with partial pivoting
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            raise ValueError("samples do not determine the costs (vary batch size and context)")
        a[col], a[piv], y[col], y[piv] = a[piv], a[col], y[piv], y[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * z for x, z in zip(a[r], a[col])]
                y[r] -= f * y[col]
    c0, c_tok, c_ctx = (max(0.0, y[i] / a[i][i]) for i in range(3))
    return c0, c_tok, c_ctx
