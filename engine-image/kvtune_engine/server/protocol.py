"""OpenAI request bodies -> (prompts, SamplingParams), and the response objects back.

Invariant owned here: every field of a request is honoured or refused, never silently ignored.
Unknown fields are a 400 naming them: a misspelled or unsupported parameter would otherwise
change the output without a word (``max_token`` would generate 16 tokens), and OpenAI's own API
answers unrecognized arguments the same way. Known OpenAI fields this engine does not implement
(tools, response_format, ...) are a 400 saying they are not supported yet. Every error is an
HTTP 4xx in OpenAI's error shape naming the field (FastAPI's default would be a 422 dump or 500).
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.request import SamplingParams
from ..input_processor import InvalidRequest
from ..outputs import RequestOutput, TokenLogprob

MAX_N = 128  # choices per request (n x prompts): beyond it, send several requests
#: logprob entries one non-streamed response may hold (n x max_tokens x (1 + top_logprobs)): each is a
#: JSON object; 2**20 of them are ~70 MB and seconds of a worker's CPU to build and encode
MAX_LOGPROB_ENTRIES = 1 << 20
#: list items encoded per call of the C JSON encoder (``encode_json``): it holds the GIL for a whole
#: call, so a large response is encoded in pieces that let the event loop's thread run in between
JSON_PIECE_ITEMS = 256

#: OpenAI fields this engine does not implement yet: 400, unless the value means "off".
NOT_SUPPORTED = {
    "tools": lambda v: v in (None, []), "tool_choice": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v is None, "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "reasoning_effort": lambda v: v is None, "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]), "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None, "store": lambda v: v in (None, False),
    "metadata": lambda v: v is None, "service_tier": lambda v: v in (None, "auto", "default"),
    "suffix": lambda v: v in (None, ""),
}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


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
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None          # an end-user id for the caller's bookkeeping: no effect on output
    cache_salt: str | None = None    # requests with different salts never share prefix-cache blocks


class CompletionBody(_Base):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    logprobs: int | None = None
    echo: bool = False
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


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a dict; malformed, too deep, lone surrogates, over-long ints: 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise HTTPError(400, "malformed JSON body: nested too deeply", code="malformed_json") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, int digit limit, NaN/Infinity
        raise HTTPError(400, f"malformed JSON body: {str(e)[:300]}", code="malformed_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the JSON body must be an object, got {type(body).__name__}",
                        code="malformed_json")
    return body


def validate(model: type[BaseModel], body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply", code="invalid_parameter") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = str(err["loc"][0]) if err["loc"] else None
        got = repr(err.get("input"))
        raise HTTPError(400, f"{loc}: {err['msg']} (got {got[:200]}{'...' if len(got) > 200 else ''})",
                        param=field, code="invalid_parameter") from None


def check_fields(body: _Base, served: str, model_names: list[str]) -> None:
    """Unknown and unsupported fields, model name, n, stream_options: 4xx naming the field."""
    extra = dict(body.model_extra or {})
    unsupported = [k for k in extra if k in NOT_SUPPORTED and not NOT_SUPPORTED[k](extra[k])]
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise HTTPError(400, f"{names}: not supported yet by this engine (tool calling, structured output "
                             f"and the like are not implemented); remove the field(s)", param=sorted(unsupported)[0],
                        code="unsupported_parameter")
    unknown = sorted(k for k in extra if k not in NOT_SUPPORTED)
    if unknown:
        known = sorted(type(body).model_fields)
        raise HTTPError(400, f"unrecognized request argument(s): {', '.join(unknown)}; this endpoint accepts "
                             f"{', '.join(known)}", param=unknown[0], code="unknown_parameter")
    if body.model is not None and body.model not in model_names:
        raise HTTPError(404, f"The model {body.model!r} does not exist; this server serves {served!r}",
                        param="model", code="model_not_found", type_="NotFoundError")
    if not 1 <= body.n <= MAX_N:
        raise HTTPError(400, f"n: must be an integer in [1, {MAX_N}], got {body.n}", param="n",
                        code="invalid_sampling_parameter")
    so = body.stream_options
    if so is not None:
        if not body.stream:
            raise HTTPError(400, "stream_options: only allowed when stream is true", param="stream_options")
        bad = sorted(set(so) - STREAM_OPTIONS)
        if bad:
            raise HTTPError(400, f"stream_options: unknown option(s) {', '.join(bad)}; allowed: "
                                 f"{', '.join(sorted(STREAM_OPTIONS))}", param="stream_options")
        for k, v in so.items():
            if not isinstance(v, bool):
                raise HTTPError(400, f"stream_options.{k}: must be true or false, got {v!r:.50}",
                                param="stream_options")
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= 256:
        raise HTTPError(400, "cache_salt: must be a non-empty string of at most 256 characters",
                        param="cache_salt")


def check_logprob_volume(params: list[SamplingParams], stream: bool) -> None:
    """A non-streamed response with more than MAX_LOGPROB_ENTRIES logprob entries is a 400 before
    any work: it is built and encoded whole (a streamed one goes out step by step)."""
    if stream:
        return
    entries = sum(p.max_tokens * (1 + p.logprobs) for p in params if p.logprobs is not None)
    if entries > MAX_LOGPROB_ENTRIES:
        p = params[0]
        raise HTTPError(400, f"n x max_tokens x (1 + top_logprobs) = {len(params)} x {p.max_tokens} x "
                             f"(1 + {p.logprobs}) = {entries} logprob entries exceeds the {MAX_LOGPROB_ENTRIES} "
                             "one response may hold; lower n, max_tokens or top_logprobs, or stream the "
                             "response (stream: true)", param="max_tokens", code="response_too_large")


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON of ``obj`` in pieces (``JSON_PIECE_ITEMS`` list items per encoder call), the
    same text as FastAPI's JSONResponse renders. Runs on a worker: see JSON_PIECE_ITEMS."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode()


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _encode(x: Any, out: list[str]) -> None:
    dumps = _dumps
    if isinstance(x, dict):
        out.append("{")
        for i, (k, v) in enumerate(x.items()):
            out.append(("," if i else "") + dumps(str(k)) + ":")
            _encode(v, out)
        out.append("}")
    elif isinstance(x, (list, tuple)) and len(x) > JSON_PIECE_ITEMS:
        out.append("[")
        for i in range(0, len(x), JSON_PIECE_ITEMS):   # token-level lists: small items, many of them
            out.append(("," if i else "") + dumps(list(x[i:i + JSON_PIECE_ITEMS]))[1:-1])
        out.append("]")
    elif isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in x):
        out.append("[")
        for i, v in enumerate(x):
            if i:
                out.append(",")
            _encode(v, out)
        out.append("]")
    else:
        out.append(dumps(x))


_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (raw or {}).items():
        if not _TOKEN_ID.match(k):
            raise HTTPError(400, f"logit_bias: keys must be token ids (decimal strings), got {k[:40]!r}",
                            param="logit_bias", code="invalid_sampling_parameter")
        out[int(k)] = v
    return out


def sampling_from(body: _Base, *, max_tokens: int | None, default_max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
    stop = body.stop
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else (default_max_tokens or 16),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        seed=body.seed, stop=list(stop), stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos), logprobs=logprobs,
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens, logit_bias=logit_bias(body.logit_bias), final_only=not body.stream,
    )


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; a seeded request's choice j uses seed + j (distinct, reproducible choices)."""
    out = []
    for j in range(n):
        p = SamplingParams(**{k: (type(v)(v) if isinstance(v, (list, dict)) else v) for k, v in vars(params).items()})
        if p.seed is not None:
            p.seed += j
        out.append(p)
    return out


def include_usage(body: _Base) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def continuous_usage(body: _Base) -> bool:
    return bool(body.stream_options and body.stream_options.get("continuous_usage_stats"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_unix() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """``cached`` only when the server returns prompt_tokens_details (--enable-prompt-tokens-details)."""
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _safe(lp: float) -> float:
    return -9999.0 if math.isinf(lp) or math.isnan(lp) else lp


def completion_logprobs(lps: list[TokenLogprob] | None, offsets: list[int], token_str,
                        text_offset0: int = 0) -> dict[str, Any] | None:
    """Legacy completions logprobs; the sampled token is always among its top_logprobs, and
    text_offset indexes the returned text (special tokens add no characters)."""
    if lps is None:
        return None
    tokens, token_lps, tops, text_offsets = [], [], [], []
    for lp, off in zip(lps, offsets):
        s = token_str(lp.token_id)
        tokens.append(s)
        token_lps.append(_safe(lp.logprob))
        top = {token_str(t): _safe(v) for t, v in lp.top}
        top.setdefault(s, _safe(lp.logprob))
        tops.append(top)
        text_offsets.append(text_offset0 + off)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": text_offsets}


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
    if reason in ("abort", "rejected", "error"):
        reason = "abort"
    return {"finish_reason": reason, "stop_reason": out.stop_reason}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
