"""One engine step's timing and shape: what the cost fit reads and the observation carries (a leaf,
so that both can import it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepSample:
    """Engine step timing: one step, or the mean of ``weight`` steps (a histogram's sum/count).

    ``context_tokens``: sum of the context lengths of the step's decodes; ``prefill_pairs``: causal
    (query, key) pairs of its prefill chunks; ``swapped_bytes``: bytes copied in or out of the swap
    pool. Unknown figures stay 0 (the fit then leaves their term out). ``t_s``: when it ran (a step's
    start, an interval's midpoint) in the trace's clock, for the machine's speed over time (None: unknown)."""
    duration_s: float
    batched_tokens: float
    context_tokens: float = 0.0
    weight: float = 1.0
    prefill_pairs: float = 0.0
    swapped_bytes: float = 0.0
    t_s: float | None = None
