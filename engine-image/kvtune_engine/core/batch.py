"""What the scheduler hands a runner each step, and what the runner hands back.

One small interface, two implementations: the model runner (torch) and the simulated runner (a cost
model in virtual time). The scheduler never knows which one it drives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start_pos: int            # position of the first token computed this step (= tokens already cached)
    num_tokens: int           # tokens computed this step: a prefill chunk, or 1 for a decode
    block_table: list[int]    # physical block ids covering positions [0, start_pos + num_tokens)
    sample: bool              # True when this step ends the prompt (or is a decode): sample one token

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos:self.start_pos + self.num_tokens]

    def slot_mapping(self, block_size: int) -> list[int]:
        """Cache slot of each computed token: block_table[pos // bs] * bs + pos % bs."""
        bt = self.block_table
        return [bt[p // block_size] * block_size + p % block_size
                for p in range(self.start_pos, self.start_pos + self.num_tokens)]


@dataclass(slots=True)
class Batch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host block, device block)
    num_batched_tokens: int = 0
    num_decode_context_tokens: int = 0  # sum of context lengths of the decodes (cost model input)

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class StepOutput:
    """tokens[i] is the token sampled for batch.seqs[i] (None where seq.sample is False)."""
    tokens: list[int | None]
    duration_s: float
    logprobs: list[object | None] | None = None  # runner-specific (top-N per sampled token)
    # batch.seqs index -> why sampling failed for that request alone (its token is a placeholder)
    failed: dict[int, str] = field(default_factory=dict)


class Runner(Protocol):
    def execute(self, batch: Batch) -> StepOutput: ...
