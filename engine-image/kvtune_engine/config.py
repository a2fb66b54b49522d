"""The engine's knobs: one pydantic model shared by the engine, the simulator, the CLI and the operator.

Field names are vLLM's flag names with dashes turned into underscores (`--max-num-seqs` ->
`max_num_seqs`), so `EngineConfig.model_validate(vllm_style_dict)` and CLI flags line up one to one.
Torch-free: the operator imports it inside a slim image.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .knobs import BLOCK_SIZES, LIVE_KNOBS, RESTART_KNOBS, TABLE

__all__ = ["BLOCK_SIZES", "LIVE_KNOBS", "RESTART_KNOBS", "ConfigError", "EngineConfig", "check_knobs",
           "format_validation_error"]


class ConfigError(ValueError):
    """A knob value that is not allowed; the message says what was wrong and what is allowed."""


class EngineConfig(BaseModel):
    """KV-cache and scheduling knobs of the engine (vLLM's names and meanings)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    block_size: int = Field(16, description="Token slots per KV block; one of 8, 16, 32, 64, 128.")
    gpu_memory_utilization: float = Field(
        0.90, gt=0.0, le=1.0,
        description="Fraction of device memory the engine may use (weights + activations + KV cache).")
    swap_space: float = Field(4.0, ge=0.0, description="CPU swap pool for preempted requests, GiB.")
    kv_cache_memory: float | None = Field(
        None, gt=0.0,
        description="KV cache size in GiB, bypassing memory profiling (CPU runs, tests).")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences running in one step.")
    max_num_batched_tokens: int = Field(
        8192, ge=1, description="Token budget of one step: prefill chunks plus one token per decode.")
    max_model_len: int = Field(8192, ge=2, description="Longest prompt + output, in tokens.")
    watermark: float = Field(
        0.01, ge=0.0, lt=1.0,
        description="Fraction of all blocks kept free when admitting new requests (decode headroom).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size {self.block_size} is not allowed; choose one of {list(BLOCK_SIZES)}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is smaller than one block "
                f"(block_size {self.block_size})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} < max_model_len {self.max_model_len} "
                "without chunked prefill: long prompts could never be scheduled; enable chunked prefill "
                "or raise the budget")
        return self

    @classmethod
    def build(cls, **values: Any) -> "EngineConfig":
        """Validate, turning pydantic's error into a ConfigError with one line per bad field."""
        try:
            return cls(**values)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e)) from None

    def with_changes(self, **changes: Any) -> "EngineConfig":
        """A validated copy with some knobs changed (never half-applied: all or nothing)."""
        return EngineConfig.build(**{**self.model_dump(), **changes})

    def restart_changes(self, other: "EngineConfig") -> set[str]:
        return {k for k in RESTART_KNOBS if getattr(self, k) != getattr(other, k)}

    def as_flags(self) -> dict[str, Any]:
        """vLLM-style flag names (dashes) -> values."""
        return {k.replace("_", "-"): v for k, v in self.model_dump().items() if v is not None}


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + (f" (got {err['input']!r})" if where != "config" else ""))
    return "; ".join(lines)


def check_knobs() -> None:
    """The knob table names exactly EngineConfig's fields, in the same order."""
    fields, table = list(EngineConfig.model_fields), [k.name for k in TABLE]
    if fields != table:
        raise AssertionError(f"knobs.TABLE {table} != EngineConfig fields {fields}")
