"""The engine's knobs: one pydantic model shared by the engine, the simulator, the CLI and the operator,
made from the knob table (`knobs.TABLE`: the fields, their defaults, docs and limits).

Field names are vLLM's flag names with dashes turned into underscores (`--max-num-seqs` ->
`max_num_seqs`), so `EngineConfig.model_validate(vllm_style_dict)` and CLI flags line up one to one.
Torch-free: the operator imports it inside a slim image.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from .knobs import BLOCK_SIZES, LIVE_KNOBS, RESTART_KNOBS, TABLE, Knob, check, device_default

__all__ = ["BLOCK_SIZES", "LIVE_KNOBS", "RESTART_KNOBS", "ConfigError", "EngineConfig", "check_knobs",
           "for_device", "format_validation_error"]


class ConfigError(ValueError):
    """A knob value that is not allowed; the message says what was wrong and what is allowed."""


class _Config(BaseModel):
    """KV-cache and scheduling knobs of the engine (vLLM's names and meanings); the fields are the
    knob table's (`config_model`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
    #: the knob table the fields were made from
    TABLE: ClassVar[tuple[Knob, ...]] = TABLE

    @model_validator(mode="after")
    def _check(self) -> Any:
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
    def build(cls, **values: Any) -> Any:
        """Validate, turning pydantic's error into a ConfigError with one line per bad field."""
        try:
            return cls(**values)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e)) from None

    def with_changes(self, **changes: Any) -> Any:
        """A validated copy with some knobs changed (never half-applied: all or nothing)."""
        return type(self).build(**{**self.model_dump(), **changes})

    def restart_changes(self, other: Any) -> set[str]:
        return {k.name for k in self.TABLE if k.restart and getattr(self, k.name) != getattr(other, k.name)}

    @property
    def profiled_batched_tokens(self) -> int:
        """The token budget the start-up memory profile covers: ``profile_batched_tokens``, at least
        ``max_num_batched_tokens``."""
        return max(self.profile_batched_tokens or 0, self.max_num_batched_tokens)

    def as_flags(self) -> dict[str, Any]:
        """vLLM-style flag names (dashes) -> values."""
        return {k.replace("_", "-"): v for k, v in self.model_dump().items() if v is not None}


def for_device(config: Any, device: str) -> Any:
    """The config the engine runs with on ``device``: each knob left unset that has a default of
    its own there (``Knob.device_defaults``: the KV block size on CPU) takes it; a knob set (a flag,
    the operator's config file, the tuner's bound) stays as set. Where the device's default would
    make the config invalid (a token budget under one block), the nearest smaller choice that fits."""
    changes: dict[str, Any] = {}
    for k in config.TABLE:
        if k.name in config.model_fields_set or not k.device_defaults:
            continue
        v = device_default(k, device)
        if v == getattr(config, k.name):
            continue
        tries = [v] + sorted((c for c in (k.choices or ()) if c < v), reverse=True) if k.choices else [v]
        for t in tries:
            try:
                config.with_changes(**changes, **{k.name: t})
            except ConfigError:
                continue
            changes[k.name] = t
            break
    if not changes:
        return config
    checked = config.with_changes(**changes)
    # what was set stays set, the device's defaults stay defaults (max_model_len's resolution reads it)
    return type(config).model_construct(_fields_set=set(config.model_fields_set), **checked.model_dump())


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + (f" (got {err['input']!r})" if where != "config" else ""))
    return "; ".join(lines)


def config_model(table: tuple[Knob, ...]) -> type[_Config]:
    """The config model of a knob table: one field per knob, its type, default, doc and limits."""
    def field(k: Knob) -> tuple[Any, Any]:
        kind: Any = Annotated[(k.type, *k.limits)] if k.limits else k.type
        return (kind if k.default is not None else kind | None), Field(k.default, description=k.doc)
    model = create_model("EngineConfig", __base__=_Config, __doc__=_Config.__doc__,
                         __module__=__name__, **{k.name: field(k) for k in table})
    model.TABLE = table
    return model


EngineConfig = config_model(TABLE)


def check_knobs() -> None:
    """The knob table is sound and EngineConfig's fields are its knobs, in its order."""
    check()
    fields, table = list(EngineConfig.model_fields), [k.name for k in TABLE]
    if fields != table:
        raise AssertionError(f"knobs.TABLE {table} != EngineConfig fields {fields}")
