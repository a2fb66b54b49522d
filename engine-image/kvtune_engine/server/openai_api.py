"""The OpenAI API: /v1/models, /v1/completions, /v1/chat/completions. What differs between the two
generation endpoints lives here: how a body becomes jobs (run on the worker pool) and how a choice
looks; everything else is generation.generate."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..outputs import RequestOutput
from . import protocol as P
from .chat import render_chat
from .context import Ctx, Job, ServerContext, error_response
from .generation import Shape, generate

router = APIRouter()


def _model_card(ctx: ServerContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(ctx.engine.start_unix_s), "owned_by": "kvtune",
            "root": ctx.settings.model_dir or name, "parent": None, "max_model_len": ctx.engine.config.max_model_len}


@router.get("/v1/models")
async def models(ctx: Ctx):
    return {"object": "list", "data": [_model_card(ctx, n) for n in ctx.names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, ctx: Ctx):
    if model_id not in ctx.names:
        return error_response(P.HTTPError(404, f"The model {model_id!r} does not exist; this server serves "
                                               f"{ctx.served!r}", param="model", code="model_not_found",
                                          type_="NotFoundError"))
    return _model_card(ctx, model_id)


@router.post("/v1/completions")
async def completions(request: Request, ctx: Ctx):
    return await generate(ctx, request, Completion)


@router.post("/v1/chat/completions")
async def chat(request: Request, ctx: Ctx):
    return await generate(ctx, request, ChatCompletion)


class Completion(Shape):
    id_prefix, object, chunk_object, Body = "cmpl", "text_completion", "text_completion", P.CompletionBody

    @staticmethod
    def prepare(ctx: ServerContext, body: P.CompletionBody) -> list[Job]:
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
        inputs, tokenizer = ctx.engine.inputs, ctx.engine.tokenizer
        jobs: list[Job] = []
        for i, prompt in enumerate(prompts):
            ids: list[int] = []
            for j, sp in enumerate(P.fan_out(base, body.n)):
                if j == 0:
                    ids = inputs.process(prompt, sp)
                else:
                    inputs.validate_sampling(sp)
                echo = ""
                if body.echo:
                    echo = prompt if isinstance(prompt, str) else (tokenizer.decode(ids) if tokenizer else "")
                jobs.append(Job(ids, sp, echo, i))
        return jobs

    def _choice(self, k: int, text: str, lps, offsets, out: RequestOutput) -> dict[str, Any]:
        lp = P.completion_logprobs(lps, offsets, self.token_str, len(self.jobs[k].echo)) if lps is not None else None
        return {"index": k, "text": text, "logprobs": lp, **P.finish_fields(out)}

    def choice(self, k, out):
        return self._choice(k, self.jobs[k].echo + out.text, out.logprobs, out.text_offsets, out)

    def stream_choices(self, k, out, first):
        text = self.jobs[k].echo + out.delta_text if first else out.delta_text
        return [(self._choice(k, text, out.new_logprobs, out.new_text_offsets, out), out)]


class ChatCompletion(Shape):
    id_prefix, object, chunk_object, Body = "chatcmpl", "chat.completion", "chat.completion.chunk", P.ChatBody

    @staticmethod
    def prepare(ctx: ServerContext, body: P.ChatBody) -> list[Job]:
        if not body.messages:
            raise P.HTTPError(400, "messages: at least one message is required", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise P.HTTPError(400, "top_logprobs: only allowed with logprobs: true", param="top_logprobs",
                              code="invalid_sampling_parameter")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise P.HTTPError(400, f"top_logprobs: must be in [0, 20], got {body.top_logprobs}",
                              param="top_logprobs", code="invalid_sampling_parameter")
        engine, inputs = ctx.engine, ctx.engine.inputs
        try:
            text = render_chat(engine.raw_tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                               add_generation_prompt=body.add_generation_prompt,
                               template_kwargs=body.chat_template_kwargs)
        except ValueError as e:
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise P.HTTPError(400, str(e), param=field) from None
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
        return jobs

    def choice(self, k, out):
        return {"index": k, "message": {"role": "assistant", "content": out.text},
                "logprobs": P.chat_logprobs(out.logprobs, self.token_str), **P.finish_fields(out)}

    def stream_choices(self, k, out, first):
        role = [({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}, None)] if first else []  # the role goes out with the first token
        delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
        return role + [({"index": k, "delta": delta, "logprobs": P.chat_logprobs(out.new_logprobs, self.token_str),
                         **P.finish_fields(out)}, out)]

    def prompt_outputs(self, outs):
        """One prompt for all choices: streamed, the first to finish counts (dicts keep that order)."""
        return list(outs.values())[:1]


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise P.HTTPError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)
