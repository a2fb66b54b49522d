"""The engine flags on the command line, generated from the knob table (through EngineConfig): vLLM's
names (`--max-num-seqs`), the table's doc lines and defaults, one definition for `serve`, `sim` and `tune`."""
from __future__ import annotations

import re
from typing import Any

import click

from .config import ConfigError, EngineConfig
from .knobs import defaults_text


def flag_names(msg: str, config: type[EngineConfig] = EngineConfig) -> str:
    """Speak in the user's flags: `block_size` -> `--block-size` in error messages."""
    msg = re.sub(r"^config: ", "", msg).replace("; config: ", "; ")
    for k in config.TABLE:
        msg = re.sub(rf"\b{k.name}\b", k.flag, msg)
    return msg


def engine_config(values: dict[str, Any], config: type[EngineConfig] = EngineConfig) -> EngineConfig:
    """EngineConfig from the flags given (None = not given: the engine default)."""
    try:
        return config.build(**{k: v for k, v in values.items() if k in config.model_fields and v is not None})
    except ConfigError as e:
        raise click.UsageError(flag_names(str(e), config)) from None


def engine_options(f, config: type[EngineConfig] = EngineConfig, per_device: bool = False):
    """Decorate a click command with one option per knob of ``config`` (value None when not given);
    ``per_device``: the command runs a model on a device, so the help names each device's default
    (``[default: 16; 128 on cpu]``)."""
    for k in reversed(config.TABLE):
        shown = defaults_text(k) if per_device else str(k.default).lower() if k.type is bool else str(k.default)
        default = "" if k.default is None else f" [default: {shown}]"
        if k.type is bool:
            opt = click.option(f"{k.flag}/--no-{k.flag[2:]}", k.name, default=None, help=k.doc + default)
        else:
            opt = click.option(k.flag, k.name, type=k.type, default=None, help=k.doc + default)
        f = opt(f)
    return f


def device_engine_options(f):
    """``engine_options`` for a command that runs a model on a device (``kvtune serve``)."""
    return engine_options(f, per_device=True)
