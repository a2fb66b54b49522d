"""Where each token of a step lives in the paged KV cache, built once per step and shared by all layers.

Flat token order inside one step: all decodes first (one token each, batched into one attention),
then the prefill chunks one after another. Caches are per layer `[2, kv_heads, num_blocks, block_size,
head_dim]` (K then V): a block of one head is one contiguous `block_size x head_dim` tile, so a
gather by block table yields `[kv_heads, seqs, positions, head_dim]` with no transpose, and a Triton
program per (sequence, head) reads contiguous tiles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    start: int               # offset of the chunk's first token in the flat step
    num_tokens: int
    start_pos: int           # tokens of this sequence already in the cache (cached prefix / earlier chunks)
    block_table: torch.Tensor  # int64 [blocks covering start_pos + num_tokens]


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor | None          # int64 [T]; None: do not write the cache (profiling)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # int64 [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decodes], including the new token
    decode_context_lens_list: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new K/V ([T, kv_heads, head_dim]) at their cache slots (block * bs + offset)."""
    _, h, nb, bs, d = kv_cache.shape
    flat = kv_cache.view(2, h, nb * bs, d)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
