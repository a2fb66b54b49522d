"""The HTTP server: OpenAI-compatible API, /health, /metrics, and the admin API under /kvtune/v1/.

Invariants owned here: limits come before work (a body over ``max_body_bytes`` is a 413 before it
is parsed; JSON parsing, validation, chat templates and tokenization run on a worker pool, never
on the event loop, and so do building and encoding a non-streamed response, so a huge request or
response cannot delay another stream's tokens); one request's error ends that request only (a 4xx
for what the client sent, a 500 naming the internal error for the rest); the loop's death stops the
server (``on_fatal``) so the process exits non-zero.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..config import LIVE_KNOBS, RESTART_KNOBS, ConfigError
from ..core.request import SamplingParams
from ..engine import InvalidRequest, LLMEngine, RestartRequired
from ..metrics import CONTENT_TYPE
from ..outputs import RequestOutput
from . import protocol as P
from .async_engine import AsyncEngine, RequestStream
from .auth import AuthMiddleware
from .body_drain import BodyDrainMiddleware
from .chat import render_chat

log = logging.getLogger("kvtune.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its requests are aborted)."""


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


def _err(e: P.HTTPError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _failed(out: RequestOutput) -> P.HTTPError:
    return P.HTTPError(500, out.error or "internal error while handling this request", type_="server_error",
                       code="internal_error")


def create_app(engine: LLMEngine, settings: ServerSettings | None = None, *, config_watcher: Any = None,
               on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    s = settings or ServerSettings()
    names = s.served_model_names or [engine.model_name]
    served = names[0]
    aeng = AsyncEngine(engine, max_waiting=s.max_waiting, on_fatal=on_fatal)
    pool = concurrent.futures.ThreadPoolExecutor(s.input_workers, thread_name_prefix="kvtune-input")
    inputs = engine.inputs
    tok_str = engine.tokenizer.token_str if engine.tokenizer else str

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
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvtune engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.async_engine = aeng
    app.state.settings = s
    app.add_middleware(AuthMiddleware, api_key=s.api_key, admin_key=s.admin_key, admin_port=s.admin_port)
    app.add_middleware(BodyDrainMiddleware)  # outermost: every early refusal is readable

    # ------------------------------------------------------------------ helpers
    def check_capacity(n_new: int) -> None:
        if not aeng.alive:
            raise P.HTTPError(503, "the engine loop is not running", type_="server_error",
                              code="engine_dead", headers={"Retry-After": str(s.retry_after_s)})
        if s.max_waiting is not None and aeng.num_waiting() + n_new > s.max_waiting:
            raise P.HTTPError(503, f"the waiting queue is full ({aeng.num_waiting()} waiting, "
                                   f"max_waiting {s.max_waiting}); retry later",
                              type_="server_overloaded", code="queue_full",
                              headers={"Retry-After": str(s.retry_after_s)})

    async def read_body(request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it exceeds the cap (before any parsing)."""
        cap = s.max_body_bytes
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

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def json_off_loop(build: Callable[[], Any]) -> Response:
        """A response body built and JSON-encoded on the worker pool: one with many logprobs is
        megabytes, seconds of work that on the loop would stall every stream and /health."""
        return Response(await off_loop(lambda: P.encode_json(build())), media_type="application/json")

    def cached(outs: list[RequestOutput]) -> int | None:
        return sum(o.num_cached_tokens for o in outs) if s.enable_prompt_tokens_details else None

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
                with contextlib.suppress(BaseException):
                    await gather
            for st in streams:
                if not st.finished:
                    aeng.abort(st.request_id)

    def to_http(e: BaseException) -> P.HTTPError:
        if isinstance(e, P.HTTPError):
            return e
        if isinstance(e, InvalidRequest):
            return P.HTTPError.from_invalid(e)
        return P.HTTPError(500, f"internal error: {e}", type_="server_error", code="internal_error")

    def submit(rid: str, jobs: list[Job], salt: str | None) -> list[RequestStream]:
        return [aeng.submit(j.ids, j.params, f"{rid}-{k}", salt) for k, j in enumerate(jobs)]

    # ------------------------------------------------------------------ request preparation (worker pool)
    def prepare_completion(raw: bytes) -> tuple[P.CompletionBody, list[Job]]:
        body = P.validate(P.CompletionBody, P.parse_json(raw))
        P.check_fields(body, served, names)
        if body.best_of not in (None, body.n):
            raise P.HTTPError(400, f"best_of: only best_of equal to n ({body.n}) is supported, got {body.best_of}",
                              param="best_of", code="unsupported_parameter")
        if body.echo and body.logprobs is not None:
            raise P.HTTPError(400, "echo: echo together with logprobs is not supported yet (prompt logprobs are "
                                   "not computed); drop one of them", param="echo", code="unsupported_parameter")
        prompts = _prompt_list(body.prompt)
        if len(prompts) * body.n > P.MAX_N:
            raise P.HTTPError(400, f"prompt: {len(prompts)} prompts x n={body.n} choices exceeds {P.MAX_N}; "
                                   f"split the batch", param="prompt")
        base = P.sampling_from(body, max_tokens=body.max_tokens, default_max_tokens=16, logprobs=body.logprobs)
        jobs: list[Job] = []
        try:
            for i, prompt in enumerate(prompts):
                ids: list[int] = []
                for j, sp in enumerate(P.fan_out(base, body.n)):
                    if j == 0:
                        ids = inputs.process(prompt, sp)
                    else:
                        inputs.validate_sampling(sp)
                    echo = ""
                    if body.echo:
                        echo = prompt if isinstance(prompt, str) else (
                            engine.tokenizer.decode(ids) if engine.tokenizer else "")
                    jobs.append(Job(ids, sp, echo, i))
        except InvalidRequest as e:
            raise P.HTTPError.from_invalid(e) from None
        P.check_logprob_volume([j.params for j in jobs], body.stream)
        return body, jobs

    def prepare_chat(raw: bytes) -> tuple[P.ChatBody, list[Job]]:
        body = P.validate(P.ChatBody, P.parse_json(raw))
        P.check_fields(body, served, names)
        if not body.messages:
            raise P.HTTPError(400, "messages: at least one message is required", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise P.HTTPError(400, "top_logprobs: only allowed with logprobs: true", param="top_logprobs",
                              code="invalid_sampling_parameter")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise P.HTTPError(400, f"top_logprobs: must be in [0, 20], got {body.top_logprobs}",
                              param="top_logprobs", code="invalid_sampling_parameter")
        try:
            text = render_chat(engine.raw_tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                               add_generation_prompt=body.add_generation_prompt,
                               template_kwargs=body.chat_template_kwargs)
        except ValueError as e:
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise P.HTTPError(400, str(e), param=field) from None
        try:
            ids = inputs.encode(text, "messages", add_special_tokens=False)
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # OpenAI's default: as much as fits
                max_tokens = max(1, engine.config.max_model_len - len(ids))
            lp = (body.top_logprobs or 0) if body.logprobs else None
            base = P.sampling_from(body, max_tokens=max_tokens, default_max_tokens=None, logprobs=lp)
            jobs = []
            for j, sp in enumerate(P.fan_out(base, body.n)):
                inputs.validate_sampling(sp)
                if j == 0:
                    inputs.check_prompt(ids, sp, "messages")
                jobs.append(Job(ids, sp, "", 0))
        except InvalidRequest as e:
            raise P.HTTPError.from_invalid(e) from None
        P.check_logprob_volume([j.params for j in jobs], body.stream)
        return body, jobs

    # ------------------------------------------------------------------ OpenAI API
    def model_card(n: str) -> dict[str, Any]:
        return {"id": n, "object": "model", "created": int(engine.start_unix_s), "owned_by": "kvtune",
                "root": s.model_dir or n, "parent": None, "max_model_len": engine.config.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in names:
            return _err(P.HTTPError(404, f"The model {model_id!r} does not exist; this server serves {served!r}",
                                    param="model", code="model_not_found", type_="NotFoundError"))
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body, jobs = await off_loop(prepare_completion, await read_body(request))
            check_capacity(len(jobs))
        except P.HTTPError as e:
            return _err(e)
        rid, created, model = P.new_id("cmpl"), P.now_unix(), body.model or served
        streams = submit(rid, jobs, body.cache_salt)
        first_of_prompt = [k for k, j in enumerate(jobs) if k == 0 or jobs[k - 1].prompt_index != j.prompt_index]
        prompt_tokens = sum(len(jobs[k].ids) for k in first_of_prompt)

        def choice(k: int, text: str, lps, offsets, out: RequestOutput, logprobs_total: bool = False) -> dict:
            lp = P.completion_logprobs(lps, offsets, tok_str, len(jobs[k].echo)) if lps is not None else None
            return {"index": k, "text": text, "logprobs": lp, **P.finish_fields(out)}

        if body.stream:
            inc_usage, cont_usage = P.include_usage(body), P.continuous_usage(body)

            async def gen() -> AsyncIterator[str]:
                done: dict[int, RequestOutput] = {}
                started: set[int] = set()
                try:
                    async for k, out in _merge(streams):
                        if out.finished and out.finish_reason == "error":
                            yield P.sse(_failed(out).body())
                            break
                        text = out.delta_text
                        if k not in started and (out.new_token_ids or out.finished):
                            started.add(k)
                            text = jobs[k].echo + text
                        if not (out.new_token_ids or out.finished):  # one chunk per step with tokens,
                            continue  # even when their text is held back: clients time tokens by chunks
                        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [choice(k, text, out.new_logprobs, out.new_text_offsets, out)]}
                        if cont_usage:
                            chunk["usage"] = P.usage(len(jobs[k].ids), out.num_output_tokens)
                        elif out.finished and not inc_usage:
                            chunk["usage"] = P.usage(len(jobs[k].ids), out.num_output_tokens, cached([out]))
                        elif inc_usage:
                            chunk["usage"] = None
                        if out.finished:
                            done[k] = out
                        yield P.sse(chunk)
                    else:
                        if inc_usage:
                            outs = list(done.values())
                            yield P.sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                         "choices": [], "usage": P.usage(prompt_tokens,
                                                                         sum(o.num_output_tokens for o in outs),
                                                                         cached([done[k] for k in first_of_prompt
                                                                                 if k in done]))})
                except Exception as e:  # noqa: BLE001
                    yield P.sse(to_http(e).body())
                finally:
                    for st in streams:
                        if not st.finished:
                            aeng.abort(st.request_id)
                yield P.SSE_DONE

            return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        try:
            outs = await wait_all(request, streams)
        except ClientDisconnected:
            log.debug("client went away before completion %s was ready; aborted", rid)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return _err(to_http(e))
        for out in outs:
            if out.finish_reason == "error":
                return _err(_failed(out))
        def response() -> dict[str, Any]:
            choices = [choice(k, jobs[k].echo + out.text, out.logprobs, out.text_offsets, out)
                       for k, out in enumerate(outs)]
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                    "usage": P.usage(prompt_tokens, sum(o.num_output_tokens for o in outs),
                                     cached([outs[k] for k in first_of_prompt]))}
        return await json_off_loop(response)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body, jobs = await off_loop(prepare_chat, await read_body(request))
            check_capacity(len(jobs))
        except P.HTTPError as e:
            return _err(e)
        rid, created, model = P.new_id("chatcmpl"), P.now_unix(), body.model or served
        streams = submit(rid, jobs, body.cache_salt)
        n_prompt = len(jobs[0].ids)

        if body.stream:
            inc_usage, cont_usage = P.include_usage(body), P.continuous_usage(body)

            def chunk(k: int, delta: dict, out: RequestOutput | None, finish: dict | None = None) -> dict:
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": k, "delta": delta,
                                  "logprobs": P.chat_logprobs(out.new_logprobs, tok_str) if out else None,
                                  **(finish or {"finish_reason": None})}]}
                if cont_usage:
                    c["usage"] = P.usage(n_prompt, out.num_output_tokens if out else 0)
                elif inc_usage:
                    c["usage"] = None
                return c

            async def gen() -> AsyncIterator[str]:
                done: list[RequestOutput] = []
                started: set[int] = set()
                try:
                    async for k, out in _merge(streams):
                        if out.finished and out.finish_reason == "error":
                            yield P.sse(_failed(out).body())
                            break
                        if not (out.new_token_ids or out.finished):  # as for completions: a chunk
                            continue  # per step with new tokens, its text possibly empty
                        if k not in started:  # the role goes out with the first token, not before
                            started.add(k)
                            yield P.sse(chunk(k, {"role": "assistant", "content": ""}, None))
                        if out.finished:
                            done.append(out)
                            c = chunk(k, {"content": out.delta_text} if out.delta_text else {}, out,
                                      P.finish_fields(out))
                            if not inc_usage and not cont_usage:
                                c["usage"] = P.usage(n_prompt, out.num_output_tokens, cached([out]))
                            yield P.sse(c)
                        else:
                            yield P.sse(chunk(k, {"content": out.delta_text}, out))
                    else:
                        if inc_usage:
                            yield P.sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                         "model": model, "choices": [],
                                         "usage": P.usage(n_prompt, sum(o.num_output_tokens for o in done),
                                                          cached(done[:1]))})
                except Exception as e:  # noqa: BLE001
                    yield P.sse(to_http(e).body())
                finally:
                    for st in streams:
                        if not st.finished:
                            aeng.abort(st.request_id)
                yield P.SSE_DONE

            return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        try:
            outs = await wait_all(request, streams)
        except ClientDisconnected:
            log.debug("client went away before chat completion %s was ready; aborted", rid)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return _err(to_http(e))
        for out in outs:
            if out.finish_reason == "error":
                return _err(_failed(out))
        return await json_off_loop(lambda: {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": k, "message": {"role": "assistant", "content": out.text},
                         "logprobs": P.chat_logprobs(out.logprobs, tok_str), **P.finish_fields(out)}
                        for k, out in enumerate(outs)],
            "usage": P.usage(n_prompt, sum(o.num_output_tokens for o in outs), cached(outs[:1]))})

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

    # ------------------------------------------------------------------ admin API (behind AuthMiddleware)
    @app.get("/kvtune/v1/state")
    def state():
        snap = engine.snapshot()
        snap["server"] = {"max_waiting": s.max_waiting, "pending": aeng.num_waiting() - snap["queues"]["waiting"],
                          "engine_alive": aeng.alive}
        return _jsonable(snap)

    @app.get("/kvtune/v1/trace")
    def trace(since_s: float | None = None, limit: int | None = None, format: str = "json", unfinished: bool = False):
        if format not in ("json", "jsonl"):
            return _err(P.HTTPError(400, f"format: json or jsonl, got {format!r:.40}", param="format"))
        t = engine.trace(since_s=since_s, limit=limit, unfinished=unfinished and format == "json")
        if format == "jsonl":
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
            changes = P.parse_json(await read_body(request))
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

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "path", "body"))
        return _err(P.HTTPError(400, f"{loc}: {err.get('msg', 'invalid')}", param=loc or None,
                                code="invalid_parameter"))

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
