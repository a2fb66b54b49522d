"""The engine flags on the command line, generated from EngineConfig: vLLM's names (`--max-num-seqs`),
EngineConfig's descriptions and defaults, one definition for `serve`, `sim` and `tune`."""
from __future__ import annotations

import re
from typing import Any

import click

from .config import ConfigError, EngineConfig

FIELDS = tuple(EngineConfig.model_fields)


def flag_names(msg: str) -> str:
    """Speak in the user's flags: `block_size` -> `--block-size` in error messages."""
    msg = re.sub(r"^config: ", "", msg).replace("; config: ", "; ")
    for f in FIELDS:
        msg = re.sub(rf"\b{f}\b", "--" + f.replace("_", "-"), msg)
    return msg


def engine_config(values: dict[str, Any]) -> EngineConfig:
    """EngineConfig from the flags given (None = not given: the engine default)."""
    try:
        return EngineConfig.build(**{k: v for k, v in values.items() if k in FIELDS and v is not None})
    except ConfigError as e:
        raise click.UsageError(flag_names(str(e))) from None


def engine_options(f):
    """Decorate a click command with one option per EngineConfig field (value None when not given)."""
    for name in reversed(FIELDS):
        field = EngineConfig.model_fields[name]
        flag = "--" + name.replace("_", "-")
        default = "" if field.default is None else f" [default: {str(field.default).lower() if isinstance(field.default, bool) else field.default}]"
        if field.annotation is bool:
            opt = click.option(f"{flag}/--no-{flag[2:]}", default=None, help=field.description + default)
        else:
            kind = int if field.annotation is int else float
            opt = click.option(flag, type=kind, default=None, help=field.description + default)
        f = opt(f)
    return f
