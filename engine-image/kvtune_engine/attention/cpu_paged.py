"""The CPU paged-decode kernel (cpu_paged.cpp), built on first use with torch's C++ extension loader.

Why compiled: the PyTorch reference gathers every decode's context into contiguous K/V before two
batched matmuls, which at 256 sequences copies ~1.4 GB per step on the benchmark model; the kernel
reads each block in place, once. It is built with the machine's compiler (`-O3 -march=native`; the
build folder is keyed by the CPU's flags, so a cache shared by two kinds of CPU never mixes them)
into `$KVTUNE_EXT_DIR` (default `~/.cache/kvtune/ext`). Without a compiler or ninja it is
unavailable and the reference path runs; `KVTUNE_CPU_ATTENTION=reference` forces the reference.

Invariant owned here: `paged_decode_cpu` has the signature and the results of
`reference.paged_decode_reference` (tests/unit/test_cpu_paged.py compares them); `check()` runs one
small case against the reference.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from .reference import paged_decode_reference

log = logging.getLogger("kvtune.attention")

_SRC = Path(__file__).with_name("cpu_paged.cpp")
_LOCK = threading.Lock()
_MOD = None
_FAILED: str | None = None


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    src = _SRC.read_bytes()
    return hashlib.sha256(flags.encode() + src + torch.__version__.encode()).hexdigest()[:12]


def _build():
    from torch.utils.cpp_extension import load  # the loader pulls in setuptools: only when building
    key = _cpu_key()
    root = Path(os.environ.get("KVTUNE_EXT_DIR") or Path.home() / ".cache" / "kvtune" / "ext")
    build = root / f"cpu_paged_{key}"
    build.mkdir(parents=True, exist_ok=True)
    # compile a copy inside the build folder: ninja keys on the source's path, and two checkouts
    # (worktrees, an installed wheel) sharing one cache would otherwise rebuild each other's object
    src = build / _SRC.name
    data = _SRC.read_bytes()
    if not src.exists() or src.read_bytes() != data:
        tmp = build / f".{_SRC.name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, src)
    return load(name=f"kvtune_cpu_paged_{key}", sources=[str(src)], build_directory=str(build),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
                extra_ldflags=["-fopenmp"], verbose=False)


def load_kernel():
    """The compiled module, or None (the reason is logged once)."""
    global _MOD, _FAILED
    if _MOD is not None or _FAILED is not None:
        return _MOD
    with _LOCK:
        if _MOD is None and _FAILED is None:
            try:
                _MOD = _build()
            except Exception as e:  # no compiler, no ninja, a broken toolchain: the reference runs
                _FAILED = f"{type(e).__name__}: {e}"
                log.warning("CPU paged-attention kernel unavailable, using the PyTorch path: %s", _FAILED)
    return _MOD


def enabled() -> bool:
    """True when decodes on CPU should use the compiled kernel (built here if need be)."""
    if os.environ.get("KVTUNE_CPU_ATTENTION", "").lower() == "reference":
        return False
    return load_kernel() is not None


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, q_heads, d] -> [N, q_heads, d]; caches [kv_heads, num_blocks, block_size, d]."""
    mod = load_kernel()
    if mod is None:
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {_FAILED}")
    with torch.profiler.record_function("kvtune::paged_decode_cpu"):  # named in profiles; ~free otherwise
        return mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def check() -> None:
    """One ragged GQA case against the reference (raises AssertionError on a mismatch)."""
    g = torch.Generator().manual_seed(0)
    hk, hq, d, bs, nb = 2, 4, 32, 8, 16
    kc, vc = torch.randn(hk, nb, bs, d, generator=g), torch.randn(hk, nb, bs, d, generator=g)
    lens = [1, 9, 30]
    bt = torch.randperm(nb, generator=g)[:12].view(3, 4)
    q = torch.randn(3, hq, d, generator=g)
    ref = paged_decode_reference(q, kc, vc, bt, lens, d ** -0.5)
    got = paged_decode_cpu(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    assert torch.allclose(ref, got, atol=1e-5, rtol=1e-4), (ref - got).abs().max()
