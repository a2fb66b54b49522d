"""The HTTP server: OpenAI-compatible API, /health, /metrics, and the admin API under /kvtune/v1/.

Invariants owned here: limits come before work (a body over ``max_body_bytes`` is a 413 before it
is parsed; JSON parsing, validation, chat templates and tokenization run on a worker pool, never
on the event loop, and so do building and encoding a non-streamed response, so a huge request or
response cannot delay another stream's tokens); one request's error ends that request only (a 4xx
for what the client sent, a 500 naming the internal error for the rest); the loop's death stops the
server (``on_fatal``) so the process exits non-zero. The steps that keep them are in context.py and
generation.py; the endpoints, one router per concern, in openai_api.py, health.py and admin_api.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from ..engine import LLMEngine
from . import admin_api, health, openai_api
from . import protocol as P
from .auth import AuthMiddleware
from .body_drain import BodyDrainMiddleware
from .context import ServerContext, ServerSettings, error_response

__all__ = ["ServerSettings", "create_app"]


def create_app(engine: LLMEngine, settings: ServerSettings | None = None, *, config_watcher: Any = None,
               on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    ctx = ServerContext(engine, settings or ServerSettings(), config_watcher=config_watcher, on_fatal=on_fatal)
    app = FastAPI(title="kvtune engine", lifespan=ctx.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    s = ctx.settings
    app.add_middleware(AuthMiddleware, api_key=s.api_key, admin_key=s.admin_key, admin_port=s.admin_port)
    app.add_middleware(BodyDrainMiddleware)  # outermost: every early refusal is readable
    for router in (openai_api.router, health.router, admin_api.router):
        app.include_router(router)
    app.add_exception_handler(P.HTTPError, _http_error)
    app.add_exception_handler(RequestValidationError, _bad_query)
    return app


async def _http_error(request: Request, e: P.HTTPError):
    return error_response(e)


async def _bad_query(request: Request, e: RequestValidationError):
    """A query or path parameter of the wrong type: a 400 naming it, not FastAPI's 422 dump."""
    err = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "path", "body"))
    return error_response(P.HTTPError(400, f"{loc}: {err.get('msg', 'invalid')}", param=loc or None,
                                      code="invalid_parameter"))
