"""Where each token of a step lives in the paged KV cache, built once per step and shared by all layers.

Flat token order inside one step: all decodes first (one token each, batched), then the prefill
chunks one after another (on CPU most of them attended row by row like the decodes). Each layer has
a K cache and a V cache `[kv_heads, num_blocks, block_size, head_dim]`: per head, block-major, so
gathering a sequence's blocks of one head is a row `index_select` that yields its context as one
contiguous `[positions, head_dim]` matrix (no transpose before the matmuls), and a (head, block)
tile is contiguous for Triton loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    start: int               # offset of the chunk's first token in the flat step
    num_tokens: int
    start_pos: int           # tokens of this sequence already in the cache (cached prefix / earlier chunks)
    block_table: torch.Tensor | None  # int64 [blocks covering start_pos + num_tokens]


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor | None          # int64 [T]; None: do not write the cache (profiling)
    #: leading rows attended one query each over their sequence's cached context: the decodes, and
    #: on CPU also the prefill tokens the runner folds in (then absent from `prefills`)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # int64 [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decodes], including the row's token
    decode_context_lens_list: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _split: tuple[torch.Tensor, torch.Tensor] | None = None

    def slot_blocks_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._split is None:
            self._split = (self.slot_mapping // self.block_size, self.slot_mapping % self.block_size)
        return self._split


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store the step's new K/V ([T, kv_heads, head_dim]) at their slots (block * bs + offset)."""
    blk, off = meta.slot_blocks_offsets()
    k_cache[:, blk, off] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, blk, off] = v.transpose(0, 1).to(v_cache.dtype)
