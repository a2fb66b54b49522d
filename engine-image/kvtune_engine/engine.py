"""The engine loop: input processing -> scheduler -> runner -> scheduler -> output processing.

``LLMEngine`` owns the loop's four operations: add a request, abort one, run one step, change the
live config. Everything else lives in its own module: admission checks and tokenization
(``input_processor``), incremental detokenization and stop strings (``detokenizer``), outputs,
histograms and counters (``output_processor``), request shapes (``sim.trace_recorder``). The
scheduler alone owns request timestamps and the live config; the engine reads both from it.

Threading: every mutation (add, abort, step, config) happens on one thread (the server's engine
thread, or the caller's in the offline API). Other threads only *read* (``/metrics``, the admin
API) under ``self.lock``, which the loop holds while it touches the scheduler but not while the
runner computes, so a scrape never waits for a forward. Input processing is pure and may run
on any thread.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .config import LIVE_KNOBS, RESTART_KNOBS, ConfigError, EngineConfig
from .core.batch import StepOutput
from .core.request import FinishReason, Request, RequestStatus, SamplingParams
from .core.scheduler import RequestRejected
from .detokenizer import Detokenizer
from .input_processor import InputProcessor, InvalidRequest
from .kv.sizing import ActivationProfile
from .metrics import EngineMetrics
from .output_processor import OutputProcessor
from .outputs import RequestOutput, TokenLogprob
from .sim.trace_recorder import TRACE_CAPACITY, TraceRecorder
from .snapshot import scheduler_view
from .tokenizer_adapter import TokenizerAdapter

__all__ = ["LLMEngine", "InvalidRequest", "RestartRequired", "RequestOutput", "TokenLogprob"]

log = logging.getLogger("kvtune.engine")

STEP_RING_CAPACITY = 4096


class RestartRequired(ConfigError):
    """A change to a knob that sizes memory at start-up (HTTP 409)."""

    def __init__(self, message: str, knobs: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.knobs = knobs


def profile_message(over: dict[str, tuple[int, int]], profile: ActivationProfile | None) -> str:
    """Why a live raise is refused, what is allowed, and what to do instead."""
    parts = ", ".join(f"{k} -> {want} (profiled for at most {most})" for k, (most, want) in sorted(over.items()))
    shape = (f"max_num_batched_tokens <= {profile.max_num_batched_tokens}, max_num_seqs <= {profile.rows}"
             if profile is not None else "")
    return (f"{parts}: beyond the step the start-up memory profile measured ({shape}); a larger step "
            "may run out of device memory and fail every request in flight. Restart the engine with the "
            "new value (it profiles again; in a cluster the operator rolls the pods), or stay within "
            "the profiled values")


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler: Any, runner: Any, tokenizer: Any, *,
                 model_name: str = "model", eos_token_ids: Sequence[int] = (), vocab_size: int | None = None,
                 memory: dict[str, float] | None = None, clock: Callable[[], float] = time.monotonic,
                 trace_capacity: int = TRACE_CAPACITY, kv_cache_dtype: str = "auto", device: str = "cpu"):
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = TokenizerAdapter(tokenizer) if tokenizer is not None else None
        self.raw_tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.vocab_size = vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None)
        self.memory = dict(memory or {})
        self.kv_cache_dtype, self.device = kv_cache_dtype, device
        self.clock = clock
        self.start_s = clock()
        self.start_unix_s = time.time()
        self.lock = threading.RLock()
        self.inputs = InputProcessor(self.tokenizer, scheduler, self.vocab_size)
        self.outputs = OutputProcessor(Detokenizer(self.tokenizer), TraceRecorder(config.block_size, trace_capacity),
                                       self.start_s)
        self.hist, self.counters = self.outputs.hist, self.outputs.counters
        self._steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=STEP_RING_CAPACITY)
        self.last_step_empty = False
        self.metrics = EngineMetrics(self.snapshot, self.hist, model_name)

    @property
    def config(self) -> EngineConfig:
        """The running config: the scheduler's (it alone applies live changes)."""
        return self.scheduler.config

    @property
    def recorder(self) -> TraceRecorder:
        return self.outputs.recorder

    @property
    def trace_capacity(self) -> int:
        return self.outputs.recorder.capacity

    @property
    def num_blocks(self) -> int:
        return int(self.scheduler.num_blocks)

    def now(self) -> float:
        return self.clock()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.inputs.encode(prompt)

    # ---------------------------------------------------------------- add, abort
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_s: float | None = None,
                    prefix_group: str | None = None, cache_salt: str | None = None,
                    checked: bool = False) -> Request:
        """Queue one request (on the loop's thread). ``checked``: ``self.inputs.process`` already ran."""
        params = params if params is not None else SamplingParams()
        ids = list(prompt) if checked else self.inputs.process(prompt, params)
        if request_id is not None and request_id in self.outputs.tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        eos = None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            # more than one end-of-sequence id (Llama 3 instruct, Qwen chat): all of them stop
            params.stop_token_ids = list(params.stop_token_ids) + extra_eos
        req = Request(prompt_token_ids=ids, sampling=params, eos_token_id=eos, prefix_group=prefix_group,
                      arrival_s=self.clock() if arrival_s is None else arrival_s, cache_salt=cache_salt)
        if request_id is not None:
            req.request_id = request_id
        with self.lock:
            try:
                self.scheduler.add_request(req)
            except RequestRejected as e:
                raise InvalidRequest(str(e), field="prompt", code="request_rejected") from None
            self.outputs.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (client gone): its blocks return to the pool at once."""
        with self.lock:
            if request_id not in self.outputs.tracked:
                return None
            self.scheduler.abort(request_id)
            return self.outputs.finish(request_id, FinishReason.ABORT, self.clock())

    def has_unfinished(self) -> bool:
        return bool(self.outputs.tracked) or bool(self.scheduler.has_unfinished())

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs.tracked)

    @property
    def num_waiting(self) -> int:
        """Requests in the scheduler's waiting queue (lock-free read; for admission control)."""
        return len(self.scheduler.waiting)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        t0 = self.clock()
        with self.lock:
            batch = self.scheduler.schedule(t0)
            step = None if batch.empty else batch.freeze()  # the runner's own, immutable copy
        self.last_step_empty = batch.empty
        out = StepOutput(tokens=[], duration_s=0.0) if step is None else self.runner.execute(step)
        now = t0 if batch.empty else self.clock()
        with self.lock:
            finished = self.scheduler.update(batch, out, now) or []
            outputs = self.outputs.process(batch, out, finished, now)
            for rid, reason in self.outputs.to_finish:
                self.scheduler.finish(rid, reason, now)
            outputs += self._collect_stray_finished(now)
            if not batch.empty:
                self._record_step(batch, out, t0, now)
        return outputs

    def _collect_stray_finished(self, now: float) -> list[RequestOutput]:
        """Requests the scheduler finished without running them (e.g. rejected after a config change)."""
        return [self.outputs.finish(rid, tr.request.finish_reason or FinishReason.ABORT, now)
                for rid, tr in list(self.outputs.tracked.items()) if tr.request.status is RequestStatus.FINISHED]

    def _record_step(self, batch: Any, out: StepOutput, t0: float, now: float) -> None:
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

    # ---------------------------------------------------------------- live config
    def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply live knobs (all or nothing). Returns ``{knob: [old, new]}`` for what changed.

        Unknown names and bad values raise ConfigError; a restart-only knob whose value differs
        from the running one raises RestartRequired (a restart knob with the running value is fine),
        and so does a live raise past the start-up activation profile (``beyond_profile``).
        """
        norm = {str(k).replace("-", "_"): v for k, v in dict(changes).items()}
        unknown = sorted(k for k in norm if k not in LIVE_KNOBS and k not in RESTART_KNOBS)
        if unknown:
            raise ConfigError(f"unknown knob(s) {unknown}; live knobs are {sorted(LIVE_KNOBS)}")
        with self.lock:
            cur = self.config
            new_all = cur.with_changes(**norm)  # validates the restart knobs too: a bad value is a 400
            restart = {k: (getattr(cur, k), getattr(new_all, k)) for k in norm
                       if k in RESTART_KNOBS and getattr(cur, k) != getattr(new_all, k)}
            if restart:
                parts = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(restart.items()))
                raise RestartRequired(
                    f"{parts}: restart-only knob(s) (they size memory at start-up); restart the engine with "
                    f"the new value (in a cluster the operator rolls the pods). Live knobs: {sorted(LIVE_KNOBS)}",
                    restart)
            over = self.beyond_profile(new_all)
            if over:
                raise RestartRequired(profile_message(over, self.activation_profile),
                                      {k: (getattr(cur, k), getattr(new_all, k)) for k in over})
            changed = {k: [getattr(cur, k), getattr(new_all, k)] for k in norm
                       if k in LIVE_KNOBS and getattr(cur, k) != getattr(new_all, k)}
            if changed:
                self.scheduler.update_config(**{k: v[1] for k, v in changed.items()})
                log.info("live config change: %s", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
            return changed

    @property
    def activation_profile(self) -> ActivationProfile | None:
        """The step shape the runner's memory was sized for at start-up (None: not bounded)."""
        p = getattr(self.runner, "activation_profile", None)
        return p if isinstance(p, ActivationProfile) else None

    def beyond_profile(self, config: EngineConfig) -> dict[str, tuple[int, int]]:
        """``{knob: (most profiled, requested)}`` where ``config`` allows a step larger than the
        start-up profile measured: such a step may not fit in device memory."""
        p = self.activation_profile
        return {} if p is None else p.exceeded(config.max_num_batched_tokens, config.max_num_seqs)

    # ---------------------------------------------------------------- reading
    def trace(self, since_s: float | None = None, limit: int | None = None, *,
              unfinished: bool = False) -> dict[str, Any]:
        """Recent request shapes (finished requests, arrival order), in ``kvtune sim``'s trace format;
        ``unfinished``: also every request still in the engine, whenever it arrived
        (``OutputProcessor.in_flight``: the queue a change starts from)."""
        with self.lock:
            view = self.recorder.view(since_s, limit)
            if unfinished:
                view["unfinished"] = self.outputs.in_flight()
        return {"start_unix_s": self.start_unix_s, "now_s": round(self.clock() - self.start_s, 6), **view}

    def steps(self, limit: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            s = list(self._steps)
        return s[-limit:] if limit else s

    def snapshot(self) -> dict[str, Any]:
        """Everything the state API and /metrics show, read consistently under the lock."""
        with self.lock:
            memory = dict(self.memory)
            rm = getattr(self.runner, "memory", None)
            if isinstance(rm, dict):
                memory.update(rm)
            c = self.counters
            return {
                "model": self.model_name, "device": self.device,
                # the profile a simulated engine (kvtune serve --simulate) charges; None: a real model
                "simulated": sim if isinstance(sim := getattr(self.runner, "simulated", None), str) else None,
                "config": self.config.model_dump(),
                "activation_profile": p.as_dict() if (p := self.activation_profile) is not None else None,
                **scheduler_view(self.scheduler), "memory": memory, "kv_cache_dtype": self.kv_cache_dtype,
                "counters": {k: c[k] for k in ("prompt_tokens", "generation_tokens", "steps", "requests_added")}
                | {"requests_finished": dict(c["requests_finished"])},
                "uptime_s": round(self.clock() - self.start_s, 3),
            }
