"""The HTTP server: OpenAI-compatible API, /health, /metrics, and the admin API under /kvtune/v1/."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..config import LIVE_KNOBS, RESTART_KNOBS, ConfigError
from ..engine import InvalidRequest, LLMEngine, RequestOutput, RestartRequired
from ..metrics import CONTENT_TYPE
from . import protocol as P
from .async_engine import AsyncEngine, RequestStream
from .chat import render_chat

log = logging.getLogger("kvtune.server")


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its requests are aborted)."""


class ServerSettings:
    def __init__(self, *, served_model_names: list[str] | None = None, api_key: str | None = None,
                 max_waiting: int | None = None, model_dir: str | None = None,
                 retry_after_s: int = 1):
        self.served_model_names = served_model_names or []
        self.api_key = api_key or None
        self.max_waiting = max_waiting
        self.model_dir = model_dir
        self.retry_after_s = retry_after_s


def _err(e: P.HTTPError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(engine: LLMEngine, settings: ServerSettings | None = None, *,
               config_watcher: Any = None) -> FastAPI:
    s = settings or ServerSettings()
    names = s.served_model_names or [engine.model_name]
    served = names[0]
    aeng = AsyncEngine(engine, max_waiting=s.max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        aeng.start(asyncio.get_running_loop())
        if config_watcher is not None:
            config_watcher.start(aeng)
        try:
            yield
        finally:
            if config_watcher is not None:
                config_watcher.stop()
            aeng.stop()

    app = FastAPI(title="kvtune engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.async_engine = aeng
    app.state.settings = s

    # ------------------------------------------------------------------ middleware: API key on /v1
    @app.middleware("http")
    async def auth(request: Request, call_next):
        if s.api_key and request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "")
            token = got[7:].strip() if got.lower().startswith("bearer ") else ""
            if not token or not hmac.compare_digest(token.encode(), s.api_key.encode()):
                return JSONResponse({"error": {"message": "invalid or missing API key",
                                               "type": "authentication_error", "param": None,
                                               "code": "invalid_api_key"}}, status_code=401)
        return await call_next(request)

    # ------------------------------------------------------------------ helpers
    def admit(prompt_ids: list[int], params) -> None:
        try:
            engine.validate_sampling(params)
            engine.check_prompt(prompt_ids, params)
        except InvalidRequest as e:
            raise P.HTTPError.from_invalid(e) from None

    def check_capacity(n_new: int) -> None:
        if s.max_waiting is not None and aeng.num_waiting() + n_new > s.max_waiting:
            raise P.HTTPError(503, f"the waiting queue is full ({aeng.num_waiting()} waiting, "
                                   f"max_waiting {s.max_waiting}); retry later",
                              type_="server_overloaded", code="queue_full",
                              headers={"Retry-After": str(s.retry_after_s)})
        if not aeng.alive:
            raise P.HTTPError(503, "the engine loop is not running", type_="server_error",
                              code="engine_dead", headers={"Retry-After": str(s.retry_after_s)})

    async def read_body(request: Request) -> dict[str, Any]:
        return P.parse_json(await request.body())

    async def wait_all(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Collect the final output of each stream; abort all if the client goes away."""
        async def collect(st: RequestStream) -> RequestOutput:
            last = None
            async for out in st:
                last = out
            return last

        async def disconnected() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        gather = asyncio.ensure_future(asyncio.gather(*(collect(st) for st in streams)))
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
            if gather in done:
                return gather.result()
            raise ClientDisconnected()
        finally:
            watch.cancel()
            if not gather.done():
                gather.cancel()
            for st in streams:
                if not st.finished:
                    aeng.abort(st.request_id)

    def to_http(e: BaseException) -> P.HTTPError:
        if isinstance(e, P.HTTPError):
            return e
        if isinstance(e, InvalidRequest):
            return P.HTTPError.from_invalid(e)
        return P.HTTPError(500, f"internal error: {e}", type_="server_error", code="internal_error")

    # ------------------------------------------------------------------ OpenAI API
    @app.get("/v1/models")
    async def models():
        cfg = engine.config
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": int(engine.start_unix_s), "owned_by": "kvtune",
             "root": s.model_dir or n, "parent": None, "max_model_len": cfg.max_model_len} for n in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = P.validate(P.CompletionBody, await read_body(request))
            P._unsupported(body, served, names)
            if body.echo:
                raise P.HTTPError(400, "echo: not supported", param="echo")
            if body.suffix:
                raise P.HTTPError(400, "suffix: not supported", param="suffix")
            if body.best_of not in (None, 1):
                raise P.HTTPError(400, f"best_of: only 1 is supported, got {body.best_of}", param="best_of")
            if body.logprobs is not None and not 0 <= body.logprobs <= 20:
                raise P.HTTPError(400, f"logprobs: must be in [0, 20], got {body.logprobs}", param="logprobs",
                                  code="invalid_sampling_parameter")
            prompts = _prompt_list(body.prompt)
            try:
                ids_list = [engine.encode(p) for p in prompts]
            except InvalidRequest as e:
                raise P.HTTPError.from_invalid(e) from None
            params_list = []
            for ids in ids_list:
                params = P.sampling_from(body, max_tokens=body.max_tokens, default_max_tokens=16,
                                         logprobs=body.logprobs)
                admit(ids, params)
                params_list.append(params)
            check_capacity(len(ids_list))
        except P.HTTPError as e:
            return _err(e)
        rid = P.new_id("cmpl")
        created = P.now_unix()
        streams = [aeng.submit(ids, params, f"{rid}-{i}") for i, (ids, params) in
                   enumerate(zip(ids_list, params_list))]
        model = body.model or served
        tok_str = engine.tokenizer.token_str if engine.tokenizer else str

        if body.stream:
            inc_usage = P.include_usage(body)

            async def gen() -> AsyncIterator[str]:
                usage_p = usage_c = 0
                try:
                    async for idx, out in _merge(streams):
                        if out.delta_text or out.new_logprobs or out.finished:
                            choice = {"index": idx, "text": out.delta_text,
                                      "logprobs": P.completion_logprobs(out.new_logprobs, tok_str),
                                      **P.finish_fields(out)}
                            chunk = {"id": rid, "object": "text_completion", "created": created,
                                     "model": model, "choices": [choice]}
                            if out.finished:
                                usage_p += out.num_prompt_tokens
                                usage_c += out.num_output_tokens
                                if not inc_usage:
                                    chunk["usage"] = P.usage(out.num_prompt_tokens, out.num_output_tokens,
                                                             out.num_cached_tokens)
                            elif inc_usage:
                                chunk["usage"] = None
                            yield P.sse(chunk)
                    if inc_usage:
                        yield P.sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                     "choices": [], "usage": P.usage(usage_p, usage_c)})
                except Exception as e:  # noqa: BLE001
                    yield P.sse(to_http(e).body())
                finally:
                    for st in streams:
                        if not st.finished:
                            aeng.abort(st.request_id)
                yield P.SSE_DONE

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        try:
            outs = await wait_all(request, streams)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return _err(to_http(e))
        choices = []
        for i, out in enumerate(outs):
            choices.append({"index": i, "text": out.text,
                            "logprobs": P.completion_logprobs(out.logprobs, tok_str), **P.finish_fields(out)})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": P.usage(sum(o.num_prompt_tokens for o in outs), sum(o.num_output_tokens for o in outs),
                                 sum(o.num_cached_tokens for o in outs))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = P.validate(P.ChatBody, await read_body(request))
            P._unsupported(body, served, names)
            if not body.messages:
                raise P.HTTPError(400, "messages: at least one message is required", param="messages")
            if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
                raise P.HTTPError(400, f"top_logprobs: must be in [0, 20], got {body.top_logprobs}",
                                  param="top_logprobs", code="invalid_sampling_parameter")
            try:
                prompt = render_chat(engine, [m.model_dump(exclude_none=True) for m in body.messages],
                                     add_generation_prompt=body.add_generation_prompt,
                                     **(body.chat_template_kwargs or {}))
            except ValueError as e:
                raise P.HTTPError(400, f"messages: {e}", param="messages") from None
            try:
                ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            except InvalidRequest as e:
                raise P.HTTPError.from_invalid(e) from None
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # OpenAI's default: as much as fits
                max_tokens = max(1, engine.config.max_model_len - len(ids))
            lp = (body.top_logprobs or 0) if body.logprobs else None
            params = P.sampling_from(body, max_tokens=max_tokens, default_max_tokens=None, logprobs=lp)
            admit(ids, params)
            check_capacity(1)
        except P.HTTPError as e:
            return _err(e)
        rid = P.new_id("chatcmpl")
        created = P.now_unix()
        stream = aeng.submit(ids, params, rid)
        model = body.model or served
        tok_str = engine.tokenizer.token_str if engine.tokenizer else str

        if body.stream:
            inc_usage = P.include_usage(body)

            def chunk(delta: dict, out: RequestOutput | None, finish: dict | None = None) -> dict:
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta,
                                  "logprobs": P.chat_logprobs(out.new_logprobs, tok_str) if out else None,
                                  **(finish or {"finish_reason": None})}]}
                if inc_usage:
                    c["usage"] = None
                return c

            async def gen() -> AsyncIterator[str]:
                try:
                    yield P.sse(chunk({"role": "assistant", "content": ""}, None))
                    async for out in stream:
                        if out.finished:
                            c = chunk({"content": out.delta_text} if out.delta_text else {}, out,
                                      P.finish_fields(out))
                            u = P.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                            if inc_usage:
                                yield P.sse(c)
                                yield P.sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                             "model": model, "choices": [], "usage": u})
                            else:
                                c["usage"] = u
                                yield P.sse(c)
                        elif out.delta_text or out.new_logprobs:
                            yield P.sse(chunk({"content": out.delta_text}, out))
                except Exception as e:  # noqa: BLE001
                    yield P.sse(to_http(e).body())
                finally:
                    if not stream.finished:
                        aeng.abort(stream.request_id)
                yield P.SSE_DONE

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        try:
            (out,) = await wait_all(request, [stream])
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return _err(to_http(e))
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": P.chat_logprobs(out.logprobs, tok_str), **P.finish_fields(out)}],
                "usage": P.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)}

    # ------------------------------------------------------------------ health, metrics
    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse({"status": "error", "error": str(aeng.error or "engine loop not running")},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():  # sync: runs in the threadpool, so waiting for the engine lock never blocks the loop
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ admin API
    @app.get("/kvtune/v1/state")
    def state():
        snap = engine.snapshot()
        snap["server"] = {"max_waiting": s.max_waiting, "pending": aeng.num_waiting() - snap["queues"]["waiting"],
                          "engine_alive": aeng.alive}
        return _jsonable(snap)

    @app.get("/kvtune/v1/trace")
    def trace(since_s: float | None = None, limit: int | None = None, format: str = "json"):
        t = engine.trace(since_s=since_s, limit=limit)
        if format == "jsonl":
            import json
            return PlainTextResponse("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in t["requests"]),
                                     media_type="application/x-ndjson")
        return t

    @app.get("/kvtune/v1/steps")
    def steps(limit: int | None = None):
        return {"steps": engine.steps(limit)}

    def config_view() -> dict[str, Any]:
        return {"config": engine.config.model_dump(), "live_knobs": sorted(LIVE_KNOBS),
                "restart_knobs": sorted(RESTART_KNOBS),
                "config_file": config_watcher.status() if config_watcher is not None else None}

    @app.get("/kvtune/v1/config")
    def get_config():
        return config_view()

    @app.patch("/kvtune/v1/config")
    async def patch_config(request: Request):
        try:
            changes = await read_body(request)
        except P.HTTPError as e:
            return _err(e)
        try:
            changed = await aeng.call(lambda e: e.update_config(changes))
        except RestartRequired as e:
            return JSONResponse({"error": {"message": str(e), "type": "restart_required", "param": sorted(e.knobs)[0],
                                           "code": 409},
                                 "restart_required": {k: {"running": a, "requested": b}
                                                      for k, (a, b) in e.knobs.items()}}, status_code=409)
        except ConfigError as e:
            return _err(P.HTTPError(400, str(e), code="invalid_config"))
        except RuntimeError as e:
            return _err(P.HTTPError(503, str(e), type_="server_error"))
        return {**config_view(), "changed": changed}

    # ------------------------------------------------------------------ error handlers
    @app.exception_handler(P.HTTPError)
    async def http_error(request: Request, e: P.HTTPError):
        return _err(e)

    return app


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise P.HTTPError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(st.__anext__()): i for i, st in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for fut in pending:
            fut.cancel()


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
