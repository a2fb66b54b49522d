"""The Triton paged-decode kernel against the PyTorch reference, on CPU through Triton's interpreter.

TRITON_INTERPRET=1 only works when set before triton is first imported (triton's own `tl.max` etc.
are jitted at import), so the cases run in a fresh interpreter: `python this_file.py`.
Block sizes 8..128, ragged context lengths (1, partial and exact blocks), GQA, non-power-of-2 head_dim.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_ATOL = 1e-5  # float32 online softmax vs float32 reference


def run_cases() -> None:
    import math

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_attention import make_cache

    from kvtune_engine.attention.reference import paged_decode_reference
    from kvtune_engine.attention.triton_decode import paged_decode_triton

    n = 0
    for bs in (8, 16, 32, 64, 128):
        for hq, hk, d in ((4, 4, 32), (8, 2, 64), (6, 3, 24)):
            lens = [1, bs - 1, bs, 2 * bs + 5, 37]
            kc, vc, bt, _ = make_cache(lens, hk, d, bs, seed=bs * hq + d)
            q = torch.randn(len(lens), hq, d)
            scale = 1 / math.sqrt(d)
            ref = paged_decode_reference(q, kc, vc, bt, lens, scale)
            out = paged_decode_triton(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), scale)
            torch.testing.assert_close(out, ref, atol=TRITON_ATOL, rtol=0,
                                       msg=lambda m: f"bs={bs} hq={hq} hk={hk} d={d}: {m}")
            n += 1
    # bf16 cache and queries: same kernel, float32 accumulation
    kc, vc, bt, _ = make_cache([5, 40], 2, 64, 16, seed=1)
    kc, vc, q = kc.bfloat16(), vc.bfloat16(), torch.randn(2, 4, 64).bfloat16()
    ref = paged_decode_reference(q, kc, vc, bt, [5, 40], 0.125)
    out = paged_decode_triton(q, kc, vc, bt, torch.tensor([5, 40]), 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    print(f"ok {n + 1} cases")


def test_triton_decode_interpreted_matches_reference():
    import triton  # noqa: F401  (installed with torch; the interpreter needs no GPU)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "engine-image"), str(root / "operator"),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ok 16 cases" in r.stdout


if __name__ == "__main__":
    run_cases()
