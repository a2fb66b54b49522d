"""/health for probes and /metrics for Prometheus: the two endpoints that read the engine, never drive it."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE
from .context import Ctx

router = APIRouter()


@router.get("/health")
async def health(ctx: Ctx):
    aeng = ctx.async_engine
    if not aeng.alive:
        return JSONResponse({"status": "error", "error": str(aeng.error or "engine loop not running")},
                            status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
def metrics(ctx: Ctx):  # sync: runs in the threadpool, so waiting for the engine lock never blocks the loop
    return Response(ctx.engine.metrics.render(), media_type=CONTENT_TYPE)
