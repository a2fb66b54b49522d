"""The requests still in the engine when a window is read, as trace records a replay can run.

The engine's trace records finished requests only. Under a deep queue those are the survivors: the
window's trace then arrives at the rate the current config *served*, not the rate it was *offered*,
and every candidate's replay of it looks as good as the current one (a queue that never builds in
the replay cannot be relieved). So the unfinished requests (the engine's ``unfinished`` trace
entries: arrival, prompt, ``generated_tokens`` so far, the ``max_tokens`` cap) join the trace with
an estimated output length: the median of the finished outputs longer than what the request has
already generated (a request that ran g tokens is one of those), at least g + 1, at most its cap.
Estimated records say so (``estimated: True``, with their ``generated_tokens``); the window's own
figures never count them. ``in_engine`` turns them into the queue a change now would start from.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from kvtune_engine.sim.trace import HASH_BLOCK, TraceRequest


def estimated_output(generated: int, cap: int | None, finished_outputs: Sequence[int]) -> int:
    """The output length of a request that has generated ``generated`` tokens of at most ``cap``,
    from the sorted output lengths of finished requests (see the module docstring)."""
    longer = finished_outputs[bisect.bisect_right(finished_outputs, generated):]
    guess = longer[len(longer) // 2] if longer else generated + 1
    lo = generated + 1 if not cap else min(generated + 1, cap)
    return max(lo, min(guess, cap) if cap else guess)


def with_unfinished(finished: Iterable[Mapping[str, Any]], unfinished: Iterable[Mapping[str, Any]]
                    ) -> list[dict[str, Any]]:
    """``finished`` trace records and the ``unfinished`` entries as records with an estimated
    ``output_tokens``, in arrival order."""
    done = [dict(r) for r in finished]
    outs = sorted(int(r.get("output_tokens") or 0) for r in done if r.get("output_tokens"))
    for e in unfinished:
        g = int(e.get("generated_tokens") or 0)
        cap = e.get("max_tokens")
        rec = {k: v for k, v in e.items() if k != "max_tokens"}
        rec.update(output_tokens=estimated_output(g, int(cap) if cap else None, outs), estimated=True)
        done.append(rec)
    return sorted(done, key=lambda r: float(r.get("arrival_s", 0.0)))


def in_engine(records: Iterable[Any]) -> list[TraceRequest]:
    """The estimated records (requests still in the engine when the window was read) as the queue a
    change would start from: all there at time 0, each with the output it has left to generate."""
    out = []
    for r in records:  # TraceRequests (a simulated window) are never estimated
        if isinstance(r, Mapping) and r.get("estimated"):
            left = max(1, int(r["output_tokens"]) - int(r.get("generated_tokens") or 0))
            group = r.get("prefix_group")
            out.append(TraceRequest(0.0, int(r["prompt_tokens"]), left, group,
                                    int(r.get("prefix_tokens") or 0) if group else 0,
                                    tuple(r.get("hash_ids") or ()), int(r.get("hash_block") or HASH_BLOCK)))
    return out


@dataclass(frozen=True)
class WindowTrace:
    """A window's trace read from the engine (``/kvtune/v1/trace?unfinished=true`` from one window
    before ``start``): what the window's figures count and what its replays run."""
    finished: list[dict[str, Any]]  # finished, arrived in the window: the observation's lengths
    trace: list[dict[str, Any]]     # arrived in the window, unfinished ones estimated: the replays
    lead: list[dict[str, Any]]      # arrived before it (the backlog it inherited is among them)
    start: float

    @classmethod
    def split(cls, got: Mapping[str, Any], start: float) -> "WindowTrace":
        def arrival(r: Mapping[str, Any]) -> float:
            return float(r.get("arrival_s", 0.0))
        done = got.get("requests", [])
        recent = with_unfinished(done, got.get("unfinished", []))
        return cls([r for r in done if arrival(r) >= start], [r for r in recent if arrival(r) >= start],
                   [r for r in recent if arrival(r) < start], start)
