"""Output processing: the scheduler's step results -> one ``RequestOutput`` per request touched.

Invariant owned here: every tracked request ends exactly once, with one final output (stop,
length, abort, rejected or error), and an error while handling one request (its sampling row,
its detokenization, its stop strings) ends that request alone with ``finish_reason`` "error";
the others in the step go on. Latency histograms are read from the timestamps the scheduler
stamps on each request (it alone owns them); counters and the trace are kept here.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .core.batch import Batch, StepOutput
from .core.request import FinishReason, Request
from .detokenizer import Detokenizer, DetokState
from .metrics import Histogram, new_histograms
from .outputs import RequestOutput, SoFar, TokenLogprob
from .sim.trace_recorder import TraceRecorder

log = logging.getLogger("kvtune.engine")


@dataclass(eq=False)
class Tracked:
    """What output processing keeps per unfinished request."""
    request: Request
    detok: DetokState
    logprobs: list[TokenLogprob] | None = None
    trace_entry: dict[str, Any] | None = None
    stop_reason: str | int | None = None
    queue_observed: bool = False
    prev_token_s: float | None = None   # req.last_token_s as seen at the previous output (for ITL)


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def to_logprobs(raw: Any, new_ids: list[int]) -> list[TokenLogprob]:
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


class OutputProcessor:
    def __init__(self, detokenizer: Detokenizer, recorder: TraceRecorder, start_s: float):
        self.detok = detokenizer
        self.recorder = recorder
        self.start_s = start_s
        self.tracked: dict[str, Tracked] = {}
        self.hist: dict[str, Histogram] = new_histograms()
        self.counters: dict[str, Any] = {
            "prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
            "requests_finished": collections.Counter(), "requests_added": 0,
        }
        #: (request id, reason) the engine must end in the scheduler after this step
        self.to_finish: list[tuple[str, FinishReason]] = []

    def add(self, req: Request) -> None:
        p = req.sampling
        tr = Tracked(req, DetokState.for_prompt(req.prompt_token_ids, p.stop, p.min_tokens))
        if p.logprobs is not None:
            tr.logprobs = []
        tr.trace_entry = self.recorder.begin(req.arrival_s - self.start_s, req.prompt_token_ids,
                                             req.prefix_group, req.cache_salt)
        self.tracked[req.request_id] = tr
        self.counters["requests_added"] += 1

    def in_flight(self) -> list[dict[str, Any]]:
        """The trace entries of every request not finished yet (arrival order, however long ago it
        arrived), with what is known of its output: ``generated_tokens`` so far and the ``max_tokens``
        cap. A replay of the finished requests alone sees a queue's survivors, never the load that
        built it."""
        out = []
        for tr in self.tracked.values():
            e = tr.trace_entry
            if e is None:
                continue
            live = {k: v for k, v in e.items() if k != "output_tokens"}
            live.update(generated_tokens=len(tr.request.output_token_ids), max_tokens=tr.request.sampling.max_tokens)
            out.append(live)
        return sorted(out, key=lambda e: e["arrival_s"])

    # ------------------------------------------------------------------ one step
    def process(self, batch: Batch, out: StepOutput, finished: Iterable[Request], now: float) -> list[RequestOutput]:
        self.to_finish = []
        finished_ids = {r.request_id for r in finished}
        failed = {batch.seqs[i].request.request_id: why for i, why in (out.failed or {}).items()}
        lp_by_id: dict[str, Any] = {}
        if out.logprobs is not None:
            for s, lp in zip(batch.seqs, out.logprobs):
                if lp is not None:
                    lp_by_id[s.request.request_id] = lp
        outputs: list[RequestOutput] = []
        touched: list[Tracked] = []
        for s in batch.seqs:
            tr = self.tracked.get(s.request.request_id)
            if tr is None:
                continue
            r = tr.request
            if not tr.queue_observed and r.first_scheduled_s is not None:
                tr.queue_observed = True
                self.hist["queue"].observe(max(0.0, r.first_scheduled_s - r.arrival_s))
            if r.request_id in failed:
                outputs.append(self.fail(r.request_id, failed[r.request_id], now))
            elif len(r.output_token_ids) > tr.detok.num_seen:
                touched.append(tr)
        for rid in finished_ids:
            tr = self.tracked.get(rid)
            if tr is not None and tr not in touched and rid not in failed:
                touched.append(tr)
        news = self._detokenize(touched, now, outputs)
        gen = 0
        for tr, new in news:
            try:
                o = self._one(tr, new, lp_by_id.get(tr.request.request_id), finished_ids, now)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.exception("output processing failed for request %s", tr.request.request_id)
                o = self.fail(tr.request.request_id, f"output processing failed: {type(e).__name__}: {e}", now)
            gen += len(new)
            if o is not None:
                outputs.append(o)
        self.counters["generation_tokens"] += gen
        return outputs

    def _detokenize(self, touched: list[Tracked], now: float, outputs: list[RequestOutput]):
        try:
            news = self.detok.step([t.detok for t in touched], [t.request.output_token_ids for t in touched])
            return list(zip(touched, news))
        except Exception:  # noqa: BLE001 - find the request(s) at fault, one by one
            log.exception("batched detokenization failed; retrying request by request")
        ok = []
        for tr in touched:
            try:
                ok.append((tr, self.detok.step([tr.detok], [tr.request.output_token_ids])[0]))
            except Exception as e:  # noqa: BLE001
                log.exception("detokenization failed for request %s", tr.request.request_id)
                outputs.append(self.fail(tr.request.request_id, f"detokenization failed: {type(e).__name__}: {e}", now))
        return ok

    def _one(self, tr: Tracked, new: list[int], raw_lp: Any, finished_ids: set[str], now: float) -> RequestOutput | None:
        """The request's output for this step; None for an unfinished ``final_only`` request."""
        r = tr.request
        if new:
            if tr.prev_token_s is None:
                self.hist["ttft"].observe(max(0.0, (r.first_token_s or now) - r.arrival_s))
                self.counters["prompt_tokens"] += r.num_prompt_tokens
            elif r.last_token_s is not None:
                self.hist["itl"].observe(max(0.0, r.last_token_s - tr.prev_token_s))
            tr.prev_token_s = r.last_token_s if r.last_token_s is not None else now
        new_lps = None
        if tr.logprobs is not None and new:
            new_lps = to_logprobs(raw_lp, new)
            tr.logprobs.extend(new_lps)
        ended = r.request_id in finished_ids or r.is_finished
        if ended:
            self.detok.flush(tr.detok, r.output_token_ids)
        reason: FinishReason | None = None
        stop_hit = self.detok.check_stop(tr.detok)
        if stop_hit is not None:
            reason = FinishReason.STOP
            tr.stop_reason = stop_hit
            if not ended:
                self.to_finish.append((r.request_id, FinishReason.STOP))
        elif ended:
            reason = r.finish_reason or FinishReason.STOP
            if reason is FinishReason.STOP and r.output_token_ids:
                last = r.output_token_ids[-1]
                if last in r.sampling.stop_token_ids or last == r.eos_token_id:
                    tr.stop_reason = last
        if reason is not None:
            return self.finish(r.request_id, reason, now, new, new_lps)
        if r.sampling.final_only:
            return None
        return self._output(tr, new, new_lps, finished=False)

    # ------------------------------------------------------------------ ends
    def fail(self, request_id: str, why: str, now: float) -> RequestOutput:
        """End one request with an internal error (the engine frees it in the scheduler)."""
        tr = self.tracked[request_id]
        tr.request.error = f"internal error while handling this request: {why}"
        self.to_finish.append((request_id, FinishReason.ERROR))
        return self.finish(request_id, FinishReason.ERROR, now)

    def finish(self, request_id: str, reason: FinishReason, now: float, new: list[int] | None = None,
               new_lps=None) -> RequestOutput:
        tr = self.tracked.pop(request_id)
        r = tr.request
        self.counters["requests_finished"][reason.value] += 1
        if r.output_token_ids:
            self.hist["e2e"].observe(max(0.0, (r.last_token_s or now) - r.arrival_s))
            self.hist["output_tokens"].observe(len(r.output_token_ids))
        self.hist["prompt_tokens"].observe(r.num_prompt_tokens)
        if tr.trace_entry is not None:
            self.recorder.finish(tr.trace_entry, len(r.output_token_ids))
        return self._output(tr, new or [], new_lps, finished=True, reason=reason)

    def _output(self, tr: Tracked, new: list[int], new_lps, *, finished: bool,
                reason: FinishReason | None = None) -> RequestOutput:
        r, st = tr.request, tr.detok
        delta = st.release(finished)
        n_out = len(r.output_token_ids) if reason is not FinishReason.ERROR else st.num_seen
        lps = tr.logprobs
        return RequestOutput(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, delta_text=delta,
            new_token_ids=list(new), finished=finished,
            so_far=SoFar(r.output_token_ids, n_out, st.text, st.released, st.offsets, lps,
                         len(lps) if lps is not None else 0),
            finish_reason=reason.value if reason else None,
            stop_reason=tr.stop_reason if finished else None, num_cached_tokens=r.num_cached_tokens,
            new_logprobs=new_lps, error=r.error,
            metrics={"arrival_s": r.arrival_s, "first_scheduled_s": r.first_scheduled_s,
                     "first_token_s": r.first_token_s, "last_token_s": r.last_token_s},
        )
