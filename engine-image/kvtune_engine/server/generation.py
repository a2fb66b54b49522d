"""One response path for generation, streamed or not, shared by completions and chat: each endpoint
supplies only what it says differently (a ``Shape``); parsing, limits, waiting, disconnects, errors,
usage and the stream's framing are here once, so the two endpoints cannot drift apart."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine import InvalidRequest
from ..outputs import RequestOutput
from . import protocol as P
from .async_engine import RequestStream
from .context import Job, ServerContext, error_response, failed, to_http

log = logging.getLogger("kvtune.server")


class Shape:
    """One endpoint's own part, in a subclass: ``Body`` (its request model); ``prepare(ctx, body)``
    (its checks and the jobs of its choices, on the worker pool); ``choice(k, out)`` (choice k of a
    whole response); ``stream_choices(k, out, first)`` (a streamed output's choices, each with the
    output whose tokens its chunk's usage counts, or None)."""
    id_prefix: str
    object: str         # a whole response's "object"
    chunk_object: str   # a streamed chunk's "object"
    Body: type

    def __init__(self, jobs: list[Job], token_str: Callable[[int], str]):
        self.jobs, self.token_str = jobs, token_str
        self.first_of_prompt = [k for k, j in enumerate(jobs) if k == 0 or jobs[k - 1].prompt_index != j.prompt_index]

    def prompt_outputs(self, outs: dict[int, RequestOutput]) -> list[RequestOutput]:
        """The outputs whose cached prompt tokens the usage reports: the first choice of each prompt."""
        return [outs[k] for k in self.first_of_prompt if k in outs]


def _prepare(ctx: ServerContext, shape: type[Shape], raw: bytes) -> tuple[Any, list[Job]]:
    body = P.validate(shape.Body, P.parse_json(raw))
    P.check_fields(body, ctx.served, ctx.names)
    try:
        jobs = shape.prepare(ctx, body)
    except InvalidRequest as e:
        raise P.HTTPError.from_invalid(e) from None
    P.check_logprob_volume([j.params for j in jobs], body.stream)
    return body, jobs


async def generate(ctx: ServerContext, request: Request, shape_of: type[Shape]) -> Response:
    """The response to one generation request: parsed off the loop, refused before it is queued."""
    try:
        body, jobs = await ctx.off_loop(_prepare, ctx, shape_of, await ctx.read_body(request))
        ctx.check_capacity(len(jobs))
    except P.HTTPError as e:
        return error_response(e)
    shape = shape_of(jobs, ctx.tok_str)
    rid = P.new_id(shape.id_prefix)
    head = {"id": rid, "object": shape.chunk_object if body.stream else shape.object, "created": P.now_unix(),
            "model": body.model or ctx.served}
    streams = ctx.submit(rid, jobs, body.cache_salt)
    prompt_tokens = sum(len(jobs[k].ids) for k in shape.first_of_prompt)

    def usage(outs: dict[int, RequestOutput]) -> dict[str, Any]:
        return P.usage(prompt_tokens, sum(o.num_output_tokens for o in outs.values()),
                       ctx.cached(shape.prompt_outputs(outs)))

    if not body.stream:
        try:
            outs = await ctx.wait_all(request, streams)
        except Exception as e:  # noqa: BLE001
            return error_response(to_http(e))
        if outs is None:
            log.debug("client went away before %s was ready; aborted", rid)
            return Response(status_code=499)
        for out in outs:
            if out.finish_reason == "error":
                return error_response(failed(out))
        return await ctx.json_off_loop(lambda: {**head, "choices": [shape.choice(k, o) for k, o in enumerate(outs)],
                                                "usage": usage(dict(enumerate(outs)))})

    inc_usage, cont_usage = P.include_usage(body), P.continuous_usage(body)

    def chunk(k: int, choice: dict[str, Any], out: RequestOutput | None) -> str:
        c = {**head, "choices": [choice]}
        if cont_usage:
            c["usage"] = P.usage(len(jobs[k].ids), out.num_output_tokens if out else 0)
        elif out is not None and out.finished and not inc_usage:
            c["usage"] = P.usage(len(jobs[k].ids), out.num_output_tokens, ctx.cached([out]))
        elif inc_usage:
            c["usage"] = None
        return P.sse(c)

    async def events() -> AsyncIterator[str]:
        done: dict[int, RequestOutput] = {}  # in the order they finished
        started: set[int] = set()
        try:
            async for k, out in merge(streams):
                if out.finished and out.finish_reason == "error":
                    yield P.sse(failed(out).body())
                    break
                if not (out.new_token_ids or out.finished):  # one chunk per step with tokens, even
                    continue  # when their text is held back: clients time tokens by chunks
                first = k not in started
                started.add(k)
                if out.finished:
                    done[k] = out
                for choice, counted in shape.stream_choices(k, out, first):
                    yield chunk(k, choice, counted)
            else:
                if inc_usage:
                    yield P.sse({**head, "choices": [], "usage": usage(done)})
        except Exception as e:  # noqa: BLE001
            yield P.sse(to_http(e).body())
        finally:
            ctx.abort_unfinished(streams)
        yield P.SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
