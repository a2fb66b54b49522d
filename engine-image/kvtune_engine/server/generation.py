"""One response path for generation, streamed or not, shared by completions and chat: each endpoint
supplies only how its choices look (a ``Shape``); limits, waiting, disconnects, errors, usage and
the stream's framing are here once, so the two endpoints cannot drift apart."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..outputs import RequestOutput
from . import protocol as P
from .async_engine import RequestStream
from .context import ClientDisconnected, Job, ServerContext, error_response, failed, to_http

log = logging.getLogger("kvtune.server")


class Shape:
    """How one endpoint's choices look; the rest of a response is the same for every endpoint."""
    id_prefix: str
    object: str         # a whole response's "object"
    chunk_object: str   # a streamed chunk's "object"

    def __init__(self, jobs: list[Job], token_str: Callable[[int], str]):
        self.jobs, self.token_str = jobs, token_str
        self.first_of_prompt = [k for k, j in enumerate(jobs) if k == 0 or jobs[k - 1].prompt_index != j.prompt_index]

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        """Choice ``k`` of a whole response, from its final output."""
        raise NotImplementedError

    def stream_choices(self, k: int, out: RequestOutput, first: bool) -> list[tuple[dict[str, Any], Any]]:
        """The chunks' choices for one streamed output, each with the output its usage counts (or None)."""
        raise NotImplementedError

    def prompt_outputs(self, outs: dict[int, RequestOutput]) -> list[RequestOutput]:
        """The outputs whose cached prompt tokens the usage reports: the first choice of each prompt."""
        return [outs[k] for k in self.first_of_prompt if k in outs]


async def generate(ctx: ServerContext, request: Request, prepare: Callable[..., Any], shape_of: type[Shape]) -> Response:
    try:
        body, jobs = await ctx.off_loop(prepare, ctx, await ctx.read_body(request))
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

    if body.stream:
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

        async def gen() -> AsyncIterator[str]:
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

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    try:
        outs = await ctx.wait_all(request, streams)
    except ClientDisconnected:
        log.debug("client went away before %s was ready; aborted", rid)
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001
        return error_response(to_http(e))
    for out in outs:
        if out.finish_reason == "error":
            return error_response(failed(out))
    return await ctx.json_off_loop(lambda: {**head, "choices": [shape.choice(k, out) for k, out in enumerate(outs)],
                                            "usage": usage(dict(enumerate(outs)))})


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
