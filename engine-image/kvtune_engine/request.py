"""A request as the scheduler sees it: token ids, progress, sampling parameters; no text, no torch.

A leaf module (imports nothing of the engine): the KV layer (kv/) and the scheduler (core/) both
name `Request`, and neither package imports the other for it.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # eos, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or max_model_len reached
    ABORT = "abort"        # client went away
    REJECTED = "rejected"  # can never fit; see Request.error
    ERROR = "error"        # an internal error while handling this request only; see Request.error


#: Temperatures below this are greedy (dividing logits by a denormal overflows to inf/nan).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling (OpenAI / vLLM meanings). Validated by the server, used by the runner."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1              # -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token
    presence_penalty: float = 0.0     # OpenAI: subtracted once from each token already in the output
    frequency_penalty: float = 0.0    # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # vLLM/HF: logits of prompt and output tokens divided (>0) or multiplied
    min_tokens: int = 0               # end-of-sequence and stop token ids are masked until this many outputs
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    #: deliver the finished output alone (a client that does not stream): no per-step output is built or
    #: handed to the server, whose event loop would wake once per step for each such request
    final_only: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler has to change this request's logits before choosing a token."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    eos_token_id: int | None = None
    prefix_group: str | None = None  # trace shape only (never text)
    cache_salt: str | None = None    # requests with different salts never share prefix-cache blocks

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_cached_tokens: int = 0       # of the prompt, found in the prefix cache at admission
    finish_reason: FinishReason | None = None
    error: str | None = None         # why it was rejected
    # timestamps (engine clock: wall time in the engine, virtual time in the simulator)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
