"""The named profiles, derived in code from published GPU figures and model shapes.

These are estimates, not measurements: they are meant to rank configurations (which knob helps,
roughly how much), not to promise absolute latencies. Replace a profile by a fitted one
(`profile.fit_step_costs` on the engine's step timings) whenever the real engine can be measured.

Derivation (the same for every GPU profile, see `from_specs`):

  weights_bytes        = parameters * 2                          (bf16)
  kv_bytes_per_token   = 2 * layers * kv_heads * head_dim * 2    (K and V, bf16)
  activation_base      = 0.75 GiB (CUDA context, cuBLAS/attention workspaces)
                         + 256 * vocab * 4 (fp32 logits of up to 256 sampled rows)
  activation/token     = 2 * (4 * hidden + 2 * intermediate + (heads + 2 * kv_heads) * head_dim)
                         (the widest point of one layer: residual, normed input, attention output,
                         MLP gate and up projections, the fused QKV; layers run one at a time)
  step_overhead_s      = 1.5 ms + 30 us per layer (scheduler, sampling, ~10 kernel launches/layer)
  weights_read_s       = weights_bytes / (0.8 * memory bandwidth)
  per_token_s          = 2 * parameters / (0.55 * dense bf16 FLOP/s)
  per_context_token_s  = kv_bytes_per_token / (0.7 * memory bandwidth)   (decode attention is bound
                         by reading K/V)
  per_prefill_pair_s   = 4 * layers * heads * head_dim / (0.4 * dense bf16 FLOP/s)  (QK^T and PV)
  swap bandwidth       = 40% of the PCIe link's nominal rate (many block-sized copies)

GPU figures (vendor data sheets): memory as `nvidia-smi` reports it.
  H200 SXM   143771 MiB, HBM3e 4.8 TB/s, 989 TFLOP/s dense BF16, PCIe Gen5 x16 (64 GB/s)
  A100 SXM4  81920 MiB (80 GB), HBM2e 2.039 TB/s, 312 TFLOP/s dense BF16, PCIe Gen4 x16 (32 GB/s)
  L20        46068 MiB (48 GB GDDR6), 864 GB/s, 119.5 TFLOP/s dense FP16/BF16, PCIe Gen4 x16
Host memory for swap: a typical 8-GPU node's RAM divided by 8 (256 / 128 / 64 GiB).

Model shapes (the models' config.json):
  Qwen3-0.6B   28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
               vocab 151936, tied embeddings: 0.596e9 parameters
  Llama-3-8B   32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336,
               vocab 128256: 8.03e9 parameters
  Qwen3-8B     36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 12288,
               vocab 151936: 8.19e9 parameters
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..config import format_validation_error
from .profile import Profile, ProfileError

MIB, GIB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth: float        # bytes/s
    flops: float            # dense bf16 FLOP/s
    pcie: float             # bytes/s, nominal
    host_bytes: int


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: float


H200 = GPU("H200 SXM 141GB", 143771 * MIB, 4.8e12, 989e12, 64e9, 256 * GIB)
A100 = GPU("A100 SXM4 80GB", 81920 * MIB, 2.039e12, 312e12, 32e9, 128 * GIB)
L20 = GPU("L20 48GB", 46068 * MIB, 864e9, 119.5e12, 32e9, 64 * GIB)

QWEN3_0_6B = Model("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, 0.596e9)
LLAMA3_8B = Model("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9)
QWEN3_8B = Model("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, 8.19e9)


def from_specs(name: str, gpu: GPU, m: Model) -> Profile:
    weights = int(m.params * 2)
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * 2
    return Profile(
        name=name,
        description=f"{m.name} (bf16) on one {gpu.name}; estimated from data-sheet figures",
        device_total_bytes=gpu.memory_bytes,
        weights_bytes=weights,
        activation_base_bytes=int(0.75 * GIB) + 256 * m.vocab * 4,
        activation_bytes_per_batched_token=2 * (4 * m.hidden + 2 * m.intermediate
                                                + (m.heads + 2 * m.kv_heads) * m.head_dim),
        num_layers=m.layers, num_kv_heads=m.kv_heads, head_dim=m.head_dim, kv_dtype_bytes=2,
        host_bytes=gpu.host_bytes,
        swap_bandwidth_bytes_per_s=0.4 * gpu.pcie,
        step_overhead_s=1.5e-3 + 30e-6 * m.layers,
        weights_read_s=weights / (0.8 * gpu.bandwidth),
        per_token_s=2 * m.params / (0.55 * gpu.flops),
        per_context_token_s=kv_per_token / (0.7 * gpu.bandwidth),
        per_prefill_pair_s=4 * m.layers * m.heads * m.head_dim / (0.4 * gpu.flops),
        derivation="kvtune_engine/sim/profiles.py: from_specs",
    )


# cpu-tiny: the demo's model on our engine on CPU -- a random Llama of `kvtune make-tiny-model --layers=4
# --hidden=256 --heads=4 --kv-heads=2 --vocab=4096 --intermediate=768` (kvtune_operator/demo/session.py
# MODEL_SHAPE; fp32, head_dim 64) served by `kvtune serve --device cpu --device-memory 0.25` as the demo
# runs it (EngineProcess: OMP_NUM_THREADS=1), on the 2-core AMD EPYC dev box.
#
# Memory picture, exact for that model and flag (the engine's own /metrics kvtune_memory_bytes):
#   device_total 0.25 GiB (--device-memory), weights 20,980,736 bytes (5.2M fp32 parameters),
#   activations 0 (the CPU runner does not profile them), K/V 2 * 4 layers * 2 heads * 64 * 4 bytes =
#   4096 bytes per token. So `kvtune sim --profile cpu-tiny --gpu-memory-utilization 0.9` sizes 3366
#   blocks of 16 and 0.09 gives 48, exactly as the engine does. Swap (host memory, copy bandwidth) is
#   an estimate: the fits below saw no swapping.
#
# Step costs, fitted (tuner/fit.py fit_step_cost, knee model) to 19,059 engine steps of the 7 cases
# of bench/sim_fidelity.py pooled, each step's wall time including the gap to the next step while busy
# (fit.samples_from_engine_steps): produced by
#     python bench/sim_fidelity.py --keep /tmp/fid --fit-profile
# (2025-11-30, machine speed 0.7-1.7 of its usual: the box is shared). Relative RMS residual 0.91:
# single steps scatter widely on a shared 2-core box; their mean is what the fit is good for. Reading:
# every step costs at least ~2.2 ms (a 12-token floor: Python scheduling, sampling, detokenization, the
# HTTP server's share of the interpreter), then 185 us per batched token and 3.75 us per decode
# context token. The engine's step log has no prefill attention figure, so per_prefill_pair_s is 0
# (its cost is inside per_token_s at these prompt lengths, 16-600 tokens). Refit after engine changes;
# figures for one case vary by up to ~2x with the machine's load (`--fit-details` prints each case's).
CPU_TINY = Profile(
    name="cpu-tiny",
    description="the demo's tiny random Llama (4 layers, hidden 256, fp32) on our engine on 2 CPU cores; "
                "step costs fitted from the engine's step log",
    device_total_bytes=GIB // 4, weights_bytes=20_980_736, activation_base_bytes=0,
    activation_bytes_per_batched_token=0.0,
    num_layers=4, num_kv_heads=2, head_dim=64, kv_dtype_bytes=4,
    host_bytes=8 * GIB, swap_bandwidth_bytes_per_s=5e9,
    step_overhead_s=0.0, weights_read_s=2.2065e-3, per_token_s=185.095e-6, per_context_token_s=3.75084e-6,
    per_prefill_pair_s=0.0,
    derivation="fitted: python bench/sim_fidelity.py --keep DIR --fit-profile (19,059 steps of the demo model "
               "on the 2-core dev box, 2025-11-30); see kvtune_engine/sim/profiles.py",
)

PROFILES: dict[str, Profile] = {
    "h200-qwen3-0.6b": from_specs("h200-qwen3-0.6b", H200, QWEN3_0_6B),
    "a100-llama3-8b": from_specs("a100-llama3-8b", A100, LLAMA3_8B),
    "l20-qwen3-8b": from_specs("l20-qwen3-8b", L20, QWEN3_8B),
    "cpu-tiny": CPU_TINY,
}


def load_profile(name_or_path: str) -> Profile:
    """A named profile (see `profiles.PROFILES`) or a JSON file with Profile's fields."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    p = Path(name_or_path)
    if not p.is_file():
        raise ProfileError(f"unknown profile {name_or_path!r}: not a file, and not one of "
                           f"{', '.join(sorted(PROFILES))}")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{p}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: a profile is a JSON object")
    data.setdefault("name", p.stem)
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(f"{p}: {format_validation_error(e)}") from None
