"""Building an engine from a model directory: tokenizer, model runner (weights, KV cache), scheduler.

Invariant owned here: ``max_model_len`` never exceeds the model's context length
(``max_position_embeddings`` in config.json). Left unset it is the model's context length; set
above it, the engine refuses to start with a ConfigError that names both numbers.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ConfigError, EngineConfig, for_device
from .core.scheduler import Scheduler
from .engine import LLMEngine
from .model import ModelConfig, load_tokenizer
from .runner import ModelRunner


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    ctx = int(model.max_position_embeddings)
    if "max_model_len" not in config.model_fields_set:
        return config.with_changes(max_model_len=ctx)
    if config.max_model_len > ctx:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds this model's context length "
                          f"(max_position_embeddings {ctx} in config.json); set max_model_len <= {ctx} "
                          f"or leave it unset to use {ctx}")
    return config


def build_engine(model_dir: str | Path, config: EngineConfig | None = None, *, device: str = "cpu",
                 dtype: str | None = None, served_model_name: str | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                 **runner_kwargs: Any) -> LLMEngine:
    """The factory: tokenizer + ModelRunner (loads weights, sizes the KV cache) + Scheduler. Knobs
    left unset take this device's defaults (``config.for_device``: KV blocks of 128 tokens on CPU)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = resolve_max_model_len(for_device(config or EngineConfig(), device), ModelConfig.from_dir(d))
    tok = load_tokenizer(d)
    runner = ModelRunner(d, config, device=device, dtype=dtype or "auto", seed=seed, **runner_kwargs)
    sched = Scheduler(config, runner.num_blocks, runner.num_swap_blocks)
    mc = runner.model_config
    eos = list(tok.eos_token_ids or []) or list(mc.eos_token_ids or [])
    dt = str(runner.dtype).removeprefix("torch.")
    return LLMEngine(config, sched, runner, tok, model_name=served_model_name or d.resolve().name,
                     eos_token_ids=eos, vocab_size=mc.vocab_size, clock=clock, kv_cache_dtype=dt,
                     device=str(runner.device))
