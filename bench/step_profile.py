"""Where one engine step's time goes: a decode step at N running, and a mixed prefill/decode step.

The model is the one of bench/engine_vs_hf.py (8 layers, hidden 512, 8/4 heads, vocab 8192, fp32).
N requests with prompts of 32-512 tokens are prefilled, then each has decoded a few tokens, so the
decode contexts are the benchmark's. Each step is run under torch's profiler and every op's self time
is put in one bucket: attention (paged decode, prefill SDPA, KV writes), GEMMs, norms/rope/activation,
sampling; the rest of the step's wall time is Python (batch flattening, scheduler, output processing).
Detokenizing one token per sequence is timed on its own (the server's extra per-step work).

    .venv/bin/python bench/step_profile.py [--running 256] [--steps 5] [--threads 2] [--reference] [--top N]
                                           [--dtype bfloat16] [--block-size N]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "0")  # see bench/engine_vs_hf.py: spinning OpenMP on a shared box

import torch  # noqa: E402

from kvtune_engine.core.request import SamplingParams  # noqa: E402
from kvtune_engine.llm import LLM  # noqa: E402
from kvtune_engine.model.tiny import make_tiny_model  # noqa: E402

MODEL = dict(arch="llama", layers=8, hidden=512, heads=8, kv_heads=4, vocab=8192, intermediate=1536)

BUCKETS = (
    ("attention", ("paged_attention", "attention", "index_select", "bmm", "softmax", "masked_fill",
                   "index_put", "index_copy", "_efficient", "flash", "kvtune")),
    ("gemm", ("addmm", "aten::mm", "linear", "matmul")),
    ("sampling", ("sort", "topk", "multinomial", "argmax", "log_softmax", "gather", "exponential",
                  "cumsum", "max")),
    ("norm_rope_act", ("rsqrt", "pow", "mean", "mul", "add", "cat", "silu", "cos", "sin", "sub",
                       "embedding", "to", "copy_", "neg", "chunk", "split", "narrow", "slice")),
)


def bucket(name: str) -> str:
    for b, keys in BUCKETS:
        if any(k in name for k in keys):
            return b
    return "other_ops"


def profile_step(eng, top: dict | None = None) -> dict:
    """Bucketed self times of one step; ``top`` (if given) sums every op's self time by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
    out = {b: 0.0 for b, _ in BUCKETS} | {"other_ops": 0.0}
    for e in prof.key_averages():
        if e.key.startswith("ProfilerStep"):
            continue
        out[bucket(e.key)] += e.self_cpu_time_total / 1e6
        if top is not None:
            top[e.key] = top.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    ops = sum(out.values())
    out["python_and_engine"] = max(0.0, wall - ops)
    out["wall"] = wall
    return out


def timed_step(eng) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="default: the engine's on CPU (128)")
    ap.add_argument("--reference", action="store_true", help="force the PyTorch reference attention")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--top", type=int, default=0, help="also list the N ops with the most self time per step")
    a = ap.parse_args()
    if a.reference:
        os.environ["KVTUNE_CPU_ATTENTION"] = "reference"
    torch.set_num_threads(a.threads)
    tmp = None
    model_dir = a.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtune-prof-")
        model_dir = Path(tmp.name) / "m"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, **MODEL)
    bs = {} if a.block_size is None else {"block_size": a.block_size}
    llm = LLM(str(model_dir), dtype=a.dtype, kv_cache_memory=2.0, swap_space=0, max_num_seqs=a.running + 8,
              max_num_batched_tokens=2048, max_model_len=2048, **bs)
    eng = llm.engine
    rng = random.Random(0)
    for _ in range(a.running):
        p = [rng.randrange(10, 8192) for _ in range(rng.randint(32, 512))]
        eng.add_request(p, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    while len(eng.scheduler.running) < a.running or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    top_dec: dict = {}
    top_mixed: dict = {}
    dec = [profile_step(eng, top_dec) for _ in range(a.steps)]
    plain = [timed_step(eng) for _ in range(a.steps)]
    # a mixed step: 8 new prompts of 240 tokens (1920 prefill tokens) + the running decodes
    mixed = []
    for _ in range(max(1, a.steps // 2)):
        for _ in range(8):
            eng.add_request([rng.randrange(10, 8192) for _ in range(240)],
                            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        mixed.append(profile_step(eng, top_mixed))
        while len(eng.scheduler.running) > a.running:
            eng.step()
    tok = eng.tokenizer
    ids = [rng.randrange(10, 8192) for _ in range(a.running)]
    t0 = time.perf_counter()
    for i in ids:
        tok.decode([i])
    detok = time.perf_counter() - t0

    def show(title, rows):
        keys = list(rows[0])
        print(title)
        for k in keys:
            med = statistics.median(r[k] for r in rows)
            print(f"  {k:<20} {med * 1e3:9.1f} ms")
    ctx = sum(r.num_tokens for r in eng.scheduler.running) / max(1, len(eng.scheduler.running))
    print(f"{a.running} running, mean context {ctx:.0f} tokens, {a.threads} threads, {a.dtype}, "
          f"attention: {'reference' if a.reference else 'default'}, load {os.getloadavg()}")
    show(f"decode step, {a.running} decodes (profiled; medians of {a.steps})", dec)
    print(f"  decode step without the profiler: median {statistics.median(plain) * 1e3:.1f} ms")
    show("mixed step: 8 prompts x 240 tokens + decodes (profiled)", mixed)
    print(f"detokenize {a.running} tokens one by one: {detok * 1e3:.1f} ms")
    for title, top, n in (("decode", top_dec, len(dec)), ("mixed", top_mixed, len(mixed))):
        if a.top:
            print(f"top ops, {title} step (self ms per step):")
            for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:a.top]:
                print(f"  {k:<44} {v / n * 1e3:8.1f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
