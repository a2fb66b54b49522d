"""The CPU KV cache asks for transparent huge pages (runner/huge_pages.py), and gets them where the
kernel's policy is `madvise` or `always`; where it is `never` the advice is a no-op."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from kvtune_engine.runner.huge_pages import advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib() -> int:
    m = re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text())
    return int(m.group(1)) if m else 0


def test_a_large_cpu_tensor_is_backed_by_huge_pages_when_the_kernel_allows():
    policy = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else "never"
    before = _anon_huge_kib()
    t = torch.empty(64 << 20 >> 2)  # 64 MiB
    took = advise_huge_pages(t)
    t.zero_()
    grown = _anon_huge_kib() - before
    if policy == "never":
        assert grown == 0
    else:
        assert took and grown >= 32 << 10, (policy, took, grown)   # most of the 64 MiB in 2 MiB pages
    assert not t.any()


def test_small_or_device_less_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(1024)) is False
