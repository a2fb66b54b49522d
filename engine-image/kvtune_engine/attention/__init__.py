"""Paged attention: K/V written by slot mapping, read through block tables (see metadata.py).

`paged_attention` is the one entry point layers call; on CUDA the decodes go to the Triton kernel,
everything else (and everything on CPU) to the plain-PyTorch path.
"""
from .metadata import AttentionMetadata, PrefillChunk, write_kv
from .reference import paged_attention, paged_decode_reference, prefill_attention

__all__ = ["AttentionMetadata", "PrefillChunk", "write_kv", "paged_attention",
           "paged_decode_reference", "prefill_attention"]
