"""vLLM V1's scheduling policy as the simulator's config, to predict a vLLM server.

Our scheduler already shares V1's rules: FCFS with running requests first (decodes and prefill
chunks within the token budget), the newest running request preempted when a block is missing, no
admission in a step that preempted, a waiting request admitted when its next chunk's blocks can be
allocated. What differs is fixed by config here: V1 always chunks prefills, preempts by recompute
only (no swap: its CPU offloading is a cache tier, not a preemption target), and keeps no watermark
reserve unless ``--watermark`` says so. It admits a waiting request only when blocks for its whole
sequence are free (``scheduler_reserve_full_isl``, on by default in vLLM 0.32), though it allocates
just the chunk's: ``ADMISSION``, for ``simulate(..., admission=ADMISSION)``. And its queue time (``vllm:request_queue_time_seconds``) starts
when the engine core takes the request in between two steps, not at its arrival: ``QUEUE_CLOCK``, for
``simulate(..., queue_clock=QUEUE_CLOCK)``.
"""
from __future__ import annotations

from ..config import EngineConfig

#: where vLLM's queue time starts (``simulate``'s ``queue_clock``): at intake, between two steps
QUEUE_CLOCK = "intake"
#: how it admits waiting requests (``simulate``'s ``admission``): the whole sequence must fit
ADMISSION = "whole"


def vllm_v1_config(config: EngineConfig, watermark: float = 0.0) -> EngineConfig:
    """The config under which our scheduler behaves as vLLM V1 with ``config``'s knobs."""
    return config.with_changes(enable_chunked_prefill=True, swap_space=0.0, watermark=watermark)
