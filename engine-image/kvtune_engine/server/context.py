"""What every endpoint shares: the engine and its loop, the settings, the input worker pool, the
served names, and the steps a request goes through (limits before work, work off the loop)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from ..core.request import SamplingParams
from ..engine import InvalidRequest, LLMEngine
from ..outputs import RequestOutput
from . import protocol as P
from .async_engine import AsyncEngine, RequestStream

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class ServerSettings:
    def __init__(self, *, served_model_names: list[str] | None = None, api_key: str | None = None,
                 admin_key: str | None = None, max_waiting: int | None = None, model_dir: str | None = None,
                 retry_after_s: int = 1, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 enable_prompt_tokens_details: bool = False, input_workers: int | None = None,
                 admin_port: int | None = None):
        self.served_model_names = served_model_names or []
        self.admin_port = admin_port  # /metrics and the admin API answer there only (auth.AuthMiddleware)
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.max_waiting = max_waiting
        self.model_dir = model_dir
        self.retry_after_s = retry_after_s
        self.max_body_bytes = max_body_bytes
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.input_workers = input_workers or min(4, os.cpu_count() or 1)


@dataclass
class Job:
    """One choice to generate: checked prompt ids and params, the echoed prompt, its prompt's index."""
    ids: list[int]
    params: SamplingParams
    echo: str
    prompt_index: int


def error_response(e: P.HTTPError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def failed(out: RequestOutput) -> P.HTTPError:
    return P.HTTPError(500, out.error or "internal error while handling this request", type_="server_error",
                       code="internal_error")


def to_http(e: BaseException) -> P.HTTPError:
    """A 4xx for what the client sent, a 500 naming the internal error for the rest."""
    if isinstance(e, P.HTTPError):
        return e
    if isinstance(e, InvalidRequest):
        return P.HTTPError.from_invalid(e)
    return P.HTTPError(500, f"internal error: {e}", type_="server_error", code="internal_error")


class ServerContext:
    """One server's shared state, built once by create_app; endpoints receive it as ``Ctx``."""

    def __init__(self, engine: LLMEngine, settings: ServerSettings, *, config_watcher: Any = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.settings = settings
        self.config_watcher = config_watcher
        self.names = settings.served_model_names or [engine.model_name]
        self.served = self.names[0]
        self.async_engine = AsyncEngine(engine, max_waiting=settings.max_waiting, on_fatal=on_fatal)
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.input_workers, thread_name_prefix="kvtune-input")
        self.tok_str = engine.tokenizer.token_str if engine.tokenizer else str

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any):
        """The engine loop and the config file watcher run while the app serves."""
        self.async_engine.start(asyncio.get_running_loop())
        if self.config_watcher is not None:
            self.config_watcher.start(self.async_engine)
        try:
            yield
        finally:
            if self.config_watcher is not None:
                self.config_watcher.stop()
            self.async_engine.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)

    def check_capacity(self, n_new: int) -> None:
        s, aeng = self.settings, self.async_engine
        if not aeng.alive:
            raise P.HTTPError(503, "the engine loop is not running", type_="server_error",
                              code="engine_dead", headers={"Retry-After": str(s.retry_after_s)})
        if s.max_waiting is not None and aeng.num_waiting() + n_new > s.max_waiting:
            raise P.HTTPError(503, f"the waiting queue is full ({aeng.num_waiting()} waiting, "
                                   f"max_waiting {s.max_waiting}); retry later",
                              type_="server_overloaded", code="queue_full",
                              headers={"Retry-After": str(s.retry_after_s)})

    async def read_body(self, request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it exceeds the cap (before any parsing)."""
        cap = self.settings.max_body_bytes
        too_big = P.HTTPError(413, f"the request body exceeds the limit of {cap} bytes (--max-body-mib)",
                              code="body_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise too_big
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > cap:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def json_off_loop(self, build: Callable[[], Any]) -> Response:
        """A response body built and JSON-encoded on the worker pool: one with many logprobs is
        megabytes, seconds of work that on the loop would stall every stream and /health."""
        return Response(await self.off_loop(lambda: P.encode_json(build())), media_type="application/json")

    def cached(self, outs: list[RequestOutput]) -> int | None:
        return sum(o.num_cached_tokens for o in outs) if self.settings.enable_prompt_tokens_details else None

    def submit(self, rid: str, jobs: list[Job], salt: str | None) -> list[RequestStream]:
        return [self.async_engine.submit(j.ids, j.params, f"{rid}-{k}", salt) for k, j in enumerate(jobs)]

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for st in streams:
            if not st.finished:
                self.async_engine.abort(st.request_id)

    async def wait_all(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """The final output of each stream, or None if the client went away first (all are aborted)."""
        async def last(st: RequestStream) -> RequestOutput | None:
            out = None
            async for out in st:
                pass
            return out

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        gather = asyncio.ensure_future(asyncio.gather(*map(last, streams)))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
            return gather.result() if gather.done() else None
        finally:
            watch.cancel()
            if not gather.done():
                gather.cancel()
                with contextlib.suppress(BaseException):
                    await gather
            self.abort_unfinished(streams)

async def _context(request: Request) -> ServerContext:  # async: resolved on the loop, no thread hop
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(_context)]
