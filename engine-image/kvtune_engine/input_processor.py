"""Input processing: the single admission check of a request, before it is queued.

Invariant owned here: a request that passes ``process`` can be scheduled and sampled: every
numeric parameter is inside the range the scheduler and the sampler handle (seed in int64, token
ids in the vocabulary, penalties and biases finite and bounded), and the prompt fits
``max_model_len`` and the KV cache by the scheduler's own rule (``prompt_rejection``). Anything
else is an ``InvalidRequest`` naming the field, what was wrong and what is allowed.

Cheap checks run before expensive ones: a text longer than ``max_model_len`` tokens of the
longest token this tokenizer has is refused without being tokenized. Everything here is pure and
thread-safe, so the server runs it on a worker thread, off the event loop.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .core.request import SamplingParams
from .core.scheduler import prompt_rejection
from .tokenizer_adapter import TokenizerAdapter

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it (HTTP 400); ``field`` names the culprit."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.field = field
        self.code = code


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_text(text: str, field: str) -> None:
    """A string must be valid Unicode (a lone surrogate such as "\\ud800" is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field}: not valid Unicode: lone surrogate {text[e.start]!r} at character "
                             f"{e.start}; send UTF-8 text", field=field) from None


class InputProcessor:
    """Validates sampling parameters, tokenizes prompts and checks their length, for one engine."""

    def __init__(self, tokenizer: TokenizerAdapter | None, scheduler: Any, vocab_size: int | None):
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # read only: max_model_len (a restart knob), num_blocks, block_size
        self.vocab_size = vocab_size

    @property
    def max_model_len(self) -> int:
        return int(self.scheduler.config.max_model_len)

    # ------------------------------------------------------------------ the whole check
    def process(self, prompt: str | Sequence[int], params: SamplingParams, field: str = "prompt",
                add_special_tokens: bool = True) -> list[int]:
        """Validate params, tokenize, check the prompt: the ids to queue, or InvalidRequest.
        (A rendered chat template writes its own BOS: ``add_special_tokens=False``.)"""
        self.validate_sampling(params)
        ids = self.encode(prompt, field, add_special_tokens)
        self.check_prompt(ids, params, field)
        return ids

    # ------------------------------------------------------------------ parts
    def validate_sampling(self, p: SamplingParams) -> None:
        """Raise InvalidRequest naming the field when a sampling parameter is out of range."""
        def bad(fld: str, msg: str):
            raise InvalidRequest(f"{fld}: {msg}", field=fld, code="invalid_sampling_parameter")
        v = self.vocab_size
        if not _is_int(p.max_tokens) or p.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {p.max_tokens!r}")
        if not _is_number(p.temperature) or p.temperature < 0.0:
            bad("temperature", f"must be a finite number >= 0, got {p.temperature!r}")
        if not _is_number(p.top_p) or not (0.0 < p.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {p.top_p!r}")
        if not _is_int(p.top_k) or (p.top_k < 1 and p.top_k != -1) or p.top_k > 2**31 - 1:
            bad("top_k", f"must be -1 or 0 (off) or an integer in [1, 2^31), got {p.top_k!r}")
        if p.seed is not None and (not _is_int(p.seed) or not INT64_MIN <= p.seed <= INT64_MAX):
            bad("seed", f"must be an integer in [-2^63, 2^63) (int64), got {p.seed!r}")
        if not isinstance(p.stop, list) or not all(isinstance(s, str) and s for s in p.stop):
            bad("stop", f"must be a list of non-empty strings, got {p.stop!r:.200}")
        if len(p.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
        for s in p.stop:
            check_text(s, "stop")
            if len(s) > MAX_STOP_CHARS:
                bad("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if (not isinstance(p.stop_token_ids, list) or len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) and 0 <= t and (v is None or t < v) for t in p.stop_token_ids)):
            bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} token ids in [0, {v}), "
                                  f"got {p.stop_token_ids!r:.200}")
        if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(p, name)
            if not _is_number(x) or not -2.0 <= x <= 2.0:
                bad(name, f"must be a number in [-2, 2], got {x!r}")
        if not _is_number(p.repetition_penalty) or not 0.0 < p.repetition_penalty <= 100.0:
            bad("repetition_penalty", f"must be a number in (0, 100] (1 = off), got {p.repetition_penalty!r}")
        if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={p.max_tokens}], got {p.min_tokens!r}")
        lb = p.logit_bias
        if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases, got {len(lb)} entries")
        for t, b in lb.items():
            if not _is_int(t) or t < 0 or (v is not None and t >= v):
                bad("logit_bias", f"token id {t!r} is outside the vocabulary [0, {v})")
            if not _is_number(b) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {b!r}")

    def encode(self, prompt: str | Sequence[int], field: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: pass token ids", field=field)
            self.check_text_length(prompt, field)
            return self.tokenizer.encode(prompt, add_special_tokens)
        ids = list(prompt)
        if not all(_is_int(t) for t in ids):
            raise InvalidRequest(f"{field}: token ids must be integers", field=field)
        return ids

    def check_text_length(self, text: str, field: str = "prompt") -> None:
        """Lone surrogates, and a text too long to fit however it tokenizes (before tokenizing)."""
        check_text(text, field)
        if self.tokenizer is None:
            return
        per_token = self.tokenizer.max_token_chars
        mml = self.max_model_len
        if len(text) > mml * per_token:
            raise InvalidRequest(
                f"{field}: {len(text)} characters cannot fit this model's maximum context length "
                f"(max_model_len) of {mml} tokens: one token of this tokenizer holds at most {per_token} "
                f"characters, so at most {mml * per_token} characters could fit", field=field,
                code="context_length_exceeded")

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams, field: str = "prompt") -> None:
        """The limits a request must fit before it is queued (each message names limit and numbers)."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest(f"{field}: the prompt is empty (0 tokens)", field=field)
        v = self.vocab_size
        if v is not None:
            for t in prompt_ids:
                if not 0 <= t < v:
                    raise InvalidRequest(f"{field}: token id {t} is outside the vocabulary [0, {v})", field=field)
        sched = self.scheduler
        why = prompt_rejection(n, self.max_model_len, int(sched.num_blocks), int(sched.block_size))
        if why is not None:
            code = "context_length_exceeded" if "max_model_len" in why else "kv_cache_too_small"
            raise InvalidRequest(f"{field}: {why}", field=field, code=code)
        mml = self.max_model_len
        if n + params.max_tokens > mml:
            raise InvalidRequest(
                f"This model's maximum context length (max_model_len) is {mml} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the output); "
                f"lower max_tokens to at most {mml - n}.", field="max_tokens", code="context_length_exceeded")
