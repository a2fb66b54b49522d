"""What this CPU can do that the engine's choices depend on, read from /proc/cpuinfo's flags.

bfloat16 arithmetic: ``avx512_bf16`` (AVX-512 bf16 dot products) or ``amx_bf16`` (AMX tiles). With
either, oneDNN runs bf16 GEMMs in hardware (AMX: several times the fp32 rate); without, it emulates
them, slower than float32, so the engine runs float32 there (``model.dtype_choice``). A leaf module:
tests stand in for another CPU by patching ``cpu_flags``.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
#: any one of these flags: the CPU computes in bfloat16
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags (empty where /proc/cpuinfo is missing or has none)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16() -> bool:
    """Does this CPU compute in bfloat16 (``BF16_FLAGS``)?"""
    return any(f in cpu_flags() for f in BF16_FLAGS)
