"""Paged attention: K/V written by slot mapping, read through block tables (see metadata.py).

`paged_attention` is the one entry point layers call; the runner picks the decode kernel: Triton on
CUDA, the compiled kernel of cpu_paged.py on CPU (reads blocks in place), the plain-PyTorch reference
otherwise. Prefill chunks always take the PyTorch path (SDPA).
"""
from .metadata import AttentionMetadata, PrefillChunk, write_kv
from .reference import paged_attention, paged_decode_reference, prefill_attention

__all__ = ["AttentionMetadata", "PrefillChunk", "write_kv", "paged_attention",
           "paged_decode_reference", "prefill_attention"]
