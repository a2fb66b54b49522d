"""What the scheduler hands a runner each step, and what the runner hands back.

One small interface, two implementations: the model runner (torch) and the simulated runner (a cost
model in virtual time). The scheduler never knows which one it drives.

`Batch` is the scheduler's working record: its entries are the scheduler's own per-request objects,
reused and changed from step to step. `Batch.freeze()` gives the runner the step as an immutable
`Step` (tuples all the way down: token ids, positions, block tables as they are now), so the model
can run while the scheduler moves on; both have the fields a runner reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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


class SeqStep(NamedTuple):
    """One sequence of a frozen step (the fields of ScheduledSeq, with tuples for lists)."""
    request: Request           # for the sampler's per-request parameters and generator
    start_pos: int
    num_tokens: int
    block_table: tuple[int, ...]
    sample: bool
    token_ids: tuple[int, ...]  # the tokens computed this step


class Step(NamedTuple):
    """A step as the runner receives it: immutable, independent of the scheduler's records."""
    seqs: tuple[SeqStep, ...]
    swap_out: tuple[tuple[int, int], ...]
    swap_in: tuple[tuple[int, int], ...]
    num_batched_tokens: int
    num_decode_context_tokens: int

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


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

    def freeze(self) -> Step:
        """This step as an immutable Step (copies what the scheduler will change later)."""
        seqs = []
        append = seqs.append
        for s in self.seqs:
            r, p, n = s.request, s.start_pos, s.num_tokens
            prompt = r.prompt_token_ids
            np_ = len(prompt)
            if n == 1:
                toks = (prompt[p] if p < np_ else r.output_token_ids[p - np_],)
            elif p + n <= np_:
                toks = tuple(prompt[p:p + n])
            else:
                toks = tuple((prompt + r.output_token_ids)[p:p + n])
            append(SeqStep(r, p, n, tuple(s.block_table), s.sample, toks))
        return Step(tuple(seqs), tuple(self.swap_out), tuple(self.swap_in), self.num_batched_tokens,
                    self.num_decode_context_tokens)


@dataclass(slots=True)
class StepOutput:
    """tokens[i] is the token sampled for batch.seqs[i] (None where seq.sample is False)."""
    tokens: list[int | None]
    duration_s: float
    logprobs: list[object | None] | None = None  # runner-specific (top-N per sampled token)
    # batch.seqs index -> why sampling failed for that request alone (its token is a placeholder)
    failed: dict[int, str] = field(default_factory=dict)


class Runner(Protocol):
    def execute(self, batch: Batch | Step) -> StepOutput: ...
