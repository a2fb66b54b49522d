"""The admin API under /kvtune/v1/ (behind auth.AuthMiddleware's admin key): what the operator reads
(state, trace, steps) and the live knobs it changes (config)."""
from __future__ import annotations

import json
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..config import LIVE_KNOBS, RESTART_KNOBS, ConfigError
from ..engine import RestartRequired
from . import protocol as P
from .context import Ctx, ServerContext, error_response

router = APIRouter(prefix="/kvtune/v1")


@router.get("/state")
def state(ctx: Ctx):
    snap = ctx.engine.snapshot()
    aeng = ctx.async_engine
    snap["server"] = {"max_waiting": ctx.settings.max_waiting,
                      "pending": aeng.num_waiting() - snap["queues"]["waiting"], "engine_alive": aeng.alive}
    return _jsonable(snap)


@router.get("/trace")
def trace(ctx: Ctx, since_s: float | None = None, limit: int | None = None, format: str = "json",
          unfinished: bool = False):
    if format not in ("json", "jsonl"):
        return error_response(P.HTTPError(400, f"format: json or jsonl, got {format!r:.40}", param="format"))
    t = ctx.engine.trace(since_s=since_s, limit=limit, unfinished=unfinished and format == "json")
    if format == "jsonl":
        return PlainTextResponse("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in t["requests"]),
                                 media_type="application/x-ndjson")
    return t


@router.get("/steps")
def steps(ctx: Ctx, limit: int | None = None):
    return {"steps": ctx.engine.steps(limit)}


def _config_view(ctx: ServerContext) -> dict[str, Any]:
    watcher = ctx.config_watcher
    read = ctx.engine.config.model_dump
    config, file = watcher.view(read) if watcher is not None else (read(), None)
    return {"config": config, "live_knobs": sorted(LIVE_KNOBS), "restart_knobs": sorted(RESTART_KNOBS),
            "config_file": file}


@router.get("/config")
def get_config(ctx: Ctx):
    return _config_view(ctx)


@router.patch("/config")
async def patch_config(request: Request, ctx: Ctx):
    try:
        changes = P.parse_json(await ctx.read_body(request))
    except P.HTTPError as e:
        return error_response(e)
    try:
        changed = await ctx.async_engine.call(lambda e: e.update_config(changes))
    except RestartRequired as e:
        return JSONResponse({"error": {"message": str(e), "type": "restart_required", "param": sorted(e.knobs)[0],
                                       "code": 409},
                             "restart_required": {k: {"running": a, "requested": b} for k, (a, b) in e.knobs.items()}},
                            status_code=409)
    except ConfigError as e:
        return error_response(P.HTTPError(400, str(e), code="invalid_config"))
    except RuntimeError as e:
        return error_response(P.HTTPError(503, str(e), type_="server_error"))
    return {**_config_view(ctx), "changed": changed}


def _jsonable(x: Any) -> Any:
    """NaN and infinities (an empty histogram's mean) as null: JSON has no such numbers."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
