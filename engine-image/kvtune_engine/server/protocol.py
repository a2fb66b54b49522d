"""OpenAI request bodies -> (prompts, SamplingParams), and the response objects back.

Parsing is by hand on top of pydantic so that every error is an HTTP 400 in OpenAI's error shape
naming the field (FastAPI's default would be a 422 with a validation dump).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.request import SamplingParams
from ..engine import InvalidRequest, RequestOutput, TokenLogprob


class HTTPError(Exception):
    """An error response: status, OpenAI error body, optional headers."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    @classmethod
    def from_invalid(cls, e: InvalidRequest) -> "HTTPError":
        return cls(400, str(e), param=e.field, code=e.code)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    user: str | None = None


class CompletionBody(_Base):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Base):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"malformed JSON body: {e}", code="malformed_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the JSON body must be an object, got {type(body).__name__}",
                        code="malformed_json")
    return body


def validate(model: type[BaseModel], body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = str(err["loc"][0]) if err["loc"] else None
        raise HTTPError(400, f"{loc}: {err['msg']} (got {err.get('input')!r})", param=field,
                        code="invalid_parameter") from None


def _unsupported(body: _Base, served: str, model_names: list[str]) -> None:
    if body.model is not None and body.model not in model_names:
        raise HTTPError(404, f"The model {body.model!r} does not exist; this server serves {served!r}",
                        param="model", code="model_not_found", type_="NotFoundError")
    if body.n != 1:
        raise HTTPError(400, f"n: only n=1 is supported, got {body.n}", param="n",
                        code="invalid_sampling_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(body, name)
        if v not in (None, 0, 0.0):
            raise HTTPError(400, f"{name}: not supported by this engine (must be 0), got {v}", param=name,
                            code="invalid_sampling_parameter")
    if body.repetition_penalty not in (None, 1, 1.0):
        raise HTTPError(400, f"repetition_penalty: not supported (must be 1), got {body.repetition_penalty}",
                        param="repetition_penalty", code="invalid_sampling_parameter")
    so = body.stream_options
    if so is not None and not body.stream:
        raise HTTPError(400, "stream_options: only allowed when stream is true", param="stream_options")


def sampling_from(body: _Base, *, max_tokens: int | None, default_max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
    stop = body.stop
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    p = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else (default_max_tokens or 16),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        seed=body.seed, stop=list(stop), stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos), logprobs=logprobs,
    )
    return p


def include_usage(body: _Base) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_unix() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _safe(lp: float) -> float:
    return -9999.0 if math.isinf(lp) or math.isnan(lp) else lp


def completion_logprobs(lps: list[TokenLogprob] | None, token_str, text_offset0: int = 0) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for lp in lps:
        s = token_str(lp.token_id)
        tokens.append(s)
        token_lps.append(_safe(lp.logprob))
        tops.append({token_str(t): _safe(v) for t, v in lp.top} if lp.top else None)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob] | None, token_str) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        s = token_str(lp.token_id)
        content.append({
            "token": s, "logprob": _safe(lp.logprob), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": token_str(t), "logprob": _safe(v),
                              "bytes": list(token_str(t).encode("utf-8"))} for t, v in lp.top],
        })
    return {"content": content}


def finish_fields(out: RequestOutput) -> dict[str, Any]:
    if not out.finished:
        return {"finish_reason": None}
    reason = out.finish_reason
    if reason in ("abort", "rejected"):
        reason = "abort"
    return {"finish_reason": reason, "stop_reason": out.stop_reason}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
