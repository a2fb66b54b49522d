"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow `transformers` step for step (RMSNorm in float32 then cast, residual adds in the
model dtype, rotate-half RoPE with cos/sin in float32 cast to the dtype), so logits match it on the
same weights. Speed comes from fusing q/k/v and gate/up into one matmul each (on CPU on prepacked oneDNN weights,
linear.py), the elementwise steps into one pass each (ops.py), computing the final norm and the LM
head only for the rows that are sampled, and the paged attention in ../attention.
Input is flat: one row per token of the step, no batch or padding dimension.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention, write_kv
from .config import ModelConfig, ModelLoadError
from .dtype_choice import choose_dtype
from .linear import Linear, packing_enabled
from .ops import rms_norm, rope, silu_and_mul
from .weights import Checkpoint


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = _param(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor | None]):
        super().__init__()
        self.cfg = cfg
        self.input_norm = RMSNorm(w["input_norm"], cfg.rms_norm_eps)
        self.post_norm = RMSNorm(w["post_norm"], cfg.rms_norm_eps)
        self.qkv = Linear(w["qkv_w"], w["qkv_b"])
        self.o = Linear(w["o_w"], w["o_b"])
        self.gate_up = Linear(w["gate_up_w"], w["gate_up_b"])
        self.down = Linear(w["down_w"], w["down_b"])
        self.q_norm = RMSNorm(w["q_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(w["k_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata,
                decode_fn=None, write_fn=write_kv) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        qkv = self.qkv(self.input_norm(h))
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q = rope(self.q_norm(q.view(t, c.num_heads, c.head_dim)), cos, sin)
            k = rope(self.k_norm(k.view(t, c.num_kv_heads, c.head_dim)), cos, sin)
        else:  # one RoPE over the q and k heads together, in place in qkv on the fused path
            qk = rope(qkv[:, :c.q_size + c.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        kc, vc = kv_cache if kv_cache is not None else (None, None)
        if kc is not None and meta.slot_mapping is not None:
            write_fn(kc, vc, k, v, meta)
        o = paged_attention(q, k, v, kc, vc, meta, self.scale, decode_fn)
        h = self.o.add_to(h, o.view(t, c.q_size))
        return self.down.add_to(h, silu_and_mul(self.gate_up(self.post_norm(h))))

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class CausalLM(nn.Module):
    """forward(ids, positions, caches, meta) -> hidden states; compute_logits(hidden rows) -> float32."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor,
                 lm_head: torch.Tensor | None):
        super().__init__()
        self.cfg = cfg
        self.embed = _param(embed)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(norm, cfg.rms_norm_eps)
        self.lm_head = Linear(self.embed if lm_head is None else lm_head)  # tied: shares embed's storage
        self.register_buffer("inv_freq", cfg.inv_freq().to(embed.device), persistent=False)
        self.decode_fn = None  # set by the runner (Triton on CUDA); None: PyTorch reference
        self.write_fn = write_kv  # the KV write; the runner sets the compiled one on CPU

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None, meta: AttentionMetadata) -> torch.Tensor:
        """kv_caches[layer] = (K, V), each [kv_heads, num_blocks, block_size, head_dim]."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, None if kv_caches is None else kv_caches[i], meta, self.decode_fn, self.write_fn)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def pack_gemms(self) -> None:
        """Every matmul's weight into oneDNN's layout (see linear.py); a tied LM head keeps the embedding."""
        for layer in self.layers:
            for lin in layer.linears():
                lin.pack()
        self.lm_head.pack(keep_dense=self.lm_head.weight.data_ptr() == self.embed.data_ptr())


def load_model(model_dir: str | Path, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device = "cpu") -> CausalLM:
    """Build the decoder from a local HF directory (config.json + safetensors); never downloads.
    The dtype: ``dtype_choice.choose_dtype`` (bfloat16 on CPU only where the CPU has it)."""
    cfg = ModelConfig.from_dir(model_dir)
    dt = choose_dtype(dtype, cfg.dtype, device)
    ck = Checkpoint(model_dir)
    H, I, qs, kvs = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size

    def get(name, shape):
        return ck.get(name, shape, dt).to(device)

    def opt(name, shape, present):
        return get(name, shape) if present else None

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        w = {
            "input_norm": get(p + "input_layernorm.weight", (H,)),
            "post_norm": get(p + "post_attention_layernorm.weight", (H,)),
            "qkv_w": torch.cat([get(a + "q_proj.weight", (qs, H)), get(a + "k_proj.weight", (kvs, H)),
                                get(a + "v_proj.weight", (kvs, H))]),
            "qkv_b": torch.cat([get(a + "q_proj.bias", (qs,)), get(a + "k_proj.bias", (kvs,)),
                                get(a + "v_proj.bias", (kvs,))]) if cfg.qkv_bias else None,
            "o_w": get(a + "o_proj.weight", (H, qs)),
            "o_b": opt(a + "o_proj.bias", (H,), cfg.o_bias),
            "gate_up_w": torch.cat([get(m + "gate_proj.weight", (I, H)), get(m + "up_proj.weight", (I, H))]),
            "gate_up_b": torch.cat([get(m + "gate_proj.bias", (I,)), get(m + "up_proj.bias", (I,))])
            if cfg.mlp_bias else None,
            "down_w": get(m + "down_proj.weight", (H, I)),
            "down_b": opt(m + "down_proj.bias", (H,), cfg.mlp_bias),
            "q_norm": opt(a + "q_norm.weight", (cfg.head_dim,), cfg.qk_norm),
            "k_norm": opt(a + "k_norm.weight", (cfg.head_dim,), cfg.qk_norm),
        }
        layers.append(DecoderLayer(cfg, w))
    extra = sorted(n for n in ck.names() if n.startswith(f"model.layers.{cfg.num_layers}."))
    if extra:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: num_hidden_layers is {cfg.num_layers} but the "
                             f"checkpoint has tensor {extra[0]!r}")
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, H))
    lm_head = None if cfg.tie_word_embeddings else get("lm_head.weight", (cfg.vocab_size, H))
    model = CausalLM(cfg, embed, layers, get("model.norm.weight", (H,)), lm_head)
    ck.close()
    if packing_enabled(device, dt):
        model.pack_gemms()
    return model.eval()
