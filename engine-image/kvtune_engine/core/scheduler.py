"""Continuous-batching scheduler over a paged KV cache, which names why requests wait.

Invariant owned here: every unfinished request is in exactly one queue (running, swapped, waiting)
and a running request's block table covers exactly its computed tokens between steps.

One step (`schedule`), FCFS throughout:
 1. running requests, oldest first: a decode (1 token) or the next prefill chunk, within the
    token budget; a request that needs a block it cannot get preempts the newest running
    requests (swap to the host pool if it has room, else recompute later), or itself;
 2. swapped requests come back (swap-in) before any new admission;
 3. waiting requests are admitted while `max_num_seqs`, the token budget and the allocatable
    blocks (free + evictable cached - watermark reserve) allow; the first limit that stops the
    queue head is the step's waiting cause (see `stats.CAUSES`).
No admission happens in a step that preempted. The watermark reserve only applies while something
is running (it keeps decode headroom), so a request that fits the cache always gets in eventually.
``admission``: a waiting request gets in when its next chunk's blocks are allocatable ("chunk", ours),
or only when its whole sequence's are, though it takes just the chunk's ("whole": vLLM's default
since its scheduler_reserve_full_isl, which keeps a long or resumed request from being admitted into
blocks it will need back from its neighbours a step later).
"""
from __future__ import annotations

from collections import deque

from ..config import LIVE_KNOBS, ConfigError, EngineConfig
from ..kv.kv_manager import KVManager
from .batch import Batch, ScheduledSeq, StepOutput
from ..request import FinishReason, Request, RequestStatus
from .stats import SchedulerStats

RUNNING, WAITING, SWAPPED, FINISHED = (RequestStatus.RUNNING, RequestStatus.WAITING,
                                       RequestStatus.SWAPPED, RequestStatus.FINISHED)


#: the admission rules (see the module docstring)
ADMISSIONS = ("chunk", "whole")


class RequestRejected(ValueError):
    """The request can never be scheduled under this engine's limits; the message says which."""


def prompt_rejection(n: int, max_model_len: int, num_blocks: int, block_size: int) -> str | None:
    """Why a prompt of `n` tokens can never be scheduled, or None: the one prompt-length rule (the
    engine's input processing applies it before queueing, the simulator through add_request)."""
    if n == 0:
        return "empty prompt"
    if n + 1 > max_model_len:
        return (f"prompt of {n} tokens + 1 output token exceeds max_model_len {max_model_len} "
                f"(the longest prompt + output this engine serves)")
    need = -(-(n + 1) // block_size)
    if need > num_blocks:
        return (f"prompt of {n} tokens + 1 output token needs {need} KV blocks of {block_size} tokens; "
                f"the whole cache has {num_blocks} blocks ({num_blocks * block_size} tokens): the prompt does "
                f"not fit the whole KV cache")
    return None


class _Seq(ScheduledSeq):
    """A running request's batch entry, kept and reused from step to step: a Batch's entries
    keep what was scheduled until the next schedule(). Between steps computed ==
    request.num_computed_tokens and total == request.num_tokens; slots == len(block_table) *
    block_size; stop_at is the total at which the request ends by length; stops the token ids
    that end it (None: none)."""
    __slots__ = ("computed", "total", "stop_at", "stops", "plen", "slots")


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_swap_blocks: int, *,
                 admission: str = "chunk") -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission is one of {ADMISSIONS}, not {admission!r}")
        self.whole = admission == "whole"
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.block_size = config.block_size
        self.kv = KVManager(num_blocks, config.block_size, num_swap_blocks)
        self.waiting: deque[Request] = deque()
        self._run: list[_Seq] = []                    # running requests, oldest first
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}       # unfinished, by id
        self.stats = SchedulerStats()
        self.computed_tokens = 0                      # sum of num_computed over device-resident requests
        self._done_early: list[Request] = []          # finished inside schedule(); returned by update()
        self._preempted = False                       # a preemption happened in this schedule()
        self._apply(config)

    def _apply(self, config: EngineConfig) -> None:
        self.config = config
        self.reserve_blocks = int(config.watermark * self.num_blocks)

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Request) -> None:
        why = prompt_rejection(req.num_tokens, self.config.max_model_len, self.num_blocks, self.block_size)
        if why is None and req.request_id in self.requests:
            why = f"duplicate request id {req.request_id}"
        if why is not None:
            req.status, req.finish_reason, req.error = FINISHED, FinishReason.REJECTED, why
            self.stats.rejected += 1
            raise RequestRejected(why)
        req.status = WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def running(self) -> list[Request]:
        return [s.request for s in self._run]

    @property
    def num_running(self) -> int:
        return len(self._run)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self._run or self.swapped)

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, now: float | None = None) -> Request | None:
        """Finish a request from outside (stop string, client gone): frees all it holds."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RUNNING:
            self._run = [s for s in self._run if s.request is not req]
        elif req.status is SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req, reason, now)
        return req

    def _release(self, req: Request, reason: FinishReason, now: float | None) -> None:
        if self.kv.on_device(req):
            self.computed_tokens -= req.num_computed_tokens
        self.kv.free(req)
        del self.requests[req.request_id]
        req.status, req.finish_reason = FINISHED, reason
        if now is not None:
            req.finished_s = now
        self.stats.finished += 1

    # ------------------------------------------------------------------ live knobs
    def update_config(self, **knobs) -> EngineConfig:
        """Apply live knobs all at once (validated together), or none; restart knobs are refused."""
        restart = sorted(set(knobs) - LIVE_KNOBS)
        if restart:
            raise ConfigError(f"{', '.join(restart)}: not a live knob (needs a restart or is unknown); "
                              f"live knobs: {', '.join(sorted(LIVE_KNOBS))}")
        new = self.config.with_changes(**knobs)
        if self.config.enable_prefix_caching and not new.enable_prefix_caching:
            self.kv.clear_cache()
        self._apply(new)
        return new

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> Batch:
        seqs: list[ScheduledSeq] = []
        batch = Batch(seqs=seqs)
        if not (self._run or self.waiting or self.swapped):
            return batch
        cfg, bs, kv = self.config, self.block_size, self.kv
        chunked = cfg.enable_chunked_prefill
        budget = cfg.max_num_batched_tokens
        run = self._run
        self._preempted = False
        ctx = 0

        # 1. running requests: decodes and prefill chunks. Preemption pops from the end of `run`
        #    (or pops the current entry when it is the last), so plain iteration stays valid.
        append = seqs.append
        for seq in run:
            start = seq.computed
            n = seq.total - start
            if n == 1 and budget:                                  # a decode: the common case
                if start >= seq.slots:                             # its last block is full
                    if kv.grow_one(seq.block_table):
                        seq.slots += bs
                    elif not self._grow(seq, 1, batch, now):
                        break
                seq.start_pos = start
                seq.num_tokens = 1
                seq.sample = True
                append(seq)
                budget -= 1
                ctx += start + 1
                continue
            if not budget:
                break
            if n > budget:                                         # a prefill chunk
                if not chunked:
                    continue
                n = budget
            table = seq.block_table
            if start + n > len(table) * bs and not self._grow(seq, (start + n + bs - 1) // bs - len(table),
                                                               batch, now):
                break
            seq.start_pos = start
            seq.num_tokens = n
            seq.sample = start + n == seq.total
            append(seq)
            budget -= n
            if n == 1:
                ctx += start + 1
        preempted = self._preempted

        # 2. swapped requests, then 3. waiting requests
        cause = "none"
        if preempted:
            if self.swapped or self.waiting:
                cause = "kv_blocks"
        else:
            if self.swapped:
                cause, budget, ctx = self._admit(self.swapped, True, now, batch, budget, ctx)
            if cause == "none" and self.waiting:
                cause, budget, ctx = self._admit(self.waiting, False, now, batch, budget, ctx)
        self.stats.record_step(cause)
        batch.num_batched_tokens = cfg.max_num_batched_tokens - budget
        batch.num_decode_context_tokens = ctx
        self.stats.scheduled_tokens += batch.num_batched_tokens
        return batch

    def _grow(self, seq: _Seq, need: int, batch: Batch, now: float) -> bool:
        """Give a running request `need` more blocks, preempting the newest running requests
        (never ones already scheduled this step) until they fit. False when `seq` itself had to
        go: preempted, or finished because even alone it outgrows the whole cache."""
        kv = self.kv
        if need > kv.num_allocatable:
            run = self._run
            while need > kv.num_allocatable and run[-1] is not seq:
                self._preempt(run.pop().request, batch)
                self._preempted = True
            if need > kv.num_allocatable:
                run.pop()                        # `seq` itself, now the newest running request
                req = seq.request
                if run:
                    self._preempt(req, batch)
                else:                            # alone and still too big: the cache cannot hold it
                    req.error = (f"KV cache full: {seq.total} tokens need more than the "
                                 f"{self.num_blocks} blocks of {self.block_size} tokens")
                    self.stats.cache_limit_finishes += 1
                    self._release(req, FinishReason.LENGTH, now)
                    self._done_early.append(req)
                return False
        kv.grow(seq.block_table, need)
        seq.slots += need * self.block_size
        return True

    def _new_seq(self, req: Request, table: list[int], computed: int) -> _Seq:
        seq = _Seq(req, computed, 0, table, False)
        seq.computed = computed
        seq.slots = len(table) * self.block_size
        plen = seq.plen = len(req.prompt_token_ids)
        seq.total = plen + len(req.output_token_ids)
        sp = req.sampling
        seq.stop_at = min(plen + sp.max_tokens, self.config.max_model_len)
        stops = set(sp.stop_token_ids)
        if req.eos_token_id is not None and not sp.ignore_eos:
            stops.add(req.eos_token_id)
        seq.stops = stops or None
        return seq

    def head_need(self, req: Request, swapped: bool) -> tuple[list[int], int, int, int]:
        """What the queue head would take now: (prefix-hit blocks, computed tokens, tokens left to
        compute, allocatable blocks it consumes)."""
        bs = self.block_size
        total = len(req.prompt_token_ids) + len(req.output_token_ids)
        if swapped:
            held = self.kv.num_host_blocks(req)
            computed = req.num_computed_tokens
            return [], computed, total - computed, held + max(0, -(-total // bs) - held)
        hits = self.kv.cached_prefix(req) if self.config.enable_prefix_caching else []
        computed = len(hits) * bs
        return hits, computed, total - computed, self.kv.blocks_to_take(hits, -(-total // bs) - len(hits))

    def _admit(self, queue: deque, swapped: bool, now: float, batch: Batch, budget: int, ctx: int):
        cfg, bs, kv = self.config, self.block_size, self.kv
        run = self._run
        max_seqs, chunked = cfg.max_num_seqs, cfg.enable_chunked_prefill
        caching = cfg.enable_prefix_caching
        while queue:
            req = queue[0]
            if len(run) >= max_seqs:
                return "max_num_seqs", budget, ctx
            if budget <= 0:
                return "token_budget", budget, ctx
            total = len(req.prompt_token_ids) + len(req.output_token_ids)
            if swapped:
                hits, computed = [], req.num_computed_tokens
                held = kv.num_host_blocks(req)
            else:
                hits = kv.cached_prefix(req) if caching else []
                held = len(hits)
                computed = held * bs
            n = total - computed
            if n > budget:
                if not chunked:
                    return "token_budget", budget, ctx
                n = budget
            new_blocks = max(0, (computed + n + bs - 1) // bs - held)
            take = (held + new_blocks) if swapped else kv.blocks_to_take(hits, new_blocks)
            avail = kv.num_allocatable
            if self.whole and not swapped and n < total - computed:  # the gate: the whole sequence
                gate = kv.blocks_to_take(hits, -(-total // bs) - held)
            else:
                gate = take
            if gate > avail:
                return "kv_blocks", budget, ctx
            if run and take > avail - self.reserve_blocks:
                return "watermark", budget, ctx
            queue.popleft()
            if swapped:
                batch.swap_in += kv.swap_in(req)
                table = kv.table(req)
                if new_blocks:
                    kv.grow(table, new_blocks)
            else:
                table = kv.admit(req, hits, new_blocks)
                req.num_computed_tokens = computed
                if caching:
                    self.stats.prefix_query_tokens += len(req.prompt_token_ids)
                    self.stats.prefix_hit_tokens += computed
                    if req.num_preemptions == 0:
                        req.num_cached_tokens = computed
                if req.first_scheduled_s is None:
                    req.first_scheduled_s = now
            self.computed_tokens += computed
            req.status = RUNNING
            seq = self._new_seq(req, table, computed)
            seq.num_tokens = n
            seq.sample = computed + n == total
            run.append(seq)
            batch.seqs.append(seq)
            budget -= n
            if n == 1:
                ctx += total
        return "none", budget, ctx

    def _preempt(self, req: Request, batch: Batch) -> None:
        kv = self.kv
        self.computed_tokens -= req.num_computed_tokens
        req.num_preemptions += 1
        if self.num_swap_blocks:
            if kv.can_swap_out(req):
                batch.swap_out += kv.swap_out(req)
                req.status = SWAPPED
                self.swapped.appendleft(req)
                self.stats.preemptions["swap"] += 1
                return
            self.stats.swap_full += 1
        kv.free(req)
        req.num_computed_tokens = 0
        req.status = WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions["recompute"] += 1

    # ------------------------------------------------------------------ after the runner
    def update(self, batch: Batch, out: StepOutput, now: float) -> list[Request]:
        """Apply a step's results; returns the requests that finished in this step (including any
        the scheduler had to end inside schedule())."""
        if len(out.tokens) != len(batch.seqs):
            raise ValueError(f"the runner returned {len(out.tokens)} tokens for {len(batch.seqs)} sequences")
        finished, self._done_early = self._done_early, []
        kv = self.kv
        caching = self.config.enable_prefix_caching
        running = RUNNING
        self.computed_tokens += batch.num_batched_tokens
        for seq, tok in zip(batch.seqs, out.tokens):
            req = seq.request
            if req.status is not running:        # finished or aborted while the step ran
                self.computed_tokens -= seq.num_tokens
                continue
            start = seq.start_pos
            end = seq.computed = req.num_computed_tokens = start + seq.num_tokens
            if caching and start < seq.plen:
                kv.commit(req, end)
            if tok is None:                       # a prefill chunk that does not end the prompt
                if seq.sample:
                    raise ValueError(f"the runner sampled no token for {req.request_id}")
                continue
            out_ids = req.output_token_ids
            if not out_ids:
                req.first_token_s = now
            out_ids.append(tok)
            req.last_token_s = now
            total = seq.total = seq.total + 1
            if total >= seq.stop_at:
                reason = FinishReason.LENGTH
            elif seq.stops is not None and tok in seq.stops:
                reason = FinishReason.STOP
            else:
                continue
            self._release(req, reason, now)
            finished.append(req)
        if finished:
            self._run = [s for s in self._run if s.request.status is RUNNING]
        return finished

    # ------------------------------------------------------------------ what it reports
    @property
    def kv_usage_ratio(self) -> float:
        return self.kv.num_used / self.num_blocks

    @property
    def internal_fragmentation_ratio(self) -> float:
        used = self.kv.num_used
        if not used:
            return 0.0
        return (self.kv.num_table_blocks * self.block_size - self.computed_tokens) / (used * self.block_size)

    @property
    def swap_usage_ratio(self) -> float:
        if not self.num_swap_blocks:
            return 0.0
        return 1.0 - self.kv.num_free_swap_blocks / self.num_swap_blocks

    def block_counts(self) -> dict[str, int]:
        """Blocks by state, a partition of the pool: free (unreserved), reserved (free blocks held
        back by the watermark), used (referenced), cached (idle, reusable, evictable)."""
        kv = self.kv
        free = kv.num_free
        reserved = min(free, self.reserve_blocks)
        return {"free": free - reserved, "reserved": reserved, "used": kv.num_used,
                "cached": kv.num_cached_idle}

    def snapshot(self) -> dict:
        """JSON-able state for the admin API: config, blocks, queues, the head and why it waits."""
        kv = self.kv
        head = None
        queue, swapped = (self.swapped, True) if self.swapped else (self.waiting, False)
        if queue:
            req = queue[0]
            hits, computed, left, take = self.head_need(req, swapped)
            head = {"request_id": req.request_id, "queue": "swapped" if swapped else "waiting",
                    "prompt_tokens": req.num_prompt_tokens, "cached_tokens": computed if not swapped else 0,
                    "needed_tokens": left, "needed_blocks": take,
                    "waited_steps_cause": self.stats.last_cause}
        return {
            "config": self.config.model_dump(),
            "num_blocks": self.num_blocks,
            "num_swap_blocks": self.num_swap_blocks,
            "blocks": self.block_counts(),
            "allocatable_blocks": max(0, kv.num_allocatable - self.reserve_blocks),
            "shared_blocks": kv.num_shared,
            "queues": {"running": len(self._run), "waiting": len(self.waiting),
                       "swapped": len(self.swapped)},
            "head": head,
            "waiting_cause": self.stats.last_cause,
            "kv_usage_ratio": self.kv_usage_ratio,
            "internal_fragmentation_ratio": self.internal_fragmentation_ratio,
            "swap_usage_ratio": self.swap_usage_ratio,
            **self.stats.as_dict(),
        }

    def check(self) -> None:
        """All invariants (tests)."""
        running = self.running
        ids = [r.request_id for q in (running, self.waiting, self.swapped) for r in q]
        assert len(ids) == len(set(ids)) == len(self.requests), "a request is in two queues or none"
        for s in self._run:
            r = s.request
            assert r.status is RUNNING
            assert s.computed == r.num_computed_tokens and s.total == r.num_tokens, "stale batch entry"
            assert s.block_table is self.kv.table(r), "batch entry and KV manager disagree on the table"
            assert s.slots == len(s.block_table) * self.block_size
        for r in self.waiting:
            assert r.status is WAITING and not self.kv.on_device(r) and not self.kv.is_swapped(r)
        for r in self.swapped:
            assert r.status is SWAPPED and self.kv.is_swapped(r)
        assert all(self.kv.on_device(r) for r in running) and self.kv.num_tables == len(running)
        assert self.computed_tokens == sum(r.num_computed_tokens for r in running)
        self.kv.check({r: r.num_computed_tokens for r in (*running, *self.swapped)})
