"""Scheduler counters: plain attributes, cheap to read from a /metrics handler at any time.

Waiting causes (`CAUSES`): every scheduled step records, for the head of the queue of requests that
are not running (the swapped queue first, since swapped requests return before new admissions,
else the waiting queue), the first limit that stopped it:

    max_num_seqs   running sequences already at the cap
    token_budget   the step's max_num_batched_tokens is used up (or, without chunked prefill,
                   too small for the head's whole prompt this step)
    kv_blocks      not enough allocatable blocks (free + evictable cached), even without the
                   watermark; also every step in which a running request had to be preempted
    watermark      it would fit but for the watermark reserve
    none           nothing waits (queue empty, or every queued request was admitted)
"""
from __future__ import annotations

CAUSES = ("none", "max_num_seqs", "token_budget", "kv_blocks", "watermark")
PREEMPTION_MODES = ("swap", "recompute")
RECENT_STEPS = 1024


class SchedulerStats:
    """Monotonic counters (Prometheus `_total` style) plus a window of the most recent causes."""

    __slots__ = ("steps", "cause_steps", "last_cause", "recent_causes", "_ring", "_ring_pos",
                 "preemptions", "swap_full", "prefix_query_tokens", "prefix_hit_tokens",
                 "rejected", "cache_limit_finishes", "scheduled_tokens", "finished")

    def __init__(self) -> None:
        self.steps = 0
        self.cause_steps: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.last_cause = "none"
        self.recent_causes: dict[str, int] = dict.fromkeys(CAUSES, 0)  # over the last RECENT_STEPS
        self._ring: list[str | None] = [None] * RECENT_STEPS
        self._ring_pos = 0
        self.preemptions: dict[str, int] = dict.fromkeys(PREEMPTION_MODES, 0)
        self.swap_full = 0             # swap wanted (a swap pool exists) but it had no room
        self.prefix_query_tokens = 0   # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0     # of those, found cached
        self.rejected = 0              # requests that could never fit
        self.cache_limit_finishes = 0  # a lone request outgrew the whole cache: finished (length)
        self.scheduled_tokens = 0
        self.finished = 0

    def record_step(self, cause: str, steps: int = 1) -> None:
        self.steps += steps
        self.cause_steps[cause] += steps
        self.last_cause = cause
        ring, recent = self._ring, self.recent_causes
        if steps >= RECENT_STEPS:
            for c in recent:
                recent[c] = 0
            recent[cause] = RECENT_STEPS
            self._ring = [cause] * RECENT_STEPS
            self._ring_pos = 0
            return
        pos = self._ring_pos
        for _ in range(steps):
            old = ring[pos]
            if old is not None:
                recent[old] -= 1
            ring[pos] = cause
            recent[cause] += 1
            pos += 1
            if pos == RECENT_STEPS:
                pos = 0
        self._ring_pos = pos

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "waiting_cause_steps": dict(self.cause_steps),
            "last_waiting_cause": self.last_cause,
            "recent_waiting_cause_steps": dict(self.recent_causes),
            "preemptions": {**self.preemptions, "swap_full": self.swap_full},
            "prefix_cache": {"query_tokens": self.prefix_query_tokens, "hit_tokens": self.prefix_hit_tokens},
            "rejected": self.rejected,
            "cache_limit_finishes": self.cache_limit_finishes,
            "scheduled_tokens": self.scheduled_tokens,
            "finished": self.finished,
        }
