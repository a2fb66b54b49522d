"""The model's shape, read from a Hugging Face `config.json` (transformers 4 and 5 spellings).

One dataclass for the whole Llama family: the architectures differ only in a few switches
(qkv bias, q/k norm, rope scaling), so the decoder reads switches, never `model_type`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message names the file (and tensor) at fault."""


#: model_type -> (qkv bias always, q/k RMSNorm). Llama and Qwen3 also honour `attention_bias` (q,k,v,o);
#: Qwen2 has q,k,v bias and no o bias; Mistral has none.
ARCHS = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None or name == "auto":
        return default
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of float32, bfloat16, float16")
    return DTYPES[key]


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype ("auto")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32), with llama3 / linear scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / float(self.rope_scaling["factor"])
        if kind == "llama3":
            s = self.rope_scaling
            factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / hi) & (wavelen <= old / lo)
            return torch.where(medium, smoothed, scaled)
        raise ModelLoadError(f"config.json: rope scaling type {kind!r} is not supported "
                             "(supported: default, linear, llama3)")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        mt = cfg.get("model_type")
        if mt not in ARCHS:
            archs = cfg.get("architectures") or []
            raise ModelLoadError(f"{source}: model_type {mt!r} (architectures {archs}) is not supported; "
                                 f"supported: {sorted(ARCHS)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int):
                raise ModelLoadError(f"{source}: missing or non-integer {key!r}")
        qkv_bias, qk_norm = ARCHS[mt]
        attn_bias = bool(cfg.get("attention_bias", False))
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads {heads} is not a multiple of "
                                 f"num_key_value_heads {kv_heads}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"{source}: rope scaling type {rope_type!r} is not supported "
                                 "(supported: default, linear, llama3)")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = cfg.get("sliding_window")
        if mt in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or (attn_bias and mt != "mistral"),
            o_bias=attn_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and mt == "llama", qk_norm=qk_norm,
            sliding_window=window, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype"), torch.float32),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist (weights are never downloaded: "
                                 "pass a local Hugging Face style directory)")
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: a model directory needs config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(cfg, str(path))
