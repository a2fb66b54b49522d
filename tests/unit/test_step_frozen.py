"""The runner receives an immutable description of each step (core/batch.py `Step`): what it holds
does not change when the scheduler moves on (block tables grow in place, tokens are appended), and
it cannot be changed by the runner."""
from __future__ import annotations

import dataclasses

import pytest

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.batch import StepOutput
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.core.scheduler import Scheduler


def test_a_frozen_step_keeps_what_was_scheduled():
    cfg = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(cfg, num_blocks=32, num_swap_blocks=0)
    a = Request(list(range(10, 26)), SamplingParams(max_tokens=20, ignore_eos=True))  # 16 tokens: 2 full blocks
    s.add_request(a)
    s.update(b := s.schedule(0.0), StepOutput([7 if x.sample else None for x in b.seqs], 0.0), 0.0)
    batch = s.schedule(1.0)                      # the decode of token 7 at position 16 needs a 3rd block
    step = batch.freeze()
    (seq,) = step.seqs
    assert (seq.start_pos, seq.num_tokens, seq.token_ids, seq.sample) == (16, 1, (7,), True)
    table = seq.block_table
    assert len(table) == 3
    for k in range(8):                           # the scheduler moves on: the table grows in place
        s.update(batch, StepOutput([9] * len(batch.seqs), 0.0), 2.0 + k)
        batch = s.schedule(3.0 + k)
    assert len(batch.seqs[0].block_table) == 4 and batch.seqs[0] is not seq
    assert seq.block_table == table and len(table) == 3 and seq.token_ids == (7,) and seq.start_pos == 16
    assert isinstance(step.seqs, tuple) and isinstance(seq.block_table, tuple)
    with pytest.raises(AttributeError):
        seq.start_pos = 0
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        step.num_batched_tokens = 0


def test_a_prefill_chunk_after_outputs_carries_its_own_tokens():
    """A recomputed request (preempted after it produced tokens) prefills prompt + outputs."""
    cfg = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(cfg, num_blocks=32, num_swap_blocks=0)
    r = Request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), output_token_ids=[4, 5])
    s.add_request(r)
    (seq,) = s.schedule(0.0).freeze().seqs
    assert seq.token_ids == (1, 2, 3, 4, 5) and seq.num_tokens == 5 and seq.start_pos == 0
