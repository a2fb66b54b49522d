"""ModelRunner and Sampler: sizing, memory picture, block moves, flat inputs, per-request sampling."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.batch import Batch, ScheduledSeq
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.kv.sizing import GIB
from kvtune_engine.model import ModelLoadError
from kvtune_engine.runner import ModelRunner, Sampler


def cfg(**kw):
    return EngineConfig(**{**dict(block_size=16, kv_cache_memory=0.002, swap_space=0.001, max_model_len=256,
                                  max_num_batched_tokens=256), **kw})


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(tiny_model("llama"), cfg(), seed=0)


def test_sizing_and_memory_picture(runner, tiny_model):
    # 2 layers x K,V x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes/token; 16-token blocks: 8 KiB
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16
    assert runner.num_blocks == int(0.002 * GIB) // block_bytes
    assert runner.num_swap_blocks == int(0.001 * GIB) // block_bytes
    m = runner.memory
    assert set(m) == {"weights", "activations_peak", "kv_cache", "swap", "device_total"}
    assert m["kv_cache"] == runner.num_blocks * block_bytes and m["swap"] == runner.num_swap_blocks * block_bytes
    # every weight of the checkpoint, also those the CPU path keeps only as oneDNN-packed copies
    n_params = sum(t.numel() for f in tiny_model("llama").glob("*.safetensors") for t in load_file(f).values())
    assert m["weights"] == 4 * n_params and m["device_total"] > m["weights"]
    assert m["activations_peak"] is None  # not measured on CPU
    assert runner.k_cache.shape == (2, 2, runner.num_blocks, 16, 16)
    assert runner.swap_k.shape == (2, 2, runner.num_swap_blocks, 16, 16)


def test_sliding_window_longer_than_max_model_len_is_refused(tiny_model, tmp_path):
    import json
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_model("mistral"), d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "sliding_window": 128}))
    with pytest.raises(ModelLoadError, match="sliding_window 128 is smaller than max_model_len 256"):
        ModelRunner(d, cfg())
    ModelRunner(d, cfg(max_model_len=128))


def test_swap_out_and_in_move_whole_blocks(runner):
    k, v = runner.k_cache, runner.v_cache
    k[:, :, 3].normal_()
    v[:, :, 3].normal_()
    k3, v3 = k[:, :, 3].clone(), v[:, :, 3].clone()
    runner.execute(Batch(swap_out=[(3, 1)]))
    k[:, :, 3].zero_()
    runner.execute(Batch(swap_in=[(1, 7)]))
    assert torch.equal(k[:, :, 7], k3) and torch.equal(v[:, :, 7], v3)


@pytest.mark.parametrize("fold", [False, True])
def test_flat_inputs_put_decodes_first(runner, fold):
    """fold: the CPU kernel attends the prefill chunks too, one row per token over its prefix."""
    assert runner.fold_prefills  # float32 on CPU with the kernel built: the default
    runner.fold_prefills = fold
    try:
        _check_flat_inputs(runner, fold)
    finally:
        runner.fold_prefills = True


def _check_flat_inputs(runner, fold: bool) -> None:
    a = Request(list(range(40)))                 # prefill chunk [16, 40) after a cached prefix
    b = Request([5, 6, 7], output_token_ids=[8])  # decode of its output token at position 3
    c = Request([9] * 20)                         # chunk [0, 16), not sampled
    seqs = [ScheduledSeq(a, 16, 24, [4, 2, 8], True), ScheduledSeq(b, 3, 1, [6], True),
            ScheduledSeq(c, 0, 16, [1], False)]
    ids, pos, meta, order, rows = runner.prepare(seqs)
    assert order == [1, 0, 2]
    assert ids.tolist() == [8] + list(range(16, 40)) + [9] * 16
    assert pos.tolist() == [3] + list(range(16, 40)) + list(range(16))
    assert meta.slot_mapping.tolist() == ([6 * 16 + 3] + [2 * 16 + i for i in range(16)]
                                          + [8 * 16 + i for i in range(8)] + [16 + i for i in range(16)])
    if fold:
        assert meta.num_decodes == 41 and not meta.prefills
        assert meta.decode_context_lens_list == [4] + list(range(17, 41)) + list(range(1, 17))
        assert meta.decode_block_tables.tolist() == [[6, 0, 0]] + [[4, 2, 8]] * 24 + [[1, 0, 0]] * 16
    else:
        assert meta.num_decodes == 1 and meta.decode_context_lens_list == [4]
        assert [(p.start, p.num_tokens, p.start_pos) for p in meta.prefills] == [(1, 24, 16), (25, 16, 0)]
    assert rows == [24, 0]  # last row of a, then b (batch order of the sampled sequences)
    out = runner.execute(Batch(seqs=seqs))
    assert out.tokens[2] is None and isinstance(out.tokens[0], int) and isinstance(out.tokens[1], int)


def req(**sp):
    return Request([1], SamplingParams(**sp))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampler(seed=0)
    ids, lps, _ = s(logits, [req(temperature=0.0), req(temperature=1.0, top_k=1), req(temperature=2.0, top_p=1e-6),
                          req(temperature=0.0)])
    assert ids == logits.argmax(-1).tolist() and lps is None


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    s = Sampler(seed=1)
    ids, _, _ = s(logits, [req(temperature=1.0, top_k=2) for _ in range(400)])
    assert set(ids) == {0, 1}
    ids, _, _ = s(logits, [req(temperature=1.0, top_p=0.7) for _ in range(400)])  # 0.5 + 0.3 reach 0.7
    assert set(ids) == {0, 1}
    ids, _, _ = s(logits, [req(temperature=1.0) for _ in range(400)])
    assert set(ids) == {0, 1, 2, 3}
    freq0 = ids.count(0) / 400
    assert abs(freq0 - 0.5) < 0.1


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)

    def run(rows, other):
        s = Sampler(seed=other)
        r = req(temperature=1.0, seed=42)
        out = []
        for _ in range(5):  # the request's generator advances step by step
            ids, _, _ = s(logits[rows], [r if i == 0 else req(temperature=1.0) for i in range(len(rows))])
            out.append(ids[0])
        return out

    a = run([0], 1)
    assert a == run([0, 1, 2, 3], 7) == run([0, 5], 99)
    assert len(set(a)) > 1  # it does sample


def test_logprobs_top_n_of_the_raw_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    s = Sampler(seed=0)
    ids, lps, _ = s(logits, [req(temperature=0.0, logprobs=3), req(temperature=0.5), req(temperature=0.7, logprobs=0)])
    ref = torch.log_softmax(logits, -1)
    assert lps[1] is None
    assert lps[0].token_id == ids[0] and math.isclose(lps[0].logprob, ref[0, ids[0]].item(), abs_tol=1e-6)
    assert [i for i, _ in lps[0].top] == ref[0].topk(3).indices.tolist()
    assert lps[2].top == [] and math.isclose(lps[2].logprob, ref[2, ids[2]].item(), abs_tol=1e-6)


def test_sampled_tokens_follow_the_distribution_and_never_a_masked_one():
    """Frequencies over 6,000 draws within 4.5 standard deviations of each token's probability (masses
    from 0.4 down to 0.001, one token of probability 0 after top-k), and a vocabulary of 122,880."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.089, 0.01, 0.001, 0.0])
    logits = torch.log(probs).repeat(6000, 1)
    s = Sampler(seed=3)
    ids, _, _ = s(logits, [req(temperature=1.0, top_k=6) for _ in range(6000)])
    assert 6 not in ids
    for t, p in enumerate(probs.tolist()[:6]):
        sd = math.sqrt(6000 * p * (1 - p))
        assert abs(ids.count(t) - 6000 * p) <= 4.5 * sd + 1, (t, ids.count(t), p)
    big = torch.full((2, 122_880), -1e4)
    big[:, 7], big[:, 122_879] = 0.0, math.log(3.0)  # 1 : 3 at both ends of the vocabulary
    ids, _, _ = s(big.repeat(500, 1), [req(temperature=1.0) for _ in range(1000)])
    assert set(ids) == {7, 122_879} and abs(ids.count(122_879) / 1000 - 0.75) < 0.06
