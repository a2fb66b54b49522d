"""The engine loop: tokenizer -> scheduler -> runner -> scheduler -> detokenizer, one step at a time.

``LLMEngine`` glues the layers together and keeps what only the loop knows: per-request text
(incremental detokenization, stop strings), latency histograms, engine counters, a bounded ring of
recent request *shapes* (the trace format of ``kvtune sim``; never text) and live config updates.

Threading: every mutation (add, abort, step, config) happens on one thread (the server's engine
thread, or the caller's in the offline API). Other threads only *read* (``/metrics``,
``/kvtune/v1/state``, ``/kvtune/v1/trace``), under ``self.lock``, which the loop holds while it
touches the scheduler but not while the runner computes, so a scrape never waits for a forward.

``LLM(model_dir, **engine_flags).generate(prompts, params)`` is the offline API.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import LIVE_KNOBS, RESTART_KNOBS, ConfigError, EngineConfig
from .core.batch import Batch, StepOutput
from .core.request import FinishReason, Request, RequestStatus, SamplingParams
from .core.scheduler import RequestRejected
from .metrics import EngineMetrics, Histogram, new_histograms

log = logging.getLogger("kvtune.engine")

MAX_LOGPROBS = 20
_DETOK_CONTEXT = 6  # prompt tokens decoded with the output so that the first word's spacing is right
TRACE_CAPACITY = 10_000
STEP_RING_CAPACITY = 4096


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it (HTTP 400); ``field`` names the culprit."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.field = field
        self.code = code


class RestartRequired(ConfigError):
    """A change to a knob that sizes memory at start-up (HTTP 409)."""

    def __init__(self, message: str, knobs: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.knobs = knobs


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------

@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """What one step produced for one request (the server streams these; ``LLM`` returns the last)."""
    request_id: str
    prompt_token_ids: list[int]
    text: str                      # all output text released so far (stop string cut, hold-back kept)
    delta_text: str                # new text since the previous output of this request
    token_ids: list[int]           # all output token ids so far
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None        # stop | length | abort | rejected
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None       # all so far (when asked for)
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class _Tracked:
    """The loop's private per-request state."""
    request: Request
    stops: list[str]
    hold_back: int                 # characters withheld while running (a stop string may be forming)
    ctx: list[int]                 # prompt tail used as decoding context
    prefix_offset: int = 0         # into ctx + outputs
    read_offset: int = 0
    text: str = ""                 # full detokenized output
    released: int = 0              # characters of `text` handed out
    num_seen: int = 0              # output tokens already detokenized
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    stop_reason: str | int | None = None
    finish_override: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    trace_entry: dict[str, Any] | None = None


# --------------------------------------------------------------------------------------------
# Tokenizer adapter
# --------------------------------------------------------------------------------------------

class TokenizerAdapter:
    """The few tokenizer operations the loop needs, over the model's Tokenizer or a ``tokenizers.Tokenizer``."""

    def __init__(self, tok: Any):
        self.wrapped = tok
        inner = tok
        for name in ("tokenizer", "raw", "_tok"):
            cand = getattr(tok, name, None)
            if cand is not None and hasattr(cand, "decode_batch"):
                inner = cand
                break
        self.inner = inner  # a tokenizers.Tokenizer when available
        self._batch = getattr(inner, "decode_batch", None)

    def encode(self, text: str) -> list[int]:
        if self.wrapped is not self.inner:
            return list(self.wrapped.encode(text))
        return list(self.inner.encode(text, add_special_tokens=True).ids)

    def decode_many(self, seqs: list[list[int]]) -> list[str]:
        if not seqs:
            return []
        if self._batch is not None:
            return self._batch(seqs, skip_special_tokens=True)
        return [self.decode(s) for s in seqs]

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        f = getattr(self.wrapped, "token_text", None)
        if f is not None:
            return f(token_id)
        return self.inner.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int | None:
        f = getattr(self.inner, "get_vocab_size", None)
        return f(with_added_tokens=True) if f else None


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------

class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler: Any, runner: Any, tokenizer: Any, *,
                 model_name: str = "model", eos_token_ids: Sequence[int] = (), vocab_size: int | None = None,
                 memory: dict[str, float] | None = None, clock: Callable[[], float] = time.monotonic,
                 trace_capacity: int = TRACE_CAPACITY, chat_template: Any = None,
                 kv_cache_dtype: str = "auto", device: str = "cpu"):
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = TokenizerAdapter(tokenizer) if tokenizer is not None else None
        self.raw_tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.vocab_size = vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None)
        self.memory = dict(memory or {})
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.clock = clock
        self.start_s = clock()
        self.start_unix_s = time.time()
        self.lock = threading.RLock()

        self._tracked: dict[str, _Tracked] = {}
        self.hist: dict[str, Histogram] = new_histograms()
        self.counters: dict[str, Any] = {
            "prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
            "requests_finished": collections.Counter(), "requests_added": 0,
        }
        self.trace_capacity = trace_capacity
        self._trace: collections.deque[dict[str, Any]] = collections.deque(maxlen=trace_capacity)
        self._trace_recorded = 0
        self._prefix_groups: collections.OrderedDict[bytes, tuple[str, list[int], dict]] = \
            collections.OrderedDict()
        self._next_group = 0
        self._steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=STEP_RING_CAPACITY)
        self.last_step_empty = False
        self.metrics = EngineMetrics(self.snapshot, self.hist, model_name)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_model_dir(cls, model_dir: str, config: EngineConfig | None = None, *, device: str = "cpu",
                       dtype: str | None = None, served_model_name: str | None = None,
                       clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                       **runner_kwargs: Any) -> "LLMEngine":
        """Load the model and tokenizer, size the KV cache (runner), wire the scheduler to it."""
        return build_engine(model_dir, config, device=device, dtype=dtype,
                            served_model_name=served_model_name, clock=clock, seed=seed, **runner_kwargs)

    # ---------------------------------------------------------------- requests
    def now(self) -> float:
        return self.clock()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: pass token ids", field="prompt")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def validate_sampling(self, p: SamplingParams) -> None:
        """Raise InvalidRequest naming the field when a sampling parameter is out of range."""
        def bad(fld: str, msg: str):
            raise InvalidRequest(f"{fld}: {msg}", field=fld, code="invalid_sampling_parameter")
        if not isinstance(p.max_tokens, int) or isinstance(p.max_tokens, bool) or p.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {p.max_tokens!r}")
        if not _is_number(p.temperature) or not (0.0 <= p.temperature) or math.isinf(p.temperature):
            bad("temperature", f"must be a number >= 0, got {p.temperature!r}")
        if not _is_number(p.top_p) or not (0.0 < p.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {p.top_p!r}")
        if not isinstance(p.top_k, int) or isinstance(p.top_k, bool) or (p.top_k < 1 and p.top_k != -1):
            bad("top_k", f"must be -1 (off) or an integer >= 1, got {p.top_k!r}")
        if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool)):
            bad("seed", f"must be an integer, got {p.seed!r}")
        if not isinstance(p.stop, list) or not all(isinstance(s, str) and s for s in p.stop):
            bad("stop", f"must be a list of non-empty strings, got {p.stop!r}")
        if len(p.stop) > 16:
            bad("stop", f"at most 16 stop strings, got {len(p.stop)}")
        if not isinstance(p.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and
                (self.vocab_size is None or t < self.vocab_size) for t in p.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {self.vocab_size}), got {p.stop_token_ids!r}")
        if p.logprobs is not None and (not isinstance(p.logprobs, int) or isinstance(p.logprobs, bool)
                                       or not 0 <= p.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The limits a request must fit before it is queued (each message names limit and numbers)."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt: the prompt is empty (0 tokens)", field="prompt")
        if self.vocab_size is not None:
            for t in prompt_ids:
                if not 0 <= t < self.vocab_size:
                    raise InvalidRequest(f"prompt: token id {t} is outside the vocabulary [0, {self.vocab_size})",
                                         field="prompt")
        mml = self.config.max_model_len
        if n + params.max_tokens > mml:
            if n >= mml:
                raise InvalidRequest(
                    f"This model's maximum context length (max_model_len) is {mml} tokens; the prompt has "
                    f"{n} tokens, which leaves no room for output.", field="prompt",
                    code="context_length_exceeded")
            raise InvalidRequest(
                f"This model's maximum context length (max_model_len) is {mml} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the output); "
                f"lower max_tokens to at most {mml - n}.", field="max_tokens", code="context_length_exceeded")
        total_slots = self.num_blocks * self.config.block_size
        if n + 1 > total_slots:
            raise InvalidRequest(
                f"The prompt ({n} tokens, {math.ceil((n + 1) / self.config.block_size)} blocks of "
                f"{self.config.block_size}) is larger than the whole KV cache ({self.num_blocks} blocks = "
                f"{total_slots} token slots).", field="prompt", code="kv_cache_too_small")

    @property
    def num_blocks(self) -> int:
        return int(self.scheduler.num_blocks)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_s: float | None = None,
                    prefix_group: str | None = None) -> Request:
        """Validate and queue one request (the caller's thread must be the loop's thread)."""
        params = params if params is not None else SamplingParams()
        self.validate_sampling(params)
        ids = self.encode(prompt)
        self.check_prompt(ids, params)
        req = Request(prompt_token_ids=ids, sampling=params,
                      arrival_s=self.clock() if arrival_s is None else arrival_s,
                      eos_token_id=None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0],
                      prefix_group=prefix_group)
        if request_id is not None:
            req.request_id = request_id
        if request_id in self._tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            # more than one end-of-sequence id (Llama 3 instruct, Qwen chat): all of them stop
            params.stop_token_ids = list(params.stop_token_ids) + extra_eos
        stops = list(params.stop)
        tr = _Tracked(request=req, stops=stops,
                      hold_back=max((len(s) for s in stops), default=1) - 1,
                      ctx=ids[-_DETOK_CONTEXT:])
        tr.prefix_offset, tr.read_offset = 0, len(tr.ctx)
        if params.logprobs is not None:
            tr.logprobs = []
        with self.lock:
            try:
                self.scheduler.add_request(req)
            except RequestRejected as e:
                raise InvalidRequest(str(e), field="prompt", code="request_rejected") from None
            self._tracked[req.request_id] = tr
            self.counters["requests_added"] += 1
            tr.trace_entry = self._trace_entry(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (client gone): its blocks return to the pool at once."""
        with self.lock:
            tr = self._tracked.get(request_id)
            if tr is None:
                return None
            self.scheduler.abort(request_id)
            tr.request.finish_reason = tr.request.finish_reason or FinishReason.ABORT
            return self._finish(tr, FinishReason.ABORT, self.clock())

    def has_unfinished(self) -> bool:
        return bool(self._tracked) or bool(self.scheduler.has_unfinished())

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        t0 = self.clock()
        with self.lock:
            batch: Batch = self.scheduler.schedule(t0)
        self.last_step_empty = batch.empty
        if batch.empty:
            with self.lock:
                finished = self.scheduler.update(batch, StepOutput(tokens=[], duration_s=0.0), t0) or []
                outs = self._after_step(batch, StepOutput(tokens=[], duration_s=0.0), finished, t0)
                return outs + self._collect_stray_finished(t0)
        for s in batch.seqs:
            tr = self._tracked.get(s.request.request_id)
            if tr is not None and tr.first_scheduled_s is None:
                tr.first_scheduled_s = t0
                self.hist["queue"].observe(max(0.0, t0 - s.request.arrival_s))
        out: StepOutput = self.runner.execute(batch)
        now = self.clock()
        with self.lock:
            finished = self.scheduler.update(batch, out, now) or []
            outputs = self._after_step(batch, out, finished, now)
            dur = now - t0
            self.hist["step_duration"].observe(dur)
            self.hist["step_tokens"].observe(batch.num_batched_tokens)
            self.hist["step_context"].observe(batch.num_decode_context_tokens)
            self.counters["steps"] += 1
            self._steps.append({
                "t_s": round(t0 - self.start_s, 6), "duration_s": round(dur, 6),
                "runner_s": round(float(getattr(out, "duration_s", 0.0) or 0.0), 6),
                "batched_tokens": batch.num_batched_tokens, "num_seqs": len(batch.seqs),
                "num_decodes": sum(1 for s in batch.seqs if s.num_tokens == 1 and s.sample),
                "decode_context_tokens": batch.num_decode_context_tokens,
                "swap_out_blocks": len(batch.swap_out), "swap_in_blocks": len(batch.swap_in),
            })
        return outputs

    def _collect_stray_finished(self, now: float) -> list[RequestOutput]:
        # requests the scheduler finished without running them (e.g. rejected after a config change)
        outs = []
        for rid, tr in list(self._tracked.items()):
            r = tr.request
            if r.status is RequestStatus.FINISHED:
                outs.append(self._finish(tr, r.finish_reason or FinishReason.ABORT, now))
        return outs

    def _after_step(self, batch: Batch, out: StepOutput, finished: Iterable[Request],
                    now: float) -> list[RequestOutput]:
        finished_ids = {r.request_id for r in finished}
        lp_by_id: dict[str, Any] = {}
        if out.logprobs is not None:
            for s, lp in zip(batch.seqs, out.logprobs):
                if lp is not None:
                    lp_by_id[s.request.request_id] = lp
        # which requests got new tokens this step
        touched: list[_Tracked] = []
        for s in batch.seqs:
            tr = self._tracked.get(s.request.request_id)
            if tr is not None and len(tr.request.output_token_ids) > tr.num_seen:
                touched.append(tr)
        for rid in finished_ids:
            tr = self._tracked.get(rid)
            if tr is not None and tr not in touched:
                touched.append(tr)
        new_ids = self._detokenize(touched)
        outputs: list[RequestOutput] = []
        gen = 0
        for tr, new in zip(touched, new_ids):
            r = tr.request
            gen += len(new)
            if new:
                if tr.first_token_s is None:
                    tr.first_token_s = now
                    self.hist["ttft"].observe(max(0.0, now - r.arrival_s))
                    self.counters["prompt_tokens"] += r.num_prompt_tokens
                elif tr.last_token_s is not None:
                    self.hist["itl"].observe(max(0.0, now - tr.last_token_s))
                tr.last_token_s = now
            new_lps = None
            if tr.logprobs is not None and new:
                new_lps = _to_logprobs(lp_by_id.get(r.request_id), new)
                tr.logprobs.extend(new_lps)
            done_reason: FinishReason | None = None
            if r.request_id in finished_ids or r.is_finished:
                self._flush_text(tr)
            stop_hit = self._check_stop_strings(tr)
            if stop_hit is not None:
                done_reason = FinishReason.STOP
                tr.stop_reason = stop_hit
                if r.request_id not in finished_ids and not r.is_finished:
                    self.scheduler.finish(r.request_id, FinishReason.STOP)
            elif r.request_id in finished_ids or r.is_finished:
                done_reason = r.finish_reason or FinishReason.STOP
                if done_reason is FinishReason.STOP and r.output_token_ids:
                    last = r.output_token_ids[-1]
                    if last in r.sampling.stop_token_ids or last == r.eos_token_id:
                        tr.stop_reason = last
            if done_reason is not None:
                outputs.append(self._finish(tr, done_reason, now, new, new_lps))
            else:
                outputs.append(self._output(tr, new, new_lps, finished=False))
        self.counters["generation_tokens"] += gen
        return outputs

    def _detokenize(self, trs: list[_Tracked]) -> list[list[int]]:
        """Append the new text of each request; return each request's new token ids."""
        news: list[list[int]] = []
        prefix_seqs: list[list[int]] = []
        full_seqs: list[list[int]] = []
        for tr in trs:
            outs = tr.request.output_token_ids
            new = outs[tr.num_seen:]
            tr.num_seen = len(outs)
            news.append(new)
            prefix_seqs.append(_window(tr.ctx, outs, tr.prefix_offset, tr.read_offset))
            full_seqs.append(_window(tr.ctx, outs, tr.prefix_offset, None))
        if self.tokenizer is None:
            return news
        texts = self.tokenizer.decode_many(prefix_seqs + full_seqs)
        n = len(trs)
        for i, tr in enumerate(trs):
            if not news[i]:
                continue
            prefix_text, full_text = texts[i], texts[n + i]
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                tr.text += full_text[len(prefix_text):]
                tr.prefix_offset = tr.read_offset
                tr.read_offset = len(tr.ctx) + tr.num_seen
        return news

    def _flush_text(self, tr: _Tracked) -> None:
        """At the end, take the text still held back waiting for a multi-byte character to complete."""
        if self.tokenizer is None or tr.stop_reason is not None:
            return
        ids = tr.ctx + tr.request.output_token_ids
        if tr.read_offset >= len(ids):
            return
        prefix_text, full_text = self.tokenizer.decode_many([ids[tr.prefix_offset:tr.read_offset],
                                                              ids[tr.prefix_offset:]])
        if len(full_text) > len(prefix_text):
            tr.text += full_text[len(prefix_text):]
        tr.prefix_offset = tr.read_offset = len(ids)

    def _check_stop_strings(self, tr: _Tracked) -> str | None:
        if not tr.stops or tr.stop_reason is not None:
            return None
        text = tr.text
        start = max(0, tr.released - max(len(s) for s in tr.stops))
        best: tuple[int, str] | None = None
        for s in tr.stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        tr.text = text[:best[0]]
        return best[1]

    def _output(self, tr: _Tracked, new: list[int], new_lps, *, finished: bool,
                reason: FinishReason | None = None) -> RequestOutput:
        r = tr.request
        end = len(tr.text) if finished else max(tr.released, len(tr.text) - tr.hold_back)
        delta = tr.text[tr.released:end]
        tr.released = end
        return RequestOutput(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, text=tr.text[:end], delta_text=delta,
            token_ids=list(r.output_token_ids), new_token_ids=list(new), finished=finished,
            finish_reason=reason.value if reason else None, stop_reason=tr.stop_reason if finished else None,
            num_cached_tokens=r.num_cached_tokens, logprobs=tr.logprobs, new_logprobs=new_lps,
            error=r.error,
            metrics={"arrival_s": r.arrival_s, "first_scheduled_s": tr.first_scheduled_s,
                     "first_token_s": tr.first_token_s, "last_token_s": tr.last_token_s},
        )

    def _finish(self, tr: _Tracked, reason: FinishReason, now: float, new: list[int] | None = None,
                new_lps=None) -> RequestOutput:
        r = tr.request
        self._tracked.pop(r.request_id, None)
        self.counters["requests_finished"][reason.value] += 1
        if r.output_token_ids:
            self.hist["e2e"].observe(max(0.0, (tr.last_token_s or now) - r.arrival_s))
            self.hist["output_tokens"].observe(len(r.output_token_ids))
        self.hist["prompt_tokens"].observe(r.num_prompt_tokens)
        if tr.trace_entry is not None and r.output_token_ids:
            # (a request aborted before its first token left no load worth replaying: not traced)
            tr.trace_entry["output_tokens"] = len(r.output_token_ids)
            tr.trace_entry["_finish"] = reason.value
            self._trace.append(tr.trace_entry)
            self._trace_recorded += 1
        return self._output(tr, new or [], new_lps, finished=True, reason=reason)

    # ---------------------------------------------------------------- trace
    def _trace_entry(self, req: Request) -> dict[str, Any]:
        e: dict[str, Any] = {"arrival_s": round(req.arrival_s - self.start_s, 6),
                             "prompt_tokens": req.num_prompt_tokens, "output_tokens": 0}
        if req.prefix_group:
            e["prefix_group"] = req.prefix_group
            return e
        bs = self.config.block_size
        ids = req.prompt_token_ids
        if len(ids) < bs:
            return e
        key = hashlib.blake2b(repr(ids[:bs]).encode(), digest_size=12).digest()
        hit = self._prefix_groups.get(key)
        if hit is None:
            self._prefix_groups[key] = ("", list(ids), e)
            if len(self._prefix_groups) > 1024:
                self._prefix_groups.popitem(last=False)
            return e
        group, prev_ids, first = hit
        self._prefix_groups.move_to_end(key)
        n = _common_prefix(prev_ids, ids)
        if not group:
            group = f"p{self._next_group}"
            self._next_group += 1
            first["prefix_group"] = group
            first["prefix_tokens"] = n
        e["prefix_group"] = group
        e["prefix_tokens"] = n
        self._prefix_groups[key] = (group, list(ids), first)
        return e

    def trace(self, since_s: float | None = None, limit: int | None = None) -> dict[str, Any]:
        """Recent request shapes (finished requests, arrival order), in ``kvtune sim``'s trace format."""
        with self.lock:
            entries = [dict(e) for e in self._trace]
            recorded = self._trace_recorded
        reqs = []
        for e in sorted(entries, key=lambda e: e["arrival_s"]):
            if since_s is not None and e["arrival_s"] <= since_s:
                continue
            e.pop("_finish", None)
            reqs.append(e)
        if limit is not None and limit >= 0:
            reqs = reqs[-limit:] if limit else []
        return {"start_unix_s": self.start_unix_s, "now_s": round(self.clock() - self.start_s, 6),
                "capacity": self.trace_capacity, "recorded_total": recorded,
                "dropped_total": max(0, recorded - len(entries)), "requests": reqs}

    def steps(self, limit: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            s = list(self._steps)
        return s[-limit:] if limit else s

    # ---------------------------------------------------------------- config
    def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply live knobs (all or nothing). Returns ``{knob: [old, new]}`` for what changed.

        Unknown names and bad values raise ConfigError; a restart-only knob whose value differs
        from the running one raises RestartRequired (a restart knob with the running value is fine).
        """
        norm = {str(k).replace("-", "_"): v for k, v in dict(changes).items()}
        unknown = sorted(k for k in norm if k not in LIVE_KNOBS and k not in RESTART_KNOBS)
        if unknown:
            raise ConfigError(f"unknown knob(s) {unknown}; live knobs are {sorted(LIVE_KNOBS)}")
        with self.lock:
            cur = self.config
            # validate the restart knobs' values too, so a bad value is a 400, not a 409
            new_all = cur.with_changes(**norm)
            restart = {k: (getattr(cur, k), getattr(new_all, k)) for k in norm
                       if k in RESTART_KNOBS and getattr(cur, k) != getattr(new_all, k)}
            if restart:
                parts = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(restart.items()))
                raise RestartRequired(
                    f"{parts}: restart-only knob(s) (they size memory at start-up); restart the engine with "
                    f"the new value (in a cluster the operator rolls the pods). Live knobs: {sorted(LIVE_KNOBS)}",
                    restart)
            live = {k: getattr(new_all, k) for k in norm if k in LIVE_KNOBS}
            changed = {k: [getattr(cur, k), v] for k, v in live.items() if getattr(cur, k) != v}
            new = cur.with_changes(**live)
            if changed:
                self.scheduler.update_config(**{k: v[1] for k, v in changed.items()})
                self.config = new
                log.info("live config change: %s", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in
                                                             changed.items()))
            return changed

    # ---------------------------------------------------------------- state
    def snapshot(self) -> dict[str, Any]:
        """Everything the state API and /metrics show, read consistently under the lock."""
        with self.lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, Any]:
        view = scheduler_view(self.scheduler)
        memory = dict(self.memory)
        rm = getattr(self.runner, "memory", None)
        if isinstance(rm, dict):
            memory.update(rm)
        return {
            "model": self.model_name,
            "device": self.device,
            "config": self.config.model_dump(),
            **view,
            "memory": memory,
            "kv_cache_dtype": self.kv_cache_dtype,
            "counters": {
                "prompt_tokens": self.counters["prompt_tokens"],
                "generation_tokens": self.counters["generation_tokens"],
                "steps": self.counters["steps"],
                "requests_added": self.counters["requests_added"],
                "requests_finished": dict(self.counters["requests_finished"]),
            },
            "uptime_s": round(self.clock() - self.start_s, 3),
        }

    @property
    def num_waiting(self) -> int:
        """Requests in the scheduler's waiting queue (lock-free read; for admission control)."""
        return len(self.scheduler.waiting)


def scheduler_view(sched: Any) -> dict[str, Any]:
    """The scheduler's snapshot in the state API's shape (names shared with the metrics)."""
    snap = sched.snapshot()
    blocks = dict(snap["blocks"])
    blocks["total"] = snap["num_blocks"]
    n_swap = snap["num_swap_blocks"]
    free_swap = sched.kv.num_free_swap_blocks if n_swap else 0
    pc = snap.get("prefix_cache", {})
    q, h = pc.get("query_tokens", 0), pc.get("hit_tokens", 0)
    head = snap.get("head")
    if head is not None:
        head = {**head, "cause": snap.get("waiting_cause"),
                "allocatable_blocks": snap.get("allocatable_blocks")}
        head.pop("waited_steps_cause", None)
    recent = dict(snap.get("recent_waiting_cause_steps", {}))
    return {
        "num_blocks": snap["num_blocks"],
        "num_swap_blocks": n_swap,
        "blocks": blocks,
        "allocatable_blocks": snap.get("allocatable_blocks"),
        "swap": {"total": n_swap, "used": n_swap - free_swap, "free": free_swap},
        "queues": dict(snap["queues"]),
        "head": head,
        "waiting_cause": snap.get("waiting_cause"),
        "waiting_reason_steps": dict(snap.get("waiting_cause_steps", {})),
        "recent_waiting_reasons": {"window_steps": sum(recent.values()), **recent},
        "kv_usage_ratio": snap["kv_usage_ratio"],
        "kv_internal_fragmentation_ratio": snap["internal_fragmentation_ratio"],
        "swap_usage_ratio": snap["swap_usage_ratio"],
        "preemptions": dict(snap.get("preemptions", {})),
        "prefix_cache": {"queries_tokens": q, "hits_tokens": h, "hit_ratio": (h / q) if q else None},
        "scheduler_steps": snap.get("steps"),
        "rejected": snap.get("rejected", 0),
        "cache_limit_finishes": snap.get("cache_limit_finishes", 0),
    }


def build_engine(model_dir: str, config: EngineConfig | None = None, *, device: str = "cpu",
                 dtype: str | None = None, served_model_name: str | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                 **runner_kwargs: Any) -> LLMEngine:
    """The factory: tokenizer + ModelRunner (loads weights, sizes the KV cache) + Scheduler."""
    from pathlib import Path

    from .core.scheduler import Scheduler
    from .model import load_tokenizer
    from .runner import ModelRunner

    config = config or EngineConfig()
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    tok = load_tokenizer(d)
    runner = ModelRunner(d, config, device=device, dtype=dtype or "auto", seed=seed, **runner_kwargs)
    sched = Scheduler(config, runner.num_blocks, runner.num_swap_blocks)
    mc = runner.model_config
    eos = list(tok.eos_token_ids or []) or list(mc.eos_token_ids or [])
    dt = str(runner.dtype).removeprefix("torch.")
    return LLMEngine(config, sched, runner, tok, model_name=served_model_name or d.resolve().name,
                     eos_token_ids=eos, vocab_size=mc.vocab_size, clock=clock, kv_cache_dtype=dt,
                     device=str(runner.device))


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _window(ctx: list[int], outs: list[int], a: int, b: int | None) -> list[int]:
    """(ctx + outs)[a:b] without building ctx + outs (the output grows every step)."""
    n = len(ctx)
    if b is None:
        b = n + len(outs)
    if a >= n:
        return outs[a - n:b - n]
    return ctx[a:b] + (outs[:b - n] if b > n else [])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _to_logprobs(raw: Any, new_ids: list[int]) -> list[TokenLogprob]:
    """Normalise the runner's logprobs for one sequence's new token(s)."""
    if raw is None:
        return [TokenLogprob(t, float("nan")) for t in new_ids]
    items = raw if isinstance(raw, list) and raw and not isinstance(raw[0], (int, float, tuple)) else [raw]
    out = []
    for tid, item in zip(new_ids, items):
        if isinstance(item, TokenLogprob):
            out.append(item)
            continue
        lp = _get(item, "logprob")
        top = _get(item, "top") or _get(item, "top_logprobs") or []
        if lp is None and isinstance(item, tuple):
            lp, top = item[0], item[1] if len(item) > 1 else []
        if isinstance(top, dict):
            top = list(top.items())
        out.append(TokenLogprob(tid, float(lp) if lp is not None else float("nan"),
                                [(int(a), float(b)) for a, b in top]))
    return out


# --------------------------------------------------------------------------------------------
# Offline API
# --------------------------------------------------------------------------------------------

class LLM:
    """Offline batch generation: ``LLM(model_dir, max_num_seqs=64).generate(prompts, params)``.

    ``engine_flags`` are EngineConfig fields (``block_size``, ``kv_cache_memory``, ...); ``device`` and
    ``dtype`` choose where and how the model runs.
    """

    def __init__(self, model: str, *, device: str = "cpu", dtype: str | None = None,
                 served_model_name: str | None = None, **engine_flags: Any):
        cfg = EngineConfig.build(**{k.replace("-", "_"): v for k, v in engine_flags.items()})
        self.engine = LLMEngine.from_model_dir(model, cfg, device=device, dtype=dtype,
                                               served_model_name=served_model_name)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        self = cls.__new__(cls)
        self.engine = engine
        return self

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Generate for all prompts (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [_copy_params(params or SamplingParams()) for _ in prompts]
        else:
            plist = [_copy_params(p) for p in params]
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        eng = self.engine
        encoded = []
        for p, sp in zip(prompts, plist):  # validate everything before queueing anything
            eng.validate_sampling(sp)
            ids = eng.encode(p)
            eng.check_prompt(ids, sp)
            encoded.append(ids)
        order: dict[str, int] = {}
        for i, (ids, sp) in enumerate(zip(encoded, plist)):
            req = eng.add_request(ids, sp)
            order[req.request_id] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        done = 0
        while done < len(prompts):
            if not eng.has_unfinished():
                raise RuntimeError(f"the engine stopped with {len(prompts) - done} requests unanswered")
            for out in eng.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    done += 1
                    if progress:
                        progress(done, len(prompts))
        return results  # type: ignore[return-value]


def _copy_params(p: SamplingParams) -> SamplingParams:
    return SamplingParams(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(p).items()})
