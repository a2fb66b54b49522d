"""The CPU decode kernel (attention/cpu_paged.cpp) at each KV block size: the time of one layer's
paged decode for N running sequences of the engine benchmark's contexts (bench/engine_vs_vllm.py's
model: 8 query / 4 KV heads, head_dim 64; contexts 32-512 prompt + 16-256 output tokens, half
generated), blocks scattered through the cache as a running engine leaves them. The block sizes
run interleaved round by round, so a busy machine slows all alike; the figure is the median over
rounds (and the best round), and the ratio to block size 16. This is what picks the CPU default
(knobs.CPU_BLOCK_SIZE).

    .venv/bin/python bench/cpu_block_size.py [--running 256] [--rounds 15] [--threads 2] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "0")  # see bench/engine_vs_hf.py: spinning OpenMP on a shared box

import torch  # noqa: E402

from kvtune_engine.attention import cpu_paged  # noqa: E402
from kvtune_engine.knobs import BLOCK_SIZES  # noqa: E402

HQ, HK, D = 8, 4, 64
KV_GIB = 2  # the benchmark's KV cache (8 layers: one layer's share is what one call reads from)


def case(bs: int, lens: list[int], dtype: torch.dtype, seed: int):
    """One layer's caches (its share of KV_GIB) with each sequence's blocks drawn at random."""
    g = torch.Generator().manual_seed(seed)
    per_block = 2 * HK * bs * D * dtype.itemsize
    nb = max(sum(-(-n // bs) for n in lens) + 1, int(KV_GIB * 2**30 / 8 / per_block))
    kc = torch.randn(HK, nb, bs, D, generator=g).to(dtype)
    vc = torch.randn(HK, nb, bs, D, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    width = max(-(-n // bs) for n in lens)
    bt = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        bt[i, :k] = perm[used:used + k]
        used += k
    q = torch.randn(len(lens), HQ, D, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if cpu_paged.load_kernel() is None:
        print(f"the kernel is unavailable: {cpu_paged.KERNEL.failed}", file=sys.stderr)
        return 1
    dtype = getattr(torch, a.dtype)
    rng = random.Random(0)
    lens = [rng.randint(32, 512) + rng.randint(16, 256) // 2 for _ in range(a.running)]
    cases = {bs: case(bs, lens, dtype, bs) for bs in BLOCK_SIZES}
    times: dict[int, list[float]] = {bs: [] for bs in BLOCK_SIZES}
    scale = D ** -0.5
    for bs, c in cases.items():  # warm-up
        cpu_paged.paged_decode_cpu(*c[:4], c[4], scale)
    for r in range(a.rounds):
        order = list(BLOCK_SIZES) if r % 2 == 0 else list(reversed(BLOCK_SIZES))
        for bs in order:
            q, kc, vc, bt, cl = cases[bs]
            t0 = time.perf_counter()
            for _ in range(3):
                cpu_paged.paged_decode_cpu(q, kc, vc, bt, cl, scale)
            times[bs].append((time.perf_counter() - t0) / 3)
    ctx = sum(lens)
    print(f"{a.running} sequences, {ctx} context tokens, {a.dtype}, {a.threads} threads, "
          f"load average {os.getloadavg()}")
    base = statistics.median(times[16])
    print("| block size | median ms / layer | best ms | GB/s read (median) | vs 16 |")
    print("| --- | --- | --- | --- | --- |")
    for bs in BLOCK_SIZES:
        med = statistics.median(times[bs])
        gbs = 2 * ctx * HK * D * dtype.itemsize / med / 1e9
        print(f"| {bs} | {med * 1e3:.3f} | {min(times[bs]) * 1e3:.3f} | {gbs:.1f} | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
