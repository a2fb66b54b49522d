"""The simulated runner: implements the Runner protocol with a cost model, in virtual time.

It never sleeps and never computes: a step's duration comes from `Profile.step_time`, and every
sampled token is `token_id` (simulated requests have no eos, so they stop at max_tokens).
"""
from __future__ import annotations

from ..core.batch import Batch, Step, StepOutput
from .profile import Profile


class SimulatedRunner:
    def __init__(self, profile: Profile, block_bytes: int, token_id: int = 0) -> None:
        self.profile = profile
        self.block_bytes = block_bytes
        self.token_id = token_id
        self.steps = 0
        self.busy_s = 0.0

    def execute(self, batch: Batch | Step) -> StepOutput:
        seqs = batch.seqs
        tok = self.token_id
        pairs = 0.0
        if batch.num_batched_tokens == len(seqs):          # one token each: no prefill attention
            tokens: list[int | None] = [tok if s.sample else None for s in seqs]
        else:
            tokens = []
            for s in seqs:
                n = s.num_tokens
                if n > 1:   # causal prefill chunk: query j attends start_pos + j + 1 keys
                    pairs += n * s.start_pos + n * (n + 1) / 2
                tokens.append(tok if s.sample else None)
        swapped = (len(batch.swap_in) + len(batch.swap_out)) * self.block_bytes
        t = self.profile.step_time(batch.num_batched_tokens, batch.num_decode_context_tokens, pairs, swapped)
        self.steps += 1
        self.busy_s += t
        return StepOutput(tokens=tokens, duration_s=t)
